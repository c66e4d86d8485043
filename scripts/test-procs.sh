#!/usr/bin/env bash
# scripts/procs.sh finds the vLLM servers below a run's pid and not one of
# somebody else's with the same command line (which `pkill -f` would hit).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/procs.sh
name="python -m vllm.entrypoints.openai.api_server"
bash -c "exec -a \"$name --uds theirs\" sleep 60" &
theirs=$!
bash -c "bash -c 'exec -a \"$name --uds ours\" sleep 60' & wait" &
run=$!
trap 'kill $theirs $found 2>/dev/null || true' EXIT
found=""
for _ in $(seq 50); do
  found=$(vllm_below "$run" vllm.entrypoints.openai.api_server)
  [[ -n "$found" ]] && break
  sleep 0.1
done
[[ -n "$found" ]] || { echo "test-procs: the run's server was not found" >&2; exit 1; }
[[ " $found " != *" $theirs "* ]] || { echo "test-procs: found another's server $theirs" >&2; exit 1; }
grep -qa -- "--uds ours" "/proc/$found/cmdline" || { echo "test-procs: found $found, not the run's" >&2; exit 1; }
echo "test-procs: ok (the run's server $found, not $theirs)"
