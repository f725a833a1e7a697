#!/usr/bin/env bash
# Many QPs across hosts: Debian's ib_write_bw -s SIZE -q Q -D 3 from a guest on h1 to one on h2
# (the namespace hosts of tests/hosts/lib.sh), with the backends restarted before each run either
# with --no-direct-remote ("backends": the backends' TLS transport carries the QPs) or with no
# options ("direct": the default, the libraries talk to each other, at most
# VRDMA_DIRECT_REMOTE_QPS of a process's QPs), ROUNDS interleaved rounds. Prints one markdown
# row per Q: each round's MB/s on both paths and the medians' ratio.
# Needs root (ip netns).
# Usage: bench/crosshost_qps.sh [BIN_DIR (default build/release/bin)] [ROUNDS (default 3)]
#        [QP counts (default "8 16 64")]   (QPS_SIZE: the message size, default 4096)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
ROUNDS="${2:-3}"
QP_COUNTS="${3:-8 16 64}"
SIZE="${QPS_SIZE:-4096}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
hosts_init "$BIN_DIR" 2
wait_mesh

# One run on PATH ("backends" or "direct") with Q QPs; its MB/s in MBS. (Not in a command
# substitution: the backends it starts must be the ones the next run stops.)
run() {
  local path=$1 q=$2 g port srv cli
  [[ $path == backends ]] && HOSTS_VRDMAD_ARGS=--no-direct-remote || HOSTS_VRDMAD_ARGS=""
  restart_backends
  g="q$q$path" port=$((19600 + RANDOM % 1000))
  hrun 2 --guest "$g-s" -- ib_write_bw -p "$port" -q "$q" -s "$SIZE" -D 3 \
    >"$E2E_TMP/$g.server.out" 2>&1 &
  srv=$!
  hwait_port 2 "$port" "$srv" "$g"
  hrun 1 --guest "$g" -- ib_write_bw -p "$port" -q "$q" -s "$SIZE" -D 3 "$(host_ip 2)" \
    >"$E2E_TMP/$g.client.out" 2>&1 &
  cli=$!
  wait "$cli" "$srv" || fail "ib_write_bw -q $q on $path: $(tail -n 3 "$E2E_TMP/$g.client.out")"
  MBS="$(awk '/#bytes/ {getline; print $4}' "$E2E_TMP/$g.client.out")"
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

echo "| date | ib_write_bw -s $SIZE -q | backends MB/s | direct MB/s | direct / backends (medians) |"
echo "|---|---|---|---|---|"
for q in $QP_COUNTS; do
  be=() di=()
  for ((r = 0; r < ROUNDS; r++)); do
    run backends "$q"
    be+=("$MBS")
    run direct "$q"
    di+=("$MBS")
  done
  ratio="$(awk -v d="$(median "${di[@]}")" -v b="$(median "${be[@]}")" 'BEGIN {printf "%.2f", d / b}')"
  echo "| $(date +%F) | $q | ${be[*]} | ${di[*]} | $ratio |"
done
e2e_pass
