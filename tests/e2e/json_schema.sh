#!/usr/bin/env bash
# Every `vrdma` command's JSON (-j and --json) against its schema (tests/e2e/schema/vrdma.json,
# checked by json_check.py): status, res show (each type, and the summary), stat (both counter
# sets and each alone: one shape), snapshot, restore, cluster init, add-node, show and status, and
# as root setup / setup --remove (in a mount namespace of the test's own). One vocabulary: every
# key is snake_case, and rows may carry only the keys their schema names. Also `vrdma status` says
# the effective configuration (config file, log, keep_state, direct paths). A verifying stream runs
# meanwhile and ends intact.
# Usage: json_schema.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command -v python3 >/dev/null || fail "python3 is not installed (scripts/deps.sh)"

# A backend of our own, from a config file, so that status has one to name.
printf '[backend]\nidle_exit_s = 0\nlog_level = "info"\n' >"$E2E_TMP/vrdmad.toml"
"$VRDMA" backend --socket "$VRDMA_SOCKET" --config "$E2E_TMP/vrdmad.toml" \
  >>"$E2E_TMP/vrdmad.log" 2>&1 &
for ((i = 0; i < 100; i++)); do [[ -S $VRDMA_SOCKET ]] && break; nap 0.05; done
[[ -S $VRDMA_SOCKET ]] || fail "the backend did not start"

# Checks what `vrdma ARGS...` prints against the schema of SCHEMA. Usage: check SCHEMA ARGS...
checked=()
check() {
  local schema=$1 out
  shift
  out="$E2E_TMP/json.$schema.out"
  "$VRDMA" "$@" >"$out" 2>&1 || fail "vrdma $*: $(cat "$out")"
  python3 "$here/json_check.py" "$here/schema/vrdma.json" "$schema" <"$out" >"$out.why" ||
    fail "vrdma $* does not match schema $schema: $(cat "$out.why")"
  checked+=("$*")
}

stream_start js
for ((i = 0; i < 200; i++)); do
  [[ $("$VRDMA" res show qp 2>/dev/null | grep -c 'state RTS') -ge 2 ]] && break
  nap 0.05
done
check status status -j
check status status --json
check res res show -j
for t in qp cq mr pd srq dm mw xrcd; do check "res_$t" res show "$t" -j; done
check res_qp res show qp guest js-c --json
check stat stat -j
check stat_qp stat qp -j
check stat_qp stat qp guest js-s --json
check stat_guest stat guest -j
check snapshot snapshot js-c "$E2E_TMP/js.snap" -j
check restore restore "$E2E_TMP/js.snap" --json
kill -USR1 "$cli_proc"
finish_stream js "$cli" "$srv" 60
check cluster_init cluster init --dir "$E2E_TMP/cluster" -j
check cluster_add_node cluster add-node n1 --dir "$E2E_TMP/cluster" --json
grep -qF '"copy":["ca.pem","n1.pem","n1.key"]' "$E2E_TMP/json.cluster_add_node.out" ||
  fail "cluster add-node -j: $(cat "$E2E_TMP/json.cluster_add_node.out")"
check cluster_show cluster show --dir "$E2E_TMP/cluster" -j
check cluster_status cluster status -j  # no TCP transport here: "off" (etcd: hosts.etcd_directory)
grep -q '"verdict":"ok"' "$E2E_TMP/json.cluster_show.out" || fail "cluster show -j: $(cat "$E2E_TMP/json.cluster_show.out")"

# The effective configuration, in text.
"$VRDMA" status >"$E2E_TMP/status.txt"
for re in "^config: $E2E_TMP/vrdmad.toml; log $E2E_TMP/vrdmad.log \(level info\); idle exit never\$" \
  '^keep_state: off$' '^direct paths: same host on, across backends on$' '^peers: none$'; do
  grep -Eq "$re" "$E2E_TMP/status.txt" || fail "status has no /$re/: $(cat "$E2E_TMP/status.txt")"
done

if [[ $(id -u) == 0 ]] && command -v unshare >/dev/null &&
  [[ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]]; then
  mkdir -p /dev/infiniband  # as in setup.sh: the mount point, as `vrdma run` makes it
  export VRDMA here
  # shellcheck disable=SC2016  # expanded in the namespace's shell
  unshare -m --propagation private bash -c 'set -e
    mount -t tmpfs vrdma-e2e-run /run
    "$VRDMA" setup -j | python3 "$here/json_check.py" "$here/schema/vrdma.json" setup
    "$VRDMA" setup --remove -j |
      python3 "$here/json_check.py" "$here/schema/vrdma.json" setup_remove' \
    >"$E2E_TMP/setup.out" 2>&1 || fail "setup -j: $(cat "$E2E_TMP/setup.out")"
  checked+=("setup -j" "setup --remove -j")
fi
log "match their schemas: ${checked[*]/#/vrdma }"
e2e_pass
