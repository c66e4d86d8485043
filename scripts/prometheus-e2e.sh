#!/usr/bin/env bash
# End to end with a real Prometheus: start a short `bapo run`, point a
# Prometheus server (from Debian's `prometheus` package, fetched by
# scripts/check-deploy.sh into its tool cache) at every service's /metrics,
# and query one metric of each service through Prometheus' HTTP API.
#
# Usage: scripts/prometheus-e2e.sh [path/to/bapo]   (default: the debug
# binary that `cargo test` builds in $CARGO_TARGET_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${BAPO_DEPLOY_TOOLS:-$HOME/.cache/bapo/deploy-tools}"
PROM="$TOOLS/prometheus/usr/bin/prometheus"
BAPO="${1:-${CARGO_TARGET_DIR:-target}/debug/bapo}"
say() { printf 'prometheus-e2e: %s\n' "$*"; }

[[ -x "$PROM" ]] || bash scripts/check-deploy.sh >/dev/null || true
[[ -x "$PROM" ]] || { say "no prometheus binary at $PROM"; exit 1; }
[[ -x "$BAPO" ]] || { say "no bapo binary at $BAPO (run cargo test first)"; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/bapo.toml" <<'TOML'
[run]
actors = 2
eval_problems = 20
pass_k = 1
[sft]
steps = 20
batch = 16
[learner]
batch_groups = 4
lr = 1e-4
steps = 100000
eval_every = 0
[buffer]
max_staleness = 2
[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 1.0
[actor.sampling]
max_new_tokens = 8
TOML
"$BAPO" run --quiet --config "$work/bapo.toml" --out "$work/run" > "$work/run.log" 2>&1 &
pids+=($!)

for _ in $(seq 600); do [[ -s "$work/run/services.json" ]] && break; sleep 0.2; done
[[ -s "$work/run/services.json" ]] || { say "bapo run never wrote services.json"; cat "$work/run.log"; exit 1; }

# One scrape job per service kind, targets from services.json.
python3 - "$work/run/services.json" > "$work/prometheus.yml" <<'PY'
import json, sys
from urllib.parse import urlparse
m = json.load(open(sys.argv[1]))["metrics"]
jobs = {}
for name, url in m.items():
    jobs.setdefault(name.split("-")[0], []).append(urlparse(url).netloc)
print("global:\n  scrape_interval: 1s\nscrape_configs:")
for job, targets in jobs.items():
    print(f"  - job_name: {job}\n    static_configs:\n      - targets: {json.dumps(targets)}")
PY
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$PROM" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$port" > "$work/prometheus.log" 2>&1 &
pids+=($!)

# One metric per service, asked of Prometheus, not of the services.
declare -A want=(
    [buffer]='bapo_buffer_learner_version{job="buffer"}'
    [learner]='bapo_learner_steps_total{job="learner"}'
    [actor]='bapo_actor_groups_total{job="actor"}'
)
found=()
for _ in $(seq 180); do
    found=()
    for job in "${!want[@]}"; do
        n=$(python3 - "$port" "${want[$job]}" <<'PY' 2>/dev/null || echo 0
import json, sys, urllib.parse, urllib.request
q = urllib.parse.quote(sys.argv[2])
r = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/api/v1/query?query={q}", timeout=5))
res = [x for x in r["data"]["result"] if float(x["value"][1]) > 0]
print(len(res))
PY
)
        [[ "$n" -gt 0 ]] && found+=("$job")
    done
    [[ ${#found[@]} -eq ${#want[@]} ]] && break
    sleep 1
done
if [[ ${#found[@]} -ne ${#want[@]} ]]; then
    say "FAIL: Prometheus has only ${found[*]:-nothing} of ${!want[*]}"
    tail -n 20 "$work/run.log" "$work/prometheus.log"
    exit 1
fi
say "ok: Prometheus scraped and answered for ${found[*]}"
