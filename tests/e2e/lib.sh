# Shared helpers for the end-to-end tests: each test sources this file and calls
# `e2e_init BIN_DIR` (the directory holding `vrdma`). The test then owns a private temp dir and
# a private backend socket ($VRDMA_SOCKET); on exit every process it started, and the backend
# serving its socket, are killed, and on failure the logs are printed.
# shellcheck shell=bash

set -euo pipefail

E2E_NAME="$(basename "${BASH_SOURCE[1]:-$0}" .sh)"
E2E_TMP=""
E2E_OK=0
E2E_NAP_FD=""
VRDMA=""
VRUN=()

log() { echo "[$E2E_NAME $(date +%T.%3N)] $*" >&2; }
fail() {
  log "FAIL: $*"
  exit 1
}

# True when the binaries under test are built with AddressSanitizer (the asan-ubsan preset): a
# test may then do less of what only adds volume.
under_asan() { ldd "$(dirname "$VRDMA")/vrdmad" 2>/dev/null | grep -q libasan; }

e2e_init() {
  local bin_dir="${1:?usage: $0 BIN_DIR (the directory holding vrdma)}"
  bin_dir="$(cd "$bin_dir" && pwd)"
  VRDMA="$bin_dir/vrdma"
  # E2E_NO_CLI=1: the test runs vrdmad and the library only (conformance_remote, which the tsan
  # preset runs without building the CLI).
  [[ -x $VRDMA || -n ${E2E_NO_CLI:-} ]] || fail "$VRDMA is not executable"
  [[ -x $bin_dir/vrdmad ]] || fail "$bin_dir/vrdmad is not executable"
  [[ -e $bin_dir/../lib/libibverbs.so.1 ]] || fail "$bin_dir/../lib/libibverbs.so.1 missing"
  E2E_TMP="$(mktemp -d "${TMPDIR:-/tmp}/vrdma-e2e-$E2E_NAME.XXXXXX")"
  # What `nap` waits on: a FIFO nothing writes to.
  mkfifo "$E2E_TMP/nap"
  exec {E2E_NAP_FD}<>"$E2E_TMP/nap"
  export VRDMA_SOCKET="$E2E_TMP/vrdmad.sock"
  unset VRDMA_GUEST
  # A test that sets its own EXIT trap must call e2e_cleanup (or hosts_cleanup, sec_cleanup)
  # from it after `set +e`: under errexit a `(exit $rc)` there ends the trap, and the programs,
  # the backend and the deadline's sleeper below (which holds ctest's pipe open) outlive it.
  trap e2e_cleanup EXIT
  trap 'log "interrupted"; exit 130' INT TERM
  # Our own deadline, under ctest's TIMEOUT (120 s): ctest would SIGKILL us and skip the cleanup,
  # leaving busy-polling programs and the backend behind.
  (
    sleep "${E2E_DEADLINE:-105}"
    kill -TERM $$ 2>/dev/null
  ) &

  # A sanitized libibverbs.so.1 inside an uninstrumented program (ibv_rc_pingpong) needs the
  # sanitizer runtime loaded first.
  VRUN=("$VRDMA" run)
  SAN_PRELOAD=""
  local rt
  rt="$(ldd "$bin_dir/../lib/libibverbs.so.1" 2>/dev/null |
    awk '/lib(a|t)san\.so/ {print $3; exit}')" || true
  if [[ -n $rt ]]; then
    log "sanitized build: preloading $rt into programs run through vrdma"
    VRUN=(env "LD_PRELOAD=$rt${LD_PRELOAD:+:$LD_PRELOAD}" "$VRDMA" run)
    SAN_PRELOAD="$rt"  # for tests that load the library without `vrdma run`
    # Debian's tools do not free everything before they exit (perftest leaks its own buffers and
    # a CQ): leaks whose stack passes through /usr/bin are theirs, and so is perftest's asprintf
    # (its stack cannot be unwound; vrdma never calls asprintf). The backend's are still ours.
    printf 'leak:/usr/bin/\nleak:vasprintf\n' >"$E2E_TMP/lsan.supp"
    export LSAN_OPTIONS="${LSAN_OPTIONS:+$LSAN_OPTIONS:}suppressions=$E2E_TMP/lsan.supp"
    # Their signal handlers are theirs too: perftest's -D ends with a SIGALRM handler that calls
    # fopen/printf (ThreadSanitizer: "signal-unsafe call", "signal handler spoils errno").
    printf 'signal:/usr/bin/\n' >"$E2E_TMP/tsan.supp"
    export TSAN_OPTIONS="${TSAN_OPTIONS:+$TSAN_OPTIONS:}suppressions=$E2E_TMP/tsan.supp"
  fi
  log "tmp $E2E_TMP, socket $VRDMA_SOCKET"
}

# Sleeps SECS (fractions allowed) without starting a process. The polling loops call it while
# the programs under test run: a `sleep` per poll is a fork and an exec, which on this 2-vCPU VM
# took ~6% of the CPUs from the busy-polling programs being measured (an 8 B ibv_rc_pingpong
# across hosts went from 20.0 to 18.2 µs per round trip without them).
nap() {
  if [[ -n ${E2E_NAP_FD:-} ]]; then
    read -r -t "$1" -u "$E2E_NAP_FD" _ || true
  else
    sleep "$1"
  fi
}

# Marks the test passed (call last); the cleanup prints logs for anything else.
e2e_pass() {
  E2E_OK=1
  log "PASS"
}

# Kills every process of USER and waits (10 s at most) until none is left: userdel refuses a user
# with a live process, and a SIGKILL is not finished when kill(2) returns. A process that is our
# own child stays a zombie of that uid until we reap it. Usage: kill_user USER
kill_user() {
  local i p
  for ((i = 0; i < 100; i++)); do
    pkill -KILL -u "$1" 2>/dev/null || return 0
    for p in $(pgrep -u "$1"); do wait "$p" 2>/dev/null; done
    pgrep -u "$1" >/dev/null || return 0
    sleep 0.1
  done
}

# Removes USER after kill_user. A process of USER that outlives it (a zombie whose parent does
# not reap, such as a daemonized backend's under a PID 1 that reaps nothing) makes userdel refuse:
# then it is removed with -f, and the log names what was left. Usage: del_user USER
del_user() {
  kill_user "$1"
  userdel "$1" 2>/dev/null && return
  log "cleanup: $1 still has processes: $(ps -o pid=,stat=,comm= -u "$1" | tr '\n' ';'); userdel -f"
  userdel -f "$1" 2>/dev/null || log "cleanup: userdel -f $1 failed"
}

# Kills the descendants of PID (depth first), not PID itself. Only our own process tree.
kill_descendants() {
  local pid=$1 child
  for child in $(pgrep -P "$pid" 2>/dev/null || true); do
    kill_descendants "$child"
    kill -KILL "$child" 2>/dev/null || true
  done
}

# Pid of the backend serving $VRDMA_SOCKET (started detached by `vrdma run` or the library),
# found by its command line (our socket path is unique); empty if none.
backend_pid() {
  local re
  # shellcheck disable=SC2001  # escaping every regex metacharacter
  re="vrdmad --socket $(sed 's/[][\\.*^$+?(){}|]/\\&/g' <<<"$VRDMA_SOCKET")( |\$)"
  pgrep -f -- "$re" | head -n 1 || true
}

# Starts a backend with --keep-state (and ARGS) on $VRDMA_SOCKET, logging to vrdmad.log, and
# waits up to 10 s for its keeper's socket. Usage: start_kept_backend [ARGS...]
start_kept_backend() {
  local i
  "$(dirname "$VRDMA")/vrdmad" --socket "$VRDMA_SOCKET" --idle-exit 0 --keep-state "$@" \
    >>"$E2E_TMP/vrdmad.log" 2>&1 &
  for ((i = 0; i < 100; i++)); do [[ -S $VRDMA_SOCKET.keeper ]] && return 0; sleep 0.1; done
  fail "no keeper socket beside the backend's"
}

# Kills the backend serving $VRDMA_SOCKET with SIGKILL and waits up to 5 s for its keeper
# (`--keep-state`) to start a new one. Sets KILLED and RESTARTED (their pids).
kill_kept_backend() {
  local i
  KILLED="$(backend_pid)"
  [[ -n $KILLED ]] || fail "no backend to kill"
  kill -KILL "$KILLED"
  for ((i = 0; i < 100; i++)); do
    RESTARTED="$(backend_pid)"
    [[ -n $RESTARTED && $RESTARTED != "$KILLED" ]] && return 0
    nap 0.05
  done
  fail "the keeper did not start a new backend after $KILLED was killed"
}

# Waits up to 5 s for the keeper's new backend to log N guests restored from the keeper.
# Usage: wait_restored N
wait_restored() {
  local i
  for ((i = 0; i < 100; i++)); do
    [[ $(grep -c 'restored from the keeper' "$E2E_TMP/vrdmad.log") -ge $1 ]] && return 0
    nap 0.05
  done
  fail "the new backend did not restore $1 guest(s): $(tail -n 5 "$E2E_TMP/vrdmad.log")"
}

e2e_cleanup() {
  local rc=$? pid i f
  trap - EXIT
  set +e
  kill_descendants $$
  if [[ -n $E2E_TMP ]]; then
    pid="$(backend_pid)"
    if [[ -n $pid ]]; then
      kill -TERM "$pid" 2>/dev/null
      # `sleep`, not nap: bash's `read -t` in an EXIT trap that a TERM started has aborted bash
      # itself ("longjmp causes uninitialized stack frame"), skipping the rest of the clean-up.
      for ((i = 0; i < 30; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      kill -KILL "$pid" 2>/dev/null
    fi
    # Sanitizer reports of the backend or of our library inside the programs fail the test.
    f="$(grep -lE 'ERROR: (Address|Leak|Thread)Sanitizer|WARNING: ThreadSanitizer|runtime error:' \
      "$E2E_TMP"/*.out "$E2E_TMP"/vrdmad.log 2>/dev/null | head -n 1)"
    if [[ -n $f ]]; then
      log "FAIL: sanitizer report in $(basename "$f")"
      E2E_OK=0
    fi
    if [[ $E2E_OK -ne 1 || $rc -ne 0 ]]; then
      for f in "$E2E_TMP"/*.out "$E2E_TMP"/vrdmad.log; do
        [[ -f $f ]] || continue
        echo "----- $f (last 40 lines)" >&2
        tail -n 40 "$f" >&2
      done
      [[ $rc -ne 0 ]] || rc=1
    fi
    if [[ -n ${E2E_KEEP:-} ]]; then
      log "kept $E2E_TMP"
    else
      rm -rf "$E2E_TMP"
    fi
  fi
  exit "$rc"
}

# Runs a command through `vrdma run` in the foreground. Usage: vrun [--guest G] -- CMD ARGS...
vrun() { "${VRUN[@]}" "$@"; }

# Status JSON of our backend.
status_json() { "$VRDMA" status --json; }

# Evaluates a Perl expression over the status JSON (decoded into $j) and prints the result.
# Example: status_query 'scalar @{$j->{guests}}'. The expression travels in the environment.
status_query() {
  local json
  json="$(status_json)" || return 1
  printf '%s' "$json" | EXPR="$1" perl -MJSON::PP -0777 -ne '
    my $j = decode_json($_);
    my $r = eval $ENV{EXPR}; die $@ if $@;
    print((defined $r ? $r : ""), "\n");'
}

# Polls `status_query EXPR` until it prints WANT or SECS pass. Returns 0 when it matched.
wait_status() {
  local expr=$1 want=$2 secs=${3:-10} got="" i
  for ((i = 0; i < secs * 10; i++)); do
    got="$(status_query "$expr" 2>/dev/null)" || got="<no status>"
    [[ $got == "$want" ]] && return 0
    nap 0.1
  done
  log "status: '$expr' is '$got', wanted '$want'"
  return 1
}

port_in_use() { [[ -n "$(ss -Htln "sport = :$1" 2>/dev/null)" ]]; }

# Waits up to 20 s until something listens on PORT; fails at once if PID (server NAME, its output
# in $E2E_TMP/NAME.server.out) exits first. Usage: wait_listen PORT PID NAME
wait_listen() {
  local k
  for ((k = 0; k < 200; k++)); do
    port_in_use "$1" && return 0
    kill -0 "$2" 2>/dev/null || fail "$3: server died: $(cat "$E2E_TMP/$3.server.out")"
    nap 0.1
  done
  fail "$3: nothing listens on port $1 after 20 s"
}

# A TCP port no socket uses, from a random range (tests may run in parallel), below the kernel's
# ephemeral range (ip_local_port_range, 32768-60999 by default): a port in it
# may be taken between this check and the server's bind by any connect() on the machine (a
# backend's dial, another test's client), and the server fails with "Couldn't listen" (perftest
# did, in CI). Free: no socket of any state has it.
free_port() {
  local p
  while :; do
    p=$((10000 + RANDOM % 22000))
    [[ -z "$(ss -Htan "sport = :$p" 2>/dev/null)" ]] && {
      echo "$p"
      return 0
    }
  done
}

# The pingpong program run_pair and start_server/start_client use; tests may set another of
# ibverbs-utils' pingpongs (ibv_uc_pingpong, ibv_ud_pingpong, ...), same options and output.
PP_TOOL="${PP_TOOL:-ibv_rc_pingpong}"

# Counter C (msgs_sent, ...) of guest G, summed over its QPs. Usage: direct_count G C
direct_count() {
  "$VRDMA" stat qp guest "$1" -j | C="$2" perl -MJSON::PP -0777 -ne \
    'my $s = 0; $s += $_->{$ENV{C}} // 0 for @{decode_json($_)->{qp}}; print $s'
}
# "SENT RECEIVED": guest G's QPs' direct_msgs_sent and direct_msgs_received, from one snapshot
# (two reads may straddle the program's end, when its QPs and their counters go). Usage:
# direct_counts G
direct_counts() {
  "$VRDMA" stat qp guest "$1" -j | perl -MJSON::PP -0777 -ne 'my ($s, $r) = (0, 0);
    for (@{decode_json($_)->{qp}}) { $s += $_->{direct_msgs_sent} // 0;
      $r += $_->{direct_msgs_received} // 0 } print "$s $r"'
}

# Runs perftest's TOOL with ARGS (a duration among them: -D N) between guests SRV and CLI
# through vrdma, and fails unless, while it ran, guest SENDER's QPs sent and guest RECEIVER's
# received over 100 messages directly (direct_count, read while the client runs: counters go
# with their QPs). Output in $E2E_TMP/NAME.{server,client}.out; logs the counts and the client's
# last result row. Usage: run_direct_tool NAME SRV CLI SENDER RECEIVER TOOL ARGS...
run_direct_tool() {
  local name=$1 srv_g=$2 cli_g=$3 sender=$4 receiver=$5 tool=$6 port srv cli row i sent=0 recv=0
  shift 6
  port="$(free_port)"
  vrun --guest "$srv_g" -- "$tool" "$@" -p "$port" >"$E2E_TMP/$name.server.out" 2>&1 &
  srv=$!
  wait_listen "$port" "$srv" "$name"
  vrun --guest "$cli_g" -- "$tool" "$@" -p "$port" localhost >"$E2E_TMP/$name.client.out" 2>&1 &
  cli=$!
  for ((i = 0; i < 200; i++)); do
    sent="$(direct_count "$sender" direct_msgs_sent)"
    recv="$(direct_count "$receiver" direct_msgs_received)"
    ((sent > 100 && recv > 100)) && break
    kill -0 "$cli" 2>/dev/null || break
    nap 0.05
  done
  wait_pid "$cli" 60
  [[ $WAIT_RC == 0 ]] || fail "$name: client exited $WAIT_RC"
  wait_pid "$srv" 20
  [[ $WAIT_RC == 0 ]] || fail "$name: server exited $WAIT_RC"
  ((sent > 100 && recv > 100)) || fail "$name: not executed directly (sent $sent, received $recv)"
  row="$(result_rows "$E2E_TMP/$name.client.out" | tail -n 1)"
  [[ -n $row ]] || fail "$name: no result row"
  log "$name: direct messages sent $sent, received $recv; $row"
}

# Starts a $PP_TOOL server through vrdma in the background and waits until it listens.
# Usage: start_server NAME GUEST [pingpong args...] (GUEST "": the default guest). Sets
# SERVER_PID and PORT.
# Output goes to $E2E_TMP/NAME.server.out.
start_server() {
  local name=$1 guest=$2 i rc
  shift 2
  local out="$E2E_TMP/$name.server.out"
  for _ in 1 2 3; do
    PORT="$(free_port)"
    "${VRUN[@]}" ${guest:+--guest "$guest"} -- "$PP_TOOL" -p "$PORT" "$@" >"$out" 2>&1 &
    SERVER_PID=$!
    for ((i = 0; i < 200; i++)); do  # 20 s
      port_in_use "$PORT" && return 0
      kill -0 "$SERVER_PID" 2>/dev/null || break
      nap 0.1
    done
    if kill -0 "$SERVER_PID" 2>/dev/null; then
      fail "$name: server (pid $SERVER_PID) did not listen on port $PORT within 20 s"
    fi
    if grep -q "Couldn't listen" "$out"; then
      log "$name: port $PORT taken, retrying"
      continue
    fi
    wait "$SERVER_PID" && rc=0 || rc=$?
    fail "$name: server exited ($rc) before listening: $(tr '\n' ' ' <"$out")"
  done
  fail "$name: could not find a free port"
}

# Starts the client of a server in the background. Usage: start_client NAME GUEST PORT [args...].
# Sets CLIENT_PID. Output goes to $E2E_TMP/NAME.client.out.
start_client() {
  local name=$1 guest=$2 port=$3
  shift 3
  "${VRUN[@]}" ${guest:+--guest "$guest"} -- "$PP_TOOL" -p "$port" "$@" localhost \
    >"$E2E_TMP/$name.client.out" 2>&1 &
  CLIENT_PID=$!
}

# Waits up to SECS for PID (a child of this shell, so not from a $(...) subshell); kills it on
# time-out. Sets WAIT_RC to its exit code (124 on time-out).
wait_pid() {
  local pid=$1 secs=$2 i
  for ((i = 0; i < secs * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    nap 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    WAIT_RC=124
    return 0
  fi
  wait "$pid" && WAIT_RC=0 || WAIT_RC=$?
}

# Pid of the child of PID (a background `hrun ... &`, a subshell) named NAME, once the exec chain
# (ip netns exec, env, vrdma run) has reached it; up to 10 s. Usage: child_named PID NAME
child_named() {
  local k c
  for ((k = 0; k < 100; k++)); do
    c="$(pgrep -P "$1" -x "$2" | head -n 1)" && [[ -n $c ]] && {
      echo "$c"
      return 0
    }
    nap 0.1
  done
  fail "no process $2 under pid $1"
}

# The program NAME that a background `"${VRUN[@]}" ... &` PID became: itself once `vrdma run`
# exec'd it, or a child of it; up to 10 s. Usage: exec_named PID NAME
exec_named() {
  local k c comm=${2:0:15}  # /proc/PID/comm: the first 15 characters
  for ((k = 0; k < 100; k++)); do
    [[ "$(cat "/proc/$1/comm" 2>/dev/null)" == "$comm" ]] && {
      echo "$1"
      return 0
    }
    c="$(pgrep -P "$1" -x "$comm" | head -n 1)" && [[ -n $c ]] && {
      echo "$c"
      return 0
    }
    nap 0.1
  done
  fail "no $2 under pid $1"
}

# Waits for an rc_stream pair (client first, up to SECS) and checks that both ends moved the same
# messages with the same checksum: nothing lost, repeated, reordered or corrupted. Outputs are
# $E2E_TMP/NAME.client.out and NAME.server.out. Sets STREAM_RESULT ("N messages of S bytes,
# checksum C"). Usage: finish_stream NAME CLIENT_PID SERVER_PID [SECS]
finish_stream() {
  local name=$1 cli=$2 srv=$3 secs=${4:-60} sent got
  wait_pid "$cli" "$secs"
  [[ $WAIT_RC == 0 ]] || fail "$name: client exited $WAIT_RC: $(cat "$E2E_TMP/$name.client.out")"
  wait_pid "$srv" 20
  [[ $WAIT_RC == 0 ]] || fail "$name: server exited $WAIT_RC: $(cat "$E2E_TMP/$name.server.out")"
  sent="$(grep -o '[0-9]* messages of .*' "$E2E_TMP/$name.client.out")"
  got="$(grep -o '[0-9]* messages of .*' "$E2E_TMP/$name.server.out")"
  [[ -n $sent && $sent == "$got" ]] || fail "$name: sent '$sent', received '$got'"
  STREAM_RESULT=$sent
}

# Iterations for a pingpong that a test watches, or kills, while it runs: more round trips than
# any run can make before the test's deadline (2e9 at 0.05 µs each is 100 s), so the test, never
# the speed of the product, decides when the program stops.
PP_UNTIL_STOPPED=2000000000

# An open-ended rc_stream of SIZE-byte messages (default 4096) on this backend: server guest
# NAME-s, client guest NAME-c, outputs $E2E_TMP/NAME.{server,client}.out. It runs until the test
# stops it: `kill -USR1 "$cli_proc"`, then finish_stream NAME "$cli" "$srv" checks both ends. Sets
# srv and cli (their `vrdma run`) and cli_proc (the client itself). Usage: stream_start NAME [SIZE]
# RC_STREAM_OPT: one more option for both ends (--events: they sleep in completion channels).
stream_start() {
  local name=$1 size=${2:-4096} port bin
  bin="$(dirname "$VRDMA")"
  port="$(free_port)"
  vrun --guest "$name-s" -- "$bin/rc_stream" server "$port" 0 "$size" ${RC_STREAM_OPT:+"$RC_STREAM_OPT"} \
    >"$E2E_TMP/$name.server.out" 2>&1 &
  srv=$!
  wait_listen "$port" "$srv" "$name"
  vrun --guest "$name-c" -- "$bin/rc_stream" client 127.0.0.1 "$port" 0 "$size" ${RC_STREAM_OPT:+"$RC_STREAM_OPT"} \
    >"$E2E_TMP/$name.client.out" 2>&1 &
  cli=$!
  # shellcheck disable=SC2034  # for the caller
  cli_proc=$(child_named "$cli" rc_stream)
}

# Starts a pingpong pair NAME (server guest SG, client guest CG) that runs until the test kills
# it, and waits up to 30 s until both its QPs are in RTS. Sets SERVER_PID, CLIENT_PID and PORT.
# Usage: start_held_pair NAME SG CG
start_held_pair() {
  local i
  start_server "$1" "$2" -n "$PP_UNTIL_STOPPED"
  start_client "$1" "$3" "$PORT" -n "$PP_UNTIL_STOPPED"
  for ((i = 0; i < 300; i++)); do
    [[ "$("$VRDMA" res show qp state RTS -j | grep -o '"qpn"' | wc -l)" == 2 ]] && return 0
    kill -0 "$CLIENT_PID" 2>/dev/null || fail "client exited: $(cat "$E2E_TMP/$1.client.out")"
    nap 0.1
  done
  fail "$1: the pair's QPs did not reach RTS in 30 s"
}

# Checks that a pingpong output file has the two result lines.
check_pp_output() {
  local f=$1
  grep -Eq '^[0-9]+ bytes in [0-9.]+ seconds = [0-9.]+ Mbit/sec' "$f" ||
    fail "$(basename "$f"): no 'bytes in ... Mbit/sec' line"
  grep -Eq '^[0-9]+ iters in [0-9.]+ seconds = [0-9.]+ usec/iter' "$f" ||
    fail "$(basename "$f"): no 'iters in ... usec/iter' line"
}

# Waits for a started server/client pair and checks both. Usage:
# finish_pair NAME SERVER_PID CLIENT_PID [SECS]
finish_pair() {
  local name=$1 spid=$2 cpid=$3 secs=${4:-60} crc src
  wait_pid "$cpid" "$secs"
  crc=$WAIT_RC
  wait_pid "$spid" 10
  src=$WAIT_RC
  [[ $crc == 0 ]] || fail "$name: client exited with $crc"
  [[ $src == 0 ]] || fail "$name: server exited with $src"
  check_pp_output "$E2E_TMP/$name.server.out"
  check_pp_output "$E2E_TMP/$name.client.out"
  log "$name: ok: $(grep -E 'usec/iter' "$E2E_TMP/$name.client.out")"
}

# One full pingpong run: server + client, both through vrdma, same options on both sides.
# Usage: run_pair NAME SERVER_GUEST CLIENT_GUEST [pingpong args...]
run_pair() {
  local name=$1 sg=$2 cg=$3
  shift 3
  log "$name: $PP_TOOL $*"
  start_server "$name" "$sg" "$@"
  start_client "$name" "$cg" "$PORT" "$@"
  finish_pair "$name" "$SERVER_PID" "$CLIENT_PID"
}

# Runs one perftest server/client pair (guests pt-srv, pt-cli); outputs in
# $E2E_TMP/TOOL.{server,client}.out. Usage: run_perftest TOOL ARGS...
run_perftest() {
  local tool=$1 port srv cli
  shift
  port="$(free_port)"
  "${VRUN[@]}" --guest pt-srv -- "$tool" -p "$port" "$@" >"$E2E_TMP/$tool.server.out" 2>&1 &
  srv=$!
  wait_listen "$port" "$srv" "$tool"
  "${VRUN[@]}" --guest pt-cli -- "$tool" -p "$port" "$@" localhost >"$E2E_TMP/$tool.client.out" 2>&1 &
  cli=$!
  wait_pid "$cli" 90
  [[ $WAIT_RC == 0 ]] || fail "$tool client exited $WAIT_RC"
  wait_pid "$srv" 20
  [[ $WAIT_RC == 0 ]] || fail "$tool server exited $WAIT_RC"
}

# The result rows: lines of numbers after the "#bytes" header. Prints them.
result_rows() { awk '/#bytes/ {t = 1; next} t && $1 ~ /^[0-9]+$/ && NF >= 4' "$1"; }

# Waits up to SECS for PID (a child of this shell), which must exit 0 having printed a line
# "success" into OUT (ibv_xsrq_pingpong's last word). Usage: wait_success WHAT PID OUT SECS
wait_success() {
  wait_pid "$2" "$4"
  [[ $WAIT_RC == 0 ]] || fail "$1 exited $WAIT_RC: $(tail -n 3 "$3")"
  grep -qx success "$3" || fail "$1 did not say success"
}
