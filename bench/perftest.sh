#!/usr/bin/env bash
# perftest through vrdma on one host (two guests of one backend) against loopback TCP, measured
# in the same run: latency (ib_send_lat, ib_write_lat, ib_read_lat vs bench/tcp_pingpong) and
# bandwidth (ib_send_bw, ib_write_bw, ib_read_bw vs iperf3, one stream) for 8 B .. 4 MiB.
# Prints markdown tables. Usage: bench/perftest.sh [BIN_DIR (default build/release/bin)]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
# shellcheck source-path=SCRIPTDIR/.. source=tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"
e2e_init "$BIN_DIR"
command -v iperf3 >/dev/null ||
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iperf3 >/dev/null 2>&1 ||
  fail "iperf3 is needed (apt-get install iperf3)"

SIZES=(8 64 512 4096 65536 1048576 4194304)
LAT_ITERS=500
BW_ITERS=200
cpu="$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)"
echo "Date $(date +%F), $(nproc) CPUs (${cpu:-unknown}), command: bench/perftest.sh"
echo

# One-way latency of the TCP peer: half its round trip, as perftest's send/write latency is.
tcp_oneway() {
  "$BIN_DIR/tcp_pingpong" -s "$1" -n "$LAT_ITERS" | awk '/usec\/iter/ {printf "%.2f", $(NF-1) / 2}'
}

echo "| size | ib_send_lat µs | ib_write_lat µs | ib_read_lat µs (round trip) | TCP one-way µs | TCP / ib_send_lat |"
echo "|---|---|---|---|---|---|"
for s in "${SIZES[@]}"; do
  row=("$s")
  for tool in ib_send_lat ib_write_lat ib_read_lat; do
    run_perftest "$tool" -s "$s" -n "$LAT_ITERS"
    # t_typical (the median) is column 5.
    row+=("$(result_rows "$E2E_TMP/$tool.client.out" | awk '{print $5}' | tail -n 1)")
  done
  tcp="$(tcp_oneway "$s")"
  ratio="$(awk -v a="$tcp" -v b="${row[1]}" 'BEGIN {printf "%.2f", a / b}')"
  echo "| $s | ${row[1]} | ${row[2]} | ${row[3]} | $tcp | $ratio |"
done
echo

iperf_port="$(free_port)"
iperf3 -s -B 127.0.0.1 -p "$iperf_port" >"$E2E_TMP/iperf3.server.out" 2>&1 &
nap 0.3
echo "| size | ib_send_bw MB/s | ib_write_bw MB/s | ib_read_bw MB/s | TCP (iperf3) MB/s | ib_write_bw / TCP |"
echo "|---|---|---|---|---|---|"
for s in "${SIZES[@]}"; do
  row=("$s")
  for tool in ib_send_bw ib_write_bw ib_read_bw; do
    run_perftest "$tool" -s "$s" -n "$BW_ITERS"
    row+=("$(result_rows "$E2E_TMP/$tool.client.out" | awk '{print $4}' | tail -n 1)")
  done
  # iperf3 writes at most 1 MiB per call; larger sizes stream in 1 MiB writes.
  tcp="$(iperf3 -c 127.0.0.1 -p "$iperf_port" -l "$((s < 1048576 ? s : 1048576))" -t 2 -f M |
    awk '/receiver/ {print $(NF-2)}')"
  ratio="$(awk -v a="${row[2]}" -v b="$tcp" 'BEGIN {printf "%.2f", a / b}')"
  echo "| $s | ${row[1]} | ${row[2]} | ${row[3]} | $tcp | $ratio |"
done
e2e_pass
