#!/usr/bin/env bash
# RDMA CM state across a live migration: Debian's rping, server on h2, client process in h1 with
# its guest on h1's backend. While it pings (-v, data printed on both ends) the client's guest
# moves h1 -> h3 and back (`vrdma migrate`), its connected rdma_cm id, event channel and QP with
# it. Both ends must finish all COUNT pings with the server reading what the client sent, and exit
# 0: the client's rdma_disconnect after the moves still reaches the server (DISCONNECTED there),
# and the client's own DISCONNECTED comes back to it on the backend it ended on. A few seconds.
# The same with the server on h1 beside the client: the pair is split by the first move and
# joined again by the second.
# Usage: rdmacm_migrate.sh BIN_DIR   (CM_MIG_COUNT: rping's -C, 3000)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
command -v rping >/dev/null || {
  log "SKIP: rdmacm-utils not installed"
  exit 77
}
hosts_init "${1:-}" 3
wait_mesh
COUNT="${CM_MIG_COUNT:-3000}"

# One try of rping_moved with -C COUNT and guests NAME-s/NAME-c. Returns 2 (after both ends have
# ended) when the pair was faster than the test: rping finished all COUNT pings, cleanly, before
# a move could be made. Never assume a program is still running when we look: on an idle machine
# the same-host pair (direct path) pings many times faster than on a loaded one.
# Usage: rping_try NAME SH PORT COUNT
rping_try() {
  local name=$1 sh=$2 port=$3 count=$4 srv_ip try k srv cli n1 n2
  srv_ip=$(host_ip "$sh")
  local so="$E2E_TMP/$name.srv" co="$E2E_TMP/$name.cli"
  hrun "$sh" --guest "$name-s" -- rping -s -a "$srv_ip" -p "$port" -C "$count" -v >"$so.out" 2>"$so.err" &
  srv=$!
  # A CM listener shows in no socket table: retried while refused (REJECTED) until it listens.
  for ((try = 0; try < 100; try++)); do
    hrun 1 --guest "$name-c" -- rping -c -a "$srv_ip" -p "$port" -C "$count" -v >"$co.out" 2>"$co.err" &
    cli=$!
    for ((k = 0; k < 50; k++)); do
      [[ $(grep -c '^ping data:' "$co.out") -ge 20 ]] && break 2
      kill -0 "$cli" 2>/dev/null || break
      nap 0.05
    done
    if wait "$cli"; then
      rping_done "$name" "$srv" "$count" || fail "$name: server exited $WAIT_RC: $(tail -n 5 "$so.err")"
      return 2
    fi
    grep -qE 'REJECTED|Unexpected CM event|rdma_connect' "$co.out" "$co.err" ||
      fail "$name: client: $(tail -n 5 "$co.err")"
    nap 0.1
  done
  n1=$(grep -c '^ping data:' "$co.out")
  for k in 1 2; do
    # The move of a guest whose program has ended is refused ("no guest"): too fast, not wrong.
    if ! hmigrate_try "$name-c" "$((k == 1 ? 1 : 3))" "$((k == 1 ? 3 : 1))"; then
      wait_pid "$cli" 30
      [[ $WAIT_RC == 0 ]] && rping_done "$name" "$srv" "$count" && return 2
      fail "$name: vrdma migrate (move $k): $MIG_JSON"
    fi
    ((k == 2)) && break
    log "$name: moved h1 -> h3 after $n1 pings ($(mig_field downtime_us) us frozen)"
    for ((try = 0; try < 100; try++)); do
      [[ $(grep -c '^ping data:' "$co.out") -gt $((n1 + 10)) ]] && break
      kill -0 "$cli" 2>/dev/null || break
      nap 0.05
    done
  done
  n2=$(grep -c '^ping data:' "$co.out")
  log "$name: moved h3 -> h1 after $n2 pings; $((n2 - n1)) pings on h3"
  ((n2 > n1)) || fail "$name: no ping while the guest was on h3"
  wait_pid "$cli" 30
  [[ $WAIT_RC == 0 ]] || fail "$name: client exited $WAIT_RC: $(tail -n 5 "$co.err")"
  rping_done "$name" "$srv" "$count" || fail "$name: server exited $WAIT_RC: $(tail -n 5 "$so.err")"
  ((n2 < count)) || return 2
  log "$name: $count pings verified, clean disconnect on both ends after two moves"
}

# After the client NAME-c exited 0: the server ended 0 too, every ping arrived and the server read
# what the client sent (else fail). Usage: rping_done NAME SERVER_PID COUNT
rping_done() {
  local name=$1 srv=$2 count=$3 n
  local so="$E2E_TMP/$name.srv" co="$E2E_TMP/$name.cli"
  wait_pid "$srv" 10
  [[ $WAIT_RC == 0 ]] || return 1
  n=$(grep -c '^ping data: rdma-ping-' "$co.out") || true
  [[ $n == "$count" ]] || fail "$name: $n pings, not $count"
  diff <(sed -n 's/^ping data: //p' "$co.out") <(sed -n 's/^server ping data: //p' "$so.out") \
    >/dev/null || fail "$name: the server read other data than the client sent"
}

# rping -C COUNT -v, server (guest NAME-s) on host SH, client (guest NAME-c) in h1, the client's
# guest moved h1 -> h3 -> h1 mid-run; every ping verified, both exit 0. A pair that finishes
# before its moves runs again with four times the count (a new port and guests), up to 3 times.
# Usage: rping_moved NAME SH PORT
rping_moved() {
  local name=$1 sh=$2 port=$3 count=$COUNT round rc
  for round in 1 2 3; do
    rc=0
    rping_try "$name$round" "$sh" "$((port + round))" "$count" || rc=$?
    ((rc == 2)) || return "$rc"
    log "$name: all $count pings were done before both moves; again with -C $((count * 4))"
    count=$((count * 4))
  done
  fail "$name: rping finished before its moves even with -C $count"
}

# Across hosts: the server on h2 follows its peer (kMoved from h3, then from h1).
rping_moved cross 2 7190
# One host: the server on h1 beside its client, which moves away (the pair is then across
# hosts, h1 told by h3) and back (local again on h1).
rping_moved local 1 7290
e2e_pass
