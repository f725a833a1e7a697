#!/usr/bin/env bash
# Debian's unmodified Open MPI over UCX over vrdma: 2 ranks on one host with `--mca pml ucx` and
# UCX_TLS=rc_verbs,ud_verbs,self, through plain `vrdma run`. mpi_check.c checks a ping-pong and
# an MPI_Allreduce; the ranks' endpoints must be on rc_verbs/vrdma0:1 (UCX's own log), and
# MPI_Finalize must not wait for transport retries (it once took 9 s: a zero-length RDMA WRITE
# with rkey 0 that the device refused, see qperf.sh and ucx_rc_verbs.sh).
# Usage: mpi_ucx.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init "${1:-}"
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  log "SKIP: no mpicc or mpirun (scripts/deps.sh: openmpi-bin libopenmpi-dev)"
  exit 77
fi
# Well above a normal finalize (~0.2 s here), well below the retry wait it must not have.
FINALIZE_MAX_S=3

mpicc -O2 -o "$E2E_TMP/mpi_check" "$(dirname "${BASH_SOURCE[0]}")/mpi_check.c" ||
  fail "mpicc mpi_check.c"
start=$(date +%s%N)
UCX_TLS=rc_verbs,ud_verbs,self UCX_LOG_LEVEL=info vrun -- \
  mpirun --allow-run-as-root --oversubscribe -np 2 --mca pml ucx "$E2E_TMP/mpi_check" \
  >"$E2E_TMP/mpi.out" 2>&1 || fail "mpirun exited $?: $(tail -n 20 "$E2E_TMP/mpi.out")"
ms=$((($(date +%s%N) - start) / 1000000))
grep -qx "mpi_check: ok" "$E2E_TMP/mpi.out" || fail "no 'mpi_check: ok': $(tail -n 20 "$E2E_TMP/mpi.out")"
grep -q "ep_cfg.*rc_verbs/vrdma0:1" "$E2E_TMP/mpi.out" ||
  fail "UCX did not use rc_verbs on vrdma0:1: $(grep 'ep_cfg' "$E2E_TMP/mpi.out")"
for r in 0 1; do
  s="$(sed -n "s/^mpi_check: rank $r finalize \([0-9.]*\) s$/\1/p" "$E2E_TMP/mpi.out")"
  [[ -n $s ]] || fail "rank $r did not say how long its MPI_Finalize took"
  awk -v s="$s" -v m="$FINALIZE_MAX_S" 'BEGIN {exit !(s < m)}' ||
    fail "rank $r: MPI_Finalize took $s s (a retry wait?)"
  log "rank $r: MPI_Finalize took $s s"
done
log "ping-pong and MPI_Allreduce checked over rc_verbs/vrdma0:1; the job took $ms ms"
e2e_pass
