#!/usr/bin/env bash
# Debian's unmodified ibv_uc_pingpong, ibv_ud_pingpong and ibv_srq_pingpong through vrdma: UC
# (connected, unreliable), UD (datagrams through address handles, by LID and by GID) and a
# shared receive queue behind several QPs, with -c (content validation) and -e (events).
# Usage: other_pingpongs.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

PP_TOOL=ibv_uc_pingpong
run_pair uc srv cli
run_pair uc_validate srv cli -c -s 8192 -n 2000

PP_TOOL=ibv_ud_pingpong
run_pair ud srv cli
run_pair ud_gid srv cli -g 0
run_pair ud_validate srv cli -c -s 2048 -n 2000
run_pair ud_events srv cli -e

PP_TOOL=ibv_srq_pingpong
run_pair srq srv cli
run_pair srq_many_qps srv cli -q 8 -n 4000 -c
run_pair srq_events srv cli -e

e2e_pass
