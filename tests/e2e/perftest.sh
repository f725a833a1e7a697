#!/usr/bin/env bash
# Debian's unmodified perftest through vrdma on one host: every RC test of the verbs issue, the
# bandwidth ones over all message sizes (-a). The test parses each client's result table.
# Usage: perftest.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

for tool in ib_send_bw ib_write_bw ib_read_bw; do
  run_perftest "$tool" -a -n 200
  rows="$(result_rows "$E2E_TMP/$tool.client.out")"
  n="$(wc -l <<<"$rows")"
  [[ $n -ge 23 ]] || fail "$tool -a: $n result rows, expected every size 2 B .. 8 MiB: $rows"
  last="$(tail -n 1 <<<"$rows")"
  [[ $(awk '{print $1}' <<<"$last") == 8388608 ]] || fail "$tool: last size is not 8 MiB: $last"
  # The message rate (5th column, Mpps): a slow 2 B point prints 0.00 MB/s in the 4th.
  awk '{ if ($5 + 0 <= 0) exit 1 }' <<<"$rows" || fail "$tool: a size with no messages: $rows"
  log "$tool -a: $n sizes; 8 MiB: $(awk '{print $4}' <<<"$last") MB/s"
done

run_perftest ib_atomic_bw -n 1000
row="$(result_rows "$E2E_TMP/ib_atomic_bw.client.out" | tail -n 1)"
[[ $(awk '{print $1}' <<<"$row") == 8 ]] || fail "ib_atomic_bw: no 8-byte result row"
log "ib_atomic_bw: $row"

for tool in ib_send_lat ib_write_lat ib_read_lat ib_atomic_lat; do
  run_perftest "$tool" -n 1000
  row="$(result_rows "$E2E_TMP/$tool.client.out" | tail -n 1)"
  read -r bytes iters tmin _ <<<"$row"
  [[ -n $bytes && $iters == 1000 ]] || fail "$tool: no result row with 1000 iterations: $row"
  awk -v t="$tmin" 'BEGIN { exit !(t > 0) }' || fail "$tool: t_min is not a positive time: $row"
  log "$tool: $row"
done
# On-demand paging (--odp): the server's buffer is written by RDMA only (ib_write_bw) or read
# by it (ib_read_bw: the pages the peer's READs reach), the latency test's sends and receives
# fault their pages in at the first post.
for tool in ib_write_bw ib_read_bw ib_send_lat; do
  run_perftest "$tool" --odp -n 200
  row="$(result_rows "$E2E_TMP/$tool.client.out" | tail -n 1)"
  [[ $(awk '{print $2}' <<<"$row") == 200 ]] || fail "$tool --odp: no row of 200 iterations: $row"
  log "$tool --odp: $row"
done
e2e_pass
