#!/usr/bin/env bash
# Debian's unmodified perftest across two namespace hosts (server on h1, client on h2): SEND
# latency, WRITE bandwidth, READ latency and atomics latency, in LID mode and with GIDs (-x 0).
# Usage: perftest.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
hosts_init "${1:-}" 2
wait_mesh

hperftest 1 2 ib_send_lat -n 2000
hperftest 1 2 ib_write_bw -s 65536 -n 2000
hperftest 1 2 ib_read_lat -n 2000
hperftest 1 2 ib_atomic_lat -n 2000
hperftest 1 2 ib_read_bw -s 65536 -n 1000 -x 0
hperftest 1 2 ib_send_bw -n 2000 -x 0
e2e_pass
