#!/usr/bin/env bash
# The metrics endpoint: a backend configured with [metrics] serves Prometheus text that a strict
# parser (prom_check.pl) accepts, with the QPs of a running ibv_rc_pingpong and counters that
# grow; bad requests get HTTP errors; idle and garbage clients neither block it nor the pingpong.
# Usage: metrics.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
HERE="$(dirname "${BASH_SOURCE[0]}")"

# The checker itself rejects what a Prometheus parser rejects.
bad=(
  $'# TYPE a counter\na 1\n'                       # counter not named *_total
  $'# TYPE a_total counter\n# TYPE a_total gauge\na_total 1\n'
  $'a{x="1"} 1\nb 2\na{x="2"} 3\n'                 # family not contiguous
  $'a{x="\\q"} 1\n'                                # bad escape
  $'a{x="1",x="2"} 1\n'
  $'a 1\na 2\n'                                     # duplicate sample
  $'a one\n'
  $'a 1'                                              # no final newline
  $'# TYPE a_msgs_sent_total counter\na_msgs_sent_total 1\n'   # abbreviation
  $'# TYPE a_bytes_sent_total counter\na_bytes_sent_total 1\n' # unit not at the end
  $'# TYPE a_latency_ms gauge\na_latency_ms 1\n'              # not a base unit
  $'# TYPE a_total gauge\na_total 1\n'                        # a gauge named *_total
)
for t in "${bad[@]}"; do
  if printf '%s' "$t" | perl "$HERE/prom_check.pl" 2>/dev/null; then
    fail "prom_check.pl accepted: $t"
  fi
done
printf '# HELP a_total x\n# TYPE a_total counter\na_total{l="q\\"\\n"} 1e+03 1700000000000\n' |
  perl "$HERE/prom_check.pl" >/dev/null || fail "prom_check.pl rejected valid text"

MPORT="$(free_port)"
cat >"$E2E_TMP/vrdmad.toml" <<TOML
[backend]
idle_exit_s = 0

# The counters of the mediated path (transport "shm") are checked: pinned to it (the direct path
# is the default).
[datapath]
direct_path = false

[metrics]
enabled = true
listen = "127.0.0.1:$MPORT"
# Names, so the checks below can find each guest (by default guests are labelled by LID); every
# scrape a new rendering, so counters that grew between two scrapes show it however fast the
# machine runs them (the snapshot interval is ops_test's: MetricsRenderAtMostOncePerInterval).
guest_names = true
min_interval_ms = 0
TOML
"$VRDMA" backend --socket "$VRDMA_SOCKET" --config "$E2E_TMP/vrdmad.toml" \
  >"$E2E_TMP/vrdmad.log" 2>&1 &
for ((i = 0; i < 100; i++)); do
  port_in_use "$MPORT" && break
  nap 0.1
done
port_in_use "$MPORT" || fail "nothing listens on the metrics port $MPORT"
URL="http://127.0.0.1:$MPORT/metrics"

scrape() { curl -sS --max-time 20 -o "$1" -D "$1.headers" "$URL"; }

# An idle backend: valid exposition already.
scrape "$E2E_TMP/idle.prom" || fail "scrape failed"
grep -qi '^content-type: text/plain; version=0.0.4' "$E2E_TMP/idle.prom.headers" ||
  fail "content type: $(cat "$E2E_TMP/idle.prom.headers")"
perl "$HERE/prom_check.pl" <"$E2E_TMP/idle.prom" || fail "idle exposition rejected"
grep -q '^vrdma_guests 0$' "$E2E_TMP/idle.prom" || fail "vrdma_guests is not 0"
# The process metrics every Prometheus client library exports, and the start time (not an uptime).
for m in process_cpu_seconds_total process_resident_memory_bytes process_open_fds \
  process_start_time_seconds vrdma_start_time_seconds; do
  grep -Eq "^$m [0-9.e+]+$" "$E2E_TMP/idle.prom" || fail "no $m"
done
start="$(sed -n 's/^vrdma_start_time_seconds //p' "$E2E_TMP/idle.prom")"
((start <= $(date +%s) && start > $(date +%s) - 60)) || fail "vrdma_start_time_seconds $start"
grep -Eq '^process_open_fds ([1-9][0-9]*)$' "$E2E_TMP/idle.prom" || fail "process_open_fds"

# Slow and garbage clients, held open during the rest of the test: one that sends nothing, one
# that sends half a request.
exec 7<>"/dev/tcp/127.0.0.1/$MPORT"
exec 8<>"/dev/tcp/127.0.0.1/$MPORT"
printf 'GET /metr' >&8

start_held_pair pp m-srv m-cli

scrape "$E2E_TMP/a.prom" || fail "scrape failed"
sleep 1
scrape "$E2E_TMP/b.prom" || fail "scrape failed"
for f in a b; do
  perl "$HERE/prom_check.pl" <"$E2E_TMP/$f.prom" || fail "exposition $f rejected"
done
msgs() { sed -n "s/^vrdma_qp_sent_messages_total{guest=\"$2\",qpn=\"0x[0-9a-f]*\",type=\"RC\",transport=\"shm\"} //p" "$1"; }
for g in m-srv m-cli; do
  a="$(msgs "$E2E_TMP/a.prom" "$g")"
  b="$(msgs "$E2E_TMP/b.prom" "$g")"
  log "$g: vrdma_qp_sent_messages_total $a -> $b"
  [[ -n $a && -n $b ]] && ((b > a && a > 0)) || fail "$g: QP counter '$a' -> '$b'"
  grep -Eq "^vrdma_guest_received_bytes_total\{guest=\"$g\"\} [1-9]" "$E2E_TMP/b.prom" ||
    fail "$g: no per-guest bytes"
  grep -q "^vrdma_resources{guest=\"$g\",kind=\"qp\"} 1$" "$E2E_TMP/b.prom" || fail "$g: resources"
done

# Bad requests: HTTP errors, never a hang or a dead backend.
code() { curl -s --max-time 20 -o /dev/null -w '%{http_code}' "$@"; }
[[ "$(code "http://127.0.0.1:$MPORT/nope")" == 404 ]] || fail "unknown path"
[[ "$(code -X POST "$URL")" == 405 ]] || fail "POST"
[[ "$(code -H "X-Big: $(head -c 9000 /dev/zero | tr '\0' a)" "$URL")" == 431 ]] || fail "huge request"
reply="$(printf 'garbage\r\n\r\n' | timeout 20 perl -MIO::Socket::INET -e '
  my $s = IO::Socket::INET->new("127.0.0.1:'"$MPORT"'") or die; local $/; print {$s} <STDIN>;
  shutdown $s, 1; print <$s>;')"
[[ $reply == "HTTP/1.1 400 "* ]] || fail "garbage got: $reply"
# More idle clients than the endpoint keeps: the oldest are dropped, scrapes still work.
for ((i = 0; i < 20; i++)); do
  exec {fd}<>"/dev/tcp/127.0.0.1/$MPORT"
done
scrape "$E2E_TMP/c.prom" || fail "scrape with 22 idle clients failed"
perl "$HERE/prom_check.pl" <"$E2E_TMP/c.prom" >/dev/null || fail "exposition c rejected"
c="$(msgs "$E2E_TMP/c.prom" m-cli)"
((c > $(msgs "$E2E_TMP/b.prom" m-cli))) || fail "pingpong stalled while clients were idle"
kill -0 "$CLIENT_PID" || fail "the pingpong died"
e2e_pass
