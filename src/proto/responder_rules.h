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
  /// Added to an address the rkey names to give the MR's iova (mr_iova_of): a zero-based
  /// window's start in its MR; 0 for an MR and any other window.
  uint64_t base = 0;
};

/// The MR iova an address under the rkey names (once check_remote_request accepted it): each
/// executor finds the bytes of that iova in its own memory.
constexpr uint64_t mr_iova_of(const RemoteMrView& v, uint64_t raddr) { return raddr + v.base; }

/// What the responder found under a request's rkey when it names a memory window (windows live
/// in the backend only; the library across backends asks it, kMwView). An rkey of a window is its
/// index (upper 24 bits) and the key of its latest bind (low 8 bits, ibv_inc_rkey(3)).
struct RemoteMwView {
  bool found = false;     ///< a window of the responder's guest has that index
  uint32_t type = 0;      ///< IBV_MW_TYPE_*
  bool bound = false;     ///< bound, and not invalidated or unbound since
  bool same_key = false;  ///< the rkey's 8-bit key is the latest bind's
  bool same_pd = false;   ///< the window's PD is the responder QP's
  bool same_qp = false;   ///< type 2: it was bound through the responder QP
  uint32_t access = 0;    ///< the bind's IBV_ACCESS_REMOTE_* bits
  uint64_t addr = 0, length = 0;
};

/// A window reaches memory only while bound under that very key, and only through a QP of its
/// PD; a type 2 window only through the QP it was bound on. That is type 2B (IBV_DEVICE_MEM_
/// WINDOW_TYPE_2B, "associated with PD and QPN", as the kernel's IB/core commit 7083e42ee2ff
/// that brought type 2 windows describes the flavours). Through the window the MR's
/// checks apply with the window's access and range: check_remote_request on the view this
/// returns (not found: REM_ACCESS_ERR, as for an rkey of no MR). A window bound with
/// IBV_ACCESS_ZERO_BASED is addressed from 0: [0, length) names [addr, addr + length) of its
/// MR (mr_iova_of); any other is addressed as its MR, [addr, addr + length).
constexpr RemoteMrView window_view(const RemoteMwView& w) {
  const bool usable =
      w.found && w.bound && w.same_key && w.same_pd && (w.type != IBV_MW_TYPE_2 || w.same_qp);
  if (!usable) return RemoteMrView{};
  const uint32_t access = w.access & ~static_cast<uint32_t>(IBV_ACCESS_ZERO_BASED);
  if (w.access & IBV_ACCESS_ZERO_BASED) return RemoteMrView{true, access, 0, w.length, w.addr};
  return RemoteMrView{true, access, w.addr, w.length, 0};
}

/// Invalidation of a window's rkey: by the responder for a SEND_WITH_INV (`fault`
/// REM_INV_REQ_ERR for the requester; the receive completes with LOC_PROT_ERR) or by the QP's
/// own IBV_WR_LOCAL_INV (`fault` LOC_QP_OP_ERR). Only a bound type 2 window, under its current
/// key, bound through this QP (ibv_alloc_mw(3): a type 1 window is unbound by a bind of length
/// 0, not invalidated). This device has no fast-registration MRs, so an MR's rkey is never
/// invalidated.
constexpr ibv_wc_status check_invalidate(const RemoteMwView& w, ibv_wc_status fault,
                                         const char** why = nullptr) {
  auto no = [&](const char* m) {
    if (why) *why = m;
    return fault;
  };
  if (!w.found || !w.same_key) return no("no window under that rkey to invalidate");
  if (w.type != IBV_MW_TYPE_2) return no("a type 1 window is not invalidated, but unbound");
  if (!w.bound) return no("the window is not bound");
  if (!w.same_qp) return no("the window was bound through another QP");
  return IBV_WC_SUCCESS;
}

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

/// RNR (IB spec 9.7.5.2.8): a request that finds no receive is NAKed; the requester waits the
/// responder's min_rnr_timer (rnr_delay_ns) and sends it again, rnr_retry times, 7 meaning for
/// ever; then its WR completes with IBV_WC_RNR_RETRY_EXC_ERR and the QP goes to ERR. Every
/// requester counts with rnr_may_retry: the backend's (same host and across backends) and the
/// library's on the direct path across backends.
inline constexpr uint32_t kRnrRetryForever = 7;

/// min_rnr_timer's encoding (IB spec table 45, in microseconds) as nanoseconds.
constexpr uint64_t rnr_delay_ns(uint8_t t) {
  constexpr uint32_t kUs[32] = {655360, 10,    20,    30,     40,     60,     80,     120,
                                160,    240,   320,   480,    640,    960,    1280,   1920,
                                2560,   3840,  5120,  7680,   10240,  15360,  20480,  30720,
                                40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return uint64_t{kUs[t & 31]} * 1000;
}

/// An RNR NAK at the requester: true when it may try again (counting `left` down), false when
/// its retries are spent (RNR_RETRY_EXC_ERR). `fresh`: the first NAK of this message, which
/// loads `left` from the QP's rnr_retry.
constexpr bool rnr_may_retry(uint32_t rnr_retry, bool fresh, uint32_t& left) {
  if (fresh) left = rnr_retry;
  if (left == kRnrRetryForever) return true;
  if (left == 0) return false;
  --left;
  return true;
}

}  // namespace vrdma::proto
