// The requester's rules: what a posted work request may be, and the answer to each fault — an
// errno from ibv_post_send/ibv_post_recv with the WR not taken (rdma-core's ibv_post_send(3):
// EINVAL for a bad WR, ENOMEM for a full queue), or, for what only executing the WR finds, the
// status of its completion. Written once, applied by every post path: the mediated ring
// (verbs/datapath.cc, and the engine's local_check for what it executes), the direct path on
// one host (verbs/direct.cc) and the path between libraries (verbs/remote.cc), so the same bad
// WR gets the same answer on each. The responder's side is proto/responder_rules.h.
#pragma once

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstdint>

#include "proto/device_caps.h"
#include "proto/responder_rules.h"

namespace vrdma::proto {

/// A SEND of any kind: it consumes a receive WQE at the responder. SEND_WITH_INV also
/// invalidates the responder's memory window under its invalidate_rkey (responder_rules.h).
constexpr bool is_send(uint32_t op) {
  return op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_SEND_WITH_INV;
}

/// Memory-window operations the requester's device executes itself, with nothing sent: a bind
/// (IBV_WR_BIND_MW, and ibv_bind_mw of a type 1 window, which posts one) and IBV_WR_LOCAL_INV.
/// Only the backend knows windows: the direct path on one host leaves these, and SEND_WITH_INV,
/// to it; across backends a QP that may bind windows stays on the backends, and the library of
/// one that may not completes them with the backend's statuses (remote.cc).
constexpr bool is_local_mw_op(uint32_t op) {
  return op == IBV_WR_BIND_MW || op == IBV_WR_LOCAL_INV;
}

/// The reliable connected QP types: RC and both ends of XRC (acknowledged, PSNs, retries).
constexpr bool is_reliable(uint32_t qp_type) {
  return qp_type == IBV_QPT_RC || qp_type == IBV_QPT_XRC_SEND || qp_type == IBV_QPT_XRC_RECV;
}

/// The QP types whose pairs may talk library to library across backends (the direct path's
/// kDirectOffer/kDirectRemote): RC, and UC with UC's responder rules (what cannot land is lost).
constexpr bool direct_remote_type(uint32_t qp_type) {
  return qp_type == IBV_QPT_RC || qp_type == IBV_QPT_UC;
}

/// Opcodes each QP type may post (IB spec: UC has no READ and no atomics, UD only sends).
/// Memory windows: binds and local invalidation on RC and UC (the QPs that reach windows
/// through an rkey); SEND_WITH_INV on RC only (the IB spec has it for RC and XRC, not UC).
/// XRC_SEND posts what RC does but windows (vrdma binds no window through an XRC QP, and
/// SEND_WITH_INV would reach a window of the target's domain); XRC_RECV posts nothing.
constexpr bool opcode_allowed(uint32_t qp_type, uint32_t op) {
  if (qp_type == IBV_QPT_XRC_SEND)
    return is_send(op) ? op != IBV_WR_SEND_WITH_INV
                       : is_rdma_write(op) || op == IBV_WR_RDMA_READ || is_rdma_atomic(op);
  if (op == IBV_WR_SEND_WITH_INV) return qp_type == IBV_QPT_RC;
  if (is_send(op)) return qp_type == IBV_QPT_RC || qp_type == IBV_QPT_UC || qp_type == IBV_QPT_UD;
  if (is_rdma_write(op) || is_local_mw_op(op))
    return qp_type == IBV_QPT_RC || qp_type == IBV_QPT_UC;
  if (op == IBV_WR_RDMA_READ || is_rdma_atomic(op)) return qp_type == IBV_QPT_RC;
  return false;
}

/// A send queue takes WRs from RTS on (in SQD, SQE and ERR too: they complete, or are
/// flushed); before RTS, posting is EINVAL (IB spec 10.8.2, and ibv_post_send(3)).
constexpr bool can_post_send(uint32_t qp_state) {
  return qp_state != IBV_QPS_RESET && qp_state != IBV_QPS_INIT && qp_state != IBV_QPS_RTR;
}
/// A receive queue takes WRs in every state but RESET.
constexpr bool can_post_recv(uint32_t qp_state) { return qp_state != IBV_QPS_RESET; }

/// IBV_SEND_INLINE counts for SEND and RDMA WRITE only ("valid only for Send and RDMA Write",
/// ibv_post_send(3)); a READ or an atomic with the flag uses its SGEs, as without it.
constexpr bool is_inline(uint32_t op, uint32_t send_flags) {
  return (send_flags & IBV_SEND_INLINE) && (is_send(op) || is_rdma_write(op));
}

/// A zero-length SGE names no memory: its lkey and address are not looked at (rxe and mlx5
/// skip it too), as a zero-length WRITE or READ names no remote memory (names_remote_memory).
constexpr bool sge_names_memory(uint32_t length) { return length != 0; }

/// The send queue's limits a post is checked against (the QP's caps as created).
struct SendQueueCaps {
  uint32_t max_send_sge = 0;
  uint32_t max_inline_data = 0;
};

/// The post-time rules of one send WR on a QP of type `qp_type`, in order; each fault is
/// EINVAL and the post stops at that WR (*bad_wr), the ones before it taken:
/// - the opcode is one the QP type allows;
/// - 0 <= num_sge <= max_send_sge;
/// - a UD WR names an address handle;
/// - inline data (is_inline) is at most max_inline_data bytes in all.
/// 0 when they hold; `why` (when given) names the rule that did not. A full send queue is
/// ENOMEM, checked by each path against its own queue, first.
constexpr int check_post_send(uint32_t qp_type, const ibv_send_wr& wr, const SendQueueCaps& caps,
                              const char** why = nullptr) {
  auto no = [&](const char* w) {
    if (why) *why = w;
    return EINVAL;
  };
  if (!opcode_allowed(qp_type, wr.opcode)) return no("the QP type does not allow that opcode");
  if (wr.num_sge < 0 || static_cast<uint32_t>(wr.num_sge) > caps.max_send_sge)
    return no("more SGEs than the QP's max_send_sge");
  if (qp_type == IBV_QPT_UD && !wr.wr.ud.ah) return no("a UD send without an address handle");
  if (is_inline(wr.opcode, wr.send_flags)) {
    uint64_t total = 0;
    for (int i = 0; i < wr.num_sge; ++i) total += wr.sg_list[i].length;
    if (total > caps.max_inline_data) return no("more inline data than the QP's max_inline_data");
  }
  return 0;
}

/// The rules of a WR's length, found when its SGEs are resolved (the sum of their lengths):
/// at most max_msg_sz, and an atomic's exactly 8 bytes (its result). LOC_LEN_ERR otherwise,
/// as the completion of that WR. (The responder adds its own: an atomic's remote address
/// 8-aligned, REM_INV_REQ_ERR; responder_rules.h.)
constexpr ibv_wc_status check_send_length(uint32_t op, uint64_t len, const char** why = nullptr) {
  auto no = [&](const char* w) {
    if (why) *why = w;
    return IBV_WC_LOC_LEN_ERR;
  };
  if (len > kMaxMsgSize) return no("message longer than max_msg_sz");
  if (is_rdma_atomic(op) && len != 8) return no("an atomic needs 8 bytes of local memory");
  return IBV_WC_SUCCESS;
}

/// A bind of a memory window, as its executor finds it: the window (by the handle the WQE
/// names), the MR the bind names (by its lkey; absent for a type 1 unbind, length 0), and the
/// bind's range and access.
struct MwBindView {
  bool mw_found = false;
  uint32_t mw_type = 0;     ///< IBV_MW_TYPE_*
  bool mw_bound = false;    ///< type 2: a bound window takes no other bind until invalidated
  bool mw_same_pd = false;  ///< the window's PD is the QP's (type 2) ...
  bool mr_found = false;
  bool mr_same_pd = false;  ///< ... and the MR's (both types; ibv_bind_mw(3) says EPERM)
  uint32_t mr_access = 0;
  uint64_t mr_iova = 0, mr_length = 0;
  uint32_t new_rkey = 0, old_rkey = 0;  ///< type 2: only the 8-bit key may change
  uint64_t addr = 0, length = 0;
  uint32_t access = 0;  ///< the window's access: IBV_ACCESS_REMOTE_* and IBV_ACCESS_ZERO_BASED
};

/// The rules of a bind (the IB spec's memory windows; rdma-core's ibv_bind_mw(3),
/// ibv_post_send(3)), in order, each fault the bind's completion IBV_WC_MW_BIND_ERR (the QP then
/// goes to ERR):
/// - the window exists, and the QP allows binds (IBV_ACCESS_MW_BIND in its qp_access_flags);
/// - a type 2 window is in the QP's PD, is not bound, and keeps its 24-bit index in the new rkey;
/// - a type 1 bind of length 0 unbinds and needs nothing more;
/// - the MR exists in the window's PD and allows binds (IBV_ACCESS_MW_BIND);
/// - the access is remote bits and IBV_ACCESS_ZERO_BASED only (a zero-based window is addressed
///   from 0: responder_rules.h window_view), and remote write or atomic access needs local
///   write on the MR;
/// - [addr, addr + length) lies in the MR (its iova range, as rkeys address it).
/// IBV_WC_SUCCESS when they hold; `why` (when given) names the rule that did not.
constexpr ibv_wc_status check_bind_mw(uint32_t qp_access, const MwBindView& b,
                                      const char** why = nullptr) {
  auto no = [&](const char* w) {
    if (why) *why = w;
    return IBV_WC_MW_BIND_ERR;
  };
  if (!b.mw_found) return no("no memory window of the session under that handle");
  if (!(qp_access & IBV_ACCESS_MW_BIND)) return no("the QP does not allow binds (MW_BIND)");
  if (b.mw_type == IBV_MW_TYPE_2) {
    if (!b.mw_same_pd) return no("a type 2 window of another PD than the QP's");
    if (b.mw_bound) return no("a type 2 window that is bound already");
    if ((b.new_rkey ^ b.old_rkey) & ~0xffu) return no("the new rkey changes the window's index");
  } else if (b.length == 0) {
    return IBV_WC_SUCCESS;
  }
  if (!b.mr_found || !b.mr_same_pd) return no("no MR of the window's PD under that lkey");
  if (!(b.mr_access & IBV_ACCESS_MW_BIND)) return no("the MR does not allow binds (MW_BIND)");
  constexpr uint32_t kRemote =
      IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  if (b.access & ~(kRemote | IBV_ACCESS_ZERO_BASED))
    return no("window access other than remote read, write, atomic and zero-based");
  if ((b.access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(b.mr_access & IBV_ACCESS_LOCAL_WRITE))
    return no("remote write or atomic access on an MR without local write");
  if (b.addr < b.mr_iova || b.length > b.mr_length || b.addr - b.mr_iova > b.mr_length - b.length)
    return no("the window is outside the MR");
  return IBV_WC_SUCCESS;
}

/// The post-time rule of a receive WR: 0 <= num_sge <= max_recv_sge (the QP's, or the SRQ's
/// max_sge), else EINVAL.
constexpr int check_post_recv(const ibv_recv_wr& wr, uint32_t max_recv_sge) {
  return wr.num_sge < 0 || static_cast<uint32_t>(wr.num_sge) > max_recv_sge ? EINVAL : 0;
}

}  // namespace vrdma::proto
