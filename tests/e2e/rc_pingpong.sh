#!/usr/bin/env bash
# Debian's unmodified ibv_rc_pingpong, server and client both through vrdma, over a range of
# options: default, -e (completion events), large messages, -c (content validation), -N (the
# extended send API), -j (device memory: ibv_alloc_dm, ibv_reg_dm_mr, ibv_memcpy_to/from_dm).
# Usage: rc_pingpong.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

run_pair default srv cli
run_pair events srv cli -e
run_pair large srv cli -s 65536 -n 10000
run_pair validate srv cli -c
run_pair validate_events_large srv cli -c -e -s 65536 -n 1000
# -N: the extended verbs (ibv_create_qp_ex, ibv_wr_start/ibv_wr_send/ibv_wr_complete).
run_pair new_send srv cli -N
run_pair new_send_events_validate srv cli -N -e -c
# -j: the buffer is device memory (a zero-based MR over ibv_alloc_dm's memory).
run_pair device_memory srv cli -j
run_pair device_memory_validate srv cli -j -c -s 8192 -n 200
# Both ends in one guest: no --guest, and the default guest is per process group (ours).
run_pair same_guest "" ""

e2e_pass
