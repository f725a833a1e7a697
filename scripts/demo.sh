#!/usr/bin/env bash
# The demo, for a fresh Debian 12 machine (as root): installs the packages, builds the release
# preset, then runs Debian's unmodified ibv_devinfo and an ibv_rc_pingpong server + client on the
# vrdma device. Nothing is started by hand: the backend (vrdmad) starts on first use and exits
# after 60 idle seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

step "installing Debian packages"
"$ROOT/scripts/deps.sh"

step "building (cmake --preset release)"
cmake --preset release
cmake --build --preset release

VRDMA="$ROOT/build/release/bin/vrdma"
TMP="$(mktemp -d)"
SERVER_PID=""
cleanup() {
  if [[ -n $SERVER_PID ]]; then kill "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT

step "vrdma run -- ibv_devinfo -v"
"$VRDMA" run -- ibv_devinfo -v

# A free TCP port for the pingpong rendezvous (18515 is ibv_rc_pingpong's default).
port=18515
while [[ -n "$(ss -Htln "sport = :$port")" ]]; do port=$((port + 1)); done

step "vrdma run --guest demo-server -- ibv_rc_pingpong -p $port   (in the background)"
"$VRDMA" run --guest demo-server -- ibv_rc_pingpong -p "$port" >"$TMP/server.out" 2>&1 &
SERVER_PID=$!
for ((i = 0; i < 100; i++)); do
  [[ -n "$(ss -Htln "sport = :$port")" ]] && break
  kill -0 "$SERVER_PID" 2>/dev/null || break
  sleep 0.1
done

step "vrdma status   (the backend's view while the server waits)"
"$VRDMA" status || true

step "vrdma run --guest demo-client -- ibv_rc_pingpong -p $port localhost"
client_rc=0
"$VRDMA" run --guest demo-client -- ibv_rc_pingpong -p "$port" localhost || client_rc=$?

server_rc=0
wait "$SERVER_PID" || server_rc=$?
SERVER_PID=""
step "server output"
cat "$TMP/server.out"

if [[ $client_rc -ne 0 || $server_rc -ne 0 ]]; then
  echo "demo: pingpong failed (client exit $client_rc, server exit $server_rc)" >&2
  exit 1
fi
step "done: ibv_devinfo and ibv_rc_pingpong ran unmodified on vrdma0"
