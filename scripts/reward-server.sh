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
STAMP="$VENV/.bapo-reward-stamp"
PY="${BAPO_PYTHON:-python3}"

die() { echo "reward-server.sh: error: $*" >&2; exit 1; }

# What the venv was built from: the pins and the protos.
stamp() { cat "$REQS" "${PROTOS[@]}" | sha256sum | cut -d' ' -f1; }

up_to_date() { [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp)" ]]; }

setup() {
  for f in "$REQS" "${PROTOS[@]}"; do [[ -f "$f" ]] || die "missing $f"; done
  up_to_date && return 0
  # One build at a time (parallel test runs may all call serve); re-check
  # once the lock is ours. The subshell holds the lock, so a server that
  # is exec'd afterwards does not keep it.
  mkdir -p "$(dirname "$VENV")"
  ( flock 9 || die "cannot lock $VENV.lock"; up_to_date || build ) 9>"$VENV.lock"
}

build() {
  command -v "$PY" >/dev/null || die "$PY not found: install Python 3.11 (or set BAPO_PYTHON)"
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$PY is $("$PY" -V 2>&1); need Python >= 3.10"
  echo "reward-server.sh: setting up $VENV" >&2
  if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV" >&2 \
      || die "cannot create a venv at $VENV (on Debian/Ubuntu: apt-get install python3-venv)"
  fi
  rm -f "$STAMP" # a failure below leaves no stamp, so the next run retries
  # Anything printed goes to stderr: serve's stdout is the server's alone.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    --only-binary :all: -r "$REQS" >&2 \
    || die "pip install failed (PyPI reachable? wheels for $("$PY" -V 2>&1) on $(uname -m)?)"
  # Stubs into the venv, never into the repository.
  rm -rf "$STUBS" && mkdir -p "$STUBS"
  "$VENV/bin/python" -m grpc_tools.protoc -I "$(dirname "$PROTO")" \
    --python_out="$STUBS" --grpc_python_out="$STUBS" "${PROTOS[@]}" >&2 \
    || die "protoc failed on ${PROTOS[*]}"
  stamp >"$STAMP"
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  setup) setup ;;
  serve)
    setup
    export BAPO_REWARD_STUBS="$STUBS" PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the repo
    exec "$VENV/bin/python" -u "$APP/server.py" "$@" ;;
  test)
    setup
    export BAPO_REWARD_STUBS="$STUBS" PYTHONDONTWRITEBYTECODE=1
    cd "$APP"
    exec "$VENV/bin/python" -u test_verifiers.py "$@" ;;
  *) echo "usage: $0 setup | serve [server args...] | test [unittest args...]" >&2; exit 2 ;;
esac
