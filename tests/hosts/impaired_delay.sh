#!/usr/bin/env bash
# Issue 30: RC across hosts over a path with delay. Two hosts with the impairer between them
# (impair_lib.sh); at each round-trip time, with the tools' defaults (timeout 14, retry_cnt 7):
# ibv_rc_pingpong -c, a verified rc_stream (equal checksums) and ib_write_bw -D 5 complete, and
# the stream's bytes on the wire stay within 3 % of an unimpaired stream's (no blind replays:
# the issue's goal is 1 %, but this measure varies by about 0.5 % between runs, with how TLS
# records and frames batch; the gross failure it catches is a window sent many times over).
# RTTs: 20 and 100 ms; IMPAIRED_RTTS="400" (the load variant) or any list instead.
# Usage: impaired_delay.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=impair_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/impair_lib.sh"
impaired_hosts_init "${1:-}"
wait_mesh
# The reference: 1 ms each way keeps the stream's pace (and so its share) near the others', and
# the machine from dropping frames at full speed (TCP's retransmissions would count).
impair_set --delay 1
IMPAIR_CALIBRATE=1 check_stream calib 2
IMPAIR_REPLAY_MAX=1  # issue 30: replays below 1 % of what is sent while the connection is up

for rtt in ${IMPAIRED_RTTS:-20 100}; do
  impair_set --delay $((rtt / 2))
  # Pingpong round trips: about two seconds' worth at this RTT.
  check_all "rtt$rtt" $((2000 / rtt + 5)) 3
done
impair_verdict
