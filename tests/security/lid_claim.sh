#!/usr/bin/env bash
# Another user claims the identity of a victim's peer on another host: two namespace hosts, a
# victim's verifying RC stream (rc_stream) from its guest lc-c on h2 to its guest lc-s on h1, and
# an attacker on h1 who (a) opens a guest named lc-c, whose GID and LID are the name's, and (b)
# opens a guest whose name hashes to lc-c's LID (found by tests/security/lid_collide.cc). (a) is
# refused at Hello with a log line naming the backend where lc-c lives; (b) gets another LID.
# Nothing of the attacker reaches the stream: it ends with equal checksums on both ends, and both
# backends serve a new pair.
# Usage: lid_claim.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=../hosts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../hosts/lib.sh"
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
E2E_NAME=security.lid_claim
hosts_init "${1:-}" 2
wait_mesh
sec_users "${1:-}"
share_socket "$(host_sock 1)"
share_socket "$(host_sock 2)"

# Runs CMD as USER on host I through vrdma. Usage: hrun_as I USER [--guest G] -- CMD...
hrun_as() {
  local i=$1 u=$2
  shift 2
  become_argv "$u"
  hexec "$i" "${BECOME[@]}" env VRDMA_SOCKET="$(host_sock "$i")" VRDMA_BACKEND=/nonexistent \
    ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} ${LSAN_OPTIONS:+LSAN_OPTIONS=$LSAN_OPTIONS} \
    "$SEC_BIN/vrdma" run "$@"
}

# The victim's stream, open-ended: it runs until the test stops it.
port=$((17000 + RANDOM % 1000))
hrun_as 1 "$VICTIM" --guest lc-s -- "$SEC_BIN/rc_stream" server "$port" 0 4096 \
  >"$E2E_TMP/lc.server.out" 2>&1 &
srv=$!
hwait_port 1 "$port" "$srv" lc
hrun_as 2 "$VICTIM" --guest lc-c -- "$SEC_BIN/rc_stream" client "$(host_ip 1)" "$port" 0 4096 \
  >"$E2E_TMP/lc.client.out" 2>&1 &
cli=$!
cli_proc=$(child_named "$cli" rc_stream)
hwait_flowing 1 lc-s msgs_received "$srv"
lid="$(hqps 2 lc-c qpn | wc -l)"
[[ $lid == 1 ]] || fail "lc-c has $lid QPs"
victim_lid="$(hstatus 2 | perl -MJSON::PP -0777 -ne \
  'for (@{decode_json($_)->{guests}}) { print $_->{lid} if $_->{guest} eq "lc-c" }')"
[[ -n $victim_lid ]] || fail "no LID for lc-c in h2's status"

# (a) The victim's peer's name on h1.
rc=0
hrun_as 1 "$ATTACKER" --guest lc-c -- ibv_devinfo >"$E2E_TMP/a.out" 2>&1 || rc=$?
grep -q 'hca_id:.*vrdma0' "$E2E_TMP/a.out" && [[ $rc == 0 ]] &&
  fail "the attacker opened guest lc-c on h1: $(cat "$E2E_TMP/a.out")"
grep -q "guest lc-c: refused: backend h2 has a guest of that name" "$E2E_TMP/vrdmad.h1.log" ||
  fail "h1 did not log the refusal: $(grep lc-c "$E2E_TMP/vrdmad.h1.log" | tail -n 3)"
log "(a) a guest named lc-c on h1: refused (rc $rc)"

# (b) A name that hashes to the victim's peer's LID.
name="$("$SEC_BIN/lid_collide" "$victim_lid")"
hrun_as 1 "$ATTACKER" --guest "$name" -- ibv_devinfo -v >"$E2E_TMP/b.out" 2>&1 ||
  fail "the attacker's own guest: $(cat "$E2E_TMP/b.out")"
got="$(awk '/port_lid:/ {print $2; exit}' "$E2E_TMP/b.out")"
[[ -n $got ]] || fail "no port_lid: $(cat "$E2E_TMP/b.out")"
((got != victim_lid)) || fail "guest $name on h1 got lc-c's LID $victim_lid"
log "(b) guest $name (hashes to lc-c's LID $victim_lid) got LID $got"

# The stream never noticed.
kill -0 "$cli" 2>/dev/null || fail "the victim's stream ended: $(tail -n 3 "$E2E_TMP/lc.client.out")"
kill -USR1 "$cli_proc"
finish_stream lc "$cli" "$srv" 30
log "victim's stream: $STREAM_RESULT on both ends"
hpair after 1 2 -n 200
e2e_pass
