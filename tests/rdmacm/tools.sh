#!/usr/bin/env bash
# Debian's unmodified rdma_cm programs (rdmacm-utils, perftest -R) through vrdma's
# librdmacm.so.1, server and client on one backend. Usage: tools.sh BIN_DIR CASE, CASE one of
#   rping      rping -s / rping -c -C 100 -v (data verified), ping data checked on both sides
#   ucmatose   default, then -c 4 (four connections at once), then -c 64 (64 concurrent
#              connects to one listener)
#   udaddy     UD QPs: the SIDR-style exchange, address handles from the events
#   sync_ep    cm_sync_ep (sync_ep.c): the synchronous API, rdma_create_ep, rdma_verbs.h
#   sync_tools Debian's rdma_server/rdma_client: the same API on static buffers (a private file
#              mapping of the executable, registered since issue 24)
#   xtools     Debian's rdma_xserver/rdma_xclient: XRC over the RDMA CM (-c x), then RC
#   perftest   ib_send_lat, ib_write_bw, ib_read_lat, ib_atomic_bw with -R, 1000 iterations
#   cm_rate    bench/cm_rate's churn, untimed: 500 connections 32 at a time, then 50 with an
#              RC QP each, every one established and torn down (the rates: BENCHMARKS.md)
#   bad_input  a port nobody listens on (REJECTED at once), an address no backend serves
#              (ADDR_ERROR after rping's 2 s timeout; refused at once where no route reaches
#              it), a listener killed and its port taken again, the backend
#              killed under a connected pair (DEVICE_REMOVAL on both ends, no hang), and
#              beside an id its process destroys the moment it sees the backend gone
#              (removal_race.c: the thread waiting on its channel still gets the removal)
# shellcheck source-path=SCRIPTDIR source=../e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
e2e_init "${1:-}"
CASE="${2:?usage: $0 BIN_DIR CASE}"
E2E_NAME="rdmacm.$CASE"
[[ -e $(dirname "$VRDMA")/../lib/librdmacm.so.1 ]] || fail "librdmacm.so.1 missing beside libibverbs"
command -v rping >/dev/null || {
  log "SKIP: rdmacm-utils not installed"
  exit 77
}

# A CM listener shows in no socket table, so the client is retried while it finds none (its
# connect is REJECTED with reason 8 at once) for up to 10 s.
# Usage: cm_pair NAME 'SERVER ARGS' 'CLIENT ARGS' (word-split); outputs $E2E_TMP/NAME.{srv,cli}
# (stdout) and NAME.{srv,cli}.err
cm_pair() {
  local name=$1 srv_args=$2 cli_args=$3 srv try
  log "$name: $srv_args | $cli_args"
  # shellcheck disable=SC2086  # the arguments are word lists
  "${VRUN[@]}" --guest cm-srv -- $srv_args >"$E2E_TMP/$name.srv" 2>"$E2E_TMP/$name.srv.err" &
  srv=$!
  # A head start: a client whose connects are still refused after the library's 200 ms grace
  # gives up, and its requests that did reach the server vanish under the server's accept
  # (EINVAL, as the kernel's): on a loaded machine ucmatose -c 64's server then exits.
  nap 0.3
  for ((try = 0; try < 100; try++)); do
    # shellcheck disable=SC2086
    if timeout 60 "${VRUN[@]}" --guest cm-cli -- $cli_args >"$E2E_TMP/$name.cli" 2>"$E2E_TMP/$name.cli.err"; then
      WAIT_RC=0
      break
    fi
    WAIT_RC=$?
    cat "$E2E_TMP/$name.cli" "$E2E_TMP/$name.cli.err" |
      grep -qE 'REJECTED|Unexpected CM event|rdma_connect: Connection refused' || break
    kill -0 "$srv" 2>/dev/null || break
    nap 0.1
  done
  [[ $WAIT_RC == 0 ]] || {
    cat "$E2E_TMP/$name.cli" "$E2E_TMP/$name.cli.err" >&2
    fail "$name: client exited $WAIT_RC"
  }
  wait_pid "$srv" 20
  [[ $WAIT_RC == 0 ]] || {
    cat "$E2E_TMP/$name.srv" "$E2E_TMP/$name.srv.err" >&2
    fail "$name: server exited $WAIT_RC"
  }
}

case $CASE in
  rping)
    cm_pair rping "rping -s -a 127.0.0.1 -p 7174 -C 100 -v" "rping -c -a 127.0.0.1 -p 7174 -C 100 -v"
    # -v prints every buffer as it arrived: the rotating pattern, the 100th one included.
    grep -q '^ping data: rdma-ping-99: ' "$E2E_TMP/rping.cli" || fail "client data missing"
    grep -q '^server ping data: rdma-ping-99: ' "$E2E_TMP/rping.srv" || fail "server data missing"
    [[ $(grep -c '^ping data: rdma-ping-' "$E2E_TMP/rping.cli") == 100 ]] || fail "not 100 pings"
    # What the server read (RDMA READ from the client's buffer) is what the client sent.
    diff <(sed -n 's/^ping data: //p' "$E2E_TMP/rping.cli") \
      <(sed -n 's/^server ping data: //p' "$E2E_TMP/rping.srv") >/dev/null ||
      fail "the server read other data than the client sent"
    ;;
  ucmatose)
    cm_pair ucmatose "ucmatose -p 7175" "ucmatose -s 127.0.0.1 -p 7175"
    cm_pair ucmatose_c4 "ucmatose -p 7176 -c 4 -C 50" "ucmatose -s 127.0.0.1 -p 7176 -c 4 -C 50"
    cm_pair ucmatose_c64 "ucmatose -p 7180 -c 64 -C 10" "ucmatose -s 127.0.0.1 -p 7180 -c 64 -C 10"
    for f in ucmatose{,_c4,_c64}.{cli,srv}; do
      grep -q '^test complete' "$E2E_TMP/$f" || fail "$f: no 'test complete'"
    done
    ;;
  udaddy)
    # udaddy has no port option (its -p is the port space): the default, 7174.
    cm_pair udaddy "udaddy" "udaddy -s 127.0.0.1"
    for f in udaddy.cli udaddy.srv; do
      grep -q '^test complete' "$E2E_TMP/$f" || fail "$f: no 'test complete'"
    done
    ;;
  mckey)
    # UD multicast among a backend's guests: two receivers join 239.1.2.3 (their QPs attached
    # on MULTICAST_JOIN), then a sender joins and sends 10 datagrams of 100 bytes to the group.
    for r in 1 2; do
      "${VRUN[@]}" --guest "mc-rcv$r" -- stdbuf -oL mckey -m 239.1.2.3 -C 10 >"$E2E_TMP/mckey.rcv$r" 2>&1 &
      eval "rcv$r=\$!"
    done
    for ((try = 0; try < 100; try++)); do
      grep -q 'receiving data transfers' "$E2E_TMP/mckey.rcv1" "$E2E_TMP/mckey.rcv2" 2>/dev/null &&
        [[ $(grep -l 'receiving data transfers' "$E2E_TMP"/mckey.rcv* | wc -l) == 2 ]] && break
      nap 0.1
    done
    timeout 30 "${VRUN[@]}" --guest mc-snd -- mckey -m 239.1.2.3 -s -C 10 >"$E2E_TMP/mckey.snd" 2>&1 ||
      fail "sender: $(tail -n 5 "$E2E_TMP/mckey.snd")"
    for r in 1 2; do
      eval "pid=\$rcv$r"
      wait_pid "$pid" 20
      [[ $WAIT_RC == 0 ]] || fail "receiver $r exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/mckey.rcv$r")"
      grep -q '^test complete' "$E2E_TMP/mckey.rcv$r" || fail "receiver $r: no 'test complete'"
    done
    ;;
  sync_ep)
    bin=$(dirname "$VRDMA")
    cm_pair sync_ep "$bin/cm_sync_ep server 7182" "$bin/cm_sync_ep client 127.0.0.1 7182"
    grep -q '^client: ok' "$E2E_TMP/sync_ep.cli" || fail "no echo"
    ;;
  cm_rate)
    bin=$(dirname "$VRDMA")
    cm_pair cm_rate "$bin/cm_rate --server 127.0.0.1 7184 -n 500" \
      "$bin/cm_rate --client 127.0.0.1 7184 -n 500 -w 32"
    grep -q '^rdma_cm: 500 connections' "$E2E_TMP/cm_rate.cli" || fail "cm_rate: no result"
    cm_pair cm_rate_qp "$bin/cm_rate --server 127.0.0.1 7185 -n 50 -q" \
      "$bin/cm_rate --client 127.0.0.1 7185 -n 50 -w 8 -q"
    grep -q '^rdma_cm+qp: 50 connections' "$E2E_TMP/cm_rate_qp.cli" || fail "cm_rate -q: no result"
    ;;
  sync_tools)
    cm_pair sync_tools "rdma_server -s 127.0.0.1 -p 7183" "rdma_client -s 127.0.0.1 -p 7183"
    grep -q '^rdma_client: end 0' "$E2E_TMP/sync_tools.cli" || fail "client did not end with 0"
    grep -q '^rdma_server: end 0' "$E2E_TMP/sync_tools.srv" || fail "server did not end with 0"
    ;;
  xtools)
    # -c x: RDMA_PS_IB, an XRC receive QP and an XRC SRQ on the server, whose number travels in
    # its accept's private data; the client's XRC send QP posts one 16-byte inline SEND naming
    # it. The server ends only once that receive completed on the SRQ's CQ. Then the same
    # programs with RC QPs.
    cm_pair xtools "rdma_xserver -c x -p 7186" "rdma_xclient -s 127.0.0.1 -c x -p 7186"
    cm_pair xtools_rc "rdma_xserver -p 7187" "rdma_xclient -s 127.0.0.1 -p 7187"
    for n in xtools xtools_rc; do
      grep -q '^rdma_xclient: end 0' "$E2E_TMP/$n.cli" || fail "$n: the client did not end with 0"
      grep -q '^rdma_xserver: end 0' "$E2E_TMP/$n.srv" || fail "$n: the server did not end with 0"
    done
    ;;
  perftest)
    command -v ib_send_lat >/dev/null || {
      log "SKIP: perftest not installed"
      exit 77
    }
    for t in ib_send_lat ib_write_bw ib_read_lat ib_atomic_bw; do
      cm_pair "$t" "$t -R -n 1000 -p 7177" "$t -R -n 1000 -p 7177 127.0.0.1"
      [[ -n $(result_rows "$E2E_TMP/$t.cli") ]] || fail "$t: no result row"
    done
    ;;
  bad_input)
    start=$(date +%s%N)
    bin=$(dirname "$VRDMA")
    if "${VRUN[@]}" --guest cm-cli -- rping -c -a 127.0.0.1 -p 7178 -C 1 >"$E2E_TMP/nolisten" 2>&1; then
      fail "a connect to a port nobody listens on succeeded"
    fi
    grep -q 'RDMA_CM_EVENT_REJECTED, error 8' "$E2E_TMP/nolisten" || {
      cat "$E2E_TMP/nolisten" >&2
      fail "no REJECTED (reason 8: no listener)"
    }
    if "${VRUN[@]}" --guest cm-cli -- rping -c -a 198.51.100.1 -p 7178 -C 1 >"$E2E_TMP/noaddr" 2>&1; then
      fail "a connect to an address no backend serves succeeded"
    fi
    grep -qE 'RDMA_CM_EVENT_ADDR_ERROR|Network is unreachable' "$E2E_TMP/noaddr" || {
      cat "$E2E_TMP/noaddr" >&2
      fail "no ADDR_ERROR (nor ENETUNREACH)"
    }
    ms=$((($(date +%s%N) - start) / 1000000))
    log "both failed: $ms ms"
    ((ms < 10000)) || fail "they took $ms ms"
    # A listener killed: its port is free again for the next one.
    "${VRUN[@]}" --guest cm-srv -- rping -s -a 127.0.0.1 -p 7179 -C 1 >"$E2E_TMP/killed" 2>&1 &
    pid=$!  # vrdma run execs the program
    nap 0.5
    kill -KILL "$pid"
    wait "$pid" 2>/dev/null || true
    cm_pair reuse "rping -s -a 127.0.0.1 -p 7179 -C 10 -v" "rping -c -a 127.0.0.1 -p 7179 -C 10 -v"
    # The backend killed under a connected pair: both ends hear DEVICE_REMOVAL and exit.
    "${VRUN[@]}" --guest cm-srv -- rping -s -a 127.0.0.1 -p 7183 -C 100000000 >"$E2E_TMP/rm.srv" 2>&1 &
    srv=$!
    for ((try = 0; try < 50; try++)); do
      "${VRUN[@]}" --guest cm-cli -- rping -c -a 127.0.0.1 -p 7183 -C 100000000 >"$E2E_TMP/rm.cli" 2>&1 &
      cli=$!
      nap 0.5
      kill -0 "$cli" 2>/dev/null && break  # connected and pinging (not refused)
    done
    # And an id destroyed as soon as its process sees the backend gone, while another thread
    # waits for its events (removal_race.c): the waiting thread gets the id's DEVICE_REMOVAL.
    "${VRUN[@]}" --guest cm-race -- "$bin/cm_removal_race" >"$E2E_TMP/race" 2>&1 &
    race=$!
    for ((try = 0; try < 100; try++)); do
      grep -q '^ready' "$E2E_TMP/race" && break
      kill -0 "$race" 2>/dev/null || fail "cm_removal_race: $(cat "$E2E_TMP/race")"
      nap 0.1
    done
    grep -q '^ready' "$E2E_TMP/race" || fail "cm_removal_race never waited: $(cat "$E2E_TMP/race")"
    log "killing the backend under a connected rping pair"
    kill -KILL "$(backend_pid)"
    wait_pid "$srv" 10
    [[ $WAIT_RC != 124 ]] || fail "the server hung when the backend died"
    wait_pid "$cli" 10
    [[ $WAIT_RC != 124 ]] || fail "the client hung when the backend died"
    grep -q 'device removal' "$E2E_TMP/rm.srv" || fail "server: no DEVICE_REMOVAL: $(cat "$E2E_TMP/rm.srv")"
    grep -q 'device removal' "$E2E_TMP/rm.cli" || fail "client: no DEVICE_REMOVAL: $(cat "$E2E_TMP/rm.cli")"
    wait_pid "$race" 10
    [[ $WAIT_RC == 0 ]] || fail "an id destroyed beside a waiting thread: $(cat "$E2E_TMP/race")"
    ;;
  *) fail "unknown case $CASE" ;;
esac
e2e_pass
