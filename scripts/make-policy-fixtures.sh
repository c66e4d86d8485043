#!/usr/bin/env bash
# Regenerates policy/tests/fixtures: a tiny random Llama and a tiny random
# Qwen2 made by Hugging Face transformers (a reference nobody here wrote),
# each with config.json, model.safetensors, tokenizer.json and
# reference.json (input ids, logits, greedy continuation); and a LoRA
# adapter made by PEFT on the Llama one (llama-lora: PEFT's own files and
# the adapted logits).
#
# The fixtures are committed, so tests need no Python; run this only to
# change them. It installs torch + transformers from PyPI into a private
# virtualenv (PyPI's torch needs its nvidia-* wheels even on CPU: a large,
# one-time download of ~4 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${BAPO_PYREF:-$HOME/.cache/bapo/pyref}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
"$VENV/bin/pip" install -q torch transformers safetensors tokenizers numpy \
  peft==0.21.2 accelerate==1.15.0
"$VENV/bin/python" scripts/policy_fixtures.py policy/tests/fixtures
"$VENV/bin/python" scripts/lora_fixture.py policy/tests/fixtures
