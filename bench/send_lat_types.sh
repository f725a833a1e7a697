#!/usr/bin/env bash
# 8 B ib_send_lat on one host for each QP type (RC, UC, UD), through the backend (a backend with
# --no-direct-path) and on the direct path (the default), interleaved: RUNS rounds, each round
# every type on both. Prints one markdown row per type and path: the median of the rounds'
# t_typical (and their range), and the mediated/direct ratio.
# Usage: bench/send_lat_types.sh [BIN_DIR (default build/release/bin)] [RUNS (default 3)]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-3}"
ITERS="${ITERS:-5000}"
# shellcheck source-path=SCRIPTDIR/.. source=tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
export E2E_DEADLINE="${E2E_DEADLINE:-1800}"
e2e_init "$BIN_DIR"
cpu="$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)"
echo "Date $(date +%F), $(nproc) CPUs (${cpu:-unknown}), load $(cut -d' ' -f1-3 /proc/loadavg)," \
  "command: bench/send_lat_types.sh $BIN_DIR $RUNS (ITERS=$ITERS)"
echo

declare -A got
for ((r = 1; r <= RUNS; r++)); do
  for path in mediated direct; do
    # Each path its own backend (the library starts it with the environment's setting).
    export VRDMA_SOCKET="$E2E_TMP/$path.sock"
    VRDMA_DIRECT_PATH=0
    [[ $path == mediated ]] || VRDMA_DIRECT_PATH=1
    export VRDMA_DIRECT_PATH
    for conn in RC UC UD; do
      run_perftest ib_send_lat -c "$conn" -s 8 -n "$ITERS"
      # t_typical (the median) is column 5.
      got[$conn.$path]+="$(result_rows "$E2E_TMP/ib_send_lat.client.out" | awk '{print $5}' | tail -n 1) "
    done
  done
done

# Median and range of a list of numbers.
stats() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -g | awk '{v[NR] = $1} END {
  printf "%.2f (%.2f-%.2f)", (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2), v[1], v[NR]}'; }
median() { stats "$1" | awk '{print $1}'; }

echo "| type | mediated µs, median (min-max) | direct µs, median (min-max) | mediated / direct |"
echo "|---|---|---|---|"
for conn in RC UC UD; do
  m="$(median "${got[$conn.mediated]}")" d="$(median "${got[$conn.direct]}")"
  echo "| $conn | $(stats "${got[$conn.mediated]}") | $(stats "${got[$conn.direct]}") |" \
    "$(awk -v a="$m" -v b="$d" 'BEGIN {printf "%.1f", a / b}') |"
done
e2e_pass
