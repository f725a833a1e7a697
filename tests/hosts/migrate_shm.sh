#!/usr/bin/env bash
# Live migration between shared memory and TCP: two guests of h1 joined by a verifying RC stream
# (rc_stream, open-ended) go through shm. One of them moves to h2 (the client, the requester, in
# odd rounds; the server, the responder, in even ones): its QP there goes through tcp to h1, and
# the QP left on h1 through tcp to h2. It moves back: both QPs are on shm again in h1.
# $MIG_ROUNDS round trips, messages arriving on every route; equal checksums at the end
# (nothing lost, duplicated or reordered across the switches).
# MIG_DIRECT=1 (hosts.migrate_shm_direct, with the backends' --direct-path): on h1 the pair is
# granted the direct path (its libraries copy into each other; the server's direct counters
# must grow before the first move), every move ends the grants first, and on shm in h1 a QP's
# route may read "direct/" (granted again) where "shm/" is wanted.
# Pinned to the backends' TCP transport (--no-direct-remote): the QPs that cross hosts must go
# through tcp, whose state moves with the guest; hosts.migrate_direct_remote covers the other.
# Usage: migrate_shm.sh BIN_DIR   (MIG_ROUNDS, MIG_PAUSE: round trips, pause after each move)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"
hosts_init "${1:-}" 2
wait_mesh

ROUNDS="${MIG_ROUNDS:-5}"
PAUSE="${MIG_PAUSE:-0.1}"
# Every `vrdma` call takes ~0.2 s under a sanitizer: fewer round trips there, the same checks.
[[ -z $SAN_PRELOAD || -n ${MIG_ROUNDS:-} ]] || ROUNDS=3

DIRECT="${MIG_DIRECT:-}"
# Waits until guest G on host I has route WANT ("shm/" also takes "direct/" with DIRECT).
# Usage: wait_route I G WANT
wait_route() {
  local got="" k
  for ((k = 0; k < 100; k++)); do
    hcheck_alive
    got="$(hroute "$1" "$2" 2>/dev/null)" || got="<no answer>"
    [[ $got == "$3" || ($3 == shm/ && -n $DIRECT && $got == direct/) ]] && return 0
    nap 0.05
  done
  fail "guest $2 on h$1: QP routes '$got', wanted '$3'"
}
# msgs_received of the server's QP on host I.
received() { hcount "$1" sh-s msgs_received; }
# After a move of guest G (sh-s or sh-c) to host GH: G's QP has route RG there, the other
# guest's QP on h1 has route RO, and messages reach the server during the pause.
# Usage: settled G GH RG RO
settled() {
  local g=$1 gh=$2 other="sh-s" sh=$2 c0 c1 k
  if [[ $g == sh-s ]]; then other="sh-c"; else sh=1; fi
  wait_route "$gh" "$g" "$3"
  wait_route 1 "$other" "$4"
  c0=$(received "$sh")
  sleep "$PAUSE"
  for ((k = 0; k < 100; k++)); do
    hcheck_alive
    c1=$(received "$sh")
    [[ $c1 -gt $c0 ]] && return 0
    nap 0.05
  done
  fail "no message reached the server for $PAUSE s + 5 s after $g moved to h$gh (stuck at $c0)"
}

# With MIG_DIRECT the ends sleep in completion channels (fired by the libraries on the direct
# path, by the backends elsewhere): an event lost across a move fails the stream.
[[ -z $DIRECT ]] || RC_STREAM_OPT=--events
hstream_start sh 1 1
HOSTS_WATCH=("$srv $E2E_TMP/sh.server.out" "$cli $E2E_TMP/sh.client.out")
hwait_flowing 1 sh-s msgs_received "$srv"
if [[ -n $DIRECT ]]; then
  hwait_flowing 1 sh-s direct_msgs_received "$srv"
  log "the pair is on the direct path in h1: $(hcount 1 sh-s direct_msgs_received) messages so far"
fi
settled sh-c 1 "shm/" "shm/"
log "stream flowing on shm in h1; moving the client, then the server, ... h1 <-> h2 $ROUNDS times"
for ((r = 1; r <= ROUNDS; r++)); do
  g="sh-c"
  ((r % 2)) || g="sh-s"
  hmigrate "$g" 1 2
  settled "$g" 2 "tcp/h1" "tcp/h2"
  hmigrate "$g" 2 1
  settled "$g" 1 "shm/" "shm/"
done
hcheck_alive
HOSTS_WATCH=()
# With DIRECT, what the libraries moved themselves: the counters live in the own rings, which
# moved with the guests.
[[ -z $DIRECT ]] || log "direct messages received by the server: $(hcount 1 sh-s direct_msgs_received)"
kill -USR1 "$cli_proc"
finish_stream sh "$cli" "$srv" 30
log "stream: $STREAM_RESULT on both ends"
read -r mn med mx < <(stats_of "${MIG_DOWNTIMES[@]}")
log "${#MIG_DOWNTIMES[@]} moves, downtime min $mn us, median $med us, max $mx us"
e2e_pass
