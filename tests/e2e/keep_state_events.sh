#!/usr/bin/env bash
# Completion channels across a SIGKILL of a --keep-state backend (docs/ARCHITECTURE.md, "Moving a
# guest's device", keep_state): Debian's unmodified `ibv_rc_pingpong -e` (both ends sleep in
# ibv_get_cq_event) is stopped in the middle of its traffic, the backend is killed, the keeper's
# new one restores both guests and fires every armed CQ that holds a completion; both ends must
# finish every iteration. A machine fast enough to finish the run before the stop skips the kill
# (logged). Without KEEP_DIRECT the backend has --no-direct-path; KEEP_DIRECT=1
# (e2e.keep_state_events_direct): --direct-path, where the libraries fire the channels themselves.
# Usage: keep_state_events.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
PATH_ARG=--no-direct-path
[[ -z ${KEEP_DIRECT:-} ]] || PATH_ARG=--direct-path

start_kept_backend "$PATH_ARG"

# Messages the RC QPs sent, one line per QP.
sent() { "$VRDMA" res show qp -j 2>/dev/null | grep -o '"msgs_sent":[0-9]*' | cut -d: -f2; }

# Enough that a fast machine is still in the traffic when the loop below stops it (20,000 ran
# in 0.12 s on the direct path, 6 µs a round trip, and ended before the stop).
ITERS=100000
start_server ev es -e -n "$ITERS"
start_client ev ec "$PORT" -e -n "$ITERS"
srv_proc="$(exec_named "$SERVER_PID" ibv_rc_pingpong)"
cli_proc="$(exec_named "$CLIENT_PID" ibv_rc_pingpong)"
for ((i = 0; i < 600; i++)); do
  [[ $(sent | awk '$1 > 0' | wc -l) -ge 2 ]] && break
  kill -0 "$CLIENT_PID" 2>/dev/null || break
  nap 0.01
done
# Stopped with both ends in their loops (each QP below the iterations): only the data path runs.
if kill -STOP "$srv_proc" "$cli_proc" 2>/dev/null &&
  sent | awk -v n="$ITERS" '$1 >= n {done = 1} END {exit NR == 2 && !done ? 0 : 1}'; then
  kill_kept_backend
  wait_restored 2
  log "backend $KILLED killed in the middle of the traffic, $RESTARTED restored both guests"
else
  log "the run finished before it could be stopped: no kill in the middle of the traffic"
fi
kill -CONT "$srv_proc" "$cli_proc" 2>/dev/null || true  # (either may be gone: it finished)
for who in client server; do
  pid=$CLIENT_PID
  [[ $who == client ]] || pid=$SERVER_PID
  wait_pid "$pid" 60
  [[ $WAIT_RC == 0 ]] || fail "$who exited $WAIT_RC: $(tail -n 3 "$E2E_TMP/ev.$who.out")"
  grep -q "$ITERS iters in" "$E2E_TMP/ev.$who.out" || fail "$who: $(tail -n 3 "$E2E_TMP/ev.$who.out")"
done
log "ibv_rc_pingpong -e -n $ITERS ($PATH_ARG): every iteration on both ends across the SIGKILL"
e2e_pass
