#!/usr/bin/env bash
# Live migration and snapshots of guests on the direct path across backends (--direct-remote,
# issue 25): before the freeze, the moving guest's QPs go back to the backends (their libraries
# settle what is in flight between them and close their connection), then the move runs as on
# the mediated path; the peer on the other backend goes on, mediated too.
#  1. A verifying RC stream (rc_stream, open-ended) from a client guest on h1 to a server guest
#     on h2, both ends' libraries talking directly (the client's direct counter grows); the
#     client's guest moves h1 -> h3 -> h1 $MIG_ROUNDS (2) times while it runs. After each move:
#     `vrdma migrate` exited 0, the client's QP is on tcp to h2 on the target, the server's faces
#     the target, messages keep reaching the server, and the pair goes direct again (the
#     client's direct counter grows on the target, the server's on h2). At the end both ends'
#     checksums are equal: every message once and in order.
#  2. A second direct stream; the server's guest (the responder, on h2) is snapshotted while it
#     runs (the snapshot succeeds, the stream goes on, and direct again), then moves h2 -> h3 ->
#     h2 (direct again back on h2; on h3 the server's library, whose process stays in h2's
#     namespace, cannot listen on h3's address, so the pair stays on the backends there); the
#     stream verifies.
#  3. The same moves of a responder whose QP is on an SRQ (rc_stream --srq): its library takes
#     the SRQ's receives across backends; the stream verifies.
# Usage: migrate_direct_remote.sh BIN_DIR   (MIG_ROUNDS: round trips of part 1)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_VRDMAD_ARGS="--direct-remote ${HOSTS_VRDMAD_ARGS:-}"
hosts_init "${1:-}" 3
wait_mesh

ROUNDS="${MIG_ROUNDS:-2}"



# ---- 1. the client moves h1 -> h3 -> h1 ----
hstream_start mv 2 1
HOSTS_WATCH=("$srv $E2E_TMP/mv.server.out" "$cli $E2E_TMP/mv.client.out")
hwait_flowing 1 mv-c msgs_sent "$cli"
hgrows 1 mv-c direct_msgs_sent "the client's library sends directly"
log "mv: stream direct h1 -> h2 (direct_msgs_sent $(hcount 1 mv-c direct_msgs_sent))"
# One move of the client FROM -> TO: its QP facing h2 there, the server's QP facing TO,
# messages reaching the server after it, and the pair direct again.
move() {
  local from=$1 to=$2
  hmigrate mv-c "$from" "$to"
  hwait_route "$to" mv-c "tcp/h2|direct/h2" 10
  hwait_route 2 mv-s "tcp/h$to|direct/h$to" 10
  hgrows 2 mv-s msgs_received "messages after the move to h$to"
  hgrows "$to" mv-c direct_msgs_sent "the client's library sends directly again after the move"
  hgrows 2 mv-s direct_msgs_received "the server's library executes directly again"
  log "mv: moved h$from -> h$to (downtime $(mig_field downtime_us) us), direct again"
}
for ((r = 1; r <= ROUNDS; r++)); do
  move 1 3
  move 3 1
done
grep -q "goes back to the backends" "$E2E_TMP/mv.client.out" ||
  fail "the client's library did not say it went back to the backends"
grep -q "goes back to the backends" "$E2E_TMP/mv.server.out" ||
  fail "the server's library did not follow its peer back to the backends"
HOSTS_WATCH=()
kill -USR1 "$cli_proc"
finish_stream mv "$cli" "$srv" 30
log "mv: $STREAM_RESULT on both ends"

# ---- 2. a snapshot of the responder's guest ----
hstream_start sn 2 1
HOSTS_WATCH=("$srv $E2E_TMP/sn.server.out" "$cli $E2E_TMP/sn.client.out")
hwait_flowing 1 sn-c msgs_sent "$cli"
hgrows 2 sn-s direct_msgs_received "the server's library executes the client's requests"
out="$("$VRDMA" snapshot sn-s "$E2E_TMP/sn.state" --socket "$(host_sock 2)" 2>&1)" ||
  fail "vrdma snapshot of a guest on the direct path across backends: $out"
log "sn: $out"
hgrows 2 sn-s msgs_received "messages after the snapshot"
hgrows 2 sn-s direct_msgs_received "the pair direct again after the snapshot"
hmigrate sn-s 2 3
hwait_route 3 sn-s "tcp/h1|direct/h1" 10
hgrows 3 sn-s msgs_received "messages after the server's move to h3"
hmigrate sn-s 3 2
hwait_route 2 sn-s "tcp/h1|direct/h1" 10
hgrows 2 sn-s msgs_received "messages after the server's move back to h2"
hgrows 2 sn-s direct_msgs_received "the pair direct again back on h2"
grep -q "may go direct again" "$E2E_TMP/sn.server.out" ||
  fail "the server's library did not say it may go direct again"
HOSTS_WATCH=()
kill -USR1 "$cli_proc"
finish_stream sn "$cli" "$srv" 30
log "sn: $STREAM_RESULT on both ends"

# ---- 3. the responder's QP on an SRQ (its library takes the SRQ's receives) moves ----
RC_STREAM_OPT=--srq hstream_start sq 2 1
HOSTS_WATCH=("$srv $E2E_TMP/sq.server.out" "$cli $E2E_TMP/sq.client.out")
hwait_flowing 1 sq-c msgs_sent "$cli"
hgrows 2 sq-s direct_msgs_received "the server's library takes the requests into its SRQ"
hmigrate sq-s 2 3
hwait_route 3 sq-s "tcp/h1|direct/h1" 10
hgrows 3 sq-s msgs_received "messages into the SRQ after the server's move to h3"
hmigrate sq-s 3 2
hwait_route 2 sq-s "tcp/h1|direct/h1" 10
hgrows 2 sq-s direct_msgs_received "the pair direct again back on h2, into the SRQ"
HOSTS_WATCH=()
kill -USR1 "$cli_proc"
finish_stream sq "$cli" "$srv" 30
log "sq: $STREAM_RESULT on both ends"
e2e_pass
