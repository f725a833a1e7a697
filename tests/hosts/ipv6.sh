#!/usr/bin/env bash
# Two namespace hosts whose veths have only IPv6 addresses: the backends listen on and dial
# "[fd00:77::I]:PORT" (TLS as ever); Debian's ibv_rc_pingpong with content validation (-c) in
# LID and GID mode across them, and each backend's status names its peer in brackets.
# Usage: ipv6.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_IPV6=1
hosts_init "${1:-}" 2
[[ -z "$(hexec 1 ip -4 -o addr show dev eth0)" ]] || fail "h1's eth0 has an IPv4 address"
wait_mesh
for i in 1 2; do
  j=$((3 - i))
  hstatus "$i" | grep -qF "\"$(host_ep "$j" "$HOSTS_PORT")\"" ||
    fail "h$i's status does not name $(host_ep "$j" "$HOSTS_PORT"): $(hstatus "$i")"
done

# ibv_rc_pingpong server on h1, client on h2. Its server listens on 0.0.0.0 (the first "any"
# address getaddrinfo gives), so a relay on h1's [::] carries the pingpong's own exchange of QP
# numbers; the RDMA traffic is vrdma's, over the backends' IPv6 connection.
# Usage: pair6 NAME ARGS...
pair6() {
  local name=$1 port=$((18000 + RANDOM % 1000)) relay k
  shift
  log "$name: ibv_rc_pingpong h1 <- h2 over IPv6 $*"
  hrun 1 --guest "$name-s" -- ibv_rc_pingpong -p "$port" "$@" >"$E2E_TMP/$name.server.out" 2>&1 &
  HP_SPID=$!
  hwait_port 1 "$port" "$HP_SPID" "$name"
  # Not through hexec: a function in the background is a subshell, and $! would be its pid.
  ip netns exec "$(host_ns 1)" python3 "$(dirname "${BASH_SOURCE[0]}")/tcp6_relay.py" "$port" \
    >"$E2E_TMP/$name.relay.out" 2>&1 &
  relay=$!
  for ((k = 0; k < 100; k++)); do
    [[ -n "$(hexec 1 ss -Htln6 "sport = :$port" 2>/dev/null)" ]] && break
    nap 0.1
  done
  hrun 2 --guest "$name-c" -- ibv_rc_pingpong -p "$port" "$@" "$(host_ip 1)" \
    >"$E2E_TMP/$name.client.out" 2>&1 &
  HP_CPID=$!
  finish_pair "$name" "$HP_SPID" "$HP_CPID" 60
  kill "$relay" 2>/dev/null || true
  wait "$relay" 2>/dev/null || true
}
pair6 lid -c -n 1000
pair6 gid -g 0 -c -n 500
# The QPs went over TCP to h1's backend, whose connection is the IPv6 one.
hstatus 2 | grep -qF "\"[fd00:77::1]:" || fail "h2's status: no connection from [fd00:77::1]"
e2e_pass
