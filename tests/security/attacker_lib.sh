# Helpers for the exhaustion tests (sourced after lib.sh): a program run as a user and held at a
# line it prints until the test lets it go (vrdma_attacker, a hostile one, among them), and what
# the backend spends meanwhile (descriptors, CPU).
# shellcheck shell=bash

# Starts PROGRAM ARGS... as USER in the background, its stdin a FIFO the test writes to; output
# in $E2E_TMP/out/NAME.out. Waits up to SECS for a line matching the extended regex READY; the
# program then waits on its stdin until hold_release NAME. Sets HELD_PID.
# Usage: hold_start USER NAME READY SECS PROGRAM ARGS...
hold_start() {
  local user=$1 name=$2 ready=$3 secs=$4 fd i
  shift 4
  local out="$E2E_TMP/out/$name.out" fifo="$E2E_TMP/out/$name.in"
  mkfifo -m 0666 "$fifo"
  # Read-write: opening it never blocks, and the program's stdin has a writer from the start.
  exec {fd}<>"$fifo"
  printf -v "HOLD_FD_${name//[^a-zA-Z0-9]/_}" '%s' "$fd"
  as_user "$user" "$@" <"$fifo" >"$out" 2>&1 &
  HELD_PID=$!
  hold_wait "$name" "$ready" "$secs"
}

# Waits up to SECS for a line matching READY in NAME's output (failing if it exited first).
hold_wait() {
  local name=$1 ready=$2 secs=$3 i out="$E2E_TMP/out/$1.out"
  for ((i = 0; i < secs * 10; i++)); do
    grep -Eq -- "$ready" "$out" 2>/dev/null && return 0
    kill -0 "$HELD_PID" 2>/dev/null || fail "$name exited: $(cat "$out")"
    nap 0.1
  done
  fail "$name: no '$ready' within $secs s: $(cat "$out")"
}

# Lets the program held as NAME go on past its current wait.
hold_release() {
  local var="HOLD_FD_${1//[^a-zA-Z0-9]/_}"
  echo go >&"${!var}"
}

# vrdma_attacker ARGS... as USER, held at its `ready` line. Sets ATTACKER_PID.
# Usage: attacker_start USER NAME ARGS...
attacker_start() {
  local user=$1 name=$2
  shift 2
  hold_start "$user" "$name" '^ready' 60 "$SEC_BIN/vrdma_attacker" "$@"
  # shellcheck disable=SC2034  # for the caller
  ATTACKER_PID=$HELD_PID
}
attacker_release() { hold_release "$1"; }

# Number of open descriptors of PID.
fds_of() { find "/proc/$1/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l; }

# CPU time PID used (user + system, in clock ticks).
cpu_ticks() { sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }

# Percent of one CPU PID used over about SECS seconds (default 1).
cpu_percent() {
  local pid=$1 secs=${2:-1} c0 c1 t0 t1 hz
  hz=$(getconf CLK_TCK)
  c0=$(cpu_ticks "$pid")
  t0=$(date +%s%N)
  nap "$secs"
  c1=$(cpu_ticks "$pid")
  t1=$(date +%s%N)
  echo $(((c1 - c0) * 100 * 1000000000 / (hz * (t1 - t0))))
}

# Waits up to SECS for a line matching the extended regex RE in FILE. Usage: wait_log FILE RE SECS
wait_log() {
  local f=$1 re=$2 secs=${3:-20} i
  for ((i = 0; i < secs * 10; i++)); do
    grep -Eq -- "$re" "$f" 2>/dev/null && return 0
    nap 0.1
  done
  return 1
}
