// Memory windows (ibv_alloc_mw(3), ibv_bind_mw(3)): the backend keeps them (kAllocMw) and
// executes binds and invalidations from the send queue like any WQE, so a window's rkey is
// checked where every other rkey is (engine respond_begin). The library only names windows by
// handle in the bind WQEs it writes (proto/ring.h, pack_bind).
#include <cstring>

#include "verbs/internal.h"

using namespace vrdma;
using namespace vrdma::verbs;
using namespace vrdma::proto;

namespace vrdma::verbs {

ibv_mw* alloc_mw(ibv_pd* pd, ibv_mw_type type) {
  AllocMwReq req{reinterpret_cast<VPd*>(pd)->handle, static_cast<uint32_t>(type)};
  AllocMwResp resp{};
  if (int rc = to_vctx(pd->context)->call(Op::kAllocMw, req, resp)) return fail_ptr<ibv_mw>(rc);
  auto* mw = new ibv_mw{};
  mw->context = pd->context;
  mw->pd = pd;
  mw->rkey = resp.rkey;
  mw->handle = resp.handle;
  mw->type = type;
  return mw;
}

int dealloc_mw(ibv_mw* mw) {
  HandleReq req{mw->handle, 0};
  Empty resp;
  if (int rc = to_vctx(mw->context)->call(Op::kDeallocMw, &req, sizeof(req), &resp, 0)) return rc;
  delete mw;
  return 0;
}

// ibv_bind_mw (type 1; verbs.h's inline wrapper checked the type and the PDs): a bind WR with
// the next key, through the QP's send queue. mw->rkey is the new one once it is posted, as
// ibv_bind_mw(3) describes; a bind that fails completes with IBV_WC_MW_BIND_ERR.
int bind_mw(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* mb) {
  ibv_send_wr wr{};
  wr.wr_id = mb->wr_id;
  wr.opcode = IBV_WR_BIND_MW;
  wr.send_flags = mb->send_flags;
  wr.bind_mw.mw = mw;
  wr.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
  wr.bind_mw.bind_info = mb->bind_info;
  ibv_send_wr* bad = nullptr;
  if (int rc = post_send(qp, &wr, &bad)) return rc;
  mw->rkey = wr.bind_mw.rkey;
  return 0;
}

void fill_bind(SendWqe& w, const ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info& info) {
  w.rkey = rkey;
  w.ud_remote_qpn = mw ? mw->handle : kNone;
  w.remote_addr = info.addr;
  w.compare_add = info.length;
  w.swap = pack_bind(info.mr ? info.mr->lkey : 0, info.mw_access_flags);
  w.num_sge = 0;
  w.inline_len = 0;
}

}  // namespace vrdma::verbs
