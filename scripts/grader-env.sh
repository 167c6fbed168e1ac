#!/usr/bin/env bash
# Builds the grader environment that `python` graders run in (requirements-graders.txt, on the interpreter
# $1, default Debian's /usr/bin/python3) and makes $2 (default .venv-graders) name it; `make install` runs it.
# The sandbox's unprivileged uid must be able to read that environment. A service run as root starts its
# sandboxes under throw-away uids, which cannot read a checkout inside a private (0700) directory, such as
# a home directory or a `mktemp -d` clone: as root the environment is therefore built in GSPO_GRADER_HOME
# (default /var/lib/gspo), readable by every uid, under a name that is a hash of the requirements and the
# interpreter (checkouts of the same requirements share it), and $2 is a link to it. Any other user's
# sandboxes read the files as that user, so the environment is built in place. See docs/rewards.md.
set -euo pipefail
py=${1:-/usr/bin/python3}
link=${2:-.venv-graders}
reqs=requirements-graders.txt

build() {  # build <dir>: a venv with the pinned requirements, marked complete last
  test -x "$1/bin/python" || "$py" -m venv "$1"
  "$1/bin/pip" install -q -r "$reqs"
  touch "$1/.installed"
}

if [ "$(id -u)" -ne 0 ]; then
  build "$link"
  exit 0
fi
home=${GSPO_GRADER_HOME:-/var/lib/gspo}
key=$({ cat "$reqs"; "$py" -c 'import sys; print(sys.version)'; readlink -f "$py"; } | sha256sum | cut -c1-16)
target=$home/graders-$key
mkdir -p "$home"
chmod 0755 "$home"
exec 9>"$home/graders-$key.lock"
flock 9  # two installs at once (CI clones) build it once
if [ ! -f "$target/.installed" ]; then
  rm -rf "$target"
  (umask 022 && build "$target")
  chmod -R a+rX "$target"
fi
exec 9>&-
# An environment built in place by an earlier install gives way to the link.
if [ -d "$link" ] && [ ! -L "$link" ]; then rm -rf "$link"; fi
ln -sfn "$target" "$link"
# Every directory above it must let other uids through, or the sandbox still cannot reach it.
dir=$target
while [ "$dir" != / ]; do
  dir=$(dirname "$dir")
  if [ $(( 0$(stat -c '%a' "$dir") & 1 )) -eq 0 ]; then
    echo "warning: $dir is not searchable by other users: python graders will be refused (set GSPO_GRADER_HOME)" >&2
  fi
done
