#!/usr/bin/env bash
# Installs what `--device wgpu` needs on a machine without a GPU: the
# Vulkan loader and Mesa's lavapipe, a conformant Vulkan driver that runs
# on the CPU (Debian: libvulkan1, mesa-vulkan-drivers). CI runs it before
# the tests so the wgpu tests execute instead of skipping (docs/gpu.md).
# Does nothing when both are already there; needs root (or sudo) otherwise.
set -euo pipefail

have() {
    ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1' &&
        ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1
}

if have; then
    echo "install-vulkan: the Vulkan loader and lavapipe are installed"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
start=$(date +%s)
# A run killed inside dpkg leaves it half-configured; finish that first.
$SUDO dpkg --configure -a
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends libvulkan1 mesa-vulkan-drivers >/dev/null
have || { echo "install-vulkan: lavapipe still missing after apt-get" >&2; exit 1; }
echo "install-vulkan: installed libvulkan1 and mesa-vulkan-drivers in $(( $(date +%s) - start )) s"
