#!/usr/bin/env bash
# Registration churn (issue 21, item 4): an ordinary application registers 5,000 fresh malloc'd
# buffers (4 KiB to 1 MiB), deregisters and frees each, on a backend whose descriptor limit is a
# service's 1024, soft and hard. Segments are released with their last MR, so every
# registration succeeds and the backend's descriptors are the same after the 5,000 as after the
# first 10 (they used to grow by one per registration: the device was lost at ~1,010).
# Usage: reg_churn.sh BIN_DIR
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source-path=SCRIPTDIR source=attacker_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/attacker_lib.sh"

ulimit -n 1024
sec_init "${1:-}"

# Under ASan each registration costs ~40 ms: the backend gets a limit of 256 descriptors, and
# 400 registrations cross it.
n=5000
if under_asan; then
  n=400
  prlimit --pid "$BACKEND_PID" --nofile=256:256 || fail "prlimit on the backend"
fi
hold_start "$VICTIM" churn '^warm' 60 "$SEC_BIN/vrdma_reg_churn" "$n"
churn=$HELD_PID
warm=$(fds_of "$BACKEND_PID")
hold_release churn
hold_wait churn '^done' 90
done_fds=$(fds_of "$BACKEND_PID")
log "backend descriptors after 10 registrations: $warm, after $n: $done_fds;" \
  "the application's: $(awk '/^warm/ {print $2}' "$E2E_TMP/out/churn.out") -> $(awk '/^done/ {print $2}' "$E2E_TMP/out/churn.out")"
((done_fds <= warm + 2)) || fail "the backend's descriptors grew from $warm to $done_fds"
hold_release churn
wait_pid "$churn" 30
[[ $WAIT_RC == 0 ]] || fail "the application failed ($WAIT_RC): $(cat "$E2E_TMP/out/churn.out")"
grep -q "^ok $n registrations" "$E2E_TMP/out/churn.out" || fail "$(cat "$E2E_TMP/out/churn.out")"
wait_status '$j->{totals}{segment}' 0 10 || fail "segments left after the application ended"
pp_as root
backend_serves churn
e2e_pass
