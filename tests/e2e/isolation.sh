#!/usr/bin/env bash
# Two guests on one backend at once: each runs its own ibv_rc_pingpong pair; all four finish and
# the backend shows two guests with distinct LIDs while they run.
# Usage: isolation.sh BIN_DIR
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

iters=20000
start_server a guest-a -n "$iters"
a_srv=$SERVER_PID a_port=$PORT
start_server b guest-b -n "$iters"
b_srv=$SERVER_PID b_port=$PORT

# Both servers have their QPs before they listen: the two guests exist now.
wait_status 'scalar grep { $_->{guest} =~ /^guest-[ab]$/ && $_->{resources}{qp} >= 1 } @{$j->{guests}}' 2 ||
  fail "status does not show guest-a and guest-b with a QP each: $(status_json)"
lids="$(status_query 'join " ", map { $_->{lid} } grep { $_->{guest} =~ /^guest-[ab]$/ } @{$j->{guests}}')"
read -r lid_a lid_b <<<"$lids"
[[ -n $lid_a && -n $lid_b ]] || fail "no lids in status: $(status_json)"
[[ $lid_a != "$lid_b" ]] || fail "guest-a and guest-b share lid $lid_a"
[[ $lid_a != 0 && $lid_b != 0 ]] || fail "a guest has lid 0: $lids"
log "guest lids: $lids"

start_client a guest-a "$a_port" -n "$iters"
a_cli=$CLIENT_PID
start_client b guest-b "$b_port" -n "$iters"
b_cli=$CLIENT_PID

# While they run (if they still do), status still shows both guests with their own QPs.
guests_now="$(status_query 'scalar grep { $_->{guest} =~ /^guest-[ab]$/ } @{$j->{guests}}')" || true
log "guests while the clients run: ${guests_now:-?}"

finish_pair a "$a_srv" "$a_cli" 90
finish_pair b "$b_srv" "$b_cli" 30

wait_status '$j->{totals}{qp}' 0 10 || fail "QPs left after both pairs: $(status_json)"
e2e_pass
