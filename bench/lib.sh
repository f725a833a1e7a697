# Helpers the benchmark scripts share (sourced).
# shellcheck shell=bash

# Median, min and max of the numbers on stdin, one a line: "MED MIN MAX".
stats() {
  sort -g | awk '{a[NR] = $1} END {m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2;
                                   printf "%.2f %.2f %.2f\n", m, a[1], a[NR]}'
}
# usec/iter of an ibv_*_pingpong or tcp_pingpong output file.
usec_of() { awk '/usec\/iter/ {print $(NF-1)}' "$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
# What each table row names: the machine and the day.
cpu="$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)"
machine="$(nproc) CPUs, ${cpu:-unknown CPU}"
today="$(date +%F)"
# iperf3, one stream h2 -> h1 for 2 s with writes of $1 bytes: MB/s received (namespace hosts,
# tests/hosts/lib.sh).
iperf_mbs() {
  hexec 1 iperf3 -s -1 -p 5201 >/dev/null 2>&1 &
  local ipid=$!
  hwait_port 1 5201 "$ipid" iperf3
  hexec 2 iperf3 -c "$(host_ip 1)" -p 5201 -t 2 -l "$1" -J |
    perl -MJSON::PP -0777 -ne 'printf "%.2f", decode_json($_)->{end}{sum_received}{bits_per_second} / 8e6'
  wait "$ipid" || true
}
