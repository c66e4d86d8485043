# Finding the processes a script started, by parent links, so that it
# signals only those (scripts/e2e-vllm.sh; tested by scripts/test-procs.sh).
# Sourced, not run.

# The processes below pid $1 (children, their children, ...).
below() {
  local kid
  for kid in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$kid"; below "$kid"; done
}
# The vLLM processes this script started, below pid $1: never a vLLM of
# someone else's on the same machine.
vllm_below() {
  local p
  for p in $(below "$1"); do
    grep -qaE "${2:-vllm.entrypoints.openai.api_server|VLLM::}" "/proc/$p/cmdline" 2>/dev/null && echo "$p"
  done
  return 0
}
