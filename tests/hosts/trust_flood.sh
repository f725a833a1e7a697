#!/usr/bin/env bash
# A flood of connections that never start a handshake (issue 20): 1,100 idle TCP connections
# from h3 to h1's port, held. Meanwhile h1 keeps its peer: h2's backend restarts and connects
# again, and a pingpong across them runs; h1 counts the connections it refused before any
# handshake (`refused.pending`) and closes them; and it does not spin on them (its CPU time over
# 3 s stays well under one second: a check that it sleeps, not a speed assertion).
# Usage: trust_flood.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=trust_lib.sh
# shellcheck disable=SC2016  # Perl expressions in single quotes
source "$(dirname "${BASH_SOURCE[0]}")/trust_lib.sh"
hosts_init "${1:-}" 3 2
wait_mesh
expect_security 1 tls

# Clock ticks (user + system) of process PID so far.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

hexec 3 "$HOSTS_BIN/net_attacker" plain "$(host_ip 1):$HOSTS_PORT" --idle 1100 --hold 12 \
  >"$E2E_TMP/flood.attack.out" 2>&1 &
flood=$!
for ((k = 0; k < 100; k++)); do
  grep -q "^idle:" "$E2E_TMP/flood.attack.out" && break
  kill -0 "$flood" 2>/dev/null || fail "net_attacker ended: $(tail -n 3 "$E2E_TMP/flood.attack.out")"
  nap 0.1
done
log "flood: $(grep "^idle:" "$E2E_TMP/flood.attack.out" || echo "not connected after 10 s")"

pid=${HOSTS_BACKEND_PID[1]}
[[ "$(cat "/proc/$pid/comm")" == vrdmad ]] || fail "pid $pid is not h1's vrdmad"
t0=$(cpu_ticks "$pid")
nap 3
used=$((($(cpu_ticks "$pid") - t0) * 1000 / $(getconf CLK_TCK)))
log "h1's backend used $used ms of CPU in 3 s under the flood"
((used < 1000)) || miss "h1's backend used $used ms of CPU in 3 s: it spins on the flood"

# h2 comes back: both connect again while the flood holds.
before1=$(grep -c "connected to h2 " "$E2E_TMP/vrdmad.h1.log" || true)
before2=$(grep -c "connected to h1 " "$E2E_TMP/vrdmad.h2.log" || true)
kill_backend 2
start_backend 2
for ((k = 0; k < 100; k++)); do
  (($(grep -c "connected to h2 " "$E2E_TMP/vrdmad.h1.log") > before1 &&
    $(grep -c "connected to h1 " "$E2E_TMP/vrdmad.h2.log") > before2)) && break
  nap 0.1
done
(($(grep -c "connected to h2 " "$E2E_TMP/vrdmad.h1.log") > before1)) ||
  miss "h1 did not connect to h2's new backend within 10 s"
(($(grep -c "connected to h1 " "$E2E_TMP/vrdmad.h2.log") > before2)) ||
  miss "h2's new backend did not connect to h1 within 10 s"
hpair_start flood_pp 1 2 -n 500
wait_pid "$HP_CPID" 20
crc=$WAIT_RC
wait_pid "$HP_SPID" 5
if [[ $crc == 0 && $WAIT_RC == 0 ]]; then
  check_pp_output "$E2E_TMP/flood_pp.client.out"
  log "flood_pp: $(grep usec/iter "$E2E_TMP/flood_pp.client.out")"
else
  miss "the pingpong h1 <- h2 under the flood: client exited $crc, server $WAIT_RC"
fi
kill -0 "$flood" 2>/dev/null || miss "the flood ended before the pingpong did: the test did not test"

expect_refused 1 pending
wait_pid "$flood" 20
[[ $WAIT_RC == 0 ]] || fail "net_attacker exited $WAIT_RC: $(tail -n 3 "$E2E_TMP/flood.attack.out")"
log "flood: $(tail -n 1 "$E2E_TMP/flood.attack.out")"
closed="$(attack_field flood '$a->{closed_by_peer}')"
[[ $closed -gt 0 ]] || miss "h1 closed none of the 1,100 idle connections"
kill -0 "${HOSTS_BACKEND_PID[1]}" || fail "h1's backend died"
trust_done
