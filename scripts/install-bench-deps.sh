#!/usr/bin/env bash
# Installs what the benchmarks compare against (not needed to build or test):
#   redis-server          the Redis Streams reference of `bapo bench buffer`
#   jax + optax (venv)    the JAX reference of `bapo bench model`,
#                         in ~/.cache/bapo/jax (or $BAPO_JAX_VENV)
#   torch (venv, --torch) the PyTorch reference of `bapo bench model`, in
#                         ~/.cache/bapo/torch (or $BAPO_TORCH_VENV). Opt-in:
#                         PyPI has only the CUDA build, torch plus ~2.3 GB of
#                         nvidia-* wheels (2.8 GB in all, ~70 s to install
#                         here once downloaded); it runs on the CPU all the same.
set -euo pipefail
TORCH=0
case "${1:-}" in
  "") ;;
  --torch) TORCH=1 ;;
  *) echo "usage: $0 [--torch]" >&2; exit 2 ;;
esac
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server already installed: $(redis-server --version)"
else
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq redis-server
  # The Debian package starts a system-wide instance; the bench runs its own.
  $SUDO service redis-server stop >/dev/null 2>&1 || true
fi
VENV="${BAPO_JAX_VENV:-$HOME/.cache/bapo/jax}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
"$VENV/bin/pip" install -q jax optax numpy
"$VENV/bin/python" -c 'import jax, optax; print("jax", jax.__version__, "optax", optax.__version__)'
if [ "$TORCH" = 1 ]; then
  TVENV="${BAPO_TORCH_VENV:-$HOME/.cache/bapo/torch}"
  [ -x "$TVENV/bin/python" ] || python3 -m venv "$TVENV"
  "$TVENV/bin/pip" install -q "torch==2.15.0"
  "$TVENV/bin/python" -W ignore -c 'import torch; print("torch", torch.__version__)'
fi
