#!/usr/bin/env bash
# Issue 30: an outage (IMPAIR_OUTAGE_S, 12 s in the suite: longer than the 2 s TCP user
# timeout, so the connection is torn down and redialed as in the issue's 30 s; set 30 for its
# figure) between two hosts under a verified rc_stream with timeout 14 and
# retry_cnt 7 (0.54 s of budget): the client's send fails with IBV_WC_RETRY_EXC_ERR ("transport
# retry counter exceeded") about 1.3 s into the outage: TCP's first three retransmission
# backoffs (0.75 s) are waited out as a lossy path's, then the budget runs (the test allows 3 s on a noisy machine
# and logs the time); after link-up a new ibv_rc_pingpong -c works at once (logged: the time
# from link-up to its end). IMPAIR_DIRECT=1 (hosts.impaired_outage_direct): the stream on the
# default path, library to library; the libraries keep the same clock (ack_tick in
# src/verbs/remote_timeout.cc), where before their connection ended only after TCP's 5 s user
# timeout.
# Usage: impaired_outage.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=impair_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/impair_lib.sh"
impaired_hosts_init "${1:-}" --delay 1
wait_mesh

istream_start out
stream_runs out 2
impair_down
t_down=$IMPAIR_T
wait_pid "$cli" 20
[[ $WAIT_RC != 124 ]] || fail "out: the client still runs 20 s into the outage"
grep -q "transport retry counter exceeded" "$E2E_TMP/out.client.out" ||
  fail "out: the client ended otherwise: $(tail -n 3 "$E2E_TMP/out.client.out")"
failed_at=$(awk '/failed at/ {print $NF; exit}' "$E2E_TMP/out.client.out")
took=$(secs_between "$t_down" "$failed_at")
log "out: IBV_WC_RETRY_EXC_ERR $took s into the outage (TCP backoffs 0.75 s, then timeout 14 x retry_cnt 7: 0.54 s${IMPAIR_DIRECT:+; library to library not before the next retransmission of TCP, ~0.8 s})"
awk -v t="$took" 'BEGIN {exit !(t > 0 && t < 3)}' || IMPAIR_FAILED+=(out.on_time)
kill -KILL "$(child_named "$srv" rc_stream)" 2>/dev/null || true
wait "$srv" 2>/dev/null || true

nap "$(awk -v d="$t_down" -v s="${IMPAIR_OUTAGE_S:-12}" -v now="$EPOCHREALTIME" \
  'BEGIN {r = d + s - now; print (r > 0 ? r : 0)}')"
impair_up
t_up=$IMPAIR_T
log "link down for $(secs_between "$t_down" "$t_up") s"
impair_try after check_pingpong after 200 30
log "after: ibv_rc_pingpong -c -n 200 ended $(secs_between "$t_up" "$EPOCHREALTIME") s after link-up"
impair_stats
impair_verdict
