#!/usr/bin/env bash
# On-demand paging (issue 24): registration cost (bench/odp_cost: 64 GiB reserved and implicit
# ODP vs an ordinary 1 GiB registration) and the per-message cost of an ODP MR (ib_send_lat and
# ib_write_lat with --odp vs without, runs interleaved), and a peer's first WRITE into an ODP page
# (bench/odp_first_touch, pager woken vs polling). Usage: bench/odp.sh [BIN_DIR] [RUNS]
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
# A peer's first WRITE into an ODP page: the pager woken by the backend, and polling every ms.
"${VRUN[@]}" --guest odp-touch -- "$BIN_DIR/odp_first_touch"
VRDMA_ODP_WAKE=0 "${VRUN[@]}" --guest odp-touch -- "$BIN_DIR/odp_first_touch"
# ODP_TOUCH_ONLY=1: only this part.
[[ ${ODP_TOUCH_ONLY:-0} == 1 ]] && { e2e_pass; exit 0; }
echo
"${VRUN[@]}" --guest odp-cost -- "$BIN_DIR/odp_cost"
echo
# ODP MRs keep their QPs on the mediated path (docs/ARCHITECTURE.md, "On-demand paging"), so
# the fair baseline is the same tool without --odp through a backend without the direct path
# (a second one, started by the library with VRDMA_DIRECT_PATH=0); the default (direct) too.
MED_SOCK="$E2E_TMP/mediated.sock"
mediated() { VRDMA_SOCKET="$MED_SOCK" VRDMA_DIRECT_PATH=0 "$@"; }
echo "| run | tool | size | t_typical µs, direct path | t_typical µs, mediated | t_typical µs, mediated, --odp |"
echo "|---|---|---|---|---|---|"
for run in $(seq "$RUNS"); do
  for tool in ib_send_lat ib_write_lat; do
    for s in 8 65536; do
      row=()
      run_perftest "$tool" -s "$s" -n 2000
      row+=("$(result_rows "$E2E_TMP/$tool.client.out" | awk '{print $5}' | tail -n 1)")
      for odp in "" --odp; do
        # shellcheck disable=SC2086
        mediated run_perftest "$tool" -s "$s" -n 2000 $odp
        row+=("$(result_rows "$E2E_TMP/$tool.client.out" | awk '{print $5}' | tail -n 1)")
      done
      echo "| $run | $tool | $s | ${row[0]} | ${row[1]} | ${row[2]} |"
    done
  done
done
for pidf in "$MED_SOCK".pid "$MED_SOCK".*.pid; do
  [[ -f $pidf ]] && kill "$(cat "$pidf")" 2>/dev/null
done
e2e_pass
