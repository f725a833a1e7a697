#!/usr/bin/env bash
# Downtime of live migration under load: ib_write_bw -q Q (client guest on h1, server on h2,
# 4 KiB WRITEs, 16 in flight per QP) runs while the client's guest moves h1 -> h3 -> h1 ...
# (vrdma migrate between the backends of three namespace hosts, tests/hosts/lib.sh), MOVES moves
# per QP count; after each move a pause, and the next move only once the guest has sent through
# the new route. The downtime is what `vrdma migrate` reports: the time the guest's device is
# frozen (export on the source, transfer of the state and its descriptors, import on the
# target). Prints a markdown table: QPs, moves, downtime median (min-max), the median's parts,
# state size, and the median against the 5 ms target.
# Not perftest's 128 in flight per QP: with 64 QPs on one backend-to-backend TCP connection that
# queue outlasts the QPs' ACK timeout and ib_write_bw fails (IBV_WC_RETRY_EXC_ERR) without any
# move. Needs root (ip netns).
# Usage: bench/migrate_downtime.sh [BIN_DIR (default build/release/bin)] [MOVES (default 10)]
#        [QP counts (default "1 8 64")]   (MIG_BW_ARGS: ib_write_bw's other options, default
#        "-s 4096 -t 16"; MIG_PAUSE: the pause after each move, default 0.3 s)
set -euo pipefail
# Pinned to the backends' transport (--no-direct-remote, comparable with its earlier rows; direct pairs leave the direct path first).
HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
MOVES="${2:-10}"
QP_COUNTS="${3:-1 8 64}"
PAUSE="${MIG_PAUSE:-0.3}"
read -ra BW_ARGS <<<"${MIG_BW_ARGS:--s 4096 -t 16}"
TARGET_US=5000
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
hosts_init "$BIN_DIR" 3
wait_mesh

cpu="$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)"
machine="$(nproc) CPUs, ${cpu:-unknown CPU}"
median() { stats_of "$@" | awk '{printf "%.0f\n", $2}'; }

echo "| date | machine | ib_write_bw ${BW_ARGS[*]} -q | moves | downtime µs median (min–max) | export / transfer / import µs (median) | state bytes | median / 5 ms |"
echo "|---|---|---|---|---|---|---|---|"
for q in $QP_COUNTS; do
  g="mdt$q" port=$((19000 + RANDOM % 1000))
  # Long enough for every move; stopped once they are done.
  dur=$((MOVES * 3 + 10))
  hrun 2 --guest "$g-s" -- ib_write_bw -p "$port" -q "$q" "${BW_ARGS[@]}" -D "$dur" \
    >"$E2E_TMP/$g.server.out" 2>&1 &
  srv=$!
  hwait_port 2 "$port" "$srv" "$g"
  hrun 1 --guest "$g" -- ib_write_bw -p "$port" -q "$q" "${BW_ARGS[@]}" -D "$dur" "$(host_ip 2)" \
    >"$E2E_TMP/$g.client.out" 2>&1 &
  cli=$!
  HOSTS_WATCH=("$srv $E2E_TMP/$g.server.out" "$cli $E2E_TMP/$g.client.out")
  hwait_flowing 1 "$g" msgs_sent "$cli"
  want="$(for ((k = 0; k < q; k++)); do printf 'tcp/h2 '; done | sed 's/ $//')"
  MIG_DOWNTIMES=()
  ex=() tr=() im=() by=()
  from=1 to=3
  for ((m = 1; m <= MOVES; m++)); do
    hmigrate "$g" "$from" "$to"
    ex+=("$(mig_field export_us)") tr+=("$(mig_field transfer_us)") im+=("$(mig_field import_us)")
    by+=("$(mig_field bytes)")
    [[ $(mig_field qps) == "$q" ]] || fail "the move carried $(mig_field qps) QPs, not $q"
    hwait_route "$to" "$g" "$want" 10
    c0=$(hcount "$to" "$g" msgs_sent)
    sleep "$PAUSE"
    for ((k = 0; k < 200; k++)); do
      (($(hcount "$to" "$g" msgs_sent) > c0)) && break
      hcheck_alive
      nap 0.05
    done
    t=$from from=$to to=$t
  done
  HOSTS_WATCH=()
  kill_descendants "$cli"
  kill_descendants "$srv"
  wait "$cli" "$srv" 2>/dev/null || true
  read -r mn med mx < <(stats_of "${MIG_DOWNTIMES[@]}")
  ratio="$(awk -v m="$med" -v t="$TARGET_US" 'BEGIN {printf "%.2f", m / t}')"
  echo "| $(date +%F) | $machine | $q | $MOVES | $med ($mn–$mx) | $(median "${ex[@]}") / $(median "${tr[@]}") / $(median "${im[@]}") | $(median "${by[@]}") | $ratio |"
done
e2e_pass
