#!/usr/bin/env bash
# The per-user socket directory (/tmp/vrdma-UID, where there is no XDG_RUNTIME_DIR: cron, su,
# containers) belongs to its user. Another user who makes it first, or plants a symlink in its
# place, serves nothing to the victim: the victim's `vrdma run` and library refuse it with a
# message naming the owner, and never connect (the attacker's backend sees no session). A symlink
# or a group-writable directory is refused too; a symlink planted beside the socket is never
# followed (the backend refuses to start rather than write through it). With the directory gone,
# the victim's device works and the directory it makes is its own, mode 0700.
# Usage: socket_dir.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
sec_init "${1:-}"
VDIR="/tmp/vrdma-$(id -u "$VICTIM")"
rm -rf "$VDIR"
cleanup_vdir() { rm -rf "$VDIR" "$E2E_TMP/attacker-dir"; }
trap 'cleanup_vdir; sec_cleanup' EXIT

# The victim as cron or su would run it: no VRDMA_SOCKET, no XDG_RUNTIME_DIR.
victim_run() {
  become "$VICTIM" env -u VRDMA_SOCKET -u XDG_RUNTIME_DIR -u VRDMA_BACKEND \
    ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} "$SEC_BIN/vrdma" run -- "$@"
}
# Expects the victim's ibv_devinfo to fail with a message matching RE. Usage: refused NAME RE
refused() {
  local rc=0
  victim_run ibv_devinfo >"$E2E_TMP/$1.out" 2>&1 || rc=$?
  [[ $rc != 0 ]] || fail "$1: the victim's ibv_devinfo ran: $(cat "$E2E_TMP/$1.out")"
  grep -Eq "$2" "$E2E_TMP/$1.out" || fail "$1: unclear refusal: $(cat "$E2E_TMP/$1.out")"
  log "$1: refused: $(grep -Em1 "$2" "$E2E_TMP/$1.out")"
}

# 1. The attacker makes the victim's directory first and serves a backend in it.
become "$ATTACKER" mkdir -m 0755 "$VDIR"
become "$ATTACKER" "$SEC_BIN/vrdmad" --socket "$VDIR/vrdmad.sock" --idle-exit 0 \
  >"$E2E_TMP/attacker-vrdmad.out" 2>&1 &
for ((k = 0; k < 100; k++)); do
  [[ -S $VDIR/vrdmad.sock ]] && break
  nap 0.1
done
[[ -S $VDIR/vrdmad.sock ]] || fail "the attacker's backend did not start: $(cat "$E2E_TMP/attacker-vrdmad.out")"
become "$ATTACKER" chmod 0777 "$VDIR/vrdmad.sock"
refused foreign-dir "belongs to uid $(id -u "$ATTACKER"), not to you"
# The library on its own (no `vrdma run`) refuses it too.
rc=0
become "$VICTIM" env -u VRDMA_SOCKET -u XDG_RUNTIME_DIR VRDMA_BACKEND=/nonexistent \
  LD_LIBRARY_PATH="$SEC_BIN/../lib" ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} ibv_devinfo \
  >"$E2E_TMP/lib.out" 2>&1 || rc=$?
[[ $rc != 0 ]] && grep -q "belongs to uid $(id -u "$ATTACKER")" "$E2E_TMP/lib.out" ||
  fail "the library used the attacker's directory: rc $rc, $(cat "$E2E_TMP/lib.out")"
! grep -q "session .* opened" "$E2E_TMP/attacker-vrdmad.out" ||
  fail "the victim opened a session on the attacker's backend: $(cat "$E2E_TMP/attacker-vrdmad.out")"
pkill -KILL -u "$ATTACKER" vrdmad || true
rm -rf "$VDIR"

# 2. A symlink in its place, to a directory the attacker owns.
mkdir -m 0755 "$E2E_TMP/attacker-dir"
chown "$ATTACKER" "$E2E_TMP/attacker-dir"
become "$ATTACKER" ln -s "$E2E_TMP/attacker-dir" "$VDIR"
refused symlink "not a directory but a symlink"
[[ -z "$(ls -A "$E2E_TMP/attacker-dir")" ]] || fail "files appeared in the symlink's target: $(ls "$E2E_TMP/attacker-dir")"
rm -f "$VDIR"

# 3. The victim's own directory, but writable by the group.
mkdir -m 0770 "$VDIR"
chown "$VICTIM:$SEC_GROUP" "$VDIR"
refused group-writable "writable by other users"
rm -rf "$VDIR"

# 4. A symlink beside the socket (how one got there does not matter): the backend that would
# take the lock through it refuses to start, and the file it points at is untouched.
mkdir -m 0700 "$VDIR"
chown "$VICTIM" "$VDIR"
echo precious >"$E2E_TMP/out/precious"
chown "$VICTIM" "$E2E_TMP/out/precious"
ln -s "$E2E_TMP/out/precious" "$VDIR/vrdmad.sock.lock"
chown -h "$VICTIM" "$VDIR/vrdmad.sock.lock"
refused lock-symlink "vrdmad.sock.lock.*symlink|nothing accepts|no backend"
grep -q "symlink: not followed" "$VDIR/vrdmad.log" ||
  fail "the backend did not say why it refused: $(cat "$VDIR/vrdmad.log" 2>&1)"
[[ "$(cat "$E2E_TMP/out/precious")" == precious ]] || fail "the file behind the symlink changed"
rm -rf "$VDIR"

# 5. Nothing planted: the victim's device works, in a directory of its own, mode 0700.
victim_run ibv_devinfo >"$E2E_TMP/ok.out" 2>&1 || fail "the victim's ibv_devinfo: $(cat "$E2E_TMP/ok.out")"
grep -q 'hca_id:.*vrdma0' "$E2E_TMP/ok.out" || fail "no vrdma0: $(cat "$E2E_TMP/ok.out")"
[[ "$(stat -c '%U %a' "$VDIR")" == "$VICTIM 700" ]] || fail "the victim's directory: $(stat -c '%U %a' "$VDIR")"
pkill -KILL -u "$VICTIM" vrdmad || true
backend_serves socket_dir
e2e_pass
