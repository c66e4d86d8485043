#!/usr/bin/env bash
# docs/notes/2026-11-26-tool-use.md: the calculator arm (configs/tiny-arith-tool.toml) and its
# tool-less control (same warm start, same RL steps, single answers) for seeds 0, 1, 2.
#
#   scripts/tool-use-study.sh [OUT]     # default runs/tool-use; BAPO=path/to/bapo to pick a binary
#
# Each seed: one bapo run with the calculator (warm start included), then the control from that
# run's warm start (--init). About 10 minutes per seed on two cores.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-runs/tool-use}"
BAPO="${BAPO:-bapo}"
for seed in 0 1 2; do
  "$BAPO" run --quiet --config "$ROOT/configs/tiny-arith-tool.toml" --seed "$seed" \
    --out "$OUT/tool-$seed"
  "$BAPO" run --quiet --config "$ROOT/docs/notes/2026-11-26-tool-use/control.toml" \
    --seed "$seed" --init "$OUT/tool-$seed/sft" --out "$OUT/control-$seed"
done
