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
for f in .gl/*_amd64.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export XDG_RUNTIME_DIR=$(mktemp -d) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# Two builds: cubecl's SPIR-V compiler (cooperative matrices) and, should
# the driver refuse or crash on its shaders (Mesa's lavapipe crashes
# compiling them), wgpu's WGSL path. The first failure of a bapo step
# switches to WGSL for the rest, and the step is run again under it.
mkdir -p /tmp/b
for v in spirv wgsl; do xz -dc .gpu/bapo-$v.xz > /tmp/b/bapo-$v && chmod +x /tmp/b/bapo-$v; done
B=/tmp/b/bapo-spirv shaders=spirv
C=scripts/device/configs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
    python3 -c 'import json,sys; n,d,m=[x.strip() for x in sys.stdin.read().split(",")]; print(json.dumps({"check":"card","name":n,"driver":d,"memory":m}))' >> "$res"
python3 -c 'import json,torch,transformers; print(json.dumps({"check":"stack","torch":torch.__version__,"transformers":transformers.__version__}))' >> "$res"

step() { # label, seconds, command...: one JSON line (or an error line) into results
    local label=$1 secs=$2; shift 2
    echo "== $label"
    local t0=$SECONDS
    timeout "$secs" "$@" > /tmp/step.out 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
        tail -12 /tmp/step.out
        printf '{"check":"%s","error":"exit %s after %s s"}\n' "$label" "$rc" "$((SECONDS - t0))" >> "$res"
        return
    fi
    grep -v '^{' /tmp/step.out | tail -8
    grep '^{' /tmp/step.out |
        sed "s/^{/{\"label\":\"$label\",\"wall_s\":$((SECONDS - t0)),/" >> "$res"
}

# A bapo step: on failure under SPIR-V, again under WGSL, which stays.
bapo_step() { # label, seconds, bapo arguments...
    local label=$1 secs=$2; shift 2
    local before
    before=$(grep -c '"error"' "$res")
    step "$label-$shaders" "$secs" "$B" "$@"
    if [ "$shaders" = spirv ] && [ "$(grep -c '"error"' "$res")" -gt "$before" ]; then
        B=/tmp/b/bapo-wgsl shaders=wgsl
        echo "{\"check\":\"shaders\",\"switched_to\":\"wgsl\",\"after\":\"$label\"}" >> "$res"
        step "$label-$shaders" "$secs" "$B" "$@"
    fi
}

# 1. Parity at the 0.5B shape.
step parity-torch 150 python3 scripts/device/torch_parity.py --config $C/qwen2.5-0.5b.json \
    --out-dir /tmp/parity --device cuda
bapo_step parity-bapo 150 bench parity --checkpoint /tmp/parity --device wgpu --precision f32

# 2. The learner step: 8 groups x 8 x (16 + 256) tokens, micro-batches of 8.
# Most important first (the 0.5B goal, then what fits at 1.5B and 7B): a
# call cut short by its limit loses only the tail.
shape_args=(--groups 8 --group-size 8 --prompt 16 --response 256 --micro-batch-seqs 8)
bench() { # shape, mode, bapo seconds, timed steps
    local cfg=$C/$1.json mode=$2 secs=$3
    shape_args+=(--steps "${4:-3}")
    step "torch-$1-$mode" 120 python3 scripts/device/torch_learner.py --config "$cfg" \
        --mode "$mode" --dtype f16 "${shape_args[@]}"
    local lora=(--lora-rank 0)
    [ "$mode" = lora ] && lora=(--lora-rank 16 --lora-only)
    bapo_step "bapo-$1-$mode" "$secs" bench learner --config "$cfg" --device wgpu --precision f16 \
        "${lora[@]}" "${shape_args[@]}" --peak-tflops 989.4 --device-memory-gib 79 --json
    unset 'shape_args[-1]' 'shape_args[-1]'
}
bench qwen2.5-0.5b full 150
bench qwen2.5-1.5b full 180
bench qwen2.5-1.5b lora 150

# 3. 7B LoRA: does it fit an 80 GB card (79 GiB usable)? PyTorch
# measured; bapo runs or refuses by its estimate.
bench qwen2.5-7b lora 200 2

# 4. A short run of the whole loop on the GPU.
bapo_step bapo-run 120 run --quiet --device wgpu --steps 12 --out /tmp/run
[ -f /tmp/run/summary.json ] && python3 -c 'import json; s=json.load(open("/tmp/run/summary.json")); print(json.dumps({"check":"run","steps":s.get("steps"),"reconciled":s.get("reconciled"),"final_accuracy":s.get("final_accuracy")}))' >> "$res"
grep -h "model on wgpu" /tmp/run/logs/learner.log 2>/dev/null | head -1

# 5. If time is left: LoRA at 0.5B, the 135M shape, and 7B full
# fine-tuning (which should not fit 79 GiB: bapo refuses it by estimate).
bench qwen2.5-0.5b lora 120
bench smollm2-135m full 90
bench qwen2.5-7b full 60 1
echo "== done"; cat "$res"
