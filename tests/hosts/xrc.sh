#!/usr/bin/env bash
# XRC across two namespace hosts (docs/ARCHITECTURE.md, "XRC"): Debian's unmodified
# ibv_xsrq_pingpong with its server on h1 and a client on h2 (LID and GID mode), then one server
# with two clients, one on each host (its XRC receive QPs answer one over TCP, one on the
# backend's own path, and both land in its one XRC SRQ), and perftest's ib_send_bw -c XRC across.
# Usage: xrc.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
hosts_init "${1:-}" 2
wait_mesh

# ibv_xsrq_pingpong opens this path with O_CREAT and never removes it (the namespaces share
# /tmp): ours goes at the end.
DOMAIN_FILE=/tmp/xrc_domain
[[ -e $DOMAIN_FILE ]] && HAD_DOMAIN_FILE=1 || HAD_DOMAIN_FILE=0
trap 'rc=$?; set +e; [[ $HAD_DOMAIN_FILE == 1 ]] || rm -f "$DOMAIN_FILE"; (exit $rc); hosts_cleanup' EXIT

PP_TOOL=ibv_xsrq_pingpong
# A server on h1 and a client on each host of HOSTS... (guests NAME-s, NAME-cI); all say success.
hxsrq() {
  local name=$1 hosts=$2 port=$((18000 + RANDOM % 1000)) i h pids=() n
  shift 2
  read -ra hs <<<"$hosts"
  n=${#hs[@]}
  log "$name: $PP_TOOL server h1, clients on h${hosts// /, h} $*"
  hrun 1 --guest "$name-s" -- "$PP_TOOL" -p "$port" -c "$n" "$@" >"$E2E_TMP/$name.server.out" 2>&1 &
  local srv=$!
  hwait_port 1 "$port" "$srv" "$name"
  for ((i = 0; i < n; i++)); do
    h=${hs[i]}
    hrun "$h" --guest "$name-c$i" -- "$PP_TOOL" -p "$port" "$@" "$(host_ip 1)" \
      >"$E2E_TMP/$name.client$i.out" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < n; i++)); do
    wait_success "$name: client $i" "${pids[i]}" "$E2E_TMP/$name.client$i.out" 30
  done
  wait_success "$name: server" "$srv" "$E2E_TMP/$name.server.out" 10
  log "$name: ok"
}

hxsrq lid "2" -n 200
hxsrq gid "2" -n 200 -g 0 -e
hxsrq both_hosts "2 1" -n 200 -s 16384
hperftest 1 2 ib_send_bw -c XRC -n 2000
grep -q 'Connection type : XRC' "$E2E_TMP/ib_send_bw.client.out" || fail "ib_send_bw: not XRC"
e2e_pass
