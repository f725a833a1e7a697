#!/usr/bin/env bash
# keep_state: a backend killed with SIGKILL while traffic runs is started again by its keeper,
# takes its guests back, and their RC connections continue: a verifying stream (rc_stream, every
# message once and in order, equal checksums) and Debian's ibv_rc_pingpong survive three kills.
# A clean stop lets the keeper go too. Snapshot/restore of a running pingpong's device.
# Usage: keep_state.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
BIN="$(dirname "$VRDMA")"

"$BIN/vrdmad" --socket "$VRDMA_SOCKET" --idle-exit 0 --keep-state >>"$E2E_TMP/vrdmad.log" 2>&1 &
for ((i = 0; i < 100; i++)); do [[ -S $VRDMA_SOCKET.keeper ]] && break; sleep 0.1; done
[[ -S $VRDMA_SOCKET.keeper ]] || fail "no keeper socket beside the backend's"

# Kills the backend N times, waiting each time for the keeper to start a new one.
kill_backend_times() {
  local n=$1 k old new i
  for ((k = 1; k <= n; k++)); do
    sleep "${KILL_EVERY:-0.8}"
    old="$(backend_pid)"
    [[ -n $old ]] || fail "no backend to kill"
    kill -KILL "$old"
    for ((i = 0; i < 100; i++)); do
      new="$(backend_pid)"
      [[ -n $new && $new != "$old" ]] && break
      sleep 0.05
    done
    [[ -n $new && $new != "$old" ]] || fail "the keeper did not start a new backend after kill $k"
    log "kill $k: backend $old -> $new"
  done
}

port="$(free_port)"
vrun --guest ks-s -- "$BIN/rc_stream" server "$port" 60000 4096 >"$E2E_TMP/stream.server.out" 2>&1 &
srv=$!
for ((i = 0; i < 100; i++)); do port_in_use "$port" && break; sleep 0.1; done
vrun --guest ks-c -- "$BIN/rc_stream" client 127.0.0.1 "$port" 60000 4096 \
  >"$E2E_TMP/stream.client.out" 2>&1 &
cli=$!
kill_backend_times 3
wait_pid "$cli" 60
[[ $WAIT_RC == 0 ]] || fail "stream client exited $WAIT_RC: $(cat "$E2E_TMP/stream.client.out")"
wait_pid "$srv" 20
[[ $WAIT_RC == 0 ]] || fail "stream server exited $WAIT_RC: $(cat "$E2E_TMP/stream.server.out")"
sent="$(grep -o 'checksum [0-9a-f]*' "$E2E_TMP/stream.client.out")"
got="$(grep -o 'checksum [0-9a-f]*' "$E2E_TMP/stream.server.out")"
[[ -n $sent && $sent == "$got" ]] || fail "sent '$sent', received '$got'"
restored="$(grep -c 'restored from the keeper' "$E2E_TMP/vrdmad.log" || true)"
[[ $restored -ge 6 ]] || fail "expected both guests restored three times, log says $restored"
log "rc_stream: 60000 x 4096 B across 3 SIGKILLs, $sent on both ends"

# Debian's pingpong, killed under it once.
PP_TOOL=ibv_rc_pingpong
start_server pp ks-pps -n 50000
start_client pp ks-ppc "$PORT" -n 50000
KILL_EVERY=0.3 kill_backend_times 1
finish_pair pp "$SERVER_PID" "$CLIENT_PID" 60

# Snapshot and restore while a pingpong runs: the device state of the file is put back under it.
start_server snap ks-sn -n 100000
start_client snap ks-sc "$PORT" -n 100000
sleep 0.5
"$VRDMA" snapshot ks-sc "$E2E_TMP/sc.snap" >"$E2E_TMP/snap.out" 2>&1 || fail "snapshot: $(cat "$E2E_TMP/snap.out")"
for k in 1 2; do
  "$VRDMA" restore "$E2E_TMP/sc.snap" >>"$E2E_TMP/snap.out" 2>&1 || fail "restore: $(cat "$E2E_TMP/snap.out")"
done
kill -0 "$CLIENT_PID" 2>/dev/null || log "warning: the pingpong ended before the restores"
finish_pair snap "$SERVER_PID" "$CLIENT_PID" 90
log "$(tr '\n' ' ' <"$E2E_TMP/snap.out")"
# The guest is gone now: its snapshot has nothing to go back into.
"$VRDMA" restore "$E2E_TMP/sc.snap" >"$E2E_TMP/gone.out" 2>&1 && fail "restored a guest that is gone"
grep -q "No such file" "$E2E_TMP/gone.out" || fail "restore of a gone guest: $(cat "$E2E_TMP/gone.out")"

# A clean stop ends the guests' devices and the keeper with them.
kpid="$(cat "$VRDMA_SOCKET.keeper.pid")"
kill -TERM "$(backend_pid)"
for ((i = 0; i < 50; i++)); do kill -0 "$kpid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$kpid" 2>/dev/null && fail "the keeper ($kpid) outlived a clean stop of its backend"
e2e_pass
