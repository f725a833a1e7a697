#!/usr/bin/env bash
# Debian's unmodified qperf through vrdma on one host: its RDMA tests (XRC aside: Debian builds
# qperf without it, its xrc_* tests are "bad test") for one second each, half of them in each
# mode, one client run for them. MODE `wait` sleeps on completion channels
# (qperf's default), `poll` polls the CQs (-cp 1). Its one-way tests create QPs with
# max_send_wr or max_recv_wr 0, which the device once refused.
# Usage: qperf.sh BIN_DIR wait|poll
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
case "${2:-}" in
  wait) cp=0 ;;
  poll) cp=1 ;;
  *) fail "usage: $0 BIN_DIR wait|poll" ;;
esac
command -v qperf >/dev/null || fail "qperf is not installed (scripts/deps.sh installs it)"

TESTS=(rc_bi_bw rc_bw rc_lat rc_rdma_read_bw rc_rdma_read_lat rc_rdma_write_bw rc_rdma_write_lat
  rc_rdma_write_poll_lat rc_compare_swap_mr rc_fetch_add_mr ver_rc_compare_swap ver_rc_fetch_add
  uc_bi_bw uc_bw uc_lat uc_rdma_write_bw uc_rdma_write_lat uc_rdma_write_poll_lat
  ud_bi_bw ud_bw ud_lat)
# Every RDMA test qperf knows but XRC's is in the list: a qperf with a new one fails here.
known="$(qperf --help tests | awk '/^(RDMA|InfiniBand|Verification)/ {t = 1; next}
  /^[A-Z]/ {t = 0} t && $1 !~ /^xrc_/ {print $1}' | sort)"
[[ $known == "$(printf '%s\n' "${TESTS[@]}" | sort)" ]] ||
  fail "qperf's RDMA tests are not the list: $(tr '\n' ' ' <<<"$known")"

# Each mode runs every other test of the list (wait the even ones, poll the odd ones), so
# both ways of completing meet RC, UC and UD and every test runs once across the two: ~11 s a
# mode instead of ~22 s. QPERF_ALL=1 runs the whole list in both.
if [[ -z ${QPERF_ALL:-} ]]; then
  half=()
  for i in "${!TESTS[@]}"; do ((i % 2 == cp)) && half+=("${TESTS[$i]}"); done
  TESTS=("${half[@]}")
fi

port="$(free_port)"
vrun --guest qperf-srv -- qperf -lp "$port" >"$E2E_TMP/qperf.server.out" 2>&1 &
srv=$!
wait_listen "$port" "$srv" qperf
# One second each (qperf's -t takes whole seconds; -n never ends, with any transport).
vrun --guest qperf-cli -- qperf -lp "$port" localhost -t 1 -cp "$cp" "${TESTS[@]}" \
  >"$E2E_TMP/qperf.client.out" 2>&1 &
cli=$!
wait_pid "$cli" 90
[[ $WAIT_RC == 0 ]] || fail "qperf client exited $WAIT_RC"
out="$E2E_TMP/qperf.client.out"
for t in "${TESTS[@]}"; do
  # "rc_lat:" then "    latency  =  3.29 us" (bw, msg_rate, send_bw/recv_bw likewise); qperf
  # groups thousands with commas ("1,000 ns": a READ that took exactly 1 µs on a fast run).
  awk -v t="$t:" '$0 == t {getline; print; exit}' "$out" |
    grep -Eq '^ +[a-z_]+ += +[0-9][0-9.,]* [a-zA-Z/]+$' || fail "$t: no result: $(cat "$out")"
done
log "$2: all ${#TESTS[@]} tests: $(grep -E 'latency|msg_rate' "$out" | awk '{print $3 $4}' | tr '\n' ' ')"
# The server serves until told to quit.
vrun --guest qperf-cli -- qperf -lp "$port" localhost quit >/dev/null 2>&1 || true
wait_pid "$srv" 10
[[ $WAIT_RC == 0 ]] || fail "qperf server exited $WAIT_RC"
e2e_pass
