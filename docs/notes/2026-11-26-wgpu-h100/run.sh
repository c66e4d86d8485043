#!/usr/bin/env bash
# Device check: bapo's wgpu path on a real NVIDIA GPU (Vulkan and OpenGL).
set -x
root=$PWD
mkdir -p /work && ln -sfn "$root" /work/main
for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
export XDG_RUNTIME_DIR=$(mktemp -d)
mkdir -p /tmp/b && tar xJf .gpu/gpu.tar.xz -C /tmp/b
nvidia-smi -L
B=/tmp/b/bapo
F=policy/tests/fixtures/llama
for p in f32 f16; do
  RUST_LOG=info timeout 120 $B eval --device wgpu --precision $p --checkpoint $F --problems 4 --k 1 2>&1 | grep -v "^ *[0-9]*:\|^ *at " | tail -4
done
WGPU_BACKEND=gl timeout 60 $B eval --device wgpu --precision f16 --checkpoint $F --problems 2 --k 1 2>&1 | head -2
WGPU_BACKEND=gl timeout 60 $B eval --device wgpu --precision f32 --checkpoint $F --problems 2 --k 1 2>&1 | tail -2
export BAPO_REQUIRE_WGPU=1
timeout 120 /tmp/b/hf_parity-* 2>&1 | tail -6
timeout 120 /tmp/b/model-* wgpu precision 2>&1 | tail -8
timeout 120 /tmp/b/wgpu-* 2>&1 | tail -6
cat > /tmp/run.toml <<'T'
[run]
actors = 2
eval_problems = 20
pass_k = 1
[sft]
steps = 60
batch = 16
lr = 6e-3
warmup_steps = 10
[buffer]
max_staleness = 4
[learner]
batch_groups = 2
lr = 1e-4
steps = 24
checkpoint_every = 12
eval_every = 0
[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 2.0
[actor.sampling]
max_new_tokens = 6
T
/usr/bin/time -v timeout 240 $B run --quiet --device wgpu --config /tmp/run.toml --out /tmp/r 2>&1 | grep -E "Elapsed|Maximum resident" 
python3 -c "import json;s=json.load(open('/tmp/r/summary.json'));print({k:s.get(k) for k in ['steps','reconciled','final_accuracy','initial_accuracy']})"
grep -h "model on wgpu" /tmp/r/logs/learner.log | head -1
cp /tmp/r/summary.json $OUT/gpu-run-summary.json 2>/dev/null
