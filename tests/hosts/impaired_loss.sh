#!/usr/bin/env bash
# Issue 30: RC across hosts over a lossy path. Two hosts with the impairer between them
# (impair_lib.sh) dropping 1 %, then 10 %, of the frames each way (1 ms each way beside, a LAN):
# with the tools' defaults (timeout 14, retry_cnt 7) ibv_rc_pingpong -c, a verified rc_stream
# (equal checksums) and ib_write_bw -D 5 complete. TCP still delivers all of it.
# IMPAIR_LOSSES: the loss percentages, in turn ("1 10"); IMPAIR_DIRECT=1: on the default path
# (the libraries' own connections; hosts.impaired_loss_direct), not pinned to the backends'.
# Usage: impaired_loss.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=impair_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/impair_lib.sh"
impaired_hosts_init "${1:-}"
wait_mesh

for loss in ${IMPAIR_LOSSES:-1 10}; do
  impair_set --delay 1 --loss "$loss"
  check_all "loss$loss" 300 3
done
impair_verdict
