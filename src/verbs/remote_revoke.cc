// The direct path across backends: going back to the backends, before a move of either guest
// (the TLS connection between the libraries cannot move with a guest), and direct again after
// it. The protocol is in remote_impl.h ("Revoke"); docs/ARCHITECTURE.md, "Moving a guest's
// device", says why it keeps every message once and in order.
#include <infiniband/verbs.h>
#include <sys/random.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

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
  // `revoking` keeps it off the direct path (offer_of, connect_out, remote_post) until our
  // backend has taken the answer (rejoin); a reset starts afresh too.
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

/// The tick's next try of an offer again: EAGAIN waits 1, 2, 4 ... 32 ticks; another answer
/// waits for another backend (grant_gen).
void reoffer(Hub& h, VQp& qp, RemoteQp& r) {
  const uint32_t gen = h.ctx->control_page()->grant_gen.load(std::memory_order_acquire);
  if (r.reoffer_stuck && gen == r.reoffer_gen) return;
  r.reoffer_stuck = false;
  if (r.reoffer_wait) {
    --r.reoffer_wait;
    return;
  }
  const int rc = offer(h, qp, r, true);
  if (rc == 0) {
    r.reoffer.store(false);
    VLOG_INFO("direct path: QP {:#x} offers its peer's library a connection{}", qp.qp.qp_num,
              r.reoffer_first ? " (its backend has one to the peer's backend now)" : " again");
    r.reoffer_first = false;
  } else if (rc == EAGAIN) {
    r.reoffer_backoff = std::min(std::max(r.reoffer_backoff * 2, 1u), 32u);
    r.reoffer_wait = r.reoffer_backoff;
  } else {
    r.reoffer_stuck = true;
    r.reoffer_gen = gen;
  }
}

/// A QP whose revoke our backend has answered: the word is 0 again (revoke_holds took
/// kRevokeDone), so the backend executes its send queue and holds no offer of it. Everything of
/// the old connections is settled (finish_revoke), and they are retired: the QP starts afresh.
/// qps_mu held.
void rejoin(Hub& h, VQp& qp, RemoteQp& r) {
  if (qp.sq_hdr->direct_revoke.load(std::memory_order_acquire) != 0) return;
  if (r.failed.load() || r.dead) return;  // in ERR: stays on the backends until a reset
  {
    std::lock_guard<std::mutex> fl(r.fl_mu);
    if (!r.inflight.empty()) return;  // cannot be: finish_revoke waited for them
    r.sent = 0;
    r.peer_executed = 0;
    r.awaiting.store(0);
    r.failing = false;
    r.rnr = false;
    r.resend_from = 0;
    r.rnr_left = 0;
    r.rnr_seq = ~0ull;
    r.rnr_until.store(0);
    r.resume_may_cross = false;
  }
  bool offered = false;
  {
    std::lock_guard<std::mutex> g(h.mu);
    r.in.reset();
    r.in_raw.store(nullptr);
    r.out.reset();
    r.resume_owed.store(false);
    r.peer_lid = 0;
    offered = r.offered;
    r.offered = false;
    r.peer_revoked.store(false);
    r.peer_count.store(0);
  }
  r.reoffer.store(offered);
  r.reoffer_first = false;
  r.reoffer_wait = 0;
  r.reoffer_backoff = 0;
  r.reoffer_stuck = false;
  r.finished = false;
  r.afresh.store(true);  // the posting thread's own fields: reset by it (remote_post)
  // Last: a post that sees it cleared finds the rest reset (connect_out asks kDirectRemote).
  r.revoking.store(false, std::memory_order_seq_cst);
  VLOG_INFO("direct path: QP {:#x} may go direct again", qp.qp.qp_num);
}

}  // namespace

int offer(Hub& h, VQp& qp, RemoteQp& r, bool watched) {
  VContext& ctx = *h.ctx;
  // We listen only where the peer's library will dial: the address our backend says.
  DirectOfferReq req{};
  req.qp = qp.handle;
  // A receive CQ with a channel: we fire it ourselves (its descriptors follow the ring's).
  const bool notify = qp.qp.recv_cq->channel != nullptr;
  // A QP on an SRQ: we take its receives from the SRQ ourselves (hold_srq_recv).
  const uint16_t notify_flag =
      (notify ? kDirectOfferNotify : 0) | (qp.qp.srq ? kDirectOfferSrq : 0);
  req.flags = kDirectOfferWhere | notify_flag;
  // With kDirectOfferSrq the answer is the longer one.
  DirectOfferSrqResp srq{};
  DirectOfferResp& resp = srq.offer;
  std::vector<UniqueFd> fds;
  auto ask = [&] {
    return qp.qp.srq ? ctx.call(Op::kDirectOffer, req, srq, {}, &fds)
                     : ctx.call(Op::kDirectOffer, req, resp, {}, &fds);
  };
  if (const int rc = ask()) {
    if (rc == EADDRNOTAVAIL)
      VLOG_INFO("direct path: QP {:#x} stays on the backends: no address of ours for its peer",
                qp.qp.qp_num);
    return rc;  // not for this QP (or not yet)
  }
  req.flags = notify_flag;
  req.port = listen_on(h, resp.listen_ipv4);
  if (req.port == 0) return EADDRNOTAVAIL;
  if (::getrandom(req.token, sizeof(req.token), 0) != static_cast<ssize_t>(sizeof(req.token)))
    return EIO;
  srq = {};
  fds.clear();
  if (const int rc = ask()) return rc;
  // Offered: the backend may ask it back (revoke_tick, whose list holds it already when it
  // offers again).
  if (!watched) watch_qp(h, qp);
  if (fds.size() != 1 + (notify ? kDirectNotifyFds : 0) || !resp.recv_ring_entries ||
      (resp.recv_ring_entries & (resp.recv_ring_entries - 1)) ||
      (qp.qp.srq && (srq.lock_tag == 0 || srq.lock_tag == kRxLockBackend))) {
    VLOG_WARN("direct path: unusable offer answer for QP {:#x}", qp.qp.qp_num);
    return EPROTO;
  }
  OwnRing ring;
  if (!map_ring(ring, fds[0].get(), resp.recv_ring_entries)) return ENOMEM;
  ring.seen = ring.hdr->consumer.load(std::memory_order_acquire);
  if (notify && !take_cq_notify(*to_vcq(qp.qp.recv_cq), fds, 1)) return EPROTO;
  std::lock_guard<std::mutex> g(h.mu);
  r.recv = std::move(ring);
  std::memcpy(r.token, req.token, kDirectTokenBytes);
  r.peer_qpn = resp.peer_qpn;
  r.my_lid = resp.my_lid;
  r.srq_tag = qp.qp.srq ? srq.lock_tag : 0;
  r.offered = true;
  return 0;
}

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
  std::lock_guard<std::mutex> d(h.doom_mu);
  std::erase(h.doomed, &qp);
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
    if (r.finished) rejoin(h, *qp, r);
    if (r.finished) continue;
    if (r.reoffer.load() && !r.revoking.load()) reoffer(h, *qp, r);
    if (!r.revoking.load()) {
      if (qp->sq_hdr->direct_revoke.load(std::memory_order_acquire) != kRevokeAsk) continue;
      begin_revoke(*qp, r);
    }
    try_finish(h, *qp, r);
  }
}

}  // namespace vrdma::verbs::dlink
