# Shared by the trust tests (trust_*.sh, issue 20): the attacker program (net_attacker) run on a
# host, the TCP transport's security fields in a backend's status, and checks that record what
# they missed and let the test go on, so one run reports every point of the contract it misses.
# Every trust test is pinned to the backends' TCP transport (--no-direct-remote): the attacker
# targets the backends' port and the stream's PSNs there (security.direct_hub covers the
# libraries' own port).
# shellcheck shell=bash
# shellcheck source-path=SCRIPTDIR source=lib.sh
# shellcheck disable=SC2016  # Perl expressions in single quotes
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"
E2E_NAME="hosts.$(basename "${BASH_SOURCE[1]:-$0}" .sh)"

declare -a TRUST_MISSED=()
# Records a check that did not hold; trust_done fails the test with all of them.
miss() {
  log "MISSED: $*"
  TRUST_MISSED+=("$*")
}
trust_done() {
  ((${#TRUST_MISSED[@]} == 0)) || fail "${#TRUST_MISSED[@]} check(s) missed: $(printf '[%s] ' "${TRUST_MISSED[@]}")"
  e2e_pass
}

# A field of the "tcp" entry of host I's status `transports`, as a Perl path ('{security}',
# '{refused}{name}'); empty when absent. Usage: htcp I PATH
htcp() {
  hstatus_query "$1" "my (\$t) = grep { \$_->{name} eq 'tcp' } @{\$j->{backend}{transports}}; \$t->$2"
}
# Host I's tcp transport reports SECURITY ("tls" or "insecure"). Usage: expect_security I SECURITY
expect_security() {
  local got
  got="$(htcp "$1" '{security}')"
  [[ $got == "$2" ]] || miss "h$1's status: tcp security '$got', wanted '$2'"
}
# Host I's counter refused.NAME is above 0. Usage: expect_refused I NAME
expect_refused() {
  local got
  got="$(htcp "$1" "{refused}{$2}")"
  [[ $got =~ ^[0-9]+$ && $got -gt 0 ]] || miss "h$1's status: refused.$2 is '$got', wanted > 0"
}
# Host I's backend log gets a line matching the extended regex RE within 5 s (WHAT: for the
# report). Usage: expect_log I WHAT RE
expect_log() {
  local k
  for ((k = 0; k < 50; k++)); do
    grep -qE -- "$3" "$E2E_TMP/vrdmad.h$1.log" && return 0
    nap 0.1
  done
  miss "h$1's log has no line for $2 (/$3/)"
}
# An extended regex matching ADDR (an IPv4 address, with or without :port) literally.
re_of() { echo "${1//./\\.}"; }

# Runs net_attacker on host I: the JSON line it prints goes to $E2E_TMP/NAME.attack.out.
# Usage: attack NAME I ARGS...
attack() {
  local name=$1 i=$2
  shift 2
  hexec "$i" "$HOSTS_BIN/net_attacker" "$@" >"$E2E_TMP/$name.attack.out" 2>&1 ||
    fail "$name: net_attacker: $(tail -n 3 "$E2E_TMP/$name.attack.out")"
  log "$name: $(tail -n 1 "$E2E_TMP/$name.attack.out")"
}
# A Perl expression over attack NAME's JSON ($a); prints the result. Usage: attack_field NAME EXPR
attack_field() {
  tail -n 1 "$E2E_TMP/$1.attack.out" | EXPR="$2" perl -MJSON::PP -0777 -ne '
    my $a = decode_json($_);
    my $r = eval $ENV{EXPR}; die $@ if $@;
    print((defined $r ? $r : ""), "\n");'
}
# Attack NAME received no frame of any of TYPES (hello, guest_up, request, reply, ...).
# Usage: expect_no_frames NAME TYPE...
expect_no_frames() {
  local name=$1 t n
  shift
  for t in "$@"; do
    n="$(attack_field "$name" "\$a->{frames}{$t} // 0")"
    [[ $n == 0 ]] || miss "$name: the attacker received $n $t frame(s)"
  done
}

# "guest/qpn=transport/peer_node" for every QP of host I, sorted: what an attack must not move.
qp_routes() {
  hstatus_query "$1" 'join " ", sort map { my $g = $_; map {
    "$g->{guest}/$_->{qpn}=$_->{transport}/$_->{peer_node}" } @{$g->{qps}} } @{$j->{guests}}'
}
# "LID GID QPN" of guest G on host I (its first QP), from the status. Usage: guest_ids I G
guest_ids() {
  hstatus_query "$1" "my (\$g) = grep { \$_->{guest} eq '$2' } @{\$j->{guests}};
    \$g ? \"\$g->{lid} \$g->{gid} \$g->{qps}[0]{qpn}\" : ''"
}
