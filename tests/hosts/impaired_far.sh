#!/usr/bin/env bash
# Issue 30: backends connect over a 600 ms RTT path (300 ms each way from the start), and a
# pingpong then runs across it.
# Usage: impaired_far.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=impair_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/impair_lib.sh"
impaired_hosts_init "${1:-}" --delay 300
wait_mesh
log "backends connected over 600 ms RTT"
impair_try far check_pingpong far 5 60
impair_verdict
