#!/usr/bin/env bash
# RDMA CM connection setup rate (connect + accept + ESTABLISHED, then teardown, per second) with
# bench/cm_rate.c through vrdma's librdmacm, beside a plain TCP connect/accept rate measured in
# the same run on the same hosts: on one host (client and server on h1's backend, to h1's
# address) and across two namespace hosts (h2 -> h1, the exchange over the backends' transport).
# Rows without and with an RC QP per connection (-q: rdma_create_qp on both ends, so also the
# QP's creation, RTR/RTS and destruction; N/5 connections, being slower). Prints markdown table
# rows. Needs root (ip netns). HOSTS_VRDMAD_ARGS: more vrdmad flags (e.g. --spin-us 0), named in
# the rows.
# Usage: bench/cm_rate.sh [BIN_DIR (default build/release/bin)] [RUNS (default 3)] [N (10000)]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-3}"
N="${3:-10000}"
N_QP=$((N / 5))
WINDOW="${WINDOW:-32}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
hosts_init "$BIN_DIR" 2
wait_mesh

RATE="$HOSTS_BIN/cm_rate"
[[ -x $RATE ]] || fail "$RATE missing (build the release preset)"
SRV_IP=$(host_ip 1)

# Waits until the server's output says it listens. Usage: wait_listening FILE PID
wait_listening() {
  local k
  for ((k = 0; k < 200; k++)); do
    grep -q '^listening' "$1" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || fail "server exited: $(tail -n 5 "$1")"
    nap 0.05
  done
  fail "server not listening: $(tail -n 5 "$1")"
}

# One run; its conn/s in RATE_OF_RUN (not printed: a `fail` in a command substitution would end
# only that subshell, leaving the run's server behind). Usage: one KIND(cm|tcp) CLIENT_HOST N [-q]
one() {
  local kind=$1 cli=$2 N=$3 port=$((20000 + RANDOM % 10000)) srv
  shift 3
  : >"$E2E_TMP/srv"  # now: the server's own redirection may come after wait_listening reads it
  if [[ $kind == cm ]]; then
    hrun 1 --guest cm-srv -- "$RATE" --server "$SRV_IP" "$port" -n "$N" "$@" >"$E2E_TMP/srv" 2>&1 &
  else
    hexec 1 "$RATE" --tcp-server "$SRV_IP" "$port" -n "$N" >"$E2E_TMP/srv" 2>&1 &
  fi
  srv=$!
  wait_listening "$E2E_TMP/srv" "$srv"
  if [[ $kind == cm ]]; then
    hrun "$cli" --guest cm-cli -- "$RATE" --client "$SRV_IP" "$port" -n "$N" -w "$WINDOW" "$@" \
      >"$E2E_TMP/cli" 2>&1 || fail "client: $(tail -n 5 "$E2E_TMP/cli")"
  else
    hexec "$cli" "$RATE" --tcp-client "$SRV_IP" "$port" -n "$N" -w "$WINDOW" \
      >"$E2E_TMP/cli" 2>&1 || fail "tcp client: $(tail -n 5 "$E2E_TMP/cli")"
  fi
  wait_pid "$srv" 30
  [[ $WAIT_RC == 0 ]] || fail "server exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/srv")"
  RATE_OF_RUN=$(awk '/conn\/s/ {print $(NF-1)}' "$E2E_TMP/cli")
  [[ -n $RATE_OF_RUN ]] || fail "no rate: $(tail -n 5 "$E2E_TMP/cli")"
}

backend="vrdmad ${HOSTS_VRDMAD_ARGS:-(defaults)}"
echo "| date | machine | backend | where | connections (with QP) x window | runs | rdma_cm conn/s median (min–max) | rdma_cm + RC QP conn/s median (min–max) | TCP connect/accept conn/s median (min–max) |"
echo "|---|---|---|---|---|---|---|---|---|"
for cli in 1 2; do
  cm=() qp=() tcp=()
  for ((r = 1; r <= RUNS; r++)); do
    one cm "$cli" "$N"
    cm+=("$RATE_OF_RUN")
    one cm "$cli" "$N_QP" -q
    qp+=("$RATE_OF_RUN")
    one tcp "$cli" "$N"
    tcp+=("$RATE_OF_RUN")
  done
  read -r cmed cmin cmax < <(printf '%s\n' "${cm[@]}" | stats)
  read -r qmed qmin qmax < <(printf '%s\n' "${qp[@]}" | stats)
  read -r tmed tmin tmax < <(printf '%s\n' "${tcp[@]}" | stats)
  where="one host (h1 -> h1)"
  [[ $cli == 2 ]] && where="two namespace hosts (h2 -> h1)"
  echo "| $today | $machine | $backend | $where | $N ($N_QP) x $WINDOW | $RUNS | $cmed ($cmin–$cmax) |" \
    "$qmed ($qmin–$qmax) | $tmed ($tmin–$tmax) |"
done
e2e_pass
