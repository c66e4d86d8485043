#!/usr/bin/env bash
# The reference environment server (examples/env-server): setup, serve, test.
#
#   scripts/env-server.sh setup            # venv + pinned packages + stubs
#   scripts/env-server.sh serve [ARGS...]  # setup if needed, then the server
#   scripts/env-server.sh test             # setup if needed, then its tests
#
# It shares the reference reward server's venv (same pinned packages; its
# setup generates the stubs of proto/environment.proto too), so setup is
# scripts/reward-server.sh's: $BAPO_REWARD_VENV (default
# ~/.cache/bapo/reward-venv) and $BAPO_PYTHON work the same. The stubs are
# found by server.py through $BAPO_ENV_STUBS.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
APP="$ROOT/examples/env-server"
VENV="${BAPO_REWARD_VENV:-$HOME/.cache/bapo/reward-venv}" # as reward-server.sh

setup() { bash "$ROOT/scripts/reward-server.sh" setup; }

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  setup) setup ;;
  serve)
    setup
    export BAPO_ENV_STUBS="$VENV/stubs" PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the repo
    exec "$VENV/bin/python" -u "$APP/server.py" "$@" ;;
  test)
    setup
    export BAPO_ENV_STUBS="$VENV/stubs" PYTHONDONTWRITEBYTECODE=1
    cd "$APP"
    exec "$VENV/bin/python" -u test_envs.py "$@" ;;
  *) echo "usage: $0 setup | serve [server args...] | test [unittest args...]" >&2; exit 2 ;;
esac
