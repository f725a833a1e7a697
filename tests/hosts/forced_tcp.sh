#!/usr/bin/env bash
# VRDMA_TRANSPORT=tcp on one host, no namespaces: the backend sends even pairs of its own guests
# through its TCP listener, so the cross-host path is tested on one machine. The status shows
# tcp and why for both QPs of a running stream; pingpongs and perftest complete.
# Usage: forced_tcp.sh BIN_DIR
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=../e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
e2e_init "${1:-}"
BIN="$(cd "${1:-}" && pwd)"
VRDMA_TRANSPORT=tcp "$BIN/vrdmad" --socket "$VRDMA_SOCKET" --node solo --idle-exit 0 \
  >"$E2E_TMP/vrdmad.log" 2>&1 &
for ((k = 0; k < 100; k++)); do
  [[ -S $VRDMA_SOCKET ]] && break
  nap 0.1
done
grep -q "forced for every pair" "$E2E_TMP/vrdmad.log" || fail "backend did not force tcp"

# Held open until the status has been read: an open-ended stream, stopped by the test.
stream_start forced
qps='join " ", map { $_->{transport} . "/" . $_->{peer_node} } map { @{$_->{qps}} } @{$j->{guests}}'
wait_status "$qps" "tcp/solo tcp/solo" 20 || fail "QPs not on tcp: $(status_json)"
why="$(status_query '(map { @{$_->{qps}} } @{$j->{guests}})[0]->{transport_why}')"
[[ $why == *VRDMA_TRANSPORT=tcp* ]] || fail "transport_why is '$why'"
kill -USR1 "$cli_proc"
finish_stream forced "$cli" "$srv" 30
log "forced tcp: $STREAM_RESULT on both ends"
run_pair validate srv cli -c -n 3000
run_pair gid srv cli -g 0 -c
PP_TOOL=ibv_ud_pingpong run_pair ud srv cli -n 500
run_perftest ib_read_lat -n 1000
run_perftest ib_atomic_lat -n 1000
e2e_pass
