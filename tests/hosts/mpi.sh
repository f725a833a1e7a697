#!/usr/bin/env bash
# Open MPI across two namespace hosts, a backend in each: one rank on each with `--mca pml ucx`
# and UCX_TLS=rc_verbs,ud_verbs,self, started by mpirun on h1 (through `vrdma run`) and on h2 by
# Open MPI's rsh launcher, whose agent here enters h2's namespace through `vrdma run` with h2's
# backend. tests/e2e/mpi_check.c checks a ping-pong and an MPI_Allreduce; the endpoints must be
# on rc_verbs/vrdma0:1, and MPI_Finalize must not wait for transport retries.
# Usage: mpi.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=../e2e/mpi_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/mpi_lib.sh"
mpi_require
hosts_init "${1:-}" 2
wait_mesh
mpi_build
# The launcher's agent: called as AGENT [OPTIONS] HOST COMMAND..., as ssh would be.
cat >"$E2E_TMP/agent" <<EOF
#!/usr/bin/env bash
while [[ \$1 == -* ]]; do shift; done
host=\$1
shift
[[ \$host == $(host_ip 2) ]] || { echo "agent: unknown host \$host" >&2; exit 255; }
echo "\$host" >>"$E2E_TMP/agent.log"
exec ip netns exec $(host_ns 2) env VRDMA_SOCKET=$(host_sock 2) VRDMA_BACKEND=/nonexistent-vrdmad \
  ${VRUN[*]} -- /bin/sh -c "\$*"
EOF
chmod +x "$E2E_TMP/agent"
printf '%s slots=1\n%s slots=1\n' "$(host_ip 1)" "$(host_ip 2)" >"$E2E_TMP/hostfile"

mpi_run hrun 1 -- mpirun --allow-run-as-root -np 2 --hostfile "$E2E_TMP/hostfile" \
  --mca pml ucx --mca plm_rsh_agent "$E2E_TMP/agent" --mca oob_tcp_if_include eth0 \
  --mca btl_tcp_if_include eth0 -x UCX_TLS -x UCX_LOG_LEVEL "$E2E_TMP/mpi_check"
grep -qx "$(host_ip 2)" "$E2E_TMP/agent.log" 2>/dev/null || fail "mpirun started nothing on h2"
mpi_check_output
log "ping-pong and MPI_Allreduce across two hosts over rc_verbs/vrdma0:1; the job took $MPI_MS ms"
e2e_pass
