#!/usr/bin/env bash
# RC across hosts on an impaired network (issue 30): under each condition of the impairer
# (tests/hosts/impair_lib.sh: two namespace hosts, a user-space netem between them), in the same
# run and on the same path, vrdma against plain TCP:
#  - bandwidth h2 -> h1: ib_write_bw -D 3 (timeout 14) vs iperf3 -t 3 (one stream);
#  - latency: ibv_rc_pingpong -s 8 (timeout 14, hard-coded) vs bench/tcp_pingpong -s 8.
# A vrdma run that fails says so in its cell ("fails: ..."), and the table goes on.
# Prints markdown table rows. Needs root (ip netns).
# Usage: bench/impaired.sh [BIN_DIR (default build/release/bin)] [RUNS (default 1)]
# IMPAIRED_CONDITIONS: a ';'-separated list of impair options to use instead of the default set.
# IMPAIRED_KEEP_CONNECTION=1: keep the backends (and their connection) across conditions.
set -euo pipefail
# Pinned to the backends' transport (--no-direct-remote, the transport of issue 30).
HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-1}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/impair_lib.sh
source "$ROOT/tests/hosts/impair_lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
impaired_hosts_init "$BIN_DIR"
wait_mesh

need_tcp_pp
command -v iperf3 >/dev/null || fail "iperf3 missing (scripts/deps.sh installs it)"

IFS=';' read -ra conditions <<<"${IMPAIRED_CONDITIONS:-;--delay 10;--delay 50 --jitter 10;\
--delay 200;--delay 1 --loss 1;--delay 1 --loss 10;--delay 5 --reorder 25 --dup 5 --corrupt 1;\
--delay 10 --rate 100}"

# Round trips for about two seconds of ping-pong at ONE_WAY ms each way (at least 200).
pp_iters() { awk -v d="$1" 'BEGIN {n = d > 0 ? int(1000 / d) : 2000; print n < 200 ? n + 5 : n}'; }
# The one-way delay an option list sets (0 if none).
delay_of() { [[ " $1 " =~ " --delay "([0-9.]+) ]] && echo "${BASH_REMATCH[1]}" || echo 0; }

# Why a vrdma run failed: the first error line of its output FILE. Usage: why FILE
why() { grep -m1 -E "Failed|failed|error|Error|exceeded" "$1" | cut -c1-60 || echo "exited"; }

# ib_write_bw -D 3 h2 -> h1; prints MB/s or "fails: ...".
vrdma_bw() {
  if (check_write_bw bench_bw 3 >/dev/null 2>&1); then
    result_rows "$E2E_TMP/bench_bw.client.out" | tail -n 1 | awk '{print $4}'
  else
    echo "fails: $(why "$E2E_TMP/bench_bw.client.out")"
  fi
}
# iperf3 -t 3 h2 -> h1; prints MB/s.
tcp_bw() {
  local ipid
  hexec 1 iperf3 -s -1 -p 5201 >/dev/null 2>&1 &
  ipid=$!
  hwait_port 1 5201 "$ipid" iperf3
  hexec 2 iperf3 -c "$(host_ip 1)" -p 5201 -t 3 -J |
    perl -MJSON::PP -0777 -ne 'printf "%.2f", decode_json($_)->{end}{sum_received}{bits_per_second} / 8e6'
  wait "$ipid" || true
}
# ibv_rc_pingpong -s 8 -n N h2 -> h1; prints usec/iter or "fails: ...".
vrdma_lat() {
  if (check_pingpong bench_pp "$1" 120 -s 8 >/dev/null 2>&1); then
    usec_of "$E2E_TMP/bench_pp.client.out"
  else
    echo "fails: $(why "$E2E_TMP/bench_pp.client.out")"
  fi
}
# A ratio, or "-" when vrdma's cell is a failure.
ratio_or() { [[ $1 =~ ^[0-9.]+$ ]] && ratio "$1" "$2" || echo "-"; }

echo "| date | machine | impairment (each way) | run | vrdma ib_write_bw -D 3 MB/s | iperf3 -t 3 MB/s | vrdma / TCP | vrdma ibv_rc_pingpong -s 8 µs/iter | tcp_pingpong -s 8 µs/iter | vrdma / TCP |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for cond in "${conditions[@]}"; do
  read -ra args <<<"$cond"
  impair_set "${args[@]}" 2>/dev/null
  # The backends' connection starts on the path as it is now, as iperf3's does: one that was
  # set up on a faster path keeps TCP's estimates of that path for a while (BENCHMARKS.md).
  if [[ ${IMPAIRED_KEEP_CONNECTION:-0} != 1 ]]; then
    kill_backend 1
    kill_backend 2
    start_backend 1
    start_backend 2
    wait_mesh
  fi
  n=$(pp_iters "$(delay_of "$cond")")
  for ((r = 1; r <= RUNS; r++)); do
    vb=$(vrdma_bw)
    tb=$(tcp_bw)
    vl=$(vrdma_lat "$n")
    tl=$(tcp_pp -s 8 -n "$n")
    echo "| $today | $machine | \`${cond:-none}\` | $r | $vb | $tb | $(ratio_or "$vb" "$tb") |" \
      "$vl (n $n) | $tl | $(ratio_or "$vl" "$tl") |"
  done
done
e2e_pass
