#!/usr/bin/env bash
# UD on the direct path across moves (issue 25; docs/ARCHITECTURE.md, keep_state and "Direct
# path"): a verifying UD stream (rc_stream ud-server/ud-client: every datagram checked, none
# duplicated or reordered, a lost one counted, never resent) between two guests whose libraries
# move the datagrams themselves, on a backend under --keep-state. The backend is SIGKILLed
# twice and the client's guest snapshotted and restored: after each, the stream goes on and the
# libraries are granted the direct path again (their direct counters grow); at the end the server
# has every datagram it got intact and once. Debian's ibv_ud_pingpong is not used: it stops at
# the first lost datagram, which UD allows.
# Usage: keep_state_ud.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
start_kept_backend --direct-path
bin="$(dirname "$VRDMA")"

# Datagrams the libraries delivered themselves to guest G (direct path). Asked again while the
# backend does not answer (a new one starting after a kill).
direct_of() {
  local i n
  for ((i = 0; i < 100; i++)); do
    n="$("$VRDMA" res show qp -j 2>/dev/null | G="$1" perl -MJSON::PP -0777 -ne '
      my $s = 0; for my $r (@{decode_json($_)}) {
        $s += $r->{counters}{direct_msgs_received} // 0 if $r->{guest} eq $ENV{G} }
      print "$s\n"' 2>/dev/null)" || n=""
    [[ -n $n ]] && break
    nap 0.05
  done
  [[ -n $n ]] || fail "vrdma res show qp -j: no answer"
  echo "$n"
}
# Waits until the client's library has delivered 100 more datagrams to the server itself (its
# direct counter, kept in the rings across every move, past what it was when called): the stream
# goes on, and on the direct path (a new backend ends the old one's grants: this is a new grant).
# A stop-and-wait stream on a loaded 2-CPU machine may make only ~100 round trips a second.
# Usage: wait_flowing WHAT
wait_flowing() {
  local what=$1 from i
  from="$(direct_of ud-s)"
  for ((i = 0; i < 600; i++)); do
    (($(direct_of ud-s) > from + 100)) && return 0
    kill -0 "$cli" 2>/dev/null || fail "$what: the client exited: $(cat "$E2E_TMP/ud.client.out")"
    nap 0.05
  done
  fail "$what: the stream did not go on directly (direct $(direct_of ud-s), was $from): $("$VRDMA" res show qp -j 2>&1)"
}

port="$(free_port)"
vrun --guest ud-s -- "$bin/rc_stream" ud-server "$port" 1024 >"$E2E_TMP/ud.server.out" 2>&1 &
srv=$!
wait_listen "$port" "$srv" ud
vrun --guest ud-c -- "$bin/rc_stream" ud-client 127.0.0.1 "$port" 1024 >"$E2E_TMP/ud.client.out" 2>&1 &
cli=$!
cli_proc=$(child_named "$cli" rc_stream)
wait_flowing "start"
log "granted: $(direct_of ud-s) datagrams delivered by the client's library"
for k in 1 2; do
  kill_kept_backend
  log "kill $k: backend $KILLED -> $RESTARTED"
  wait_flowing "after kill $k"
done
"$VRDMA" snapshot ud-c "$E2E_TMP/udc.snap" >"$E2E_TMP/snap.out" 2>&1 || fail "snapshot: $(cat "$E2E_TMP/snap.out")"
wait_flowing "after the snapshot"
log "snapshot taken, the stream goes on"
"$VRDMA" restore "$E2E_TMP/udc.snap" >>"$E2E_TMP/snap.out" 2>&1 || fail "restore: $(cat "$E2E_TMP/snap.out")"
wait_flowing "after the restore"
log "restored: $(tr "\n" " " <"$E2E_TMP/snap.out")"
kill -USR1 "$cli_proc"
wait_pid "$cli" 30
[[ $WAIT_RC == 0 ]] || fail "client exited $WAIT_RC: $(cat "$E2E_TMP/ud.client.out")"
wait_pid "$srv" 20
[[ $WAIT_RC == 0 ]] || fail "server exited $WAIT_RC: $(cat "$E2E_TMP/ud.server.out")"
line="$(grep 'each once, in order, intact' "$E2E_TMP/ud.server.out")" || fail "server: $(tail -n 3 "$E2E_TMP/ud.server.out")"
read -r got sent lost <<<"$(sed -E 's/ud: received ([0-9]+) of ([0-9]+) sent \(([0-9]+) lost\).*/\1 \2 \3/' <<<"$line")"
# A move may drop the datagrams in flight across it (UD), never more than a few per move.
((lost <= 50)) || fail "lost $lost of $sent datagrams across 4 moves"
log "UD across 2 SIGKILLs, a snapshot and a restore: $line"
e2e_pass
