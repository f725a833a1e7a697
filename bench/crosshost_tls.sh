#!/usr/bin/env bash
# Bandwidth across two namespace hosts (tests/hosts/lib.sh) with the default, TLS transport
# between the backends: `ib_write_bw` h2 -> h1 at 1 MiB and 64 KiB, and an 8 B `ib_send_lat`
# to see that latency did not pay for it; with BASE_BIN also a build to compare with (its
# backends and library, restarted in turn, runs interleaved). Peers in the same run: iperf3
# (plaintext, one stream) and one TLS 1.3 stream through OpenSSL's own record layer with the
# same suite and credentials (bench/tls_stream.py, 1 MiB writes; Python's cost per call is
# small beside a MiB's). Prints markdown table rows.
# Needs root (ip netns). Usage: bench/crosshost_tls.sh [BIN_DIR] [BASE_BIN_DIR|-] [RUNS (5)]
# DIRECT=1: the libraries' direct path across backends instead (VRDMA_DIRECT_REMOTE=1: the
# libraries' own TLS records, verbs/remote_tls.cc); the CPU column is still the backends', which
# then carry only the control path. BASE_BIN_DIR "mediated" (with DIRECT=1): the base is the same
# build on the backends' transport, so the two paths run interleaved in the same runs.
set -euo pipefail
# Pinned to the backends' transport (VRDMA_DIRECT_REMOTE=0, the transport whose TLS it measures;
# the variable, not --no-direct-remote, which a BASE_BIN of before 2026-11-27 does not know).
export VRDMA_DIRECT_REMOTE=0
[[ ${DIRECT:-0} == 1 ]] && VRDMA_DIRECT_REMOTE=1

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="$(cd "${1:-$ROOT/build/release/bin}" && pwd)"
BASE_DIR="${2:--}"
RUNS="${3:-5}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
hosts_init "$BIN_DIR" 2
wait_mesh
command -v iperf3 >/dev/null || fail "iperf3 missing (scripts/deps.sh installs it)"
BUILDS=(new)
BASE_MEDIATED=0
if [[ $BASE_DIR == mediated ]]; then
  BASE_MEDIATED=1 BASE_DIR=$BIN_DIR
  BUILDS+=(base)
elif [[ $BASE_DIR != - ]]; then
  BASE_DIR="$(cd "$BASE_DIR" && pwd)" && BUILDS+=(base)
fi
# The TLS peer's suite: the transport's first choice (Python's ssl cannot name TLS 1.3 suites).
cat >"$E2E_TMP/openssl.cnf" <<'EOF'
openssl_conf = conf
[conf]
ssl_conf = ssl
[ssl]
system_default = sys
[sys]
Ciphersuites = TLS_AES_128_GCM_SHA256
EOF

# Restarts both backends from build $1 (new | base); the programs use its library too.
use_build() {
  local dir=$BIN_DIR
  [[ $1 == base ]] && dir=$BASE_DIR
  HOSTS_BIN=$dir VRDMA=$dir/vrdma VRUN=("$dir/vrdma" run)
  if ((BASE_MEDIATED)); then
    VRDMA_DIRECT_REMOTE=1
    [[ $1 == base ]] && VRDMA_DIRECT_REMOTE=0
  fi
  restart_backends
}
# CPU time both backends have used so far, in clock ticks (utime + stime).
backend_ticks() {
  cat "/proc/${HOSTS_BACKEND_PID[1]}/stat" "/proc/${HOSTS_BACKEND_PID[2]}/stat" |
    awk '{sub(/^.*\) /, ""); t += $12 + $13} END {print t}'
}
# perftest h2 -> h1: TOOL ARGS...; prints the last result row's column COL (set before the call)
# and, for a bandwidth test, the backends' CPU ms per MB moved (the machine is shared: what the
# CPU costs is steadier than what a time slice lets through).
perf_col() {
  local t0 t1
  t0="$(backend_ticks)"
  hperftest 1 2 "$@" >/dev/null
  t1="$(backend_ticks)"
  result_rows "$E2E_TMP/$1.client.out" | tail -n 1 |
    awk -v c="$COL" -v t=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" \
      '{if (c == 4) printf "%s %.3f\n", $c, t * 1000 / hz / ($1 * $2 / 1e6); else print $c}'
}
tls_mbs() {
  local port=$((17000 + RANDOM % 1000)) srv
  hexec 1 env OPENSSL_CONF="$E2E_TMP/openssl.cnf" python3 "$ROOT/bench/tls_stream.py" server \
    "$port" "$HOSTS_CLUSTER" h1 >"$E2E_TMP/tls.out" 2>&1 &
  srv=$!
  hwait_port 1 "$port" "$srv" tls_stream
  hexec 2 env OPENSSL_CONF="$E2E_TMP/openssl.cnf" python3 "$ROOT/bench/tls_stream.py" client \
    "$(host_ip 1)" "$port" "$HOSTS_CLUSTER" h2 2 "$1" || fail "tls_stream client"
  wait "$srv" || fail "tls_stream server: $(cat "$E2E_TMP/tls.out")"
  grep -q TLS_AES_128_GCM_SHA256 "$E2E_TMP/tls.out" || fail "tls_stream: $(cat "$E2E_TMP/tls.out")"
  awk '{print $1}' "$E2E_TMP/tls.out"
}

declare -A res
ROWS=("ib_write_bw -s 1048576 -D 2" "ib_write_bw -s 65536 -D 2" "ib_send_lat -s 8 -n 20000")
# TLS_ROWS="CMD;CMD...": other perftest commands (h2 -> h1) instead.
[[ -z ${TLS_ROWS:-} ]] || IFS=';' read -ra ROWS <<<"$TLS_ROWS"
# iperf3 runs at each bandwidth row's size.
mapfile -t BW_SIZES < <(printf '%s\n' "${ROWS[@]}" |
  awk '/_bw/ {for (i = 1; i < NF; i++) if ($i == "-s") print $(i + 1)}' | sort -un)
for ((r = 1; r <= RUNS; r++)); do
  # Alternate which build goes first, so neither always follows the peers.
  order=("${BUILDS[@]}")
  ((r % 2 == 0)) && mapfile -t order < <(printf '%s\n' "${BUILDS[@]}" | tac)
  for b in "${order[@]}"; do
    use_build "$b"
    for cmd in "${ROWS[@]}"; do
      read -ra a <<<"$cmd"
      [[ ${a[0]} == *_bw ]] && COL=4 || COL=5  # BW average MB/s; t_typical µs
      read -r v cpu < <(perf_col "${a[@]}")
      res["$cmd|$b"]+="$v "
      res["$cmd|$b|cpu"]+="${cpu:-} "
      log "$b $cmd: $v${cpu:+ MB/s, backends $cpu CPU ms/MB}"
    done
  done
  for s in "${BW_SIZES[@]}"; do
    res["iperf3 $s"]+="$(iperf_mbs "$s") "
  done
  res["tls"]+="$(tls_mbs 1048576) "  # a byte stream: one figure for both sizes
  for s in "${BW_SIZES[@]}"; do log "iperf3 -l $s: $(awk '{print $NF}' <<<"${res[iperf3 $s]}") MB/s"; done
  log "TLS stream: $(awk '{print $NF}' <<<"${res[tls]}") MB/s"
  log "run $r of $RUNS done"
done

med() { tr ' ' '\n' <<<"$1" | grep . | stats; }
echo "| date | machine | command (h2 -> h1) | runs | this build median (min–max) | base build | iperf3 (plaintext) | OpenSSL TLS stream | this / iperf3 | this / TLS stream | this / base | backends' CPU ms per MB, this / base |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for cmd in "${ROWS[@]}"; do
  read -r nm nmin nmax < <(med "${res[$cmd|new]}")
  base="—" pm="" tm="" rb="—" ri="—" rt="—" cpu="—"
  if [[ -n ${res[$cmd|base]:-} ]]; then
    read -r bm bmin bmax < <(med "${res[$cmd|base]}")
    base="$bm ($bmin–$bmax)" rb="$(ratio "$nm" "$bm")"
  fi
  if [[ -n ${res[$cmd|new|cpu]// /} ]]; then
    read -r cm _ _ < <(med "${res[$cmd|new|cpu]}")
    cpu="$cm"
    if [[ -n ${res[$cmd|base|cpu]:-} ]]; then
      read -r cb _ _ < <(med "${res[$cmd|base|cpu]}")
      cpu="$cm / $cb"
    fi
  fi
  case $cmd in
    *_bw*) s="$(awk '{for (i = 1; i < NF; i++) if ($i == "-s") print $(i + 1)}' <<<"$cmd")"
      read -r pm pmin pmax < <(med "${res[iperf3 $s]}")
      read -r tm tmin tmax < <(med "${res[tls]}")
      ri="$(ratio "$nm" "$pm")" rt="$(ratio "$nm" "$tm")"
      pm="$pm ($pmin–$pmax)" tm="$tm ($tmin–$tmax)" unit="MB/s" ;;
    *) pm="—" tm="—" unit="µs typical" ;;
  esac
  echo "| $today | $machine | \`$cmd\` ($unit) | $RUNS | $nm ($nmin–$nmax) | $base | $pm | $tm |" \
    "$ri | $rt | $rb | $cpu |"
done
e2e_pass
