#!/usr/bin/env bash
# RDMA CM state across a live migration: Debian's rping, server on h2, client process in h1 with
# its guest on h1's backend. While it pings (-v, data printed on both ends) the client's guest
# moves h1 -> h3 and back (`vrdma migrate`), its connected rdma_cm id, event channel and QP with
# it. Both ends must finish all COUNT pings with the server reading what the client sent, and exit
# 0: the client's rdma_disconnect after the moves still reaches the server (DISCONNECTED there),
# and the client's own DISCONNECTED comes back to it on the backend it ended on. A few seconds.
# Usage: rdmacm_migrate.sh BIN_DIR   (CM_MIG_COUNT: rping's -C, 3000)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
command -v rping >/dev/null || {
  log "SKIP: rdmacm-utils not installed"
  exit 77
}
hosts_init "${1:-}" 3
wait_mesh
SRV_IP=$(host_ip 2) COUNT="${CM_MIG_COUNT:-3000}"

hrun 2 --guest cm-srv -- rping -s -a "$SRV_IP" -p 7190 -C "$COUNT" -v >"$E2E_TMP/srv.out" 2>"$E2E_TMP/srv.err" &
srv=$!
# A CM listener shows in no socket table: retried while refused (REJECTED) until it listens.
for ((try = 0; try < 100; try++)); do
  hrun 1 --guest cm-mv -- rping -c -a "$SRV_IP" -p 7190 -C "$COUNT" -v >"$E2E_TMP/cli.out" 2>"$E2E_TMP/cli.err" &
  cli=$!
  for ((k = 0; k < 50; k++)); do
    [[ $(grep -c '^ping data:' "$E2E_TMP/cli.out") -ge 20 ]] && break 2
    kill -0 "$cli" 2>/dev/null || break
    nap 0.05
  done
  wait "$cli" && fail "rping -c finished before the move (raise CM_MIG_COUNT)"
  cat "$E2E_TMP/cli.err" >>"$E2E_TMP/cli.out"
  grep -qE 'REJECTED|Unexpected CM event|rdma_connect' "$E2E_TMP/cli.out" ||
    fail "client: $(tail -n 5 "$E2E_TMP/cli.out")"
  nap 0.1
done
HOSTS_WATCH=("$srv $E2E_TMP/srv.err" "$cli $E2E_TMP/cli.err")
hmigrate cm-mv 1 3
n1=$(grep -c '^ping data:' "$E2E_TMP/cli.out")
log "moved h1 -> h3 after $n1 pings ($(mig_field downtime_us) us frozen)"
for ((k = 0; k < 100; k++)); do
  [[ $(grep -c '^ping data:' "$E2E_TMP/cli.out") -gt $((n1 + 10)) ]] && break
  hcheck_alive
  nap 0.05
done
hmigrate cm-mv 3 1
n2=$(grep -c '^ping data:' "$E2E_TMP/cli.out")
log "moved h3 -> h1 after $n2 pings; $((n2 - n1)) pings on h3"
((n2 > n1)) || fail "no ping while the guest was on h3"
((n2 < COUNT)) || fail "rping ended before the second move (raise CM_MIG_COUNT)"
HOSTS_WATCH=()
wait_pid "$cli" 30
[[ $WAIT_RC == 0 ]] || fail "client exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/cli.err")"
wait_pid "$srv" 10
[[ $WAIT_RC == 0 ]] || fail "server exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/srv.err")"
n=$(grep -c '^ping data: rdma-ping-' "$E2E_TMP/cli.out") || true
[[ $n == "$COUNT" ]] || fail "$n pings, not $COUNT: $(grep -v '^ping data' "$E2E_TMP/cli.out" | tail -n 3)"
diff <(sed -n 's/^ping data: //p' "$E2E_TMP/cli.out") \
  <(sed -n 's/^server ping data: //p' "$E2E_TMP/srv.out") >/dev/null ||
  fail "the server read other data than the client sent"
log "rping: $COUNT pings verified, clean disconnect on both ends after two moves"
e2e_pass
