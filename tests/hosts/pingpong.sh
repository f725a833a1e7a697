#!/usr/bin/env bash
# Two namespace hosts, a backend in each, joined by TCP: Debian's unmodified ibv_rc_pingpong
# across them in LID mode and with GIDs (-g 0), with content validation (-c), events, large
# messages; a SEND that finds no receive (rc_stream rnr-*); ibv_ud_pingpong; and a running
# stream's QP shows its transport and peer backend in the status.
# Usage: pingpong.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
hosts_init "${1:-}" 2
wait_mesh

# While a stream runs (open-ended: the test stops it), the client's QP, once connected (RTR),
# goes direct to its peer's library on h1 (direct_remote, the default).
hstream_start route 1 2
hwait_route 2 route-c "direct/h1" 10
kill -USR1 "$cli_proc"
finish_stream route "$cli" "$srv" 30
hpair lid 1 2 -c -n 2000
hpair gid 1 2 -g 0 -c
hpair events_large 2 1 -e -c -s 65536 -n 500
hpair huge 1 2 -g 0 -c -s 4000000 -n 20
hrnr rnr 2 1
PP_TOOL=ibv_ud_pingpong hpair ud 1 2 -n 2000
PP_TOOL=ibv_ud_pingpong hpair ud_gid 2 1 -g 0 -n 2000
e2e_pass
