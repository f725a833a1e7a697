#!/usr/bin/env bash
# One command for issue 5's comparison: installs what the benchmark needs (perftest, UCX's
# ucx-utils, iperf3, matplotlib), builds the release preset, and runs bench/compare.py.
# Usage: bench/compare.sh [compare.py args: --repeat N, --quick, --out DIR, ...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/deps.sh
need=()
for p in ucx-utils iperf3 python3 python3-matplotlib; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || need+=("$p")
done
if [[ ${#need[@]} -gt 0 ]]; then
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
cmake --preset release >/dev/null
cmake --build --preset release
# Debian's python3 (where apt installed matplotlib), not one earlier on PATH.
exec /usr/bin/python3 bench/compare.py "$@"
