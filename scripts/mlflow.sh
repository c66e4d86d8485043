#!/usr/bin/env bash
# An MLflow tracking server for the tracking tests (issue #56): setup, serve, read.
#
#   scripts/mlflow.sh setup               # venv + pinned packages (~850 MB)
#   scripts/mlflow.sh serve [--listen HOST:PORT] DIR
#                                         # setup if needed, then a server on DIR
#   scripts/mlflow.sh read URI EXPERIMENT # one JSON object: the experiment's runs
#
# serve starts `mlflow server` on HOST:PORT (default 127.0.0.1:0; port 0 =
# a free port, retried on another should it be taken meanwhile), its
# storage under DIR (DIR/mlflow.db, a SQLite backend store, and
# DIR/artifacts, the artifact store served through
# /api/2.0/mlflow-artifacts; both kept across restarts). Once GET /health
# answers (about 10 s; a first call also builds the venv) it prints
# exactly one line to stdout, `listening on HOST:PORT` (the port bound),
# then stays in the foreground until the server exits (status 1) or it is
# stopped; everything else goes to stderr. The --listen form is the one
# tests/common's script_server passes.
#
# Stopping serve. The server is two processes below this script's own
# (`mlflow server` and the uvicorn it spawns; no worker processes with
# --workers 1), all in this script's process group; none starts a session
# or group of its own (job execution, whose job subprocesses would, is
# turned off). Any of these stops them all (each checked):
#   - kill the process group, SIGTERM or SIGKILL: start the script as a
#     group leader (Rust: Command::process_group(0); shell: setsid) and
#     signal the negative pid. The surest way;
#   - SIGTERM (or SIGINT, SIGHUP) to the script's pid alone: it stops the
#     server processes it started (found by parent links, scripts/procs.sh;
#     SIGKILL after 10 s), waits for them and exits (status 143);
#   - SIGKILL to the script's pid alone (tokio's kill_on_drop): no trap
#     runs, but a watchdog child of the script notices its parent gone
#     within a second and stops the server the same way.
# The server logs every request to stderr: a caller that pipes stderr must
# keep reading it (or send it to a file, or inherit it), or the server
# blocks once the pipe is full.
#
# read needs only python3 (the standard library; not the venv): URI is the
# server, http://HOST:PORT or HOST:PORT; EXPERIMENT its name (or its id).
# It prints {"experiment": {...}, "runs": [...]}, each run with its name,
# status, params, tags, metric histories (key -> [[step, value], ...]) and
# its artifact files (scripts/mlflow/read_run.py says more).
#
# Needs only Python >= 3.10 (3.11 tested) with venv/pip and access to PyPI.
# The venv lives outside the repository, at $BAPO_MLFLOW_VENV (default
# ~/.cache/bapo/mlflow-venv). $BAPO_PYTHON picks the interpreter (default
# python3). $BAPO_MLFLOW_START_TIMEOUT: seconds to wait for /health (120).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
APP="$ROOT/scripts/mlflow"
REQS="$APP/requirements.txt"
VENV="${BAPO_MLFLOW_VENV:-$HOME/.cache/bapo/mlflow-venv}"
PY="${BAPO_PYTHON:-python3}"
START_TIMEOUT="${BAPO_MLFLOW_START_TIMEOUT:-120}"
NAME=mlflow.sh
# shellcheck source=pyvenv.sh
source "$ROOT/scripts/pyvenv.sh"
venv_ready() { [[ -x "$VENV/bin/mlflow" ]]; }

# A free TCP port on host $1 (bound, read, released; the server binds it
# a moment later, and serve retries on another if that loses a race).
free_port() {
  "$VENV/bin/python" -c 'import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1]); s.close()' "$1"
}

healthy() {
  "$VENV/bin/python" - "$1" "$2" <<'PY' 2>/dev/null
import sys, urllib.request
try:
    with urllib.request.urlopen(f"http://{sys.argv[1]}:{sys.argv[2]}/health", timeout=2) as r:
        sys.exit(0 if r.status == 200 and r.read().strip() == b"OK" else 1)
except Exception:
    sys.exit(1)
PY
}

server=""   # the `mlflow server` this script started (uvicorn runs below it)
watchdog="" # stops it should this script be killed outright (SIGKILL)
# Alive: not gone, nor a zombie.
alive() { local st; st="$(ps -o stat= -p "$1" 2>/dev/null)" && [[ "$st" != Z* ]]; }
# Stops the server this script started: its pid and the processes below it
# (listed first: a killed parent's children are re-parented away from it);
# SIGTERM, then SIGKILL for what is left after 10 s.
stop_server() {
  if [[ -n "$watchdog" ]]; then
    kill -TERM $watchdog $(below "$watchdog") 2>/dev/null || true
    watchdog=""
  fi
  [[ -n "$server" ]] || return 0
  local pids p left
  pids="$server $(below "$server")"
  server=""
  kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 100); do
    left=""
    for p in $pids; do alive "$p" && left="$left $p"; done
    [[ -z "$left" ]] && return 0
    sleep 0.1
  done
  echo "mlflow.sh: the server did not stop in 10 s (pids$left); SIGKILL" >&2
  kill -KILL $left 2>/dev/null || true
}

# A SIGKILL to this script's pid alone (e.g. tokio's kill_on_drop) runs no
# trap: a child of ours notices its parent gone (re-parented) and stops the
# server processes in our stead.
start_watchdog() {
  local me=$$
  if [[ -n "$watchdog" ]]; then # one for each server started
    kill -TERM $watchdog $(below "$watchdog") 2>/dev/null || true
  fi
  (
    trap - EXIT TERM INT HUP
    self=$BASHPID
    while sleep 1; do
      [[ "$(ps -o ppid= -p "$self" 2>/dev/null | tr -d ' ')" == "$me" ]] && continue
      echo "mlflow.sh: killed; stopping the server it started" >&2
      watchdog=""
      stop_server
      exit 0
    done
  ) >&2 </dev/null &
  watchdog=$!
}

serve() {
  local listen="127.0.0.1:0" dir host port want tries rc
  if [[ "${1:-}" == "--listen" ]]; then
    [[ $# -ge 2 ]] || die "usage: $0 serve [--listen HOST:PORT] DIR"
    listen="$2"
    shift 2
  fi
  [[ $# -eq 1 && -n "$1" ]] || die "usage: $0 serve [--listen HOST:PORT] DIR"
  [[ "$listen" =~ ^([^:]+):([0-9]+)$ ]] || die "--listen wants HOST:PORT, not $listen"
  host="${BASH_REMATCH[1]}" want="${BASH_REMATCH[2]}"
  venv_setup
  mkdir -p "$1/artifacts" || die "cannot create $1/artifacts"
  dir="$(cd "$1" && pwd)"
  # below: the processes this script started (never anyone else's).
  source "$ROOT/scripts/procs.sh"
  trap stop_server EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  trap 'exit 129' HUP
  # No job runner (huey consumer, job subprocesses in sessions of their
  # own, a temp dir in /dev/shm) and no usage telemetry.
  export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true
  for tries in 1 2 3; do
    port="$want"
    if [[ "$port" == 0 ]]; then port="$(free_port "$host")" || die "cannot find a free port on $host"; fi
    echo "mlflow.sh: starting mlflow server on $host:$port, storage in $dir" >&2
    "$VENV/bin/mlflow" server \
      --backend-store-uri "sqlite:///$dir/mlflow.db" \
      --artifacts-destination "$dir/artifacts" \
      --host "$host" --port "$port" --workers 1 >&2 </dev/null &
    server=$!
    start_watchdog
    local deadline=$((SECONDS + START_TIMEOUT))
    while ((SECONDS < deadline)); do
      if healthy "$host" "$port"; then
        echo "listening on $host:$port"
        # In the foreground until the server exits (or a signal: the traps).
        rc=0
        wait "$server" || rc=$?
        server=""
        die "the server exited (status $rc)"
      fi
      kill -0 "$server" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "$server" 2>/dev/null; then
      stop_server
      die "the server did not answer GET /health within ${START_TIMEOUT}s (its log is above)"
    fi
    rc=0
    wait "$server" 2>/dev/null || rc=$?
    server=""
    [[ "$want" == 0 ]] || die "the server exited (status $rc; is $host:$want taken? its log is above)"
    echo "mlflow.sh: the server exited (status $rc) before answering (port $port taken?); attempt $tries of 3" >&2
  done
  die "the server did not start (its log is above)"
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the repository
case "$cmd" in
  setup) venv_setup ;;
  serve) serve "$@" ;;
  read)
    [[ $# -eq 2 ]] || die "usage: $0 read URI EXPERIMENT"
    command -v "$PY" >/dev/null || die "$PY not found: install Python 3 (or set BAPO_PYTHON)"
    exec "$PY" "$APP/read_run.py" "$@" ;;
  *) echo "usage: $0 setup | serve [--listen HOST:PORT] DIR | read URI EXPERIMENT" >&2; exit 2 ;;
esac
