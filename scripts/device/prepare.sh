#!/usr/bin/env bash
# Prepares the learner's GPU check (scripts/device/learner-check.sh) on a
# machine without a GPU: builds bapo (release, `bench` + `vulkan`: wgpu
# with cubecl's SPIR-V compiler, so f16 matmuls reach the tensor cores
# through cooperative matrices), strips and xz's it into .gpu/, and puts
# Debian's Vulkan and GL loaders into .gl/ (the device image has NVIDIA's
# driver but no loader). Both folders are git-ignored locally and travel
# as the device call's `carry`, well under its 64 MiB with the tree.
#
# Then, in one device call (about 8 minutes):
#   run(command="bash scripts/device/learner-check.sh", carry=[".gpu", ".gl"], timeout_s=560)
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/bapo/target}"
for d in /.gpu/ /.gl/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
# Two builds (learner-check.sh falls back to the second): SPIR-V shaders
# (cooperative matrices), and wgpu's WGSL ones.
mkdir -p .gpu
for v in spirv:bench,vulkan wgsl:bench,wgpu; do
    cargo build --release --locked -p bapo --features "${v#*:}"
    strip -o ".gpu/bapo-${v%%:*}" "$CARGO_TARGET_DIR/release/bapo"
    xz -9e -T2 -f ".gpu/bapo-${v%%:*}"
done
if [ ! -e .gl/libvulkan1.deb ]; then
    mkdir -p .gl /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    apt-get $o update -qq
    (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
    ln -sf "$(basename "$(ls .gl/libvulkan1_*.deb | head -1)")" .gl/libvulkan1.deb
fi
du -sh .gpu .gl
echo "prepared: run scripts/device/learner-check.sh on the device with carry [.gpu, .gl]"
