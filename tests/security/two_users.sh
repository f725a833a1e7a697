#!/usr/bin/env bash
# The ground the other security tests stand on: two real users share one root backend through
# its group socket (the README's SocketGroup/SocketMode recipe); each opens the device, and each
# runs an ibv_rc_pingpong pair of its own guests, both at once, to the end.
# Usage: two_users.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
sec_init "${1:-}"

for u in "$VICTIM" "$ATTACKER"; do
  vrun_as "$u" -- ibv_devinfo >"$E2E_TMP/$u.devinfo.out" 2>&1 ||
    fail "$u: ibv_devinfo: $(cat "$E2E_TMP/$u.devinfo.out")"
  grep -q 'hca_id:.*vrdma0' "$E2E_TMP/$u.devinfo.out" || fail "$u: no vrdma0"
done
pp_as "$VICTIM"
start_server v v-srv -n 2000
v_srv=$SERVER_PID v_port=$PORT
pp_as "$ATTACKER"
start_server a a-srv -n 2000
a_srv=$SERVER_PID a_port=$PORT
start_client a a-cli "$a_port" -n 2000
a_cli=$CLIENT_PID
pp_as "$VICTIM"
start_client v v-cli "$v_port" -n 2000
v_cli=$CLIENT_PID
finish_pair v "$v_srv" "$v_cli"
finish_pair a "$a_srv" "$a_cli"
pp_as root
backend_serves two_users
e2e_pass
