#!/usr/bin/env bash
# Debian's unmodified UCX (ucx_perftest tag_lat and tag_bw, two processes on this host) over
# vrdma (rc_verbs on vrdma0:1, through plain `vrdma run`) beside UCX over its own transports in
# the same run: shared memory (posix, sysv) and tcp (loopback). Runs interleaved: each round runs
# every transport once. Prints markdown table rows: date, machine, test, medians (min–max) and
# the ratio of the best UCX-own transport to vrdma.
# Usage: bench/ucx.sh [BIN_DIR (default build/release/bin)] [RUNS (default 3)]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
RUNS="${2:-3}"

# shellcheck source-path=SCRIPTDIR/.. source=tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
e2e_init "$BIN_DIR"
command -v ucx_perftest >/dev/null || fail "ucx_perftest is not installed (scripts/deps.sh: ucx-utils)"

# name and UCX environment of each transport; vrdma's first.
TRANSPORTS=(vrdma posix sysv tcp)
declare -A UCX_ENV=(
  [vrdma]="UCX_TLS=rc_verbs,ud_verbs"
  [posix]="UCX_TLS=posix,self"
  [sysv]="UCX_TLS=sysv,self"
  [tcp]="UCX_TLS=tcp,self UCX_NET_DEVICES=lo"
)
# test, its arguments, the column of ucx_perftest's "Final:" row to report (typical latency,
# average bandwidth, average message rate), its divisor, the unit.
TESTS=(
  "tag_lat|-s 8 -n 20000|3|1|µs one-way (typical)"
  "tag_lat|-s 65536 -n 5000|3|1|µs one-way (typical)"
  "tag_bw|-s 8 -n 200000|8|1000000|million messages/s"
  "tag_bw|-s 65536 -n 20000|6|1|MB/s"
)

# Runs one ucx_perftest pair on transport $1 with ARGS...; prints the value in column $2 / $3.
measure() {
  local tl=$1 col=$2 div=$3
  shift 3
  (
    # shellcheck disable=SC2086,SC2163  # UCX_ENV holds NAME=VALUE words on purpose
    export ${UCX_ENV[$tl]}
    run_perftest ucx_perftest "$@"
  ) || return 0
  grep -E '^Final:' "$E2E_TMP/ucx_perftest.client.out" | awk -v c="$col" -v d="$div" '{printf "%.2f\n", $c / d}'
}

echo "| date | machine | test | runs | vrdma rc_verbs | UCX posix | UCX sysv | UCX tcp (lo) | best UCX-own / vrdma |"
echo "|---|---|---|---|---|---|---|---|---|"
for t in "${TESTS[@]}"; do
  IFS='|' read -r test args col div unit <<<"$t"
  read -ra argv <<<"$args"
  declare -A vals=()
  for ((r = 1; r <= RUNS; r++)); do
    for tl in "${TRANSPORTS[@]}"; do
      v="$(measure "$tl" "$col" "$div" -t "$test" "${argv[@]}")"
      [[ -n $v ]] || fail "$tl $test $args: no Final row"
      vals[$tl]+="$v "
    done
  done
  row="| $today | $machine | \`ucx_perftest -t $test $args\`, $unit | $RUNS"
  best=""
  for tl in "${TRANSPORTS[@]}"; do
    read -r med min max < <(tr ' ' '\n' <<<"${vals[$tl]}" | grep . | stats)
    row+=" | $med ($min–$max)"
    if [[ $tl == vrdma ]]; then
      vmed=$med
    elif [[ -z $best ]] || if [[ $test == tag_lat ]]; then
      awk -v a="$med" -v b="$best" 'BEGIN {exit !(a < b)}'
    else
      awk -v a="$med" -v b="$best" 'BEGIN {exit !(a > b)}'
    fi; then
      best=$med
    fi
  done
  echo "$row | $(ratio "$best" "$vmed") |"
  unset vals
done
e2e_pass
