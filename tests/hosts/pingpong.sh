#!/usr/bin/env bash
# Two namespace hosts, a backend in each, joined by TCP: Debian's unmodified ibv_rc_pingpong
# across them in LID mode and with GIDs (-g 0), with content validation (-c), events, large
# messages; a SEND that finds no receive (rc_stream rnr-*); ibv_ud_pingpong; and every QP shows
# its transport and peer backend in the status.
# Usage: pingpong.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
hosts_init "${1:-}" 2
wait_mesh

hpair_start lid 1 2 -c -n 2000
# While it runs: the client's QP, once connected (RTR), goes through tcp toward h1's backend.
for ((k = 0; k < 200; k++)); do
  t="$(hstatus 2 | perl -MJSON::PP -0777 -ne 'for $g (@{decode_json($_)->{guests}}) { for $q (@{$g->{qps}}) { print "$q->{transport}/$q->{peer_node} " } }')"
  [[ $t == "tcp/h1 " ]] && break
  nap 0.05
done
[[ $t == "tcp/h1 " ]] || fail "h2's QP: transport/peer '$t', wanted tcp/h1"
finish_pair lid "$HP_SPID" "$HP_CPID" 90
hpair gid 1 2 -g 0 -c
hpair events_large 2 1 -e -c -s 65536 -n 500
hpair huge 1 2 -g 0 -c -s 4000000 -n 20
hrnr rnr 2 1
PP_TOOL=ibv_ud_pingpong hpair ud 1 2 -n 2000
PP_TOOL=ibv_ud_pingpong hpair ud_gid 2 1 -g 0 -n 2000
e2e_pass
