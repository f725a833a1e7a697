#!/usr/bin/env bash
# Issue 30: one tenant's bulk transfer never turns into another tenant's transport error. At
# 20 ms RTT, guest bulk-* runs ib_write_bw -D 10 while guest other-* runs a verified rc_stream
# over the same pair of backends (and so the same TCP connection): the stream never fails and
# ends with equal checksums; the bulk transfer completes too.
# Usage: impaired_two_tenants.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=impair_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/impair_lib.sh"
impaired_hosts_init "${1:-}" --delay 10
wait_mesh

# The stream first, then the neighbour beside it; the stream outlives the neighbour.
istream_start other
log "other: a verified rc_stream runs; bulk: ib_write_bw -D 10 beside it"
(check_write_bw bulk 10) &
bulk=$!
impair_try other stream_runs other 14
wait "$bulk" || IMPAIR_FAILED+=(bulk)
if [[ " ${IMPAIR_FAILED[*]} " != *" other "* ]]; then
  kill -USR1 "$cli_proc"
  finish_stream other "$cli" "$srv" 40
  log "other: $STREAM_RESULT on both ends"
fi
impair_stats
impair_verdict
