#!/usr/bin/env bash
# The user's first mistakes fail at once, non-zero, with a message that names the cause and what
# to do, and leave no file behind: no backend (CLI and library), a backend the library cannot
# start, bad guest names, a second backend on a served socket, a stopped backend, operator
# commands the backend refuses, a move that would strand a guest's peer, two programs on two
# backends without a route, two jobs of one script in one default guest, and a socket the user
# may not open (as a second, real uid).
# Usage: first_mistakes.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
LIB="$(cd "$1/../lib" && pwd)"
VRDMAD="$(dirname "$VRDMA")/vrdmad"
RULE="a guest name is 1 to 63 bytes of letters, digits and . _ - : @ +, not starting with -"

# Runs CMD (its output in $E2E_TMP/NAME.out) and fails unless it exits non-zero within MAX_S
# seconds and its output holds TEXT. Usage: expect_fail NAME MAX_S TEXT CMD...
expect_fail() {
  local name=$1 max=$2 text=$3 t0 ms rc=0
  shift 3
  t0=${EPOCHREALTIME/./}
  "$@" >"$E2E_TMP/$name.out" 2>&1 || rc=$?
  ms=$(((${EPOCHREALTIME/./} - t0) / 1000))
  [[ $rc != 0 ]] || fail "$name: exit 0: $(cat "$E2E_TMP/$name.out")"
  ((ms <= max * 1000)) || fail "$name: took $ms ms (at most $max s): $(cat "$E2E_TMP/$name.out")"
  grep -qF -- "$text" "$E2E_TMP/$name.out" ||
    fail "$name: no \"$text\" in: $(cat "$E2E_TMP/$name.out")"
  log "$name: exit $rc after $ms ms: $(grep -F -m1 -- "$text" "$E2E_TMP/$name.out" | cut -c1-160)"
}
# The library alone (no `vrdma run`), as a program that links libibverbs finds it.
lib_run() { env ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} LD_LIBRARY_PATH="$LIB" "$@"; }

# No backend: the CLI says how to get one.
expect_fail none 1 "no backend is running at $VRDMA_SOCKET" "$VRDMA" res show qp

# One set of names: a word that is no command is named, both programs say their version, and
# `vrdma backend` takes vrdmad's options (here one it checks: a bad --log-level).
expect_fail unknown-command 1 "vrdma: unknown command 'bogus' (commands: run, backend," "$VRDMA" bogus
for prog in vrdma vrdmad; do
  v="$("$(dirname "$VRDMA")/$prog" --version)" || fail "$prog --version failed"
  [[ $v =~ ^$prog\ [0-9]+\.[0-9]+\.[0-9]+$ ]] || fail "$prog --version said: $v"
done
# ... and its help names every one of them.
"$VRDMA" backend --help >"$E2E_TMP/backend-help.out" || fail "vrdma backend --help"
for o in $("$VRDMAD" --help | grep -o -- '--[a-z-]*' | sort -u); do
  grep -qF -- "$o" "$E2E_TMP/backend-help.out" || fail "vrdma backend --help does not name $o"
done
expect_fail backend-log-level 1 "--log-level: bogus not in {error,warn,info,debug}" \
  "$VRDMA" backend --socket "$E2E_TMP/unused.sock" --log-level bogus
grep -qF 'start a backend (`vrdma backend`' "$E2E_TMP/none.out" || fail "$(cat "$E2E_TMP/none.out")"

# The library cannot start a backend: it names the binary and the variable to set, and does not
# wait for a backend it did not start.
expect_fail lib-nobin 1 \
  "cannot start the vrdma backend: $E2E_TMP/no/vrdmad is not executable; set VRDMA_BACKEND" \
  lib_run VRDMA_BACKEND="$E2E_TMP/no/vrdmad" ibv_devinfo
grep -qF "cannot reach the vrdma backend: nothing listens on $VRDMA_SOCKET" "$E2E_TMP/lib-nobin.out" ||
  fail "library, no backend: $(cat "$E2E_TMP/lib-nobin.out")"
# ... or what it started is no backend: it says so once that has exited (not after 5 s).
expect_fail lib-badbin 2 "the backend it started (pid" lib_run VRDMA_BACKEND=/bin/false ibv_devinfo
grep -qF "exited; its log is $E2E_TMP/vrdmad.log" "$E2E_TMP/lib-badbin.out" ||
  fail "library, bad backend: $(cat "$E2E_TMP/lib-badbin.out")"

# Guest names: one rule, said whatever was wrong, before any backend is started.
long="$(printf 'g%.0s' {1..100})"
expect_fail name-empty 1 "guest name '' is empty: $RULE" lib_run VRDMA_GUEST= ibv_devinfo
expect_fail name-space 1 "guest name 'a b' has a space: $RULE" lib_run VRDMA_GUEST="a b" ibv_devinfo
expect_fail name-dash 1 "guest name '-x' starts with -" lib_run VRDMA_GUEST=-x ibv_devinfo
expect_fail name-long 1 "is 100 bytes long: $RULE" lib_run VRDMA_GUEST="$long" ibv_devinfo
expect_fail name-run 1 "vrdma run: --guest: guest name 'a/b' has '/': $RULE" \
  "$VRDMA" run --guest a/b -- true
expect_fail name-run-empty 1 "guest name '' is empty" "$VRDMA" run --guest "" -- true
[[ -z "$(backend_pid)" ]] || fail "a bad guest name started a backend"

# `vrdma run` says when it starts a backend, and which; a log over 10 MiB is rotated first.
truncate -s 11M "$E2E_TMP/vrdmad.log"
"$VRDMA" run -- true 2>"$E2E_TMP/started.out" || fail "vrdma run: $(cat "$E2E_TMP/started.out")"
[[ $(stat -c %s "$E2E_TMP/vrdmad.log.1") == $((11 << 20)) && $(stat -c %s "$E2E_TMP/vrdmad.log") -lt 4096 ]] ||
  fail "the log was not rotated: $(ls -l "$E2E_TMP")"
BPID="$(backend_pid)"
[[ -n $BPID ]] || fail "vrdma run started no backend"
grep -qF "vrdma run: started a backend (pid $BPID) on $VRDMA_SOCKET; its log is $E2E_TMP/vrdmad.log; it exits after 60 s without guests" \
  "$E2E_TMP/started.out" || fail "vrdma run did not say it started pid $BPID: $(cat "$E2E_TMP/started.out")"

# A second backend on the served socket, started by hand: an error naming the one that serves.
expect_fail second-cli 2 \
  "another backend already serves $VRDMA_SOCKET (pid $BPID, started on demand by \`vrdma run\` or a program's first use; it exits after 60 s without guests)" \
  "$VRDMA" backend --metrics-listen 127.0.0.1:0
grep -qF "To replace it, stop that one (kill $BPID" "$E2E_TMP/second-cli.out" ||
  fail "no way to replace it: $(cat "$E2E_TMP/second-cli.out")"
expect_fail second-vrdmad 2 "another backend already serves $VRDMA_SOCKET (pid $BPID" \
  "$VRDMAD" --socket "$VRDMA_SOCKET"
# ... started on demand (a race lost), it leaves quietly.
"$VRDMAD" --socket "$VRDMA_SOCKET" --on-demand >"$E2E_TMP/second-quiet.out" 2>&1 ||
  fail "an on-demand backend that lost the socket failed: $(cat "$E2E_TMP/second-quiet.out")"
[[ "$(backend_pid)" == "$BPID" ]] || fail "the backend serving the socket changed"

# Operator commands the backend refuses: its reason, not an errno.
start_server reasons g1
expect_fail mig-noguest 1 "refused: no guest nosuch here (guests: g1)" \
  "$VRDMA" migrate nosuch --to "$E2E_TMP/other.sock"
expect_fail mig-self 1 "refused: the target is this backend" \
  "$VRDMA" migrate g1 --to "$VRDMA_SOCKET"
expect_fail mig-dash 1 "guest name '-g' starts with -" "$VRDMA" migrate --to "$E2E_TMP/o.sock" -- -g
mkdir "$E2E_TMP/snap"
expect_fail snap-noguest 1 "refused: no guest nosuch here (guests: g1)" \
  "$VRDMA" snapshot nosuch "$E2E_TMP/snap/nosuch.snap"
[[ -z "$(ls -A "$E2E_TMP/snap")" ]] || fail "a failed snapshot left $(ls -A "$E2E_TMP/snap")"
printf 'not a snapshot' >"$E2E_TMP/garbage.snap"
expect_fail restore-garbage 1 "vrdma restore: the backend at $VRDMA_SOCKET refused: " \
  "$VRDMA" restore "$E2E_TMP/garbage.snap"
! grep -qF "its log says why" "$E2E_TMP/restore-garbage.out" ||
  fail "restore gave no reason: $(cat "$E2E_TMP/restore-garbage.out")"
kill "$SERVER_PID" 2>/dev/null
wait "$SERVER_PID" 2>/dev/null || true

# A move that would strand the guest's peer (two backends without TCP): refused at once, naming
# both backends and the QP's peer; nothing moves. --force moves it anyway.
OTHER="$E2E_TMP/other.sock"
"$VRDMAD" --socket "$OTHER" --idle-exit 0 >"$E2E_TMP/other.out" 2>&1 &
OTHER_PID=$!
start_held_pair strand m1 m2
for ((i = 0; i < 100; i++)); do [[ -S $OTHER ]] && break; nap 0.1; done
expect_fail mig-strand 1 \
  "vrdma migrate: refused: moving guest m2 from $VRDMA_SOCKET (node $(hostname)) to $OTHER (node $(hostname)) would strand its connections: QP 0x" \
  "$VRDMA" migrate m2 --to "$OTHER"
grep -qF "is connected to guest m1, which stays on $VRDMA_SOCKET; $VRDMA_SOCKET has no TCP transport (no [transport] listen). Give both backends [transport] listen and each other as peers, or move it anyway with --force" \
  "$E2E_TMP/mig-strand.out" || fail "no reason: $(cat "$E2E_TMP/mig-strand.out")"
# shellcheck disable=SC2016  # perl
[[ "$(status_query 'join ",", sort map { $_->{guest} } @{$j->{guests}}')" == m1,m2 ]] ||
  fail "a refused move moved: $("$VRDMA" status)"
"$VRDMA" migrate m2 --to "$OTHER" --force >"$E2E_TMP/mig-force.out" 2>&1 ||
  fail "--force: $(cat "$E2E_TMP/mig-force.out")"
grep -qF "guest m2 moved from $VRDMA_SOCKET (node $(hostname)) to $OTHER (node $(hostname))" \
  "$E2E_TMP/mig-force.out" || fail "--force: $(cat "$E2E_TMP/mig-force.out")"
kill "$SERVER_PID" "$CLIENT_PID" 2>/dev/null
wait "$SERVER_PID" "$CLIENT_PID" 2>/dev/null || true

# Two programs on two backends without TCP (a typo in VRDMA_SOCKET): each backend's log says
# once that the other's LID is unknown to it, and asks the question; so does each program's
# stderr, once, when its QP goes to RTR (not only "transport retry counter exceeded" later).
VRDMA_SOCKET="$OTHER" start_server split split-s -n 3
start_client split split-c "$PORT" -n 3
unknown="unknown to this backend (tcp off): are both programs on the same VRDMA_SOCKET?"
said() { # PROGRAM_OUT SOCKET: how many times the program's stderr said it
  local re="warn: modify_qp to RTR: destination LID 0x[0-9a-f]+ unknown to the backend on $2"
  grep -cE "$re \(tcp off\): are both programs on the same VRDMA_SOCKET\?" "$1"
}
for ((i = 0; i < 100; i++)); do
  grep -qF "$unknown" "$E2E_TMP/vrdmad.log" && grep -qF "$unknown" "$E2E_TMP/other.out" &&
    [[ $(said "$E2E_TMP/split.server.out" "$OTHER") != 0 &&
      $(said "$E2E_TMP/split.client.out" "$VRDMA_SOCKET") != 0 ]] && break
  nap 0.1
done
if ! grep -qF "(guest split-c): destination LID 0x" "$E2E_TMP/vrdmad.log" ||
  ! grep -qF "(guest split-s): destination LID 0x" "$E2E_TMP/other.out"; then
  fail "no unknown destination in the logs: $(grep -h warn "$E2E_TMP/vrdmad.log" "$E2E_TMP/other.out")"
fi
[[ $(said "$E2E_TMP/split.server.out" "$OTHER") == 1 &&
  $(said "$E2E_TMP/split.client.out" "$VRDMA_SOCKET") == 1 ]] ||
  fail "not said once on the programs' stderr: $(cat "$E2E_TMP"/split.*.out)"
kill "$SERVER_PID" "$CLIENT_PID" "$OTHER_PID" 2>/dev/null
wait "$SERVER_PID" "$CLIENT_PID" "$OTHER_PID" 2>/dev/null || true

# Two background jobs of one shell script share its process group, so by default one guest: the
# backend warns that both ends of their RC connection are in one guest, naming both pids.
port="$(free_port)"
# shellcheck disable=SC2016  # expanded by that script
setsid --wait bash -c '
  "${@:3}" -- ibv_rc_pingpong -p "$1" -n 100 >"$2.server.out" 2>&1 &
  for ((i = 0; i < 200; i++)); do [[ -n "$(ss -Htln "sport = :$1")" ]] && break; sleep 0.1; done
  "${@:3}" -- ibv_rc_pingpong -p "$1" -n 100 localhost >"$2.client.out" 2>&1 && wait $!' \
  pgrp "$port" "$E2E_TMP/pgrp" "${VRUN[@]}" || fail "two jobs of one script: $(cat "$E2E_TMP"/pgrp.*.out)"
grep -qE "\(guest pgrp-[0-9]+, pid [0-9]+\): both ends of this RC connection are in one guest, with pid [0-9]+: processes of one process group" \
  "$E2E_TMP/vrdmad.log" || fail "no warning for one default guest: $(grep warn "$E2E_TMP/vrdmad.log")"

# A stopped backend: the CLI gives up and says which pid does not answer.
kill -STOP "$BPID"
for cmd in status "res show qp" stat; do
  # shellcheck disable=SC2086  # the command's words
  expect_fail "stopped-${cmd%% *}" 2 "backend pid $BPID does not answer on $VRDMA_SOCKET within 500 ms" \
    env VRDMA_TIMEOUT_MS=500 "$VRDMA" $cmd
done
kill -CONT "$BPID"
"$VRDMA" status >/dev/null || fail "the backend does not answer after SIGCONT"

# Permission denied: root's backend, used by another user; nothing is started for them.
if [[ $(id -u) == 0 ]] && command -v setpriv >/dev/null && command -v useradd >/dev/null; then
  FM_USER="vrfm$(printf '%05x' $(((RANDOM << 5 ^ $$) & 0xfffff)))"
  fm_cleanup() {
    local rc=$?
    set +e
    del_user "$FM_USER"
    (exit "$rc")
    e2e_cleanup
  }
  trap fm_cleanup EXIT
  useradd --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin -U "$FM_USER" ||
    fail "useradd $FM_USER"
  uid="$(id -u "$FM_USER")"
  mine="/tmp/vrdma-$uid/vrdmad.sock"
  [[ ! -e /tmp/vrdma-$uid ]] || fail "/tmp/vrdma-$uid exists before the test"
  chmod 0711 "$E2E_TMP"
  [[ "$(stat -c %a "$VRDMA_SOCKET")" != *[2367] ]] || fail "the socket is writable by others"
  as_fm() {
    setpriv --reuid="$FM_USER" --regid="$FM_USER" --clear-groups \
      env -u XDG_RUNTIME_DIR VRDMA_SOCKET="$VRDMA_SOCKET" "$@"
  }
  perm="permission denied on $VRDMA_SOCKET (owner uid 0, group gid 0, mode 0$(stat -c %a "$VRDMA_SOCKET")): run as the backend's user or a member of its group"
  expect_fail perm-status 1 "$perm" as_fm "$VRDMA" status
  expect_fail perm-run 1 "$perm" as_fm "$VRDMA" run -- true
  grep -qF "or use a backend of your own at your default socket $mine (unset VRDMA_SOCKET" \
    "$E2E_TMP/perm-run.out" || fail "no per-user default: $(cat "$E2E_TMP/perm-run.out")"
  ! grep -qF "started a backend" "$E2E_TMP/perm-run.out" || fail "vrdma run started a backend"
  expect_fail perm-lib 1 "$perm" as_fm ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} \
    LD_LIBRARY_PATH="$LIB" ibv_devinfo
  [[ ! -e /tmp/vrdma-$uid ]] || fail "a backend was started for $FM_USER: $(ls -la "/tmp/vrdma-$uid")"
else
  log "not root (or no setpriv/useradd): permission case skipped"
fi

# Nothing left behind by what failed.
left="$(find "$E2E_TMP" -name '*.part*')"
[[ -z $left ]] || fail "stray files: $left"
e2e_pass
