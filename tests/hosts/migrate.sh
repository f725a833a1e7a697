#!/usr/bin/env bash
# Live migration across three namespace hosts: `vrdma migrate` moves a guest's device between the
# backends of h1 and h3 (by their socket paths) while its process keeps running in h1. After
# every move: `vrdma migrate` exited 0, the target shows each QP of the guest on tcp to h2, the
# peer's QPs on h2 follow it (their peer_node names the target), and the guest's messages go
# through the new route before the next move.
#  1. A verifying RC stream (rc_stream, open-ended: server guest on h1, client guest on h2) while
#     the server guest (the responder) moves h1 -> h3 -> h1 $MIG_ROUNDS (8) times; then the same
#     with the client on h1 (the requester, SENDs in flight) $MIG_REQ_ROUNDS (3) times. The
#     checksums of both ends are equal: every byte once and in order.
#  2. Debian's ib_write_bw, client on h1 (the requester, WRITEs in flight), server on h2: the
#     client's guest moves h1 -> h3 -> h1 ... up to 6 times while it runs; both ends complete
#     normally.
#  3. ib_write_bw -q 64: the guest with 64 connected RC QPs under load moves h1 -> h3 (and back
#     when there is time); its downtime is logged (performance is measured by
#     bench/migrate_downtime.sh, never asserted).
# A sanitized build, where each move takes seconds, runs 4 + 2 round trips and no 64-QP part.
# The downtimes `vrdma migrate` reports are logged (min/median/max); every move's JSON is in
# $E2E_TMP/migrations.out.
# Pinned to the backends' TCP transport (--no-direct-remote): it moves the mediated state (the
# QPs' tcp routes); hosts.migrate_direct_remote moves guests on the direct path.
# Usage: migrate.sh BIN_DIR   (MIG_ROUNDS, MIG_REQ_ROUNDS: round trips of part 1; MIG_PAUSE: the
#        pause after each move; MIG_ONLY=resp|req|bw|bw64: that part only)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"
hosts_init "${1:-}" 3
wait_mesh

ROUNDS="${MIG_ROUNDS:-8}" REQ_ROUNDS="${MIG_REQ_ROUNDS:-3}" BW_SECS=7 BW64=1
PAUSE="${MIG_PAUSE:-0.1}"
if [[ -n $SAN_PRELOAD ]]; then
  # Every `vrdma` call takes ~0.2 s under a sanitizer, a move with its checks ~3 s, and the
  # 64-QP perftest needs ~10 s to connect: fewer round trips, the same checks; no 64-QP part
  # (it only logs a downtime, which means nothing here). The release build runs it all.
  [[ -n ${MIG_ROUNDS:-} ]] || ROUNDS=4 REQ_ROUNDS=2
  BW_SECS=12 BW64=""
  log "sanitized build: $ROUNDS + $REQ_ROUNDS round trips of the streams, no 64-QP part"
fi

# "ROUTES COUNT" of guest G on host I: its QPs' transport/peer_node (space-separated) and the sum
# of their counter C.
routes_count() {
  hqps "$1" "$2" transport peer_node "$3" |
    awk '{r = r (NR > 1 ? " " : "") $1 "/" ($2 == "-" ? "" : $2); s += $3} END {print r, s + 0}'
}
# One move of guest G (its process runs in h1) FROM -> TO while host PH serves its peer, guest
# PG: the move exits 0, the target shows every QP of G on tcp to PH, the peer's QPs face TO
# (checked on the 1st, PEER_EVERY+1-th, ... move since MOVES_IN_PART was reset), and
# counter C of G grows on TO during the pause. Usage: move G FROM TO PH PG NQPS C
move() {
  local g=$1 from=$2 to=$3 ph=$4 pg=$5 nq=$6 c=$7 want="" pwant="" got="" rc c0 c1 k
  for ((k = 0; k < nq; k++)); do
    want+="${want:+ }tcp/h$ph"
    pwant+="${pwant:+ }tcp/h$to"
  done
  hmigrate "$g" "$from" "$to"
  for ((k = 0; k < 100; k++)); do
    hcheck_alive
    rc="$(routes_count "$to" "$g" "$c")" || rc="? 0"
    got="${rc% *}" c0="${rc##* }"
    [[ $got == "$want" ]] && break
    nap 0.05
  done
  [[ $got == "$want" ]] || fail "guest $g on h$to: QP routes '$got', wanted '$want'"
  # The peer's side, on every PEER_EVERY-th move of a part (each costs a `vrdma` call; when the
  # responder moved, its counter growing on TO below shows the peer found it anyway).
  ((MOVES_IN_PART++ % PEER_EVERY)) || hwait_route "$ph" "$pg" "$pwant"
  sleep "$PAUSE"
  for ((k = 0; k < 100; k++)); do
    hcheck_alive
    c1=$(hcount "$to" "$g" "$c")
    [[ $c1 -gt $c0 ]] && return 0
    nap 0.05
  done
  fail "guest $g on h$to: $c stayed at $c0 for $PAUSE s + 5 s after the move (no traffic)"
}
log_downtimes() {
  local what=$1
  shift
  read -r mn med mx < <(stats_of "$@")
  log "$what: $# moves, downtime min $mn us, median $med us, max $mx us"
}

# ---- 1. rc_stream while one end moves h1 <-> h3 ----
# An open-ended rc_stream between a guest on h1 (the one that moves) and one on h2; MOVER is
# the role of the h1 guest (server: the responder moves; client: the requester, with SENDs in
# flight). Usage: stream_under_moves NAME MOVER ROUNDS
stream_under_moves() {
  local name=$1 mover=$2 rounds=$3 sh ch g pg c first srv cli cli_proc
  first=${#MIG_DOWNTIMES[@]}
  if [[ $mover == server ]]; then
    sh=1 ch=2 g=$name-s pg=$name-c c=msgs_received
  else
    sh=2 ch=1 g=$name-c pg=$name-s c=msgs_sent
  fi
  hstream_start "$name" "$sh" "$ch"
  HOSTS_WATCH=("$srv $E2E_TMP/$name.server.out" "$cli $E2E_TMP/$name.client.out")
  hwait_flowing 1 "$g" "$c" "$srv"
  hwait_route 1 "$g" "tcp/h2"
  log "$name: stream flowing h$ch -> h$sh; moving its $mover h1 <-> h3 $rounds times"
  for ((r = 1; r <= rounds; r++)); do
    move "$g" 1 3 2 "$pg" 1 "$c"
    move "$g" 3 1 2 "$pg" 1 "$c"
  done
  hcheck_alive
  HOSTS_WATCH=()
  kill -USR1 "$cli_proc"
  finish_stream "$name" "$cli" "$srv" 30
  log "$name: $STREAM_RESULT on both ends"
  log_downtimes "$name: rc_stream $mover (1 QP)" "${MIG_DOWNTIMES[@]:first}"
}
part() { [[ -z ${MIG_ONLY:-} || $MIG_ONLY == "$1" ]]; }
MOVES_IN_PART=0 PEER_EVERY=3  # odd: both directions get checked
if part resp; then stream_under_moves resp server "$ROUNDS"; fi
MOVES_IN_PART=0 PEER_EVERY=1
if part req; then stream_under_moves req client "$REQ_ROUNDS"; fi

# ---- 2. and 3. ib_write_bw, the requester moves h1 <-> h3 ----
# ib_write_bw ARGS for SECS seconds (-D) with the server on h2 and the client (guest G, NQPS QPs)
# on h1; G moves h1 -> h3 -> h1 ... up to MOVES times while it runs (at least once; no move
# starts in its last 3 s). Both ends must complete normally.
# Usage: bw_under_moves G MOVES NQPS SECS ARGS...
bw_under_moves() {
  local g=$1 moves=$2 nq=$3 secs=$4 port=$((19000 + RANDOM % 1000)) srv cli t0 m from=1 to=3
  local first=${#MIG_DOWNTIMES[@]}
  shift 4
  hrun 2 --guest "$g-s" -- ib_write_bw -p "$port" -D "$secs" "$@" >"$E2E_TMP/$g.server.out" 2>&1 &
  srv=$!
  hwait_port 2 "$port" "$srv" "$g"
  hrun 1 --guest "$g" -- ib_write_bw -p "$port" -D "$secs" "$@" "$(host_ip 2)" \
    >"$E2E_TMP/$g.client.out" 2>&1 &
  cli=$!
  HOSTS_WATCH=("$srv $E2E_TMP/$g.server.out" "$cli $E2E_TMP/$g.client.out")
  hwait_flowing 1 "$g" msgs_sent "$cli"
  t0=$SECONDS
  [[ $(hqps 1 "$g" qpn | wc -l) == "$nq" ]] || fail "$g: $(hqps 1 "$g" qpn | wc -l) QPs, wanted $nq"
  log "$g: ib_write_bw -D $secs $* running h1 -> h2 on $nq QPs; moving its client h1 <-> h3"
  for ((m = 0; m < moves; m++)); do
    ((m == 0 || SECONDS - t0 < secs - 3)) || break
    move "$g" "$from" "$to" 2 "$g-s" "$nq" msgs_sent
    [[ $(mig_field qps) == "$nq" ]] || fail "$g: the move carried $(mig_field qps) QPs"
    local t=$from
    from=$to to=$t
  done
  HOSTS_WATCH=()
  hperftest_finish "$g" "$cli" "$srv" 60
  log "$g: $m move(s); $(result_rows "$E2E_TMP/$g.client.out" | tail -n 1)"
  log_downtimes "$g: ib_write_bw ($nq QPs)" "${MIG_DOWNTIMES[@]:first}"
}
if part bw; then bw_under_moves bw 6 1 "$BW_SECS" -s 65536; fi
# 64 connected RC QPs, 16 WRITEs in flight on each. Not perftest's 128: one TCP connection
# carries all 64 QPs, and a queue that deep takes longer to drain than the QPs' ACK timeout
# (67 ms, 7 retries; each re-sends every unacknowledged message): with -s 65536, or under a
# sanitizer, ib_write_bw -q 64 then ends in IBV_WC_RETRY_EXC_ERR without any move.
if part bw64 && [[ -n $BW64 ]]; then bw_under_moves bw64 2 64 10 -q 64 -s 4096 -t 16; fi
e2e_pass
