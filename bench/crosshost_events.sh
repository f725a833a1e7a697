#!/usr/bin/env bash
# Event mode across hosts on both paths: Debian's ibv_rc_pingpong -e -s 8 (both ends sleep in
# ibv_get_cq_event) from h2 to h1 (the namespace hosts of tests/hosts/lib.sh), with the backends
# restarted before each run either with no options ("direct": the default, the libraries fire
# their CQs' channels) or with --no-direct-remote ("backends"), against the blocking TCP
# ping-pong (bench/tcp_pingpong) in the same rounds, ROUNDS interleaved. Prints each round and
# a markdown row of medians (min-max) with the ratios to TCP (issue 25: within 1.2x).
# Needs root (ip netns).
# Usage: bench/crosshost_events.sh [BIN_DIR (default build/release/bin)] [ROUNDS (default 5)]
#        (EV_ITERS: round trips per run, default 20000)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
ROUNDS="${2:-5}"
ITERS="${EV_ITERS:-20000}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
hosts_init "$BIN_DIR" 2
wait_mesh
need_tcp_pp

# One ibv_rc_pingpong -e run on PATH; its usec/iter in US. (Not in a command substitution: the
# backends it starts must be the ones the next run stops.)
ev_run() {
  local path=$1 name=$2
  [[ $path == backends ]] && HOSTS_VRDMAD_ARGS=--no-direct-remote || HOSTS_VRDMAD_ARGS=""
  restart_backends
  wait_mesh
  hpair "$name" 1 2 -e -s 8 -n "$ITERS" >/dev/null
  US="$(usec_of "$E2E_TMP/$name.client.out")"
}

di=() be=() tcp=()
for ((r = 1; r <= ROUNDS; r++)); do
  ev_run direct "evd$r"
  di+=("$US")
  ev_run backends "evb$r"
  be+=("$US")
  tcp+=("$(tcp_pp -s 8 -n "$ITERS")")
  log "round $r: direct ${di[-1]} backends ${be[-1]} blocking TCP ${tcp[-1]} usec/iter"
done
read -r dmed dmin dmax < <(printf '%s\n' "${di[@]}" | stats)
read -r bmed bmin bmax < <(printf '%s\n' "${be[@]}" | stats)
read -r tmed tmin tmax < <(printf '%s\n' "${tcp[@]}" | stats)
echo "| date | ibv_rc_pingpong -e -s 8 -n $ITERS, runs | direct µs/iter | backends µs/iter | blocking TCP µs/iter | direct / TCP | backends / TCP |"
echo "|---|---|---|---|---|---|---|"
echo "| $(date +%F) | $ROUNDS | $dmed ($dmin–$dmax) | $bmed ($bmin–$bmax) | $tmed ($tmin–$tmax) |" \
  "$(ratio "$dmed" "$tmed") | $(ratio "$bmed" "$tmed") |"
e2e_pass
