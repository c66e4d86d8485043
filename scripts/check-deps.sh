#!/usr/bin/env bash
# The crate graph stays the product's shape, and no crate declares a
# dependency it does not use. Run by .ci/run.
#
# 1. Edges between our crates: proto and tasks depend on nothing of ours;
#    policy on tasks at most; actor and learner on proto, policy, tasks;
#    the buffer on proto only (normal dependencies; dev-dependencies are
#    free to reach further for tests).
# 2. cargo-machete (installed here, pinned) finds declared dependencies
#    that no source file uses.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo metadata --format-version 1 --no-deps --locked | python3 -c '
import json, sys
allowed = {
    "bapo-proto": set(),
    "bapo-tasks": set(),
    "bapo-policy": {"bapo-tasks"},
    "bapo-actor": {"bapo-proto", "bapo-policy", "bapo-tasks"},
    "bapo-learner": {"bapo-proto", "bapo-policy", "bapo-tasks"},
    "bapo-buffer": {"bapo-proto"},
}
bad = []
for p in json.load(sys.stdin)["packages"]:
    if p["name"] not in allowed:
        continue
    ours = {d["name"] for d in p["dependencies"]
            if d["name"].startswith("bapo-") and d["kind"] is None}
    name = p["name"]
    extra = ours - allowed[name]
    if extra:
        bad.append(f"{name} depends on {sorted(extra)}; allowed: {sorted(allowed[name])}")
if bad:
    print("crate graph:", *bad, sep="\n  ")
    sys.exit(1)
print("crate graph: ok")
'

MACHETE_VERSION=0.9.2
if ! cargo machete --version 2>/dev/null | grep -q "$MACHETE_VERSION"; then
    cargo install cargo-machete --version "$MACHETE_VERSION" --locked --quiet
fi
cargo machete
