#!/usr/bin/env bash
# Debian's UCX across hosts over vrdma (UCX_TLS=rc_verbs,ud_verbs through plain `vrdma run`; the
# rc_verbs QPs are on an SRQ) on both paths, against UCX's own TCP transport between the same
# namespace hosts (tests/hosts/lib.sh), ROUNDS interleaved: the backends restarted before each
# vrdma run either with no options ("direct": the libraries of a QP pair talk to each other, and
# take the SRQ's receives themselves) or with --no-direct-remote ("backends": every message
# through both backends' transport, which is where an SRQ's QPs went before 2026-11-27).
# ucx_perftest h2 -> h1: tag_lat 8 B (one-way µs, typical), tag_bw 8 B (messages/s),
# ucp_put_bw 1 MiB (MB/s), ucp_get 8 B (µs, typical: an RDMA READ that h1's side, which only
# calls its progress now and then, must answer). Prints each round and a markdown table of
# medians (min-max).
# Needs root (ip netns).
# Usage: bench/crosshost_ucx.sh [BIN_DIR (default build/release/bin)] [ROUNDS (default 5)]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${1:-$ROOT/build/release/bin}"
ROUNDS="${2:-5}"
export E2E_DEADLINE="${E2E_DEADLINE:-3600}"  # lib.sh's watchdog; a benchmark may take long
# shellcheck source-path=SCRIPTDIR/.. source=tests/hosts/lib.sh
source "$ROOT/tests/hosts/lib.sh"
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
hosts_init "$BIN_DIR" 2
wait_mesh
command -v ucx_perftest >/dev/null || fail "ucx_perftest missing (scripts/deps.sh installs ucx-utils)"

# The four figures of one path: "LAT RATE BW GET" (RUN: ucx_vrdma or ucx_tcp).
figures() {
  local lat rate bw get
  lat="$("$1" tag_lat 8 20000 | awk '{print $2}')"
  rate="$("$1" tag_bw 8 200000 | awk '{print $8}')"
  bw="$("$1" ucp_put_bw 1048576 2000 | awk '{print $6}')"
  get="$("$1" ucp_get 8 2000 | awk '{print $2}')"
  echo "$lat $rate $bw $get"
}
# Not in a command substitution: the backends it starts must be the ones the next run stops.
restart_path() {
  [[ $1 == backends ]] && HOSTS_VRDMAD_ARGS=--no-direct-remote || HOSTS_VRDMAD_ARGS=""
  restart_backends
  wait_mesh
}

declare -A v
last() {
  local -a xs
  read -ra xs <<<"${v[$1]}"
  echo "${xs[-1]}"
}
for ((r = 1; r <= ROUNDS; r++)); do
  for path in direct backends; do
    restart_path "$path"
    read -r lat rate bw get < <(figures ucx_vrdma)
    v[$path.lat]+="$lat "
    v[$path.rate]+="$rate "
    v[$path.bw]+="$bw "
    v[$path.get]+="$get "
  done
  read -r lat rate bw get < <(figures ucx_tcp)
  v[tcp.lat]+="$lat "
  v[tcp.rate]+="$rate "
  v[tcp.bw]+="$bw "
  v[tcp.get]+="$get "
  log "round $r: tag_lat µs direct $(last direct.lat) / backends $(last backends.lat) / tcp $lat"
done
med() {
  local -a xs
  read -ra xs <<<"${v[$1]}"
  printf '%s\n' "${xs[@]}" | stats
}
echo "| date | ucx_perftest h2 -> h1, rounds | vrdma direct | vrdma through the backends | UCX tcp | direct / tcp | backends / tcp |"
echo "|---|---|---|---|---|---|---|"
for k in "lat:tag_lat -s 8, µs one-way (typical)" "rate:tag_bw -s 8, messages/s" \
  "bw:ucp_put_bw -s 1048576, MB/s" "get:ucp_get -s 8, µs (typical)"; do
  key=${k%%:*}
  read -r dm dn dx < <(med "direct.$key")
  read -r bm bn bx < <(med "backends.$key")
  read -r tm tn tx < <(med "tcp.$key")
  echo "| $today | ${k#*:}, $ROUNDS | $dm ($dn–$dx) | $bm ($bn–$bx) | $tm ($tn–$tx) |" \
    "$(ratio "$dm" "$tm") | $(ratio "$bm" "$tm") |"
done
e2e_pass
