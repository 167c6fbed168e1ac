#!/usr/bin/env bash
# Starts what the test suite talks to, when it is down: PostgreSQL, Redis; installs Debian's Chromium.
set -u
if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no || true
fi
# Debian packages (bubblewrap, the grader environment's python3, Chromium for the browser tests).
bash "$(dirname "$0")/system-deps.sh" --with-browser
for i in $(seq 1 30); do
  pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && exit 0
  sleep 1
done
echo "warning: PostgreSQL or Redis not reachable on 127.0.0.1" >&2
exit 0
