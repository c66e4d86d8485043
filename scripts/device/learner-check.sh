#!/usr/bin/env bash
# The learner's whole GPU check, in one device call (issue 51): on the
# same card, bapo (Burn on wgpu/Vulkan, f16 compute, f32 master weights)
# beside PyTorch (transformers, SDPA attention, autocast f16), at the
# shapes of SmolLM2-135M, Qwen2.5-0.5B and Qwen2.5-1.5B (random weights
# from the committed config.json files; nothing is downloaded).
#
#   1. parity: logits, log-probs and gradients of bapo against
#      transformers on the same random 0.5B weights (f32);
#   2. the learner step, full fine-tuning and LoRA r16: tokens/s, peak
#      device memory, MFU, beside PyTorch's;
#   3. Qwen2.5-7B LoRA: PyTorch measured, bapo's memory estimate;
#   4. a short `bapo run --device wgpu` (the built-in task and model).
#
# Every result is one JSON line in $OUT/results.jsonl (the card, driver
# and adapter named in it); the whole log is $OUT/log.txt. Each part
# runs under its own timeout, most important first, so a slow part
# costs only itself. Prepared by scripts/device/prepare.sh.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
res=$out/results.jsonl
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export XDG_RUNTIME_DIR=$(mktemp -d) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/b && xz -dc .gpu/bapo.xz > /tmp/b/bapo && chmod +x /tmp/b/bapo
B=/tmp/b/bapo
C=scripts/device/configs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
    python3 -c 'import json,sys; n,d,m=[x.strip() for x in sys.stdin.read().split(",")]; print(json.dumps({"check":"card","name":n,"driver":d,"memory":m}))' >> "$res"
python3 -c 'import json,torch,transformers; print(json.dumps({"check":"stack","torch":torch.__version__,"transformers":transformers.__version__}))' >> "$res"

step() { # label, seconds, command...: one JSON line (or an error line) into results
    local label=$1 secs=$2; shift 2
    echo "== $label"
    local t0=$SECONDS
    if ! timeout "$secs" "$@" > /tmp/step.out 2>&1; then
        tail -5 /tmp/step.out
        printf '{"check":"%s","error":"exit %s after %s s"}\n' "$label" "$?" "$((SECONDS - t0))" >> "$res"
        return
    fi
    cat /tmp/step.out | grep -v '^{' | tail -8
    grep '^{' /tmp/step.out | sed "s/^{/{\"label\":\"$label\",/" >> "$res"
}

# 1. Parity at the 0.5B shape.
step parity-torch 150 python3 scripts/device/torch_parity.py --config $C/qwen2.5-0.5b.json \
    --out-dir /tmp/parity --device cuda
step parity-bapo 150 "$B" bench parity --checkpoint /tmp/parity --device wgpu --precision f32

# 2. The learner step: 8 groups x 8 x (16 + 256) tokens, micro-batches of 8.
shape_args=(--groups 8 --group-size 8 --prompt 16 --response 256 --micro-batch-seqs 8 --steps 3)
bench() { # shape, mode, bapo seconds
    local cfg=$C/$1.json mode=$2
    step "torch-$1-$mode" 120 python3 scripts/device/torch_learner.py --config "$cfg" \
        --mode "$mode" --dtype f16 "${shape_args[@]}"
    local lora=(--lora-rank 0)
    [ "$mode" = lora ] && lora=(--lora-rank 16 --lora-only)
    step "bapo-$1-$mode" "$3" "$B" bench learner --config "$cfg" --device wgpu --precision f16 \
        "${lora[@]}" "${shape_args[@]}" --peak-tflops 989.4 --device-memory-gib 79 --json
}
bench qwen2.5-0.5b full 150
bench qwen2.5-0.5b lora 120
bench smollm2-135m full 90
bench qwen2.5-1.5b full 180
bench qwen2.5-1.5b lora 150

# 3. 7B LoRA, and 7B full fine-tuning: do they fit an 80 GB card (79 GiB
# usable)? PyTorch measured; bapo refuses or runs by its estimate.
step torch-qwen2.5-7b-lora 150 python3 scripts/device/torch_learner.py \
    --config $C/qwen2.5-7b.json --mode lora --dtype f16 "${shape_args[@]}" --steps 2
step bapo-qwen2.5-7b-lora 200 "$B" bench learner --config $C/qwen2.5-7b.json --device wgpu \
    --precision f16 --lora-rank 16 --lora-only "${shape_args[@]}" --steps 2 \
    --peak-tflops 989.4 --device-memory-gib 79 --json

step torch-qwen2.5-7b-full 90 python3 scripts/device/torch_learner.py \
    --config $C/qwen2.5-7b.json --mode full --dtype f16 "${shape_args[@]}" --steps 1
step bapo-qwen2.5-7b-full 60 "$B" bench learner --config $C/qwen2.5-7b.json --device wgpu \
    --precision f16 --lora-rank 0 "${shape_args[@]}" --steps 1 --device-memory-gib 79 --json

# 4. A short run of the whole loop on the GPU.
step bapo-run 120 "$B" run --quiet --device wgpu --steps 12 --out /tmp/run
[ -f /tmp/run/summary.json ] && python3 -c 'import json; s=json.load(open("/tmp/run/summary.json")); print(json.dumps({"check":"run","steps":s.get("steps"),"reconciled":s.get("reconciled"),"final_accuracy":s.get("final_accuracy")}))' >> "$res"
grep -h "model on wgpu" /tmp/run/logs/learner.log 2>/dev/null | head -1
echo "== done"; cat "$res"
