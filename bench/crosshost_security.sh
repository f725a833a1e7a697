#!/usr/bin/env bash
# What authenticating and encrypting the transport between backends costs (TLS 1.3, AES-128-GCM:
# docs/ARCHITECTURE.md, "Trust across hosts"): the same perftest runs across two namespace hosts
# (tests/hosts/lib.sh) with the backends authenticated (--cluster-dir, the default) and insecure
# (--insecure, plain TCP), restarted between modes, runs interleaved; iperf3 and a raw TCP
# ping-pong on the same path in the same run. Prints markdown table rows.
# Needs root (ip netns). Usage: bench/crosshost_security.sh [BIN_DIR] [RUNS (default 5)]
set -euo pipefail
# Pinned to the backends' transport (--no-direct-remote, the transport whose TLS it measures).
HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-5}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
hosts_init "$BIN_DIR" 2
wait_mesh
need_tcp_pp
command -v iperf3 >/dev/null || fail "iperf3 missing (scripts/deps.sh installs it)"

# Restarts both backends authenticated (tls) or not (insecure) and checks what status says.
use_mode() {
  [[ $1 == tls ]] && HOSTS_INSECURE=0 || HOSTS_INSECURE=1
  kill_backend 1
  kill_backend 2
  start_backend 1
  start_backend 2
  wait_mesh
  local got
  got="$(hstatus_query 1 'my ($t) = grep { $_->{name} eq "tcp" } @{$j->{backend}{transports}};
                          $t->{security}')"
  [[ $got == "$1" ]] || fail "h1's transport is '$got', wanted '$1'"
}
# perftest h2 -> h1: TOOL ARGS...; prints the last result row's column COL (set before the call).
perf_col() {
  hperftest 1 2 "$@" >/dev/null
  result_rows "$E2E_TMP/$1.client.out" | awk -v c="$COL" '{print $c}' | tail -n 1
}
tcp_rtt() {
  local port=$((16000 + RANDOM % 1000)) srv
  hexec 1 "$TCP_PP" -s "$1" -n 20000 --server "$port" >/dev/null 2>&1 &
  srv=$!
  hwait_port 1 "$port" "$srv" tcp_pingpong
  hexec 2 "$TCP_PP" -s "$1" -n 20000 --client "$(host_ip 1)" "$port" >"$E2E_TMP/tcp.out" ||
    fail "tcp_pingpong"
  wait "$srv" || true
  usec_of "$E2E_TMP/tcp.out"
}

declare -A res
ROWS=("ib_write_bw -s 1048576 -D 2" "ib_write_bw -s 65536 -D 2" "ib_write_lat -s 8 -n 20000"
      "ib_send_lat -s 8 -n 20000")
for ((r = 1; r <= RUNS; r++)); do
  for mode in tls insecure; do
    use_mode "$mode"
    for cmd in "${ROWS[@]}"; do
      read -ra a <<<"$cmd"
      # bandwidth: BW average MB/s (column 4); latency: t_typical µs (column 5)
      [[ ${a[0]} == *_bw ]] && COL=4 || COL=5
      res["$cmd|$mode"]+="$(perf_col "${a[@]}") "
    done
  done
  res["iperf3 1048576"]+="$(iperf_mbs 1048576) "
  res["iperf3 65536"]+="$(iperf_mbs 65536) "
  res["tcp 8"]+="$(awk -v u="$(tcp_rtt 8)" 'BEGIN {printf "%.2f", u / 2}') "  # one way, as perftest
  log "run $r of $RUNS done"
done

med() { tr ' ' '\n' <<<"$1" | grep . | stats; }
echo "| date | machine | command (h2 -> h1) | runs | authenticated + encrypted median (min–max) | insecure median (min–max) | TCP peer median (min–max) | authenticated / insecure | authenticated / TCP |"
echo "|---|---|---|---|---|---|---|---|---|"
for cmd in "${ROWS[@]}"; do
  read -r tm tmin tmax < <(med "${res[$cmd|tls]}")
  read -r im imin imax < <(med "${res[$cmd|insecure]}")
  case $cmd in
    *"-s 1048576"*) peer="iperf3 1048576" unit="MB/s" ;;
    *"-s 65536"*) peer="iperf3 65536" unit="MB/s" ;;
    *) peer="tcp 8" unit="µs one way" ;;
  esac
  read -r pm pmin pmax < <(med "${res[$peer]}")
  echo "| $today | $machine | \`$cmd\` ($unit) | $RUNS | $tm ($tmin–$tmax) | $im ($imin–$imax) |" \
    "$pm ($pmin–$pmax) ${peer%% *} | $(ratio "$tm" "$im") | $(ratio "$tm" "$pm") |"
done
