#!/usr/bin/env bash
# The reference reward server (examples/reward-server): setup, serve, test.
#
#   scripts/reward-server.sh setup            # venv + pinned packages + stubs
#   scripts/reward-server.sh serve [ARGS...]  # setup if needed, then the server
#   scripts/reward-server.sh test             # setup if needed, then its tests
#
# Needs only Python >= 3.10 (3.11 tested) with venv/pip and access to PyPI.
# The venv lives outside the repository, at $BAPO_REWARD_VENV (default
# ~/.cache/bapo/reward-venv); the Python stubs for proto/reward.proto (and
# proto/environment.proto: scripts/env-server.sh shares this venv) are
# generated into $VENV/stubs and found by server.py through
# $BAPO_REWARD_STUBS. $BAPO_PYTHON picks the interpreter (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
APP="$ROOT/examples/reward-server"
REQS="$APP/requirements.txt"
PROTO="$ROOT/proto/reward.proto"
# Stubs for the environment server too (examples/env-server), same packages.
PROTOS=("$PROTO" "$ROOT/proto/environment.proto")
VENV="${BAPO_REWARD_VENV:-$HOME/.cache/bapo/reward-venv}"
STUBS="$VENV/stubs"
PY="${BAPO_PYTHON:-python3}"
NAME=reward-server.sh
# shellcheck source=pyvenv.sh
source "$ROOT/scripts/pyvenv.sh"

# What the venv is built from: the pins and the protos.
venv_inputs() { echo "$REQS" "${PROTOS[@]}"; }

# Stubs into the venv, never into the repository.
venv_after() {
  rm -rf "$STUBS" && mkdir -p "$STUBS"
  "$VENV/bin/python" -m grpc_tools.protoc -I "$(dirname "$PROTO")" \
    --python_out="$STUBS" --grpc_python_out="$STUBS" "${PROTOS[@]}" >&2 \
    || die "protoc failed on ${PROTOS[*]}"
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  setup) venv_setup ;;
  serve)
    venv_setup
    export BAPO_REWARD_STUBS="$STUBS" PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the repo
    exec "$VENV/bin/python" -u "$APP/server.py" "$@" ;;
  test)
    venv_setup
    export BAPO_REWARD_STUBS="$STUBS" PYTHONDONTWRITEBYTECODE=1
    cd "$APP"
    exec "$VENV/bin/python" -u test_verifiers.py "$@" ;;
  *) echo "usage: $0 setup | serve [server args...] | test [unittest args...]" >&2; exit 2 ;;
esac
