// The direct path across backends: what a peer's request may touch of this process, as the
// responding library checks it (proto/responder_rules.h): its MRs, memory windows as the
// backend that keeps them sees them (kMwView), and an ODP MR's pages, faulted in first.
#include "proto/responder_rules.h"
#include "verbs/internal.h"
#include "verbs/remote_impl.h"

namespace vrdma::verbs::dlink {

bool find_mr(VContext& ctx, uint32_t pd, uint32_t key, LocalMr& out) {
  std::lock_guard<std::mutex> g(ctx.mr_mu);
  auto it = ctx.local_mrs.find(key);
  if (it == ctx.local_mrs.end() || it->second.pd != pd) return false;
  out = it->second;
  return true;
}

namespace {

/// A memory window under `rkey` as responder `qp` may use it, and its MR here (`mr`): the
/// backend keeps windows and answers with its own rule (kMwView: window_view), so a window
/// bound, unbound or invalidated through any QP, before or after this connection, is seen as
/// it is now. Not found: none, or not usable through this QP.
RemoteMrView window_view_of(VQp& qp, uint32_t rkey, LocalMr& mr, uint32_t& mr_key) {
  VContext& ctx = *to_vctx(qp.qp.context);
  MwViewReq req{};
  req.qp = qp.handle;
  req.rkey = rkey;
  MwViewResp resp{};
  if (ctx.call(Op::kMwView, req, resp) != 0 || !resp.found || !find_mr(ctx, qp.pd, resp.mr_key, mr))
    return RemoteMrView{};
  mr_key = resp.mr_key;
  return RemoteMrView{true, resp.access, resp.iova, resp.length, resp.base};
}

}  // namespace

bool invalidate_window(VQp& qp, uint32_t rkey) {
  MwViewReq req{};
  req.qp = qp.handle;
  req.rkey = rkey;
  req.flags = kMwViewInvalidate;
  MwViewResp resp{};
  return to_vctx(qp.qp.context)->call(Op::kMwView, req, resp) == 0 && resp.status == IBV_WC_SUCCESS;
}

ibv_wc_status rkey_memory(VQp& qp, uint32_t op, uint32_t rkey, uint64_t iova, uint64_t len,
                          uint8_t*& p) {
  p = nullptr;
  VContext& ctx = *to_vctx(qp.qp.context);
  const bool names_memory = names_remote_memory(len) || is_rdma_atomic(op);
  LocalMr mr;
  RemoteMrView view;
  uint32_t key = rkey;  ///< the MR's
  if (find_mr(ctx, qp.pd, rkey, mr))
    view = RemoteMrView{true, mr.access, mr.iova, mr.length};
  else if (names_memory)
    view = window_view_of(qp, rkey, mr, key);
  const ibv_wc_status st = check_remote_request(op, qp.access, iova, len, view);
  if (st == IBV_WC_SUCCESS && names_memory) {
    const uint64_t at = mr_iova_of(view, iova);
    p = local_ptr(mr, mr.addr + (at - mr.iova));
    // An ODP MR's pages may not be there yet, or not mapped at all: fault them in first.
    if (ctx.odp_mrs.load(std::memory_order_relaxed) &&
        odp_reach(ctx, key, reinterpret_cast<uintptr_t>(p), is_rdma_atomic(op) ? 8 : len,
                  op != IBV_WR_RDMA_READ)) {
      p = nullptr;
      return IBV_WC_REM_ACCESS_ERR;
    }
  }
  return st;
}

}  // namespace vrdma::verbs::dlink
