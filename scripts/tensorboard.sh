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
PY="${BAPO_PYTHON:-python3}"
NAME=tensorboard.sh
# shellcheck source=pyvenv.sh
source "$ROOT/scripts/pyvenv.sh"

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the repository
case "$cmd" in
  setup) venv_setup ;;
  read)
    [[ $# -eq 1 && -n "$1" ]] || die "usage: $0 read LOGDIR"
    [[ -d "$1" ]] || die "$1 is not a directory"
    venv_setup
    # TensorBoard without TensorFlow says so on stderr; quiet that, and TF-style C++ logs.
    export TF_CPP_MIN_LOG_LEVEL=3
    exec "$VENV/bin/python" -u "$APP/read_events.py" "$1" ;;
  *) echo "usage: $0 setup | read LOGDIR" >&2; exit 2 ;;
esac
