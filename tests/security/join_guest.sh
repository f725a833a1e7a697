#!/usr/bin/env bash
# Issue 21, item 2: another user opens a session in the victim's guest by name (to use up its
# quotas, share its QPN space and epoch page). While the victim's guests hold a verifying
# stream, the attacker tries, through the library (ibv_devinfo, ibv_rc_pingpong) and with its
# own client that claims the victim's pid (raw_client): each gets EPERM, the library says whose
# guest it is not and how to choose another name, and the backend logs the refusal naming both
# uids and the guest. The victim's guests keep their sessions and resources, the stream runs on
# and ends with the same bytes at both ends, and the backend serves a new pingpong.
# Usage: join_guest.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
sec_init "${1:-}"
vuid="$(id -u "$VICTIM")" auid="$(id -u "$ATTACKER")"

sec_stream_start "$VICTIM" vj
wait_sent_above vj-c 0
# What the victim's guests hold: sessions and resources, as root sees them.
holds='join " ", map { my $g = $_; "$g->{guest}:" . scalar(@{$g->{sessions}}) . ":" .
  join(",", map { "$_=$g->{resources}{$_}" } sort keys %{$g->{resources}}) }
  sort { $a->{guest} cmp $b->{guest} } grep { $_->{guest} =~ /^vj-/ } @{$j->{guests}}'
before="$(status_query "$holds")"
log "victim's guests: $before"
[[ $before == "vj-c:1:"*" vj-s:1:"* ]] || fail "victim's guests: $before"
sent="$(guest_sent vj-c)"

# Through the library: the device does not open, and the message says why and what to do.
for g in vj-s vj-c; do
  rc=0
  vrun_as "$ATTACKER" --guest "$g" -- ibv_devinfo >"$E2E_TMP/devinfo-$g.out" 2>&1 || rc=$?
  [[ $rc -ne 0 ]] || fail "the attacker opened the victim's guest $g: $(cat "$E2E_TMP/devinfo-$g.out")"
  grep -q "guest $g belongs to another user (not to uid $auid); choose another name with VRDMA_GUEST" \
    "$E2E_TMP/devinfo-$g.out" || fail "ibv_devinfo in $g: $(cat "$E2E_TMP/devinfo-$g.out")"
  logged "guest $g: uid $auid \(pid [0-9]+\) refused a session \(EPERM\): the guest belongs to uid $vuid" \
    "the refused hello in $g"
done
rc=0
vrun_as "$ATTACKER" --guest vj-s -- ibv_rc_pingpong -p "$(free_port)" \
  >"$E2E_TMP/pp-attack.out" 2>&1 || rc=$?
[[ $rc -ne 0 ]] && grep -q "belongs to another user" "$E2E_TMP/pp-attack.out" ||
  fail "ibv_rc_pingpong in the victim's guest: rc $rc: $(cat "$E2E_TMP/pp-attack.out")"

# Without the library, claiming to be the victim's process: the backend's own rule refuses it.
vpid="$(pgrep -u "$VICTIM" -x rc_stream | head -n 1)"
rc=0
as_user "$ATTACKER" "$SEC_BIN/vrdma_raw_client" "$VRDMA_SOCKET" hello vj-c "$vpid" \
  >"$E2E_TMP/raw-hello.out" 2>&1 || rc=$?
[[ $rc == 3 ]] && grep -q '^hello: EPERM' "$E2E_TMP/raw-hello.out" ||
  fail "raw hello into vj-c: rc $rc: $(cat "$E2E_TMP/raw-hello.out")"

# Nothing of the victim's changed, and its stream moves on.
after="$(status_query "$holds")"
[[ $after == "$before" ]] || fail "the victim's guests changed: '$before' -> '$after'"
wait_sent_above vj-c "$sent"
kill -USR1 "$cli_proc"
finish_stream vj "$cli" "$srv"
log "victim's stream: $STREAM_RESULT"

# The attacker still has a device of its own, under a name of its own.
vrun_as "$ATTACKER" --guest attacker-own -- ibv_devinfo >"$E2E_TMP/own.out" 2>&1 ||
  fail "the attacker's own guest: $(cat "$E2E_TMP/own.out")"
pp_as root
backend_serves join_guest
e2e_pass
