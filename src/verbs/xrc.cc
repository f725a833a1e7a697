// XRC in the drop-in library (ibv_open_xrcd(3), ibv_create_srq_ex(3), ibv_get_srq_num(3),
// ibv_open_qp(3), ibv_create_qp_ex(3)): domains, XRC SRQs and receive QPs are the backend's
// (engine/device_xrc.cc); this file turns the verbs into its commands. An XRC send QP is an
// ordinary QP with a send queue only (extended.cc); its WQEs carry the SRQ number (datapath.cc).
#include <fcntl.h>

#include <cstring>

#include "verbs/extended.h"
#include "verbs/internal.h"
#include "verbs/srq.h"

using namespace vrdma;
using namespace vrdma::proto;

namespace vrdma::verbs {

namespace {

struct VXrcd {
  ibv_xrcd xrcd;  ///< first: ibv_xrcd* and VXrcd* are the same address
  uint32_t handle;
};

VXrcd* to_vxrcd(ibv_xrcd* x) { return reinterpret_cast<VXrcd*>(x); }

/// What a receive QP's absent rings point at: full (size 0) and never written, so a post to
/// one fails with ENOMEM before it touches anything.
proto::RingHeader g_no_ring{};

/// An ibv_qp for XRC receive QP `qpn` (handle `h` of this session): no PD, CQs or queues.
ibv_qp* new_recv_qp(ibv_context* c, uint32_t h, uint32_t qpn, void* qp_context) {
  auto* qp = new VQp{};
  qp->handle = h;
  qp->sq_hdr = qp->rq_hdr = &g_no_ring;
  qp->sq_size = qp->rq_size = 0;
  qp->pd = kNone;
  ibv_qp& q = qp->qp;
  q.context = c;
  q.qp_context = qp_context;
  q.handle = h;
  q.qp_num = qpn;
  q.state = IBV_QPS_RESET;
  q.qp_type = IBV_QPT_XRC_RECV;
  pthread_mutex_init(&q.mutex, nullptr);
  pthread_cond_init(&q.cond, nullptr);
  VContext* ctx = to_vctx(c);
  std::lock_guard<std::mutex> g(ctx->objs_mu);
  ctx->qps[h] = qp;
  return &q;
}

}  // namespace

ibv_xrcd* open_xrcd(ibv_context* c, ibv_xrcd_init_attr* a) {
  if (!a) return fail_ptr<ibv_xrcd>(EINVAL);
  if (a->comp_mask >= IBV_XRCD_INIT_ATTR_RESERVED) return fail_ptr<ibv_xrcd>(EOPNOTSUPP);
  if (!(a->comp_mask & IBV_XRCD_INIT_ATTR_FD) || !(a->comp_mask & IBV_XRCD_INIT_ATTR_OFLAGS))
    return fail_ptr<ibv_xrcd>(EINVAL);
  if (a->fd < -1) return fail_ptr<ibv_xrcd>(EBADF);
  const OpenXrcdReq req{static_cast<uint32_t>(a->oflags), 0};
  HandleResp resp{};
  const int file[] = {a->fd};
  // The backend fstat()s the file itself: the inode it names is the domain's name.
  if (to_vctx(c)->call(Op::kOpenXrcd, req, resp,
                       a->fd >= 0 ? std::span<const int>(file) : std::span<const int>()))
    return nullptr;
  auto* x = new VXrcd{};
  x->xrcd.context = c;
  x->handle = resp.handle;
  return &x->xrcd;
}

int close_xrcd(ibv_xrcd* x) {
  HandleReq req{to_vxrcd(x)->handle, 0};
  if (int rc = to_vctx(x->context)->call(Op::kCloseXrcd, &req, sizeof(req), nullptr, 0)) return rc;
  delete to_vxrcd(x);
  return 0;
}

ibv_srq* create_srq_ex(ibv_context* c, ibv_srq_init_attr_ex* a) {
  if (!a) return fail_ptr<ibv_srq>(EINVAL);
  constexpr uint32_t kKnown =
      IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ;
  if (a->comp_mask & ~kKnown) return fail_ptr<ibv_srq>(EOPNOTSUPP);  // tag matching
  const bool xrc = (a->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) && a->srq_type == IBV_SRQT_XRC;
  if ((a->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) && a->srq_type != IBV_SRQT_BASIC && !xrc)
    return fail_ptr<ibv_srq>(EOPNOTSUPP);
  if (!(a->comp_mask & IBV_SRQ_INIT_ATTR_PD) || !a->pd || a->pd->context != c)
    return fail_ptr<ibv_srq>(EINVAL);
  if (!xrc) return ibv_create_srq(a->pd, reinterpret_cast<ibv_srq_init_attr*>(a));
  if (!(a->comp_mask & IBV_SRQ_INIT_ATTR_XRCD) || !(a->comp_mask & IBV_SRQ_INIT_ATTR_CQ) ||
      !a->xrcd || !a->cq || a->xrcd->context != c || a->cq->context != c)
    return fail_ptr<ibv_srq>(EINVAL);
  CreateXrcSrqReq req{reinterpret_cast<VPd*>(a->pd)->handle, to_vxrcd(a->xrcd)->handle,
                      to_vcq(a->cq)->handle, 0,
                      SrqAttr{a->attr.max_wr, a->attr.max_sge, a->attr.srq_limit, 0}};
  CreateSrqResp resp{};
  std::vector<UniqueFd> fds;
  if (to_vctx(c)->call(Op::kCreateXrcSrq, req, resp, {}, &fds)) return nullptr;
  VSrq* srq = finish_srq(c, a->pd, a->srq_context, a->attr, resp, fds);
  if (!srq) return nullptr;
  srq->xrc = true;
  srq->srq_num = resp.srq_num;
  return &srq->srq;
}

int get_srq_num(ibv_srq* s, uint32_t* srq_num) {
  VSrq* srq = to_vsrq(s);
  if (!srq_num || !srq->xrc) return EINVAL;  // a basic SRQ has no number requests could name
  *srq_num = srq->srq_num;
  return 0;
}

ibv_qp* create_xrc_recv_qp(ibv_context* c, ibv_qp_init_attr_ex* a) {
  // ibv_create_qp_ex(3): "for XRC_RECV only the xrcd is needed"; no PD, CQs, SRQ or queues.
  constexpr uint32_t kKnown =
      IBV_QP_INIT_ATTR_XRCD | IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS;
  if (a->comp_mask & ~kKnown) return fail_ptr<ibv_qp>(EOPNOTSUPP);
  if ((a->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && a->create_flags)
    return fail_ptr<ibv_qp>(EOPNOTSUPP);
  if (!(a->comp_mask & IBV_QP_INIT_ATTR_XRCD) || !a->xrcd || a->xrcd->context != c)
    return fail_ptr<ibv_qp>(EINVAL);
  CreateQpReq req{};
  req.pd = kNone;
  req.send_cq = req.recv_cq = req.srq = kNone;
  req.qp_type = IBV_QPT_XRC_RECV;
  req.xrcd = to_vxrcd(a->xrcd)->handle;
  CreateQpResp resp{};
  if (to_vctx(c)->call(Op::kCreateQp, req, resp)) return nullptr;
  a->cap = ibv_qp_cap{};
  return new_recv_qp(c, resp.handle, resp.qpn, a->qp_context);
}

ibv_qp* open_qp(ibv_context* c, ibv_qp_open_attr* a) {
  if (!a) return fail_ptr<ibv_qp>(EINVAL);
  constexpr uint32_t kNeeded = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
  if (a->comp_mask >= IBV_QP_OPEN_ATTR_RESERVED) return fail_ptr<ibv_qp>(EOPNOTSUPP);
  if ((a->comp_mask & kNeeded) != kNeeded || !a->xrcd || a->xrcd->context != c)
    return fail_ptr<ibv_qp>(EINVAL);
  if (a->qp_type != IBV_QPT_XRC_RECV) return fail_ptr<ibv_qp>(EINVAL);
  const OpenQpReq req{to_vxrcd(a->xrcd)->handle, a->qp_num, a->qp_type, 0};
  CreateQpResp resp{};
  if (to_vctx(c)->call(Op::kOpenQp, req, resp)) return nullptr;
  void* qp_context = (a->comp_mask & IBV_QP_OPEN_ATTR_CONTEXT) ? a->qp_context : nullptr;
  ibv_qp* qp = new_recv_qp(c, resp.handle, resp.qpn, qp_context);
  // Its state is whatever its creator made it; ask.
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  (void)ibv_query_qp(qp, &attr, IBV_QP_STATE, &init);
  return qp;
}

}  // namespace vrdma::verbs
