#!/usr/bin/env bash
# A stranger on the network against a library's direct-path port (the hub, src/verbs/remote.cc;
# issue 20): two namespace hosts with --direct-remote and a direct RC stream between them; an
# attacker on the client's host (hub_attacker.py) then
#   - finds the hub listening only on the address its backend announced (not on loopback);
#   - sends a hello of the plain-TCP protocol before TLS (hub_attacker.py, and
#     hub_tls_attacker plain) with the right QPNs: closed at once, unread past its first byte
#     and unanswered, logged with its address;
#   - does a TLS 1.3 handshake naming the right QPN pair as its PSK identity with a wrong key
#     (hub_tls_attacker psk): the handshake fails, logged with its address and the pair;
#   - opens 1,000 idle connections: those over the cap closed at once, the rest after 2 s, and
#     the hub's thread does not burn a core meanwhile (its CPU time, /proc/PID/task/TID/stat);
#   - queues connections while the library has no descriptor left: the hub stops watching its
#     listener for a while (a line says so) instead of spinning;
# while the stream goes on directly, checksummed at the end; then a new pair still goes direct.
# Usage: direct_hub.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=../hosts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../hosts/lib.sh"
ATTACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/hub_attacker.py"
HOSTS_VRDMAD_ARGS="--direct-remote ${HOSTS_VRDMAD_ARGS:-}"
hosts_init "${1:-}" 2
wait_mesh
TLS_ATTACK="$HOSTS_BIN/vrdma_hub_tls_attacker"

# CPU time (clock ticks) of the hub thread TID of process PID so far.
ticks() { awk '{print $14 + $15}' "/proc/$1/task/$2/stat"; }
# CPU time the hub thread spent over the last command run by `timed`, in ticks.
timed() {
  local t0
  t0="$(ticks "$pid" "$hub")"
  "$@"
  SPENT=$(($(ticks "$pid" "$hub") - t0))
}
# Ticks in a second of CPU time. A thread that spins takes every one the scheduler gives it; the
# checks below allow the hub half a second over a whole attack (it takes a few ticks).
HZ="$(getconf CLK_TCK)"
direct_sent() { hcount 2 st-c direct_msgs_sent; }
# Fails unless the stream's direct count moved since $1 (what it was).
still_direct() {
  local now
  now="$(direct_sent)"
  ((now > $1)) || fail "$2: the direct stream stopped ($1 -> $now)"
  echo "$now"
}

hstream_start st 1 2
pid="$(child_named "$srv" rc_stream)"
for ((k = 0; k < 100; k++)); do
  offer="$(grep -o "guest st-s QP 0x[0-9a-f]* takes QP 0x[0-9a-f]* of backend h2 on port [0-9]*" \
    "$E2E_TMP/vrdmad.h1.log" | tail -n 1)"
  [[ -n $offer && $(direct_sent) -gt 0 ]] && break
  nap 0.1
done
[[ -n $offer ]] || fail "no offer of st-s in h1's log"
read -r _ _ _ to_qpn _ _ from_qpn _ _ _ _ _ port <<<"$offer"
sent="$(still_direct 0 "before the attack")"
hub=""
for t in /proc/"$pid"/task/*; do [[ $(cat "$t/comm") == vrdma-hub ]] && hub="${t##*/}"; done
[[ -n $hub ]] || fail "no vrdma-hub thread in rc_stream ($pid)"
log "st-s listens on port $port (QP $to_qpn, peer QP $from_qpn); hub thread $hub"

# 1. Only on the announced address.
bound="$(hexec 1 ss -Htln "sport = :$port" | awk '{print $4}')"
[[ $bound == "$(host_ip 1):$port" ]] || fail "the hub listens on '$bound', not $(host_ip 1):$port"
hexec 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port" 2>/dev/null &&
  fail "the hub answers on loopback too"

# 2. The connection carries TLS 1.3 (both libraries say so). Strangers with the right QPNs: a
# plain hello (the old protocol; its token is never looked at), twice; TLS with a wrong key.
# The hub logs a line a second at most: each attack waits for the previous one's to pass.
for side in server client; do
  grep -q "through its library (TLSv1.3, TLS_AES_128_GCM_SHA256)\|from its library at .* (TLSv1.3, TLS_AES_128_GCM_SHA256)" \
    "$E2E_TMP/st.$side.out" || fail "st's $side does not say TLS 1.3: $(grep "direct path" "$E2E_TMP/st.$side.out")"
done
refused_line() { # N REASON-REGEX
  grep -q "refused a connection from $(host_ip 2):[0-9]*: $2 ($1 refused so far)" "$E2E_TMP/st.server.out" ||
    fail "no line for refusal $1: $(grep "direct path" "$E2E_TMP/st.server.out" | tail -n 3)"
}
out="$(hexec 2 python3 "$ATTACK" hello "$(host_ip 1)" "$port" "$to_qpn" "$from_qpn" 2>&1)" ||
  fail "plain hello: $out"
refused_line 1 "not TLS .*"
nap 1.1
out="$(hexec 2 "$TLS_ATTACK" plain "$(host_ip 1)" "$port" "$to_qpn" "$from_qpn" 2>&1)" ||
  fail "plain hello (C++): $out"
refused_line 2 "not TLS .*"
log "plain hello: $out"
nap 1.1
out="$(hexec 2 "$TLS_ATTACK" psk "$(host_ip 1)" "$port" "$to_qpn" "$from_qpn" 2>&1)" ||
  fail "wrong key: $out"
refused_line 3 "its TLS handshake failed: .* (a wrong key for QP $to_qpn to QP $from_qpn)"
log "wrong key: $out; the hub: $(grep -o "its TLS handshake failed: [^(]*" "$E2E_TMP/st.server.out" | tail -n 1)"
sent="$(still_direct "$sent" "strangers' hellos")"

# 3. 1,000 idle connections (over 2 s). 6 s in, the hub holds none of them any more.
flood() {
  hexec 2 python3 "$ATTACK" flood "$(host_ip 1)" "$port" 1000 8 >"$E2E_TMP/flood.out" 2>&1 &
  local attacker=$!
  sleep 6
  held="$(hexec 1 ss -Htn state established "sport = :$port" | wc -l)"
  wait "$attacker" || fail "flood: $(cat "$E2E_TMP/flood.out")"
}
timed flood
read -r _ est _ closed _ fast _ slowest _ <"$E2E_TMP/flood.out"
((held == 1)) || fail "flood: the hub holds $((held - 1)) strangers' connections after 6 s"
((est == 1000 && closed >= 950 && fast >= 900)) || fail "flood: $(cat "$E2E_TMP/flood.out")"
awk -v s="$slowest" 'BEGIN {exit !(s < 3.5)}' || fail "flood: idle for $slowest s before closed"
((SPENT < HZ / 2)) || fail "flood: the hub thread took $SPENT ticks of $HZ a second"
grep -q "others have not said hello yet" "$E2E_TMP/st.server.out" || fail "flood: no line for the cap"
grep -q "no hello within 2000 ms" "$E2E_TMP/st.server.out" || fail "flood: no line for late hellos"
sent="$(still_direct "$sent" "flood")"
log "flood: $(cat "$E2E_TMP/flood.out"); hub thread $SPENT ticks"

# 4. No descriptor left for accept: the listener rests instead of waking the hub for ever.
nofile="$(prlimit --pid "$pid" --nofile --output=SOFT --noheadings --raw)"
# The lowest free descriptor number: with the limit there, accept has none to give.
for ((free = 0; ; free++)); do [[ -e /proc/$pid/fd/$free ]] || break; done
prlimit --pid "$pid" --nofile="$free": || fail "prlimit"
hexec 2 python3 "$ATTACK" hold "$(host_ip 1)" "$port" 40 4 >"$E2E_TMP/hold.out" 2>&1 &
holder=$!
sleep 1
timed sleep 2
prlimit --pid "$pid" --nofile="$nofile": || fail "prlimit"
wait "$holder" || fail "hold: $(cat "$E2E_TMP/hold.out")"
grep -q "cannot accept peers' libraries on port $port: Too many open files" "$E2E_TMP/st.server.out" ||
  fail "no descriptors: accept never failed: $(grep "direct path" "$E2E_TMP/st.server.out" | tail -n 3)"
((SPENT < HZ / 2)) || fail "no descriptors: the hub thread took $SPENT ticks in 2 s"
sent="$(still_direct "$sent" "no descriptors")"
log "no descriptors: hub thread $SPENT ticks in 2 s"

kill -USR1 "$cli_proc"
finish_stream st "$cli" "$srv" 60
log "rc_stream: $STREAM_RESULT"
# A new pair still goes direct.
hpair after 1 2 -c -n 500
grep -q "direct path: guest after-c QP .* of backend" "$E2E_TMP/vrdmad.h2.log" ||
  fail "the next pair did not go direct"
e2e_pass
