# Helpers of the Open MPI tests (tests/e2e/mpi_ucx.sh, tests/hosts/mpi.sh), sourced after
# tests/e2e/lib.sh: build mpi_check.c, run a job of it over UCX's rc_verbs, check what it said.
# shellcheck shell=bash

MPI_LIB_DIR="$(dirname "${BASH_SOURCE[0]}")"
# Well above a normal MPI_Finalize (~0.2 s here), well below the retry wait it must not have.
MPI_FINALIZE_MAX_S=3
MPI_MS=0

# Exits 77 (skip) unless mpicc and mpirun are installed.
mpi_require() {
  if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    echo "SKIP: no mpicc or mpirun (scripts/deps.sh: openmpi-bin libopenmpi-dev)" >&2
    exit 77
  fi
}

# Builds mpi_check.c into $E2E_TMP/mpi_check.
mpi_build() {
  mpicc -O2 -o "$E2E_TMP/mpi_check" "$MPI_LIB_DIR/mpi_check.c" || fail "mpicc mpi_check.c"
}

# Runs CMD... (an mpirun of $E2E_TMP/mpi_check) with UCX_TLS=rc_verbs,ud_verbs,self and UCX's
# info log (which names each endpoint's transport) into $E2E_TMP/mpi.out; MPI_MS: its duration.
# shellcheck disable=SC2034  # MPI_MS is read by the tests that source this
mpi_run() {
  local start asan
  start=$(date +%s%N)
  # A sanitized build preloads its runtime into the job: what it would report as leaks are Open
  # MPI's own (orte, hwloc, its plugins, unloaded before exit); the library's are checked by the
  # other tests.
  asan="${ASAN_OPTIONS:-}"
  [[ -z ${SAN_PRELOAD:-} ]] || asan="${asan:+$asan:}detect_leaks=0"
  ASAN_OPTIONS="$asan" UCX_TLS=rc_verbs,ud_verbs,self UCX_LOG_LEVEL=info "$@" \
    >"$E2E_TMP/mpi.out" 2>&1 ||
    fail "mpirun exited $?: $(tail -n 20 "$E2E_TMP/mpi.out")"
  MPI_MS=$((($(date +%s%N) - start) / 1000000))
}

# Checks $E2E_TMP/mpi.out: the ranks' checks passed, both ranks' endpoints are on
# rc_verbs/vrdma0:1, and each rank's MPI_Finalize took less than MPI_FINALIZE_MAX_S.
mpi_check_output() {
  local out="$E2E_TMP/mpi.out" r s
  grep -qx "mpi_check: ok" "$out" || fail "no 'mpi_check: ok': $(tail -n 20 "$out")"
  [[ $(grep -c "ep_cfg.*rc_verbs/vrdma0:1" "$out") -ge 2 ]] ||
    fail "both ranks must use rc_verbs on vrdma0:1: $(grep 'ep_cfg' "$out")"
  for r in 0 1; do
    s="$(sed -n "s/^mpi_check: rank $r finalize \([0-9.]*\) s$/\1/p" "$out")"
    [[ -n $s ]] || fail "rank $r did not say how long its MPI_Finalize took"
    awk -v s="$s" -v m="$MPI_FINALIZE_MAX_S" 'BEGIN {exit !(s < m)}' ||
      fail "rank $r: MPI_Finalize took $s s (a retry wait?)"
    log "rank $r: MPI_Finalize took $s s"
  done
}
