# Shared helpers for the security tests (ctest label `security`): attacks by a second, real uid
# on one backend, as the README's SocketGroup/SocketMode=0660 recipe lets several users share it.
# `sec_init BIN_DIR` creates two users (VICTIM and ATTACKER, uids of their own, no home, no
# shell) in one group, and starts a root backend whose socket that group may use; `as_user USER
# CMD...` runs a command as that user against it. Users and group are removed on exit, whatever
# happened. Needs root. Sources tests/e2e/lib.sh for logging, pingpongs and clean-up.
# shellcheck shell=bash
# shellcheck source-path=SCRIPTDIR source=../e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
E2E_NAME="security.$(basename "${BASH_SOURCE[1]:-$0}" .sh)"

SEC_BIN=""
SEC_GROUP=""
SEC_NEXT_CLEANUP=""
VICTIM=""
ATTACKER=""
BACKEND_PID=""

sec_init() {
  local bin=$1
  e2e_init "$bin"
  sec_users "$bin"
  sec_backend
  share_socket "$VRDMA_SOCKET"  # the README's recipe
}

# Starts the root backend on $VRDMA_SOCKET (SEC_VRDMAD_ARGS, then ARGS) and waits for its
# socket; sets BACKEND_PID. SEC_VRDMAD_LOG=debug: it logs at that level (what a test greps may be
# a debug line). Usage: sec_backend [ARGS...]
sec_backend() {
  local k
  ${SEC_VRDMAD_LOG:+env VRDMA_LOG=$SEC_VRDMAD_LOG} \
    "$SEC_BIN/vrdmad" --socket "$VRDMA_SOCKET" --idle-exit 0 ${SEC_VRDMAD_ARGS:-} "$@" \
    >>"$E2E_TMP/vrdmad.log" 2>&1 &
  BACKEND_PID=$!
  for ((k = 0; k < 100; k++)); do
    [[ -S $VRDMA_SOCKET ]] && break
    nap 0.1
  done
  [[ -S $VRDMA_SOCKET ]] || fail "the backend did not start: $(tail -n 5 "$E2E_TMP/vrdmad.log")"
}

# Creates the users and their group (after e2e_init or hosts_init: their clean-up runs after
# ours) and lets them into our temp dir. Usage: sec_users BIN_DIR
sec_users() {
  local rid u
  SEC_BIN="$(cd "$1" && pwd)"
  [[ $(id -u) == 0 ]] || fail "needs root (it creates users)"
  # Short names (useradd allows 32 bytes): a run id, so parallel tests do not collide.
  rid="$(printf '%05x' $(((RANDOM << 5 ^ $$) & 0xfffff)))"
  SEC_GROUP="vrsec$rid" VICTIM="vrsec${rid}v" ATTACKER="vrsec${rid}a"
  SEC_NEXT_CLEANUP="$(trap -p EXIT | sed -n "s/^trap -- '\([a-z_]*\)' EXIT$/\1/p")"
  trap sec_cleanup EXIT
  groupadd "$SEC_GROUP" || fail "groupadd"
  for u in "$VICTIM" "$ATTACKER"; do
    useradd --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin -g "$SEC_GROUP" "$u" ||
      fail "useradd $u"
  done
  log "users $VICTIM ($(id -u "$VICTIM")) and $ATTACKER ($(id -u "$ATTACKER")), group $SEC_GROUP"
  # The users reach the sockets through our temp dir, and write their outputs into it.
  chmod 0711 "$E2E_TMP"
  mkdir -m 0777 "$E2E_TMP/out"
}

# Lets the group use the backend socket SOCK, as SocketGroup=/SocketMode=0660 would.
share_socket() {
  chgrp "$SEC_GROUP" "$1"
  chmod 0660 "$1"
}

# Runs CMD as USER: its uid, its group, no other privilege. setpriv execs (runuser forks), so a
# background `become ... &` is CMD's own pid, as the e2e helpers expect. Usage: become USER CMD...
become() {
  become_argv "$1"
  shift
  "${BECOME[@]}" "$@"
}
# Sets BECOME to the command words that run what follows as USER (for `ip netns exec`, which
# cannot run a shell function). Usage: become_argv USER
become_argv() { BECOME=(setpriv --reuid="$1" --regid="$(id -g "$1")" --init-groups --); }

# Runs CMD as USER on our backend; the library may not start another one.
# Usage: as_user USER CMD...
as_user() {
  local u=$1
  shift
  become "$u" env VRDMA_SOCKET="$VRDMA_SOCKET" VRDMA_BACKEND=/nonexistent-vrdmad \
    ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} ${LSAN_OPTIONS:+LSAN_OPTIONS=$LSAN_OPTIONS} \
    "$@"
}
# `vrdma run` as USER: Usage: vrun_as USER [--guest G] -- CMD...
vrun_as() {
  local u=$1
  shift
  as_user "$u" "$SEC_BIN/vrdma" run "$@"
}

# Fails unless the backend is alive and serves a new ibv_rc_pingpong pair (root's guests).
backend_serves() {
  kill -0 "$BACKEND_PID" 2>/dev/null || fail "the backend died: $(tail -n 20 "$E2E_TMP/vrdmad.log")"
  run_pair "after-$1" sec-after-s sec-after-c -n 200
}

sec_cleanup() {
  local rc=$? u
  set +e
  kill_descendants $$
  for u in "$ATTACKER" "$VICTIM"; do
    [[ -n $u ]] || continue
    del_user "$u"
  done
  [[ -n $SEC_GROUP ]] && groupdel "$SEC_GROUP" 2>/dev/null
  (exit "$rc")
  "${SEC_NEXT_CLEANUP:-e2e_cleanup}"
}

# stream_start (tests/e2e/lib.sh) as USER: an open-ended, verifying rc_stream between USER's
# guests NAME-s and NAME-c, until `kill -USR1 "$cli_proc"`; finish_stream NAME "$cli" "$srv" then
# checks that both ends moved the same bytes. Sets srv, cli and cli_proc as stream_start does.
# Usage: sec_stream_start USER NAME [SIZE]
sec_stream_start() {
  pp_as "$1"
  stream_start "$2" "${3:-4096}"
}

# The msgs_sent counter of the QPs of GUEST, as root sees it (the admin's whole view).
# Usage: guest_sent GUEST
guest_sent() {
  status_query 'my ($g) = grep { $_->{guest} eq "'"$1"'" } @{$j->{guest_counters}};
    $g ? $g->{counters}{msgs_sent} : -1'
}

# Waits until GUEST's QPs have sent more than N messages (the stream moves on). Usage:
# wait_sent_above GUEST N
wait_sent_above() {
  wait_status 'my ($g) = grep { $_->{guest} eq "'"$1"'" } @{$j->{guest_counters}};
    $g && $g->{counters}{msgs_sent} > '"$2"' ? "moving" : "stuck"' moving 30 ||
    fail "$1: the stream made no progress past $2 messages"
}

# Fails unless the backend's log has a line matching the extended regex PATTERN.
# Usage: logged PATTERN WHAT
logged() {
  grep -Eq -- "$1" "$E2E_TMP/vrdmad.log" ||
    fail "no log line for $2 (wanted /$1/): $(tail -n 10 "$E2E_TMP/vrdmad.log")"
}

# Makes start_server/start_client/run_pair run their programs as USER (`root`: as this shell).
# Usage: pp_as USER
pp_as() {
  if [[ $1 == root ]]; then
    VRUN=("$SEC_BIN/vrdma" run)
    [[ -z $SAN_PRELOAD ]] || VRUN=(env "LD_PRELOAD=$SAN_PRELOAD" "$SEC_BIN/vrdma" run)
  else
    VRUN=(vrun_as "$1")
  fi
}
