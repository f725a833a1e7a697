#!/usr/bin/env bash
# Debian's unmodified UCX (ucx_perftest) over vrdma's rc_verbs and ud_verbs on one host:
# tag_lat, tag_bw, ucp_put_bw and ucp_get, with UCX_TLS=rc_verbs,ud_verbs and no other setting.
# UCX ends each endpoint with a flush, a zero-length RDMA WRITE with rkey 0 and address 0, that
# the device once failed with REM_ACCESS_ERR (UCX then aborted). UCX only takes a device whose
# /dev/infiniband/uverbs0 exists: plain `vrdma run` shows it one (device_view.h).
# Usage: ucx_rc_verbs.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
command -v ucx_perftest >/dev/null || fail "ucx_perftest is not installed (scripts/deps.sh: ucx-utils)"
export UCX_TLS=rc_verbs,ud_verbs

vrun -- ucx_info -d >"$E2E_TMP/ucx_info.out" 2>&1 || fail "ucx_info -d failed"
if grep -q '^vrdma run: no /dev/infiniband/uverbs0' "$E2E_TMP/ucx_info.out"; then
  log "SKIP: $(grep '^vrdma run: no /dev/infiniband/uverbs0' "$E2E_TMP/ucx_info.out")"
  exit 77
fi
for tl in rc_verbs ud_verbs; do
  grep -A1 "Transport: $tl\$" "$E2E_TMP/ucx_info.out" | grep -q "Device: vrdma0:1" ||
    fail "ucx_info -d lists no $tl on vrdma0:1: $(grep -E 'Transport|Device' "$E2E_TMP/ucx_info.out")"
done

# ucx_perftest takes perftest's -p PORT and server name, so run_perftest serves it as well.
for t in tag_lat tag_bw ucp_put_bw ucp_get; do
  run_perftest ucx_perftest -t "$t" -n 10000
  row="$(grep -E '^Final: +10000 ' "$E2E_TMP/ucx_perftest.client.out")" || fail "$t: no Final row"
  log "$t: $row"
done
e2e_pass
