#!/usr/bin/env bash
# The Debian package, as a packager and then a new user would meet it: `dpkg-buildpackage -us -uc
# -b` on a copy of the source tree builds vrdma_*.deb with Debian's compiler flags (no -Werror);
# lintian reports no error; `apt-get install ./vrdma_*.deb` puts vrdmad, vrdma, the systemd units
# (the socket enabled) and the /etc/vrdma conffile in place and the drop-in library in
# /usr/lib/<triplet>/vrdma only; the installed `vrdma run` serves ibv_devinfo and an
# ibv_rc_pingpong pair; `apt-get purge` removes all of it and leaves rdma-core's libibverbs1
# exactly as it was (dpkg --verify), still loaded by Debian's tools.
# Skips (77) without dpkg-buildpackage and debhelper, or when a vrdma package is already installed
# (the test never touches one it did not install).
# Usage: package.sh BIN_DIR SOURCE_DIR
: "${E2E_DEADLINE:=380}"  # ctest gives this test 400 s: a compile of the product beside other tests
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
SRC="$(cd "${2:?usage: $0 BIN_DIR SOURCE_DIR}" && pwd)"
for tool in dpkg-buildpackage dh apt-get; do
  command -v "$tool" >/dev/null || {
    echo "package: no $tool (scripts/deps.sh installs it); skipped"
    exit 77
  }
done
if dpkg-query -W -f='${Status}' vrdma 2>/dev/null | grep -q 'ok installed'; then
  echo "package: a vrdma package is installed on this machine; skipped (remove it to run this test)"
  exit 77
fi
e2e_init "${1:-}"
[[ -z $SAN_PRELOAD ]] || fail "run this test from a plain build: the package builds its own binaries"

INSTALLED=0
package_cleanup() {
  local rc=$?
  set +e
  if ((INSTALLED)) && dpkg-query -W -f='${Status}' vrdma 2>/dev/null | grep -q 'ok installed'; then
    kill_descendants $$
    pid="$(backend_pid)"
    [[ -n $pid ]] && kill -KILL "$pid"
    DEBIAN_FRONTEND=noninteractive apt-get purge -y vrdma >>"$E2E_TMP/purge.out" 2>&1 ||
      log "could not purge vrdma: $(tail -n 3 "$E2E_TMP/purge.out")"
  fi
  (exit "$rc")
  e2e_cleanup
}
trap package_cleanup EXIT

# 1. Build, from a copy of the tree (dpkg-buildpackage writes into debian/ and the parent dir).
mkdir -p "$E2E_TMP/pkg/vrdma"
if git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$SRC" ls-files -co --exclude-standard -z | tar -C "$SRC" --null -T - -cf - |
    tar -C "$E2E_TMP/pkg/vrdma" -xf -
else
  tar -C "$SRC" --exclude=./build --exclude='./obj-*' -cf - . | tar -C "$E2E_TMP/pkg/vrdma" -xf -
fi
log "dpkg-buildpackage"
# Both cores (the suite's other slot mostly waits on network tests), and no -dbgsym package (a
# second pass over every binary that this test never installs). Debian's flags otherwise, but
# line tables only (-g1 after Debian's -g): the full debug information that nothing here reads
# made this compile, the longest step of the suite, about a third slower; and `noopt` (-O0,
# which also drops _FORTIFY_SOURCE): this test checks the packaging, not the optimizer, and the
# compile took 72 s instead of 53 s (112 s of CPU instead of 78) with -O2. lintian says the same.
# Each target one unity batch (debian/rules: VRDMA_UNITY_BATCH): a fifth less CPU than batches of
# 8 (BENCHMARKS.md, CI time); the test's other slot keeps the second core busy.
(cd "$E2E_TMP/pkg/vrdma" &&
  DEB_BUILD_OPTIONS="parallel=$(nproc) noautodbgsym noopt" DEB_CFLAGS_APPEND=-g1 \
    DEB_CXXFLAGS_APPEND=-g1 VRDMA_UNITY_BATCH=0 dpkg-buildpackage -us -uc -b) \
  >"$E2E_TMP/build.log" 2>&1 ||
  fail "dpkg-buildpackage: $(tail -n 20 "$E2E_TMP/build.log")"
grep -q -- '-Werror ' "$E2E_TMP/build.log" && fail "the package build used -Werror"
deb="$(ls "$E2E_TMP"/pkg/vrdma_*_"$(dpkg --print-architecture)".deb)"
[[ -f $deb ]] || fail "no .deb: $(ls "$E2E_TMP/pkg")"
MA="$(dpkg-architecture -qDEB_HOST_MULTIARCH)"
contents="$(dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\./|/|')"
for f in /usr/bin/vrdma /usr/bin/vrdmad "/usr/lib/$MA/vrdma/libibverbs.so.1" /etc/vrdma/vrdmad.toml \
  /lib/systemd/system/vrdmad.socket /lib/systemd/system/vrdmad.service \
  /lib/systemd/system/vrdmad-keeper.socket /lib/systemd/system/vrdmad-keeper.service \
  /lib/systemd/system/vrdma-setup.service; do
  grep -qx "$f" <<<"$contents" || fail "the package has no $f: $contents"
done
shadow="$(grep 'libibverbs' <<<"$contents" | grep -v "^/usr/lib/$MA/vrdma/" || true)"
[[ -z $shadow ]] || fail "a libibverbs outside the private directory: $shadow"
# A private library: no shlibs entry or ldconfig trigger that would stand in for rdma-core's.
dpkg-deb --ctrl-tarfile "$deb" | tar -t | grep -Eq '(shlibs|triggers)$' &&
  fail "the package declares shlibs or triggers"
if command -v lintian >/dev/null; then
  lintian "$E2E_TMP"/pkg/vrdma_*.changes >"$E2E_TMP/lintian.out" 2>&1
  ! grep -q '^E: ' "$E2E_TMP/lintian.out" || fail "lintian errors: $(grep '^E: ' "$E2E_TMP/lintian.out")"
  log "lintian: $(grep -c '^[WE]: ' "$E2E_TMP/lintian.out") warnings, no errors"
else
  log "no lintian; not checked"
fi

# 2. Install it. rdma-core's library first, to compare after the purge.
ibv_before="$(dpkg-query -W -f='${Version}' libibverbs1)"
dpkg --verify libibverbs1 >"$E2E_TMP/verify.before" 2>&1 || true
INSTALLED=1
DEBIAN_FRONTEND=noninteractive apt-get install -y "$deb" >"$E2E_TMP/install.out" 2>&1 ||
  fail "apt-get install: $(tail -n 10 "$E2E_TMP/install.out")"
[[ "$(dpkg-query -W -f='${Status}' vrdma)" == "install ok installed" ]] || fail "vrdma not installed"
dpkg-query -W -f='${Conffiles}\n' vrdma | grep -q '/etc/vrdma/vrdmad.toml' ||
  fail "/etc/vrdma/vrdmad.toml is not a conffile"
[[ -L /etc/systemd/system/sockets.target.wants/vrdmad.socket ]] || fail "vrdmad.socket is not enabled"
# The keeper's socket comes with the service (Wants=); the boot-time setup is the operator's choice.
enabled="$(find /etc/systemd/system -name 'vrdmad-keeper*' -o -name 'vrdma-setup*' | tr '\n' ' ')"
[[ -z $enabled ]] || fail "enabled by the package: $enabled"
if command -v systemd-analyze >/dev/null; then
  systemd-analyze verify /lib/systemd/system/vrdmad.socket /lib/systemd/system/vrdmad.service \
    /lib/systemd/system/vrdmad-keeper.socket /lib/systemd/system/vrdmad-keeper.service \
    /lib/systemd/system/vrdma-setup.service \
    >"$E2E_TMP/analyze.out" 2>&1 || fail "systemd-analyze verify: $(cat "$E2E_TMP/analyze.out")"
fi
/usr/bin/vrdmad --config /etc/vrdma/vrdmad.toml --check-config >/dev/null ||
  fail "the installed config does not validate"

# 3. Use it as a new user would: the installed vrdma, its library and its backend.
VRUN=(/usr/bin/vrdma run)
vrun -- sh -c 'echo "$LD_LIBRARY_PATH"' >"$E2E_TMP/ld.out" 2>"$E2E_TMP/ld.err"
[[ "$(cut -d: -f1 "$E2E_TMP/ld.out")" == "/usr/lib/$MA/vrdma" ]] ||
  fail "vrdma run puts '$(cat "$E2E_TMP/ld.out")' first in LD_LIBRARY_PATH"
vrun -- ibv_devinfo >"$E2E_TMP/devinfo.out" 2>&1 || fail "ibv_devinfo: $(cat "$E2E_TMP/devinfo.out")"
grep -q 'hca_id:.*vrdma0' "$E2E_TMP/devinfo.out" || fail "no vrdma0: $(cat "$E2E_TMP/devinfo.out")"
[[ "$(readlink "/proc/$(backend_pid)/exe")" == /usr/bin/vrdmad ]] ||
  fail "the backend is not the installed vrdmad"
run_pair installed pkg-srv pkg-cli -n 1000
kill -TERM "$(backend_pid)"
for ((i = 0; i < 50; i++)); do
  [[ -z "$(backend_pid)" ]] && break
  nap 0.1
done

# 4. Purge: nothing of vrdma left, rdma-core's library untouched and in use again.
DEBIAN_FRONTEND=noninteractive apt-get purge -y vrdma >"$E2E_TMP/purge.out" 2>&1 ||
  fail "apt-get purge: $(tail -n 10 "$E2E_TMP/purge.out")"
INSTALLED=0
for f in /usr/bin/vrdma /usr/bin/vrdmad "/usr/lib/$MA/vrdma" /etc/vrdma /lib/systemd/system/vrdmad.socket \
  /etc/systemd/system/sockets.target.wants/vrdmad.socket /lib/systemd/system/vrdmad-keeper.socket \
  /lib/systemd/system/vrdma-setup.service; do
  [[ ! -e $f && ! -L $f ]] || fail "$f is left after the purge"
done
[[ "$(dpkg-query -W -f='${Status} ${Version}' libibverbs1)" == "install ok installed $ibv_before" ]] ||
  fail "libibverbs1 changed: $(dpkg-query -W -f='${Status} ${Version}' libibverbs1)"
dpkg --verify libibverbs1 >"$E2E_TMP/verify.after" 2>&1 || true
cmp -s "$E2E_TMP/verify.before" "$E2E_TMP/verify.after" ||
  fail "libibverbs1's files changed: $(cat "$E2E_TMP/verify.after")"
lib="$(ldd "$(command -v ibv_devinfo)" | awk '/libibverbs.so.1/ {print $3}')"
[[ $lib == */$MA/libibverbs.so.1 && $lib != */vrdma/* && -e $lib ]] ||
  fail "ibv_devinfo now loads '$lib'"
log "built, installed, ran ibv_rc_pingpong, purged; libibverbs1 $ibv_before untouched"
e2e_pass
