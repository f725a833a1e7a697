#!/usr/bin/env bash
# Registered memory as a weapon (issue 21, item 4): a second user's guest, speaking the protocol
# itself, hands the backend a sealed sparse 1 TiB memfd (free to it, 1 TiB of the backend's
# address space) and then one-page segments until refused (one backend descriptor each). The 1
# TiB one fails with ENOMEM (max_segment_bytes), the rest at max_segments with ENOMEM, each with
# a log line; the backend's descriptors stay bounded; a victim's pingpong runs while the
# attacker holds its segments, and when the attacker goes its segments are gone.
# Usage: segments.sh BIN_DIR
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source-path=SCRIPTDIR source=attacker_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/attacker_lib.sh"

# A quota below any descriptor limit, so the quota, not the table, is what stops the attacker.
cfg="$(mktemp "${TMPDIR:-/tmp}/vrdma-segments.XXXXXX.toml")"
printf '[quotas]\nmax_segments = 512\n' >"$cfg"
SEC_VRDMAD_ARGS="--config $cfg"
sec_init "${1:-}"
rm -f "$cfg"
LOG="$E2E_TMP/vrdmad.log"

base=$(fds_of "$BACKEND_PID")
attacker_start "$ATTACKER" seg segments "$VRDMA_SOCKET" 100000
out="$E2E_TMP/out/seg.out"
grep -q '^sparse Cannot allocate memory' "$out" || fail "the sparse 1 TiB memfd: $(cat "$out")"
grep -q '^segments 512 stopped Cannot allocate memory' "$out" || fail "segments: $(cat "$out")"
grep -q 'guest attacker-seg: quota max_segment_bytes = 137438953472 reached' "$LOG" ||
  fail "no log line for max_segment_bytes"
grep -q 'guest attacker-seg: quota max_segments = 512 reached' "$LOG" ||
  fail "no log line for max_segments"
now=$(fds_of "$BACKEND_PID")
log "attacker holds 512 segments; backend descriptors $base -> $now"
((now <= base + 512 + 16)) || fail "the backend holds $now descriptors (was $base)"
wait_status '$j->{totals}{segment}' 512 10 || fail "segments counted: $(status_json)"

pp_as "$VICTIM"
run_pair victim vic-s vic-c -n 500 -s 65536

attacker_release seg
wait_pid "$ATTACKER_PID" 20
wait_status '$j->{totals}{segment}' 0 10 || fail "the attacker's segments outlived it"
pp_as root
backend_serves segments
e2e_pass
