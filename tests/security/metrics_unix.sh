#!/usr/bin/env bash
# Issue 21: metrics on a unix socket of a shared root backend, as the README's recipe sets it up
# ([metrics] listen = "unix:PATH", socket_mode = "0660", the directory setgid to the users'
# group). The kernel says who scrapes: while the victim's guests hold a verifying stream and the
# attacker has a guest of its own, the attacker's scrape (names on, guest_names = true) is valid
# text with its own guest and none of the victim's, no key, and totals of its own; root's shows
# every guest; a user outside the group cannot connect. The backend logs the cut-down view; the
# victim's stream ends with the same bytes at both ends, and the backend serves a new pingpong.
# Usage: metrics_unix.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HERE="$(dirname "${BASH_SOURCE[0]}")"
e2e_init "${1:-}"
sec_users "${1:-}"
auid="$(id -u "$ATTACKER")"

MDIR="$E2E_TMP/metrics"
MSOCK="$MDIR/metrics.sock"
mkdir "$MDIR"
chgrp "$SEC_GROUP" "$MDIR"
chmod 2750 "$MDIR"
cat >"$E2E_TMP/vrdmad.toml" <<TOML
[metrics]
enabled = true
listen = "unix:$MSOCK"
socket_mode = "0660"
guest_names = true
min_interval_ms = 0
TOML
VRDMA_LOG=debug "$SEC_BIN/vrdmad" --socket "$VRDMA_SOCKET" --idle-exit 0 \
  --config "$E2E_TMP/vrdmad.toml" >>"$E2E_TMP/vrdmad.log" 2>&1 &
BACKEND_PID=$!
for ((k = 0; k < 100; k++)); do
  [[ -S $VRDMA_SOCKET && -S $MSOCK ]] && break
  nap 0.1
done
[[ -S $MSOCK ]] || fail "the backend did not start: $(tail -n 5 "$E2E_TMP/vrdmad.log")"
share_socket "$VRDMA_SOCKET"
[[ "$(stat -c '%a %G' "$MSOCK")" == "660 $SEC_GROUP" ]] ||
  fail "the metrics socket is $(stat -c '%a %G' "$MSOCK"), want 660 $SEC_GROUP"

sec_stream_start "$VICTIM" vmu
wait_sent_above vmu-c 0
# The attacker's own guest, held open by a pingpong server that waits for a client.
pp_as "$ATTACKER"
start_server a-own amu-own -n 5

# (become, not as_user: curl loads no vrdma library)
scrape() {
  local u=$1 out=$2
  become "$u" curl -sS --max-time 20 --unix-socket "$MSOCK" http://localhost/metrics \
    >"$out" 2>"$out.err"
}
scrape "$ATTACKER" "$E2E_TMP/attacker.prom" || fail "scrape: $(cat "$E2E_TMP/attacker.prom.err")"
perl "$HERE/../e2e/prom_check.pl" <"$E2E_TMP/attacker.prom" || fail "the exposition is not valid"
! grep -q 'vmu-' "$E2E_TMP/attacker.prom" ||
  fail "the attacker sees the victim's guests: $(grep 'vmu-' "$E2E_TMP/attacker.prom" | head -n 3)"
! grep -Eq 'lkey|rkey|iova' "$E2E_TMP/attacker.prom" || fail "the metrics carry keys"
grep -q '^vrdma_resources{guest="amu-own",kind="qp"} 1$' "$E2E_TMP/attacker.prom" ||
  fail "the attacker's own guest is missing: $(grep '^vrdma_resources' "$E2E_TMP/attacker.prom")"
grep -q '^vrdma_guests 1$' "$E2E_TMP/attacker.prom" ||
  fail "attacker: $(grep '^vrdma_guests' "$E2E_TMP/attacker.prom")"
logged "metrics: uid $auid sees its own guests only" "the attacker's cut-down view"

scrape root "$E2E_TMP/root.prom" || fail "root's scrape: $(cat "$E2E_TMP/root.prom.err")"
for g in vmu-s vmu-c amu-own; do
  grep -q "^vrdma_resources{guest=\"$g\",kind=\"qp\"} 1$" "$E2E_TMP/root.prom" ||
    fail "root does not see $g: $(grep '^vrdma_resources' "$E2E_TMP/root.prom")"
done

# Outside the group: the directory (2750) and the socket (0660) keep it out.
! scrape nobody "$E2E_TMP/nobody.prom" || fail "nobody could scrape: $(head -c 300 "$E2E_TMP/nobody.prom")"

wait_sent_above vmu-c "$(guest_sent vmu-c)"
kill -USR1 "$cli_proc"
finish_stream vmu "$cli" "$srv"
log "victim's stream: $STREAM_RESULT"
pp_as root
backend_serves metrics_unix
e2e_pass
