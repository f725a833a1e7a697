#!/usr/bin/env bash
# A peer backend is killed (SIGKILL) and not restarted while an RC stream toward one of its
# guests runs: the requester's WQE completes with IBV_WC_RETRY_EXC_ERR once the QP's retry
# budget (timeout 14 x retry_cnt 7, about 0.5 s) is spent, and nothing hangs. The surviving
# backend keeps serving: a pingpong between two of its own guests still runs.
# Pinned to the backends' TCP transport (--no-direct-remote): a pair on the direct path across
# backends keeps going when a backend dies, so the requester's retry budget would not be tested.
# Usage: peer_dies.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"
hosts_init "${1:-}" 2
wait_mesh

port=$((17000 + RANDOM % 1000))
hrun 1 --guest doomed -- "$HOSTS_BIN/rc_stream" server "$port" 0 4096 \
  >"$E2E_TMP/stream.server.out" 2>&1 &
srv=$!
hwait_port 1 "$port" "$srv" stream
hrun 2 --guest survivor -- "$HOSTS_BIN/rc_stream" client "$(host_ip 1)" "$port" 0 4096 \
  >"$E2E_TMP/stream.client.out" 2>&1 &
cli=$!
sleep 1
kill -0 "$cli" 2>/dev/null || fail "the stream ended before the peer was killed"
log "killing h1's backend"
kill_backend 1
t0=$(date +%s%N)
wait_pid "$cli" 30
ms=$((($(date +%s%N) - t0) / 1000000))
[[ $WAIT_RC != 124 ]] || fail "requester still running 30 s after its peer backend died"
[[ $WAIT_RC != 0 ]] || fail "requester succeeded although its peer backend died"
grep -q "transport retry counter exceeded" "$E2E_TMP/stream.client.out" ||
  fail "requester did not end with IBV_WC_RETRY_EXC_ERR: $(cat "$E2E_TMP/stream.client.out")"
log "requester: '$(cat "$E2E_TMP/stream.client.out")' after $ms ms"
grep -q "transport retries exhausted" "$E2E_TMP/vrdmad.h2.log" || fail "h2's log has no retry line"
kill -KILL "$srv" 2>/dev/null || true

# The survivor's backend is fine: two of its guests still talk (shm).
hpair after 2 2 -n 200
e2e_pass
