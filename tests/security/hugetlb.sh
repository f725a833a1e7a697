#!/usr/bin/env bash
# A hugetlbfs memfd as a segment (issue 21, item 3): sealed against shrinking, it passed every
# check, but its owner can punch its huge page out and let another process take it, and the
# backend's next access (an RDMA WRITE into the MR) was a SIGBUS that ended every guest's device.
# A second user's guest, speaking the protocol itself, hands the backend a sealed MFD_HUGETLB
# memfd whose page it has touched: refused with EINVAL and a log line; a victim's pingpong and
# a new pingpong run afterwards. Skipped (77) where no huge page can be had: it reserves a few
# (vm.nr_hugepages) when none is free, and puts the old value back.
# Usage: hugetlb.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source-path=SCRIPTDIR source=attacker_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/attacker_lib.sh"

sec_init "${1:-}"
NR=/proc/sys/vm/nr_hugepages
HP_ORIG=""
restore_hugepages() {
  [[ -n $HP_ORIG ]] && echo "$HP_ORIG" >"$NR" 2>/dev/null
  HP_ORIG=""
}
hugetlb_cleanup() {
  local rc=$?
  restore_hugepages
  (exit "$rc")
  sec_cleanup
}
trap hugetlb_cleanup EXIT

free=$(awk '/^HugePages_Free:/ {print $2}' /proc/meminfo)
if [[ ${free:-0} -lt 1 && -w $NR ]]; then
  HP_ORIG=$(cat "$NR")
  echo $((HP_ORIG + 2)) >"$NR" 2>/dev/null || true
  free=$(awk '/^HugePages_Free:/ {print $2}' /proc/meminfo)
  log "reserved huge pages: vm.nr_hugepages $HP_ORIG -> $(cat "$NR"), $free free"
fi
if [[ ${free:-0} -lt 1 ]]; then
  log "SKIP: no huge page can be had (HugePages_Free ${free:-none})"
  E2E_OK=1
  exit 77
fi

rc=0
as_user "$ATTACKER" "$SEC_BIN/vrdma_attacker" hugetlb "$VRDMA_SOCKET" >"$E2E_TMP/huge.out" 2>&1 || rc=$?
if [[ $rc == 77 ]]; then
  log "SKIP: $(cat "$E2E_TMP/huge.out")"
  E2E_OK=1
  exit 77
fi
[[ $rc == 0 ]] || fail "the attacker failed ($rc): $(cat "$E2E_TMP/huge.out")"
grep -q '^hugetlb Invalid argument' "$E2E_TMP/huge.out" ||
  fail "the hugetlb segment was not refused with EINVAL: $(cat "$E2E_TMP/huge.out")"
grep -q 'guest attacker-huge pid [0-9]*: segment refused: hugetlbfs memfd' "$E2E_TMP/vrdmad.log" ||
  fail "no log line for the refused segment"
restore_hugepages

pp_as "$VICTIM"
run_pair victim vic-s vic-c -n 200
pp_as root
backend_serves hugetlb
e2e_pass
