#!/usr/bin/env bash
# Installs what the benchmarks compare against (not needed to build or test):
#   redis-server  - the Redis Streams reference of `bapo bench buffer`.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server already installed: $(redis-server --version)"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq redis-server
# The Debian package starts a system-wide instance; the bench runs its own.
$SUDO service redis-server stop >/dev/null 2>&1 || true
redis-server --version
