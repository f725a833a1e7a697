// Shared receive queues: create/modify/query/destroy as commands to the backend, and
// ibv_post_srq_recv writing receive WQEs into the SRQ's ring (no syscall but the doorbell).
#include "verbs/srq.h"

#include <cstring>
#include <map>
#include <mutex>
#include <utility>

using namespace vrdma;
using namespace vrdma::verbs;
using namespace vrdma::proto;

#define VERBS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

/// Every live SRQ by (context, handle), for ibv_get_async_event.
std::mutex g_srqs_mu;
std::map<std::pair<ibv_context*, uint32_t>, ibv_srq*> g_srqs;

int srq_command(ibv_srq* srq, Op op, const void* req, size_t req_len, void* resp,
                size_t resp_len) {
  return to_vctx(srq->context)->call(op, req, req_len, resp, resp_len);
}

}  // namespace

namespace vrdma::verbs {

ibv_srq* find_srq(ibv_context* ctx, uint32_t handle) {
  std::lock_guard<std::mutex> g(g_srqs_mu);
  auto it = g_srqs.find({ctx, handle});
  return it == g_srqs.end() ? nullptr : it->second;
}

int post_srq_recv(ibv_srq* s, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  VSrq* srq = to_vsrq(s);
  if (to_vctx(s->context)->dead.load(std::memory_order_relaxed)) {
    *bad = wr;
    return EIO;
  }
  if (VContext* ctx = to_vctx(s->context); ctx->odp_mrs.load(std::memory_order_relaxed)) {
    for (const ibv_recv_wr* w = wr; w; w = w->next)
      if (w->num_sge > 0) odp_fault_sges(*ctx, w->sg_list, w->num_sge, true);
  }
  int rc = 0;
  srq->lock.lock();
  const uint32_t start = srq->prod;
  for (; wr; wr = wr->next) {
    if (ring_full(srq->hdr, srq->prod, srq->size, srq->cons_seen)) {
      rc = ENOMEM;
      break;
    }
    if ((rc = check_post_recv(*wr, srq->max_sge))) break;
    RecvWqe& r = srq->entries[srq->prod & (srq->size - 1)];
    r.wr_id = wr->wr_id;
    r.num_sge = static_cast<uint32_t>(wr->num_sge);
    for (int i = 0; i < wr->num_sge; ++i)
      r.sge[i] = Sge{wr->sg_list[i].addr, wr->sg_list[i].length, wr->sg_list[i].lkey};
    srq->prod++;
  }
  if (srq->prod != start) {
    srq->hdr->producer.store(srq->prod, std::memory_order_release);
    // A sender may be waiting in RNR for this. Not on an SRQ that libraries feed (`armed`), as
    // on such an RQ: they read the producer index, and a backend RNR wait ends by its timer;
    // waking the backend on every post would only take a CPU from the pollers.
    if (!srq->hdr->armed.load(std::memory_order_relaxed)) to_vctx(s->context)->ring_doorbell();
  }
  srq->lock.unlock();
  // The producer index before the flag (send_rnr stores them the other way round).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (srq->prod != start && srq->resume_owed.load(std::memory_order_seq_cst) &&
      srq->resume_owed.exchange(false))
    remote_srq_posted(*srq);
  if (rc) *bad = wr;
  return rc;
}

VSrq* finish_srq(ibv_context* c, ibv_pd* pd, void* srq_context, ibv_srq_attr& attr,
                 const CreateSrqResp& resp, std::vector<UniqueFd>& fds) {
  VContext* ctx = to_vctx(c);
  auto* srq = new VSrq{};
  srq->ring = MappedRegion::map_shared(fds.empty() ? -1 : fds[0].get(), resp.ring_bytes);
  if (!srq->ring.valid()) {
    HandleReq d{resp.handle, 0};
    ctx->call(Op::kDestroySrq, &d, sizeof(d), nullptr, 0);
    delete srq;
    errno = ENOMEM;
    return nullptr;
  }
  srq->handle = resp.handle;
  srq->hdr = reinterpret_cast<RingHeader*>(srq->ring.data());
  srq->entries = ring_entries<RecvWqe>(srq->hdr);
  srq->size = resp.attr.max_wr;
  srq->max_sge = resp.attr.max_sge;
  srq->srq.context = c;
  srq->srq.srq_context = srq_context;
  srq->srq.pd = pd;
  srq->srq.handle = resp.handle;
  pthread_mutex_init(&srq->srq.mutex, nullptr);
  pthread_cond_init(&srq->srq.cond, nullptr);
  attr.max_wr = resp.attr.max_wr;
  attr.max_sge = resp.attr.max_sge;
  std::lock_guard<std::mutex> g(g_srqs_mu);
  g_srqs[{c, srq->handle}] = &srq->srq;
  return srq;
}

}  // namespace vrdma::verbs

VERBS_EXPORT ibv_srq* ibv_create_srq(ibv_pd* pd, ibv_srq_init_attr* attr) {
  if (!pd || !attr) {
    errno = EINVAL;
    return nullptr;
  }
  VContext* ctx = to_vctx(pd->context);
  CreateSrqReq req{reinterpret_cast<VPd*>(pd)->handle, 0,
                   SrqAttr{attr->attr.max_wr, attr->attr.max_sge, attr->attr.srq_limit, 0}};
  CreateSrqResp resp{};
  std::vector<UniqueFd> fds;
  if (ctx->call(Op::kCreateSrq, req, resp, {}, &fds)) return nullptr;
  VSrq* srq = finish_srq(pd->context, pd, attr->srq_context, attr->attr, resp, fds);
  return srq ? &srq->srq : nullptr;
}

VERBS_EXPORT int ibv_modify_srq(ibv_srq* srq, ibv_srq_attr* attr, int mask) {
  if (!attr) return EINVAL;
  ModifySrqReq req{to_vsrq(srq)->handle, static_cast<uint32_t>(mask),
                   SrqAttr{attr->max_wr, attr->max_sge, attr->srq_limit, 0}};
  return srq_command(srq, Op::kModifySrq, &req, sizeof(req), nullptr, 0);
}

VERBS_EXPORT int ibv_query_srq(ibv_srq* srq, ibv_srq_attr* attr) {
  HandleReq req{to_vsrq(srq)->handle, 0};
  SrqAttr resp{};
  if (int rc = srq_command(srq, Op::kQuerySrq, &req, sizeof(req), &resp, sizeof(resp))) return rc;
  attr->max_wr = resp.max_wr;
  attr->max_sge = resp.max_sge;
  attr->srq_limit = resp.srq_limit;
  return 0;
}

VERBS_EXPORT int ibv_destroy_srq(ibv_srq* srq) {
  VSrq* v = to_vsrq(srq);
  HandleReq req{v->handle, 0};
  if (int rc = srq_command(srq, Op::kDestroySrq, &req, sizeof(req), nullptr, 0)) return rc;
  {
    std::lock_guard<std::mutex> g(g_srqs_mu);
    g_srqs.erase({srq->context, v->handle});
  }
  pthread_cond_destroy(&srq->cond);
  pthread_mutex_destroy(&srq->mutex);
  delete v;
  return 0;
}
