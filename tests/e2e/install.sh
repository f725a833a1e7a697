#!/usr/bin/env bash
# `cmake --install`: into a DESTDIR with prefix /usr, the layout is bin/, lib/vrdma/ (nothing
# that would shadow the system's libibverbs), /etc/vrdma and the systemd units. Installed under a
# temporary prefix: the units pass `systemd-analyze verify` and the service's sandbox rates at
# most 3.0 in `systemd-analyze security`; `vrdma run -- ibv_devinfo` uses the
# installed library and starts the installed vrdmad; the installed library alone
# (LD_LIBRARY_PATH) starts it too; and vrdmad started by socket activation
# (systemd-socket-activate, as vrdmad.socket does it) serves ibv_devinfo on the inherited socket.
# Usage: install.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
BUILD="$(cd "$1/.." && pwd)"

# Packaging layout, as a distribution package would be built.
D="$E2E_TMP/destdir"
DESTDIR="$D" cmake --install "$BUILD" --prefix /usr >"$E2E_TMP/install.out" 2>&1 ||
  fail "cmake --install: $(cat "$E2E_TMP/install.out")"
for f in usr/bin/vrdma usr/bin/vrdmad usr/lib/vrdma/libibverbs.so.1 etc/vrdma/vrdmad.toml \
  usr/lib/systemd/system/vrdmad.service usr/lib/systemd/system/vrdmad.socket \
  usr/lib/systemd/system/vrdmad-keeper.service usr/lib/systemd/system/vrdmad-keeper.socket \
  usr/lib/systemd/system/vrdma-setup.service \
  usr/share/doc/vrdma/vrdmad.toml usr/share/doc/vrdma/README.md usr/share/doc/vrdma/TESTING.md \
  usr/share/doc/vrdma/BENCHMARKS.md usr/share/doc/vrdma/docs/ARCHITECTURE.md; do
  [[ -e $D/$f ]] || fail "not installed: /$f ($(find "$D" -type f | sed "s|^$D||" | tr '\n' ' '))"
done
shadow="$(find "$D" -name 'libibverbs*' ! -path "$D/usr/lib/vrdma/*")"
[[ -z $shadow ]] || fail "a libibverbs outside lib/vrdma: $shadow"
grep -qx 'ExecStart=/usr/bin/vrdmad --config /etc/vrdma/vrdmad.toml' \
  "$D/usr/lib/systemd/system/vrdmad.service" || fail "ExecStart: $(grep Exec "$D"/usr/lib/systemd/system/vrdmad.service)"
grep -qx 'ListenSequentialPacket=/run/vrdma/vrdmad.sock' "$D/usr/lib/systemd/system/vrdmad.socket" ||
  fail "the socket unit does not listen on /run/vrdma/vrdmad.sock"
# An edited config survives a reinstall.
echo '# mine' >>"$D/etc/vrdma/vrdmad.toml"
DESTDIR="$D" cmake --install "$BUILD" --prefix /usr >/dev/null 2>&1 || fail "second install"
grep -q '^# mine$' "$D/etc/vrdma/vrdmad.toml" || fail "reinstall overwrote /etc/vrdma/vrdmad.toml"

# A runnable install under a temporary prefix.
P="$E2E_TMP/prefix"
cmake --install "$BUILD" --prefix "$P" >"$E2E_TMP/install.out" 2>&1 ||
  fail "cmake --install --prefix: $(cat "$E2E_TMP/install.out")"
"$P/bin/vrdmad" --config "$P/etc/vrdma/vrdmad.toml" --check-config >/dev/null ||
  fail "the installed config does not validate"
if command -v systemd-analyze >/dev/null; then
  (cd "$P/lib/systemd/system" && systemd-analyze verify ./vrdmad.socket ./vrdmad.service \
    ./vrdmad-keeper.socket ./vrdmad-keeper.service ./vrdma-setup.service) \
    >"$E2E_TMP/verify.out" 2>&1 || fail "systemd-analyze verify: $(cat "$E2E_TMP/verify.out")"
  [[ ! -s $E2E_TMP/verify.out ]] || fail "systemd-analyze verify warns: $(cat "$E2E_TMP/verify.out")"
  # The service's sandbox (issue 29: 9.0 UNSAFE before): at most 3.0 ("OK").
  systemd-analyze security --offline=true --threshold=30 "$P/lib/systemd/system/vrdmad.service" \
    >"$E2E_TMP/security.out" 2>&1 ||
    fail "vrdmad.service is exposed: $(grep 'Overall exposure' "$E2E_TMP/security.out")"
  log "vrdmad.service: $(grep -o 'Overall exposure level.*' "$E2E_TMP/security.out")"
  systemd-analyze security --offline=true --threshold=30 "$P/lib/systemd/system/vrdmad-keeper.service" \
    >"$E2E_TMP/security.out" 2>&1 ||
    fail "vrdmad-keeper.service is exposed: $(grep 'Overall exposure' "$E2E_TMP/security.out")"
  log "vrdmad-keeper.service: $(grep -o 'Overall exposure level.*' "$E2E_TMP/security.out")"
else
  log "no systemd-analyze; units not verified"
fi

# The exe of the backend serving $VRDMA_SOCKET.
backend_exe() {
  local pid
  pid="$(backend_pid)"
  [[ -n $pid ]] && readlink "/proc/$pid/exe"
}
# Our sanitized library in uninstrumented tools needs the sanitizer runtime preloaded.
run_installed() { env ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} "$@"; }

# `vrdma run` from the install: the installed library, the installed backend.
run_installed "$P/bin/vrdma" run -- ibv_devinfo -l >"$E2E_TMP/devinfo.out" 2>&1 ||
  fail "installed vrdma run ibv_devinfo: $(cat "$E2E_TMP/devinfo.out")"
grep -q vrdma0 "$E2E_TMP/devinfo.out" || fail "no vrdma0: $(cat "$E2E_TMP/devinfo.out")"
[[ "$(backend_exe)" == "$P/bin/vrdmad" ]] || fail "backend is '$(backend_exe)', not $P/bin/vrdmad"
# (No sanitizer runtime preloaded here: `sh` loads no libibverbs, and TSan preloaded into an
# uninstrumented shell has crashed it.)
"$P/bin/vrdma" run -- sh -c 'echo "$LD_LIBRARY_PATH"' >"$E2E_TMP/ld.out" 2>"$E2E_TMP/ld.err"
[[ "$(cut -d: -f1 "$E2E_TMP/ld.out")" == "$P/lib/vrdma" ]] || fail "LD_LIBRARY_PATH: $(cat "$E2E_TMP/ld.out")"
kill -TERM "$(backend_pid)"
for ((i = 0; i < 50; i++)); do
  [[ -z "$(backend_pid)" ]] && break
  nap 0.1
done

# The installed library on its own finds the installed backend (lib/vrdma/../../bin/vrdmad).
run_installed env -u VRDMA_BACKEND LD_LIBRARY_PATH="$P/lib/vrdma" ibv_devinfo >"$E2E_TMP/lib.out" 2>&1 ||
  fail "ibv_devinfo with the installed library: $(cat "$E2E_TMP/lib.out")"
grep -q 'hca_id:.*vrdma0' "$E2E_TMP/lib.out" || fail "no vrdma0: $(cat "$E2E_TMP/lib.out")"
[[ "$(backend_exe)" == "$P/bin/vrdmad" ]] || fail "autostarted backend is '$(backend_exe)'"
kill -TERM "$(backend_pid)"
for ((i = 0; i < 50; i++)); do
  [[ -z "$(backend_pid)" ]] && break
  nap 0.1
done

# Socket activation: systemd-socket-activate owns the socket and starts vrdmad on the first
# connection with LISTEN_FDS, as vrdmad.socket does.
if command -v systemd-socket-activate >/dev/null; then
  rm -f "$VRDMA_SOCKET"
  systemd-socket-activate --seqpacket -l "$VRDMA_SOCKET" \
    "$P/bin/vrdmad" --socket "$VRDMA_SOCKET" >"$E2E_TMP/vrdmad.log" 2>&1 &
  for ((i = 0; i < 100; i++)); do
    [[ -S $VRDMA_SOCKET ]] && break
    nap 0.1
  done
  run_installed "$P/bin/vrdma" run -- ibv_devinfo -l >"$E2E_TMP/activated.out" 2>&1 ||
    fail "ibv_devinfo on an activated socket: $(cat "$E2E_TMP/activated.out")"
  grep -q vrdma0 "$E2E_TMP/activated.out" || fail "no vrdma0: $(cat "$E2E_TMP/activated.out")"
  [[ "$(backend_exe)" == "$P/bin/vrdmad" ]] || fail "no activated backend"
  [[ "$("$P/bin/vrdma" status --json | grep -o '"socket":"[^"]*"')" == "\"socket\":\"$VRDMA_SOCKET\"" ]] ||
    fail "status: $("$P/bin/vrdma" status --json)"
  grep -q "listening on $VRDMA_SOCKET (socket activation)" "$E2E_TMP/vrdmad.log" ||
    fail "the backend did not take the inherited socket: $(cat "$E2E_TMP/vrdmad.log")"
else
  log "no systemd-socket-activate; socket activation not tested"
fi
e2e_pass
