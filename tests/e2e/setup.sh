#!/usr/bin/env bash
# `vrdma setup` and `vrdma setup --remove` (src/cli/device_view.h): the device view for every
# program of the host, also those not started through `vrdma run`. The host here is a mount
# namespace of the test's own (unshare -m, private; a tmpfs on /run for the state file), so the
# machine's mounts are never touched. In it: setup puts uverbs0 and the sysfs view in place;
# programs started without `vrdma run` (ibv_devinfo -v through LD_LIBRARY_PATH, and ucx_info -d
# where installed) find the node and sysfs with the values of the guest setup named; a second
# setup says it is already there, one whose mounts were taken away by hand sets them up again;
# --remove leaves the mounts, /dev/infiniband and /run exactly
# as before; a second --remove has nothing to do. A user other than root is refused.
# Usage: setup.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
[[ $(id -u) == 0 ]] || {
  log "SKIP: needs root (setup mounts on /sys/class and /dev/infiniband)"
  exit 77
}
command -v unshare >/dev/null && command -v ibv_devinfo >/dev/null ||
  fail "unshare or ibv_devinfo missing (scripts/deps.sh)"
if [[ -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ]]; then
  log "SKIP: a kernel RDMA driver is loaded ($(ls /sys/class/infiniband)): setup refuses to hide it"
  exit 77
fi
# The mount point, as `vrdma run` as root makes it: setup would make it too and --remove take it
# away, but here another test's `vrdma run` may be using it at the same time.
mkdir -p /dev/infiniband
lib="$(dirname "$VRDMA")/../lib"
o="$E2E_TMP"
step() {  # NAME CMD...: CMD's output in NAME.out, its exit code in NAME.rc
  local name=$1
  shift
  "$@" >"$o/$name.out" 2>&1
  echo $? >"$o/$name.rc"
}
export -f step
export VRDMA lib o SAN_PRELOAD
# shellcheck disable=SC2016  # expanded in the namespace's shell
unshare -m --propagation private bash -c '
  mount -t tmpfs vrdma-e2e-run /run || exit 1
  mounts() { awk "\$5 ~ \"^(/sys/class|/dev/infiniband)(/|\$)\" {print \$5, \$(NF-2), \$(NF-1)}" \
    /proc/self/mountinfo | sort; }
  mounts >"$o/mounts_before"; ls -A /dev/infiniband /run >"$o/files_before"
  step setup "$VRDMA" setup --guest su-host
  step again "$VRDMA" setup --guest su-host -j
  # Unmounted by hand, the recorded view is set up again.
  umount -n -l /sys/class  # -n: no /run/mount/utab
  step redo "$VRDMA" setup --guest su-host -j
  step node stat -c "%F %a %t:%T" /dev/infiniband/uverbs0
  step sysfs bash -c "cd /sys/class/infiniband/vrdma0 && for f in node_guid ports/1/lid ports/1/gids/0; do echo \$f=\$(cat \$f); done; cat /sys/class/infiniband_verbs/uverbs0/ibdev; ls /sys/class/net"
  step devinfo env VRDMA_GUEST=su-host LD_LIBRARY_PATH="$lib" ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} ibv_devinfo -v
  if command -v ucx_info >/dev/null; then
    step ucx env VRDMA_GUEST=su-host LD_LIBRARY_PATH="$lib" ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} ucx_info -d
  fi
  step remove "$VRDMA" setup --remove
  mounts >"$o/mounts_after"; ls -A /dev/infiniband /run >"$o/files_after"
  step remove2 "$VRDMA" setup --remove
  step user setpriv --reuid=65534 --regid=65534 --clear-groups "$VRDMA" setup
' || fail "unshare -m failed"

rc() { cat "$o/$1.rc"; }
[[ $(rc setup) == 0 ]] || fail "vrdma setup: $(cat "$o/setup.out")"
grep -q '^vrdma setup: /dev/infiniband/uverbs0 (character device 231:192) and /sys/class/infiniband/vrdma0 for guest su-host' \
  "$o/setup.out" || fail "vrdma setup said: $(cat "$o/setup.out")"
[[ $(rc again) == 0 ]] && grep -q '"already":true' "$o/again.out" ||
  fail "a second setup: $(cat "$o/again.out")"
[[ $(rc redo) == 0 ]] && grep -q '"already":false' "$o/redo.out" ||
  fail "setup after the view was unmounted by hand: $(cat "$o/redo.out")"
[[ $(cat "$o/node.out") == "character special file 666 e7:c0" ]] ||
  fail "uverbs0 outside vrdma run: $(cat "$o/node.out")"
[[ $(rc sysfs) == 0 ]] && grep -qx vrdma0 "$o/sysfs.out" && grep -qx lo "$o/sysfs.out" ||
  fail "sysfs outside vrdma run: $(cat "$o/sysfs.out")"
[[ $(rc devinfo) == 0 ]] || fail "ibv_devinfo -v without vrdma run: $(tail -n 3 "$o/devinfo.out")"
view() { sed -n "s|^$1=||p" "$o/sysfs.out"; }
devinfo() { awk -v k="$1:" '$1 == k {print $2; exit}' "$o/devinfo.out"; }
[[ $(view node_guid) == "$(devinfo node_guid)" ]] ||
  fail "node_guid: sysfs $(view node_guid), ibv_devinfo $(devinfo node_guid)"
[[ $(($(view ports/1/lid))) == "$(devinfo port_lid)" ]] ||
  fail "lid: sysfs $(view ports/1/lid), ibv_devinfo $(devinfo port_lid)"
[[ $(view ports/1/gids/0) == "$(awk '$1 == "GID[" && $2 == "0]:" {print $3; exit}' "$o/devinfo.out")" ]] ||
  fail "gid: sysfs $(view ports/1/gids/0) differs from ibv_devinfo's"
log "outside vrdma run: $(cat "$o/node.out"); sysfs = ibv_devinfo -v for guest su-host"
if [[ -f $o/ucx.rc ]]; then
  for tl in rc_verbs ud_verbs; do
    grep -A1 "Transport: $tl\$" "$o/ucx.out" | grep -q "Device: vrdma0:1" ||
      fail "ucx_info -d without vrdma run lists no $tl on vrdma0:1"
  done
  log "ucx_info -d without vrdma run: rc_verbs and ud_verbs on vrdma0:1"
fi
[[ $(rc remove) == 0 ]] || fail "vrdma setup --remove: $(cat "$o/remove.out")"
diff "$o/mounts_before" "$o/mounts_after" >&2 || fail "--remove left mounts behind"
diff "$o/files_before" "$o/files_after" >&2 || fail "--remove left files behind"
[[ $(rc remove2) == 0 ]] && grep -q 'nothing to remove' "$o/remove2.out" ||
  fail "a second --remove: $(cat "$o/remove2.out")"
[[ $(rc user) == 1 ]] && grep -q 'needs root' "$o/user.out" ||
  fail "setup as a user: rc $(rc user): $(cat "$o/user.out")"
log "--remove: $(tr '\n' ' ' <"$o/remove.out")"
e2e_pass
