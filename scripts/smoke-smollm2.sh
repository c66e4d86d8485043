#!/usr/bin/env bash
# Opt-in smoke run of a real instruct model: SmolLM2-135M-Instruct (converted
# by scripts/convert-smollm2.sh, ~12 s) runs `bapo run` on GSM8K in its chat
# format for a few BAPO steps with two actors (configs/smollm2-gsm8k.toml),
# then checks the run: versions advanced, rewards were computed on real
# text, a checkpoint and the HF export were written and load again.
#
#   scripts/smoke-smollm2.sh [GSM8K_JSONL]   # default ../shared/data/gsm8k/test.jsonl
#   BAPO_SMOKE_LORA=1 scripts/smoke-smollm2.sh  # the same with LoRA adapters (--lora)
#   BAPO_BIN=path/to/bapo ...                   # a bapo already built (any features)
#
# Not in .ci/run: on two cores it takes minutes of the 45-minute budget
# (see docs/policy.md); run it before touching the model, tokenizer or
# weight paths.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${1:-../shared/data/gsm8k/test.jsonl}"
[[ -f "$DATA" ]] || { echo "smoke-smollm2: no GSM8K file at $DATA" >&2; exit 1; }
MODEL="${BAPO_SMOLLM2_DIR:-$HOME/.cache/bapo/smollm2}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bapo/target}"
OUT="${BAPO_SMOKE_OUT:-$(mktemp -d)}"
start=$(date +%s)
bash scripts/convert-smollm2.sh >&2
BAPO="${BAPO_BIN:-}"
if [[ -z "$BAPO" ]]; then
  cargo build -q -p bapo
  BAPO="$CARGO_TARGET_DIR/debug/bapo"
fi
LORA=()
[[ "${BAPO_SMOKE_LORA:-0}" == 1 ]] && LORA=(--lora)
"$BAPO" run --config configs/smollm2-gsm8k.toml --init "$MODEL" --data "$DATA" \
    --out "$OUT/run" "${LORA[@]}"
BAPO_SMOKE_LORA="${BAPO_SMOKE_LORA:-0}" python3 - "$OUT/run" <<'PY'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()
         if '"step"' in l]
assert steps, "no training step in metrics.jsonl"
last = steps[-1]
assert last["version"] >= 3, f"versions did not advance: {last}"
assert any("reward_mean" in s for s in steps), "no reward in the step records"
assert (run / "final" / "config.json").exists(), "no HF export"
assert (run / "final" / "tokenizer_config.json").exists(), "the export lost its chat template"
import os
if os.environ["BAPO_SMOKE_LORA"] == "1":
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    state = json.loads((ckpts[-1] / "state.json").read_text())
    assert "lora" in state and "adapters.bpk" in state["files"], "not a LoRA checkpoint"
    cfg = json.loads((run / "final" / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 16, cfg
    print(f"smoke-smollm2: LoRA r {cfg['r']}, base {state['lora']['base_fingerprint']}")
print(f"smoke-smollm2: {len(steps)} steps, version {last['version']}, "
      f"mean reward {last.get('reward_mean')}")
PY
"$BAPO" eval --checkpoint "$OUT/run/final" --config configs/smollm2-gsm8k.toml \
    --data "$DATA" --problems 2 >/dev/null
echo "smoke-smollm2: ok in $(( $(date +%s) - start )) s ($OUT/run)"
