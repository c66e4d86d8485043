# The project's Python venvs, built once from pinned requirements: sourced
# by the scripts that need one (reward-server.sh, openenv-server.sh,
# tensorboard.sh, mlflow.sh). The caller sets
#   NAME   its own name, for messages;   VENV   the venv's directory;
#   REQS   the requirements file;        PY     the interpreter to build with;
# and may define
#   venv_inputs   the files the venv is built from (default: $REQS);
#   venv_ready    an extra check that the venv is whole (default: none);
#   venv_after    a step after pip install (generated stubs, say).
# A venv is up to date when its stamp is the sha256 of its inputs; a build
# that fails leaves no stamp, so the next call retries. Everything these
# print goes to stderr: the callers' stdout is their result alone.

die() { echo "$NAME: error: $*" >&2; exit 1; }

# Where the stamp is kept: .bapo-<name>-stamp, as each script has named it.
venv_stamp_file() { echo "$VENV/.bapo-${NAME%%[-.]*}-stamp"; }

venv_stamp() {
  if declare -F venv_inputs >/dev/null; then cat $(venv_inputs); else cat "$REQS"; fi \
    | sha256sum | cut -d' ' -f1
}

venv_up_to_date() {
  [[ -x "$VENV/bin/python" && -f "$(venv_stamp_file)" \
    && "$(cat "$(venv_stamp_file)")" == "$(venv_stamp)" ]] || return 1
  if declare -F venv_ready >/dev/null; then venv_ready; fi
}

# Builds the venv unless it is up to date; one build at a time (parallel
# test runs may all call it), re-checked once the lock is ours. The
# subshell holds the lock, so a process exec'd afterwards does not keep it.
venv_setup() {
  local f
  for f in $(if declare -F venv_inputs >/dev/null; then venv_inputs; else echo "$REQS"; fi); do
    [[ -f "$f" ]] || die "missing $f"
  done
  venv_up_to_date && return 0
  mkdir -p "$(dirname "$VENV")"
  ( flock 9 || die "cannot lock $VENV.lock"; venv_up_to_date || venv_build ) 9>"$VENV.lock"
}

venv_build() {
  command -v "$PY" >/dev/null || die "$PY not found: install Python 3.11 (or set BAPO_PYTHON)"
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$PY is $("$PY" -V 2>&1); need Python >= 3.10"
  echo "$NAME: setting up $VENV" >&2
  if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV" >&2 \
      || die "cannot create a venv at $VENV (on Debian/Ubuntu: apt-get install python3-venv)"
  fi
  rm -f "$(venv_stamp_file)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    --only-binary :all: -r "$REQS" >&2 \
    || die "pip install failed (PyPI reachable? wheels for $("$PY" -V 2>&1) on $(uname -m)?)"
  if declare -F venv_after >/dev/null; then venv_after; fi
  venv_stamp >"$(venv_stamp_file)"
}
