#!/usr/bin/env bash
# Latency of Debian's unmodified ibv_rc_pingpong through vrdma (server and client on this host,
# two guests of one backend), against the peer a program without RDMA would use: the same
# ping-pong over loopback TCP (bench/tcp_pingpong), measured in the same run, runs interleaved.
# Prints markdown table rows: date, machine, command, µs/iter of both, and the ratio.
# Usage: bench/pingpong.sh [BIN_DIR (default build/release/bin)] [RUNS (default 5)]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-5}"

# shellcheck source-path=SCRIPTDIR/.. source=tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
e2e_init "$BIN_DIR"

CONFIGS=(
  "-s 8 -n 100000"
  "-s 65536 -n 10000"
)


TCP_PP="$BIN_DIR/tcp_pingpong"
[[ -x $TCP_PP ]] || fail "$TCP_PP missing (build the release preset)"


echo "| date | machine | command | runs | vrdma µs/iter median (min–max) | TCP loopback µs/iter median (min–max) | TCP / vrdma |"
echo "|---|---|---|---|---|---|---|"
for cfg in "${CONFIGS[@]}"; do
  read -ra args <<<"$cfg"
  vals=()
  peer=()
  for ((r = 1; r <= RUNS; r++)); do
    run_pair "run$r" bench-srv bench-cli "${args[@]}"
    v="$(usec_of "$E2E_TMP/run$r.client.out")"
    [[ -n $v ]] || fail "no usec/iter in run $r"
    vals+=("$v")
    "$TCP_PP" "${args[@]}" >"$E2E_TMP/tcp$r.out" || fail "tcp_pingpong failed"
    peer+=("$(usec_of "$E2E_TMP/tcp$r.out")")
  done
  read -r med min max < <(printf '%s\n' "${vals[@]}" | stats)
  read -r pmed pmin pmax < <(printf '%s\n' "${peer[@]}" | stats)
  ratio="$(awk -v a="$pmed" -v b="$med" 'BEGIN {printf "%.2f", a / b}')"
  echo "| $today | $machine | \`vrdma run -- ibv_rc_pingpong $cfg\` | $RUNS | $med ($min–$max) | $pmed ($pmin–$pmax) | $ratio |"
done
e2e_pass
