#!/usr/bin/env bash
# Issue 25, the direct path's trust rule: one uid is not enough. A backend with the direct path
# grants a QP pair only when the requester's library shows it could already write the peer's
# memory by the kernel's rules (it opens the peer's /proc/PID/mem for writing), or when the
# operator declared the guests one tenant. Real processes, real pids:
#  1. two unrelated processes of one ordinary user (no Yama, or ptrace_scope 0): both granted;
#  2. the same with Yama's ptrace_scope = 1 (when this kernel has Yama; restored after): no
#     grant, and the mediated path carries every byte (ibv_rc_pingpong -c checks them);
#  3. two "containers" of uid 0 (pid + mount namespaces, a /proc of their own): no grant, bytes
#     right; each library was told no peer pid (the peer is not in its pid namespace);
#  4. the same containers on a backend whose config declares them one tenant: granted.
# Usage: direct_trust.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
SEC_VRDMAD_ARGS="--direct-path"
SEC_VRDMAD_LOG=debug  # the refusals of kDirectPeer are debug lines
sec_init "${1:-}"
# Long enough that a proof whose read the backend settles later (a loaded machine: over 5 ms)
# still ends in a grant: the library asks again after 64, 128, 256, ... posts.
N=3000
if under_asan; then N=1000; fi
YAMA=/proc/sys/kernel/yama/ptrace_scope

# Grant lines for guest G in the log of the backend. Usage: grants G
grants() { grep -c "direct path: guest $1 QP" "$E2E_TMP/vrdmad.log" || true; }

# A checked pingpong NAME between guests NAME-s and NAME-c, run as VRUN says; then whether each
# side was granted. Usage: pair NAME yes|no
pair() {
  local g want=$2
  run_pair "$1" "$1-s" "$1-c" -n "$N" -c
  for g in "$1-s" "$1-c"; do
    if [[ $want == yes ]]; then
      [[ $(grants "$g") -ge 1 ]] || fail "$g: no grant: $(grep "direct path" "$E2E_TMP/vrdmad.log")"
    else
      [[ $(grants "$g") == 0 ]] || fail "$g: granted: $(grep "direct path: guest $g" "$E2E_TMP/vrdmad.log")"
    fi
  done
}

# 1. One ordinary user, two unrelated processes: the kernel lets each write the other's memory.
yama_was=""
[[ -r $YAMA ]] && yama_was="$(cat "$YAMA")"
if [[ -n $yama_was && $yama_was != 0 ]]; then
  echo 0 >"$YAMA" || fail "cannot set $YAMA"
fi
restore_yama() { [[ -z $yama_was ]] || echo "$yama_was" >"$YAMA"; }
trap 'rc=$?; set +e; restore_yama; (exit $rc); sec_cleanup' EXIT
pp_as "$VICTIM"
pair same yes
logged "pid [0-9]+ \(guest same-c\) may write pid [0-9]+ \(guest same-s\) by the kernel's rules" \
  "the client's proof"

# 2. Yama: a process may write only its descendants' memory; the pair are siblings.
if [[ -n $yama_was ]]; then
  echo 1 >"$YAMA" || fail "cannot set $YAMA"
  pair yama no
  restore_yama
  log "yama: ptrace_scope 1: no grant, every byte checked; restored to $yama_was"
else
  log "yama: skipped: this kernel has no Yama ($YAMA missing)"
fi

# 3. Two containers of uid 0: neither sees the other's process, so neither can prove anything.
if ! unshare --pid --mount --fork --mount-proc true 2>/dev/null; then
  log "containers: skipped: no pid and mount namespaces here"
  e2e_pass
  exit 0
fi
VRUN=(unshare --pid --mount --fork --mount-proc)
[[ -z ${SAN_PRELOAD:-} ]] || VRUN+=(env "LD_PRELOAD=$SAN_PRELOAD")  # the sanitizer's runtime first
VRUN+=("$SEC_BIN/vrdma" run)
pair box no
logged "direct_peer failed: the peer is in another pid namespace" "no pid named across containers"

# 4. The operator declares the two containers one tenant: granted without a proof.
kill "$BACKEND_PID"
wait "$BACKEND_PID" 2>/dev/null || true
rm -f "$VRDMA_SOCKET"
cat >"$E2E_TMP/tenant.toml" <<'EOF'
[datapath]
direct_path = true
direct_tenants = [["tenant-s", "tenant-c"]]
EOF
sec_backend --config "$E2E_TMP/tenant.toml"
pair tenant yes
e2e_pass
