#!/usr/bin/env bash
# keep_state across hosts: two namespace hosts whose backends run with --keep-state; a verifying
# RC stream (rc_stream, over the TCP transport) keeps going while the backends are killed with
# SIGKILL in turn (h1, h2, h1): each keeper starts its backend again, the guests' state comes
# back with PSNs from the rings, and every message arrives once and in order (equal checksums).
# Each keeper is stopped for 1 s as its backend dies, so every restart takes longer than the
# stream's retry budget (the tools' `timeout` 14, retry 7: 0.54 s): the peer's QPs wait for it as
# for a slow backend, because the keeper holds the transport's listener meanwhile (its host
# accepts their connections; docs/ARCHITECTURE.md, keep_state).
# Usage: keep_state.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_VRDMAD_ARGS="--keep-state"
hosts_init "${1:-}" 2
wait_mesh

hstream_start kx 1 2
hwait_flowing 1 kx-s msgs_received "$srv"  # connected: no command in flight when a backend dies
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
  log "h$k: backend $old killed, $new took over"
done
kill -USR1 "$cli_proc"  # open-ended: the client drains and says how many it sent
finish_stream kx "$cli" "$srv" 60
log "rc_stream across hosts through 3 backend kills: $STREAM_RESULT on both ends"
e2e_pass
