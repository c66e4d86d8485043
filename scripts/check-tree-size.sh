#!/usr/bin/env bash
# The tracked tree must stay small enough to travel: a GPU device check
# sends the whole working tree (64 MiB at most, a carried binary
# included), so tracked files stay under 30 MiB. Large study artefacts are
# gzip'd; what a command can remake is not committed twice.
set -euo pipefail
cd "$(dirname "$0")/.."
limit_mib=${TREE_LIMIT_MIB:-30}
total=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s + 0}')
mib=$(awk -v b="$total" 'BEGIN {printf "%.1f", b / 1048576}')
if (( total > limit_mib * 1048576 )); then
    echo "check-tree-size: tracked files take $mib MiB, over the $limit_mib MiB limit; the largest:" >&2
    git ls-files -z | xargs -0 stat -c '%s %n' | sort -rn | head -15 >&2
    exit 1
fi
echo "check-tree-size: tracked files take $mib MiB (limit $limit_mib MiB)"
