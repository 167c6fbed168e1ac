#!/usr/bin/env bash
# Builds the test-only environment that runs a real OpenEnv server (PyPI `openenv`, its server classes) for
# tests/core/test_openenv.py: $2 (default .venv-openenv) on the interpreter $1 (default python3.11). It is kept
# apart from .venv because openenv's dependencies (fastmcp 3 -> mcp 1.x, pillow 12) conflict with the service's
# pins; the service itself speaks OpenEnv's protocol with its own client (gspo_core/environments/openenv.py) and
# never imports the package. `make install` runs it; the marker file makes a second run a no-op.
set -euo pipefail
py=${1:-python3.11}
dir=${2:-.venv-openenv}
pin=${OPENENV_PIN:-openenv==0.10.0}
if [ -f "$dir/.installed" ] && [ "$(cat "$dir/.installed")" = "$pin" ]; then
  exit 0
fi
test -x "$dir/bin/python" || "$py" -m venv "$dir"
"$dir/bin/pip" install -q "$pin"
echo "$pin" > "$dir/.installed"
