#!/usr/bin/env bash
# UD multicast across backends with Debian's unmodified mckey (rdmacm-utils): a group spans the
# cluster as one IB partition does. The sender's backend delivers to its own members and sends
# the datagram once to each peer backend, which delivers it to its members there. Two groups at
# once: 239.1.2.3 with its receiver on h1 and the sender on h2; 239.1.2.4 with receivers on h1
# and h2 and the sender on h1 (one member beside the sender, one across). Each receiver counts
# all 10 datagrams of its group (mckey -C 10 ends with 'test complete' only then). ~7 s, most of
# it mckey's own 3 s pause after joining, on each side.
# Usage: mcast.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
command -v mckey >/dev/null || {
  log "SKIP: rdmacm-utils not installed"
  exit 77
}
hosts_init "${1:-}" 2
wait_mesh

# Receivers: NAME GROUP HOST (output $E2E_TMP/NAME); senders: NAME GROUP HOST.
RECEIVERS=("across.rcv1 239.1.2.3 1" "both.rcv1 239.1.2.4 1" "both.rcv2 239.1.2.4 2")
SENDERS=("across.snd 239.1.2.3 2" "both.snd 239.1.2.4 1")
rpids=() spids=()
for r in "${RECEIVERS[@]}"; do
  read -r name group h <<<"$r"
  log "receiver $name: $group on h$h"
  hrun "$h" --guest "mc-$name" -- stdbuf -oL mckey -m "$group" -C 10 >"$E2E_TMP/$name" 2>&1 &
  rpids+=($!)
done
for ((try = 0; try < 100; try++)); do
  n=$(cat "$E2E_TMP"/*.rcv* 2>/dev/null | grep -c 'receiving data transfers' || true)
  [[ $n == "${#RECEIVERS[@]}" ]] && break
  nap 0.1
done
[[ $n == "${#RECEIVERS[@]}" ]] || fail "only $n of ${#RECEIVERS[@]} receivers joined"
for s in "${SENDERS[@]}"; do
  read -r name group h <<<"$s"
  log "sender $name: $group on h$h"
  hrun "$h" --guest "mc-$name" -- mckey -m "$group" -s -C 10 >"$E2E_TMP/$name" 2>&1 &
  spids+=($!)
done
for i in "${!SENDERS[@]}"; do
  read -r name _ <<<"${SENDERS[i]}"
  wait_pid "${spids[i]}" 30
  [[ $WAIT_RC == 0 ]] || fail "sender $name exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/$name")"
done
for i in "${!RECEIVERS[@]}"; do
  read -r name _ <<<"${RECEIVERS[i]}"
  wait_pid "${rpids[i]}" 20
  [[ $WAIT_RC == 0 ]] || fail "receiver $name exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/$name")"
  grep -q '^test complete' "$E2E_TMP/$name" || fail "receiver $name: not all 10 datagrams"
done
e2e_pass
