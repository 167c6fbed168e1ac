#!/usr/bin/env bash
# The Debian/Ubuntu packages the service needs, installed only when missing (idempotent; `make install`
# runs it): bubblewrap (the sandbox of `python` graders), python3 + venv (the grader environment's
# interpreter, readable by the sandbox's unprivileged uid) and python3-gdbm (dbm.gnu in that environment).
# --with-browser adds Chromium for the dashboard's browser tests (scripts/services-up.sh).
set -u
pkgs=(bubblewrap python3 python3-venv python3-gdbm)
[ "${1:-}" = "--with-browser" ] && pkgs+=(chromium)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "warning: install ${missing[*]} with your package manager (python graders are refused without bubblewrap)" >&2
  exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
if ! ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
      "${missing[@]}") >/dev/null 2>&1; then
  echo "warning: could not install ${missing[*]}" >&2
fi
exit 0
