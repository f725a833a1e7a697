#!/usr/bin/env bash
# Many QPs on one backend-to-backend connection: ib_write_bw -q 64 at perftest's default depth
# (128 WRITEs in flight per QP, 1 MiB each) and -q 256 (256 KiB WRITEs) across two namespace
# hosts. The queue on the shared connection holds far more than one ACK timeout's worth of bytes;
# a reliable transport must not turn that queueing into IBV_WC_RETRY_EXC_ERR (Device::ack_timeout).
# perftest's CQ holds depth x QPs entries: 256 QPs at depth 128 is 32768, over the default quota
# max_queue_depth (8192), so -q 256 runs at depth 32 (8192) here; raise the quota for more.
# Pinned to the backends' TCP transport (--no-direct-remote): the test is about the queue on
# the one backend-to-backend connection.
# Usage: many_qps.sh BIN_DIR   (MANY_QPS: QPs:bytes:depth, default "64:1048576:128 256:262144:32")
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HOSTS_VRDMAD_ARGS="--no-direct-remote ${HOSTS_VRDMAD_ARGS:-}"
hosts_init "${1:-}" 2
wait_mesh

# perftest registers 2 x size per QP, which the backend maps: the sizes keep the set-up short,
# and each QP still queues a megabyte and more on the connection.
for qsd in ${MANY_QPS:-64:1048576:128 256:262144:32}; do
  IFS=: read -r q s d <<<"$qsd"
  hperftest 1 2 ib_write_bw -q "$q" -s "$s" -t "$d" -D 2
done
e2e_pass
