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
VICTIM=""
ATTACKER=""
BACKEND_PID=""

sec_init() {
  local bin=$1 rid k
  e2e_init "$bin"
  SEC_BIN="$(cd "$bin" && pwd)"
  [[ $(id -u) == 0 ]] || fail "needs root (it creates users)"
  # Short names (useradd allows 32 bytes): a run id, so parallel tests do not collide.
  rid="$(printf '%05x' $(((RANDOM << 5 ^ $$) & 0xfffff)))"
  SEC_GROUP="vrsec$rid" VICTIM="vrsec${rid}v" ATTACKER="vrsec${rid}a"
  trap sec_cleanup EXIT
  groupadd "$SEC_GROUP" || fail "groupadd"
  for u in "$VICTIM" "$ATTACKER"; do
    useradd --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin -g "$SEC_GROUP" "$u" ||
      fail "useradd $u"
  done
  log "users $VICTIM ($(id -u "$VICTIM")) and $ATTACKER ($(id -u "$ATTACKER")), group $SEC_GROUP"
  # The users reach the socket through our temp dir, and write their outputs into it.
  chmod 0711 "$E2E_TMP"
  mkdir -m 0777 "$E2E_TMP/out"
  # SEC_VRDMAD_LOG=debug: the backend logs at that level (what a test greps may be a debug line).
  ${SEC_VRDMAD_LOG:+env VRDMA_LOG=$SEC_VRDMAD_LOG} \
    "$SEC_BIN/vrdmad" --socket "$VRDMA_SOCKET" --idle-exit 0 ${SEC_VRDMAD_ARGS:-} \
    >>"$E2E_TMP/vrdmad.log" 2>&1 &
  BACKEND_PID=$!
  for ((k = 0; k < 100; k++)); do
    [[ -S $VRDMA_SOCKET ]] && break
    nap 0.1
  done
  [[ -S $VRDMA_SOCKET ]] || fail "the backend did not start: $(tail -n 5 "$E2E_TMP/vrdmad.log")"
  # The README's recipe: SocketGroup=GROUP, SocketMode=0660.
  chgrp "$SEC_GROUP" "$VRDMA_SOCKET"
  chmod 0660 "$VRDMA_SOCKET"
}

# Runs CMD as USER (its own uid and group, no other privilege) on our backend; the library may
# not start another one. Usage: as_user USER CMD...
as_user() {
  local u=$1
  shift
  runuser -u "$u" -- env VRDMA_SOCKET="$VRDMA_SOCKET" VRDMA_BACKEND=/nonexistent-vrdmad \
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
    pkill -KILL -u "$u" 2>/dev/null
    userdel "$u" 2>/dev/null
  done
  [[ -n $SEC_GROUP ]] && groupdel "$SEC_GROUP" 2>/dev/null
  (exit "$rc")
  e2e_cleanup
}

# Pid of USER's process whose command line matches the extended regex PATTERN, once it runs
# (up to 10 s). Usage: user_proc USER PATTERN
user_proc() {
  local k p
  for ((k = 0; k < 100; k++)); do
    p="$(pgrep -u "$1" -f -- "$2" | head -n 1)" && [[ -n $p ]] && {
      echo "$p"
      return 0
    }
    nap 0.1
  done
  fail "no process of $1 matches '$2'"
}

# stream_start (tests/e2e/lib.sh) as USER: an open-ended, verifying rc_stream between USER's
# guests NAME-s and NAME-c, until `kill -USR1 "$cli_proc"`; finish_stream NAME "$cli" "$srv" then
# checks that both ends moved the same bytes. Sets srv, cli and cli_proc as stream_start does.
# Usage: sec_stream_start USER NAME [SIZE]
sec_stream_start() {
  local u=$1 name=$2 size=${3:-4096} port i
  pp_as "$u"
  port="$(free_port)"
  vrun --guest "$name-s" -- "$SEC_BIN/rc_stream" server "$port" 0 "$size" \
    >"$E2E_TMP/$name.server.out" 2>&1 &
  srv=$!
  for ((i = 0; i < 200; i++)); do
    port_in_use "$port" && break
    kill -0 "$srv" 2>/dev/null || fail "$name: server died: $(cat "$E2E_TMP/$name.server.out")"
    nap 0.1
  done
  vrun --guest "$name-c" -- "$SEC_BIN/rc_stream" client 127.0.0.1 "$port" 0 "$size" \
    >"$E2E_TMP/$name.client.out" 2>&1 &
  cli=$!
  # runuser forks (it closes a PAM session after), so the client is not a child of $cli.
  cli_proc=$(user_proc "$u" "rc_stream client 127\\.0\\.0\\.1 $port ")
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
