#!/usr/bin/env bash
# The conformance suite (tests/verbs/verbs_conformance_test) on the direct path across backends:
# two backends on this host (--direct-remote, meshed over loopback, --insecure), our guest on
# one and the suite's peer guest on the other, so every RC and UC pair's libraries talk to each
# other and each rule of the suite is proven on that path too (UD and the tests that reach into
# a backend's rings stay on the backends' paths), CqOverrunIsCqError included (the library raises
# IBV_EVENT_CQ_ERR when its own send ring overruns, as the backend does for its rings). About
# 11 s. The hub's spin is set by its old name, VRDMA_SPIN_US: still taken, with one deprecation
# line per process. RnrRetryCountThenRnrRetryExceeded included: the library's path counts
# rnr_retry as the backend does. The Windows section runs here too: QPs that may bind windows stay
# on the backends and the others reach windows through their library, which asks its backend
# (ARCHITECTURE.md, "Memory windows"); the ODP case's first touches and unreachable page go
# through the responding library's fault-in. ASnapshotWithWorkInFlightKeepsEveryMessageOnceAndInOrder
# takes a pair back to the backends (kRevoke) with SENDs and READs in flight. Then windows, ODP
# and XRC again with the backends restarted with --no-direct-remote (their TCP path between them).
# Usage: conformance_remote.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
E2E_NO_CLI=1 e2e_init "${1:-}"
BIN="$(dirname "$VRDMA")"
SUITE="$BIN/verbs_conformance_test"
[[ -x $SUITE ]] || fail "$SUITE is not built"

pa="$(free_port)"
pb="$(free_port)"
while [[ $pb == "$pa" ]]; do pb="$(free_port)"; done
start_node() {  # NAME PORT PEER_PORT [FLAG...]
  "$BIN/vrdmad" --socket "$E2E_TMP/$1.sock" --node "$1" --idle-exit 0 --insecure "${@:4}" \
    --listen "127.0.0.1:$2" --peer "127.0.0.1:$3" >"$E2E_TMP/vrdmad.$1.out" 2>&1 &
}
start_pair() {  # [FLAG...]
  start_node a "$pa" "$pb" "$@"
  start_node b "$pb" "$pa" "$@"
  for n in a b; do
    for ((i = 0; i < 200; i++)); do
      [[ -S $E2E_TMP/$n.sock ]] && grep -q "connected to " "$E2E_TMP/vrdmad.$n.out" && break
      nap 0.05
    done
    grep -q "connected to " "$E2E_TMP/vrdmad.$n.out" ||
      fail "backend $n did not join: $(tail -n 5 "$E2E_TMP/vrdmad.$n.out")"
  done
}
start_pair  # direct_remote is the default

log "the suite, our guest on backend a, the peer's on b"
VRDMA_SOCKET="$E2E_TMP/a.sock" VRDMA_TEST_PEER_SOCKET="$E2E_TMP/b.sock" VRDMA_SPIN_US=200 \
  VRDMA_BACKEND=/nonexistent-vrdmad "$SUITE" --gtest_brief=1 \
  >"$E2E_TMP/suite.out" 2>&1 || {
  cat "$E2E_TMP/suite.out" >&2
  fail "the conformance suite failed across backends"
}
tail -n 3 "$E2E_TMP/suite.out" >&2
deprecated='vrdma\[[0-9]+\] warn: VRDMA_SPIN_US is deprecated: the library.s poll spin is VRDMA_POLL_SPIN_US'
grep -Eq "$deprecated" "$E2E_TMP/suite.out" || fail "no deprecation line for VRDMA_SPIN_US"
twice="$(grep -Eo "$deprecated" "$E2E_TMP/suite.out" | grep -Eo '\[[0-9]+\]' | sort | uniq -d)"
[[ -z $twice ]] || fail "the deprecation line came more than once from process $twice"
# ASnapshotWithWorkInFlight...: the pair went back to the backends before the snapshot, both ends.
# It takes the snapshot with the vrdma CLI, which the TSan preset does not build (it skips there).
if [[ -x $BIN/vrdma ]]; then
  [[ $(grep -c "is back on the backends" "$E2E_TMP/suite.out") -ge 2 ]] ||
    fail "no QP pair went back to the backends for a snapshot: $(grep "back" "$E2E_TMP/suite.out")"
else
  log "no vrdma CLI in $BIN: the snapshot case skipped"
fi
grep -q "direct path: guest .* QP .* of backend" "$E2E_TMP/vrdmad.a.out" "$E2E_TMP/vrdmad.b.out" ||
  fail "no QP took the direct path across backends: $(grep -h direct "$E2E_TMP"/vrdmad.*.out | tail -n 5)"

# Windows, ODP and XRC again over the backends' own TCP path between them (direct_remote off):
# a peer's first touch of ODP pages then waits for the pager behind an RNR NAK. ~3 s.
log "windows, ODP and XRC through the backends"
for n in a b; do
  kill -TERM "$(cat "$E2E_TMP/$n.sock.pid")"
  for ((i = 0; i < 200; i++)); do
    [[ -S $E2E_TMP/$n.sock ]] || break
    nap 0.05
  done
done
start_pair --no-direct-remote
VRDMA_SOCKET="$E2E_TMP/a.sock" VRDMA_TEST_PEER_SOCKET="$E2E_TMP/b.sock" \
  VRDMA_BACKEND=/nonexistent-vrdmad "$SUITE" --gtest_brief=1 \
  --gtest_filter='Windows.*:XrcConformance.*:Conformance.Odp*' >"$E2E_TMP/suite2.out" 2>&1 || {
  cat "$E2E_TMP/suite2.out" >&2
  fail "windows, ODP or XRC failed through the backends"
}
tail -n 1 "$E2E_TMP/suite2.out" >&2
! grep -q "direct path: guest .* QP .* of backend" "$E2E_TMP/vrdmad.a.out" "$E2E_TMP/vrdmad.b.out" ||
  fail "a QP took the direct path across backends with direct_remote off"
e2e_pass
