#!/usr/bin/env bash
# Guests SIGKILLed at any moment - while creating resources, registering memory, connecting
# (modify), posting, and mid-transfer: after each, the backend's resource totals and its fd count
# return to their baseline, the surviving peer notices (its QP goes to ERR: ibv_rc_pingpong
# fails with a flush error instead of hanging), and the backend keeps serving a new pair.
# Usage: guest_death.sh BIN_DIR   (ROUNDS=N rounds: 8 by default, 4 under a sanitizer)
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=lib.sh
: "${E2E_DEADLINE:=165}"  # ctest gives this test 180 s (a round takes ~10 s under ASan)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

fd_count() { find "/proc/$1/fd" -mindepth 1 -maxdepth 1 | wc -l; }

# Start the backend, and take the baseline with no guest connected.
vrun --guest warmup -- ibv_devinfo >/dev/null
bpid="$(backend_pid)"
[[ -n $bpid ]] || fail "no backend"
wait_status '$j->{totals}{sessions}' 0 10 || fail "sessions left after warm-up: $(status_json)"
fds0="$(fd_count "$bpid")"
log "backend $bpid: $fds0 fds with no guests"

session_of() { echo "scalar grep { \$_->{pid} == $1 } map { @{\$_->{sessions}} } @{\$j->{guests}}"; }

# Each of the four phases twice; once under a sanitizer, where every round is several times slower.
rounds=${ROUNDS:-8}
[[ -z $SAN_PRELOAD || -n ${ROUNDS:-} ]] || rounds=4
for ((r = 0; r < rounds; r++)); do
  # Phase (r % 4): who dies and when. Early: 0-30 ms after the client's session opened (the
  # client is in reg_mr / create_cq / create_qp / the TCP exchange, the server in modify).
  # Late: 0.3-1 s after (both connected, mid-transfer).
  phase=$((r % 4))
  size=$((64 << (RANDOM % 8)))
  start_server "r$r" "death-srv-$r" -n "$PP_UNTIL_STOPPED" -s "$size"
  srv=$SERVER_PID
  start_client "r$r" "death-cli-$r" "$PORT" -n "$PP_UNTIL_STOPPED" -s "$size"
  cli=$CLIENT_PID
  wait_status "$(session_of "$cli")" 1 20 || fail "round $r: the client has no session: $(status_json)"
  if ((phase < 2)); then delay_ms=$((RANDOM % 30)); else delay_ms=$((300 + RANDOM % 700)); fi
  if ((phase % 2 == 0)); then victim=$cli peer=$srv who=client; else victim=$srv peer=$cli who=server; fi
  sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
  log "round $r: SIGKILL the $who ${delay_ms} ms after the client's session opened"
  kill -KILL "$victim" 2>/dev/null || true
  wait "$victim" 2>/dev/null || true
  # The peer: mid-transfer its QP goes to ERR and it exits on its own with a failed completion;
  # early, it may still wait for its TCP partner (then the test kills it).
  wait_pid "$peer" $((phase < 2 ? 3 : 20))
  log "round $r: the peer ended with $WAIT_RC (124: killed by the test)"
  if ((phase >= 2)); then
    [[ $WAIT_RC != 0 && $WAIT_RC != 124 ]] ||
      fail "round $r: the peer of a guest killed mid-transfer ended with $WAIT_RC"
  fi
  kill -0 "$bpid" 2>/dev/null || fail "the backend died in round $r"
  wait_status '$j->{totals}{sessions}' 0 15 || fail "round $r: sessions left: $(status_json)"
  wait_status 'join ",", map { $j->{totals}{$_} } qw(pd mr cq qp srq channel segment)' \
    "0,0,0,0,0,0,0" 5 || fail "round $r: resources left: $(status_json)"
  fds="$(fd_count "$bpid")"
  [[ $fds == "$fds0" ]] || fail "round $r: backend holds $fds fds, $fds0 at the start: $(ls -l "/proc/$bpid/fd")"
done

# A connected peer of a dead guest fails at once (QP in ERR, flush completion) rather than after
# its retries: kill a server mid-transfer and check the client reports a failed completion.
start_server mid death-srv-mid -n "$PP_UNTIL_STOPPED"
srv=$SERVER_PID
start_client mid death-cli-mid "$PORT" -n "$PP_UNTIL_STOPPED"
cli=$CLIENT_PID
wait_status "$(session_of "$cli")" 1 20 || fail "the client has no session: $(status_json)"
nap 0.5
kill -0 "$cli" 2>/dev/null || fail "the client ended early: $(cat "$E2E_TMP/mid.client.out")"
kill -KILL "$srv"
wait "$srv" 2>/dev/null || true
wait_pid "$cli" 20
[[ $WAIT_RC != 0 && $WAIT_RC != 124 ]] || fail "the client of a dead server ended with $WAIT_RC"
# Flushed, not "Transport Retry Counter Exceeded": the backend put the QP in ERR when its peer's
# session ended, without waiting out the retries.
grep -q 'Failed status Work Request Flushed Error' "$E2E_TMP/mid.client.out" ||
  fail "no flushed completion at the client: $(cat "$E2E_TMP/mid.client.out")"
log "client of the dead server: $(grep -h 'Failed status' "$E2E_TMP/mid.client.out" | head -n 1)"

wait_status '$j->{totals}{sessions}' 0 15 || fail "sessions left: $(status_json)"
[[ "$(fd_count "$bpid")" == "$fds0" ]] || fail "fds: $(fd_count "$bpid"), baseline $fds0"
run_pair after death-srv-after death-cli-after -n 200
[[ "$(backend_pid)" == "$bpid" ]] || fail "the backend was replaced"
e2e_pass
