#!/usr/bin/env bash
# Latency of Debian's unmodified ibv_rc_pingpong through vrdma (server and client on this host,
# two guests of one backend). Prints markdown table rows: date, machine, command, µs/iter.
# Usage: bench/pingpong.sh [BIN_DIR (default build/release/bin)] [RUNS (default 5)]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-5}"

# shellcheck source-path=SCRIPTDIR/.. source=tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
e2e_init "$BIN_DIR"

CONFIGS=(
  "-s 8 -n 100000"
  "-s 65536 -n 10000"
)

cpu="$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)"
machine="$(nproc) CPUs, ${cpu:-unknown CPU}"
today="$(date +%F)"

echo "| date | machine | command | runs | µs/iter median | min | max |"
echo "|---|---|---|---|---|---|---|"
for cfg in "${CONFIGS[@]}"; do
  read -ra args <<<"$cfg"
  vals=()
  for ((r = 1; r <= RUNS; r++)); do
    run_pair "run$r" bench-srv bench-cli "${args[@]}"
    v="$(awk '/usec\/iter/ {print $(NF-1)}' "$E2E_TMP/run$r.client.out")"
    [[ -n $v ]] || fail "no usec/iter in run $r"
    vals+=("$v")
  done
  read -r med min max < <(printf '%s\n' "${vals[@]}" | sort -g |
    awk '{a[NR] = $1} END {m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2;
                           printf "%.2f %.2f %.2f\n", m, a[1], a[NR]}')
  echo "| $today | $machine | \`vrdma run -- ibv_rc_pingpong $cfg\` | $RUNS | $med | $min | $max |"
done
e2e_pass
