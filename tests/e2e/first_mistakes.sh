#!/usr/bin/env bash
# The user's first mistakes get messages that say what to do: no backend (CLI and library), a
# backend the library cannot start, and a socket the user may not open (run as `nobody`).
# Usage: first_mistakes.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
LIB="$(cd "$1/../lib" && pwd)"

# No backend: the CLI says how to get one.
rc=0
"$VRDMA" res show qp >"$E2E_TMP/none.out" 2>&1 || rc=$?
[[ $rc == 1 ]] || fail "res show without a backend: rc $rc"
grep -q "no backend is running at $VRDMA_SOCKET" "$E2E_TMP/none.out" &&
  grep -q 'start a backend (`vrdma backend`' "$E2E_TMP/none.out" || fail "$(cat "$E2E_TMP/none.out")"

# The library cannot start a backend: it names the binary and the variable to set.
rc=0
env ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} VRDMA_BACKEND="$E2E_TMP/no/vrdmad" \
  LD_LIBRARY_PATH="$LIB" ibv_devinfo >"$E2E_TMP/lib.out" 2>&1 || rc=$?
[[ $rc != 0 ]] || fail "ibv_devinfo succeeded without a backend"
grep -q "cannot start the vrdma backend: $E2E_TMP/no/vrdmad is not executable; set VRDMA_BACKEND" \
  "$E2E_TMP/lib.out" || fail "library, no binary: $(cat "$E2E_TMP/lib.out")"
grep -q "cannot reach the vrdma backend: nothing listens on $VRDMA_SOCKET" "$E2E_TMP/lib.out" ||
  fail "library, no backend: $(cat "$E2E_TMP/lib.out")"

# Permission denied: a root backend's socket, used by another user.
"$VRDMA" backend --socket "$VRDMA_SOCKET" --idle-exit 0 >"$E2E_TMP/vrdmad.log" 2>&1 &
for ((i = 0; i < 100; i++)); do
  [[ -S $VRDMA_SOCKET ]] && break
  nap 0.1
done
[[ -S $VRDMA_SOCKET ]] || fail "no backend"
if [[ $(id -u) == 0 ]] && command -v setpriv >/dev/null && id nobody >/dev/null 2>&1; then
  # The socket's directory is searchable, the socket itself is root's alone (0600).
  chmod 0755 "$E2E_TMP"
  rc=0
  setpriv --reuid=nobody --regid=nogroup --clear-groups env VRDMA_SOCKET="$VRDMA_SOCKET" \
    "$VRDMA" status >"$E2E_TMP/perm.out" 2>&1 || rc=$?
  [[ $rc == 1 ]] || fail "status as nobody: rc $rc, $(cat "$E2E_TMP/perm.out")"
  grep -q "permission denied on $VRDMA_SOCKET (owner uid 0, group gid 0): run as the backend's user or a member of its group" \
    "$E2E_TMP/perm.out" || fail "permission message: $(cat "$E2E_TMP/perm.out")"
else
  log "not root (or no setpriv/nobody): permission case skipped"
fi
e2e_pass
