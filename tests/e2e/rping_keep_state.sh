#!/usr/bin/env bash
# RDMA CM state across a SIGKILL of a --keep-state backend (docs/ARCHITECTURE.md, "RDMA CM",
# keep_state): Debian's unmodified rping server and client (two guests) connect through vrdma's
# librdmacm; the client's verbose output goes into a FIFO that the test stops reading after a
# few pings, so the client blocks in its write with the pair connected and the run cannot end
# (the kill does not depend on timing). The backend is then SIGKILLed, the keeper's new one
# restores both guests, their CM ids included, the FIFO is read again, and every ping must arrive
# and be verified (-V), and the client's disconnect must give DISCONNECTED on both ends, both
# exiting 0. Usage: rping_keep_state.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
command -v rping >/dev/null || {
  log "SKIP: rdmacm-utils not installed"
  exit 77
}
[[ -e $(dirname "$VRDMA")/../lib/librdmacm.so.1 ]] || fail "librdmacm.so.1 missing beside libibverbs"

start_kept_backend
PINGS=2000  # ~150 KB of verbose lines: more than a pipe holds, so the client must wait for us
PORT=7174

# The server says it listens only in its debug lines (-d, line-buffered to see them at once).
"${VRUN[@]}" --guest cm-srv -- stdbuf -oL rping -s -a 127.0.0.1 -p "$PORT" -C "$PINGS" -v -V -d \
  >"$E2E_TMP/srv.out" 2>"$E2E_TMP/srv_err.out" &
SRV=$!
for ((i = 0; i < 200; i++)); do
  grep -q 'rdma_listen' "$E2E_TMP/srv.out" 2>/dev/null && break
  kill -0 "$SRV" 2>/dev/null || fail "server exited: $(cat "$E2E_TMP/srv_err.out")"
  nap 0.05
done
grep -q 'rdma_listen' "$E2E_TMP/srv.out" || fail "the server does not listen: $(tail -n 3 "$E2E_TMP/srv.out")"

mkfifo "$E2E_TMP/cli.fifo"
"${VRUN[@]}" --guest cm-cli -- stdbuf -oL rping -c -a 127.0.0.1 -p "$PORT" -C "$PINGS" -v -V \
  >"$E2E_TMP/cli.fifo" 2>"$E2E_TMP/cli_err.out" &
CLI=$!
exec {CLI_OUT}<"$E2E_TMP/cli.fifo"
for ((i = 0; i < 20; i++)); do
  IFS= read -r -t 20 -u "$CLI_OUT" line || fail "client: no ping $i: $(cat "$E2E_TMP/cli_err.out")"
  echo "$line" >>"$E2E_TMP/cli.out"
done
# Now the pipe fills and the client blocks writing its next line (connected, between pings).
cli_proc="$(exec_named "$CLI" rping)"
for ((i = 0; i < 200; i++)); do
  [[ $(cat "/proc/$cli_proc/wchan" 2>/dev/null) == *pipe_write* ]] && break
  nap 0.05
done
[[ $(cat "/proc/$cli_proc/wchan" 2>/dev/null) == *pipe_write* ]] ||
  fail "the client does not wait for its output: $(cat "/proc/$cli_proc/wchan" 2>/dev/null)"

kill_kept_backend
wait_restored 2
grep -q 'RDMA CM state was not taken in' "$E2E_TMP/vrdmad.log" &&
  fail "a guest's CM state was not restored: $(grep 'RDMA CM state' "$E2E_TMP/vrdmad.log")"
log "backend $KILLED killed with the client at ping $(wc -l <"$E2E_TMP/cli.out")+, $RESTARTED restored both guests"

cat <&"$CLI_OUT" >>"$E2E_TMP/cli.out" &
READER=$!
exec {CLI_OUT}<&-
for who in client server; do
  pid=$CLI
  [[ $who == client ]] || pid=$SRV
  wait_pid "$pid" 60
  err=$E2E_TMP/cli_err.out
  [[ $who == client ]] || err=$E2E_TMP/srv_err.out
  [[ $WAIT_RC == 0 ]] || fail "$who exited $WAIT_RC: $(tail -n 3 "$err")"
done
wait_pid "$READER" 10
last=$((PINGS - 1))
[[ $(grep -c '^ping data: rdma-ping-' "$E2E_TMP/cli.out") == "$PINGS" ]] ||
  fail "client: $(grep -c '^ping data: rdma-ping-' "$E2E_TMP/cli.out") pings, not $PINGS"
grep -q "^ping data: rdma-ping-$last: " "$E2E_TMP/cli.out" || fail "client: ping $last missing"
# What the server read (RDMA READ from the client's buffer) is what the client sent, in order.
diff <(sed -n 's/^ping data: //p' "$E2E_TMP/cli.out") \
  <(sed -n 's/^server ping data: //p' "$E2E_TMP/srv.out") >/dev/null ||
  fail "the server read other data than the client sent"
# rping says so on stderr (*_err.out: the clean-up looks for sanitizer reports there too).
grep -q '^client DISCONNECT EVENT' "$E2E_TMP/cli_err.out" || fail "client: no DISCONNECTED"
grep -q '^server DISCONNECT EVENT' "$E2E_TMP/srv_err.out" || fail "server: no DISCONNECTED"
log "rping -C $PINGS -v -V across the SIGKILL: every ping verified, DISCONNECTED on both ends"
e2e_pass
