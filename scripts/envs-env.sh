#!/usr/bin/env bash
# Builds the environments venv that the worker runs verifiers environments in (requirements-envs.txt, plus the
# operator's environment packages: the requirement files named after the venv) on the interpreter $1 (default
# python3.11) as $2 (default .venv-envs); `make install` runs it. Marked complete last, so an interrupted build
# is redone. See docs/environments.md.
set -euo pipefail
py=${1:-python3.11}
venv=${2:-.venv-envs}
shift $(( $# < 2 ? $# : 2 ))
test -x "$venv/bin/python" || "$py" -m venv "$venv"
"$venv/bin/pip" install -q -r requirements-envs.txt
for extra in "$@"; do
  "$venv/bin/pip" install -q -r "$extra"
done
"$venv/bin/python" -c 'import verifiers.v1'  # the runner's one import that must work
touch "$venv/.installed"
