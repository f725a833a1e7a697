#!/usr/bin/env bash
# CI smoke run of one fuzzer: a bounded number of executions (or 20 s, whichever comes first),
# starting from the seed corpus in the tree. New inputs go to a scratch directory, never into the
# tree; a crash leaves its input in WORK/ and fails the test.
# Usage: smoke.sh FUZZER SEED_DIR WORK_DIR [RUNS]
set -euo pipefail
fuzzer=$1 seeds=$2 work=$3 runs=${VRDMA_FUZZ_RUNS:-${4:-20000}}
rm -rf "$work"
mkdir -p "$work/corpus"
cd "$work"
export VRDMA_LOG=error
"$fuzzer" -runs="$runs" -max_total_time="${VRDMA_FUZZ_SECONDS:-20}" -max_len=4096 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$seeds"
