#!/usr/bin/env bash
# With no backend running, several programs that load our libibverbs.so.1 directly (no
# `vrdma run`) start at once: each library tries to start a backend, exactly one serves, and
# every program gets vrdma0.
# Usage: autostart_race.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

lib_dir="$(cd "$(dirname "$VRDMA")/../lib" && pwd)"
[[ -z "$(backend_pid)" ]] || fail "a backend is already running"
pids=()
for i in 1 2 3 4 5 6; do
  env LD_LIBRARY_PATH="$lib_dir" ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} \
    ibv_devinfo >"$E2E_TMP/devinfo$i.out" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait_pid "${pids[$i]}" 20
  [[ $WAIT_RC == 0 ]] || fail "ibv_devinfo #$((i + 1)) exited $WAIT_RC: $(cat "$E2E_TMP/devinfo$((i + 1)).out")"
  grep -q "PORT_ACTIVE" "$E2E_TMP/devinfo$((i + 1)).out" || fail "ibv_devinfo #$((i + 1)): no active port"
done
# Every program already has the device, but a library's backend that lost the race may not have
# reached the lock yet (six starts on two CPUs, slower under a sanitizer): it leaves on its own
# once it finds the lock taken. Wait for that, never for a fixed time.
n=
for ((i = 0; i < 200; i++)); do
  n="$(pgrep -fc -- "vrdmad --socket $VRDMA_SOCKET " || true)"
  [[ $n -gt 1 ]] || break
  nap 0.1
done
[[ $n == 1 ]] || fail "$n backends serve $VRDMA_SOCKET after 20 s, expected exactly 1"
log "6 concurrent first uses, one backend: $(backend_pid)"
e2e_pass
