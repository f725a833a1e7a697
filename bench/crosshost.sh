#!/usr/bin/env bash
# Cross-host latency and bandwidth through vrdma's TCP transport, against raw TCP on the same
# pair of namespace hosts (tests/hosts/lib.sh), measured in the same run, runs interleaved:
#  - latency: Debian's ibv_rc_pingpong (h2 -> h1) vs bench/tcp_pingpong --client/--server, the
#    same ping-pong over one TCP connection with TCP_NODELAY and blocking reads, and with both
#    ends spinning on non-blocking ones (--busy: what a busy-polling program gets from TCP);
#  - event mode: ibv_rc_pingpong -e (both ends block in ibv_get_cq_event) vs the blocking TCP
#    ping-pong, 8 bytes (issue 25: within 1.2x);
#  - bandwidth: perftest's ib_write_bw vs iperf3 (one stream) h2 -> h1;
#  - both also vs UCX over its TCP transport (ucx_perftest, UCX_TLS=tcp on the hosts' eth0):
#    tag_lat (its one-way latency doubled, a round trip like the others) and ucp_put_bw;
#  - one-sided operations the peer's library answers, message rate: ib_read_bw and
#    ib_atomic_bw (8 B) against UCX tcp's ucp_get and ucp_add;
#  - with the direct path, perftest's ib_{send,write,read}_lat with the library's hub thread
#    polling for 200 µs after a request (the default) and sleeping at once (VRDMA_POLL_SPIN_US=0).
# Prints markdown table rows. Needs root (ip netns).
# Usage: bench/crosshost.sh [BIN_DIR (default build/release/bin)] [RUNS (default 5)]
# vrdma's rows take the direct path across backends (the libraries talk TCP to each other;
# docs/ARCHITECTURE.md; the default) and say "direct"; HOSTS_VRDMAD_ARGS=--no-direct-remote: they
# go through the backends' transport and say "mediated".
# CORUN=K: K more processes that do nothing but sched_yield() run beside the latency rows (the
# CPUs a real host's other busy-polling programs would take; the bandwidth rows run without).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-5}"
CORUN="${CORUN:-0}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
hosts_init "$BIN_DIR" 2
wait_mesh

need_tcp_pp
command -v iperf3 >/dev/null || fail "iperf3 missing (scripts/deps.sh installs it)"
command -v ucx_perftest >/dev/null || fail "ucx_perftest missing (scripts/deps.sh installs ucx-utils)"

# One table row: LABEL, then the vrdma numbers in vals[], raw TCP's in peer[], UCX's in ucx[].
row() {
  read -r med min max < <(printf '%s\n' "${vals[@]}" | stats)
  read -r pmed pmin pmax < <(printf '%s\n' "${peer[@]}" | stats)
  read -r umed umin umax < <(printf '%s\n' "${ucx[@]}" | stats)
  echo "| $today | $machine | $1 | $RUNS | $med ($min–$max) | $pmed ($pmin–$pmax) |" \
    "$umed ($umin–$umax) | $(ratio "$med" "$pmed") | $(ratio "$med" "$umed") |"
}

# A row of two columns: LABEL, then vrdma's numbers in vals[] and the peer's in peer[].
pair_row() {
  read -r med min max < <(printf '%s\n' "${vals[@]}" | stats)
  read -r pmed pmin pmax < <(printf '%s\n' "${peer[@]}" | stats)
  echo "| $today | $machine | $1 | $RUNS | $med ($min–$max) | $pmed ($pmin–$pmax) | $(ratio "$med" "$pmed") |"
}

# (On a failure hosts_cleanup kills them with every other descendant.)
corun_pids=()
corun_label=""
stop_corun() {
  local p
  for p in "${corun_pids[@]}"; do { kill "$p" && wait "$p"; } 2>/dev/null || true; done
  corun_pids=()
}
for ((k = 0; k < CORUN; k++)); do
  python3 -c $'import os\nwhile True: os.sched_yield()' &
  corun_pids+=($!)
done
mode_label=" direct"
[[ " ${HOSTS_VRDMAD_ARGS:-} " == *" --no-direct-remote "* ]] && mode_label=" mediated"
if ((CORUN > 0)); then
  corun_label=" (+$CORUN co-runners)"
  log "$CORUN yielding co-runners beside the latency rows"
fi
echo "| date | machine | command (h2 -> h1) | runs | vrdma µs/iter median (min–max) | raw TCP µs/iter median (min–max) | UCX tcp µs/iter median (min–max) | vrdma / TCP | vrdma / UCX | busy-polling raw TCP µs/iter median (min–max) | vrdma / busy TCP |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for cfg in "-s 8 -n 20000" "-s 4096 -n 20000" "-s 65536 -n 5000"; do
  read -ra args <<<"$cfg"
  vals=() peer=() ucx=() busy=()
  for ((r = 1; r <= RUNS; r++)); do
    hpair "run$r" 1 2 "${args[@]}" >/dev/null
    vals+=("$(usec_of "$E2E_TMP/run$r.client.out")")
    peer+=("$(tcp_pp "${args[@]}")")
    busy+=("$(tcp_pp --busy "${args[@]}")")
    ucx+=("$(ucx_tcp tag_lat "${args[1]}" "${args[3]}" | awk '{printf "%.2f", 2 * $4}')")
  done
  read -r bmed bmin bmax < <(printf '%s\n' "${busy[@]}" | stats)
  read -r med _ < <(printf '%s\n' "${vals[@]}" | stats)
  echo "$(row "\`ibv_rc_pingpong $cfg\`$mode_label$corun_label") $bmed ($bmin–$bmax) | $(ratio "$med" "$bmed") |"
done
echo
echo "| date | machine | command (h2 -> h1) | runs | vrdma µs/iter median (min–max) | blocking raw TCP µs/iter median (min–max) | vrdma / TCP |"
echo "|---|---|---|---|---|---|---|"
vals=() peer=()
for ((r = 1; r <= RUNS; r++)); do
  hpair "ev$r" 1 2 -e -s 8 -n 20000 >/dev/null
  vals+=("$(usec_of "$E2E_TMP/ev$r.client.out")")
  peer+=("$(tcp_pp -s 8 -n 20000)")
done
pair_row "\`ibv_rc_pingpong -e -s 8 -n 20000\`$mode_label$corun_label"
stop_corun

echo
echo "| date | machine | command (h2 -> h1) | runs | vrdma MB/s median (min–max) | iperf3 MB/s median (min–max) | UCX tcp ucp_put_bw MB/s median (min–max) | vrdma / TCP | vrdma / UCX |"
echo "|---|---|---|---|---|---|---|---|---|"
for size in 4096 65536 1048576; do
  vals=() peer=() ucx=()
  for ((r = 1; r <= RUNS; r++)); do
    hperftest 1 2 ib_write_bw -s "$size" -D 2 >/dev/null
    vals+=("$(result_rows "$E2E_TMP/ib_write_bw.client.out" | awk '{print $4}' | tail -n 1)")
    hexec 1 iperf3 -s -1 -p 5201 >/dev/null 2>&1 &
    ipid=$!
    hwait_port 1 5201 "$ipid" iperf3
    peer+=("$(hexec 2 iperf3 -c "$(host_ip 1)" -p 5201 -t 2 -l "$size" -J |
      perl -MJSON::PP -0777 -ne 'printf "%.2f", decode_json($_)->{end}{sum_received}{bits_per_second} / 8e6')")
    wait "$ipid" || true
    # About two seconds at a few hundred MB/s, as the others.
    ucx+=("$(ucx_tcp ucp_put_bw "$size" $((400000000 / size)) | awk '{printf "%.2f", $6}')")
  done
  row "\`ib_write_bw -s $size -D 2\`$mode_label vs \`iperf3 -t 2 -l $size\`"
done

# One-sided operations the peer's library answers (its program only waits): 8 B READs and
# fetch-and-adds, 16 in flight (perftest's -o), message rate, against UCX's over TCP (ucp_get,
# ucp_add; UCX answers a get through its progress thread: ~1 ms each, so few of them).
echo
echo "| date | machine | command (h2 -> h1) | runs | vrdma k msg/s median (min–max) | UCX tcp k msg/s median (min–max) | vrdma / UCX |"
echo "|---|---|---|---|---|---|---|"
for cfg in "ib_read_bw ucp_get 3000" "ib_atomic_bw ucp_add 200000"; do
  read -r tool utest uiters <<<"$cfg"
  vals=() peer=()
  for ((r = 1; r <= RUNS; r++)); do
    hperftest 1 2 "$tool" -s 8 -D 2 >/dev/null
    vals+=("$(result_rows "$E2E_TMP/$tool.client.out" | awk '{printf "%.2f", $5 * 1000}' | tail -n 1)")
    peer+=("$(ucx_tcp "$utest" 8 "$uiters" | awk '{printf "%.2f", $8 / 1e3}')")
  done
  pair_row "\`$tool -s 8 -D 2\`$mode_label vs \`$utest\`"
done

# The direct path's hub thread: polling for 200 µs after a request (the default) against sleeping
# at once (VRDMA_POLL_SPIN_US=0), runs interleaved; perftest's one-way latency, typical and average.
# t_typical and t_avg of the last hperftest TOOL.
lat_of() { result_rows "$E2E_TMP/$1.client.out" | awk '{print $5, $6}' | tail -n 1; }
if [[ $mode_label == " direct" ]]; then
  echo
  echo "| date | machine | command (h2 -> h1) | runs | hub polls 200 µs: t_typical µs | t_avg µs | VRDMA_POLL_SPIN_US=0: t_typical µs | t_avg µs | t_avg 200 µs / 0 |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for tool in ib_send_lat ib_write_lat ib_read_lat; do
    typ=() avg=() typ0=() avg0=()
    for ((r = 1; r <= RUNS; r++)); do
      hperftest 1 2 "$tool" -s 8 -n 5000 >/dev/null
      read -r t a < <(lat_of "$tool")
      typ+=("$t") avg+=("$a")
      VRDMA_POLL_SPIN_US=0 hperftest 1 2 "$tool" -s 8 -n 5000 >/dev/null
      read -r t a < <(lat_of "$tool")
      typ0+=("$t") avg0+=("$a")
    done
    read -r tm tmin tmax < <(printf '%s\n' "${typ[@]}" | stats)
    read -r am amin amax < <(printf '%s\n' "${avg[@]}" | stats)
    read -r tm0 tmin0 tmax0 < <(printf '%s\n' "${typ0[@]}" | stats)
    read -r am0 amin0 amax0 < <(printf '%s\n' "${avg0[@]}" | stats)
    echo "| $today | $machine | \`$tool -s 8 -n 5000\`$mode_label | $RUNS | $tm ($tmin–$tmax) |" \
      "$am ($amin–$amax) | $tm0 ($tmin0–$tmax0) | $am0 ($amin0–$amax0) | $(ratio "$am" "$am0") |"
  done
fi
e2e_pass
