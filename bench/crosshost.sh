#!/usr/bin/env bash
# Cross-host latency and bandwidth through vrdma's TCP transport, against raw TCP on the same
# pair of namespace hosts (tests/hosts/lib.sh), measured in the same run, runs interleaved:
#  - latency: Debian's ibv_rc_pingpong (h2 -> h1) vs bench/tcp_pingpong --client/--server, the
#    same ping-pong over one TCP connection with TCP_NODELAY and blocking reads;
#  - bandwidth: perftest's ib_write_bw vs iperf3 (one stream) h2 -> h1.
# Prints markdown table rows. Needs root (ip netns).
# Usage: bench/crosshost.sh [BIN_DIR (default build/release/bin)] [RUNS (default 5)]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-5}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
hosts_init "$BIN_DIR" 2
wait_mesh

TCP_PP="$HOSTS_BIN/tcp_pingpong"
[[ -x $TCP_PP ]] || fail "$TCP_PP missing (build the release preset)"
command -v iperf3 >/dev/null || fail "iperf3 missing (scripts/deps.sh installs it)"
cpu="$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)"
machine="$(nproc) CPUs, ${cpu:-unknown CPU}"
today="$(date +%F)"

stats() {
  sort -g | awk '{a[NR] = $1} END {m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2;
                                   printf "%.2f %.2f %.2f\n", m, a[1], a[NR]}'
}
usec_of() { awk '/usec\/iter/ {print $(NF-1)}' "$1"; }
# One table row: LABEL, then the vrdma numbers in vals[], the TCP ones in peer[].
row() {
  read -r med min max < <(printf '%s\n' "${vals[@]}" | stats)
  read -r pmed pmin pmax < <(printf '%s\n' "${peer[@]}" | stats)
  ratio="$(awk -v a="$med" -v b="$pmed" 'BEGIN {printf "%.2f", a / b}')"
  echo "| $today | $machine | $1 | $RUNS | $med ($min–$max) | $pmed ($pmin–$pmax) | $ratio |"
}

# Raw TCP ping-pong h2 -> h1 with ARGS; prints usec/iter.
tcp_pp() {
  local port=$((16000 + RANDOM % 1000)) srv k
  hexec 1 "$TCP_PP" "$@" --server "$port" >/dev/null 2>&1 &
  srv=$!
  hwait_port 1 "$port" "$srv" tcp_pingpong
  hexec 2 "$TCP_PP" "$@" --client "$(host_ip 1)" "$port" >"$E2E_TMP/tcp.out" || fail "tcp_pingpong"
  wait "$srv" || true
  usec_of "$E2E_TMP/tcp.out"
}

echo "| date | machine | command (h2 -> h1) | runs | vrdma µs/iter median (min–max) | raw TCP µs/iter median (min–max) | vrdma / TCP |"
echo "|---|---|---|---|---|---|---|"
for cfg in "-s 8 -n 20000" "-s 4096 -n 20000" "-s 65536 -n 5000"; do
  read -ra args <<<"$cfg"
  vals=() peer=()
  for ((r = 1; r <= RUNS; r++)); do
    hpair "run$r" 1 2 "${args[@]}" >/dev/null
    vals+=("$(usec_of "$E2E_TMP/run$r.client.out")")
    peer+=("$(tcp_pp "${args[@]}")")
  done
  row "\`ibv_rc_pingpong $cfg\`"
done

echo
echo "| date | machine | command (h2 -> h1) | runs | vrdma MB/s median (min–max) | iperf3 MB/s median (min–max) | vrdma / TCP |"
echo "|---|---|---|---|---|---|---|"
for size in 4096 65536 1048576; do
  vals=() peer=()
  for ((r = 1; r <= RUNS; r++)); do
    hperftest 1 2 ib_write_bw -s "$size" -D 2 >/dev/null
    vals+=("$(result_rows "$E2E_TMP/ib_write_bw.client.out" | awk '{print $4}' | tail -n 1)")
    hexec 1 iperf3 -s -1 -p 5201 >/dev/null 2>&1 &
    ipid=$!
    hwait_port 1 5201 "$ipid" iperf3
    peer+=("$(hexec 2 iperf3 -c "$(host_ip 1)" -p 5201 -t 2 -l "$size" -J |
      perl -MJSON::PP -0777 -ne 'printf "%.2f", decode_json($_)->{end}{sum_received}{bits_per_second} / 8e6')")
    wait "$ipid" || true
  done
  row "\`ib_write_bw -s $size -D 2\` vs \`iperf3 -t 2 -l $size\`"
done
e2e_pass
