#!/usr/bin/env bash
# Downtime of live migration under load: ib_write_bw -q Q (client guest on h1, server on h2,
# 4 KiB WRITEs, 16 in flight per QP) runs while the client's guest moves h1 -> h3 -> h1 ...
# (vrdma migrate between the backends of three namespace hosts, tests/hosts/lib.sh), MOVES moves
# per QP count; after each move a pause, and the next move only once the guest has sent through
# the new route. The downtime is what `vrdma migrate` reports: the time the guest's device is
# frozen (export on the source, transfer of the state and its descriptors, import on the
# target), until the target serves it; when the source read the target's answer is shown beside
# it (the source may wait for a CPU after the target has taken over). Prints a markdown table:
# QPs, moves, downtime median (min-max), the median's parts, the answer's time, state size, and
# the median against the 5 ms target.
# The command's whole time is shown too: with the direct path across backends (MIG_DIRECT=1)
# it includes the QPs' return to the backends before the freeze (their libraries settle what is
# in flight between them; `vrdma migrate` asks every 10 ms until they have), during which the
# guest's QPs go on, on the backends once each has settled.
# Needs root (ip netns).
# Usage: bench/migrate_downtime.sh [BIN_DIR (default build/release/bin)] [MOVES (default 10)]
#        [QP counts (default "1 8 64")]   (MIG_BW_ARGS: ib_write_bw's other options, default
#        "-s 4096 -t 16"; "-s 4096" is perftest's default depth, 128 in flight per QP;
#        MIG_PAUSE: the pause after each move, default 0.3 s; MIG_DIRECT=1: the direct path across
#        backends, the default configuration, instead of the backends' transport)
set -euo pipefail
DIRECT="${MIG_DIRECT:-0}"
# By default pinned to the backends' transport (--no-direct-remote, comparable with its earlier
# rows).
[[ $DIRECT == 1 ]] || HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"

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

path="backends"
[[ $DIRECT == 1 ]] && path="direct"
echo "| date | machine | path | ib_write_bw ${BW_ARGS[*]} -q | moves | downtime µs median (min–max) | export / transfer / import µs (median) | the answer read µs median (max) | state bytes | \`vrdma migrate\` ms median (max) | median / 5 ms |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
# Messages guest G's QPs on host I sent, through the backend or from its library.
sent() {
  local n
  n=$(hcount "$1" "$2" msgs_sent)
  [[ $DIRECT == 1 ]] && n=$((n + $(hcount "$1" "$2" direct_msgs_sent)))
  echo "$n"
}
# Waits up to 10 s until every QP of guest G on host I goes to h2 (tcp, or direct as well).
wait_routes() {
  local k got="" re='^tcp/h2$'
  [[ $DIRECT == 1 ]] && re='^(tcp|direct)/h2$'
  for ((k = 0; k < 200; k++)); do
    hcheck_alive
    got="$(hroute "$1" "$2" 2>/dev/null)" || got=""
    if [[ -n $got ]] && (($(wc -w <<<"$got") == $3)); then
      local w ok=1
      for w in $got; do [[ $w =~ $re ]] || ok=0; done
      ((ok)) && return 0
    fi
    nap 0.05
  done
  fail "guest $2 on h$1: QP routes '$got'"
}
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
  MIG_DOWNTIMES=()
  ex=() tr=() im=() by=() cmd=() an=()
  from=1 to=3
  for ((m = 1; m <= MOVES; m++)); do
    t0=$(date +%s%N)
    hmigrate "$g" "$from" "$to"
    cmd+=("$((($(date +%s%N) - t0) / 1000))")
    ex+=("$(mig_field export_us)") tr+=("$(mig_field transfer_us)") im+=("$(mig_field import_us)")
    by+=("$(mig_field bytes)") an+=("$(mig_field answered_us)")
    [[ $(mig_field qps) == "$q" ]] || fail "the move carried $(mig_field qps) QPs, not $q"
    wait_routes "$to" "$g" "$q"
    c0=$(sent "$to" "$g")
    sleep "$PAUSE"
    for ((k = 0; k < 200; k++)); do
      (($(sent "$to" "$g") > c0)) && break
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
  read -r _ cmed cmx < <(stats_of "${cmd[@]}")
  cms="$(awk -v m="$cmed" -v x="$cmx" 'BEGIN {printf "%.1f (%.1f)", m / 1000, x / 1000}')"
  read -r _ amed amx < <(stats_of "${an[@]}")
  echo "| $(date +%F) | $machine | $path | $q | $MOVES | $med ($mn–$mx) | $(median "${ex[@]}") / $(median "${tr[@]}") / $(median "${im[@]}") | $amed ($amx) | $(median "${by[@]}") | $cms | $ratio |"
done
e2e_pass
