#!/usr/bin/env bash
# QP scale on one backend (issue 26): bench/qp_scale.c creates N RC QPs (depth 1, one CQ) on one
# guest of a fresh vrdmad, connects them in pairs to RTS, holds them while this script reads the
# backend's RSS, then destroys them. Prints a markdown row per N: create/s, connect-to-RTS/s,
# destroy/s, vrdmad's RSS before and with the QPs, and the difference per QP (backend memory
# per idle QP; its rings are the guest's shared memory, counted in RSS only for pages the
# backend touched), and, while the QPs are held, how long `vrdma status`, `vrdma status -j` and
# one Prometheus scrape (the backend's metrics on a unix socket) take, in seconds; "vrdmad CPU":
# the backend's CPU time (user + system) for the creation and the connects.
# Usage: bench/qp_scale.sh [BIN_DIR (default build/release/bin)] [N... (default 1000 10000)]
# PER_QP=false: the backend's [metrics] per_qp (series per QP; default true).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="$(cd "${1:-$ROOT/build/release/bin}" && pwd)"
shift || true
SIZES=("${@:-1000 10000}")
read -ra SIZES <<<"${SIZES[*]}"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
TMP="$(mktemp -d /tmp/vrdma-qpscale.XXXXXX)"
BPID=""
cleanup() {
  [[ -n $BPID ]] && kill "$BPID" 2>/dev/null && wait "$BPID" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
# CPU time a process has used (user + system), in ms.
cpu_ms() { awk -v hz="$(getconf CLK_TCK)" '{print int(($14 + $15) * 1000 / hz)}' "/proc/$1/stat"; }

# Seconds a command takes (its output discarded), or "failed" with its error on stderr.
secs() {
  local t0 t1
  t0=$(date +%s.%N)
  "$@" >/dev/null || { echo failed; return 0; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f", b - a}'
}

echo "| QPs | create/s | connect to RTS/s | destroy/s | vrdmad CPU | vrdmad RSS before | with the QPs | per QP | status s | status -j s | metrics s | machine | date |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for n in "${SIZES[@]}"; do
  printf '[quotas]\nmax_qps = %d\n[metrics]\nper_qp = %s\n' $((n + 16)) "${PER_QP:-true}" \
    >"$TMP/c.toml"
  "$BIN_DIR/vrdmad" --socket "$TMP/s$n.sock" --idle-exit 0 --config "$TMP/c.toml" \
    --metrics-listen "unix:$TMP/m$n.sock" >"$TMP/vrdmad.log" 2>&1 &
  BPID=$!
  for ((k = 0; k < 100; k++)); do [[ -S $TMP/s$n.sock ]] && break; sleep 0.1; done
  before=$(rss_kib "$BPID")
  cpu0=$(cpu_ms "$BPID")
  rm -f "$TMP/hold"
  VRDMA_SOCKET="$TMP/s$n.sock" VRDMA_BACKEND=/nonexistent-vrdmad "$BIN_DIR/vrdma" run \
    --guest qpscale -- "$BIN_DIR/qp_scale" "$n" "$TMP/hold" >"$TMP/out" 2>&1 &
  cpid=$!
  until grep -q '^holding' "$TMP/out"; do
    kill -0 "$cpid" 2>/dev/null || { cat "$TMP/out" >&2; exit 1; }
    sleep 0.1
  done
  with=$(rss_kib "$BPID")
  cpu=$(($(cpu_ms "$BPID") - cpu0))
  st=$(secs env VRDMA_TIMEOUT_MS=60000 "$BIN_DIR/vrdma" status --socket "$TMP/s$n.sock")
  stj=$(secs env VRDMA_TIMEOUT_MS=60000 "$BIN_DIR/vrdma" status -j --socket "$TMP/s$n.sock")
  met=$(secs curl -sf --max-time 60 --unix-socket "$TMP/m$n.sock" http://vrdmad/metrics)
  : >"$TMP/hold"
  wait "$cpid" || { cat "$TMP/out" >&2; exit 1; }
  read -r _ _ _ create _ connect < <(grep '^qps' "$TMP/out")
  destroy=$(awk '/^destroy_per_s/ {print $2}' "$TMP/out")
  per=$(awk -v a="$before" -v b="$with" -v n="$n" 'BEGIN {printf "%.1f KiB", (b - a) / n}')
  echo "| $n | $create | $connect | $destroy | $cpu ms | $((before / 1024)) MiB | $((with / 1024)) MiB | $per | $st | $stj | $met | $machine | $today |"
  kill "$BPID"
  wait "$BPID" 2>/dev/null || true
  BPID=""
  rm -f "$TMP/s$n.sock"
done
