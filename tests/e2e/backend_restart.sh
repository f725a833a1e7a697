#!/usr/bin/env bash
# A backend that dies (SIGKILL, leaving its socket file behind) is replaced on the next use:
# `vrdma run` starts a new one and programs work again.
# Usage: backend_restart.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

vrun -- ibv_devinfo >"$E2E_TMP/first.out" 2>&1 || fail "ibv_devinfo failed"
old="$(backend_pid)"
[[ -n $old ]] || fail "no backend after the first run"
log "SIGKILL backend $old"
kill -KILL "$old"
for ((i = 0; i < 50; i++)); do
  kill -0 "$old" 2>/dev/null || break
  nap 0.1
done
[[ -S $VRDMA_SOCKET ]] || log "(the socket file is gone too)"
if "$VRDMA" status >/dev/null 2>&1; then fail "status answered with the backend dead"; fi

vrun -- ibv_devinfo >"$E2E_TMP/second.out" 2>&1 || fail "ibv_devinfo failed after the backend died"
grep -q vrdma0 "$E2E_TMP/second.out" || fail "no vrdma0 after the restart"
new="$(backend_pid)"
[[ -n $new && $new != "$old" ]] || fail "no new backend (old $old, now '${new}')"
run_pair after srv cli
e2e_pass
