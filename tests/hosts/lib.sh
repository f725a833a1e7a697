# Test hosts as network namespaces: `hosts_init BIN_DIR N [B]` creates N hosts h1..hN, each a
# network namespace with one veth (eth0, 10.77.0.I/24) plugged into a bridge that lives in a
# "switch" namespace of its own, so no address or link exists outside the namespaces. Names are
# the only thing unique per run (a short run id prefix), so tests may run in parallel. Each host
# of h1..hB (B defaults to N) gets a vrdmad (own socket, --node hI, --listen 10.77.0.I:$HOSTS_PORT,
# --peer every other of them); the others are bare hosts on the same network.
# Everything is torn down on exit, whatever happened (trap). HOSTS_VRDMAD_ARGS: more vrdmad flags.
# The backends authenticate each other: a cluster made per test in $E2E_TMP/cluster (nodes
# h1..hN, make_cluster) and `--cluster-dir` for each; HOSTS_INSECURE=1 runs them all with
# `--insecure` (the plain TCP transport) instead, HOSTS_SECURITY[I]=tls|insecure|none one host.
# Needs root (ip netns). Sources tests/e2e/lib.sh for logging, pingpong checks and clean-up.
# shellcheck shell=bash
# shellcheck source-path=SCRIPTDIR source=../e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
E2E_NAME="hosts.$(basename "${BASH_SOURCE[1]:-$0}" .sh)"

HOSTS_N=0
HOSTS_B=0  # hosts with a backend: h1..hB
HOSTS_RID=""
HOSTS_PORT=7471
HOSTS_BIN=""
declare -a HOSTS_BACKEND_PID=()
# Per host: "tls" (--cluster-dir), "insecure" (--insecure) or "none" (neither); tests may set an
# entry before hosts_init. Unset: "insecure" under HOSTS_INSECURE=1, else "tls".
declare -a HOSTS_SECURITY=()
HOSTS_CLUSTER=""

# Namespace name of host I (0: the switch).
host_ns() { if [[ $1 == 0 ]]; then echo "${HOSTS_RID}sw"; else echo "${HOSTS_RID}h$1"; fi; }
# HOSTS_IPV6=1: the hosts' veths carry only IPv6 addresses (fd00:77::I/64), and the backends
# listen and dial there ("[fd00:77::I]:PORT").
host_ip() { if [[ ${HOSTS_IPV6:-0} == 1 ]]; then echo "fd00:77::$1"; else echo "10.77.0.$1"; fi; }
# Host I's transport endpoint on PORT: "ADDR:PORT", or "[ADDR]:PORT" for IPv6.
host_ep() {
  if [[ ${HOSTS_IPV6:-0} == 1 ]]; then echo "[$(host_ip "$1")]:$2"; else echo "$(host_ip "$1"):$2"; fi
}
host_sock() { echo "$E2E_TMP/h$1.sock"; }

hosts_init() {
  local bin=$1 n=$2 i
  e2e_init "$bin"
  HOSTS_BIN="$(cd "$bin" && pwd)"
  HOSTS_N=$n
  HOSTS_B=${3:-$n}
  # A run id short enough for interface names (15 bytes): "v" + 5 hex digits.
  HOSTS_RID="v$(printf '%05x' $(((RANDOM << 5 ^ $$) & 0xfffff)))"
  trap hosts_cleanup EXIT
  ip netns add "$(host_ns 0)" || fail "ip netns add (need root)"
  ip -n "$(host_ns 0)" link add br0 type bridge
  ip -n "$(host_ns 0)" link set br0 up
  for ((i = 1; i <= n; i++)); do
    ip netns add "$(host_ns "$i")"
    ip -n "$(host_ns "$i")" link set lo up
    # Created inside the host's namespace; the peer end moves into the switch at once.
    ip -n "$(host_ns "$i")" link add eth0 type veth peer name "p$i" netns "$(host_ns 0)"
    if [[ ${HOSTS_IPV6:-0} == 1 ]]; then
      ip -n "$(host_ns "$i")" addr add "$(host_ip "$i")/64" dev eth0 nodad
    else
      ip -n "$(host_ns "$i")" addr add "$(host_ip "$i")/24" dev eth0
    fi
    ip -n "$(host_ns "$i")" link set eth0 up
    ip -n "$(host_ns 0)" link set "p$i" master br0
    ip -n "$(host_ns 0)" link set "p$i" up
  done
  log "hosts: $n namespaces, run id $HOSTS_RID"
  HOSTS_CLUSTER="$E2E_TMP/cluster"
  local nodes=()
  for ((i = 1; i <= n; i++)); do nodes+=("h$i"); done
  make_cluster "$HOSTS_CLUSTER" "${nodes[@]}"
  [[ ${HOSTS_INSECURE:-0} == 1 ]] && log "backends: --insecure (the plain transport)"
  for ((i = 1; i <= HOSTS_B; i++)); do start_backend "$i"; done
}

# Creates a cluster CA in DIR (ca.key, ca.pem) and a credential for each NAME (NAME.key,
# NAME.pem) with `vrdma cluster`, as an operator would. Usage: make_cluster DIR NAME...
make_cluster() {
  local dir=$1 name
  shift
  [[ -f $dir/ca.pem ]] || "$HOSTS_BIN/vrdma" cluster init --dir "$dir" >/dev/null ||
    fail "vrdma cluster init --dir $dir"
  for name in "$@"; do
    "$HOSTS_BIN/vrdma" cluster add-node "$name" --dir "$dir" >/dev/null ||
      fail "vrdma cluster add-node $name --dir $dir"
  done
}

# The security flags of host I's backend, one a line.
security_args() {
  local mode=${HOSTS_SECURITY[$1]:-}
  [[ -n $mode ]] || { [[ ${HOSTS_INSECURE:-0} == 1 ]] && mode=insecure || mode=tls; }
  case $mode in
    tls) printf '%s\n' --cluster-dir "$HOSTS_CLUSTER" ;;
    insecure) echo --insecure ;;
    none) ;;
    *) fail "HOSTS_SECURITY[$1]: '$mode' (tls, insecure or none)" ;;
  esac
}

# Starts (or restarts) host I's backend; waits for its socket. Log: $E2E_TMP/vrdmad.hI.log.
start_backend() {
  local i=$1 j peers=() k sec
  for ((j = 1; j <= HOSTS_B; j++)); do
    [[ $j == "$i" ]] || peers+=(--peer "$(host_ep "$j" "$HOSTS_PORT")")
  done
  mapfile -t sec < <(security_args "$i")
  rm -f "$(host_sock "$i")"
  ip netns exec "$(host_ns "$i")" env VRDMA_LOG="${HOSTS_LOG:-info}" \
    "$HOSTS_BIN/vrdmad" --socket "$(host_sock "$i")" --node "h$i" --idle-exit 0 \
    --listen "$(host_ep "$i" "$HOSTS_PORT")" "${peers[@]}" "${sec[@]}" ${HOSTS_VRDMAD_ARGS:-} \
    >>"$E2E_TMP/vrdmad.h$i.log" 2>&1 &
  HOSTS_BACKEND_PID[i]=$!
  for ((k = 0; k < 100; k++)); do
    [[ -S $(host_sock "$i") ]] && return 0
    nap 0.1
  done
  fail "backend of h$i did not start: $(tail -n 5 "$E2E_TMP/vrdmad.h$i.log")"
}

# Kills host I's backend (SIGKILL: no goodbye to its peers).
kill_backend() {
  # A bare host (hosts_init's B < N) has none: nounset would end the clean-up right here.
  local pid=${HOSTS_BACKEND_PID[$1]:-}
  [[ -n $pid ]] || return 0
  { kill -KILL "$pid" && wait "$pid"; } 2>/dev/null || true
}

# Stops every backend (SIGKILL), empties their logs, starts them again (with HOSTS_VRDMAD_ARGS
# as it is now) and waits for the mesh: a benchmark's next configuration.
restart_backends() {
  local i
  for ((i = 1; i <= HOSTS_B; i++)); do
    kill_backend "$i"
    : >"$E2E_TMP/vrdmad.h$i.log"
  done
  for ((i = 1; i <= HOSTS_B; i++)); do start_backend "$i"; done
  wait_mesh
}

# Waits until every backend has connected to every other one (its log says so), up to 20 s.
wait_mesh() {
  local i j k
  for ((i = 1; i <= HOSTS_B; i++)); do
    for ((j = 1; j <= HOSTS_B; j++)); do
      [[ $i == "$j" ]] && continue
      for ((k = 0; k < 200; k++)); do
        grep -q "connected to h$j " "$E2E_TMP/vrdmad.h$i.log" && break
        nap 0.1
      done
      grep -q "connected to h$j " "$E2E_TMP/vrdmad.h$i.log" || fail "h$i never connected to h$j"
    done
  done
}

# Runs a command on host I through vrdma (its own backend). Usage: hrun I [--guest G] -- CMD...
hrun() {
  local i=$1
  shift
  ip netns exec "$(host_ns "$i")" env VRDMA_SOCKET="$(host_sock "$i")" \
    VRDMA_BACKEND=/nonexistent-vrdmad "${VRUN[@]}" "$@"
}
# Runs a plain command in host I's namespace.
hexec() {
  local i=$1
  shift
  ip netns exec "$(host_ns "$i")" "$@"
}
hstatus() { VRDMA_SOCKET="$(host_sock "$1")" "$VRDMA" status --json; }
# status_query (tests/e2e/lib.sh) on host I's backend. Usage: hstatus_query I EXPR
hstatus_query() { VRDMA_SOCKET="$(host_sock "$1")" status_query "$2"; }

# TCP port PORT listened on in host I.
hport_in_use() { [[ -n "$(hexec "$1" ss -Htln "sport = :$2" 2>/dev/null)" ]]; }
# Waits up to 20 s until host I listens on PORT; fails if PID (the server) dies first.
# Usage: hwait_port I PORT PID NAME
hwait_port() {
  local k
  for ((k = 0; k < 200; k++)); do
    hport_in_use "$1" "$2" && return 0
    kill -0 "$3" 2>/dev/null || fail "$4: server died: $(cat "$E2E_TMP/$4.server.out" 2>/dev/null)"
    nap 0.1
  done
  fail "$4: nothing listens on port $2 of h$1 after 20 s"
}

# An open-ended rc_stream NAME of 4 KiB messages: server guest NAME-s on host SH, client guest
# NAME-c on host CH, outputs $E2E_TMP/NAME.{server,client}.out. Sets srv and cli (their hrun; a
# caller's `local srv cli cli_proc` receives them) and cli_proc (the client, which SIGUSR1 stops:
# finish_stream then checks both ends). Usage: hstream_start NAME SH CH
# RC_STREAM_OPT: more options for both ends, split on spaces (--events: they sleep in completion
# channels; --timeout N).
# shellcheck disable=SC2086  # RC_STREAM_OPT is split on purpose
hstream_start() {
  local name=$1 sh=$2 ch=$3 port=$((17000 + RANDOM % 1000))
  hrun "$sh" --guest "$name-s" -- "$HOSTS_BIN/rc_stream" server "$port" 0 4096 ${RC_STREAM_OPT:-} \
    >"$E2E_TMP/$name.server.out" 2>&1 &
  srv=$!
  hwait_port "$sh" "$port" "$srv" "$name"
  hrun "$ch" --guest "$name-c" -- "$HOSTS_BIN/rc_stream" client "$(host_ip "$sh")" "$port" 0 4096 ${RC_STREAM_OPT:-} \
    >"$E2E_TMP/$name.client.out" 2>&1 &
  cli=$!
  # shellcheck disable=SC2034  # for the caller
  cli_proc=$(child_named "$cli" rc_stream)
}

# rc_stream's RNR test (a SEND with no receive must not hold up the ACK behind it): server on
# host SH, client on CH, both must say "rnr: ok". Outputs $E2E_TMP/NAME.{server,client}.out; the
# server's library logs at debug level. With PATTERN, the client sends its test SENDs only once
# its output has a line matching it (its path under test is up: on a busy machine the warm-up
# may end before). Usage: hrnr NAME SH CH [PATTERN]
hrnr() {
  local name=$1 sh=$2 ch=$3 port=$((17000 + RANDOM % 1000)) srv cli gate="" opener=""
  local sout="$E2E_TMP/$name.server.out" cout="$E2E_TMP/$name.client.out"
  [[ -n ${4:-} ]] && gate="$E2E_TMP/$name.gate"
  hrun "$sh" --guest "$name-s" -- env VRDMA_LOG=debug "$HOSTS_BIN/rc_stream" rnr-server "$port" \
    >"$sout" 2>&1 &
  srv=$!
  hwait_port "$sh" "$port" "$srv" "$name"
  hrun "$ch" --guest "$name-c" -- env ${gate:+RC_STREAM_GATE="$gate"} "$HOSTS_BIN/rc_stream" \
    rnr-client "$(host_ip "$sh")" "$port" >"$cout" 2>&1 &
  cli=$!
  if [[ -n $gate ]]; then
    (
      until grep -q -- "$4" "$cout" 2>/dev/null; do
        kill -0 "$cli" 2>/dev/null || exit 0
        nap 0.02
      done
      : >"$gate"
    ) &
    opener=$!
  fi
  wait_pid "$cli" 30
  if [[ -n $opener ]]; then
    kill "$opener" 2>/dev/null || true
    wait "$opener" 2>/dev/null || true
  fi
  [[ $WAIT_RC == 0 ]] || fail "$name: client exited $WAIT_RC: $(tail -n 5 "$cout")"
  wait_pid "$srv" 20
  [[ $WAIT_RC == 0 ]] || fail "$name: server exited $WAIT_RC: $(tail -n 5 "$sout")"
  grep -q "^rnr: ok" "$sout" && grep -q "^rnr: ok" "$cout" ||
    fail "$name: no \"rnr: ok\" from both ends"
  log "$name: a SEND without a receive waited; the ACK behind it did not"
}

# A pingpong ($PP_TOOL) server on host SI and client on host CI, all options on both sides.
# Usage: hpair NAME SI CI [args...]; waits and checks both outputs.
hpair_start() {
  local name=$1 si=$2 ci=$3 port=$((18000 + RANDOM % 1000))
  shift 3
  hrun "$si" --guest "$name-s" -- "$PP_TOOL" -p "$port" "$@" >"$E2E_TMP/$name.server.out" 2>&1 &
  HP_SPID=$!
  hwait_port "$si" "$port" "$HP_SPID" "$name"
  hrun "$ci" --guest "$name-c" -- "$PP_TOOL" -p "$port" "$@" "$(host_ip "$si")" \
    >"$E2E_TMP/$name.client.out" 2>&1 &
  HP_CPID=$!
}
hpair() {
  local name=$1
  log "$name: $PP_TOOL h$2 <- h$3 ${*:4}"
  hpair_start "$@"
  finish_pair "$name" "$HP_SPID" "$HP_CPID" 90
}

# Runs a perftest tool: server on host SI, client on host CI. Outputs in
# $E2E_TMP/TOOL.{server,client}.out. Usage: hperftest SI CI TOOL ARGS...
hperftest() {
  local si=$1 ci=$2 tool=$3 port=$((19000 + RANDOM % 1000)) srv cli
  shift 3
  hrun "$si" --guest pt-srv -- "$tool" -p "$port" "$@" >"$E2E_TMP/$tool.server.out" 2>&1 &
  srv=$!
  hwait_port "$si" "$port" "$srv" "$tool"
  hrun "$ci" --guest pt-cli -- "$tool" -p "$port" "$@" "$(host_ip "$si")" \
    >"$E2E_TMP/$tool.client.out" 2>&1 &
  cli=$!
  hperftest_finish "$tool" "$cli" "$srv" 90
  log "$tool: $(result_rows "$E2E_TMP/$tool.client.out" | tail -n 1)"
}

# Waits for a perftest pair NAME (client first, up to SECS) and checks that both ended normally
# and the client printed its result rows ($E2E_TMP/NAME.{server,client}.out).
# Usage: hperftest_finish NAME CLIENT_PID SERVER_PID SECS
hperftest_finish() {
  local name=$1
  wait_pid "$2" "$4"
  [[ $WAIT_RC == 0 ]] || fail "$name: client exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/$name.client.out")"
  wait_pid "$3" 20
  [[ $WAIT_RC == 0 ]] || fail "$name: server exited $WAIT_RC: $(tail -n 5 "$E2E_TMP/$name.server.out")"
  [[ -n "$(result_rows "$E2E_TMP/$name.client.out")" ]] || fail "$name: no result rows"
}

hosts_cleanup() {
  local rc=$? i
  set +e
  kill_descendants $$
  # A keep_state backend has a keeper that would start it again: the keeper goes first, then
  # whichever backend serves the socket now.
  for ((i = 1; i <= HOSTS_N; i++)); do
    [[ -f $(host_sock "$i").keeper.pid ]] && kill -KILL "$(cat "$(host_sock "$i").keeper.pid")" 2>/dev/null
    [[ -f $(host_sock "$i").pid ]] && kill -KILL "$(cat "$(host_sock "$i").pid")" 2>/dev/null
  done
  for ((i = 1; i <= HOSTS_N; i++)); do kill_backend "$i"; done
  for ((i = 0; i <= HOSTS_N; i++)); do ip netns del "$(host_ns "$i")" 2>/dev/null; done
  # Backend logs are part of what e2e_cleanup prints on failure and scans for sanitizer reports.
  for ((i = 1; i <= HOSTS_N; i++)); do
    [[ -f $E2E_TMP/vrdmad.h$i.log ]] && cp "$E2E_TMP/vrdmad.h$i.log" "$E2E_TMP/vrdmad.h$i.out"
  done
  (exit "$rc")
  e2e_cleanup
}

# ---- live migration (vrdma migrate) ----

# Downtimes (µs) of the moves made by hmigrate, in order; MIG_JSON: the last move's JSON.
declare -a MIG_DOWNTIMES=()
MIG_JSON=""
# A numeric field of MIG_JSON.
mig_field() { [[ $MIG_JSON =~ \"$1\":([0-9]+) ]] && echo "${BASH_REMATCH[1]}"; }
# Moves guest G from host FROM's backend to host TO's; fails unless `vrdma migrate` exits 0.
# Each JSON result goes to $E2E_TMP/migrations.out. Usage: hmigrate G FROM TO
hmigrate() {
  hcheck_alive
  hmigrate_try "$@" || fail "vrdma migrate $1 h$2 -> h$3: $MIG_JSON"
}
# hmigrate without the checks: returns 1 (MIG_JSON says why) when the move is refused.
# Usage: hmigrate_try GUEST FROM TO
hmigrate_try() {
  local g=$1 from=$2 to=$3
  MIG_JSON="$("$VRDMA" migrate "$g" --socket "$(host_sock "$from")" --to "$(host_sock "$to")" \
    --json 2>&1)" || return 1
  echo "h$from -> h$to $MIG_JSON" >>"$E2E_TMP/migrations.out"
  # The downtime ends when the target serves the guest: after the freeze, and no later than
  # the source read the target's answer.
  local down answered
  down=$(mig_field downtime_us) answered=$(mig_field answered_us)
  ((down > 0 && down <= answered)) || fail "downtime $down us, the answer read after $answered us: $MIG_JSON"
  MIG_DOWNTIMES+=("$down")
}
# "min median max" of the numbers given as arguments.
stats_of() {
  printf '%s\n' "$@" | sort -g | awk '{a[NR] = $1} END {
    m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; print a[1], m, a[NR]}'
}

# The values of KEYs (top-level fields of the QP's object in `vrdma res show qp -j`, or a
# counter's name) for each QP of guest G on host I: one line per QP, space-separated, "-" for an
# empty string. Plain perl (JSON::PP alone takes ~0.1 s to load on a busy 2-core machine);
# every key occurs once per QP, so the n-th match of each belongs to the n-th QP.
# Usage: hqps I G KEY...
hqps() {
  local i=$1 g=$2
  shift 2
  VRDMA_SOCKET="$(host_sock "$i")" "$VRDMA" res show qp guest "$g" -j |
    KEYS="$*" perl -0777 -ne '
      my $in = $_;
      my @cols = map { [$in =~ /"\Q$_\E":"?([^",}]*)/g] } split " ", $ENV{KEYS};
      for my $r (0 .. $#{$cols[0]}) {
        print join(" ", map { my $v = $_->[$r] // "?"; $v eq "" ? "-" : $v } @cols), "\n";
      }'
}
# "transport/peer_node" of each QP of guest G on host I, space-separated.
hroute() {
  hqps "$1" "$2" transport peer_node |
    awk '{printf "%s%s/%s", (NR > 1 ? " " : ""), $1, ($2 == "-" ? "" : $2)}'
}
# Processes that must live while a test waits on the backends ("PID OUTPUT_FILE" each):
# hcheck_alive fails at once, with the output's end, when one has exited.
declare -a HOSTS_WATCH=()
hcheck_alive() {
  local w pid out
  for w in "${HOSTS_WATCH[@]}"; do
    read -r pid out <<<"$w"
    kill -0 "$pid" 2>/dev/null || fail "$(basename "$out") exited: $(tail -n 3 "$out" | tr '\n' ' ')"
  done
}
# Waits up to SECS (default 5) until `hroute I G` prints WANT, or one of the routes WANT lists
# with '|' between them ("tcp/h2|direct/h2": a pair just moved, direct again or not yet); fails
# otherwise. Usage: hwait_route I G WANT [SECS]
hwait_route() {
  local got="" k
  for ((k = 0; k < ${4:-5} * 20; k++)); do
    hcheck_alive
    got="$(hroute "$1" "$2" 2>/dev/null)" || got="<no answer>"
    [[ "|$3|" == *"|$got|"* ]] && return 0
    nap 0.05
  done
  fail "guest $2 on h$1: QP routes '$got', wanted '$3'"
}
# Counter C (msgs_received, msgs_sent, ...) summed over guest G's QPs on host I.
hcount() { hqps "$1" "$2" "$3" | awk '{s += $1} END {print s + 0}'; }
# Waits up to 20 s until counter C of guest G on host I grows past its value now; fails if it
# does not (WHAT says what was expected). Usage: hgrows I G C WHAT
hgrows() {
  local c0 k
  c0=$(hcount "$1" "$2" "$3")
  for ((k = 0; k < 200; k++)); do
    hcheck_alive
    [[ $(hcount "$1" "$2" "$3") -gt $c0 ]] && return 0
    nap 0.1
  done
  fail "guest $2 on h$1: $3 stayed at $c0 for 20 s ($4)"
}
# Waits up to 20 s until guest G on host I has moved a message (counter C > 0); fails if PID
# (its process) exits first. Usage: hwait_flowing I G C PID
hwait_flowing() {
  local k
  for ((k = 0; k < 200; k++)); do
    [[ $(hcount "$1" "$2" "$3" 2>/dev/null || echo 0) -gt 0 ]] && return 0
    kill -0 "$4" 2>/dev/null || fail "guest $2 on h$1 exited before any traffic"
    nap 0.1
  done
  fail "guest $2 on h$1: no traffic after 20 s"
}
