// The direct path across backends: going back to the backends, before a move of either guest
// (the TLS connection between the libraries cannot move with a guest). The protocol is in
// remote_impl.h ("Revoke"); docs/ARCHITECTURE.md, "Moving a guest's device", says why it keeps
// every message once and in order.
#include <infiniband/verbs.h>

#include <algorithm>
#include <memory>
#include <mutex>

#include "common/log.h"
#include "verbs/internal.h"
#include "verbs/remote_impl.h"

namespace vrdma::verbs::dlink {

namespace {

/// kRevoke on `c`, with how many requests we sent in all (fl_mu held).
void send_revoke(const RemoteQp& r, Conn& c) {
  Frame f{};
  f.type = kRevoke;
  f.arg0 = r.sent;
  send_frame(c, f, nullptr, 0, true);
}

/// Answers our backend: nothing of the pair is between the libraries any more (qps_mu held, no
/// other lock). The connections close (the ACK we owe goes first) and the backend, woken, takes
/// the send queue back.
void finish_revoke(Hub& h, VQp& qp, RemoteQp& r, const std::shared_ptr<Conn>& in,
                   const std::shared_ptr<Conn>& out) {
  if (in) {
    send_ack(*in);
    retire(h, in);
  }
  if (out && out != in) retire(h, out);
  // `revoking` keeps it off the direct path for the rest of its life in RTS (offer_of,
  // connect_out, remote_post); a reset starts another.
  r.active.store(false);
  r.finished = true;
  qp.sq_hdr->direct_revoke.store(kRevokeDone, std::memory_order_seq_cst);
  // Its send queue may hold what was posted meanwhile; on a shared-memory route nothing else
  // makes the backend look at it again.
  h.ctx->ring_doorbell(qp.handle);
  VLOG_INFO("direct path: QP {:#x} is back on the backends", qp.qp.qp_num);
}

/// Whether the revoke of `qp` is settled, and then finishes it (qps_mu held).
void try_finish(Hub& h, VQp& qp, RemoteQp& r) {
  if (r.dialing.load()) return;  // its connection, if it comes, takes part (connect_out)
  std::shared_ptr<Conn> in, out;
  {
    std::lock_guard<std::mutex> g(h.mu);
    in = r.in;
    out = r.out;
  }
  const bool live = (in && !in->broken.load()) || (out && !out->broken.load());
  if (live) {
    if (in) send_ack(*in);  // what we executed: the peer's WRs complete
    // The peer sends nothing more, and we executed all it sent; a broken connection says the
    // same (what was in flight on it failed, and completed so).
    if (!r.peer_revoked.load()) return;
    if (in && !in->broken.load() && in->executed.load() < r.peer_count.load()) return;
  }
  {
    // Every request of ours answered (or failed): no completion of ours can follow the
    // backend's.
    std::lock_guard<std::mutex> fl(r.fl_mu);
    if (!r.inflight.empty()) return;
  }
  finish_revoke(h, qp, r, in, out);
}

}  // namespace

void tell_revoke(RemoteQp& r, Conn& c) {
  std::lock_guard<std::mutex> fl(r.fl_mu);
  send_revoke(r, c);
}

void watch_qp(Hub& h, VQp& qp) {
  std::lock_guard<std::mutex> q(h.qps_mu);
  if (std::find(h.qps.begin(), h.qps.end(), &qp) != h.qps.end()) return;
  h.qps.push_back(&qp);
  h.nqps.store(h.qps.size(), std::memory_order_relaxed);
}

void forget_qp(Hub& h, VQp& qp) {
  std::erase(h.qps, &qp);
  h.nqps.store(h.qps.size(), std::memory_order_relaxed);
}

void begin_revoke(VQp& qp, RemoteQp& r) {
  std::shared_ptr<Conn> via;
  if (Hub* h = to_vctx(qp.qp.context)->hub_raw.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(h->mu);
    via = r.out ? r.out : r.in;  // after our last request, on the connection it went on
  }
  std::lock_guard<std::mutex> fl(r.fl_mu);
  if (r.revoking.load()) return;
  // The backend holds what comes to the send queue from now on (it may have asked already):
  // stored before any post can see `revoking` and write there instead.
  qp.sq_hdr->direct_revoke.store(kRevokeAsk, std::memory_order_seq_cst);
  r.revoking.store(true);
  if (via && !via->broken.load()) send_revoke(r, *via);
  VLOG_INFO(
      "direct path: QP {:#x} goes back to the backends ({} requests sent directly, {} in "
      "flight)",
      qp.qp.qp_num, r.sent, r.inflight.size());
}

void peer_revoked(Conn& c, VQp& qp, RemoteQp& r) {
  if (r.peer_revoked.load()) return;  // once
  r.peer_count.store(c.f.arg0);
  r.peer_revoked.store(true);
  begin_revoke(qp, r);
}

void revoke_tick(Hub& h) {
  std::lock_guard<std::mutex> q(h.qps_mu);
  for (VQp* qp : h.qps) {
    RemoteQp& r = *qp->remote;
    if (r.finished) continue;
    if (!r.revoking.load()) {
      if (qp->sq_hdr->direct_revoke.load(std::memory_order_acquire) != kRevokeAsk) continue;
      begin_revoke(*qp, r);
    }
    try_finish(h, *qp, r);
  }
}

}  // namespace vrdma::verbs::dlink
