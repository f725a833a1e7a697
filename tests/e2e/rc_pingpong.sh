#!/usr/bin/env bash
# Debian's unmodified ibv_rc_pingpong, server and client both through vrdma, over a range of
# options: default, -e (completion events), large messages, -c (content validation), -N (the
# extended send API), -j (device memory: ibv_alloc_dm, ibv_reg_dm_mr, ibv_memcpy_to/from_dm),
# -t (completion timestamps), -o/-O/-P (on-demand paging).
# Usage: rc_pingpong.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
# Large messages: 10,000 of 64 KiB (655 MB each way). Under ASan that volume took a minute of
# both cores and adds no code: 1,000 there, as validate_events_large below.
LARGE_N=10000
if under_asan; then LARGE_N=1000; fi

run_pair default srv cli
run_pair events srv cli -e
run_pair large srv cli -s 65536 -n "$LARGE_N"
run_pair validate srv cli -c
run_pair validate_events_large srv cli -c -e -s 65536 -n 1000
# -N: the extended verbs (ibv_create_qp_ex, ibv_wr_start/ibv_wr_send/ibv_wr_complete).
run_pair new_send srv cli -N
run_pair new_send_events_validate srv cli -N -e -c
# -j: the buffer is device memory (a zero-based MR over ibv_alloc_dm's memory).
run_pair device_memory srv cli -j
run_pair device_memory_validate srv cli -j -c -s 8192 -n 200
# -t: completion timestamps (ibv_create_cq_ex with IBV_WC_EX_WITH_COMPLETION_TIMESTAMP, read
# with ibv_wc_read_completion_ts): each end prints the gaps between its receive completions, in
# hca_core_clock ticks (ns on vrdma), which cannot be 0 on average between a message's round trips.
run_pair timestamps srv cli -t -n 500
for side in server client; do
  avg="$(sed -n 's/^Average receive completion clock cycles = //p' "$E2E_TMP/timestamps.$side.out")"
  [[ -n $avg ]] || fail "timestamps: $side printed no timestamp stats"
  awk -v a="$avg" 'BEGIN { exit !(a > 0) }' || fail "timestamps: $side average gap $avg"
  log "timestamps: $side: average receive-completion gap $avg ns"
done
# On-demand paging: -o (an ODP MR over the buffer), -o -P (ibv_advise_mr prefetch first), -O
# (implicit ODP: ibv_reg_mr(pd, NULL, SIZE_MAX, ...)); the pages fault in at the first post.
run_pair odp srv cli -o -n 200
run_pair odp_prefetch_validate srv cli -o -P -c -n 200
run_pair odp_implicit srv cli -O -n 200
# Both ends in one guest: no --guest, and the default guest is per process group (ours).
run_pair same_guest "" ""

e2e_pass
