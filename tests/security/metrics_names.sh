#!/usr/bin/env bash
# The metrics endpoint of a shared backend (any local uid can scrape loopback): by default it
# names no guest. While the victim's guests hold a verifying stream, the attacker's scrape is
# valid Prometheus text that counts the victim's traffic under its guests' LIDs (`lid-0xN`, as root's
# `vrdma status` shows them) and never under their names, and carries no key; the backend logged
# the snapshot it rendered. The victim's stream ends with the same bytes at both ends, and the
# backend serves a new pingpong. Usage: metrics_names.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
MPORT="$(free_port)"
SEC_VRDMAD_ARGS="--metrics-listen 127.0.0.1:$MPORT"
SEC_VRDMAD_LOG=debug
sec_init "${1:-}"
HERE="$(dirname "${BASH_SOURCE[0]}")"

sec_stream_start "$VICTIM" vmx
wait_sent_above vmx-c 0
lids="$(status_query 'join " ", map { sprintf "lid-0x%x", $_->{lid} } sort { $a->{guest} cmp $b->{guest} }
  grep { $_->{guest} =~ /^vmx-/ } @{$j->{guests}}')"
log "victim's guests are $lids"
# (become, not as_user: curl loads no vrdma library, and a sanitizer's runtime preloaded into it
# made it hang)
become "$ATTACKER" curl -sS --max-time 20 "http://127.0.0.1:$MPORT/metrics" \
  >"$E2E_TMP/attacker.prom" 2>"$E2E_TMP/curl.err" || fail "scrape: $(cat "$E2E_TMP/curl.err")"
perl "$HERE/../e2e/prom_check.pl" <"$E2E_TMP/attacker.prom" || fail "the exposition is not valid"
! grep -q 'vmx-' "$E2E_TMP/attacker.prom" ||
  fail "the metrics name the victim's guests: $(grep 'vmx-' "$E2E_TMP/attacker.prom" | head -n 3)"
! grep -Eq 'lkey|rkey|iova' "$E2E_TMP/attacker.prom" || fail "the metrics carry keys"
for l in $lids; do
  grep -Eq "^vrdma_guest_sent_messages_total\{guest=\"$l\"\} [0-9]+$" "$E2E_TMP/attacker.prom" ||
    fail "no counters under $l: $(grep '^vrdma_guest_sent_messages_total' "$E2E_TMP/attacker.prom")"
done
logged "metrics: new snapshot of [0-9]+ bytes" "the rendered snapshot"

wait_sent_above vmx-c "$(guest_sent vmx-c)"
kill -USR1 "$cli_proc"
finish_stream vmx "$cli" "$srv"
log "victim's stream: $STREAM_RESULT"
pp_as root
backend_serves metrics_names
e2e_pass
