#!/usr/bin/env bash
# Issue 21, item 1 (its first step): the status document told any client every guest's QPNs,
# PSNs, dlid/rqpn, lkeys, rkeys and iovas, which is what connecting to a victim's QP and reading
# its memory takes. While the victim's guests hold a verifying stream (and the attacker a guest
# of its own), the attacker's `vrdma status --json`, `res show` (all types), `stat` and a raw
# Status command (before any hello, and on a session of its own) show none of the victim's guests
# and no key or address, while its own resources still show; the victim sees its own guests
# without keys; root sees everything with keys. The backend logs each cut-down view and the pid
# a hello claimed against the one the kernel gave (debug lines). Then the victim's stream ends
# with the same bytes at both ends, and the backend serves a new pingpong.
# Usage: status_leak.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
SEC_VRDMAD_LOG=debug
sec_init "${1:-}"
vuid="$(id -u "$VICTIM")" auid="$(id -u "$ATTACKER")"

sec_stream_start "$VICTIM" vl
wait_sent_above vl-c 0
# The attacker's own guest, held open by a pingpong server that waits for a client.
pp_as "$ATTACKER"
start_server a-own al-own -n 5
a_srv=$SERVER_PID

# Views of the document, as USER, into $E2E_TMP/out/NAME.
view() {
  local u=$1 name=$2
  shift 2
  as_user "$u" "$@" >"$E2E_TMP/out/$name" 2>"$E2E_TMP/out/$name.err" ||
    fail "$name as $u: $(cat "$E2E_TMP/out/$name.err")"
}
# Fails if file F names a guest matching REGEX anywhere or carries a key or an address.
no_leak() {
  local f=$1 what=$2
  ! grep -Eq 'vl-[sc]' "$f" || fail "$what shows the victim's guests: $(head -c 600 "$f")"
  ! grep -Eq '"(lkey|rkey|iova)"|\b(lkey|rkey|iova) ' "$f" ||
    fail "$what shows keys or addresses: $(head -c 600 "$f")"
}
V=("$SEC_BIN/vrdma")
R=("$SEC_BIN/vrdma_raw_client" "$VRDMA_SOCKET")
view "$ATTACKER" status.json "${V[@]}" status --json
view "$ATTACKER" status.txt "${V[@]}" status
for t in qp cq mr pd srq; do view "$ATTACKER" "res-$t.json" "${V[@]}" res show "$t" -j; done
view "$ATTACKER" res-mr.txt "${V[@]}" res show mr
view "$ATTACKER" res.json "${V[@]}" res show -j
view "$ATTACKER" stat.json "${V[@]}" stat -j
view "$ATTACKER" raw-before-hello.json "${R[@]}" status
# On a session of its own, claiming the victim's pid: the same view, and the backend records the
# attacker's real pid.
vpid="$(pgrep -u "$VICTIM" -x rc_stream | head -n 1)"
view "$ATTACKER" raw-session.json "${R[@]}" hello al-raw "$vpid" status
for f in "$E2E_TMP"/out/*.json "$E2E_TMP"/out/*.txt; do no_leak "$f" "$(basename "$f")"; done

# The attacker's view is its own: its guests, its uid, no admin.
js() { EXPR="$2" perl -MJSON::PP -0777 -ne 'my $j = decode_json($_); my $r = eval $ENV{EXPR};
  die $@ if $@; print((defined $r ? $r : ""), "\n");' "$E2E_TMP/out/$1"; }
for f in status.json raw-before-hello.json raw-session.json; do
  v="$(js "$f" '"$j->{view}{uid}:" . ($j->{view}{admin} ? "admin" : "user")')"
  [[ $v == "$auid:user" ]] || fail "$f: view is $v"
done
[[ "$(js status.json 'join ",", sort map { $_->{guest} } @{$j->{guests}}')" == al-own ]] ||
  fail "the attacker's status lists: $(js status.json 'join ",", map { $_->{guest} } @{$j->{guests}}')"
[[ "$(js raw-session.json 'join ",", sort map { $_->{guest} } @{$j->{guests}}')" == al-own,al-raw ]] ||
  fail "the attacker's session sees: $(js raw-session.json 'join ",", map { $_->{guest} } @{$j->{guests}}')"
[[ "$(js status.json '$j->{totals}{guests}')" == 1 ]] || fail "attacker's totals count others' guests"
[[ "$(js res-mr.json 'scalar(@$j) . ":" . $j->[0]{guest} . ":" . ($j->[0]{mrlen} > 0)')" == 1:al-own:1 ]] ||
  fail "the attacker's own MR: $(cat "$E2E_TMP/out/res-mr.json")"
grep -q "^view: uid $auid: its own guests only" "$E2E_TMP/out/status.txt" ||
  fail "vrdma status does not say the view is cut down: $(cat "$E2E_TMP/out/status.txt")"
# The session's pid is the kernel's, not the one the hello claimed.
gone="$(status_query 'my ($g) = grep { $_->{guest} eq "al-raw" } @{$j->{guests}}; $g ? 0 : 1')"
[[ $gone == 1 ]] || fail "the raw client's guest outlived its connection"
logged "connection [0-9]+ \(before hello\): status for uid $auid: its own 1 guest\(s\), keys and addresses hidden" \
  "the attacker's status before hello"
logged "guest al-raw pid [0-9]+ session [0-9]+: status for uid $auid: its own 2 guest\(s\)" \
  "the attacker's status on a session"
logged "hello claims pid $vpid, the socket's peer is pid [0-9]+" "the forged hello pid"
logged "session [0-9]+ opened: guest al-raw pid [0-9]+ uid $auid" "the raw client's session"
! grep -Eq "session [0-9]+ opened: guest al-raw pid $vpid " "$E2E_TMP/vrdmad.log" ||
  fail "the backend recorded the pid the hello claimed"

# The victim: its own guests, no keys.
view "$VICTIM" v-status.json "${V[@]}" status --json
view "$VICTIM" v-res-mr.json "${V[@]}" res show mr -j
[[ "$(js v-status.json 'join ",", sort map { $_->{guest} } @{$j->{guests}}')" == vl-c,vl-s ]] ||
  fail "the victim's status lists: $(js v-status.json 'join ",", map { $_->{guest} } @{$j->{guests}}')"
[[ "$(js v-res-mr.json 'scalar(@$j) . ":" . (grep { exists $_->{rkey} || exists $_->{lkey} || exists $_->{iova} } @$j)')" == 2:0 ]] ||
  fail "the victim's MRs: $(cat "$E2E_TMP/out/v-res-mr.json")"
# Root: everything, keys included.
"$VRDMA" res show mr -j >"$E2E_TMP/root-mr.json"
[[ "$(EXPR='join ",", map { "$_->{guest}:" . (exists $_->{rkey} && exists $_->{iova} ? "k" : "-") }
  sort { $a->{guest} cmp $b->{guest} } @$j' perl -MJSON::PP -0777 -ne \
  'my $j = decode_json($_); print eval $ENV{EXPR}, "\n"' "$E2E_TMP/root-mr.json")" == al-own:k,vl-c:k,vl-s:k ]] ||
  fail "root's MRs: $(cat "$E2E_TMP/root-mr.json")"
"$VRDMA" status | grep -q '^view:' && fail "root's status says its view is cut down"

# The victim's stream was untouched.
wait_sent_above vl-c "$(guest_sent vl-c)"
kill -USR1 "$cli_proc"
finish_stream vl "$cli" "$srv"
log "victim's stream: $STREAM_RESULT"
kill_descendants "$a_srv"
pp_as root
backend_serves status_leak
e2e_pass
