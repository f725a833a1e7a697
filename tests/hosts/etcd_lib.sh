# etcd for the hosts tests: a cluster of members started from Debian's etcd (etcd-server), one
# per namespace host, data in $E2E_TMP/etcd.hI; killed by the hosts' clean-up (they are the
# test's descendants). `etcd_cluster I...` starts members on hosts I... and waits until the
# cluster answers; ETCD_URLS is then their client URLs as a TOML array, for [directory] etcd.
# Needs tests/hosts/lib.sh; a test without etcd installed exits 77 (skipped) at etcd_require.
# shellcheck shell=bash

declare -a ETCD_PID=()
ETCD_URLS=""
ETCD_HOSTS=()

etcd_require() {
  if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; then
    echo "SKIP: etcd is not installed (apt-get install etcd-server etcd-client)"
    exit 77
  fi
}
etcd_url() { echo "http://$(host_ep "$1" 2379)"; }

# Starts (or restarts, on its data) the member on host I.
etcd_member_start() {
  local i=$1 j cluster=""
  for j in "${ETCD_HOSTS[@]}"; do
    cluster+="${cluster:+,}e$j=http://$(host_ep "$j" 2380)"
  done
  # Not through hexec (a function: its subshell's pid would be $!, not etcd's).
  ip netns exec "$(host_ns "$i")" etcd --name "e$i" --data-dir "$E2E_TMP/etcd.h$i" \
    --listen-client-urls "$(etcd_url "$i")" --advertise-client-urls "$(etcd_url "$i")" \
    --listen-peer-urls "http://$(host_ep "$i" 2380)" \
    --initial-advertise-peer-urls "http://$(host_ep "$i" 2380)" \
    --initial-cluster "$cluster" --initial-cluster-token "$HOSTS_RID" \
    --heartbeat-interval 50 --election-timeout 500 >>"$E2E_TMP/etcd.h$i.log" 2>&1 &
  ETCD_PID[i]=$!
}
etcd_member_kill() {
  { kill -KILL "${ETCD_PID[$1]}" && wait "${ETCD_PID[$1]}"; } 2>/dev/null || true
}
# Waits up to 20 s until the cluster (seen from the first member's host) takes a write.
etcd_wait() {
  local from=${ETCD_HOSTS[0]} eps="" j k
  for j in "${ETCD_HOSTS[@]}"; do eps+="${eps:+,}$(etcd_url "$j")"; done
  for ((k = 0; k < 200; k++)); do
    hexec "$from" etcdctl --endpoints "$eps" --dial-timeout 1s --command-timeout 1s \
      put /vrdma-test/ping ok >/dev/null 2>&1 && return 0
    nap 0.1
  done
  fail "etcd on ${ETCD_HOSTS[*]} did not answer in 20 s:" \
    "$(tail -n 3 "$E2E_TMP/etcd.h${ETCD_HOSTS[0]}.log")"
}
etcd_cluster() {
  local i
  ETCD_HOSTS=("$@")
  ETCD_URLS=""
  for i in "$@"; do
    ETCD_URLS+="${ETCD_URLS:+, }\"$(etcd_url "$i")\""
    etcd_member_start "$i"
  done
  ETCD_URLS="[$ETCD_URLS]"
  etcd_wait
  log "etcd: ${#ETCD_HOSTS[@]} member(s) on ${ETCD_HOSTS[*]/#/h}"
}

# Nodes in cluster status (JSON) of host I, sorted: "h1 h2 h3".
cluster_nodes() {
  VRDMA_SOCKET="$(host_sock "$1")" "$VRDMA" cluster status -j |
    python3 -c 'import json, sys
print(" ".join(sorted(n["node"] for n in json.load(sys.stdin).get("nodes", []))))'
}
# Waits up to 20 s until host I's cluster status lists exactly the nodes WANT ("h1 h2 h3").
etcd_wait_nodes() {
  local k
  for ((k = 0; k < 200; k++)); do
    [[ $(cluster_nodes "$1") == "$2" ]] && return 0
    nap 0.1
  done
  fail "h$1's cluster status: '$(cluster_nodes "$1")', wanted '$2'"
}
# "NODE GENERATION" of guest G's entry in host I's cluster status.
guest_on() {
  VRDMA_SOCKET="$(host_sock "$1")" "$VRDMA" cluster status -j | G=$2 python3 -c '
import json, os, sys
for n in json.load(sys.stdin)["nodes"]:
    for g in n["guests"]:
        if g["name"] == os.environ["G"]: print(n["node"], g["generation"])'
}
# etcd.reachable in host I's cluster status: "True" or "False".
etcd_reachable() {
  VRDMA_SOCKET="$(host_sock "$1")" "$VRDMA" cluster status -j |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["etcd"]["reachable"])'
}
# Waits up to 5 s until etcd.reachable is WANT ("True" or "False") in the cluster status of
# each host I. Usage: etcd_wait_reachable WANT I...
etcd_wait_reachable() {
  local want=$1 i k
  shift
  for i in "$@"; do
    for ((k = 0; k < 100; k++)); do
      [[ $(etcd_reachable "$i") == "$want" ]] && break
      nap 0.05
    done
    [[ $(etcd_reachable "$i") == "$want" ]] || fail "h$i: etcd reachable is not $want"
  done
}
# Waits up to 5 s until guest G's entry in host I's cluster status is WANT ("NODE GENERATION").
etcd_wait_guest() {
  local k
  for ((k = 0; k < 100; k++)); do
    [[ $(guest_on "$1" "$2") == "$3" ]] && return 0
    nap 0.05
  done
  fail "h$1's cluster status: $2 on '$(guest_on "$1" "$2")', wanted '$3'"
}
# With etcd unreachable, a new pair (ibv_rc_pingpong, server guest dark-s on host SH, client
# dark-c on host CH) fails clearly: the server's guest is not in the directory, so CH cannot
# locate it; RETRY_EXC, not a hang, and CH's backend says why. Meanwhile the stream whose guest
# G runs on host I goes on (its msgs_received grows). Usage: etcd_dark_pair SH CH I G
etcd_dark_pair() {
  local sh=$1 ch=$2 port=$((18000 + RANDOM % 1000)) dsrv dcli before after
  before=$(hcount "$3" "$4" msgs_received)
  hrun "$sh" --guest dark-s -- ibv_rc_pingpong -p "$port" -n 10 >"$E2E_TMP/dark.server.out" 2>&1 &
  dsrv=$!
  hwait_port "$sh" "$port" "$dsrv" dark
  hrun "$ch" --guest dark-c -- ibv_rc_pingpong -p "$port" -n 10 "$(host_ip "$sh")" \
    >"$E2E_TMP/dark.client.out" 2>&1 &
  dcli=$!
  wait_pid "$dcli" 20
  [[ $WAIT_RC != 124 ]] || fail "a new connection hung while etcd was down"
  [[ $WAIT_RC != 0 ]] || fail "a new connection succeeded with no directory to locate its peer"
  grep -q "transport retry counter exceeded" "$E2E_TMP/dark.client.out" ||
    fail "new pair: $(cat "$E2E_TMP/dark.client.out")"
  grep -q "destination not known: the directory (etcd) is unreachable" \
    "$E2E_TMP/vrdmad.h$ch.log" || fail "h$ch's log does not say why the destination is not located"
  kill -KILL "$dsrv" 2>/dev/null || true
  after=$(hcount "$3" "$4" msgs_received)
  ((after > before)) || fail "the stream stopped while etcd was down ($before -> $after)"
  log "etcd down: the stream went on ($before -> $after messages), a new pair failed clearly"
}
