#!/usr/bin/env bash
# A stranger on the backends' network (issue 20). Hosts h1 and h2 run backends with the cluster's
# credentials; h3 runs only net_attacker. While a verifying RC stream runs from a guest on h1 to
# one on h2 (held still, so its expected PSN is known), the attacker talks to h2's port:
#   - without a credential, saying Hello as h1 and as h9: a directory entry for each stream guest,
#     then a READ with a bad key and a SEND for every PSN of a 4096-wide window around the PSN
#     h2's QP expects next. The TLS handshake fails; nothing comes back.
#   - with a valid credential of a node h9 that is no backend: Hello as h1 is refused (the name is
#     not its certificate's); Hello as h9 is heard, but its directory entries (guests of h1 and
#     h2) and its requests for h2's QP (whose peer is h1) are refused, and h2 answers none.
# Each refusal leaves a log line with the attacker's address and a counter in the status; the
# stream ends with the same checksum on both ends, and no QP changed its peer or transport.
# Usage: trust_attacker.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=trust_lib.sh
# shellcheck disable=SC2016  # Perl expressions in single quotes
source "$(dirname "${BASH_SOURCE[0]}")/trust_lib.sh"
hosts_init "${1:-}" 3 2
wait_mesh
expect_security 1 tls
expect_security 2 tls
ATTACKER_IP="$(host_ip 3)"
TARGET="$(host_ip 2):$HOSTS_PORT"

# The stream: server (the receiver) ts-s on h2, client ts-c on h1.
hstream_start ts 2 1
hwait_flowing 2 ts-s msgs_received "$srv"
read -r s_lid s_gid s_qpn <<<"$(guest_ids 2 ts-s)"
read -r c_lid c_gid c_qpn <<<"$(guest_ids 1 ts-c)"
[[ -n $s_qpn && -n $c_qpn ]] || fail "no QPs for the stream guests in the status"
routes1="$(qp_routes 1)" routes2="$(qp_routes 2)"
log "stream QPs: ts-s $s_qpn (lid $s_lid) on h2 <- ts-c $c_qpn (lid $c_lid) on h1; $routes2"

# Held still: the client stops posting; once h2 has received all in flight, the PSN its QP
# expects next is its first one plus the messages received.
kill -STOP "$cli_proc"
prev="" k=0
for ((k = 0; k < 50; k++)); do
  nap 0.2
  cur="$(hqps 2 ts-s rq_psn msgs_received)"
  [[ $cur == "$prev" ]] && break
  prev=$cur
done
read -r rq_psn received <<<"$cur"
expected=$(((rq_psn + received) & 0xffffff))
window="$(((expected - 2048) & 0xffffff)):4096"
log "h2's QP expects PSN $expected ($received messages received); probing $window"
guests=(--guest-up "ts-s:$s_lid:$s_gid" --guest-up "ts-c:$c_lid:$c_gid")
probes=(--probe "$s_lid:$s_qpn:$c_qpn:$c_lid" --window "$window")

# Without a credential.
for as in h1 h9; do
  attack "plain_$as" 3 plain "$TARGET" --as "$as" "${guests[@]}" "${probes[@]}"
  expect_no_frames "plain_$as" hello guest_up request reply direct_offer
  local_addr="$(attack_field "plain_$as" '$a->{local}')"
  expect_log 2 "plain_$as's failed handshake" "TLS handshake with $(re_of "$local_addr") failed"
done
expect_refused 2 handshake

# With h9's credential: a member of the cluster, but no backend, and no peer of any QP.
make_cluster "$HOSTS_CLUSTER" h9
attack tls_claims_h1 3 tls "$TARGET" --dir "$HOSTS_CLUSTER" --cert h9 --as h1 "${guests[@]}"
[[ "$(attack_field tls_claims_h1 '$a->{handshake}')" == ok ]] ||
  miss "tls_claims_h1: the TLS handshake with h9's credential failed"
expect_no_frames tls_claims_h1 guest_up request reply
expect_log 2 "h9 claiming h1" "claims node h1 but its certificate names h9.*$(re_of "$ATTACKER_IP")|$(re_of "$ATTACKER_IP").*claims node h1 but its certificate names h9"
expect_refused 2 name

# Its directory entries and its requests on connections of their own: whether a backend closes a
# connection at the first refusal is its choice.
attack tls_h9_directory 3 tls "$TARGET" --dir "$HOSTS_CLUSTER" --cert h9 --as h9 "${guests[@]}"
attack tls_h9_requests 3 tls "$TARGET" --dir "$HOSTS_CLUSTER" --cert h9 --as h9 "${probes[@]}"
for a in tls_h9_directory tls_h9_requests; do
  [[ "$(attack_field "$a" '$a->{handshake}')" == ok ]] ||
    miss "$a: the TLS handshake with h9's credential failed"
  expect_no_frames "$a" request reply
done
expect_log 2 "h9's directory entries" "directory: refused.*$(re_of "$ATTACKER_IP")|$(re_of "$ATTACKER_IP").*directory: refused"
expect_log 2 "h9's requests" "refused a frame from.*$(re_of "$ATTACKER_IP")"
expect_refused 2 directory
expect_refused 2 frames

# The peers h2 knows: h1, over TLS; nobody from the attacker's host.
known="$(htcp 2 '{peers} ? join(" ", map { "$_->{node}\@$_->{address}/" . ($_->{cipher} // "") } @{$t->{peers}}) : "none"')"
log "h2's tcp peers: $known"
[[ $known =~ (^| )h1@$(re_of "$(host_ip 1)")(:[0-9]+)?/TLS ]] || miss "h2's peers '$known' lack h1 over TLS"
[[ $known != *"$ATTACKER_IP:"* ]] || miss "h2's peers '$known' include the attacker's host"

# Nothing moved, and the stream goes on to the end intact.
kill -CONT "$cli_proc"
[[ "$(qp_routes 1)" == "$routes1" ]] || miss "h1's QPs moved: '$routes1' -> '$(qp_routes 1)'"
[[ "$(qp_routes 2)" == "$routes2" ]] || miss "h2's QPs moved: '$routes2' -> '$(qp_routes 2)'"
for ((k = 0; k < 100; k++)); do
  [[ $(hcount 2 ts-s msgs_received) -gt $received ]] && break
  nap 0.1
done
[[ $(hcount 2 ts-s msgs_received) -gt $received ]] || miss "the stream did not go on after the attacks"
kill -USR1 "$cli_proc" 2>/dev/null || miss "the stream's client is gone"
finish_stream ts "$cli" "$srv" 30
log "ts: $STREAM_RESULT on both ends"
{ kill -0 "${HOSTS_BACKEND_PID[1]}" && kill -0 "${HOSTS_BACKEND_PID[2]}"; } || fail "a backend died"
trust_done
