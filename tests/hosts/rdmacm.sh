#!/usr/bin/env bash
# Debian's unmodified rdma_cm programs across two namespace hosts (server on h1, client on h2):
# rdma_resolve_addr of h1's address finds h1's backend, and the CM exchange travels between the
# backends over their transport connection (wire kCm). rping -C 20 -v with the data checked on
# both ends, ucmatose -c 4, udaddy (UD), rdma_xserver/rdma_xclient -c x (XRC), ib_send_bw -R; IPv6: rping on ::1 (one host) and rping and
# ucmatose by the hosts' IPv6 addresses; then an address on the network with no host (ADDR_ERROR
# after rping's 2 s timeout) and one no route reaches (refused at once). A few seconds.
# Usage: rdmacm.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
command -v rping >/dev/null || {
  log "SKIP: rdmacm-utils not installed"
  exit 77
}
hosts_init "${1:-}" 2
wait_mesh
SRV_IP=$(host_ip 1)

# A CM listener shows in no socket table: the client is retried while it is refused (REJECTED,
# reason 8) until the server listens. Usage: cm_pair NAME 'SERVER ARGS' 'CLIENT ARGS'
# [CLIENT HOST (2)]; outputs $E2E_TMP/NAME.{srv,cli}.
cm_pair() {
  local name=$1 srv_args=$2 cli_args=$3 cli_host=${4:-2} srv try
  log "$name: h1: $srv_args | h$cli_host: $cli_args"
  # shellcheck disable=SC2086  # the arguments are word lists
  hrun 1 --guest cm-srv -- $srv_args >"$E2E_TMP/$name.srv" 2>&1 &
  srv=$!
  for ((try = 0; try < 100; try++)); do
    # shellcheck disable=SC2086
    if timeout 30 ip netns exec "$(host_ns "$cli_host")" env VRDMA_SOCKET="$(host_sock "$cli_host")" \
      VRDMA_BACKEND=/nonexistent-vrdmad "${VRUN[@]}" --guest cm-cli -- $cli_args \
      >"$E2E_TMP/$name.cli" 2>&1; then
      WAIT_RC=0
      break
    fi
    WAIT_RC=$?
    grep -qE 'REJECTED|Unexpected CM event|rdma_connect' "$E2E_TMP/$name.cli" || break
    kill -0 "$srv" 2>/dev/null || break
    nap 0.1
  done
  [[ $WAIT_RC == 0 ]] || fail "$name: client exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/$name.cli")"
  wait_pid "$srv" 20
  [[ $WAIT_RC == 0 ]] || fail "$name: server exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/$name.srv")"
}

# rping -v's output of cm_pair NAME: COUNT pings, and what the server read (RDMA READ from the
# client's buffer) is what the client sent. Usage: check_rping NAME COUNT
check_rping() {
  [[ $(grep -c '^ping data: rdma-ping-' "$E2E_TMP/$1.cli") == "$2" ]] || fail "$1: not $2 pings"
  diff <(sed -n 's/^ping data: //p' "$E2E_TMP/$1.cli") \
    <(sed -n 's/^server ping data: //p' "$E2E_TMP/$1.srv") >/dev/null ||
    fail "$1: the server read other data than the client sent"
}
# Both ends of cm_pair NAME said 'test complete' (ucmatose, udaddy). Usage: check_complete NAME
check_complete() {
  local f
  for f in "$1.cli" "$1.srv"; do
    grep -q '^test complete' "$E2E_TMP/$f" || fail "$f: no 'test complete'"
  done
}

cm_pair rping "rping -s -a $SRV_IP -p 7174 -C 20 -v" "rping -c -a $SRV_IP -p 7174 -C 20 -v"
check_rping rping 20

cm_pair ucmatose "ucmatose -p 7175 -c 4 -C 20" "ucmatose -s $SRV_IP -p 7175 -c 4 -C 20"
check_complete ucmatose

# UD: the SIDR-shaped exchange, then datagrams to the address handle from the event.
cm_pair udaddy "udaddy" "udaddy -s $SRV_IP"
check_complete udaddy

# XRC: the server's XRC SRQ number in its accept's private data, the client's inline SEND on h2
# naming it; the server ends only once that receive completed.
cm_pair xtools "rdma_xserver -c x -p 7186" "rdma_xclient -s $SRV_IP -c x -p 7186"
grep -q '^rdma_xclient: end 0' "$E2E_TMP/xtools.cli" || fail "xtools: the client did not end with 0"
grep -q '^rdma_xserver: end 0' "$E2E_TMP/xtools.srv" || fail "xtools: the server did not end with 0"

if command -v ib_send_bw >/dev/null; then
  cm_pair ib_send_bw "ib_send_bw -R -n 1000 -p 7177" "ib_send_bw -R -n 1000 -p 7177 $SRV_IP"
  [[ -n $(result_rows "$E2E_TMP/ib_send_bw.cli") ]] || fail "ib_send_bw -R: no result row"
  log "ib_send_bw -R: $(result_rows "$E2E_TMP/ib_send_bw.cli" | tail -n 1)"
else
  log "perftest not installed: ib_send_bw -R skipped"
fi

# IPv6: loopback (::1) on one host, and across the two hosts by their IPv6 addresses (fd77::I on
# eth0), which h2's backend learns is h1's by asking its peers (wire kCm kAddrQuery).
for i in 1 2; do ip -n "$(host_ns "$i")" addr add "fd77::$i/64" dev eth0 nodad; done
cm_pair rping6_lo "rping -s -a ::1 -p 7180 -C 5 -v" "rping -c -a ::1 -p 7180 -C 5 -v" 1
check_rping rping6_lo 5
cm_pair rping6 "rping -s -a fd77::1 -p 7181 -C 10 -v" "rping -c -a fd77::1 -p 7181 -C 10 -v"
check_rping rping6 10
cm_pair ucmatose6 "ucmatose -b fd77::1 -p 7182 -c 2 -C 10" "ucmatose -s fd77::1 -p 7182 -c 2 -C 10"
check_complete ucmatose6

# An address on h2's network that nobody answers: ADDR_ERROR once rping's timeout (2 s) passed.
start=$(date +%s%N)
if hrun 2 --guest cm-cli -- rping -c -a 10.77.0.99 -p 7178 -C 1 >"$E2E_TMP/noaddr" 2>&1; then
  fail "a connect to an address with no host succeeded"
fi
ms=$((($(date +%s%N) - start) / 1000000))
grep -q 'RDMA_CM_EVENT_ADDR_ERROR' "$E2E_TMP/noaddr" || fail "no ADDR_ERROR: $(cat "$E2E_TMP/noaddr")"
log "no host: ADDR_ERROR after $ms ms"
((ms >= 1900 && ms < 10000)) || fail "ADDR_ERROR after $ms ms (rping's timeout: 2000 ms)"
# No route at all: rdma_resolve_addr fails at once (ENETUNREACH), as the kernel's does.
if hrun 2 --guest cm-cli -- rping -c -a 192.0.2.1 -p 7178 -C 1 >"$E2E_TMP/noroute" 2>&1; then
  fail "a connect to an address without a route succeeded"
fi
grep -qi 'unreachable' "$E2E_TMP/noroute" || fail "no route: $(cat "$E2E_TMP/noroute")"
e2e_pass
