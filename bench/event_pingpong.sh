#!/usr/bin/env bash
# Event mode (completion channels, issue 25): Debian's unmodified `ibv_rc_pingpong -e` (both
# sides block in ibv_get_cq_event) through vrdma, server and client two guests of one backend,
# against a blocking TCP ping-pong over loopback (bench/tcp_pingpong, blocking reads), runs
# interleaved. Each BIN_DIR is one build (its own backend and library), so a build before and
# after a change are measured in the same run. With COUNT=1 the last run of each build is
# repeated under `strace -c -f` on the client: syscalls per round trip.
# Prints markdown table rows: date, machine, build, µs/iter median (min–max), TCP's, ratio.
# Usage: bench/event_pingpong.sh [RUNS (default 5)] [BIN_DIR ...(default build/release/bin)]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUNS="${1:-5}"
shift || true
BINS=("$@")
[[ ${#BINS[@]} -gt 0 ]] || BINS=("$ROOT/build/release/bin")
ARGS=(-e -s "${SIZE:-8}" -n "${ITERS:-20000}")

# shellcheck source-path=SCRIPTDIR/.. source=tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"
e2e_init "${BINS[0]}"

TCP_PP="${BINS[0]}/tcp_pingpong"
[[ -x $TCP_PP ]] || fail "$TCP_PP missing (build the release preset)"

# One backend per build, each on its own socket; e2e_cleanup stops the last one, we the others.
SOCKS=()
for i in "${!BINS[@]}"; do SOCKS+=("$E2E_TMP/vrdmad$i.sock"); done
use_build() {
  VRDMA="$(cd "${BINS[$1]}" && pwd)/vrdma"
  VRUN=("$VRDMA" run)
  export VRDMA_SOCKET="${SOCKS[$1]}"
}
stop_backends() {
  local i pid
  for i in "${!SOCKS[@]}"; do
    export VRDMA_SOCKET="${SOCKS[$i]}"
    pid="$(backend_pid)"
    [[ -z $pid ]] || kill -TERM "$pid" 2>/dev/null || true
  done
}
trap 'rc=$?; set +e; stop_backends; (exit $rc); e2e_cleanup' EXIT

declare -A vals
tcp=()
for ((r = 1; r <= RUNS; r++)); do
  "$TCP_PP" -s "${SIZE:-8}" -n "${ITERS:-20000}" >"$E2E_TMP/tcp$r.out" || fail "tcp_pingpong failed"
  tcp+=("$(usec_of "$E2E_TMP/tcp$r.out")")
  for i in "${!BINS[@]}"; do
    use_build "$i"
    run_pair "b$i.r$r" "ev-srv" "ev-cli" "${ARGS[@]}"
    vals[$i]+="$(usec_of "$E2E_TMP/b$i.r$r.client.out") "
  done
done
read -r tmed tmin tmax < <(printf '%s\n' "${tcp[@]}" | stats)
echo "| date | machine | build | runs | \`ibv_rc_pingpong ${ARGS[*]}\` µs/iter median (min–max) | \`tcp_pingpong\` µs/iter median (min–max) | vrdma / TCP |"
echo "|---|---|---|---|---|---|---|"
for i in "${!BINS[@]}"; do
  read -r med min max < <(tr ' ' '\n' <<<"${vals[$i]% }" | stats)
  echo "| $today | $machine | ${BINS[$i]} | $RUNS | $med ($min–$max) | $tmed ($tmin–$tmax) | $(ratio "$med" "$tmed") |"
done

if [[ ${COUNT:-0} == 1 ]]; then
  # Syscalls of the client per round trip (strace slows it; only the counts mean anything).
  for i in "${!BINS[@]}"; do
    use_build "$i"
    start_server "cnt$i" "ev-srv" "${ARGS[@]}"
    "${VRUN[@]}" --guest ev-cli -- strace -f -c -o "$E2E_TMP/cnt$i.strace" \
      "$PP_TOOL" -p "$PORT" "${ARGS[@]}" localhost >"$E2E_TMP/cnt$i.client.out" 2>&1 ||
      fail "client under strace failed"
    wait_pid "$SERVER_PID" 30
    echo "build ${BINS[$i]}: client syscalls per round trip (strace -c -f):"
    awk -v n="${ITERS:-20000}" '$NF ~ /^(read|write|poll|ppoll|futex|sched_yield)$/ {
      printf "  %-12s %.2f\n", $NF, $4 / n }' "$E2E_TMP/cnt$i.strace"
    # Context switches per round trip, without strace: the client's (perf stat) and the
    # backend's (/proc/PID/status, voluntary + involuntary, across the whole run).
    start_server "cs$i" "ev-srv" "${ARGS[@]}"
    bpid="$(backend_pid)"
    b0="$(awk '/ctxt_switches/ {s += $2} END {print s}' "/proc/$bpid/status")"
    "${VRUN[@]}" --guest ev-cli -- perf stat -x, -e context-switches -o "$E2E_TMP/cs$i.perf" \
      "$PP_TOOL" -p "$PORT" "${ARGS[@]}" localhost >"$E2E_TMP/cs$i.client.out" 2>&1 ||
      fail "client under perf stat failed"
    wait_pid "$SERVER_PID" 30
    b1="$(awk '/ctxt_switches/ {s += $2} END {print s}' "/proc/$bpid/status")"
    awk -F, -v n="${ITERS:-20000}" -v b=$((b1 - b0)) '$3 == "context-switches" {
      printf "  context switches per round trip: client %.2f, vrdmad %.2f\n", $1 / n, b / n }' \
      "$E2E_TMP/cs$i.perf"
  done
fi
e2e_pass
