#!/usr/bin/env bash
# Misbehaving but live guests cannot starve another or grow the backend: while one guest never
# polls its CQ (it must get IBV_EVENT_CQ_ERR), one floods its doorbell and one posts in a tight
# loop on 8 QPs, an ibv_rc_pingpong pair of another guest still completes (no timed assertion:
# the per-iteration latency alone and under the misbehavers is logged), and the backend's RSS
# does not grow with the lost completions.
# Usage: misbehave.sh BIN_DIR
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
MISBEHAVE="$(dirname "$VRDMA")/vrdma_misbehave"
[[ -x $MISBEHAVE ]] || fail "$MISBEHAVE is not built"

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
usec_per_iter() { awk '/usec\/iter/ {print $(NF-1)}' "$E2E_TMP/$1.client.out"; }

iters=500
run_pair alone pp-srv pp-cli -n "$iters"
bpid="$(backend_pid)"
[[ -n $bpid ]] || fail "no backend"
alone="$(usec_per_iter alone)"

secs=600  # outlasts the test: they are killed below, never stopped by their own clock
pids=()
for mode in no-poll doorbells post-forever; do
  vrun --guest "bad-$mode" -- "$MISBEHAVE" "$mode" "$secs" >"$E2E_TMP/$mode.out" 2>&1 &
  pids+=($!)
done
wait_status 'scalar grep { $_->{guest} =~ /^bad-/ } @{$j->{guests}}' 3 20 ||
  fail "the misbehaving guests did not start: $(status_json)"
sleep 2
rss0="$(rss_kib "$bpid")"
start_server busy pp-srv -n "$iters"
start_client busy pp-cli "$PORT" -n "$iters"
finish_pair busy "$SERVER_PID" "$CLIENT_PID" 90
busy="$(usec_per_iter busy)"
rss1="$(rss_kib "$bpid")"
for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || fail "a misbehaving guest ended early"; done
log "ibv_rc_pingpong -n $iters: $alone usec/iter alone, $busy usec/iter beside the misbehavers"
log "backend RSS: $rss0 KiB when they started, $rss1 KiB after the pingpong"

for p in "${pids[@]}"; do  # each is a subshell running `vrdma run`: kill what it runs too
  kill_descendants "$p"
  kill -KILL "$p" 2>/dev/null || true
done
grep -q '^CQ_ERR after' "$E2E_TMP/no-poll.out" ||
  fail "the guest that never polls got no IBV_EVENT_CQ_ERR: $(cat "$E2E_TMP/no-poll.out")"
# Completions nobody reaps are dropped, not queued: the backend's memory stays put. 8 MiB of
# slack for the pingpong's own sessions and the allocator's arenas; a queue of the no-poll
# guest's millions of lost completions would be hundreds of MiB.
# (Not under a sanitizer: ASan's quarantine makes RSS meaningless; LeakSanitizer checks instead.)
if [[ -z $SAN_PRELOAD ]]; then
  ((rss1 - rss0 < 8192)) || fail "backend RSS grew from $rss0 to $rss1 KiB"
fi
wait_status '$j->{totals}{sessions}' 0 15 || fail "sessions left: $(status_json)"
e2e_pass
