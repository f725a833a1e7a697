#!/usr/bin/env bash
# Three namespace hosts, a full mesh of backends; every pair of hosts runs an ibv_rc_pingpong at
# the same time (LID mode, GID mode, content validation), then ibv_ud_pingpong the same way.
# Usage: three_hosts.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
hosts_init "${1:-}" 3
wait_mesh

declare -A spid cpid
start_all() {
  hpair_start p12 1 2 "$@" -c
  spid[p12]=$HP_SPID cpid[p12]=$HP_CPID
  hpair_start p23 2 3 "$@" -g 0
  spid[p23]=$HP_SPID cpid[p23]=$HP_CPID
  hpair_start p31 3 1 "$@" -e
  spid[p31]=$HP_SPID cpid[p31]=$HP_CPID
}
finish_all() {
  for p in p12 p23 p31; do finish_pair "$p" "${spid[$p]}" "${cpid[$p]}" 90; done
}
log "three rc pingpongs at once"
start_all -n 1000
finish_all
log "three ud pingpongs at once"
PP_TOOL=ibv_ud_pingpong start_all -n 1000
PP_TOOL=ibv_ud_pingpong finish_all
e2e_pass
