#!/usr/bin/env bash
# Installs the dependencies, builds and runs the whole test suite (unit + e2e).
# Usage: scripts/test.sh                 release, asan-ubsan, tsan, then the fuzz smoke (what CI runs):
#                                        each runs even if an earlier one failed; exit 1 if any did
#        scripts/test.sh PRESET [ctest args...]   one preset: release, debug, asan-ubsan, tsan, fuzz
#                                                 example: scripts/test.sh asan-ubsan -R e2e
# Each test preset selects by ctest label (CMakePresets.json, tests/CMakeLists.txt): release and
# debug run every test, asan-ubsan all but the `load` and `abi` ones, tsan only the `threads` ones
# (and builds only what they need).
# The fuzz preset (clang-14 + libFuzzer) builds only the fuzz targets and runs each for a bounded
# number of executions (tests/fuzz/smoke.sh: VRDMA_FUZZ_RUNS, VRDMA_FUZZ_SECONDS).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

"$ROOT/scripts/deps.sh"

run_preset() {
  local preset=$1
  shift
  echo "== $preset: build"
  # Unity build (CMAKE_UNITY_BUILD): each target's sources compile as a few large files, which
  # parses the heavy headers (nlohmann/json, gtest) once per target instead of once per file:
  # ~25% less build time, which is most of CI. VRDMA_UNITY=OFF builds file by file.
  # Chained with &&, not left to `set -e`, which an `if` below switches off.
  cmake --preset "$preset" -DCMAKE_UNITY_BUILD="${VRDMA_UNITY:-ON}" &&
    cmake --build --preset "$preset" &&
    echo "== $preset: test" &&
    ctest --preset "$preset" "$@"
}

if [[ $# -gt 0 ]]; then
  run_preset "$@"
  exit
fi
# Every preset runs even when one fails, so one failure does not hide the others; the summary
# at the end names each preset's result and time, and the exit code is non-zero if any failed.
summary=() failed=0
for preset in release asan-ubsan tsan fuzz; do
  t0=$SECONDS
  if run_preset "$preset"; then result=passed; else result=FAILED failed=1; fi
  summary+=("$(printf '%-11s %-7s %4d s' "$preset" "$result" $((SECONDS - t0)))")
done
echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
