#!/usr/bin/env bash
# XRC across SIGKILLs of the backend (docs/ARCHITECTURE.md, "XRC" and "Moving a guest's
# device"): a backend with --keep-state serves Debian's unmodified ibv_xsrq_pingpong, a server
# and a client in guests of their own, each with an XRC domain opened by a file, an XRC SRQ with
# a receive posted, an XRC_SEND and an XRC_RECV QP.
#  1. At a point of the run that does not depend on timing: the server stopped (SIGSTOP) in
#     accept(), the client past its set-up, having sent the server its QPN and SRQ number and
#     waiting for the server's; no command to the backend is in flight. The backend is killed,
#     the keeper's new backend restores both guests (the SRQs as they were, `res show srq`),
#     and the run goes on with the numbers exchanged before the kill.
#  2. Once messages flow, both programs are stopped while neither has sent all its messages
#     (each XRC_SEND QP's count below the iterations: both are in their loops, which post to
#     rings only) and the backend is killed again. A machine fast enough to finish the run
#     before the stop skips this kill (logged).
# Both programs finish every iteration and say "success".
# Usage: xrc_keep_state.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

# ibv_xsrq_pingpong opens this path with O_CREAT and never removes it: ours goes at the end.
DOMAIN_FILE=/tmp/xrc_domain
[[ -e $DOMAIN_FILE ]] && HAD_DOMAIN_FILE=1 || HAD_DOMAIN_FILE=0
trap 'rc=$?; set +e; [[ $HAD_DOMAIN_FILE == 1 ]] || rm -f "$DOMAIN_FILE"; (exit $rc); e2e_cleanup' EXIT

# shellcheck disable=SC2119  # no arguments: the default data path
start_kept_backend

pp_proc() { exec_named "$1" ibv_xsrq_pingpong; }
# `vrdma res show srq -j`, one row a line, in order (a restore gives the sessions new ids).
srq_rows() { "$VRDMA" res show srq -j 2>&1 | sed 's/},{/}\n{/g; s/^\[//; s/\]$//' | sort; }
# Messages the guests' XRC send QPs sent, summed.
xrc_sent() {
  "$VRDMA" res show qp type XRC_SEND -j 2>/dev/null | grep -o '"msgs_sent":[0-9]*' |
    awk -F: '{s += $2} END {print s + 0}'
}

# Enough that a fast machine is still in the traffic when part 2 stops it.
ITERS=8000  # (ibv_xsrq_pingpong sizes its send queue by it: the quota max_queue_depth is 8192)
PP_TOOL=ibv_xsrq_pingpong

# Kills the backend and waits until its keeper's new one has restored WANT guests in all (the
# log's count).
kill_and_restore() {
  local want=$1
  kill_kept_backend
  for ((i = 0; i < 100; i++)); do
    [[ $(grep -c 'restored from the keeper' "$E2E_TMP/vrdmad.log") -ge $want ]] && break
    nap 0.05
  done
  [[ $(grep -c 'restored from the keeper' "$E2E_TMP/vrdmad.log") -ge $want ]] ||
    fail "the new backend did not restore both guests: $(grep -i 'keep\|restor' "$E2E_TMP/vrdmad.log" | tail -n 5)"
  log "backend $KILLED killed, $RESTARTED restored both guests"
}

# 1. The server listens once its set-up is done (domain, SRQ, QPs, a receive posted): stopped
# there, it accepts nobody. The client's bytes waiting on the server's side of the connection
# say the client's set-up is done too.
start_server xks xs -c 1 -n "$ITERS"
srv_proc="$(pp_proc "$SERVER_PID")"
kill -STOP "$srv_proc"
"${VRUN[@]}" --guest xc1 -- "$PP_TOOL" -p "$PORT" -n "$ITERS" localhost \
  >"$E2E_TMP/xks.client1.out" 2>&1 &
CLIENT_PID=$!
cli_proc="$(pp_proc "$CLIENT_PID")"
for ((i = 0; i < 400; i++)); do
  q="$(ss -Htn state established "( sport = :$PORT )" 2>/dev/null | awk '{print $1; exit}')"
  [[ -n $q && $q -gt 0 ]] && break
  kill -0 "$CLIENT_PID" 2>/dev/null || fail "client exited: $(cat "$E2E_TMP/xks.client1.out")"
  nap 0.05
done
[[ -n $q && $q -gt 0 ]] || fail "the client did not send the server its address"
srq_rows >"$E2E_TMP/srq.before"
[[ $(grep -c '"srq_num"' "$E2E_TMP/srq.before") == 2 ]] ||
  fail "not two XRC SRQs listed: $(cat "$E2E_TMP/srq.before")"
kill_and_restore 2
srq_rows >"$E2E_TMP/srq.after"
cmp -s "$E2E_TMP/srq.before" "$E2E_TMP/srq.after" ||
  fail "SRQs differ after the restore: $(diff "$E2E_TMP/srq.before" "$E2E_TMP/srq.after")"
kill -CONT "$srv_proc"

# 2. Mid-traffic.
for ((i = 0; i < 300; i++)); do
  [[ $(xrc_sent) -gt 0 ]] && break
  kill -0 "$CLIENT_PID" 2>/dev/null || break
  nap 0.01
done
if kill -STOP "$srv_proc" "$cli_proc" 2>/dev/null &&
  "$VRDMA" res show qp type XRC_SEND -j | grep -o '"msgs_sent":[0-9]*' |
  awk -F: -v n="$ITERS" '$2 >= n {done = 1} END {exit NR == 2 && !done ? 0 : 1}'; then
  kill_and_restore 4
  log "killed in the middle of the traffic"
else
  log "the run finished before it could be stopped: no kill in the middle of the traffic"
fi
kill -CONT "$srv_proc" "$cli_proc" 2>/dev/null || true  # (either may be gone: it finished)
wait_success "client" "$CLIENT_PID" "$E2E_TMP/xks.client1.out" 60
wait_success "server" "$SERVER_PID" "$E2E_TMP/xks.server.out" 10
log "ibv_xsrq_pingpong -n $ITERS: success on both ends across the SIGKILLs"
e2e_pass
