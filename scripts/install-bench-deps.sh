#!/usr/bin/env bash
# Installs what the benchmarks compare against (not needed to build or test):
#   redis-server          the Redis Streams reference of `bapo bench buffer`
#   jax + optax (venv)    the JAX reference of `bapo bench model`,
#                         in ~/.cache/bapo/jax (or $BAPO_JAX_VENV)
set -euo pipefail
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
