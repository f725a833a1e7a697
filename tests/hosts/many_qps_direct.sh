#!/usr/bin/env bash
# Many QPs in the default configuration (the direct path across backends): Debian's
# ib_write_bw -q 64 -s 4096 at perftest's default depth from h1 to h2, its 64 QPs on one CQ.
#  1. As configured by default: the stream moves data (a result row with a bandwidth above 0),
#     between 1 and 8 of the client's QPs talk to their peers' libraries (VRDMA_DIRECT_REMOTE_QPS:
#     more were slower than the backends) and its library says the others stay on the backends.
#  2. With VRDMA_DIRECT_REMOTE_QPS=1000, every QP direct, ib_write_bw -q 64 -n 1000: each QP must
#     finish its 1000 WRITEs, so a QP whose completions go unread hangs it. perftest's CQ is fed
#     by more own rings than one kDirectRings answer holds (64): before 6604694 the library read
#     none of them past E2BIG, and a library that reads only the first page leaves this run
#     hanging (checked: it fails after the 90 s wait).
# Usage: many_qps_direct.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
hosts_init "${1:-}" 2
wait_mesh

out="$E2E_TMP/ib_write_bw.client.out"
# The last result row's average bandwidth must be above 0; WHAT names the run.
moved() {
  local bw
  bw="$(result_rows "$out" | tail -n 1 | awk '{print $4}')"
  awk -v b="$bw" 'BEGIN {exit !(b > 0)}' || fail "$1: ib_write_bw moved nothing ($bw MB/s)"
  log "$1: $bw MB/s"
}

hperftest 2 1 ib_write_bw -q 64 -s 4096 -D 2
moved "default"
n="$(grep -c "through its library" "$out" || true)"
((n >= 1 && n <= 8)) || fail "$n of the client's 64 QPs went direct (wanted 1 to 8): $(tail -n 3 "$out")"
grep -q "further QPs stay on the backends" "$out" || fail "the client's library did not say why"

VRDMA_DIRECT_REMOTE_QPS=1000 hperftest 2 1 ib_write_bw -q 64 -s 4096 -n 1000
moved "64 QPs, all direct"
n="$(grep -c "through its library" "$out" || true)"
((n > 48)) || fail "only $n of the client's 64 QPs went direct with VRDMA_DIRECT_REMOTE_QPS=1000"
e2e_pass
