#!/usr/bin/env bash
# The direct path across backends (--direct-remote): two namespace hosts whose backends only
# introduce each RC (or UC) QP pair's libraries, which then talk TCP to each other. Debian's
# unmodified tools across them: ibv_rc_pingpong -c (LID and GID), ibv_uc_pingpong -c,
# ibv_srq_pingpong -c (QPs on an SRQ, half of them library to library), every
# perftest opcode (SEND, WRITE, READ, atomics), a SEND that finds no receive while an ACK waits
# behind it (rc_stream rnr-*), a verifying RC stream whose direct counts grow while it runs (and
# go on growing when strangers connect to a library's port with a bad hello or none),
# completion channels (direct too: the libraries fire them), and a peer killed mid-stream: the
# survivor's QP fails with a clear error, and both backends serve the next pair.
# Usage: direct_remote.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_VRDMAD_ARGS="--direct-remote ${HOSTS_VRDMAD_ARGS:-}"
hosts_init "${1:-}" 2
wait_mesh

# Counter C (direct_msgs_sent, msgs_sent, ...) of guest G on host H, summed over its QPs.
hcount() {
  VRDMA_SOCKET="$(host_sock "$1")" "$VRDMA" stat qp guest "$2" -j | C="$3" perl -MJSON::PP \
    -0777 -ne 'my $s = 0; $s += $_->{$ENV{C}} // 0 for @{decode_json($_)->{qp}}; print $s'
}
# Lines of host H's backend log that say a library of guest G took the direct path.
granted() { grep -c "direct path: guest $2 QP .* of backend" "$E2E_TMP/vrdmad.h$1.log" || true; }
# Fails unless both ends of pair NAME (server NAME-s on h1, client NAME-c on h2) went direct.
expect_direct() {
  local g h
  for g in "$1-s" "$1-c"; do
    h=1
    [[ $g == *-c ]] && h=2
    [[ $(granted "$h" "$g") -ge 1 ]] ||
      fail "no direct connection for $g: $(grep -i direct "$E2E_TMP/vrdmad.h$h.log" | tail -n 3)"
  done
}

# 1. ibv_rc_pingpong validating every buffer, both ways direct, in LID and GID mode.
hpair lid 1 2 -c -n 5000
hpair gid 2 1 -g 0 -c -n 1000 -s 65536
expect_direct lid

# 1b. One connection carries both directions: a SEND that finds no receive is dropped (kRnr)
# and sent again once one is posted (kResume), and the ACK behind it on that connection gets
# through meanwhile; the SENDs arrive in order with the bytes they were posted with.
# The gate opens when the client's end of that connection is up: it says "sends to" when it
# dialed, "takes ... requests" when the server's library dialed first (the CI run that hung 30 s).
# The SEND must reach the server before its receive is posted (100 ms later); on a loaded
# machine it may not, and then nothing was tested: tried again, 3 times at most.
for try in 1 2 3; do
  hrnr "rnr$try" 1 2 'direct path: QP .* \(sends to\|takes\) QP'
  grep -q "one connection both ways" "$E2E_TMP/rnr$try.server.out" ||
    fail "rnr: the pair did not share one connection: $(grep "direct path" "$E2E_TMP/rnr$try.server.out")"
  grep -q "has no receive for request" "$E2E_TMP/rnr$try.server.out" && break
  ((try < 3)) || fail "rnr: the SEND found a receive in 3 tries: nothing was tested"
  log "rnr: the SEND found a receive (a loaded machine): again"
done

# 2. Completion channels (both ends sleep in ibv_get_cq_event): the libraries fire them, so the
# pair goes direct too (before issue 25's channels it stayed on the backends).
hpair events 1 2 -e -c -n 500
expect_direct events
# 2b. UC (Debian's ibv_uc_pingpong, validating): direct too, library to library.
PP_TOOL=ibv_uc_pingpong hpair uc 1 2 -c -n 2000
expect_direct uc
# 2c. SRQ (Debian's ibv_srq_pingpong, validating): 16 QPs on one SRQ at each end, of which a
# library takes 8 to its peer's (the cap of VRDMA_DIRECT_REMOTE_QPS) and takes their receives
# from the SRQ itself, while the backends' transport carries the other 8 into the same SRQ.
PP_TOOL=ibv_srq_pingpong hpair srq 1 2 -c -q 16 -n 500
expect_direct srq
grep -q "takes QP .* requests from its library" "$E2E_TMP/srq.server.out" "$E2E_TMP/srq.client.out" ||
  fail "srq: no library took a peer's requests into its SRQ: $(grep -h "direct path" "$E2E_TMP"/srq.*.out | tail -n 3)"

# 3. A checksummed stream: while it runs, direct messages are counted on both ends.
hstream_start st 1 2
sleep 1
a_sent="$(hcount 2 st-c direct_msgs_sent)" a_recv="$(hcount 1 st-s direct_msgs_received)"
nap 0.5
b_sent="$(hcount 2 st-c direct_msgs_sent)" b_recv="$(hcount 1 st-s direct_msgs_received)"
((b_sent > a_sent && b_recv > a_recv)) ||
  fail "not direct: sent $a_sent -> $b_sent, received $a_recv -> $b_recv"
log "stream direct: sent $a_sent -> $b_sent, received $a_recv -> $b_recv"
# A stranger at the server library's port (from its backend's log): a wrong hello, then one
# that says nothing. Both are refused or dropped; the stream goes on.
port="$(grep -o "guest st-s QP .* on port [0-9]*" "$E2E_TMP/vrdmad.h1.log" | tail -n 1 | awk '{print $NF}')"
[[ -n $port ]] || fail "no offer of st-s in h1's log"
hexec 2 bash -c "exec 3<>/dev/tcp/$(host_ip 1)/$port; printf 'x%.0s' {1..40} >&3; sleep 0.2" ||
  fail "cannot reach the library's port $port"
hexec 2 bash -c "exec 3<>/dev/tcp/$(host_ip 1)/$port; sleep 2.2" &
sleep 2.5
grep -q "refused a connection" "$E2E_TMP/st.server.out" ||
  fail "the library did not refuse a bad hello: $(tail -n 3 "$E2E_TMP/st.server.out")"
c_sent="$(hcount 2 st-c direct_msgs_sent)"
((c_sent > b_sent)) || fail "the stream stopped after a stranger connected: $b_sent -> $c_sent"
kill -USR1 "$cli_proc"
finish_stream st "$cli" "$srv" 60
log "rc_stream: $STREAM_RESULT"

# 4. Every opcode through perftest.
hperftest 1 2 ib_send_lat -n 1000
hperftest 1 2 ib_write_lat -n 1000
# The same with a hub that sleeps at once after each request (it polls for 200 µs by default).
VRDMA_POLL_SPIN_US=0 hperftest 1 2 ib_write_lat -n 300
hperftest 1 2 ib_read_lat -n 1000
hperftest 1 2 ib_atomic_lat -n 1000
hperftest 1 2 ib_write_bw -s 1048576 -n 100
hperftest 1 2 ib_send_bw -n 2000 -x 0
hperftest 1 2 ib_read_bw -s 65536 -n 300

# 5. The server's process dies mid-stream: the client's QP goes to ERR with a clear line in its
# output (a failed completion), nothing hangs, and both backends serve the next pair.
hstream_start dies 1 2
sleep 1
kill -KILL "$(child_named "$srv" rc_stream)" 2>/dev/null || true
wait_pid "$cli" 30
[[ $WAIT_RC != 0 && $WAIT_RC != 124 ]] ||
  fail "client after its peer died: exit $WAIT_RC: $(tail -n 3 "$E2E_TMP/dies.client.out")"
grep -q "completion .* failed" "$E2E_TMP/dies.client.out" ||
  fail "client did not report a failed completion: $(tail -n 3 "$E2E_TMP/dies.client.out")"
log "peer killed: client says: $(grep -m1 failed "$E2E_TMP/dies.client.out")"
hpair after 1 2 -c -n 500
e2e_pass
