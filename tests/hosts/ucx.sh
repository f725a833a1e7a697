#!/usr/bin/env bash
# Debian's unmodified UCX across two hosts: ucx_perftest tag_lat, tag_bw, ucp_put_bw and ucp_get
# between namespace hosts h1 (server) and h2 (client), with UCX_TLS=rc_verbs,ud_verbs and no
# other setting, through plain `vrdma run` (which shows UCX the device: device_view.h). The
# rc_verbs QPs (on an SRQ) go library to library (the direct path across backends, TLS between
# the libraries); the first messages and ud_verbs cross the backends' authenticated transport.
# Usage: ucx.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
command -v ucx_perftest >/dev/null || {
  echo "SKIP: ucx_perftest is not installed (scripts/deps.sh: ucx-utils)"
  exit 77
}
hosts_init "${1:-}" 2
wait_mesh
export UCX_TLS=rc_verbs,ud_verbs

for t in tag_lat tag_bw ucp_put_bw ucp_get; do
  port=$((20000 + RANDOM % 1000))
  hrun 1 --guest "ucx-$t-s" -- ucx_perftest -p "$port" -t "$t" -n 10000 \
    >"$E2E_TMP/$t.server.out" 2>&1 &
  srv=$!
  hwait_port 1 "$port" "$srv" "$t"
  hrun 2 --guest "ucx-$t-c" -- ucx_perftest -p "$port" -t "$t" -n 10000 "$(host_ip 1)" \
    >"$E2E_TMP/$t.client.out" 2>&1 &
  cli=$!
  wait_pid "$cli" 60
  [[ $WAIT_RC == 0 ]] || fail "$t: client exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/$t.client.out")"
  wait_pid "$srv" 20
  [[ $WAIT_RC == 0 ]] || fail "$t: server exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/$t.server.out")"
  row="$(grep -E '^Final: +10000 ' "$E2E_TMP/$t.client.out")" || fail "$t: no Final row"
  log "$t across hosts: $row"
  # rc_verbs' QPs are on an SRQ, which the libraries feed themselves (kDirectOfferSrq).
  grep -q "through its library" "$E2E_TMP/$t.client.out" "$E2E_TMP/$t.server.out" ||
    fail "$t: no QP went library to library: $(grep -h "direct" "$E2E_TMP/$t".*.out | tail -n 3)"
done
# They went over the transport, not a shortcut: the client's QPs were on tcp to h1.
grep -q "tcp to h1" "$E2E_TMP/vrdmad.h2.log" || fail "no QP of h2 went to h1 over tcp"
e2e_pass
