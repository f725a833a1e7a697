#!/usr/bin/env bash
# Issue 26's acceptance: a cluster of 8 namespace hosts whose backends know each other only
# through a 3-member etcd cluster (on three more hosts; lease 2 s, [transport] idle_close_s 2).
# Connections are made on demand: none at start; ibv_rc_pingpong -c between all 28 pairs (in
# rounds of 4 disjoint pairs) connects each backend to the 7 others, and with the pingpongs gone
# every connection closes for being idle. A verifying RC stream h1 <- h2 then keeps exactly that
# one connection (O(peers used)). A 9th host started while it runs is reached without restarting
# anyone; one etcd member killed: nothing stops; the stream's server guest migrates h1 -> h3
# (the stream verifies at the end); a backend SIGKILLed leaves the others' cluster status within
# its lease and its peer's QP goes to ERR; all etcd members stopped: the stream goes on, a new
# pair fails clearly; etcd back: a new pair runs. Everything is torn down by lib.sh's trap.
# Usage: etcd_cluster.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source-path=SCRIPTDIR source=etcd_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/etcd_lib.sh"
etcd_require
hosts_init "${1:-}" 12 0  # h1..h9: backends (h9 joins later); h10..h12: etcd members
etcd_cluster 10 11 12
cat >"$E2E_TMP/cluster.toml" <<TOML
[transport]
idle_close_s = 2
[directory]
etcd = $ETCD_URLS
lease_s = 2
TOML
HOSTS_VRDMAD_ARGS="--config $E2E_TMP/cluster.toml"
for i in 1 2 3 4 5 6 7 8; do start_backend "$i"; done  # HOSTS_B is 0: no --peer
all="h1 h2 h3 h4 h5 h6 h7 h8"
for i in 1 2 3 4 5 6 7 8; do etcd_wait_nodes "$i" "$all"; done
log "8 backends registered in etcd"

# The nodes host I's backend is connected to, sorted, space-separated.
hconnected() {
  VRDMA_SOCKET="$(host_sock "$1")" "$VRDMA" cluster status -j |
    python3 -c 'import json, sys; print(" ".join(sorted(json.load(sys.stdin)["connected"])))'
}
# Waits up to SECS (default 10) until every host I in the list "I:WANT;..." is connected to
# exactly WANT (space-separated nodes, "" for none).
wait_connected() {
  local spec=$1 secs=${2:-10} k ok item i want
  for ((k = 0; k < secs * 10; k++)); do
    ok=1
    IFS=';' read -ra items <<<"$spec"
    for item in "${items[@]}"; do
      i=${item%%:*} want=${item#*:}
      [[ $(hconnected "$i") == "$want" ]] || { ok=0; break; }
    done
    ((ok)) && return 0
    nap 0.1
  done
  fail "h$i connected to '$(hconnected "$i")', wanted '$want'"
}
none="1:;2:;3:;4:;5:;6:;7:;8:"
wait_connected "$none" 1
log "on demand: no backend connected to any other"

log "ibv_rc_pingpong -c between all 28 pairs, 7 rounds of 4 disjoint pairs"
t0=$(date +%s%N)
# The circle method: host 8 fixed, the others rotate; each round pairs every host once.
for ((r = 0; r < 7; r++)); do
  declare -A spid=() cpid=()
  pairs=("$((r + 1)) 8")
  for ((d = 1; d <= 3; d++)); do
    pairs+=("$(((r + d) % 7 + 1)) $(((r - d + 7) % 7 + 1))")
  done
  for p in "${pairs[@]}"; do
    read -r a b <<<"$p"
    hpair_start "r$r-$a$b" "$a" "$b" -n 20 -c
    spid[$a$b]=$HP_SPID cpid[$a$b]=$HP_CPID
  done
  for p in "${pairs[@]}"; do
    read -r a b <<<"$p"
    finish_pair "r$r-$a$b" "${spid[$a$b]}" "${cpid[$a$b]}" 60
  done
done
log "28 pairs in $((($(date +%s%N) - t0) / 1000000)) ms"
for i in 1 2 3 4 5 6 7 8; do
  [[ $(VRDMA_SOCKET="$(host_sock "$i")" "$VRDMA" cluster status -j | python3 -c '
import json, sys; print(json.load(sys.stdin)["connections"]["dials"] > 0)') == True ]] ||
    fail "h$i dialed nobody"
done
# Nothing uses the connections now: each closes 2 s after its last frame, by agreement.
wait_connected "$none" 10
closes=$(VRDMA_SOCKET="$(host_sock 8)" "$VRDMA" cluster status -j |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["connections"]["idle_closes"])')
((closes >= 7)) || fail "h8 counted $closes idle closes, wanted >= 7 (one per peer)"
log "idle: every connection closed ($closes on h8)"

log "a verifying RC stream h1 <- h2: one connection, h1-h2, and no other"
hstream_start st 1 2
HOSTS_WATCH+=("$cli $E2E_TMP/st.client.out" "$srv $E2E_TMP/st.server.out")
hwait_flowing 1 st-s msgs_received "$srv"
nap 2.5  # past idle_close_s: nothing idle is left open
wait_connected "1:h2;2:h1;3:;4:;5:;6:;7:;8:" 5

log "h9 joins while the stream runs; h3 <- h9 pingpong, nobody restarted"
start_backend 9
etcd_wait_nodes 1 "$all h9"
hpair n9 3 9 -n 50 -c

log "one etcd member killed"
before=$(hcount 1 st-s msgs_received)
etcd_member_kill 10
# A guest that joins now is found through etcd only (no connection carries its announcement
# yet): a new pair waits for the others to elect a leader if the killed member led.
etcd_wait
hpair m1 4 5 -n 50 -c
after=$(hcount 1 st-s msgs_received)
((after > before)) || fail "the stream stopped when an etcd member died ($before -> $after)"

log "the stream's server guest moves h1 -> h3"
etcd_wait_guest 4 st-s "h1 1"
hmigrate st-s 1 3
hwait_route 2 st-c "tcp/h3|direct/h3" 10  # direct again after the move, or not yet
etcd_wait_guest 4 st-s "h3 2"
log "st-s on h3 (generation 2), downtime ${MIG_DOWNTIMES[-1]} us"

log "h8's backend SIGKILLed under a stream h8 <- h7"
srv_a=$srv cli_a=$cli cli_proc_a=$cli_proc
hstream_start dead 8 7
hwait_flowing 7 dead-c msgs_sent "$cli"
kill_backend 8
t0=$(date +%s%N)
for ((k = 0; k < 150; k++)); do
  [[ $(cluster_nodes 1) == "h1 h2 h3 h4 h5 h6 h7 h9" ]] && break
  nap 0.05
done
ms=$((($(date +%s%N) - t0) / 1000000))
[[ $(cluster_nodes 1) == "h1 h2 h3 h4 h5 h6 h7 h9" ]] ||
  fail "h8 still in h1's cluster status after $ms ms: $(cluster_nodes 1)"
((ms <= 5000)) || fail "h8 left h1's cluster status after $ms ms (lease 2 s)"
# The client's QP facing h8 runs its retry budget out: an error completion, the QP in ERR.
wait_pid "$cli" 20
[[ $WAIT_RC != 124 && $WAIT_RC != 0 ]] || fail "h7's stream toward the dead h8 exited $WAIT_RC"
grep -q "failed: transport retry counter exceeded" "$E2E_TMP/dead.client.out" ||
  fail "h7's stream toward the dead h8: $(tail -n 3 "$E2E_TMP/dead.client.out")"
log "h8 gone from h1's cluster status after $ms ms; h7's QP facing it in ERR (RETRY_EXC)"
srv=$srv_a cli=$cli_a cli_proc=$cli_proc_a

log "all of etcd stopped"
etcd_member_kill 11
etcd_member_kill 12
etcd_wait_reachable False 5 6
etcd_dark_pair 6 5 3 st-s

log "etcd back"
for i in 10 11 12; do etcd_member_start "$i"; done
etcd_wait
etcd_wait_reachable True 5 6
hpair back 6 5 -n 50 -c
kill -USR1 "$cli_proc"
finish_stream st "$cli" "$srv" 30
HOSTS_WATCH=()
log "stream across the move and the etcd outage: $STREAM_RESULT on both ends"
# Nothing uses a connection any more: every one closes, by agreement.
wait_connected "1:;2:;3:;4:;5:;6:;7:;9:" 10
log "idle again: no connection left"
e2e_pass
