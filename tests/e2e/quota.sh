#!/usr/bin/env bash
# Per-guest quotas from the backend's config file: Debian's ibv_rc_pingpong asking for more than
# its guest may have (queue depth, registered bytes) fails cleanly, the backend's log and the
# program's stderr naming the quota it hit; a pingpong within the quotas runs on the same backend
# at the same time.
# Usage: quota.sh BIN_DIR
# shellcheck disable=SC2016  # Perl expressions in single quotes
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"

cat >"$E2E_TMP/vrdmad.toml" <<'TOML'
[quotas]
max_queue_depth = 256
max_mr_bytes = 65536
TOML
"$(dirname "$VRDMA")/vrdmad" --socket "$VRDMA_SOCKET" --config "$E2E_TMP/vrdmad.toml" \
  --idle-exit 0 2>"$E2E_TMP/vrdmad.log" &
for ((i = 0; i < 100; i++)); do
  [[ -S $VRDMA_SOCKET ]] && break
  nap 0.1
done
[[ -S $VRDMA_SOCKET ]] || fail "the backend did not start"

# The default rx depth (500) makes a CQ of 501 entries: over max_queue_depth.
rc=0
vrun --guest greedy-depth -- ibv_rc_pingpong -p "$(free_port)" >"$E2E_TMP/depth.out" 2>&1 || rc=$?
[[ $rc -ne 0 ]] || fail "ibv_rc_pingpong with rx depth 500 ran under max_queue_depth = 256"
grep -q "Couldn't create CQ" "$E2E_TMP/depth.out" || fail "unclear failure: $(cat "$E2E_TMP/depth.out")"
grep -q 'guest greedy-depth: quota max_queue_depth = 256 reached' "$E2E_TMP/vrdmad.log" ||
  fail "no log line for max_queue_depth"
# The program's own stderr names the quota too, once (its message alone says only the verb).
[[ $(grep -c 'refused: .*guest quota max_queue_depth = 256' "$E2E_TMP/depth.out") == 1 ]] ||
  fail "the program's stderr does not name max_queue_depth once: $(cat "$E2E_TMP/depth.out")"

# 128 KiB messages: the MR is over max_mr_bytes.
rc=0
vrun --guest greedy-bytes -- ibv_rc_pingpong -p "$(free_port)" -r 64 -s 131072 \
  >"$E2E_TMP/bytes.out" 2>&1 || rc=$?
[[ $rc -ne 0 ]] || fail "a 128 KiB MR was registered under max_mr_bytes = 65536"
grep -q "Couldn't register MR" "$E2E_TMP/bytes.out" || fail "unclear failure: $(cat "$E2E_TMP/bytes.out")"
grep -q 'guest greedy-bytes: quota max_mr_bytes = 65536 reached' "$E2E_TMP/vrdmad.log" ||
  fail "no log line for max_mr_bytes"
grep -q 'refused: .*guest quota max_mr_bytes = 65536' "$E2E_TMP/bytes.out" ||
  fail "the program's stderr does not name max_mr_bytes: $(cat "$E2E_TMP/bytes.out")"

# Within the quotas, on the same backend.
run_pair fits fits-srv fits-cli -r 64 -s 4096 -n 200
wait_status '$j->{totals}{qp}' 0 10 || fail "QPs left: $(status_json)"
e2e_pass
