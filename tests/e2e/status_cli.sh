#!/usr/bin/env bash
# The `vrdma` command itself: `status` without a backend fails with a clear message; `run`
# reports a missing program like a shell does; `status` with a backend prints a table and JSON;
# a configured peer that cannot be reached shows its state and last error.
# Usage: status_cli.sh BIN_DIR
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

# No backend on our private socket.
if "$VRDMA" status >"$E2E_TMP/nobackend.out" 2>&1; then
  fail "vrdma status succeeded without a backend"
fi
grep -q 'no backend is running' "$E2E_TMP/nobackend.out" ||
  fail "unclear message: $(cat "$E2E_TMP/nobackend.out")"
if "$VRDMA" status --json --socket "$E2E_TMP/other.sock" >/dev/null 2>&1; then
  fail "vrdma status --json --socket succeeded without a backend"
fi

# Usage errors.
rc=0
"$VRDMA" run >/dev/null 2>&1 || rc=$?
[[ $rc -ne 0 ]] || fail "vrdma run without a command succeeded"
rc=0
"$VRDMA" >/dev/null 2>&1 || rc=$?
[[ $rc -ne 0 ]] || fail "vrdma without a subcommand succeeded"

# `run` starts the backend, passes the environment and the exit code through. (Plain "$VRDMA"
# run: a sanitizer runtime preloaded into sh would crash it.)
rc=0
"$VRDMA" run --guest g-env -- sh -c 'echo "$VRDMA_GUEST|$VRDMA_SOCKET|$LD_LIBRARY_PATH|$VRDMA_BACKEND"; exit 7' \
  >"$E2E_TMP/env.out" 2>"$E2E_TMP/env.err" || rc=$?
[[ $rc -eq 7 ]] || fail "vrdma run did not pass the exit code through (got $rc)"
IFS='|' read -r g s l b <"$E2E_TMP/env.out"
[[ $g == g-env ]] || fail "VRDMA_GUEST is '$g'"
[[ $s == "$VRDMA_SOCKET" ]] || fail "VRDMA_SOCKET is '$s'"
[[ $l == */lib* ]] || fail "LD_LIBRARY_PATH is '$l'"
[[ $b == */vrdmad ]] || fail "VRDMA_BACKEND is '$b'"
[[ -n "$(backend_pid)" ]] || fail "vrdma run did not start a backend on $VRDMA_SOCKET"
[[ -f $E2E_TMP/vrdmad.log ]] || fail "no $E2E_TMP/vrdmad.log"

rc=0
"$VRDMA" run -- /nonexistent/program >/dev/null 2>&1 || rc=$?
[[ $rc -eq 127 ]] || fail "missing program: exit $rc, wanted 127"

# With a backend: both forms work.
"$VRDMA" status >"$E2E_TMP/status.out" 2>&1 || fail "vrdma status failed: $(cat "$E2E_TMP/status.out")"
grep -q '^GUEST' "$E2E_TMP/status.out" || fail "no table header"
grep -q '^totals:' "$E2E_TMP/status.out" || fail "no totals line"
[[ "$(status_query 'ref $j->{guests}')" == ARRAY ]] || fail "status --json has no guests array"
[[ "$(status_query 'ref $j->{totals}')" == HASH ]] || fail "status --json has no totals object"

# A configured peer that cannot be reached: status says its state and why (the transport's last
# error for it), in text and JSON (against the schema).
psock="$E2E_TMP/peer.sock"
dead="127.0.0.1:$(free_port)"
"$VRDMA" backend --socket "$psock" --idle-exit 0 --listen "127.0.0.1:$(free_port)" --peer "$dead" \
  >"$E2E_TMP/peer-backend.out" 2>&1 &
pb=$!
for ((i = 0; i < 100; i++)); do
  "$VRDMA" status --socket "$psock" >"$E2E_TMP/peer-status.out" 2>&1 &&
    grep -q "^peers: $dead (.*failed attempt" "$E2E_TMP/peer-status.out" && break
  nap 0.05
done
grep -Eq "^peers: $dead \((not connected|connecting), [0-9]+ failed attempt\(s\); last error [0-9]+s ago: Connection refused\)\$" \
  "$E2E_TMP/peer-status.out" || fail "peer state: $(grep peers "$E2E_TMP/peer-status.out")"
"$VRDMA" status --socket "$psock" -j >"$E2E_TMP/peer-status.json" || fail "status -j"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python3 "$here/json_check.py" "$here/schema/vrdma.json" status <"$E2E_TMP/peer-status.json" ||
  fail "status -j with a peer does not match its schema"
[[ $(perl -MJSON::PP -0777 -ne 'print decode_json($_)->{backend}{peer_states}[0]{last_error}' \
  "$E2E_TMP/peer-status.json") == "Connection refused" ]] || fail "peer_states: $(cat "$E2E_TMP/peer-status.json")"
log "$(grep '^peers:' "$E2E_TMP/peer-status.out")"
kill "$pb"
wait "$pb" || true

# A second `vrdma run` reuses the running backend.
pid="$(backend_pid)"
"$VRDMA" run -- true || fail "vrdma run -- true failed"
[[ "$(backend_pid)" == "$pid" ]] || fail "a second backend replaced $pid"

e2e_pass
