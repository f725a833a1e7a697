// The responder's rules: what an RDMA WRITE, READ or atomic may touch of the responder's memory,
// and the status each fault completes the requester's WR with (IB spec o9-20 ff., NAK codes;
// rdma-core's ibv_post_send(3)). Written once, applied by every executor of a request: the
// backend's responder (engine respond_begin, same host and across hosts), the direct path on one
// host (verbs/direct.cc: what fails there is left to the backend, so the status is this one),
// and the library-to-library path across hosts (verbs/remote_datapath.cc start_request). What is
// left to each executor is where the bytes lie in its own memory (segments and chunks, or this
// process).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

namespace vrdma::proto {

/// A zero-length RDMA WRITE or READ names no memory: the IB spec lets it carry any rkey and
/// address (UCX flushes with a 0-byte WRITE, rkey 0, address 0; rxe accepts it). The responder
/// QP's access flags are still checked.
inline constexpr bool names_remote_memory(uint64_t len) { return len != 0; }

constexpr bool is_rdma_write(uint32_t op) {
  return op == IBV_WR_RDMA_WRITE || op == IBV_WR_RDMA_WRITE_WITH_IMM;
}
constexpr bool is_rdma_atomic(uint32_t op) {
  return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

/// The access bit a request needs of the responder QP and of the MR under its rkey; 0 for
/// SENDs, which name no remote memory.
constexpr uint32_t remote_access_needed(uint32_t op) {
  return is_rdma_write(op)          ? IBV_ACCESS_REMOTE_WRITE
         : op == IBV_WR_RDMA_READ  ? IBV_ACCESS_REMOTE_READ
         : is_rdma_atomic(op)      ? IBV_ACCESS_REMOTE_ATOMIC
                                   : 0;
}

/// What the responder found under a request's rkey: an MR of the responder QP's PD (and, on the
/// backend, of its session), as each executor keeps its MRs.
struct RemoteMrView {
  bool found = false;
  uint32_t access = 0;
  uint64_t iova = 0, length = 0;  ///< rkeys address [iova, iova + length)
};

/// The rules of a WRITE, READ or atomic of length `len` at `raddr`, in order:
/// - the responder QP allows the access (qp_access_flags), else REM_ACCESS_ERR;
/// - a zero-length WRITE or READ needs nothing more;
/// - an MR under the rkey allows the access and holds [raddr, raddr + len) (atomics: 8 bytes),
///   else REM_ACCESS_ERR;
/// - an atomic's address is 8-aligned, else REM_INV_REQ_ERR.
/// IBV_WC_SUCCESS when they hold; `why` (when given) names the rule that did not.
/// (The executor then also wants the atomic's word 8-aligned where it lies in its own memory,
/// and in one mapping: REM_INV_REQ_ERR too.)
constexpr ibv_wc_status check_remote_request(uint32_t op, uint32_t qp_access, uint64_t raddr,
                                             uint64_t len, const RemoteMrView& mr,
                                             const char** why = nullptr) {
  auto no = [&](ibv_wc_status st, const char* w) {
    if (why) *why = w;
    return st;
  };
  const uint32_t need = remote_access_needed(op);
  if ((qp_access & need) != need)
    return no(IBV_WC_REM_ACCESS_ERR, "the responder QP does not allow that access");
  if (is_rdma_atomic(op)) len = 8;
  if (!names_remote_memory(len)) return IBV_WC_SUCCESS;
  if (!mr.found) return no(IBV_WC_REM_ACCESS_ERR, "no MR of the QP's PD under that rkey");
  if ((mr.access & need) != need)
    return no(IBV_WC_REM_ACCESS_ERR, "the MR does not allow that access");
  if (raddr < mr.iova || len > mr.length || raddr - mr.iova > mr.length - len)
    return no(IBV_WC_REM_ACCESS_ERR, "outside the MR");
  if (is_rdma_atomic(op) && (raddr & 7))
    return no(IBV_WC_REM_INV_REQ_ERR, "atomic on a misaligned address");
  return IBV_WC_SUCCESS;
}

}  // namespace vrdma::proto
