#!/usr/bin/env bash
# What `vrdma run` shows the program where verbs consumers look (src/cli/device_view.h):
# /dev/infiniband/uverbs0, a character device it may read and write, and a sysfs view of vrdma0
# whose values are those `ibv_devinfo -v` gets through the library for the same guest; the rest
# of /sys/class reads as before (also inside `ip netns exec`), nothing is left on the host, and
# --no-view / VRDMA_VIEW=0 leave the mounts alone. Then, as a user with no privilege (made here
# and removed), `ucx_info -d` lists rc_verbs and ud_verbs on vrdma0:1, where the kernel allows
# unprivileged user namespaces (else that part is skipped, with the reason).
# Usage: device_view.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=../security/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../security/lib.sh"
E2E_NAME=device_view
e2e_init "${1:-}"
command -v ibv_devinfo >/dev/null || fail "ibv_devinfo is not installed (scripts/deps.sh)"
[[ $(id -u) == 0 ]] || {
  log "SKIP: needs root (it creates a user)"
  exit 77
}
host_mounts="$(grep -c ' /sys/class \| /dev/infiniband ' /proc/self/mountinfo || true)"

# The view, as the program reads it; ibv_devinfo's values for the same guest.
# shellcheck disable=SC2016  # expanded by the program's shell
vrun --guest dv -- bash -c 'set -e
  stat -c "node %F %a" /dev/infiniband/uverbs0
  [[ -r /dev/infiniband/uverbs0 && -w /dev/infiniband/uverbs0 ]] && echo node rw
  cd /sys/class/infiniband/vrdma0
  for f in node_type node_guid sys_image_guid fw_ver board_id ports/1/{state,phys_state,lid,sm_lid,lid_mask_count,link_layer,rate,gids/0,gid_attrs/types/0,pkeys/0}; do
    echo "$f=$(cat "$f")"
  done
  echo "ibdev=$(cat /sys/class/infiniband_verbs/uverbs0/ibdev)"
  ls /sys/class/net/lo/address >/dev/null && echo net ok' >"$E2E_TMP/view.out" 2>&1 ||
  fail "the program cannot read the view: $(cat "$E2E_TMP/view.out")"
vrun --guest dv -- ibv_devinfo -v >"$E2E_TMP/devinfo.out" 2>&1 || fail "ibv_devinfo -v failed"
view() { sed -n "s|^$1=||p" "$E2E_TMP/view.out"; }
devinfo() { awk -v k="$1:" '$1 == k {print $2; exit}' "$E2E_TMP/devinfo.out"; }
grep -qx "node character special file 666" "$E2E_TMP/view.out" || fail "uverbs0: $(head -n 2 "$E2E_TMP/view.out")"
grep -qx "node rw" "$E2E_TMP/view.out" || fail "uverbs0 is not readable and writable"
grep -qx "net ok" "$E2E_TMP/view.out" || fail "/sys/class/net is gone under the view"
check() {  # NAME VIEW_VALUE DEVINFO_VALUE
  [[ $2 == "$3" ]] || fail "$1: sysfs says '$2', ibv_devinfo -v '$3'"
}
check node_guid "$(view node_guid)" "$(devinfo node_guid)"
check sys_image_guid "$(view sys_image_guid)" "$(devinfo sys_image_guid)"
check fw_ver "$(view fw_ver)" "$(devinfo fw_ver)"
check board_id "$(view board_id)" "$(devinfo board_id)"
check state "$(view ports/1/state)" "$(devinfo state | sed 's/PORT_ACTIVE/4: ACTIVE/')"
check phys_state "$(view ports/1/phys_state)" "$(devinfo phys_state | sed 's/LINK_UP/5: LinkUp/')"
check lid "$(($(view ports/1/lid)))" "$(devinfo port_lid)"
check sm_lid "$(($(view ports/1/sm_lid)))" "$(devinfo sm_lid)"
check lmc "$(view ports/1/lid_mask_count)" "$(($(devinfo port_lmc)))"
check link_layer "$(view ports/1/link_layer)" "$(devinfo link_layer)"
check gid "$(view ports/1/gids/0)" "$(awk '$1 == "GID[" && $2 == "0]:" {print $3; exit}' "$E2E_TMP/devinfo.out")"
check node_type "$(view node_type)" "1: CA"
check ibdev "$(view ibdev)" "vrdma0"
log "sysfs view matches ibv_devinfo -v: $(tr '\n' ' ' <"$E2E_TMP/view.out")"

# Nothing reached the host; the switches leave the program's mounts as they are.
[[ "$(grep -c ' /sys/class \| /dev/infiniband ' /proc/self/mountinfo || true)" == "$host_mounts" ]] ||
  fail "the view's mounts leaked to the host: $(grep ' /sys/class \| /dev/infiniband ' /proc/self/mountinfo)"
if [[ ! -e /sys/class/infiniband/vrdma0 ]]; then
  ! vrun --no-view -- test -e /sys/class/infiniband/vrdma0 || fail "--no-view still shows the view"
  ! VRDMA_VIEW=0 vrun -- test -e /sys/class/infiniband/vrdma0 || fail "VRDMA_VIEW=0 still shows it"
fi

# Inside `ip netns exec` (its own /sys): the view sits on that namespace's sysfs.
ns="vrdv$$"
if ip netns add "$ns" 2>/dev/null; then
  nets="$(ip netns exec "$ns" "${VRUN[@]}" -- bash -c \
    'ls /sys/class/net; test -e /sys/class/infiniband/vrdma0 && echo view' 2>&1)" || true
  ip netns del "$ns"
  [[ $(tr '\n' ' ' <<<"$nets") == "lo view " ]] || fail "in ip netns exec: $nets"
  log "in ip netns exec: the namespace's /sys/class/net (lo) and the view"
fi

# As a user without privilege, with a backend of its own (a socket directory of its own: the
# library accepts no other user's but root's, which a user namespace cannot map).
sec_users "$1"
udir="$E2E_TMP/out/$VICTIM"
mkdir -m 0700 "$udir"
chown "$VICTIM" "$udir"
become "$VICTIM" env VRDMA_SOCKET="$udir/vrdmad.sock" ${SAN_PRELOAD:+LD_PRELOAD=$SAN_PRELOAD} \
  "$VRDMA" run -- bash -c 'id -u; ucx_info -d' >"$E2E_TMP/ucx_user.out" 2>&1 ||
  fail "ucx_info -d as $VICTIM failed: $(tail -n 5 "$E2E_TMP/ucx_user.out")"
if why="$(grep '^vrdma run: no /dev/infiniband/uverbs0' "$E2E_TMP/ucx_user.out")"; then
  log "SKIP (as a user): $why"
  e2e_pass
  exit 0
fi
[[ $(grep -m1 -x '[0-9]*' "$E2E_TMP/ucx_user.out") == "$(id -u "$VICTIM")" ]] ||
  fail "the program did not run as $VICTIM's uid: $(head -n 1 "$E2E_TMP/ucx_user.out")"
for tl in rc_verbs ud_verbs; do
  grep -A1 "Transport: $tl\$" "$E2E_TMP/ucx_user.out" | grep -q "Device: vrdma0:1" ||
    fail "as $VICTIM, ucx_info -d lists no $tl on vrdma0:1"
done
log "as $VICTIM (uid $(id -u "$VICTIM")): ucx_info -d lists rc_verbs and ud_verbs on vrdma0:1"
e2e_pass
