#!/usr/bin/env bash
# Where a cross-host round trip goes: runs Debian's ibv_rc_pingpong h2 -> h1 through vrdma's
# TCP transport (the namespace hosts of tests/hosts/lib.sh) and records the scheduler for
# SECONDS in the middle of it (perf sched). Prints the round trip, the context switches of the
# pingpongs and of the backends in that window, and the switches per round trip.
# Needs root (ip netns) and perf (Debian's linux-perf).
# Usage: bench/crosshost_sched.sh [BIN_DIR (default build/release/bin)] [ITERS (default 100000)]
#        [SECONDS (default 2)]
set -euo pipefail
# Pinned to the backends' transport (--no-direct-remote, what it measures).
HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
ITERS="${2:-100000}"
SECS="${3:-2}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
command -v perf >/dev/null || fail "perf missing (apt-get install -y linux-perf)"
hosts_init "$BIN_DIR" 2
wait_mesh

data="$E2E_TMP/sched.data"
# Starts once the pair runs (the client's first iterations are connection set-up).
(sleep 3 && perf sched record -o "$data" -- sleep "$SECS" >"$E2E_TMP/perf.out" 2>&1) &
rec=$!
hpair sched 1 2 -s 8 -n "$ITERS" >/dev/null
wait "$rec" || fail "perf sched record: $(tail -n 3 "$E2E_TMP/perf.out")"
usec="$(awk '/usec\/iter/ {print $(NF-1)}' "$E2E_TMP/sched.client.out")"
[[ -n $usec ]] || fail "no round trip in the client's output"
perf sched latency -i "$data" 2>/dev/null >"$E2E_TMP/latency.txt"
switches() { awk -F'|' -v c="$1" '$1 ~ c {gsub(/ /, "", $3); s += $3} END {print s + 0}' \
  "$E2E_TMP/latency.txt"; }
pp="$(switches ibv_rc_pingpong)"
be="$(switches vrdmad)"
awk -v u="$usec" -v s="$SECS" -v pp="$pp" -v be="$be" 'BEGIN {
  trips = s * 1e6 / u
  printf "round trip %.2f us; in %d s (~%.0f round trips): pingpong switches %d, backend switches %d\n", u, s, trips, pp, be
  printf "context switches per round trip: %.1f\n", (pp + be) / trips
}'
e2e_pass
