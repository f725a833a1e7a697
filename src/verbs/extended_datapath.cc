// Guest side of the extended data-path verbs over the same rings as datapath.cc: ibv_cq_ex's
// start/next/end_poll and read_* walk the CQ ring, ibv_qp_ex's wr_* builders write WQEs into
// the SQ ring. Same publication rules: nothing is visible to the backend until one release
// store of the index (end_poll's consumer, wr_complete's producer). No allocation, no syscall
// except the doorbell and the yield of an empty poll (see datapath.cc).
#include <sched.h>

#include <cstddef>
#include <cstring>

#include "verbs/ah.h"
#include "verbs/extended.h"
#include "verbs/internal.h"

namespace vrdma::verbs {

using namespace vrdma::proto;

namespace {

// ---- ibv_cq_ex ----
// Locking: start_poll takes the CQ's lock when it returns 0 and end_poll releases it; a failed
// start_poll (ENOENT, EIO) holds nothing, and the caller must not call end_poll (the man page's
// rule). The completion the iterator stands on stays valid in the ring until end_poll publishes
// the consumer index: the backend never writes a slot the guest has not given back.

VCq* cq_of(ibv_cq_ex* c) { return to_vcq(ibv_cq_ex_to_cq(c)); }
const Cqe& current(ibv_cq_ex* c) { return *cq_of(c)->ex_cur; }

/// Stands on the next completion (the CQ's ring or a QP's own, direct.cc) and steps past it;
/// false when there is none. CQ lock held.
bool take_next(VCq* cq) {
  const Cqe* e = next_cqe(*cq);
  if (!e) return false;
  cq->ex_cur = e;
  cq->cq_ex.wr_id = e->wr_id;
  cq->cq_ex.status = static_cast<ibv_wc_status>(e->status);
  return true;
}

int start_poll(ibv_cq_ex* c, ibv_poll_cq_attr* attr) {
  if (attr && attr->comp_mask) return EINVAL;
  VCq* cq = cq_of(c);
  cq->lock.lock();
  ++cq->polls_unchecked;
  if (take_next(cq) || (remote_progress(*cq) && take_next(cq))) {
    cq->empty_polls = 0;
    remote_found(*cq);
    poll_found();
    return 0;
  }
  // As poll_cq: a dead backend produces nothing, say so; otherwise let the backend run.
  const bool dead = dead_on_empty_poll(*cq);
  const uint32_t empty = ++cq->empty_polls;
  const bool yield = !dead && empty % kYieldEvery == 0 && should_yield(*cq);
  cq->lock.unlock();
  if (dead) return EIO;
  if (yield) ::sched_yield();
  poll_empty();
  return ENOENT;
}

int next_poll(ibv_cq_ex* c) {
  return take_next(cq_of(c)) ? 0 : ENOENT;
}

void end_poll(ibv_cq_ex* c) {
  VCq* cq = cq_of(c);
  publish_consumed(*cq);
  cq->ex_cur = nullptr;
  cq->lock.unlock();
}

ibv_wc_opcode read_opcode(ibv_cq_ex* c) { return static_cast<ibv_wc_opcode>(current(c).opcode); }
uint32_t read_vendor_err(ibv_cq_ex* c) { return current(c).vendor_err; }
uint32_t read_byte_len(ibv_cq_ex* c) { return current(c).byte_len; }
__be32 read_imm_data(ibv_cq_ex* c) { return current(c).imm_data; }  // already network order
uint32_t read_qp_num(ibv_cq_ex* c) { return current(c).qp_num; }
uint32_t read_src_qp(ibv_cq_ex* c) { return current(c).src_qp; }
unsigned int read_wc_flags(ibv_cq_ex* c) { return current(c).wc_flags; }
uint32_t read_slid(ibv_cq_ex* c) { return current(c).slid; }
uint8_t read_sl(ibv_cq_ex* c) { return current(c).sl; }
// Completion timestamps (proto/ring.h's CqeStamp): a completion of a ring without stamps
// (none can be, as every ring of a CQ created with them has them) reads 0.
uint64_t read_completion_ts(ibv_cq_ex* c) {
  const CqeStamp* s = cq_of(c)->cur_stamp;
  return s ? s->ns : 0;
}
uint64_t read_completion_wallclock_ns(ibv_cq_ex* c) {
  const CqeStamp* s = cq_of(c)->cur_stamp;
  return s ? s->wallclock_ns : 0;
}
uint8_t read_dlid_path_bits(ibv_cq_ex* c) { return current(c).dlid_path_bits; }

// ---- ibv_qp_ex ----
// Locking: wr_start takes the QP's send lock, wr_complete and wr_abort release it (as rdma-core's
// providers do), so a batch is never interleaved with ibv_post_send. WQEs are written at the
// private cursor sq_prod as the wr_* calls come; wr_complete publishes them all at once, or, if
// any call of the batch failed, rewinds sq_prod to ex_batch_start so that none is posted.

VQp* qp_of(ibv_qp_ex* q) { return to_vqp(&q->qp_base); }

/// Same rule as post_send (datapath.cc): UC has no READ and no atomics, UD only sends.
void fail_batch(VQp* qp, int err) {
  if (!qp->ex_batch_err) qp->ex_batch_err = err;
}

/// Opens the next WQE of the batch with the qp_ex's wr_id and wr_flags; null once the batch
/// has failed. Send lock held.
SendWqe* open_wqe(ibv_qp_ex* q, ibv_wr_opcode op) {
  VQp* qp = qp_of(q);
  if (qp->ex_batch_err) return nullptr;
  if (!opcode_allowed(q->qp_base.qp_type, op)) {
    fail_batch(qp, EINVAL);
    return nullptr;
  }
  if (ring_full(qp->sq_hdr, qp->sq_prod, qp->sq_size, qp->sq_cons_seen)) {
    fail_batch(qp, ENOMEM);
    return nullptr;
  }
  SendWqe& w = qp->sq[qp->sq_prod++ & (qp->sq_size - 1)];
  std::memset(&w, 0, offsetof(SendWqe, sge));  // every header field, whatever the ring adds
  w.wr_id = q->wr_id;
  w.opcode = op;
  // Inline is a property of the data, set by wr_set_inline_data*, not of wr_flags.
  w.send_flags = q->wr_flags & ~static_cast<unsigned>(IBV_SEND_INLINE);
  return &w;
}

/// The WQE the last wr_<opcode> opened, for the wr_set_* calls; null if none or failed.
SendWqe* open_wqe_or_fail(ibv_qp_ex* q) {
  VQp* qp = qp_of(q);
  if (qp->ex_batch_err) return nullptr;
  if (qp->sq_prod == qp->ex_batch_start) {  // wr_set_* before any wr_<opcode>
    fail_batch(qp, EINVAL);
    return nullptr;
  }
  return &qp->sq[(qp->sq_prod - 1) & (qp->sq_size - 1)];
}

void wr_start(ibv_qp_ex* q) {
  VQp* qp = qp_of(q);
  qp->sq_lock.lock();
  qp->ex_batch_start = qp->sq_prod;
  qp->ex_batch_err = 0;
  const ibv_qp& b = q->qp_base;
  if (to_vctx(b.context)->dead.load(std::memory_order_relaxed)) {
    fail_batch(qp, EIO);
  } else if (b.state == IBV_QPS_RESET || b.state == IBV_QPS_INIT || b.state == IBV_QPS_RTR) {
    fail_batch(qp, EINVAL);  // as post_send: a QP that cannot send
  }
}

int wr_complete(ibv_qp_ex* q) {
  VQp* qp = qp_of(q);
  const int rc = qp->ex_batch_err;
  if (rc) {
    qp->sq_prod = qp->ex_batch_start;  // the batch's WQEs were never published: drop them
  } else if (qp->sq_prod != qp->ex_batch_start) {
    // ODP: the pages the batch names are made reachable first (odp.cc; once per page).
    if (VContext* ctx = to_vctx(q->qp_base.context); ctx->odp_mrs.load(std::memory_order_relaxed)) {
      for (uint32_t i = qp->ex_batch_start; i != qp->sq_prod; ++i) {
        const SendWqe& w = qp->sq[i & (qp->sq_size - 1)];
        if (w.send_flags & IBV_SEND_INLINE) continue;
        for (uint32_t k = 0; k < w.num_sge && k < kMaxSge; ++k)
          odp_fault_sge(*ctx, w.sge[k].lkey, w.sge[k].addr, w.sge[k].length,
                        w.opcode == IBV_WR_RDMA_READ || is_rdma_atomic(w.opcode));
      }
    }
    qp->sq_hdr->producer.store(qp->sq_prod, std::memory_order_release);
    to_vctx(q->qp_base.context)->ring_doorbell(qp->handle);
  }
  qp->ex_batch_err = 0;
  qp->sq_lock.unlock();
  return rc;
}

void wr_abort(ibv_qp_ex* q) {
  VQp* qp = qp_of(q);
  qp->sq_prod = qp->ex_batch_start;
  qp->ex_batch_err = 0;
  qp->sq_lock.unlock();
}

void wr_send(ibv_qp_ex* q) { open_wqe(q, IBV_WR_SEND); }

void wr_send_imm(ibv_qp_ex* q, __be32 imm) {
  if (SendWqe* w = open_wqe(q, IBV_WR_SEND_WITH_IMM)) w->imm_data = imm;
}

void wr_send_inv(ibv_qp_ex* q, uint32_t invalidate_rkey) {
  if (SendWqe* w = open_wqe(q, IBV_WR_SEND_WITH_INV)) w->imm_data = invalidate_rkey;
}

void wr_bind_mw(ibv_qp_ex* q, ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info* info) {
  if (SendWqe* w = open_wqe(q, IBV_WR_BIND_MW)) fill_bind(*w, mw, rkey, *info);
}

void wr_local_inv(ibv_qp_ex* q, uint32_t invalidate_rkey) {
  if (SendWqe* w = open_wqe(q, IBV_WR_LOCAL_INV)) w->rkey = invalidate_rkey;
}

void set_remote(SendWqe* w, uint32_t rkey, uint64_t remote_addr) {
  w->rkey = rkey;
  w->remote_addr = remote_addr;
}

void wr_rdma_write(ibv_qp_ex* q, uint32_t rkey, uint64_t remote_addr) {
  if (SendWqe* w = open_wqe(q, IBV_WR_RDMA_WRITE)) set_remote(w, rkey, remote_addr);
}

void wr_rdma_write_imm(ibv_qp_ex* q, uint32_t rkey, uint64_t remote_addr, __be32 imm) {
  if (SendWqe* w = open_wqe(q, IBV_WR_RDMA_WRITE_WITH_IMM)) {
    set_remote(w, rkey, remote_addr);
    w->imm_data = imm;
  }
}

void wr_rdma_read(ibv_qp_ex* q, uint32_t rkey, uint64_t remote_addr) {
  if (SendWqe* w = open_wqe(q, IBV_WR_RDMA_READ)) set_remote(w, rkey, remote_addr);
}

void wr_atomic_cmp_swp(ibv_qp_ex* q, uint32_t rkey, uint64_t remote_addr, uint64_t compare,
                       uint64_t swap) {
  if (SendWqe* w = open_wqe(q, IBV_WR_ATOMIC_CMP_AND_SWP)) {
    set_remote(w, rkey, remote_addr);
    w->compare_add = compare;
    w->swap = swap;
  }
}

void wr_atomic_fetch_add(ibv_qp_ex* q, uint32_t rkey, uint64_t remote_addr, uint64_t add) {
  if (SendWqe* w = open_wqe(q, IBV_WR_ATOMIC_FETCH_AND_ADD)) {
    set_remote(w, rkey, remote_addr);
    w->compare_add = add;
  }
}

void wr_set_ud_addr(ibv_qp_ex* q, ibv_ah* ah, uint32_t remote_qpn, uint32_t remote_qkey) {
  SendWqe* w = open_wqe_or_fail(q);
  if (!w) return;
  if (!ah || q->qp_base.qp_type != IBV_QPT_UD) {
    fail_batch(qp_of(q), EINVAL);
    return;
  }
  pack_ud_dest(*w, to_vah(ah)->dest);  // as post_send does for wr.ud
  w->ud_remote_qpn = remote_qpn;
  w->ud_remote_qkey = remote_qkey;
}

void wr_set_xrc_srqn(ibv_qp_ex* q, uint32_t remote_srqn) {
  SendWqe* w = open_wqe_or_fail(q);
  if (!w) return;
  if (q->qp_base.qp_type != IBV_QPT_XRC_SEND) {
    fail_batch(qp_of(q), EINVAL);
    return;
  }
  w->ud_remote_qkey = remote_srqn;  // as post_send does for qp_type.xrc.remote_srqn
}

void wr_set_sge_list(ibv_qp_ex* q, size_t num_sge, const ibv_sge* sg_list) {
  SendWqe* w = open_wqe_or_fail(q);
  if (!w) return;
  VQp* qp = qp_of(q);
  if (num_sge > qp->caps.max_send_sge) {
    fail_batch(qp, EINVAL);
    return;
  }
  for (size_t i = 0; i < num_sge; ++i)
    w->sge[i] = Sge{sg_list[i].addr, sg_list[i].length, sg_list[i].lkey};
  w->num_sge = static_cast<uint32_t>(num_sge);
  w->inline_len = 0;
  w->send_flags &= ~static_cast<unsigned>(IBV_SEND_INLINE);
}

void wr_set_sge(ibv_qp_ex* q, uint32_t lkey, uint64_t addr, uint32_t length) {
  const ibv_sge sge{addr, length, lkey};
  wr_set_sge_list(q, 1, &sge);
}

void wr_set_inline_data_list(ibv_qp_ex* q, size_t num_buf, const ibv_data_buf* bufs) {
  SendWqe* w = open_wqe_or_fail(q);
  if (!w) return;
  VQp* qp = qp_of(q);
  uint64_t total = 0;
  for (size_t i = 0; i < num_buf; ++i) total += bufs[i].length;
  if (total > qp->caps.max_inline_data) {
    fail_batch(qp, EINVAL);
    return;
  }
  uint32_t off = 0;
  for (size_t i = 0; i < num_buf; ++i) {
    if (bufs[i].length) std::memcpy(w->inline_data + off, bufs[i].addr, bufs[i].length);
    off += static_cast<uint32_t>(bufs[i].length);
  }
  w->inline_len = off;
  w->num_sge = 0;
  w->send_flags |= IBV_SEND_INLINE;
}

void wr_set_inline_data(ibv_qp_ex* q, void* addr, size_t length) {
  const ibv_data_buf buf{addr, length};
  wr_set_inline_data_list(q, 1, &buf);
}

}  // namespace

void install_cq_ex_ops(ibv_cq_ex& c) {
  c.start_poll = start_poll;
  c.next_poll = next_poll;
  c.end_poll = end_poll;
  c.read_opcode = read_opcode;
  c.read_vendor_err = read_vendor_err;
  c.read_byte_len = read_byte_len;
  c.read_imm_data = read_imm_data;
  c.read_qp_num = read_qp_num;
  c.read_src_qp = read_src_qp;
  c.read_wc_flags = read_wc_flags;
  c.read_slid = read_slid;
  c.read_sl = read_sl;
  c.read_dlid_path_bits = read_dlid_path_bits;
  c.read_completion_ts = read_completion_ts;
  c.read_completion_wallclock_ns = read_completion_wallclock_ns;
  // CVLAN, flow tag and TM info stay null: create_cq_ex refuses those wc_flags.
}

void install_qp_ex_ops(ibv_qp_ex& q) {
  q.wr_start = wr_start;
  q.wr_complete = wr_complete;
  q.wr_abort = wr_abort;
  q.wr_send = wr_send;
  q.wr_send_imm = wr_send_imm;
  q.wr_rdma_write = wr_rdma_write;
  q.wr_rdma_write_imm = wr_rdma_write_imm;
  q.wr_rdma_read = wr_rdma_read;
  q.wr_atomic_cmp_swp = wr_atomic_cmp_swp;
  q.wr_atomic_fetch_add = wr_atomic_fetch_add;
  q.wr_set_ud_addr = wr_set_ud_addr;
  q.wr_set_sge = wr_set_sge;
  q.wr_set_sge_list = wr_set_sge_list;
  q.wr_set_inline_data = wr_set_inline_data;
  q.wr_set_inline_data_list = wr_set_inline_data_list;
  q.wr_bind_mw = wr_bind_mw;
  q.wr_local_inv = wr_local_inv;
  q.wr_send_inv = wr_send_inv;
  q.wr_set_xrc_srqn = wr_set_xrc_srqn;
  // send_tso and atomic_write stay null:
  // create_qp_ex refuses the send_ops_flags that would need them.
}

}  // namespace vrdma::verbs
