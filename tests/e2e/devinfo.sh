#!/usr/bin/env bash
# ibv_devinfo / ibv_devices (Debian's, unmodified) see the vrdma device with an active port and
# a non-zero LID. The backend is not started by hand: `vrdma run` starts it on first use.
# Usage: devinfo.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

out="$E2E_TMP/devinfo.out"
vrun -- ibv_devinfo -v >"$out" 2>&1 || fail "ibv_devinfo -v exited with $?"
grep -q 'vrdma0' "$out" || fail "ibv_devinfo: no vrdma0"
grep -q 'PORT_ACTIVE' "$out" || fail "ibv_devinfo: port not PORT_ACTIVE"
grep -Eq 'port_lid:[[:space:]]+[0-9]+' "$out" || fail "ibv_devinfo: no port_lid line"
grep -Eq 'port_lid:[[:space:]]+0*[1-9][0-9]*' "$out" || fail "ibv_devinfo: port_lid is 0"
[[ -n "$(backend_pid)" ]] || fail "no backend process serves $VRDMA_SOCKET"

out="$E2E_TMP/devices.out"
vrun -- ibv_devices >"$out" 2>&1 || fail "ibv_devices exited with $?"
grep -q 'vrdma0' "$out" || fail "ibv_devices: no vrdma0"

e2e_pass
