#!/usr/bin/env bash
# On-demand paging (issue 24): registration cost (bench/odp_cost: 64 GiB reserved and implicit
# ODP vs an ordinary 1 GiB registration) and the per-message cost of an ODP MR (ib_send_lat and
# ib_write_lat with --odp vs without, runs interleaved). Usage: bench/odp.sh [BIN_DIR] [RUNS]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-3}"
# shellcheck source-path=SCRIPTDIR/.. source=tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
export E2E_DEADLINE="${E2E_DEADLINE:-1800}"
e2e_init "$BIN_DIR"
cpu="$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)"
echo "Date $(date +%F), $(nproc) CPUs (${cpu:-unknown}), load $(cut -d' ' -f1 /proc/loadavg), command: bench/odp.sh"
"${VRUN[@]}" --guest odp-cost -- "$BIN_DIR/odp_cost"
echo
echo "| run | tool | size | t_typical µs | t_typical µs with --odp |"
echo "|---|---|---|---|---|"
for run in $(seq "$RUNS"); do
  for tool in ib_send_lat ib_write_lat; do
    for s in 8 65536; do
      row=()
      for odp in "" --odp; do
        # shellcheck disable=SC2086
        run_perftest "$tool" -s "$s" -n 2000 $odp
        row+=("$(result_rows "$E2E_TMP/$tool.client.out" | awk '{print $5}' | tail -n 1)")
      done
      echo "| $run | $tool | $s | ${row[0]} | ${row[1]} |"
    done
  done
done
e2e_pass
