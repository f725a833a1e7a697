// Creation of extended CQs and QPs: checks what the caller asks for against what the device
// does, creates the object exactly as ibv_create_cq / ibv_create_qp do, then fills the
// ibv_cq_ex / ibv_qp_ex callbacks (extended_datapath.cc). Destruction is ibv_destroy_cq/qp's.
#include "verbs/extended.h"

#include <climits>
#include <cstddef>

#include "verbs/internal.h"

using namespace vrdma::verbs;

#define VERBS_EXPORT extern "C" __attribute__((visibility("default")))

// ibv_cq_ex_to_cq() is a cast: ibv_cq must be a prefix of ibv_cq_ex.
#define VRDMA_SAME_OFFSET(A, B, m) static_assert(offsetof(A, m) == offsetof(B, m), #m)
VRDMA_SAME_OFFSET(ibv_cq, ibv_cq_ex, context);
VRDMA_SAME_OFFSET(ibv_cq, ibv_cq_ex, channel);
VRDMA_SAME_OFFSET(ibv_cq, ibv_cq_ex, cq_context);
VRDMA_SAME_OFFSET(ibv_cq, ibv_cq_ex, handle);
VRDMA_SAME_OFFSET(ibv_cq, ibv_cq_ex, cqe);
VRDMA_SAME_OFFSET(ibv_cq, ibv_cq_ex, mutex);
VRDMA_SAME_OFFSET(ibv_cq, ibv_cq_ex, cond);
VRDMA_SAME_OFFSET(ibv_cq, ibv_cq_ex, comp_events_completed);
VRDMA_SAME_OFFSET(ibv_cq, ibv_cq_ex, async_events_completed);
#undef VRDMA_SAME_OFFSET
static_assert(sizeof(ibv_cq) <= offsetof(ibv_cq_ex, comp_mask));
static_assert(offsetof(ibv_qp_ex, qp_base) == 0);
static_assert(offsetof(VCq, cq) == 0 && offsetof(VCq, cq_ex) == 0);
static_assert(offsetof(VQp, qp) == 0 && offsetof(VQp, qp_ex) == 0);

namespace {

/// Completion fields the rings carry (proto::Cqe, and CqeStamp when asked); CVLAN, flow tag
/// and TM info no.
constexpr uint64_t kSupportedWcFlags = uint64_t{IBV_WC_STANDARD_FLAGS} |
                                       IBV_WC_EX_WITH_COMPLETION_TIMESTAMP |
                                       IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK;

constexpr uint32_t kKnownCqMask = IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD;

/// The builders extended_datapath.cc implements, per QP type (UC: no READ, no atomics; UD:
/// sends, addressed with wr_set_ud_addr).
constexpr uint64_t kUcSendOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
                                IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
                                IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV;
constexpr uint64_t kUdSendOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;
constexpr uint64_t kRcSendOps = kUcSendOps | IBV_QP_EX_WITH_RDMA_READ |
                                IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
                                IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_SEND_WITH_INV;

/// XRC_SEND: RC's, less the windows (proto::opcode_allowed).
constexpr uint64_t kXrcSendOps =
    kRcSendOps &
    ~uint64_t{IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_SEND_WITH_INV};

constexpr uint32_t kSupportedQpMask =
    IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;

}  // namespace

namespace vrdma::verbs {

ibv_cq_ex* create_cq_ex(ibv_context* c, ibv_cq_init_attr_ex* a) {
  if (!a) return fail_ptr<ibv_cq_ex>(EINVAL);
  if (a->comp_mask & ~kKnownCqMask) return fail_ptr<ibv_cq_ex>(EINVAL);
  // No parent domains, so no CQ may name one.
  if (a->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) return fail_ptr<ibv_cq_ex>(EOPNOTSUPP);
  // SINGLE_THREADED is a hint (we lock anyway: one uncontended atomic); IGNORE_OVERRUN asks
  // for CQEs written past a full ring, which the backend never does (it drops and reports).
  if ((a->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) &&
      (a->flags & ~static_cast<uint32_t>(IBV_CREATE_CQ_ATTR_SINGLE_THREADED)))
    return fail_ptr<ibv_cq_ex>(EOPNOTSUPP);
  if (a->wc_flags & ~kSupportedWcFlags) return fail_ptr<ibv_cq_ex>(EOPNOTSUPP);
  if (a->cqe > INT_MAX || a->comp_vector > INT_MAX) return fail_ptr<ibv_cq_ex>(EINVAL);
  uint32_t stamps = 0;
  if (a->wc_flags & IBV_WC_EX_WITH_COMPLETION_TIMESTAMP) stamps |= proto::kStampRaw;
  if (a->wc_flags & IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK) stamps |= proto::kStampWallclock;
  ibv_cq* cq = create_cq(c, static_cast<int>(a->cqe), a->cq_context, a->channel,
                         static_cast<int>(a->comp_vector), stamps);
  if (!cq) return nullptr;
  VCq* v = to_vcq(cq);
  install_cq_ex_ops(v->cq_ex);
  return &v->cq_ex;
}

ibv_qp* create_qp_ex(ibv_context* c, ibv_qp_init_attr_ex* a) {
  if (!a) return fail_ptr<ibv_qp>(EINVAL);
  if (a->qp_type == IBV_QPT_XRC_RECV) return create_xrc_recv_qp(c, a);  // xrc.cc
  if (!(a->comp_mask & IBV_QP_INIT_ATTR_PD) || !a->pd || a->pd->context != c)
    return fail_ptr<ibv_qp>(EINVAL);
  // A domain is for XRC receive QPs only.
  if (a->comp_mask & IBV_QP_INIT_ATTR_XRCD) return fail_ptr<ibv_qp>(EINVAL);
  if (a->comp_mask & ~kSupportedQpMask) return fail_ptr<ibv_qp>(EOPNOTSUPP);
  if ((a->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && a->create_flags)
    return fail_ptr<ibv_qp>(EOPNOTSUPP);
  const bool ex = a->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  if (ex) {
    const uint64_t ops = a->qp_type == IBV_QPT_RC         ? kRcSendOps
                         : a->qp_type == IBV_QPT_UC       ? kUcSendOps
                         : a->qp_type == IBV_QPT_UD       ? kUdSendOps
                         : a->qp_type == IBV_QPT_XRC_SEND ? kXrcSendOps
                                                          : 0;
    if (!ops || (a->send_ops_flags & ~ops)) return fail_ptr<ibv_qp>(EOPNOTSUPP);
  }
  // ibv_qp_init_attr is a prefix of ibv_qp_init_attr_ex (verbs.h's inline wrapper relies on it
  // too); ibv_create_qp writes the granted capabilities back into it.
  ibv_qp* qp = ibv_create_qp(a->pd, reinterpret_cast<ibv_qp_init_attr*>(a));
  if (!qp || !ex) return qp;
  install_qp_ex_ops(to_vqp(qp)->qp_ex);
  return qp;
}

}  // namespace vrdma::verbs

VERBS_EXPORT ibv_qp_ex* ibv_qp_to_qp_ex(ibv_qp* qp) {
  VQp* v = to_vqp(qp);
  if (v->qp_ex.wr_start) return &v->qp_ex;  // created by create_qp_ex with SEND_OPS_FLAGS
  errno = EOPNOTSUPP;
  return nullptr;
}
