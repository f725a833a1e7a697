#!/usr/bin/env bash
# The direct path (docs/ARCHITECTURE.md, "Direct path"): two guests of one uid on a backend that
# grants it (VRDMA_DIRECT_PATH=1, as `vrdmad --direct-path`) move their bytes themselves. Debian's
# tools must work exactly as through the backend: every byte checked (ibv_rc_pingpong -c, a
# checksummed rc_stream), every perftest size, atomics (executed by the libraries too), and the
# backend must say which QPs are direct and count their messages. Then the same pair on a
# backend without it: not direct. QPs on an SRQ too (ibv_srq_pingpong). (UC and UD:
# direct_path_ud.sh.)
# Usage: direct_path.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
export VRDMA_DIRECT_PATH=1  # the backend the library starts inherits it
# Under the sanitizers each step is ~10x slower and what matters there is the code each size and
# opcode runs, not how many times: fewer iterations.
PP_N=5000 PT_N=30 LAT_N=1000
if under_asan; then PP_N=500 PT_N=5 LAT_N=100; fi

# Waits until `vrdma res show qp` lists N QPs whose transport is $2. Usage: wait_transport N T
wait_transport() {
  local i
  for ((i = 0; i < 200; i++)); do
    [[ $("$VRDMA" res show qp 2>/dev/null | grep -c "transport $2") -ge $1 ]] && return 0
    nap 0.05
  done
  fail "expected $1 QPs with transport $2: $("$VRDMA" res show qp 2>&1)"
}

# 1. ibv_rc_pingpong -c validates every buffer it receives; both sides' QPs are granted.
start_server pp pp-a -n "$PP_N" -c
start_client pp pp-b "$PORT" -n "$PP_N" -c
finish_pair pp "$SERVER_PID" "$CLIENT_PID" 90
for g in pp-a pp-b; do
  grep -q "direct path: guest $g QP" "$E2E_TMP/vrdmad.log" || fail "no grant for $g in the log"
done

# 1b. ibv_srq_pingpong -c: each side's QPs (16) receive from one SRQ, which the other side's
# libraries feed themselves (issue 25): both sides granted, and while it runs the direct
# counters of the client's guest grow both ways.
# The counts are read while the pair runs (the QPs' counters go with them), and a direct run can
# end before the first read: 5000 round trips took 20 ms, 20,000 under ASan 0.15 s, less than
# one `vrdma stat` there. So a run that ended unseen is made again with four times the round
# trips (each run checks its data: -c), until one is seen (five runs at most).
srq_sent=0 srq_recv=0 srq_n=$((PP_N * 40))
for ((run = 0; run < 5; run++, srq_n *= 4)); do
  PP_TOOL=ibv_srq_pingpong start_server srq srq-a -c -n "$srq_n"
  PP_TOOL=ibv_srq_pingpong start_client srq srq-b "$PORT" -c -n "$srq_n"
  for ((i = 0; i < 400; i++)); do
    read -r srq_sent srq_recv <<<"$(direct_counts srq-b)"
    ((srq_sent > 100 && srq_recv > 100)) && break
    kill -0 "$CLIENT_PID" 2>/dev/null || break
    nap 0.05
  done
  PP_TOOL=ibv_srq_pingpong finish_pair srq "$SERVER_PID" "$CLIENT_PID" 120
  ((srq_sent > 100 && srq_recv > 100)) && break
  log "ibv_srq_pingpong -n $srq_n ended before its direct counts were seen (last: sent $srq_sent, received $srq_recv); again with more"
done
((srq_sent > 100 && srq_recv > 100)) ||
  fail "ibv_srq_pingpong: not direct (sent $srq_sent, received $srq_recv)"
for g in srq-a srq-b; do
  grep -q "direct path: guest $g QP" "$E2E_TMP/vrdmad.log" || fail "no grant for $g in the log"
done
log "ibv_srq_pingpong: direct messages sent $srq_sent, received $srq_recv"

# 2. An open-ended checksummed stream of SENDs (32 in flight): the sender's QP shows as direct
# while it runs; then nothing lost, repeated, reordered or corrupted.
stream_start st 8192
wait_transport 1 direct
# The backend counts what the libraries move directly: the direct parts of both sides' counters
# grow, and the totals include them.
a_sent="$(direct_count st-c direct_msgs_sent)" a_recv="$(direct_count st-s direct_msgs_received)"
sleep 1
b_sent="$(direct_count st-c direct_msgs_sent)" b_recv="$(direct_count st-s direct_msgs_received)"
((b_sent > a_sent && b_recv > a_recv)) ||
  fail "direct messages not counted: sent $a_sent -> $b_sent, received $a_recv -> $b_recv"
t_sent="$(direct_count st-c msgs_sent)" t_recv="$(direct_count st-s msgs_received)"
((t_sent >= b_sent && t_recv >= b_recv)) ||
  fail "totals without the direct messages: sent $t_sent < $b_sent or received $t_recv < $b_recv"
log "counted while direct: sent $a_sent -> $b_sent (total $t_sent), received $a_recv -> $b_recv"
kill -USR1 "$cli_proc"
finish_stream st "$cli" "$srv" 90
log "rc_stream: $STREAM_RESULT"

# 3. perftest over every size; READ and the atomics too.
for tool in ib_send_bw ib_write_bw ib_read_bw; do
  run_perftest "$tool" -a -n "$PT_N"
  rows="$(result_rows "$E2E_TMP/$tool.client.out")"
  [[ $(wc -l <<<"$rows") -ge 23 ]] || fail "$tool -a: not every size: $rows"
  # The message rate (5th column, Mpps): a slow 2 B point prints 0.00 MB/s in the 4th.
  awk '{ if ($5 + 0 <= 0) exit 1 }' <<<"$rows" || fail "$tool: a size with no messages: $rows"
  log "$tool -a: 8 MiB: $(tail -n 1 <<<"$rows" | awk '{print $4}') MB/s"
done
for tool in ib_send_lat ib_write_lat ib_atomic_lat; do
  run_perftest "$tool" -n "$LAT_N"
  row="$(result_rows "$E2E_TMP/$tool.client.out" | tail -n 1)"
  [[ $(awk '{print $2}' <<<"$row") == "$LAT_N" ]] || fail "$tool: no result row: $row"
  log "$tool: $row"
done
grants="$(grep -c 'direct path: guest pt-cli' "$E2E_TMP/vrdmad.log" || true)"
[[ $grants -ge 5 ]] || fail "expected perftest's client QPs granted, log has $grants"
# The atomics for 1 s each: while they run, the client's library executes them (the backend's
# direct counters of the client's sent and the server's received messages grow).
for tool in ib_atomic_lat ib_atomic_bw; do
  run_direct_tool "$tool" at-srv at-cli at-cli at-srv "$tool" -D 1
done

# 4. A backend without the direct path: the same pair stays on it.
kill "$(backend_pid)" 2>/dev/null || true
for ((i = 0; i < 50; i++)); do [[ -S $VRDMA_SOCKET ]] || break; sleep 0.1; done
export VRDMA_DIRECT_PATH=0  # on by default
start_server off off-a -n "$PP_N" -c
start_client off off-b "$PORT" -n "$PP_N" -c
finish_pair off "$SERVER_PID" "$CLIENT_PID" 90
[[ $(grep -c "direct path: guest off-" "$E2E_TMP/vrdmad.log") == 0 ]] || fail "granted while off"
e2e_pass
