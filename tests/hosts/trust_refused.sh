#!/usr/bin/env bash
# What the authenticated transport refuses outright (issue 20): a backend started with
# `--insecure` (h2) cannot join a backend of the cluster (h1, `--cluster-dir`): they never
# connect, and h1 logs the failed handshake of h2's dials; and a backend with a non-loopback
# `--listen` but neither a credential nor `--insecure` does not start (exit 1, naming
# `--insecure`), while on loopback it does (one host, nobody else can reach it).
# Usage: trust_refused.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=trust_lib.sh
# shellcheck disable=SC2016  # Perl expressions in single quotes
source "$(dirname "${BASH_SOURCE[0]}")/trust_lib.sh"
HOSTS_SECURITY[2]=insecure
hosts_init "${1:-}" 2
expect_security 1 tls
expect_security 2 insecure

# Each dials the other every few ms: 3 s is hundreds of tries.
nap 3
grep -q "connected to h2 " "$E2E_TMP/vrdmad.h1.log" && miss "h1 (TLS) connected to h2 (--insecure)"
grep -q "connected to h1 " "$E2E_TMP/vrdmad.h2.log" && miss "h2 (--insecure) connected to h1 (TLS)"
expect_log 1 "h2's plain dial" "TLS handshake with $(re_of "$(host_ip 2)"):[0-9]+ failed"
expect_refused 1 handshake
known="$(htcp 1 '{peers} ? scalar @{$t->{peers}} : "none"')"
[[ $known == 0 ]] || miss "h1's tcp peers: '$known', wanted 0"

# No credential, no --insecure: refused on a reachable address, allowed on loopback.
out="$E2E_TMP/nocred.out"
rc=0
hexec 1 timeout 5 "$HOSTS_BIN/vrdmad" --socket "$E2E_TMP/nocred.sock" --node h1 --idle-exit 0 \
  --listen "$(host_ip 1):$((HOSTS_PORT + 1))" >"$out" 2>&1 || rc=$?
log "vrdmad --listen $(host_ip 1):$((HOSTS_PORT + 1)) without a credential: exit $rc: $(tail -n 1 "$out")"
[[ $rc == 1 ]] || miss "vrdmad without a credential on $(host_ip 1) exited $rc, wanted 1"
grep -q -- "insecure" "$out" || miss "vrdmad without a credential did not name --insecure"

# Not through hexec (a function: in the background it is a subshell, and $! would be that
# subshell, leaving the backend behind when it is killed): ip netns exec execs vrdmad itself.
ip netns exec "$(host_ns 1)" "$HOSTS_BIN/vrdmad" --socket "$E2E_TMP/loop.sock" --node h1 \
  --idle-exit 0 --listen "127.0.0.1:$((HOSTS_PORT + 1))" >"$E2E_TMP/loop.out" 2>&1 &
loop=$!
for ((k = 0; k < 100; k++)); do
  [[ -S $E2E_TMP/loop.sock ]] && break
  kill -0 "$loop" 2>/dev/null || break
  nap 0.1
done
[[ -S $E2E_TMP/loop.sock ]] || miss "vrdmad on loopback without a credential did not start: $(tail -n 2 "$E2E_TMP/loop.out")"
kill -TERM "$loop" 2>/dev/null
wait "$loop" 2>/dev/null || true
trust_done
