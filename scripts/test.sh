#!/usr/bin/env bash
# Installs the dependencies, builds and runs the whole test suite (unit + e2e).
# Usage: scripts/test.sh                 release, asan-ubsan, tsan, then the fuzz smoke (what CI runs)
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
  cmake --preset "$preset" -DCMAKE_UNITY_BUILD="${VRDMA_UNITY:-ON}"
  cmake --build --preset "$preset"
  echo "== $preset: test"
  ctest --preset "$preset" "$@"
}

if [[ $# -gt 0 ]]; then
  run_preset "$@"
else
  for preset in release asan-ubsan tsan fuzz; do
    run_preset "$preset"
  done
fi
