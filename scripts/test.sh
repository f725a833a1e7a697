#!/usr/bin/env bash
# Installs the dependencies, builds and runs the whole test suite (unit + e2e).
# Usage: scripts/test.sh                 release, asan-ubsan, tsan (what CI runs): each runs even if
#                                        an earlier one failed; exit 1 if any did; the release stage
#                                        without the `unit` programs (unit_tests); VRDMA_FUZZ=1 adds
#                                        the libFuzzer smoke (the fuzz preset) at the end
#        scripts/test.sh PRESET [ctest args...]   one preset: release, debug, asan-ubsan, tsan, fuzz
#                                                 example: scripts/test.sh asan-ubsan -R e2e
# Each test preset selects by ctest label (CMakePresets.json, tests/CMakeLists.txt): release and
# debug run every test, asan-ubsan all but the `load` and `abi` ones, tsan only the `threads` ones
# (and builds only what they need).
# What each stage costs (BENCHMARKS.md, "CI time: the CPU of each test"): the builds are most of
# it; under ASan an end-to-end test costs 1-25 CPU-s, and each runs code the sanitizer checks
# (transport, direct path, migration, the CM), so every non-`load` test stays in both stages. A
# test does less under ASan only where the rest is volume through code it has already run
# (`under_asan` in tests/e2e/lib.sh: rc_pingpong's large messages, direct_path's iterations).
# scripts/test_cpu.py BUILD_DIR [ctest args] measures each test's CPU.
# The fuzz preset (clang-14 + libFuzzer) builds only the fuzz targets and runs each for a bounded
# number of executions (tests/fuzz/smoke.sh: VRDMA_FUZZ_RUNS, VRDMA_FUZZ_SECONDS).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

"$ROOT/scripts/deps.sh"

# Configures and builds one preset. Usage: build_preset PRESET
build_preset() {
  # Unity build (CMAKE_UNITY_BUILD): each target's sources compile as a few large files, which
  # parses the heavy headers (nlohmann/json, gtest) once per target instead of once per file:
  # ~25% less build time, which is most of CI. VRDMA_UNITY=OFF builds file by file.
  # Chained with &&, not left to `set -e`, which an `if` below switches off.
  cmake --preset "$1" -DCMAKE_UNITY_BUILD="${VRDMA_UNITY:-ON}" -DVRDMA_UNIT_TESTS="$(unit_tests "$1")" &&
    cmake --build --preset "$1"
}

# ON or OFF: whether PRESET builds (and so runs) the unit test programs (label `unit`). The whole
# sequence leaves them out of its release stage: the asan-ubsan stage runs every one of them,
# under ASan and UBSan, and their build and run in release cost ~90 CPU-s (~45 s of the 2-core
# CI) for tests that exercise the same code deterministically (BENCHMARKS.md, "CI time: every
# core busy"). One preset run alone builds them. Usage: unit_tests PRESET
WHOLE_SEQUENCE=0
unit_tests() { if [[ $WHOLE_SEQUENCE == 1 && $1 == release ]]; then echo OFF; else echo ON; fi; }
# The ctest arguments of PRESET's stage in the whole sequence: its release stage leaves out the
# `verbs` tests too (the verbs API through the library, 253 runs, ~62 test-s: ~31 s of a stage
# whose wall is its tests' durations over two slots); asan-ubsan and tsan run every one of them,
# and the release e2e tests drive the same calls through Debian's tools at release speed
# (BENCHMARKS.md, "CI time: the pollers nap"). The release and asan-ubsan stages run
# VRDMA_TEST_JOBS tests at once (default 3, the presets' 2 otherwise): their tests wait on
# timers, sockets and each other more than they compute, so a third slot shortened those stages'
# tests by ~30 % on CI's two cores, and the whole sequence from 895 to 793 s, although the
# background builds then get less CPU (BENCHMARKS.md, "CI time: three tests at once").
# Usage: stage_tests PRESET
stage_tests() {
  local jobs=${VRDMA_TEST_JOBS:-3}
  case $1 in
    release) echo "-LE ^verbs\$ -j$jobs" ;;
    asan-ubsan) echo "-j$jobs" ;;
  esac
}

run_preset() {
  local preset=$1
  shift
  echo "== $preset: build"
  build_preset "$preset" &&
    echo "== $preset: test" &&
    ctest --preset "$preset" "$@"
}

if [[ $# -gt 0 ]]; then
  run_preset "$@"
  exit
fi
# Every preset runs even when one fails, so one failure does not hide the others; the summary
# at the end names each preset's result and time, and the exit code is non-zero if any failed.
#
# The presets after the first build in the background while the earlier ones' tests run, at
# SCHED_IDLE (and idle I/O): the tests wait on timers, sockets and other processes as much as they
# compute, and an idle-class build takes only the CPU they leave. On CI's two cores this hides
# most of the sanitizer and fuzz builds (about a third of the suite's time). The tests are made
# to pass on a loaded machine; VRDMA_PREBUILD=0 builds each preset only when its turn comes.
# The fuzz preset is not in the default sequence: its clang build and bounded runs cost ~160
# CPU-s (~80 s of a 2-core CI that is CPU-bound throughout) for a random search of ~20 s per
# target, while every stage replays the fuzz corpora (`fuzz_replay_test`, under ASan and UBSan
# in asan-ubsan) as regression tests. `scripts/test.sh fuzz` runs it; VRDMA_FUZZ=1 appends it.
presets=(release asan-ubsan tsan)
[[ ${VRDMA_FUZZ:-0} == 1 ]] && presets+=(fuzz)
WHOLE_SEQUENCE=1
prebuild_pid=""
# Ends the background build and everything it started. Usage: kill_tree PID
kill_tree() {
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
if [[ ${VRDMA_PREBUILD:-1} != 0 ]]; then
  mkdir -p build
  rm -f build/prebuild-*.rc
  (
    chrt --idle -p 0 "$BASHPID" >/dev/null && ionice -c 3 -p "$BASHPID" ||
      echo "test.sh: could not lower the background build's priority; it runs at normal priority" >&2
    for preset in "${presets[@]:1}"; do
      rc=0
      build_preset "$preset" >"build/prebuild-$preset.log" 2>&1 || rc=$?
      echo "$rc" >"build/prebuild-$preset.rc"
    done
  ) </dev/null &
  prebuild_pid=$!
  trap 'kill_tree "$prebuild_pid"' EXIT
fi
summary=() failed=0 tails=()
for preset in "${presets[@]}"; do
  t0=$SECONDS
  if [[ -n $prebuild_pid && $preset != "${presets[0]}" ]]; then
    # Wait for the background build of this preset (it logs to build/prebuild-PRESET.log); the
    # build in run_preset then finds nothing to do, or rebuilds what failed, in the foreground.
    while [[ ! -e build/prebuild-$preset.rc ]] && kill -0 "$prebuild_pid" 2>/dev/null; do sleep 1; done
  fi
  if run_preset "$preset" $(stage_tests "$preset"); then result=passed; else
    result=FAILED failed=1 tails+=("$preset")
  fi
  summary+=("$(printf '%-11s %-7s %4d s' "$preset" "$result" $((SECONDS - t0)))")
done
# A failed stage's tests again, each with the end of its output, next to the summary: a record that
# keeps only the end of this script's output (a CI log's tail) still says what failed and how.
for preset in "${tails[@]}"; do
  echo "== $preset: the tests that failed"
  python3 scripts/failed_tails.py "build/$preset" 30 || true
done
echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
