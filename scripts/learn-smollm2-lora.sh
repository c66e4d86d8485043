#!/usr/bin/env bash
# Opt-in learning run of a real model with LoRA (issue 34): BAPO trains
# rank-16 adapters on the frozen SmolLM2-135M-Instruct (converted by
# scripts/convert-smollm2.sh) to answer two-digit additions in its chat
# format (configs/smollm2-lora-arith.toml), then prints the held-out test
# accuracy before and after. ~30 minutes on two CPU cores; not in .ci/run.
#
#   scripts/learn-smollm2-lora.sh [OUT]     # default: a fresh temp dir
#   BAPO_BIN=path/to/bapo ...               # a bapo already built
#
# Results of the committed run: docs/notes/2026-11-26-smollm2-lora-learning.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-$(mktemp -d)}"
MODEL="${BAPO_SMOLLM2_DIR:-$HOME/.cache/bapo/smollm2}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bapo/target}"
bash scripts/convert-smollm2.sh >&2
BAPO="${BAPO_BIN:-}"
if [[ -z "$BAPO" ]]; then
  cargo build -q -p bapo
  BAPO="$CARGO_TARGET_DIR/debug/bapo"
fi
mkdir -p "$OUT"
python3 scripts/arith_chat_jsonl.py "$OUT/add2.jsonl" 4000
start=$(date +%s)
"$BAPO" run --config configs/smollm2-lora-arith.toml --init "$MODEL" \
    --data "$OUT/add2.jsonl" --out "$OUT/run" --quiet
python3 - "$OUT/run" <<'PY'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
s = json.loads((run / "summary.json").read_text())
assert s["lora_rank"] == 16 and s["reconciled"], s
curve = [(r["step"], r["eval_accuracy"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
         if "eval_accuracy" in r]
print("validation accuracy by step:", ", ".join(f"{t}: {a:.2f}" for t, a in curve))
print(f"test accuracy ({s['eval_problems']} problems, greedy): "
      f"{s['warm_start_accuracy']:.3f} -> {s['final_accuracy']:.3f}")
PY
echo "learn-smollm2-lora: $(( $(date +%s) - start )) s ($OUT/run)"
