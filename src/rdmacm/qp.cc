// The QPs and SRQs of rdma_cm ids: ordinary vrdma QPs made and moved through the public verbs
// API (INIT at creation, RTR and RTS from what the two ends said in REQ and REP).
#include <fcntl.h>
#include <sys/random.h>

#include <algorithm>
#include <cstring>

#include "rdmacm/internal.h"

namespace vrdma::rdmacm {

namespace {

uint32_t random_psn() {
  uint32_t v = 0;
  if (::getrandom(&v, sizeof(v), GRND_NONBLOCK) != sizeof(v)) v = static_cast<uint32_t>(::rand());
  return v & 0xffffff;
}

constexpr unsigned kQpAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                               IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

ibv_pd* default_pd() {
  Cm& c = cm();
  std::lock_guard<std::mutex> g(c.mu);
  if (!c.pd) c.pd = ibv_alloc_pd(c.ctx);
  return c.pd;
}

/// The XRC domain of the process's XRC_RECV ids: a private one (fd -1, O_CREAT), as
/// rdma-core's librdmacm opens one per device for the ids that name none.
ibv_xrcd* default_xrcd() {
  Cm& c = cm();
  std::lock_guard<std::mutex> g(c.mu);
  if (!c.xrcd) {
    ibv_xrcd_init_attr a{};
    a.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
    a.fd = -1;
    a.oflags = O_CREAT;
    c.xrcd = ibv_open_xrcd(c.ctx, &a);
  }
  return c.xrcd;
}

/// One of the id's CQs (send or receive) with its own completion channel, which the
/// rdma_get_send_comp/rdma_get_recv_comp inlines of rdma_verbs.h wait on: 0, or -1 with errno
/// (nothing left behind).
int make_cq(rdma_cm_id* id, bool send, int size) {
  ibv_comp_channel*& ch = send ? id->send_cq_channel : id->recv_cq_channel;
  ibv_cq*& cq = send ? id->send_cq : id->recv_cq;
  ch = ibv_create_comp_channel(id->verbs);
  if (ch) cq = ibv_create_cq(id->verbs, std::max(size, 1), id, ch, 0);
  if (cq) return 0;
  const int err = errno ? errno : ENOMEM;
  if (ch) ibv_destroy_comp_channel(ch);
  ch = nullptr;
  return fail(err);
}

void destroy_cq(rdma_cm_id* id, bool send) {
  ibv_comp_channel*& ch = send ? id->send_cq_channel : id->recv_cq_channel;
  ibv_cq*& cq = send ? id->send_cq : id->recv_cq;
  if (cq) ibv_destroy_cq(cq);
  if (ch) ibv_destroy_comp_channel(ch);
  cq = nullptr;
  ch = nullptr;
}

/// An XRC receive QP (IBV_QPT_XRC_RECV) in `xrcd` (the process's when null): no PD, CQs or
/// queues of its own; each request names the XRC SRQ that gives its receive WQE and CQ
/// (rdma_create_srq on the id makes one in the same domain). `pd` becomes the id's: the PD of
/// that SRQ and of the memory the application registers for it (rdma_reg_msgs).
int create_xrc_recv_qp(VId* v, ibv_pd* pd, ibv_xrcd* xrcd, ibv_qp_init_attr* attr) {
  if (!xrcd) xrcd = default_xrcd();
  if (!xrcd) return -1;
  ibv_qp_init_attr_ex x{};
  x.qp_context = attr->qp_context;
  x.qp_type = IBV_QPT_XRC_RECV;
  x.comp_mask = IBV_QP_INIT_ATTR_XRCD;
  x.xrcd = xrcd;
  ibv_qp* qp = ibv_create_qp_ex(v->id.verbs, &x);
  if (!qp) return -1;
  v->id.qp = qp;
  v->id.pd = pd;
  if (move_qp(v, {IBV_QPS_INIT})) {
    const int err = errno;
    rdma_destroy_qp(&v->id);
    return fail(err);
  }
  attr->cap = x.cap;
  attr->qp_type = IBV_QPT_XRC_RECV;
  return 0;
}

/// rdma_create_qp and rdma_create_qp_ex: `xrcd` is the caller's domain for an XRC_RECV QP.
int create_qp(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* attr, ibv_xrcd* xrcd) {
  if (!id || !attr || !id->verbs) return fail(EINVAL);
  if (id->qp) return fail(EINVAL);
  VId* v = to_vid(id);
  if (!pd) pd = id->pd ? id->pd : default_pd();
  if (!pd) return -1;
  ibv_qp_init_attr a = *attr;
  // The id's type unless the caller names one (rdma_server and rdma_client leave it 0).
  if (!a.qp_type) a.qp_type = id->qp_type;
  id->qp_type = a.qp_type;
  if (a.qp_type == IBV_QPT_XRC_RECV) return create_xrc_recv_qp(v, pd, xrcd, attr);
  const bool xrc_send = a.qp_type == IBV_QPT_XRC_SEND;  // a send queue only
  if (!a.srq && !xrc_send) a.srq = id->srq;
  // No CQs given: one per direction (an XRC send QP has no receive side), each with its own
  // completion channel.
  const bool make_cqs = !a.send_cq || (!a.recv_cq && !xrc_send);
  if (make_cqs) {
    v->own_cqs = true;
    if (make_cq(id, true, static_cast<int>(a.cap.max_send_wr)) ||
        (!xrc_send && make_cq(id, false, static_cast<int>(a.cap.max_recv_wr)))) {
      const int err = errno;
      rdma_destroy_qp(id);
      return fail(err);
    }
    if (!a.send_cq) a.send_cq = id->send_cq;
    if (!a.recv_cq && !xrc_send) a.recv_cq = id->recv_cq;
  }
  ibv_qp* qp = ibv_create_qp(pd, &a);
  if (!qp) {
    const int err = errno ? errno : ENOMEM;
    if (make_cqs) rdma_destroy_qp(id);
    return fail(err);
  }
  id->qp = qp;
  id->pd = pd;
  const bool ud = id->qp_type == IBV_QPT_UD;
  if (ud) v->mine.psn = 0;
  if (move_qp(v, ud ? std::initializer_list<ibv_qp_state>{IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS}
                    : std::initializer_list<ibv_qp_state>{IBV_QPS_INIT})) {
    const int err = errno;
    rdma_destroy_qp(id);
    return fail(err);
  }
  attr->cap = a.cap;
  attr->send_cq = a.send_cq;
  attr->recv_cq = a.recv_cq;
  attr->srq = a.srq;
  attr->qp_type = a.qp_type;
  return 0;
}

}  // namespace

proto::CmQpInfo local_qp_info(VId* v, const rdma_conn_param* p) {
  Cm& c = cm();
  proto::CmQpInfo q{};
  q.qpn = v->id.qp ? v->id.qp->qp_num : (p ? p->qp_num : 0);
  q.psn = random_psn();
  std::memcpy(q.gid, &c.gid, 16);
  q.lid = c.port.lid;
  q.qp_type = service_qp_type(v->id.qp_type);
  q.mtu = static_cast<uint8_t>(c.port.active_mtu);
  q.qkey = RDMA_UDP_QKEY;
  if (p) {
    q.responder_resources =
        static_cast<uint8_t>(std::min<int>(p->responder_resources, c.dev.max_qp_rd_atom));
    q.initiator_depth =
        static_cast<uint8_t>(std::min<int>(p->initiator_depth, c.dev.max_qp_init_rd_atom));
    q.flow_control = p->flow_control;
    q.retry_count = std::min<uint8_t>(p->retry_count, 7);
    q.rnr_retry_count = std::min<uint8_t>(p->rnr_retry_count, 7);
    q.srq = v->id.srq ? 1 : p->srq;
  }
  return q;
}

int qp_attr_for(VId* v, ibv_qp_state state, ibv_qp_attr* a, int* mask) {
  *a = ibv_qp_attr{};
  a->qp_state = state;
  const ibv_qp_type t = v->id.qp_type;
  const bool ud = t == IBV_QPT_UD;
  switch (state) {
    case IBV_QPS_INIT:
      a->pkey_index = 0;
      a->port_num = 1;
      *mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
      if (ud) {
        a->qkey = RDMA_UDP_QKEY;
        *mask |= IBV_QP_QKEY;
      } else {
        a->qp_access_flags = kQpAccess;
        *mask |= IBV_QP_ACCESS_FLAGS;
      }
      return 0;
    case IBV_QPS_RTR:
      *mask = IBV_QP_STATE;
      if (ud) return 0;
      if (!v->have_peer) return fail(EINVAL);
      a->path_mtu = static_cast<ibv_mtu>(
          std::min<int>(v->peer.mtu ? int{v->peer.mtu} : int{IBV_MTU_1024}, cm().port.active_mtu));
      a->dest_qp_num = v->peer.qpn;
      a->rq_psn = v->peer.psn;
      a->ah_attr.dlid = v->peer.lid;
      a->ah_attr.port_num = 1;
      a->ah_attr.is_global = 1;  // by GID: a LID alone is ambiguous across backends
      std::memcpy(&a->ah_attr.grh.dgid, v->peer.gid, 16);
      a->ah_attr.grh.hop_limit = 1;
      *mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
      // A responder's reads and atomics and its RNR timer: RC and the XRC receive QP (the
      // kernel's CM gives an XRC send QP the RTR of UC).
      if (t == IBV_QPT_RC || t == IBV_QPT_XRC_RECV) {
        a->max_dest_rd_atomic = v->mine.responder_resources;
        a->min_rnr_timer = 12;
        *mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
      }
      return 0;
    case IBV_QPS_RTS:
      a->sq_psn = v->mine.psn;
      *mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
      if (t == IBV_QPT_XRC_RECV) {  // it never sends: the timeout only, as the kernel's CM
        a->timeout = 14;
        *mask |= IBV_QP_TIMEOUT;
      } else if (t == IBV_QPT_RC || t == IBV_QPT_XRC_SEND) {
        if (!v->have_peer) return fail(EINVAL);
        a->timeout = 14;
        // The requester's retry count serves both ends; each end's RNR retry count is what
        // the other end asked for.
        a->retry_cnt = v->active ? v->mine.retry_count : v->peer.retry_count;
        a->rnr_retry = v->peer.rnr_retry_count;
        a->max_rd_atomic = std::min(v->mine.initiator_depth, v->peer.responder_resources);
        *mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
      }
      return 0;
    default:
      return fail(EINVAL);
  }
}

int move_qp(VId* v, std::initializer_list<ibv_qp_state> states) {
  for (ibv_qp_state s : states) {
    ibv_qp_attr a;
    int mask;
    if (qp_attr_for(v, s, &a, &mask)) return -1;
    if (const int err = ibv_modify_qp(v->id.qp, &a, mask)) return fail(err);
  }
  return 0;
}

}  // namespace vrdma::rdmacm

using namespace vrdma::rdmacm;

CM_EXPORT int rdma_init_qp_attr(rdma_cm_id* id, ibv_qp_attr* qp_attr, int* qp_attr_mask) {
  if (!id || !qp_attr || !qp_attr_mask) return fail(EINVAL);
  return qp_attr_for(to_vid(id), qp_attr->qp_state, qp_attr, qp_attr_mask);
}

CM_EXPORT int rdma_create_qp(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* attr) {
  return create_qp(id, pd, attr, nullptr);
}

CM_EXPORT int rdma_create_qp_ex(rdma_cm_id* id, ibv_qp_init_attr_ex* attr) {
  if (!id || !attr) return fail(EINVAL);
  constexpr uint32_t kKnown = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_XRCD;
  if (attr->comp_mask & ~kKnown) return fail(EOPNOTSUPP);
  ibv_qp_init_attr a{};
  a.qp_context = attr->qp_context;
  a.send_cq = attr->send_cq;
  a.recv_cq = attr->recv_cq;
  a.srq = attr->srq;
  a.cap = attr->cap;
  a.qp_type = attr->qp_type;
  a.sq_sig_all = attr->sq_sig_all;
  if (create_qp(id, (attr->comp_mask & IBV_QP_INIT_ATTR_PD) ? attr->pd : nullptr, &a,
                (attr->comp_mask & IBV_QP_INIT_ATTR_XRCD) ? attr->xrcd : nullptr))
    return -1;
  attr->cap = a.cap;
  attr->send_cq = a.send_cq;
  attr->recv_cq = a.recv_cq;
  return 0;
}

CM_EXPORT void rdma_destroy_qp(rdma_cm_id* id) {
  if (!id) return;
  VId* v = to_vid(id);
  if (id->qp) ibv_destroy_qp(id->qp);
  id->qp = nullptr;
  if (!v->own_cqs) return;
  destroy_cq(id, true);
  if (!v->srq_cq) destroy_cq(id, false);  // else the XRC SRQ's (rdma_destroy_srq)
  v->own_cqs = false;
}

CM_EXPORT int rdma_create_srq_ex(rdma_cm_id* id, ibv_srq_init_attr_ex* attr) {
  if (!id || !attr || !id->verbs || !(attr->comp_mask & IBV_SRQ_INIT_ATTR_TYPE))
    return fail(EINVAL);
  VId* v = to_vid(id);
  ibv_srq_init_attr_ex a = *attr;
  if (!(a.comp_mask & IBV_SRQ_INIT_ATTR_PD) || !a.pd) {
    a.pd = id->pd ? id->pd : default_pd();
    if (!a.pd) return -1;
    a.comp_mask |= IBV_SRQ_INIT_ATTR_PD;
  }
  // An XRC SRQ: in the process's domain unless one is named, completing on the id's receive
  // CQ (made here, with its channel, when the caller names none), which rdma_get_recv_comp
  // waits on. ibv_get_srq_num gives the number the other end's sends name (rdma_xserver sends it
  // in its accept's private data).
  bool made_cq = false;
  if (a.srq_type == IBV_SRQT_XRC) {
    if (!(a.comp_mask & IBV_SRQ_INIT_ATTR_XRCD) || !a.xrcd) a.xrcd = default_xrcd();
    if (!a.xrcd) return -1;
    if (!(a.comp_mask & IBV_SRQ_INIT_ATTR_CQ) || !a.cq) {
      if (!id->recv_cq) {
        if (make_cq(id, false, static_cast<int>(a.attr.max_wr))) return -1;
        made_cq = true;
      }
      a.cq = id->recv_cq;
    }
    a.comp_mask |= IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ;
  }
  ibv_srq* srq = ibv_create_srq_ex(id->verbs, &a);
  if (!srq) {
    const int err = errno ? errno : ENOMEM;
    if (made_cq) destroy_cq(id, false);
    return fail(err);
  }
  id->srq = srq;
  if (!id->pd) id->pd = a.pd;
  v->srq_cq = made_cq;
  *attr = a;
  return 0;
}

CM_EXPORT int rdma_create_srq(rdma_cm_id* id, ibv_pd* pd, ibv_srq_init_attr* attr) {
  if (!id || !attr) return fail(EINVAL);
  // An XRC receive id's SRQ is an XRC SRQ, as with rdma-core.
  ibv_srq_init_attr_ex x{};
  x.srq_context = attr->srq_context;
  x.attr = attr->attr;
  x.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD;
  x.srq_type = id->qp_type == IBV_QPT_XRC_RECV ? IBV_SRQT_XRC : IBV_SRQT_BASIC;
  x.pd = pd;
  const int rc = rdma_create_srq_ex(id, &x);
  attr->attr = x.attr;
  return rc;
}

CM_EXPORT void rdma_destroy_srq(rdma_cm_id* id) {
  if (!id || !id->srq) return;
  ibv_destroy_srq(id->srq);
  id->srq = nullptr;
  VId* v = to_vid(id);
  if (v->srq_cq) destroy_cq(id, false);
  v->srq_cq = false;
}
