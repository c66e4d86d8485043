#!/usr/bin/env bash
# TensorBoard's own event-file reader, for the tracking tests (issue #56).
#
#   scripts/tensorboard.sh setup        # venv + pinned packages (~180 MB)
#   scripts/tensorboard.sh read LOGDIR  # setup if needed, then one JSON object
#
# read prints to stdout one JSON object: what TensorBoard loads from LOGDIR,
# each directory under it that holds event files being a run (as in
# TensorBoard; "." is LOGDIR itself):
#   {"runs": {"RUN": {"file_version": 2.0, "writer": "...", "files": [...],
#     "scalars": {"TAG": {"steps": [...], "values": [...], "wall_times": [...]}},
#     "text": {"TAG": {"steps": [...], "values": ["text" or [[cells]]], ...}},
#     "tags": {...}, "plugins": {...}}}}
# (scripts/tensorboard/read_events.py says more). Everything else goes to
# stderr; a LOGDIR without event files is an error (status 1).
#
# Needs only Python >= 3.10 (3.11 tested) with venv/pip and access to PyPI;
# not TensorFlow. The venv lives outside the repository, at
# $BAPO_TENSORBOARD_VENV (default ~/.cache/bapo/tensorboard-venv).
# $BAPO_PYTHON picks the interpreter (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
APP="$ROOT/scripts/tensorboard"
REQS="$APP/requirements.txt"
VENV="${BAPO_TENSORBOARD_VENV:-$HOME/.cache/bapo/tensorboard-venv}"
STAMP="$VENV/.bapo-tensorboard-stamp"
PY="${BAPO_PYTHON:-python3}"

die() { echo "tensorboard.sh: error: $*" >&2; exit 1; }

# What the venv was built from: the pins.
stamp() { sha256sum <"$REQS" | cut -d' ' -f1; }

up_to_date() { [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp)" ]]; }

setup() {
  [[ -f "$REQS" ]] || die "missing $REQS"
  up_to_date && return 0
  # One build at a time (parallel tests may all call read); re-check once
  # the lock is ours. The subshell holds the lock, so the reader exec'd
  # afterwards does not keep it.
  mkdir -p "$(dirname "$VENV")"
  ( flock 9 || die "cannot lock $VENV.lock"; up_to_date || build ) 9>"$VENV.lock"
}

build() {
  command -v "$PY" >/dev/null || die "$PY not found: install Python 3.11 (or set BAPO_PYTHON)"
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$PY is $("$PY" -V 2>&1); need Python >= 3.10"
  echo "tensorboard.sh: setting up $VENV" >&2
  if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV" >&2 \
      || die "cannot create a venv at $VENV (on Debian/Ubuntu: apt-get install python3-venv)"
  fi
  rm -f "$STAMP" # a failure below leaves no stamp, so the next run retries
  # Anything printed goes to stderr: read's stdout is the JSON alone.
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
  read)
    [[ $# -eq 1 && -n "$1" ]] || die "usage: $0 read LOGDIR"
    [[ -d "$1" ]] || die "$1 is not a directory"
    setup
    # TensorBoard without TensorFlow says so on stderr; quiet that, and TF-style C++ logs.
    export TF_CPP_MIN_LOG_LEVEL=3
    exec "$VENV/bin/python" -u "$APP/read_events.py" "$1" ;;
  *) echo "usage: $0 setup | read LOGDIR" >&2; exit 2 ;;
esac
