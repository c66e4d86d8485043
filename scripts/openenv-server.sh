#!/usr/bin/env bash
# The example OpenEnv server (examples/openenv-server): setup, serve, test.
#
#   scripts/openenv-server.sh setup                   # venv + pinned packages
#   scripts/openenv-server.sh serve [ARGS...]         # setup if needed, then the server
#   scripts/openenv-server.sh test [ARGS...]          # setup if needed, then its tests
#   scripts/openenv-server.sh client HOST:PORT [...]  # play one episode, raw frames
#
# serve passes ARGS to server.py (--listen HOST:PORT, port 0 = a free port;
# --max-concurrent-envs N; --session-timeout S; ...). Once GET /health
# answers it prints exactly one line to stdout, `listening on HOST:PORT`
# (the port actually bound); everything else goes to stderr.
#
# Needs only Python >= 3.10 (3.11 tested) with venv/pip and access to PyPI.
# The venv lives outside the repository, at $BAPO_OPENENV_VENV (default
# ~/.cache/bapo/openenv-venv). $BAPO_PYTHON picks the interpreter (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
APP="$ROOT/examples/openenv-server"
REQS="$APP/requirements.txt"
VENV="${BAPO_OPENENV_VENV:-$HOME/.cache/bapo/openenv-venv}"
PY="${BAPO_PYTHON:-python3}"
NAME=openenv-server.sh
# shellcheck source=pyvenv.sh
source "$ROOT/scripts/pyvenv.sh"

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the repository
case "$cmd" in
  setup) venv_setup ;;
  serve)
    venv_setup
    exec "$VENV/bin/python" -u "$APP/server.py" "$@" ;;
  test)
    venv_setup
    cd "$APP"
    exec "$VENV/bin/python" -u test_server.py "$@" ;;
  client)
    venv_setup
    exec "$VENV/bin/python" -u "$APP/client.py" "$@" ;;
  *) echo "usage: $0 setup | serve [server args...] | test [unittest args...] | client HOST:PORT [answers...]" >&2; exit 2 ;;
esac
