#!/usr/bin/env bash
# UC and UD on the direct path (docs/ARCHITECTURE.md, "Direct path"; issue 25): Debian's tools
# between two guests of one uid on a backend that grants it (the default), every buffer checked,
# each side granted (the backend's log) and the libraries moving the messages themselves (the
# backend's direct counters grow while ib_send_lat runs).
# Usage: direct_path_ud.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
export VRDMA_DIRECT_PATH=1  # the backend the library starts inherits it
PP_N=1000
if under_asan; then PP_N=100; fi

# 1. Debian's ibv_uc_pingpong and ibv_ud_pingpong (by LID, and by GID: the GRH the sender's
# library writes) validate every buffer; each side's QP is granted.
# Few round trips: two spinning processes on a loaded 2-CPU machine can take a time slice
# (milliseconds) per round trip, on any path.
PP_TOOL=ibv_uc_pingpong run_pair uc uc-a uc-b -c -n "$PP_N"
PP_TOOL=ibv_ud_pingpong run_pair ud ud-a ud-b -c -s 2048 -n "$PP_N"
PP_TOOL=ibv_ud_pingpong run_pair ud_gid udg-a udg-b -c -g 0 -n "$PP_N"
for g in uc-a uc-b ud-a ud-b udg-a udg-b; do
  grep -q "direct path: guest $g QP" "$E2E_TMP/vrdmad.log" || fail "no grant for $g in the log"
done
# 2. ib_send_lat over UC and UD for 2 s each: while it runs, the libraries move its messages (the
# backend's direct counters of both guests grow).
for conn in UC UD; do
  run_direct_tool "lat-$conn" "lat-$conn-s" "lat-$conn-c" "lat-$conn-c" "lat-$conn-c" \
    ib_send_lat -c "$conn" -D 2
done

e2e_pass
