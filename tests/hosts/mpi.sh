#!/usr/bin/env bash
# Open MPI across two namespace hosts, a backend in each: one rank on each with `--mca pml ucx`
# and UCX_TLS=rc_verbs,ud_verbs,self, started by mpirun on h1 (through `vrdma run`) and on h2 by
# Open MPI's rsh launcher, whose agent here enters h2's namespace through `vrdma run` with h2's
# backend. tests/e2e/mpi_check.c checks a ping-pong and an MPI_Allreduce; the endpoints must be
# on rc_verbs/vrdma0:1, and MPI_Finalize must not wait for transport retries.
# Usage: mpi.sh BIN_DIR
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  echo "SKIP: no mpicc or mpirun (scripts/deps.sh: openmpi-bin libopenmpi-dev)" >&2
  exit 77
fi
hosts_init "${1:-}" 2
wait_mesh
FINALIZE_MAX_S=3  # as tests/e2e/mpi_ucx.sh

mpicc -O2 -o "$E2E_TMP/mpi_check" "$(dirname "${BASH_SOURCE[0]}")/../e2e/mpi_check.c" ||
  fail "mpicc mpi_check.c"
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

start=$(date +%s%N)
UCX_TLS=rc_verbs,ud_verbs,self UCX_LOG_LEVEL=info hrun 1 -- \
  mpirun --allow-run-as-root -np 2 --hostfile "$E2E_TMP/hostfile" --mca pml ucx \
  --mca plm_rsh_agent "$E2E_TMP/agent" --mca oob_tcp_if_include eth0 \
  --mca btl_tcp_if_include eth0 -x UCX_TLS -x UCX_LOG_LEVEL "$E2E_TMP/mpi_check" \
  >"$E2E_TMP/mpi.out" 2>&1 || fail "mpirun exited $?: $(tail -n 20 "$E2E_TMP/mpi.out")"
ms=$((($(date +%s%N) - start) / 1000000))
grep -qx "$(host_ip 2)" "$E2E_TMP/agent.log" 2>/dev/null || fail "mpirun started nothing on h2"
grep -qx "mpi_check: ok" "$E2E_TMP/mpi.out" || fail "no 'mpi_check: ok': $(tail -n 20 "$E2E_TMP/mpi.out")"
[[ $(grep -c "ep_cfg.*rc_verbs/vrdma0:1" "$E2E_TMP/mpi.out") -ge 2 ]] ||
  fail "both ranks must use rc_verbs on vrdma0:1: $(grep 'ep_cfg' "$E2E_TMP/mpi.out")"
for r in 0 1; do
  s="$(sed -n "s/^mpi_check: rank $r finalize \([0-9.]*\) s$/\1/p" "$E2E_TMP/mpi.out")"
  [[ -n $s ]] || fail "rank $r did not say how long its MPI_Finalize took"
  awk -v s="$s" -v m="$FINALIZE_MAX_S" 'BEGIN {exit !(s < m)}' ||
    fail "rank $r: MPI_Finalize took $s s (a retry wait?)"
  log "rank $r: MPI_Finalize took $s s"
done
log "ping-pong and MPI_Allreduce across two hosts over rc_verbs/vrdma0:1; the job took $ms ms"
e2e_pass
