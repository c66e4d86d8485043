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
STAMP="$VENV/.bapo-openenv-stamp"
PY="${BAPO_PYTHON:-python3}"

die() { echo "openenv-server.sh: error: $*" >&2; exit 1; }

# What the venv was built from: the pins.
stamp() { sha256sum <"$REQS" | cut -d' ' -f1; }

up_to_date() { [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp)" ]]; }

setup() {
  [[ -f "$REQS" ]] || die "missing $REQS"
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
  echo "openenv-server.sh: setting up $VENV" >&2
  if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV" >&2 \
      || die "cannot create a venv at $VENV (on Debian/Ubuntu: apt-get install python3-venv)"
  fi
  rm -f "$STAMP" # a failure below leaves no stamp, so the next run retries
  # Anything printed goes to stderr: serve's stdout is the server's alone.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    --only-binary :all: -r "$REQS" >&2 \
    || die "pip install failed (PyPI reachable? wheels for $("$PY" -V 2>&1) on $(uname -m)?)"
  stamp >"$STAMP"
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the repository
case "$cmd" in
  setup) setup ;;
  serve)
    setup
    exec "$VENV/bin/python" -u "$APP/server.py" "$@" ;;
  test)
    setup
    cd "$APP"
    exec "$VENV/bin/python" -u test_server.py "$@" ;;
  client)
    setup
    exec "$VENV/bin/python" -u "$APP/client.py" "$@" ;;
  *) echo "usage: $0 setup | serve [server args...] | test [unittest args...] | client HOST:PORT [answers...]" >&2; exit 2 ;;
esac
