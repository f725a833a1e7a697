#!/usr/bin/env bash
# The directory on etcd: three namespace hosts whose backends are given no peers, only a
# 3-member etcd cluster (on three more hosts; [directory] etcd, lease 2 s). They find each other
# there (and connect on demand: none until a QP needs one), `vrdma cluster status` lists them,
# and ibv_rc_pingpong runs between every pair at once (LID, GID, content validation). One etcd member killed: nothing stops. All of
# etcd stopped: a verifying RC stream that runs goes on, a new connection fails clearly (the
# destination is not located; IBV_WC_RETRY_EXC_ERR); etcd back: the backends answer again and a
# new pair connects. A backend SIGKILLed disappears from the others' cluster status within its
# lease, and their connection to it is dropped.
# HOSTS_IPV6=1 ETCD_DISCOVERY_ONLY=1 (hosts.etcd_directory_ipv6): every address IPv6, etcd's
# URLs and the backends' included ("http://[fd00:77::4]:2379"); the test ends once the backends
# found each other there and `vrdma cluster status` lists them (the pingpongs' own exchange of
# QP numbers would need IPv4: hosts.ipv6 relays it).
# Usage: etcd_directory.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source-path=SCRIPTDIR source=etcd_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/etcd_lib.sh"
etcd_require
E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../e2e" && pwd)"
hosts_init "${1:-}" 6 0  # h1..h3: backends (below); h4..h6: etcd members
etcd_cluster 4 5 6
cat >"$E2E_TMP/directory.toml" <<TOML
[directory]
etcd = $ETCD_URLS
lease_s = 2
TOML
HOSTS_VRDMAD_ARGS="--config $E2E_TMP/directory.toml"
for i in 1 2 3; do start_backend "$i"; done  # HOSTS_B is 0: no --peer
HOSTS_B=3
for i in 1 2 3; do etcd_wait_nodes "$i" "h1 h2 h3"; done
log "three backends found each other through etcd alone"

# Connections on demand: known, not dialed until a QP needs one. (h2's endpoint as a regex.)
# shellcheck disable=SC2001  # escaping regex metacharacters
h2_ep="$(sed 's/[].[]/\\&/g' <<<"$(host_ep 2 7471)")"
VRDMA_SOCKET="$(host_sock 1)" "$VRDMA" cluster status >"$E2E_TMP/cluster_status.out" ||
  fail "vrdma cluster status"
if ! grep -qE "^h2 +$h2_ep .* no\$" "$E2E_TMP/cluster_status.out" ||
  ! grep -q '^connections: 0 of 2 known peers' "$E2E_TMP/cluster_status.out"; then
  fail "cluster status text: $(cat "$E2E_TMP/cluster_status.out")"
fi
if [[ -n ${ETCD_DISCOVERY_ONLY:-} ]]; then
  grep -qF "directory: etcd $(etcd_url 4)" "$E2E_TMP/cluster_status.out" ||
    fail "cluster status names no etcd at $(etcd_url 4): $(cat "$E2E_TMP/cluster_status.out")"
  log "cluster status: $(grep -E 'directory: etcd|^h2 ' "$E2E_TMP/cluster_status.out" | tr -s ' ' | tr '\n' ';')"
  e2e_pass
  exit 0
fi
# Both documents with the directory in them match their schemas (tests/e2e/schema/vrdma.json).
for cmd in "status status" "cluster_status cluster status"; do
  read -r schema args <<<"$cmd"
  # shellcheck disable=SC2086  # the command's words
  VRDMA_SOCKET="$(host_sock 1)" "$VRDMA" $args -j >"$E2E_TMP/$schema.json"
  python3 "$E2E_DIR/json_check.py" "$E2E_DIR/schema/vrdma.json" "$schema" \
    <"$E2E_TMP/$schema.json" >"$E2E_TMP/$schema.why" ||
    fail "vrdma $args -j does not match its schema: $(cat "$E2E_TMP/$schema.why")"
done

# The first QP pair between two backends reaches RTR before they have a connection (made on
# demand, by its first frame): its offers are made again once one is up, and it goes direct.
# (A stream the test stops once it sees that: however fast or slow the machine.)
hstream_start first 1 2
hwait_route 2 first-c "direct/h1" 30
kill -USR1 "$cli_proc"
finish_stream first "$cli" "$srv" 30
log "the first pair between h1 and h2 went direct ($STREAM_RESULT)"

log "three rc pingpongs at once (content validation, GID, LID)"
declare -A spid cpid
for pair in "12 -c" "23 -g 0" "31"; do
  read -r ab opts <<<"$pair"
  # shellcheck disable=SC2086  # the options are words
  hpair_start "p$ab" "${ab:0:1}" "${ab:1:1}" -n 500 $opts
  spid[p$ab]=$HP_SPID cpid[p$ab]=$HP_CPID
done
for p in p12 p23 p31; do finish_pair "$p" "${spid[$p]}" "${cpid[$p]}" 60; done
VRDMA_SOCKET="$(host_sock 1)" "$VRDMA" cluster status >"$E2E_TMP/cluster_status.out"
grep -qE "^h2 +$h2_ep .* yes\$" "$E2E_TMP/cluster_status.out" ||
  fail "cluster status text after the pingpongs: $(cat "$E2E_TMP/cluster_status.out")"

PP_TOOL=ibv_ud_pingpong hpair ud 1 3 -n 200

log "one etcd member killed"
etcd_member_kill 4
hpair m1 2 3 -n 200

hstream_start st 1 2
hwait_flowing 1 st-s msgs_received "$srv"
# A move is a compare-and-swap of the entry the source wrote: wait until it is there (a join not
# written before the guest leaves is never written, and the target's entry is then the first).
etcd_wait_guest 2 st-s "h1 1"
log "the stream's server guest moves h1 -> h3 -> h1 (its entry: compare-and-swap)"
gen=1
for hop in "1 3" "3 1"; do
  read -r from to <<<"$hop"
  gen=$((gen + 1))
  hmigrate st-s "$from" "$to"
  hwait_route 2 st-c "tcp/h$to|direct/h$to" 10  # direct again after the move, or not yet
  etcd_wait_guest 2 st-s "h$to $gen"
  log "st-s on h$to (generation $gen), downtime ${MIG_DOWNTIMES[-1]} us"
done
log "all of etcd stopped"
t_down=$(date +%s%N)
etcd_member_kill 5
etcd_member_kill 6
for ((k = 0; k < 100; k++)); do
  [[ $(etcd_reachable 1) == False && $(etcd_reachable 3) == False ]] && break
  nap 0.05
done
[[ $(etcd_reachable 1) == False ]] || fail "h1 does not notice that etcd is gone"
log "h1 and h3 saw etcd go after $((($(date +%s%N) - t_down) / 1000000)) ms"
etcd_dark_pair 3 1 1 st-s

log "etcd back"
for i in 4 5 6; do etcd_member_start "$i"; done
etcd_wait
kill -USR1 "$cli_proc"
finish_stream st "$cli" "$srv" 30
log "stream across the etcd outage: $STREAM_RESULT on both ends"
etcd_wait_reachable True 1 3
hpair back 3 1 -n 200

log "h3's backend SIGKILLed"
kill_backend 3
t0=$(date +%s%N)
for ((k = 0; k < 150; k++)); do
  [[ $(cluster_nodes 1) == "h1 h2" && $(cluster_nodes 2) == "h1 h2" ]] && break
  nap 0.05
done
ms=$((($(date +%s%N) - t0) / 1000000))
[[ $(cluster_nodes 1) == "h1 h2" ]] || fail "h3 still in h1's cluster status after $ms ms"
# The lease (2 s) from its last refresh, then etcd's expiry check (every 0.5 s) and the watch:
# under 5 s.
((ms <= 5000)) || fail "h3 left h1's cluster status after $ms ms (lease 2 s)"
grep -q "directory: node h3 left" "$E2E_TMP/vrdmad.h1.log" || fail "h1 still dials h3"
log "h3 gone from the others' cluster status after $ms ms (lease 2 s)"
e2e_pass
