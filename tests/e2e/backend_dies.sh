#!/usr/bin/env bash
# The backend (the device) dies mid-run: the guests must not hang. Both ends of a running
# ibv_rc_pingpong pair fail (a poll/post error, as with a dead HCA) within seconds.
# Usage: backend_dies.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

start_server long dies-srv -n "$PP_UNTIL_STOPPED"
srv=$SERVER_PID
start_client long dies-cli "$PORT" -n "$PP_UNTIL_STOPPED"
cli=$CLIENT_PID
sleep 1
kill -0 "$cli" 2>/dev/null || fail "the client ended early: $(cat "$E2E_TMP/long.client.out")"
bpid="$(backend_pid)"
[[ -n $bpid ]] || fail "no backend"
log "SIGKILL backend $bpid"
kill -KILL "$bpid"

wait_pid "$cli" 10
crc=$WAIT_RC
wait_pid "$srv" 10
src=$WAIT_RC
[[ $crc != 124 ]] || fail "the client hung after the backend died"
[[ $src != 124 ]] || fail "the server hung after the backend died"
[[ $crc != 0 && $src != 0 ]] || fail "a pingpong reported success with the device gone ($crc/$src)"
grep -q "backend is gone\|lost the backend" "$E2E_TMP/long.client.out" ||
  fail "the client did not say why it failed"
log "client exited $crc, server $src: $(grep -h -m1 -i "fail" "$E2E_TMP"/long.*.out | tr '\n' ' ')"
e2e_pass
