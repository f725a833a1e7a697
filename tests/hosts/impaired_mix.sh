#!/usr/bin/env bash
# Issue 30: RC across hosts over a path that reorders 25 % of the frames (they skip the 5 ms
# delay each way the others wait), duplicates 5 % and corrupts 1 % (one bit past the IP header:
# TCP's checksum drops the frame, and TLS would refuse what slipped through). With the tools'
# defaults ibv_rc_pingpong -c, a verified rc_stream (equal checksums: nothing lost, repeated,
# reordered or altered reached the guest) and ib_write_bw -D 5 complete.
# Usage: impaired_mix.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=impair_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/impair_lib.sh"
impaired_hosts_init "${1:-}" --delay 5 --reorder 25 --dup 5 --corrupt 1
wait_mesh
check_all mix 200 4
impair_verdict
