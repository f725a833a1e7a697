#!/usr/bin/env bash
# The metrics endpoint on a unix socket ([metrics] listen = "unix:PATH"): made with socket_mode
# in a checked directory, it serves the same text (curl --unix-socket) with the guests of a
# running pingpong to the backend's own user; a socket file left by a backend killed with
# SIGKILL is replaced; a clean exit removes it; a relative path (FILE:LINE) and a directory
# writable by others are refused, naming the path. Usage: metrics_unix.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
HERE="$(dirname "${BASH_SOURCE[0]}")"

MDIR="$E2E_TMP/m"
MSOCK="$MDIR/metrics.sock"
mkdir -m 0750 "$MDIR"

# A relative path: refused by the config check, with the file and line.
printf '[metrics]\nenabled = true\nlisten = "unix:metrics.sock"\n' >"$E2E_TMP/bad.toml"
rc=0
"$VRDMA" backend --check-config "$E2E_TMP/bad.toml" >"$E2E_TMP/check.out" 2>&1 || rc=$?
((rc != 0)) && grep -qF "$E2E_TMP/bad.toml:3: metrics.listen" "$E2E_TMP/check.out" &&
  grep -qF "absolute path" "$E2E_TMP/check.out" ||
  fail "relative unix path: rc $rc, $(cat "$E2E_TMP/check.out")"

cat >"$E2E_TMP/vrdmad.toml" <<TOML
[backend]
idle_exit_s = 0

[metrics]
enabled = true
listen = "unix:$MSOCK"
socket_mode = "0660"
guest_names = true
min_interval_ms = 0
TOML
"$VRDMA" backend --check-config "$E2E_TMP/vrdmad.toml" >"$E2E_TMP/check.out" 2>&1 ||
  fail "config rejected: $(cat "$E2E_TMP/check.out")"

# Starts the backend in the background (BPID) and waits for its metrics socket.
start_backend() {
  "$VRDMA" backend --socket "$VRDMA_SOCKET" --config "$E2E_TMP/vrdmad.toml" \
    >>"$E2E_TMP/vrdmad.log" 2>&1 &
  BPID=$!
  for ((i = 0; i < 100; i++)); do
    [[ -S $VRDMA_SOCKET && -S $MSOCK ]] && "$VRDMA" status >/dev/null 2>&1 && return 0
    kill -0 "$BPID" 2>/dev/null || fail "the backend exited: $(tail -n 5 "$E2E_TMP/vrdmad.log")"
    nap 0.1
  done
  fail "no metrics socket at $MSOCK"
}
scrape() { curl -sS --max-time 20 --unix-socket "$MSOCK" -o "$1" -D "$1.headers" http://localhost/metrics; }

# A backend killed with SIGKILL leaves its socket file: the next one replaces it.
start_backend
kill -KILL "$BPID"
wait "$BPID" 2>/dev/null || true
[[ -S $MSOCK ]] || fail "SIGKILL left no socket file (the next step tests nothing)"
start_backend
[[ "$(stat -c %a "$MSOCK")" == 660 ]] || fail "socket mode $(stat -c %a "$MSOCK"), want 660"
grep -qF "metrics on unix:$MSOCK" "$E2E_TMP/vrdmad.log" || fail "no log line for the socket"
"$VRDMA" status | grep -qF "metrics: unix:$MSOCK" || fail "status: $("$VRDMA" status | grep metrics)"

scrape "$E2E_TMP/idle.prom" || fail "scrape failed"
grep -qi '^content-type: text/plain; version=0.0.4' "$E2E_TMP/idle.prom.headers" ||
  fail "content type: $(cat "$E2E_TMP/idle.prom.headers")"
perl "$HERE/prom_check.pl" <"$E2E_TMP/idle.prom" || fail "idle exposition rejected"
grep -q '^vrdma_guests 0$' "$E2E_TMP/idle.prom" || fail "vrdma_guests is not 0"
[[ "$(curl -s --max-time 20 --unix-socket "$MSOCK" -o /dev/null -w '%{http_code}' \
  http://localhost/nope)" == 404 ]] || fail "unknown path"

# The backend's own user is an admin: it sees every guest.
start_held_pair pp mu-srv mu-cli
scrape "$E2E_TMP/pp.prom" || fail "scrape failed"
perl "$HERE/prom_check.pl" <"$E2E_TMP/pp.prom" || fail "exposition rejected"
for g in mu-srv mu-cli; do
  grep -q "^vrdma_resources{guest=\"$g\",kind=\"qp\"} 1$" "$E2E_TMP/pp.prom" || fail "$g: resources"
done

# A clean exit removes the socket file (the pingpong goes first: nothing may start another
# backend meanwhile).
for p in "$CLIENT_PID" "$SERVER_PID"; do
  kill_descendants "$p"
  kill -KILL "$p" 2>/dev/null || true
  wait "$p" 2>/dev/null || true
done
kill -TERM "$BPID"
wait_pid "$BPID" 20
[[ $WAIT_RC == 0 ]] || fail "the backend exited with $WAIT_RC on SIGTERM"
grep -qE "info: stopping on SIGTERM: [0-9]+ guest session\(s\) end$" "$E2E_TMP/vrdmad.log" ||
  fail "no shutdown line: $(tail -n 2 "$E2E_TMP/vrdmad.log")"
[[ ! -e $MSOCK ]] || fail "the socket file is left after a clean exit"

# A directory other users may write: refused, naming the path; nothing is made there.
chmod 0777 "$MDIR"
rc=0
timeout 20 "$VRDMA" backend --socket "$VRDMA_SOCKET" --config "$E2E_TMP/vrdmad.toml" \
  >"$E2E_TMP/start.out" 2>&1 || rc=$?
((rc != 0 && rc != 124)) && grep -qF "metrics listen unix:$MSOCK: $MDIR is writable by other users" \
  "$E2E_TMP/start.out" || fail "writable directory: rc $rc, $(cat "$E2E_TMP/start.out")"
[[ ! -e $MSOCK ]] || fail "a socket was made in a writable directory"
chmod 0750 "$MDIR"
e2e_pass
