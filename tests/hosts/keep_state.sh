#!/usr/bin/env bash
# keep_state across hosts: two namespace hosts whose backends run with --keep-state (and
# --direct-remote); two verifying RC streams (rc_stream) keep going while the backends are
# killed with SIGKILL in turn (h1, h2, h1): each keeper starts its backend again, the guests'
# state comes back, and every message of each stream arrives once and in order (equal
# checksums). Each keeper is stopped for 1 s as its backend dies, so every restart takes longer
# than the streams' retry budget (the tools' `timeout` 14, retry 7: 0.54 s).
#  - kx, over the TCP transport between the backends (its completion channels keep it off the
#    direct path): PSNs and cursors come back from the rings; the peer's QPs wait for the
#    restart as for a slow backend, because the keeper holds the transport's listener meanwhile
#    (its host accepts their connections; docs/ARCHITECTURE.md, keep_state).
#  - kd, on the direct path across backends (client on h1, server on h2, their libraries talk
#    TLS to each other): the libraries' connection outlives the killed backend, the restarted
#    one takes the QPs' direct state from the keeper (h1's reports the client's QP direct), and
#    after each restart both ends' direct counters grow again, with no revoke (the pair never
#    left the direct path).
# Usage: keep_state.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_VRDMAD_ARGS="--keep-state --direct-remote"
hosts_init "${1:-}" 2
wait_mesh

RC_STREAM_OPT="--events" hstream_start kx 1 2
kx_srv=$srv kx_cli=$cli kx_proc=$cli_proc
hstream_start kd 2 1
HOSTS_WATCH=("$srv $E2E_TMP/kd.server.out" "$cli $E2E_TMP/kd.client.out"
  "$kx_srv $E2E_TMP/kx.server.out" "$kx_cli $E2E_TMP/kx.client.out")
hwait_flowing 1 kx-s msgs_received "$kx_srv"  # connected: no command in flight when one dies
hwait_route 1 kx-s tcp/h2 20
hgrows 1 kd-c direct_msgs_sent "the client's library sends directly"
hgrows 2 kd-s direct_msgs_received "the server's library executes directly"
for k in 1 2 1; do
  nap 0.8
  old="$(cat "$(host_sock "$k").pid")"
  keeper="$(cat "$(host_sock "$k").keeper.pid")"
  kill -STOP "$keeper"  # it sees its backend die 1 s late: a restart longer than the budget
  kill -KILL "$old"
  nap 1
  kill -CONT "$keeper"
  for ((i = 0; i < 100; i++)); do
    new="$(cat "$(host_sock "$k").pid" 2>/dev/null)"
    [[ -n $new && $new != "$old" ]] && kill -0 "$new" 2>/dev/null && break
    nap 0.05
  done
  [[ -n $new && $new != "$old" ]] || fail "h$k: the keeper did not start a new backend"
  # The pair's libraries keep talking whatever their backends know: that h1's backend knows
  # the QP is direct (what a move asks back) is in its route.
  hwait_route 1 kd-c direct/h2 20
  hgrows 1 kd-c direct_msgs_sent "direct after h$k's backend was killed"
  hgrows 2 kd-s direct_msgs_received "direct after h$k's backend was killed"
  hgrows 1 kx-s msgs_received "kx after h$k's backend was killed"
  log "h$k: backend $old killed, $new took over; kd direct, kx on tcp, both flowing"
done
HOSTS_WATCH=()
for f in kd.client kd.server; do
  ! grep -q "goes back to the backends" "$E2E_TMP/$f.out" ||
    fail "$f: the pair left the direct path: $(cat "$E2E_TMP/$f.out")"
done
kill -USR1 "$kx_proc" "$cli_proc"  # open-ended: the clients drain and say how many they sent
finish_stream kx "$kx_cli" "$kx_srv" 60
kx_result=$STREAM_RESULT
finish_stream kd "$cli" "$srv" 60
log "rc_stream across hosts through 3 backend kills: kx (tcp) $kx_result, kd (direct)" \
  "$STREAM_RESULT, on both ends"
e2e_pass
