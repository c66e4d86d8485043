#!/usr/bin/env bash
# The calculator task (configs/tiny-arith-tool.toml) for seeds 0, 1, 2: BAPO with the calculator,
# then a second arm from that run's warm start (--init), so only the arm's difference differs.
#
#   scripts/tool-use-study.sh [OUT] [ARM]   # default runs/tool-use, control; BAPO=path/to/bapo
#
# ARM is one of
#   control   (docs/notes/2026-11-26-tool-use.md): no calculator, single answers;
#   turn-ppo  (docs/notes/2026-11-28-turn-ppo.md): the calculator, Turn-PPO's loss.
# About 10 minutes per seed on two cores.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-runs/tool-use}"
ARM="${2:-control}"
BAPO="${BAPO:-bapo}"
case "$ARM" in
  control) SECOND=(--config "$ROOT/docs/notes/2026-11-26-tool-use/control.toml") ;;
  turn-ppo) SECOND=(--config "$ROOT/configs/tiny-arith-tool.toml" --algo turn-ppo) ;;
  *) echo "tool-use-study.sh: unknown arm $ARM (control, turn-ppo)" >&2; exit 2 ;;
esac
for seed in 0 1 2; do
  "$BAPO" run --quiet --config "$ROOT/configs/tiny-arith-tool.toml" --seed "$seed" \
    --out "$OUT/tool-$seed"
  "$BAPO" run --quiet "${SECOND[@]}" --seed "$seed" --init "$OUT/tool-$seed/sft" \
    --out "$OUT/$ARM-$seed"
done
