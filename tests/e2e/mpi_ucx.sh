#!/usr/bin/env bash
# Debian's unmodified Open MPI over UCX over vrdma: 2 ranks on one host with `--mca pml ucx` and
# UCX_TLS=rc_verbs,ud_verbs,self, through plain `vrdma run`. mpi_check.c checks a ping-pong and
# an MPI_Allreduce; the ranks' endpoints must be on rc_verbs/vrdma0:1 (UCX's own log), and
# MPI_Finalize must not wait for transport retries (it once took 9 s: a zero-length RDMA WRITE
# with rkey 0 that the device refused, see qperf.sh and ucx_rc_verbs.sh).
# Usage: mpi_ucx.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=mpi_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/mpi_lib.sh"
mpi_require
e2e_init "${1:-}"
mpi_build
mpi_run vrun -- mpirun --allow-run-as-root --oversubscribe -np 2 --mca pml ucx "$E2E_TMP/mpi_check"
mpi_check_output
log "ping-pong and MPI_Allreduce checked over rc_verbs/vrdma0:1; the job took $MPI_MS ms"
e2e_pass
