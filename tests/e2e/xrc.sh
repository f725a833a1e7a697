#!/usr/bin/env bash
# XRC through vrdma on one host (docs/ARCHITECTURE.md, "XRC"): Debian's unmodified
# ibv_xsrq_pingpong (an XRC domain opened by a file, an XRC SRQ, a receive and a send QP per
# client, each WR naming the peer's SRQ number), with one client and with two clients of one
# server (-c 2, completion events), and perftest's XRC mode (-c XRC) of ib_send_bw, ib_send_lat,
# ib_write_bw and ib_read_bw. Every program runs through `vrdma run` in a guest of its own.
# Usage: xrc.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

# ibv_xsrq_pingpong opens this path with O_CREAT and never removes it: ours goes at the end.
DOMAIN_FILE=/tmp/xrc_domain
[[ -e $DOMAIN_FILE ]] && HAD_DOMAIN_FILE=1 || HAD_DOMAIN_FILE=0
trap 'rc=$?; set +e; [[ $HAD_DOMAIN_FILE == 1 ]] || rm -f "$DOMAIN_FILE"; (exit $rc); e2e_cleanup' EXIT

PP_TOOL=ibv_xsrq_pingpong
# One server, CLIENTS clients (guests xs, xc1, xc2...); every one prints "success" at the end.
xsrq() {
  local name=$1 clients=$2 i pids=()
  shift 2
  start_server "$name" xs -c "$clients" "$@"
  for ((i = 1; i <= clients; i++)); do
    "${VRUN[@]}" --guest "xc$i" -- "$PP_TOOL" -p "$PORT" "$@" localhost \
      >"$E2E_TMP/$name.client$i.out" 2>&1 &
    pids+=($!)
  done
  for ((i = 1; i <= clients; i++)); do
    wait_success "$name: client $i" "${pids[i - 1]}" "$E2E_TMP/$name.client$i.out" 30
  done
  wait_success "$name: server" "$SERVER_PID" "$E2E_TMP/$name.server.out" 10
  log "$name: ok ($clients client(s): $*)"
}

xsrq xsrq 1 -n 200
xsrq xsrq_two_clients_events 2 -n 200 -e
xsrq xsrq_large 1 -n 50 -s 65536

# perftest: an XRC send QP per connection into the peer's XRC SRQ.
for tool in ib_send_bw ib_send_lat ib_write_bw ib_read_bw; do
  run_perftest "$tool" -c XRC -n 1000
  rows="$(result_rows "$E2E_TMP/$tool.client.out")"
  [[ -n $rows ]] || fail "$tool -c XRC: no result row"
  grep -q 'Connection type : XRC' "$E2E_TMP/$tool.client.out" || fail "$tool: not XRC"
  log "$tool -c XRC: $rows"
done

e2e_pass
