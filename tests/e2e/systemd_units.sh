#!/usr/bin/env bash
# The installed systemd units, run by a real systemd: `cmake --install` into a prefix of the
# test's own, then systemd 252 as PID 1 of new pid, mount and cgroup namespaces (tmpfs on /run,
# /tmp and /var/tmp, its own cgroup2 tree), with only the installed units and stub targets in its
# unit path. The prefix is /run/vrdma-e2e there: a DESTDIR install under the build tree,
# bind-mounted by the namespace (through a descriptor opened before the tmpfs mounts, so a tree
# under /tmp or /run works too), a path no service's PrivateTmp= hides. In it:
# vrdmad.socket listens (0600, /run/vrdma 0755) and nothing runs; the first `vrdma status`
# starts vrdmad.service by socket activation; with keep_state, the backend's first connection
# to vrdmad-keeper.socket starts vrdmad-keeper.service, whose pid `vrdma status` names; an
# rc_stream pair keeps running, every message once and in order, across a SIGKILL of the
# backend (`systemctl kill -s KILL vrdmad`) that systemd alone restarts (Restart=on-failure;
# the keeper restarts nothing, and is still the same process); `systemctl stop` ends backend
# and keeper cleanly; the keeper refuses another uid; without the keeper's socket the backend
# does not start and says why; vrdma-setup.service mounts the device view and its stop
# removes it; without the units, root's on-demand backend makes /run/vrdma 0755.
# Skips (77), naming the check, only where systemd cannot run here: not root, no systemd binary,
# no unshare/nsenter/setpriv/python3, a sanitized build, no cgroup2 hierarchy or no cgroup of our
# own, namespaces or tmpfs mounts refused. Everything after (the units not seen, systemd not
# reaching "running", a unit failing) fails.
# Usage: systemd_units.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
BIN="$(dirname "$VRDMA")"
BUILD="$(cd "$BIN/.." && pwd)"
skip() {
  log "SKIP: $*"
  exit 77
}
[[ $(id -u) == 0 ]] || skip "needs root (systemd as PID 1 of its own namespaces)"
SYSTEMD=/lib/systemd/systemd
[[ -x $SYSTEMD ]] || skip "no $SYSTEMD (apt-get install systemd)"
if ! command -v unshare >/dev/null || ! command -v nsenter >/dev/null ||
  ! command -v setpriv >/dev/null || [[ ! -x /usr/bin/python3 ]]; then
  skip "no unshare, nsenter, setpriv or /usr/bin/python3"
fi
[[ -n $SAN_PRELOAD ]] && skip "sanitized build: the units' sandbox (MemoryDenyWriteExecute) is for release binaries"

# The prefix the units name, as systemd's namespace sees it (a bind mount of $P there).
PREFIX=/run/vrdma-e2e
# DESTDIR: under the build tree, whose binaries run anyway (a TMPDIR may be noexec).
H="$(mktemp -d "$BUILD/vrdma-e2e-systemd.XXXXXX")"
P="$H$PREFIX"
SDPID=""
CG=""
stop_systemd() {
  local i
  if [[ -n $SDPID ]]; then
    kill -KILL "$SDPID" 2>/dev/null # PID 1 of the namespace: everything in it goes too
    for ((i = 0; i < 50; i++)); do kill -0 "$SDPID" 2>/dev/null || break; sleep 0.1; done
  fi
  if [[ -n $CG ]]; then
    for ((i = 0; i < 30; i++)); do
      find "$CG" -depth -type d -exec rmdir {} + 2>/dev/null
      [[ -d $CG ]] || break
      sleep 0.1
    done
  fi
  [[ -z ${E2E_KEEP:-} ]] && rm -rf "$H"
}
# The test's exit code goes on to e2e_cleanup, and its socket is no longer the namespace's (whose
# backends died with it): nothing of the machine's is cleaned up by mistake.
exit_with() { return "$1"; }
trap 'rc=$?; set +e; stop_systemd; VRDMA_SOCKET=$E2E_TMP/vrdmad.sock; exit_with $rc; e2e_cleanup' EXIT

DESTDIR="$H" cmake --install "$BUILD" --prefix "$PREFIX" >"$E2E_TMP/install.out" 2>&1 ||
  fail "cmake --install: $(cat "$E2E_TMP/install.out")"
U="$P/lib/systemd/system"
# The programs run in the namespace are the installed ones, and a test program beside them.
cp "$BIN/rc_stream" "$P/bin/" || fail "copy rc_stream"
for u in vrdmad.socket vrdmad.service vrdmad-keeper.socket vrdmad-keeper.service vrdma-setup.service; do
  [[ -f $U/$u ]] || fail "not installed: $u"
done
sed -i 's/^keep_state = false/keep_state = true/' "$P/etc/vrdma/vrdmad.toml"
grep -qx 'keep_state = true' "$P/etc/vrdma/vrdmad.toml" || fail "keep_state not in the installed config"

# Stub targets for the units' default dependencies, and the logs in files (no journald here).
S="$P/units"
mkdir -p "$S"
for t in sysinit basic sockets shutdown local-fs e2e; do
  printf '[Unit]\nDescription=%s (test stub)\n' "$t" >"$S/$t.target"
done
for u in vrdmad.service vrdmad-keeper.service vrdma-setup.service; do
  mkdir -p "$S/$u.d"
  printf '[Service]\nStandardOutput=append:%s/%s.log\nStandardError=inherit\n' "$PREFIX" "${u%.service}" \
    >"$S/$u.d/log.conf"
done

# systemd as PID 1: own cgroup (cgroup2; this machine's v1 controllers stay outside), a private
# /run, /tmp and /var/tmp (the services' PrivateTmp= directories go with it), no units but ours.
if [[ -d /sys/fs/cgroup/unified ]]; then
  CG=/sys/fs/cgroup/unified/vrdma-e2e-$$
elif [[ $(stat -fc %T /sys/fs/cgroup) == cgroup2fs ]]; then
  CG=/sys/fs/cgroup/vrdma-e2e-$$
else
  skip "no cgroup2 hierarchy for systemd"
fi
mkdir "$CG" || skip "cannot make a cgroup ($CG)"
unshare --pid --mount --cgroup --fork --mount-proc true 2>"$E2E_TMP/unshare.out" ||
  skip "unshare of pid, mount and cgroup namespaces refused: $(cat "$E2E_TMP/unshare.out")"
# The namespace's shell exits 10 where mounts are refused (skip), 11 or 12 where the prefix is
# not seen (fail); then it is systemd.
# shellcheck disable=SC2016  # expanded by the namespace's shell
(
  echo "$BASHPID" >"$CG/cgroup.procs"
  exec unshare --pid --mount --cgroup --fork --mount-proc --propagation private sh -c '
    exec 3<"$1" || exit 11
    for d in /run /tmp /var/tmp; do mount -t tmpfs vrdma-e2e "$d" || exit 10; done
    mount -t cgroup2 cgroup2 /sys/fs/cgroup || exit 10
    mkdir "$2" && mount --no-canonicalize --bind /proc/self/fd/3 "$2" || exit 11
    exec 3<&-
    for f in units/e2e.target lib/systemd/system/vrdmad.service bin/vrdmad; do
      [ -e "$2/$f" ] || { echo "not seen in the namespace: $2/$f"; exit 12; }
    done
    exec env -i container=vrdma-e2e SYSTEMD_UNIT_PATH="$2/units:$2/lib/systemd/system" \
      PATH=/usr/sbin:/usr/bin:/sbin:/bin "$3" --unit=e2e.target --log-target=console' \
    sh "$P" "$PREFIX" "$SYSTEMD"
) >"$E2E_TMP/systemd.out" 2>&1 &
sdsh=$!
in_ns() { nsenter -t "$SDPID" -m -p -- "$@"; }
sd() { in_ns systemctl "$@"; }
state=""
for ((i = 0; i < 150; i++)); do
  # The subshell became unshare; its child is systemd.
  SDPID="$(pgrep -P "$sdsh" -x systemd | head -n 1 || true)"
  [[ -n $SDPID ]] && state="$(sd is-system-running 2>&1 || true)"
  [[ $state == running || $state == degraded ]] && break
  kill -0 "$sdsh" 2>/dev/null || break
  nap 0.1
done
if [[ $state != running ]] && ! kill -0 "$sdsh" 2>/dev/null; then
  rc=0
  wait "$sdsh" || rc=$?
  [[ $rc == 10 ]] && skip "tmpfs or cgroup2 mounts refused in a mount namespace: $(cat "$E2E_TMP/systemd.out")"
  fail "systemd's namespace ended (exit $rc) before systemd ran: $(cat "$E2E_TMP/systemd.out")"
fi
[[ $state == degraded ]] && fail "systemd degraded: $(sd list-units --failed --no-legend 2>&1)"
[[ $state == running ]] ||
  fail "systemd in a namespace is not running after 15 s (${state:-not started}): $(cat "$E2E_TMP/systemd.out")"
log "systemd $SDPID is PID 1 of its namespaces, $PREFIX the installed prefix there"
export VRDMA_SOCKET=/run/vrdma/vrdmad.sock
VRUN=(in_ns env "VRDMA_SOCKET=$VRDMA_SOCKET" "$PREFIX/bin/vrdma" run)
# A first command waits for systemd to start the backend (its ExecStartPre too) and the keeper:
# seconds on a loaded machine.
vr() { in_ns env "VRDMA_SOCKET=$VRDMA_SOCKET" VRDMA_TIMEOUT_MS=20000 "$PREFIX/bin/vrdma" "$@"; }
mainpid() { sd show -p MainPID --value "$1"; }

# The socket unit: systemd's socket, root's only; nothing runs yet.
sd start vrdmad.socket || fail "start vrdmad.socket: $(sd status vrdmad.socket 2>&1)"
[[ $(in_ns stat -c '%F %a' /run/vrdma/vrdmad.sock) == "socket 600" ]] ||
  fail "socket: $(in_ns stat -c '%F %a' /run/vrdma/vrdmad.sock)"
[[ $(in_ns stat -c %a /run/vrdma) == 755 ]] || fail "/run/vrdma is $(in_ns stat -c %a /run/vrdma)"
[[ $(sd is-active vrdmad.service) == inactive ]] || fail "vrdmad.service runs before any connection"

# The first connection starts the backend, which connects to its keeper's socket.
vr status >"$E2E_TMP/status1.out" 2>&1 || fail "first status: $(cat "$E2E_TMP/status1.out")"
[[ $(sd is-active vrdmad.service) == active ]] || fail "vrdmad.service: $(sd status vrdmad.service 2>&1)"
[[ $(sd is-active vrdmad-keeper.service) == active ]] ||
  fail "vrdmad-keeper.service: $(sd status vrdmad-keeper.service 2>&1)"
kpid="$(mainpid vrdmad-keeper.service)"
grep -q "socket activation" "$P/vrdmad.log" || fail "the backend was not socket-activated"
want="keep_state: on, keeper pid $(in_ns cat /run/vrdma/vrdmad.sock.keeper.pid), restarted by systemd (systemctl show -p NRestarts vrdmad), grace 10 s"
grep -qxF "$want" "$E2E_TMP/status1.out" || fail "status: $(grep keep_state "$E2E_TMP/status1.out")"
log "vrdmad.service $(mainpid vrdmad.service), vrdmad-keeper.service $kpid"

# A stream across a SIGKILL of the backend: systemd restarts it, the keeper hands it the guests.
port="$(free_port)"
vrun --guest stream-s -- "$PREFIX/bin/rc_stream" server "$port" 0 4096 \
  >"$E2E_TMP/stream.server.out" 2>&1 &
srv=$!
wait_listen "$port" "$srv" stream
vrun --guest stream-c -- "$PREFIX/bin/rc_stream" client 127.0.0.1 "$port" 0 4096 \
  >"$E2E_TMP/stream.client.out" 2>&1 &
cli=$!
cli_proc=""
for ((i = 0; i < 100; i++)); do
  cli_proc="$(pgrep -f "^$PREFIX/bin/rc_stream client 127.0.0.1 $port " | head -n 1 || true)"
  [[ -n $cli_proc ]] && break
  nap 0.1
done
[[ -n $cli_proc ]] || fail "no rc_stream client"
for ((i = 0; i < 200; i++)); do
  [[ $(vr res show qp 2>/dev/null | grep -c 'state RTS') -ge 2 ]] && break
  nap 0.05
done
[[ $i -lt 200 ]] || fail "the pair did not connect"
nap 0.5
old="$(mainpid vrdmad.service)"
# Every process of the service's cgroup; the keeper, a unit of its own, is not in it.
sd kill -s KILL vrdmad.service || fail "systemctl kill -s KILL vrdmad.service"
for ((i = 0; i < 300; i++)); do
  new="$(mainpid vrdmad.service)"
  [[ $new != 0 && $new != "$old" ]] && [[ $(sd is-active vrdmad.service) == active ]] && break
  nap 0.1
done
[[ $new != 0 && $new != "$old" ]] || fail "systemd did not restart vrdmad after SIGKILL"
[[ $(sd show -p NRestarts --value vrdmad.service) == 1 ]] ||
  fail "NRestarts $(sd show -p NRestarts --value vrdmad.service)"
for ((i = 0; i < 300; i++)); do
  # One line per backend start: the first one's, then the restarted one's.
  [[ $(grep -c 'guest(s) restored' "$P/vrdmad.log") -ge 2 ]] && break
  nap 0.1
done
nap 0.5
kill -USR1 "$cli_proc"
finish_stream stream "$cli" "$srv" 60
grep -q "stream-c: restored from the keeper" "$P/vrdmad.log" ||
  fail "the client's guest was not restored: $(grep -i keeper "$P/vrdmad.log")"
[[ $(mainpid vrdmad-keeper.service) == "$kpid" ]] ||
  fail "the keeper changed ($kpid -> $(mainpid vrdmad-keeper.service)): it must outlive the backend"
grep -q "starting it again" "$P/vrdmad-keeper.log" && fail "the keeper restarted the backend itself"
log "rc_stream across a SIGKILL (backend $old -> $new, keeper $kpid kept): $STREAM_RESULT on both ends"

# A clean stop: the backend says goodbye, the keeper lets go and exits.
sd stop vrdmad.service vrdmad.socket || fail "stop"
for ((i = 0; i < 50; i++)); do
  [[ $(sd is-active vrdmad-keeper.service) != active ]] && break
  nap 0.1
done
[[ $(sd is-active vrdmad-keeper.service) != active ]] || fail "the keeper outlived a clean stop"
[[ $(sd show -p Result --value vrdmad-keeper.service) == success ]] ||
  fail "keeper result $(sd show -p Result --value vrdmad-keeper.service)"

# Only the keeper's own uid may hand over or take back state, even through a socket whose mode
# lets others in (a drop-in's SocketMode=0666).
mkdir -p "$S/vrdmad-keeper.socket.d"
printf '[Socket]\nSocketMode=0666\n' >"$S/vrdmad-keeper.socket.d/mode.conf"
sd daemon-reload
sd restart vrdmad-keeper.socket || fail "restart vrdmad-keeper.socket"
# Debian's python3 (a python3 first in root's PATH may be under /root, closed to nobody).
# shellcheck disable=SC2016  # python, not shell
in_ns setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 -c '
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect("/run/vrdma/vrdmad.sock.keeper")
s.settimeout(10)
print("closed" if s.recv(64) == b"" else "answered")' >"$E2E_TMP/nobody.out" 2>&1 ||
  fail "nobody's connection: $(cat "$E2E_TMP/nobody.out")"
[[ $(cat "$E2E_TMP/nobody.out") == closed ]] || fail "the keeper answered uid 65534"
grep -q 'keeper: a connection from uid 65534 refused' "$P/vrdmad-keeper.log" ||
  fail "no refusal in the keeper's log: $(tail -n 3 "$P/vrdmad-keeper.log")"
sd stop vrdmad-keeper.service vrdmad-keeper.socket

# keep_state without the keeper's socket (units copied by hand): the backend refuses to start and
# its log names the units, instead of forking a keeper into its own cgroup.
rm "$U/vrdmad-keeper.socket"
sd daemon-reload
sd start vrdmad.socket || fail "start vrdmad.socket again"
in_ns env "VRDMA_SOCKET=$VRDMA_SOCKET" VRDMA_TIMEOUT_MS=2000 "$PREFIX/bin/vrdma" status >/dev/null 2>&1 &&
  fail "a backend with keep_state ran without its keeper"
for ((i = 0; i < 100; i++)); do
  grep -q 'no keeper answers at /run/vrdma/vrdmad.sock.keeper' "$P/vrdmad.log" && break
  nap 0.1
done
grep -q 'vrdmad-keeper.service, started by vrdmad-keeper.socket' "$P/vrdmad.log" ||
  fail "no keeper: $(tail -n 3 "$P/vrdmad.log")"
sd stop vrdmad.socket vrdmad.service

# The boot unit: `vrdma setup` before the socket, `--remove` on stop.
if [[ -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ]]; then
  log "a kernel RDMA driver is loaded: vrdma-setup.service not run (setup refuses to hide it)"
else
  sd start vrdma-setup.service || fail "vrdma-setup: $(cat "$P/vrdma-setup.log")"
  in_ns test -c /dev/infiniband/uverbs0 -o -e /dev/infiniband/uverbs0 ||
    fail "no uverbs0 after vrdma-setup: $(cat "$P/vrdma-setup.log")"
  in_ns test -e /sys/class/infiniband/vrdma0 || fail "no vrdma0 in sysfs after vrdma-setup"
  sd stop vrdma-setup.service || fail "stop vrdma-setup"
  in_ns test -e /sys/class/infiniband/vrdma0 && fail "vrdma-setup's stop left the view"
  log "vrdma-setup.service: $(head -n 1 "$P/vrdma-setup.log" | cut -c1-100)..."
fi

# Without the units, root's backend started on demand makes /run/vrdma as vrdmad.socket does:
# 0755 whatever the umask (the socket's mode says who may connect).
in_ns rm -rf /run/vrdma
# shellcheck disable=SC2016  # the namespace's shell
in_ns sh -c 'umask 077; exec env -u VRDMA_SOCKET "$0" run -- true' "$PREFIX/bin/vrdma" \
  >"$E2E_TMP/ondemand.out" 2>&1 || fail "vrdma run as root: $(cat "$E2E_TMP/ondemand.out")"
grep -qF "started a backend (pid" "$E2E_TMP/ondemand.out" || fail "$(cat "$E2E_TMP/ondemand.out")"
[[ $(in_ns stat -c %a /run/vrdma) == 755 ]] || fail "/run/vrdma made $(in_ns stat -c %a /run/vrdma)"
e2e_pass
