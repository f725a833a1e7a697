#!/usr/bin/env bash
# keep_state across hosts: two namespace hosts whose backends run with --keep-state (and
# --direct-remote); two verifying RC streams (rc_stream) keep going while the backends are
# killed with SIGKILL in turn (h1, h2, h1): each keeper starts its backend again, the guests'
# state comes back, and every message of each stream arrives once and in order (equal
# checksums).
#  - kx, over the TCP transport between the backends (its completion channels keep it off the
#    direct path): PSNs and cursors come back from the rings.
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

# The streams' QPs wait 2.1 s for a peer backend that restarts (timeout 16: 268 ms x 8 tries)
# instead of the tools' 0.54 s: a keeper's restart took 0.9 s under ASan on a loaded machine,
# and a requester whose retry budget is shorter than the restart fails with RETRY_EXC_ERR, as
# against an HCA that reboots (docs/ARCHITECTURE.md, keep_state).
RC_STREAM_OPT="--timeout 16 --events" hstream_start kx 1 2
kx_srv=$srv kx_cli=$cli kx_proc=$cli_proc
RC_STREAM_OPT="--timeout 16" hstream_start kd 2 1
HOSTS_WATCH=("$srv $E2E_TMP/kd.server.out" "$cli $E2E_TMP/kd.client.out"
  "$kx_srv $E2E_TMP/kx.server.out" "$kx_cli $E2E_TMP/kx.client.out")
hwait_flowing 1 kx-s msgs_received "$kx_srv"  # connected: no command in flight when one dies
hwait_route 1 kx-s tcp/h2 20
hgrows 1 kd-c direct_msgs_sent "the client's library sends directly"
hgrows 2 kd-s direct_msgs_received "the server's library executes directly"
for k in 1 2 1; do
  nap 0.8
  old="$(cat "$(host_sock "$k").pid")"
  kill -KILL "$old"
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
