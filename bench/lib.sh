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
# After the hosts are up: TCP_PP, the raw TCP ping-pong of the build (tcp_pp below).
need_tcp_pp() {
  TCP_PP="$HOSTS_BIN/tcp_pingpong"
  [[ -x $TCP_PP ]] || fail "$TCP_PP missing (build the release preset)"
}
# The raw TCP ping-pong (bench/tcp_pingpong, in $TCP_PP) h2 -> h1 with ARGS (namespace hosts,
# tests/hosts/lib.sh); prints usec/iter.
tcp_pp() {
  local port=$((16000 + RANDOM % 1000)) srv
  hexec 1 "$TCP_PP" "$@" --server "$port" >/dev/null 2>&1 &
  srv=$!
  hwait_port 1 "$port" "$srv" tcp_pingpong
  hexec 2 "$TCP_PP" "$@" --client "$(host_ip 1)" "$port" >"$E2E_TMP/tcp.out" || fail "tcp_pingpong"
  wait "$srv" || true
  usec_of "$E2E_TMP/tcp.out"
}
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
# ucx_perftest h2 -> h1 (namespace hosts, tests/hosts/lib.sh): TEST SIZE ITERS; prints the Final
# row (iters, typical/avg/overall latency µs, avg/overall MB/s, avg/overall msg/s). ucx_tcp: over
# UCX's TCP transport on the hosts' eth0; ucx_vrdma: over vrdma's device (rc_verbs, ud_verbs)
# through plain `vrdma run`.
ucx_tcp() {
  local pre="env UCX_TLS=tcp UCX_NET_DEVICES=eth0"
  ucx_pair hexec "$pre" "$pre" "$@"
}
ucx_vrdma() {  # (a guest of its own on each host)
  local pre="-- env UCX_TLS=rc_verbs,ud_verbs" n=$RANDOM
  ucx_pair hrun "--guest ucx-s$n $pre" "--guest ucx-c$n $pre" "$@"
}
ucx_pair() {  # RUNNER SERVER_PREFIX CLIENT_PREFIX TEST SIZE ITERS
  local run=$1 srv port=$((18000 + RANDOM % 1000))
  local -a spre cpre
  read -ra spre <<<"$2"
  read -ra cpre <<<"$3"
  shift 3
  "$run" 1 "${spre[@]}" ucx_perftest -p "$port" >/dev/null 2>&1 &
  srv=$!
  hwait_port 1 "$port" "$srv" ucx_perftest
  "$run" 2 "${cpre[@]}" ucx_perftest -p "$port" -t "$1" -s "$2" -n "$3" "$(host_ip 1)" \
    >"$E2E_TMP/ucx.out" 2>&1 || fail "ucx_perftest $*: $(tail -n 5 "$E2E_TMP/ucx.out")"
  wait "$srv" || true
  awk '/^Final:/ {$1 = ""; print; f = 1} END {exit !f}' "$E2E_TMP/ucx.out" ||
    fail "ucx_perftest $*: no Final row: $(tail -n 5 "$E2E_TMP/ucx.out")"
}
