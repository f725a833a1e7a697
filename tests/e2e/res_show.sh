#!/usr/bin/env bash
# `vrdma res show` and `vrdma stat` while an unmodified ibv_rc_pingpong pair runs: both QPs are
# listed in RTS with their transport, connected to each other, owned by the right guest, pid and
# comm; the JSON parses (JSON::PP, a strict parser); filters select; counters grow between two
# reads; text output gives LIDs and QPNs in 0x hex (as the log lines) and sizes in KiB/MiB/GiB
# where JSON keeps numbers and bytes; after the pair is killed the backend lists nothing.
# Usage: res_show.sh BIN_DIR
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
# The mediated path's report (transport "shm", the backend's counters): pinned to it, the
# direct path being the default (the backend the library starts inherits this).
export VRDMA_DIRECT_PATH=0

# Evaluates a Perl expression over the JSON a vrdma command prints ($j). Usage: jq_of EXPR CMD...
jq_of() {
  local expr=$1 out
  shift
  out="$("$VRDMA" "$@")" || return 1
  printf '%s' "$out" | EXPR="$expr" perl -MJSON::PP -0777 -ne '
    my $j = JSON::PP->new->decode($_);
    my $r = eval $ENV{EXPR}; die $@ if $@;
    print((defined $r ? $r : ""), "\n");'
}

# Runs until the test kills it below.
start_server pp rs-srv -n "$PP_UNTIL_STOPPED"
start_client pp rs-cli "$PORT" -n "$PP_UNTIL_STOPPED"

# Both QPs reach RTS (the client's after the exchange of addresses).
rts='scalar grep { $_->{state} eq "RTS" } @$j'
for ((i = 0; i < 300; i++)); do
  [[ "$(jq_of "$rts" res show qp -j 2>/dev/null)" == 2 ]] && break
  kill -0 "$CLIENT_PID" 2>/dev/null || fail "client exited: $(cat "$E2E_TMP/pp.client.out")"
  nap 0.1
done
"$VRDMA" res show qp -j >"$E2E_TMP/qp.json"
[[ "$(jq_of "$rts" res show qp -j)" == 2 ]] || fail "not two QPs in RTS: $(cat "$E2E_TMP/qp.json")"

# Each QP: its guest, the pid and comm of the process that owns it, RC, a transport and why,
# and its dest_qpn is the other one's qpn.
for g in rs-srv rs-cli; do
  row="$(jq_of 'my ($q) = @$j; join "|", $q->{guest}, $q->{type}, $q->{state}, $q->{transport},
                $q->{transport_why}, $q->{comm}, $q->{pid}, $q->{qpn}, $q->{dest_qpn}' \
    res show qp guest "$g" -j)"
  IFS='|' read -r guest type state transport why comm pid lqpn rqpn <<<"$row"
  [[ $guest == "$g" && $type == RC && $state == RTS ]] || fail "$g: $row"
  [[ $transport == shm && -n $why ]] || fail "$g: transport '$transport' ($why)"
  [[ $comm == ibv_rc_pingpong ]] || fail "$g: comm '$comm'"
  want_pid=$SERVER_PID
  [[ $g == rs-cli ]] && want_pid=$CLIENT_PID
  [[ $pid == "$want_pid" ]] || fail "$g: pid $pid, the pingpong is $want_pid"
  declare "lqpn_${g#rs-}=$lqpn" "rqpn_${g#rs-}=$rqpn"
done
# shellcheck disable=SC2154  # set by declare above
{
  [[ $rqpn_srv == "$lqpn_cli" && $rqpn_cli == "$lqpn_srv" ]] ||
    fail "QPs not connected to each other: srv $lqpn_srv->$rqpn_srv, cli $lqpn_cli->$rqpn_cli"
  # Filters: by qpn (decimal and hex, and by iproute2's name lqpn) within a guest; a guest that
  # does not exist lists none.
  [[ "$(jq_of 'scalar @$j' res show qp guest rs-srv qpn "$lqpn_srv" -j)" == 1 ]] || fail "qpn filter"
  [[ "$(jq_of 'scalar @$j' res show qp lqpn "$(printf '0x%x' "$lqpn_srv")" guest rs-srv -j)" == 1 ]] ||
    fail "hex lqpn filter"
}
[[ "$(jq_of 'scalar @$j' res show qp guest nobody -j)" == 0 ]] || fail "guest filter"

# The other resources of each pingpong: one PD, one MR (the buffer), one CQ.
for t in pd mr cq; do
  [[ "$(jq_of 'scalar @$j' res show "$t" guest rs-srv -j)" == 1 ]] || fail "res show $t guest rs-srv"
done
[[ "$(jq_of 'scalar @$j' res show srq -j)" == 0 ]] || fail "an SRQ appeared"
[[ "$(jq_of '$j->[0]{mrlen} >= 4096 ? "ok" : "small"' res show mr guest rs-cli -j)" == ok ]] ||
  fail "MR length"

# Text forms, as iproute2 prints them (-d: with the transport's reason).
"$VRDMA" res show qp -d >"$E2E_TMP/qp.txt"
[[ "$(grep -c 'state RTS' "$E2E_TMP/qp.txt")" == 2 ]] || fail "text: $(cat "$E2E_TMP/qp.txt")"
# shellcheck disable=SC2154  # set by declare above
grep -q "guest rs-srv qpn $(printf '0x%x' "$lqpn_srv") dest_qpn $(printf '0x%x' "$rqpn_srv") type RC state RTS .*transport shm (.*) pid [0-9]* comm ibv_rc_pingpong" \
  "$E2E_TMP/qp.txt" || fail "text line: $(cat "$E2E_TMP/qp.txt")"
"$VRDMA" res show >"$E2E_TMP/res.txt"
lid_srv="$(jq_of 'my ($g) = grep { $_->{guest} eq "rs-srv" } @{$j->{guests}}; $g->{lid}' status -j)"
grep -q "^vrdma0 guest rs-srv lid $(printf '0x%x' "$lid_srv"): pd 1 mr 1 cq 1 srq 0 qp 1\$" \
  "$E2E_TMP/res.txt" || fail "summary (lid $lid_srv): $(cat "$E2E_TMP/res.txt")"
# The MR's length: bytes in JSON, a human size in text (ibv_rc_pingpong -s 4096 ... registers a
# page-rounded buffer).
mrlen="$(jq_of '$j->[0]{mrlen}' res show mr guest rs-cli -j)"
"$VRDMA" res show mr guest rs-cli >"$E2E_TMP/mr.txt"
human="$(perl -e 'my ($n, $u) = (shift, 0); my @u = qw(B KiB MiB GiB TiB);
  while ($u < $#u && $n >= 1024 ** ($u + 1)) { $u++ }
  print $u == 0 ? "${n}B" : $n % 1024 ** $u ? sprintf("%.1f%s", $n / 1024 ** $u, $u[$u])
                                        : ($n / 1024 ** $u) . $u[$u]' "$mrlen")"
grep -q " mrlen $human " "$E2E_TMP/mr.txt" || fail "mrlen $mrlen is not '$human': $(cat "$E2E_TMP/mr.txt")"
[[ $human == *iB ]] || fail "MR of $mrlen bytes shown as $human"

# Bad arguments are usage errors, with the valid choices.
rc=0
"$VRDMA" res show qp lqpm 17 2>"$E2E_TMP/bad.err" || rc=$?
[[ $rc == 2 ]] && grep -q 'unknown filter "lqpm"; valid: guest, qpn, dest_qpn' "$E2E_TMP/bad.err" ||
  fail "typo in a filter: rc $rc, $(cat "$E2E_TMP/bad.err")"
rc=0
"$VRDMA" res show qp guest 2>"$E2E_TMP/bad.err" || rc=$?
[[ $rc == 2 ]] && grep -q 'filter "guest" has no value' "$E2E_TMP/bad.err" ||
  fail "filter without a value: rc $rc, $(cat "$E2E_TMP/bad.err")"

# Counters grow between two reads, per QP and per guest.
sent='join " ", map { "$_->{guest}=$_->{msgs_sent}/$_->{bytes_sent}" } sort { $a->{guest} cmp $b->{guest} } @{$j->{qp}}'
first="$(jq_of "$sent" stat qp -j)"
sleep 1
second="$(jq_of "$sent" stat qp -j)"
log "counters: $first -> $second"
for g in rs-cli rs-srv; do
  a="$(tr ' ' '\n' <<<"$first" | sed -n "s/^$g=//p")"
  b="$(tr ' ' '\n' <<<"$second" | sed -n "s/^$g=//p")"
  ((${a%/*} > 0 && ${b%/*} > ${a%/*} && ${b#*/} > ${a#*/})) || fail "$g: counters $a -> $b"
done
gsum="$(jq_of 'my ($g) = grep { $_->{guest} eq "rs-cli" } @{$j->{guest}}; $g->{msgs_received}' stat -j)"
((gsum > 0)) || fail "per-guest sum of rs-cli is '$gsum'"
"$VRDMA" stat >"$E2E_TMP/stat.txt"
grep -Eq "^rs-cli +$(printf '0x%x' "$lqpn_cli") RC +shm +[1-9][0-9]* " "$E2E_TMP/stat.txt" ||
  fail "stat: $(cat "$E2E_TMP/stat.txt")"

# `vrdma status` shows the backend, transports, the data-path thread and quotas.
"$VRDMA" status >"$E2E_TMP/status.txt"
for re in '^backend: .*\(vrdmad [0-9.]+, pid [0-9]+, node .*, up [0-9]' '^transports: shm up' \
  '^datapath: 1 thread, busy [0-9.]+%' '^quotas per guest .*qp 1/[0-9]+' \
  '^quotas per guest .*, mr bytes [0-9.]+[KMGT]?i?B/[0-9.]+[KMGT]iB, segment [0-9]+/[0-9]+, segment bytes [0-9.]+[KMGT]?i?B/[0-9.]+[KMGT]iB;' \
  '^mapped bytes .*: [0-9.]+[KMGT]?i?B/[0-9.]+[KMGT]iB$' "^rs-srv +$(printf '0x%x' "$lid_srv") "; do
  grep -Eq "$re" "$E2E_TMP/status.txt" || fail "status has no /$re/: $(cat "$E2E_TMP/status.txt")"
done

# The pair dies; the backend reclaims everything and lists nothing.
kill -KILL "$CLIENT_PID" "$SERVER_PID" 2>/dev/null || true
wait "$CLIENT_PID" "$SERVER_PID" 2>/dev/null || true
for ((i = 0; i < 100; i++)); do
  [[ "$(jq_of 'scalar @$j' res show qp -j)" == 0 ]] && break
  nap 0.1
done
[[ "$(jq_of 'scalar @$j' res show qp -j)" == 0 ]] || fail "QPs left after the pair died"
e2e_pass
