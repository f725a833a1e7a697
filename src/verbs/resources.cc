// Control-path verbs: PDs, MRs, completion channels, CQs and QPs. Each is one command to the
// backend, which owns the resource; the guest keeps a handle and the shared rings.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <type_traits>

#include "common/log.h"
#include "common/wait_readable.h"
#include "proto/device_caps.h"
#include "verbs/internal.h"
#include "verbs/srq.h"

using namespace vrdma;
using namespace vrdma::verbs;
using namespace vrdma::proto;

#define VERBS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

int destroy_handle(ibv_context* c, Op op, uint32_t handle) {
  HandleReq req{handle, 0};
  Empty resp;
  return to_vctx(c)->call(op, &req, sizeof(req), &resp, 0);
}

// An enum field the caller's attribute mask leaves out may hold any bits (ibv_xsrq_pingpong
// leaves cur_qp_state uninitialized): read as its underlying integer, never as the enum, whose
// load of a value outside it is undefined. The backend checks what the mask names.
template <class E>
std::underlying_type_t<E> enum_bits(const E& e) {
  std::underlying_type_t<E> v;
  std::memcpy(&v, &e, sizeof(v));
  return v;
}

QpAttr to_wire(const ibv_qp_attr& a) {
  QpAttr w{};
  w.qp_state = enum_bits(a.qp_state);
  w.cur_qp_state = enum_bits(a.cur_qp_state);
  w.path_mtu = enum_bits(a.path_mtu);
  w.qp_access_flags = a.qp_access_flags;
  w.qkey = a.qkey;
  w.rq_psn = a.rq_psn;
  w.sq_psn = a.sq_psn;
  w.dest_qp_num = a.dest_qp_num;
  w.pkey_index = a.pkey_index;
  w.port_num = a.port_num;
  w.max_rd_atomic = a.max_rd_atomic;
  w.max_dest_rd_atomic = a.max_dest_rd_atomic;
  w.min_rnr_timer = a.min_rnr_timer;
  w.timeout = a.timeout;
  w.retry_cnt = a.retry_cnt;
  w.rnr_retry = a.rnr_retry;
  w.sq_draining = a.sq_draining;
  w.en_sqd_async_notify = a.en_sqd_async_notify;
  w.is_global = a.ah_attr.is_global;
  w.dlid = a.ah_attr.dlid;
  w.sl = a.ah_attr.sl;
  w.src_path_bits = a.ah_attr.src_path_bits;
  w.static_rate = a.ah_attr.static_rate;
  w.ah_port_num = a.ah_attr.port_num;
  w.sgid_index = a.ah_attr.grh.sgid_index;
  w.hop_limit = a.ah_attr.grh.hop_limit;
  w.traffic_class = a.ah_attr.grh.traffic_class;
  w.flow_label = a.ah_attr.grh.flow_label;
  std::memcpy(w.dgid, a.ah_attr.grh.dgid.raw, 16);
  return w;
}

void from_wire(const QpAttr& w, ibv_qp_attr& a) {
  std::memset(&a, 0, sizeof(a));
  a.qp_state = static_cast<ibv_qp_state>(w.qp_state);
  a.cur_qp_state = static_cast<ibv_qp_state>(w.cur_qp_state);
  a.path_mtu = static_cast<ibv_mtu>(w.path_mtu);
  a.path_mig_state = IBV_MIG_MIGRATED;
  a.qp_access_flags = w.qp_access_flags;
  a.qkey = w.qkey;
  a.rq_psn = w.rq_psn;
  a.sq_psn = w.sq_psn;
  a.dest_qp_num = w.dest_qp_num;
  a.pkey_index = w.pkey_index;
  a.port_num = w.port_num;
  a.max_rd_atomic = w.max_rd_atomic;
  a.max_dest_rd_atomic = w.max_dest_rd_atomic;
  a.min_rnr_timer = w.min_rnr_timer;
  a.timeout = w.timeout;
  a.retry_cnt = w.retry_cnt;
  a.rnr_retry = w.rnr_retry;
  a.sq_draining = w.sq_draining;
  a.en_sqd_async_notify = w.en_sqd_async_notify;
  a.ah_attr.is_global = w.is_global;
  a.ah_attr.dlid = w.dlid;
  a.ah_attr.sl = w.sl;
  a.ah_attr.src_path_bits = w.src_path_bits;
  a.ah_attr.static_rate = w.static_rate;
  a.ah_attr.port_num = w.ah_port_num;
  a.ah_attr.grh.sgid_index = w.sgid_index;
  a.ah_attr.grh.hop_limit = w.hop_limit;
  a.ah_attr.grh.traffic_class = w.traffic_class;
  a.ah_attr.grh.flow_label = w.flow_label;
  std::memcpy(a.ah_attr.grh.dgid.raw, w.dgid, 16);
}

}  // namespace

// ---- protection domains ----

VERBS_EXPORT ibv_pd* ibv_alloc_pd(ibv_context* c) {
  HandleResp resp{};
  if (to_vctx(c)->call(Op::kAllocPd, nullptr, 0, &resp, sizeof(resp))) return nullptr;
  auto* pd = new VPd{};
  pd->pd.context = c;
  pd->pd.handle = resp.handle;
  pd->handle = resp.handle;
  return &pd->pd;
}

VERBS_EXPORT int ibv_dealloc_pd(ibv_pd* pd) {
  auto* v = reinterpret_cast<VPd*>(pd);
  if (int rc = destroy_handle(pd->context, Op::kDeallocPd, v->handle)) return rc;
  delete v;
  return 0;
}

// ---- imports (ibv_import_pd(3), ibv_import_mr(3)): objects of a context this one shares
// with another process (ibv_import_device), by handle. Unimporting forgets the local object
// only; deallocating or deregistering an imported one destroys it for every sharer, as on a
// kernel device.

namespace {
/// Looks object `handle` of `kind` up in the session; 0 or the errno.
int import_object(ibv_context* c, ImportKind kind, uint32_t handle, ImportObjectResp& resp,
                  std::vector<UniqueFd>* fds = nullptr) {
  const ImportObjectReq req{static_cast<uint32_t>(kind), handle};
  return to_vctx(c)->call(Op::kImportObject, req, resp, {}, fds);
}
}  // namespace

VERBS_EXPORT ibv_pd* ibv_import_pd(ibv_context* c, uint32_t pd_handle) {
  if (!c) return fail_ptr<ibv_pd>(EINVAL);
  ImportObjectResp resp{};
  if (int rc = import_object(c, ImportKind::kPd, pd_handle, resp)) return fail_ptr<ibv_pd>(rc);
  auto* pd = new VPd{};
  pd->pd.context = c;
  pd->pd.handle = pd_handle;
  pd->handle = pd_handle;
  return &pd->pd;
}

VERBS_EXPORT void ibv_unimport_pd(ibv_pd* pd) { delete reinterpret_cast<VPd*>(pd); }

// The MR's memory is the registering process's: the backend reaches it for every WR that
// names the keys; this process's direct paths do not (they hand such WRs to the backend on one
// host; across hosts its QPs stay on the backends from then on: docs/ARCHITECTURE.md,
// "Imports").
VERBS_EXPORT ibv_mr* ibv_import_mr(ibv_pd* pd, uint32_t mr_handle) {
  if (!pd) return fail_ptr<ibv_mr>(EINVAL);
  ImportObjectResp resp{};
  if (int rc = import_object(pd->context, ImportKind::kMr, mr_handle, resp))
    return fail_ptr<ibv_mr>(rc);
  if (resp.pd != reinterpret_cast<VPd*>(pd)->handle) return fail_ptr<ibv_mr>(EINVAL);
  auto* mr = new VMr{};
  mr->mr.context = pd->context;
  mr->mr.pd = pd;
  mr->mr.addr = reinterpret_cast<void*>(static_cast<uintptr_t>(resp.addr));
  mr->mr.length = resp.length;
  mr->mr.handle = mr_handle;
  mr->mr.lkey = resp.key;
  mr->mr.rkey = resp.key;
  mr->handle = mr_handle;
  mr->imported = true;
  to_vctx(pd->context)->mr_imports.store(true);
  return &mr->mr;
}

VERBS_EXPORT void ibv_unimport_mr(ibv_mr* mr) { delete reinterpret_cast<VMr*>(mr); }

// ---- memory regions ----

namespace {
ibv_mr* reg_mr_common(ibv_pd* pd, void* addr, size_t length, uint64_t iova, unsigned access) {
  if (access & IBV_ACCESS_ON_DEMAND) return reg_odp_mr(pd, addr, length, iova, access);  // odp.cc
  if (!pd || !addr || length == 0) return fail_ptr<ibv_mr>(EINVAL);
  VContext* ctx = to_vctx(pd->context);
  auto* req = new RegMrReq{};
  std::unique_ptr<RegMrReq> own(req);
  req->pd = reinterpret_cast<VPd*>(pd)->handle;
  req->access = access & ~IBV_ACCESS_OPTIONAL_RANGE;
  req->addr = reinterpret_cast<uintptr_t>(addr);
  req->length = length;
  req->iova = iova;
  std::vector<uint32_t> segments;
  if (int rc = describe_memory(*ctx, addr, length, *req, segments)) {
    release_segments(*ctx, segments);
    return fail_ptr<ibv_mr>(rc);
  }
  RegMrResp resp{};
  if (int rc = ctx->call(Op::kRegMr, *req, resp)) {
    release_segments(*ctx, segments);
    return fail_ptr<ibv_mr>(rc);
  }
  VMr* mr =
      new_vmr(pd, addr, length, resp,
              LocalMr{reinterpret_cast<uintptr_t>(addr), length, req->iova, req->access, req->pd});
  mr->segments = std::move(segments);
  return &mr->mr;
}
}  // namespace

namespace vrdma::verbs {
VMr* new_vmr(ibv_pd* pd, void* addr, size_t length, const RegMrResp& resp, const LocalMr& local) {
  auto* mr = new VMr{};
  mr->mr.context = pd->context;
  mr->mr.pd = pd;
  mr->mr.addr = addr;
  mr->mr.length = length;
  mr->mr.handle = resp.handle;
  mr->mr.lkey = resp.lkey;
  mr->mr.rkey = resp.rkey;
  mr->handle = resp.handle;
  VContext* ctx = to_vctx(pd->context);
  std::lock_guard<std::mutex> g(ctx->mr_mu);
  ctx->local_mrs[resp.lkey] = local;
  return mr;
}
}  // namespace vrdma::verbs

#undef ibv_reg_mr
VERBS_EXPORT ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  return reg_mr_common(pd, addr, length, reinterpret_cast<uintptr_t>(addr),
                       static_cast<unsigned>(access));
}

#undef ibv_reg_mr_iova
VERBS_EXPORT ibv_mr* ibv_reg_mr_iova(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                                     int access) {
  return reg_mr_common(pd, addr, length, iova, static_cast<unsigned>(access));
}

VERBS_EXPORT ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                                      unsigned int access) {
  return reg_mr_common(pd, addr, length, iova, access);
}

VERBS_EXPORT int ibv_dereg_mr(ibv_mr* mr) {
  auto* v = reinterpret_cast<VMr*>(mr);
  VContext* ctx = to_vctx(mr->context);
  if (int rc = destroy_handle(mr->context, Op::kDeregMr, v->handle)) return rc;
  {
    std::lock_guard<std::mutex> g(ctx->mr_mu);
    ctx->local_mrs.erase(mr->lkey);
    ctx->mr_gen.fetch_add(1, std::memory_order_release);
  }
  if (v->odp) forget_odp_mr(*ctx, *v, v->segments);
  release_segments(*ctx, v->segments);
  delete v;
  return 0;
}

// ibv_rereg_mr(3): the checks rdma-core's libibverbs makes before the command answer
// IBV_REREG_MR_ERR_INPUT; a refused command IBV_REREG_MR_ERR_CMD (the backend changes nothing,
// so on vrdma the old MR stays valid then too; the caller deregisters it either way). The
// lkey and rkey stay. Pages of a new translation become reachable as for ibv_reg_mr; those the
// MR no longer names are given back once the backend has switched.
VERBS_EXPORT int ibv_rereg_mr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length,
                              int access) {
  auto input_error = [] {
    errno = EINVAL;
    return static_cast<int>(IBV_REREG_MR_ERR_INPUT);
  };
  if (!mr) return input_error();
  auto* v = reinterpret_cast<VMr*>(mr);
  if (v->on_dm || v->imported || (flags & ~IBV_REREG_MR_FLAGS_SUPPORTED)) return input_error();
  // ODP MRs: not re-registered (yet); the backend answers EOPNOTSUPP for one made ODP.
  if (v->odp) {
    errno = EOPNOTSUPP;
    return IBV_REREG_MR_ERR_CMD;
  }
  if ((flags & IBV_REREG_MR_CHANGE_TRANSLATION) && (!addr || !length)) return input_error();
  if (access && !(flags & IBV_REREG_MR_CHANGE_ACCESS)) return input_error();
  if ((flags & IBV_REREG_MR_CHANGE_PD) && (!pd || pd->context != mr->context)) return input_error();
  VContext* ctx = to_vctx(mr->context);
  auto req = std::make_unique<ReregMrReq>();
  req->handle = v->handle;
  req->flags = static_cast<uint32_t>(flags);
  if (flags & IBV_REREG_MR_CHANGE_PD) req->mr.pd = reinterpret_cast<VPd*>(pd)->handle;
  if (flags & IBV_REREG_MR_CHANGE_ACCESS)
    req->mr.access = static_cast<uint32_t>(access) & ~IBV_ACCESS_OPTIONAL_RANGE;
  std::vector<uint32_t> segments;
  auto cmd_error = [&](int rc) {
    release_segments(*ctx, segments);
    errno = rc;
    return static_cast<int>(IBV_REREG_MR_ERR_CMD);
  };
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    req->mr.addr = reinterpret_cast<uintptr_t>(addr);
    req->mr.length = length;
    req->mr.iova = reinterpret_cast<uintptr_t>(addr);
    if (int rc = describe_memory(*ctx, addr, length, req->mr, segments)) return cmd_error(rc);
  }
  Empty resp;
  if (int rc = ctx->call(Op::kReregMr, req.get(), sizeof(*req), &resp, 0)) return cmd_error(rc);
  {
    std::lock_guard<std::mutex> g(ctx->mr_mu);
    LocalMr& local = ctx->local_mrs[mr->lkey];
    if (flags & IBV_REREG_MR_CHANGE_PD) local.pd = req->mr.pd;
    if (flags & IBV_REREG_MR_CHANGE_ACCESS) local.access = req->mr.access;
    if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
      local.addr = local.iova = req->mr.addr;
      local.length = length;
    }
    ctx->mr_gen.fetch_add(1, std::memory_order_release);
  }
  if (flags & IBV_REREG_MR_CHANGE_PD) mr->pd = pd;
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    mr->addr = addr;
    mr->length = length;
    std::swap(v->segments, segments);
    release_segments(*ctx, segments);  // the old translation's
  }
  return 0;
}

// ---- completion channels ----

VERBS_EXPORT ibv_comp_channel* ibv_create_comp_channel(ibv_context* c) {
  HandleResp resp{};
  std::vector<UniqueFd> fds;
  if (to_vctx(c)->call(Op::kCreateChannel, nullptr, 0, &resp, sizeof(resp), {}, &fds))
    return nullptr;
  if (fds.size() != 1) return fail_ptr<ibv_comp_channel>(EIO);
  auto* ch = new VChannel{};
  ch->ch.context = c;
  ch->ch.fd = fds[0].release();
  ch->ch.refcnt = 0;
  ch->handle = resp.handle;
  return &ch->ch;
}

VERBS_EXPORT int ibv_destroy_comp_channel(ibv_comp_channel* ch) {
  auto* v = reinterpret_cast<VChannel*>(ch);
  if (int rc = destroy_handle(ch->context, Op::kDestroyChannel, v->handle)) return rc;
  ::close(ch->fd);
  delete v;
  return 0;
}

// ---- completion queues ----

namespace {

/// Maps the CQ ring the backend answered a create or resize with; false (errno set) when the
/// mapping fails, or the ring lacks timestamps asked for (ENOMEM, EOPNOTSUPP: a backend older
/// than them) or is too short for them (EPROTO).
bool map_cq_ring(VCq& cq, const std::vector<UniqueFd>& fds, const CreateCqResp& resp,
                 uint32_t stamps) {
  auto fail = [](int err) {
    errno = err;
    return false;
  };
  MappedRegion ring = MappedRegion::map_shared(fds.empty() ? -1 : fds[0].get(), resp.ring_bytes);
  if (!ring.valid()) return fail(ENOMEM);
  auto* hdr = reinterpret_cast<RingHeader*>(ring.data());
  if ((hdr->stamps & kStampAll) != stamps) return fail(EOPNOTSUPP);
  if (resp.ring_bytes < cq_ring_bytes(resp.cqe + 1, stamps)) return fail(EPROTO);
  cq.ring = std::move(ring);
  cq.hdr = hdr;
  cq.entries = ring_entries<Cqe>(hdr);
  cq.size = resp.cqe + 1;
  cq.stamps = stamps ? cq_stamps(hdr, cq.size) : nullptr;
  cq.cur_stamp = nullptr;
  return true;
}

}  // namespace

namespace vrdma::verbs {

ibv_cq* create_cq(ibv_context* c, int cqe, void* cq_context, ibv_comp_channel* channel,
                  int comp_vector, uint32_t stamps) {
  if (cqe <= 0 || comp_vector < 0 || comp_vector >= c->num_comp_vectors)
    return fail_ptr<ibv_cq>(EINVAL);
  VContext* ctx = to_vctx(c);
  CreateCqReq req{static_cast<uint32_t>(cqe),
                  channel ? reinterpret_cast<VChannel*>(channel)->handle : kNone,
                  static_cast<uint32_t>(comp_vector), stamps};
  CreateCqResp resp{};
  std::vector<UniqueFd> fds;
  if (ctx->call(Op::kCreateCq, req, resp, {}, &fds)) return nullptr;
  auto* cq = new VCq{};
  if (!map_cq_ring(*cq, fds, resp, stamps)) {
    const int err = errno;
    destroy_handle(c, Op::kDestroyCq, resp.handle);
    delete cq;
    return fail_ptr<ibv_cq>(err);
  }
  cq->handle = resp.handle;
  cq->cq.context = c;
  cq->cq.channel = channel;
  cq->cq.cq_context = cq_context;
  cq->cq.handle = resp.handle;
  cq->cq.cqe = static_cast<int>(resp.cqe);
  pthread_mutex_init(&cq->cq.mutex, nullptr);
  pthread_cond_init(&cq->cq.cond, nullptr);
  if (channel) __atomic_add_fetch(&channel->refcnt, 1, __ATOMIC_RELAXED);
  std::lock_guard<std::mutex> g(ctx->objs_mu);
  ctx->cqs[cq->handle] = cq;
  return &cq->cq;
}

}  // namespace vrdma::verbs

VERBS_EXPORT ibv_cq* ibv_create_cq(ibv_context* c, int cqe, void* cq_context,
                                   ibv_comp_channel* channel, int comp_vector) {
  return create_cq(c, cqe, cq_context, channel, comp_vector, 0);
}

VERBS_EXPORT int ibv_destroy_cq(ibv_cq* cq) {
  VCq* v = to_vcq(cq);
  VContext* ctx = to_vctx(cq->context);
  if (int rc = destroy_handle(cq->context, Op::kDestroyCq, v->handle)) return rc;
  // As with a kernel device: wait until every event handed out has been acknowledged.
  pthread_mutex_lock(&cq->mutex);
  while (cq->comp_events_completed != v->events_reported) pthread_cond_wait(&cq->cond, &cq->mutex);
  pthread_mutex_unlock(&cq->mutex);
  if (cq->channel) __atomic_sub_fetch(&cq->channel->refcnt, 1, __ATOMIC_RELAXED);
  {
    std::lock_guard<std::mutex> g(ctx->objs_mu);
    ctx->cqs.erase(v->handle);
  }
  pthread_cond_destroy(&cq->cond);
  pthread_mutex_destroy(&cq->mutex);
  delete v;
  return 0;
}

// ibv_resize_cq(3): the backend gives the CQ a new ring with its completions in the same order
// at the same (free-running) indices, so the consumer cursor stays; cqe is what it really holds.
// Under the CQ's lock: no poll reads the ring while it changes.
VERBS_EXPORT int ibv_resize_cq(ibv_cq* cq, int cqe) {
  if (!cq || cqe <= 0) return EINVAL;
  VCq* v = to_vcq(cq);
  VContext* ctx = to_vctx(cq->context);
  v->lock.lock();
  publish_consumed(*v);  // the backend counts what it holds from the published cursors
  ResizeCqReq req{v->handle, static_cast<uint32_t>(cqe)};
  CreateCqResp resp{};
  std::vector<UniqueFd> fds;
  int rc = ctx->call(Op::kResizeCq, req, resp, {}, &fds);
  if (rc == 0) {
    const uint32_t stamps = v->stamps ? v->hdr->stamps & kStampAll : 0;
    // The old ring goes: a hub thread that fires the channel reads the header under notify_mu.
    std::lock_guard<std::mutex> n(v->notify_mu);
    const bool mapped = map_cq_ring(*v, fds, resp, stamps);
    if (v->notify.hdr) v->notify.hdr = v->hdr;
    if (mapped) {
      v->ex_cur = nullptr;
      cq->cqe = static_cast<int>(resp.cqe);
    } else {
      // The backend moved on to the new ring: nothing more can be polled here.
      rc = errno ? errno : ENOMEM;
      VLOG_ERROR("resize_cq: mapping CQ {}'s new ring failed; its completions are lost", v->handle);
    }
  }
  v->lock.unlock();
  return rc;
}

VERBS_EXPORT int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  uint32_t handle;
  // Waiting in poll, not read: a thread there can be stopped (common/wait_readable.h).
  if (vrdma::wait_readable(channel->fd)) return -1;  // EINTR, as read would have failed
  ssize_t n = ::read(channel->fd, &handle, sizeof(handle));
  if (n != sizeof(handle)) return -1;
  VContext* ctx = to_vctx(channel->context);
  VCq* v;
  {
    std::lock_guard<std::mutex> g(ctx->objs_mu);
    auto it = ctx->cqs.find(handle);
    if (it == ctx->cqs.end()) {
      errno = EIO;
      return -1;
    }
    v = it->second;
  }
  pthread_mutex_lock(&v->cq.mutex);
  v->events_reported++;
  pthread_mutex_unlock(&v->cq.mutex);
  *cq = &v->cq;
  *cq_context = v->cq.cq_context;
  return 0;
}

VERBS_EXPORT void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents) {
  pthread_mutex_lock(&cq->mutex);
  cq->comp_events_completed += nevents;
  pthread_cond_signal(&cq->cond);
  pthread_mutex_unlock(&cq->mutex);
}

// ---- queue pairs ----

VERBS_EXPORT ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  // An XRC send QP has a send queue only (ibv_create_qp_ex(3); verbs.h's ibv_create_qp_ex
  // comes here when only the PD is given): no receive CQ or SRQ. The backend's QP takes the
  // send CQ for the receive CQ it never uses.
  const bool xrc_send = attr && attr->qp_type == IBV_QPT_XRC_SEND;
  if (!pd || !attr || !attr->send_cq || (!attr->recv_cq && !xrc_send) || (xrc_send && attr->srq))
    return fail_ptr<ibv_qp>(EINVAL);
  VContext* ctx = to_vctx(pd->context);
  CreateQpReq req{};
  req.pd = reinterpret_cast<VPd*>(pd)->handle;
  req.send_cq = to_vcq(attr->send_cq)->handle;
  req.recv_cq = to_vcq(xrc_send ? attr->send_cq : attr->recv_cq)->handle;
  req.srq = attr->srq ? to_vsrq(attr->srq)->handle : kNone;
  req.qp_type = static_cast<uint8_t>(attr->qp_type);
  req.sq_sig_all = attr->sq_sig_all ? 1 : 0;
  req.caps = QpCaps{attr->cap.max_send_wr,  attr->cap.max_recv_wr, attr->cap.max_send_sge,
                    attr->cap.max_recv_sge, attr->cap.max_inline_data, 0};
  CreateQpResp resp{};
  std::vector<UniqueFd> fds;
  if (ctx->call(Op::kCreateQp, req, resp, {}, &fds)) return nullptr;
  auto* qp = new VQp{};
  qp->ring = MappedRegion::map_shared(fds.empty() ? -1 : fds[0].get(), resp.ring_bytes);
  if (!qp->ring.valid()) {
    destroy_handle(pd->context, Op::kDestroyQp, resp.handle);
    delete qp;
    return fail_ptr<ibv_qp>(ENOMEM);
  }
  qp->handle = resp.handle;
  qp->sq_hdr = reinterpret_cast<RingHeader*>(qp->ring.data());
  qp->rq_hdr = reinterpret_cast<RingHeader*>(qp->ring.data() + resp.rq_offset);
  qp->sq = ring_entries<SendWqe>(qp->sq_hdr);
  qp->rq = ring_entries<RecvWqe>(qp->rq_hdr);
  qp->sq_size = resp.caps.max_send_wr;
  qp->rq_size = resp.caps.max_recv_wr;
  qp->caps = resp.caps;
  qp->pd = req.pd;
  qp->sig_all = attr->sq_sig_all != 0;
  ibv_qp& q = qp->qp;
  q.context = pd->context;
  q.qp_context = attr->qp_context;
  q.pd = pd;
  q.send_cq = attr->send_cq;
  q.recv_cq = xrc_send ? nullptr : attr->recv_cq;
  q.srq = attr->srq;
  q.handle = resp.handle;
  q.qp_num = resp.qpn;
  q.state = IBV_QPS_RESET;
  q.qp_type = attr->qp_type;
  pthread_mutex_init(&q.mutex, nullptr);
  pthread_cond_init(&q.cond, nullptr);
  // ibv_create_qp returns the capabilities actually granted.
  attr->cap.max_send_wr = resp.caps.max_send_wr;
  attr->cap.max_recv_wr = resp.caps.max_recv_wr;
  attr->cap.max_send_sge = resp.caps.max_send_sge;
  attr->cap.max_recv_sge = resp.caps.max_recv_sge;
  attr->cap.max_inline_data = resp.caps.max_inline_data;
  std::lock_guard<std::mutex> g(ctx->objs_mu);
  ctx->qps[qp->handle] = qp;
  return &q;
}

VERBS_EXPORT int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  if (!attr) return EINVAL;
  ModifyQpReq req{to_vqp(qp)->handle, static_cast<uint32_t>(mask), to_wire(*attr)};
  Empty resp;
  VQp* v = to_vqp(qp);
  drop_grant(*v);  // any change ends a direct grant (the backend's epoch moves too)
  remote_before_modify(*v, mask, *attr);
  uint32_t answer = 0;
  if (int rc = to_vctx(qp->context)
                   ->call(Op::kModifyQp, &req, sizeof(req), &resp, 0, {}, nullptr, &answer))
    return rc;
  if (answer & proto::kAnswerDestUnknown) say_destination_unknown(*qp, *attr, mask);
  if (mask & IBV_QP_STATE) qp->state = attr->qp_state;
  remote_after_modify(*v, mask, *attr);
  return 0;
}

VERBS_EXPORT int ibv_query_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init) {
  (void)mask;  // everything is returned; the mask only says what the caller needs
  HandleReq req{to_vqp(qp)->handle, 0};
  QueryQpResp resp{};
  if (int rc = to_vctx(qp->context)->call(Op::kQueryQp, req, resp)) return rc;
  from_wire(resp.attr, *attr);
  attr->cap.max_send_wr = resp.caps.max_send_wr;
  attr->cap.max_recv_wr = resp.caps.max_recv_wr;
  attr->cap.max_send_sge = resp.caps.max_send_sge;
  attr->cap.max_recv_sge = resp.caps.max_recv_sge;
  attr->cap.max_inline_data = resp.caps.max_inline_data;
  qp->state = attr->qp_state;
  if (init) {
    std::memset(init, 0, sizeof(*init));
    init->qp_context = qp->qp_context;
    init->send_cq = qp->send_cq;
    init->recv_cq = qp->recv_cq;
    init->srq = qp->srq;
    init->qp_type = qp->qp_type;
    init->cap = attr->cap;
  }
  return 0;
}

VERBS_EXPORT int ibv_destroy_qp(ibv_qp* qp) {
  VQp* v = to_vqp(qp);
  VContext* ctx = to_vctx(qp->context);
  remote_destroy(*v);
  if (int rc = destroy_handle(qp->context, Op::kDestroyQp, v->handle)) return rc;
  // XRC QPs lack one CQ (send) or both (receive).
  if (qp->send_cq) drop_rings(*to_vcq(qp->send_cq), v->handle);
  if (qp->recv_cq) drop_rings(*to_vcq(qp->recv_cq), v->handle);
  {
    std::lock_guard<std::mutex> g(ctx->objs_mu);
    ctx->qps.erase(v->handle);
  }
  pthread_cond_destroy(&qp->cond);
  pthread_mutex_destroy(&qp->mutex);
  delete v;
  return 0;
}

// ---- UD multicast within the backend (engine/device_mcast.cc) ----

namespace {

int mcast_command(ibv_qp* qp, Op op, const union ibv_gid* gid, uint16_t lid) {
  if (!qp || !gid) return EINVAL;
  McastReq req{to_vqp(qp)->handle, lid, 0, {}};
  std::memcpy(req.gid, gid->raw, sizeof(req.gid));
  Empty resp;
  return to_vctx(qp->context)->call(op, &req, sizeof(req), &resp, 0);
}

}  // namespace

VERBS_EXPORT int ibv_attach_mcast(ibv_qp* qp, const union ibv_gid* gid, uint16_t lid) {
  return mcast_command(qp, Op::kAttachMcast, gid, lid);
}
VERBS_EXPORT int ibv_detach_mcast(ibv_qp* qp, const union ibv_gid* gid, uint16_t lid) {
  return mcast_command(qp, Op::kDetachMcast, gid, lid);
}
