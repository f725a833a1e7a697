// The direct path across backends, its API to the rest of the library (remote.h): posting,
// the QP's state changes, polling and shutdown. The design is in remote_impl.h.
#include "verbs/remote.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/core_names.h>
#include <openssl/err.h>
#include <openssl/kdf.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "common/listener_rest.h"
#include "common/log.h"
#include "common/rdma_atomic.h"
#include "proto/device_caps.h"
#include "verbs/internal.h"
#include "verbs/remote_impl.h"
#include "verbs/srq.h"
#include "verbs/stop_world.h"

namespace vrdma::verbs {

namespace {

uint8_t frame_type(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_SEND:
      return kSend;
    case IBV_WR_SEND_WITH_IMM:
      return kSendImm;
    case IBV_WR_SEND_WITH_INV:
      return kSendInv;
    case IBV_WR_RDMA_WRITE:
      return kWrite;
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return kWriteImm;
    case IBV_WR_RDMA_READ:
      return kRead;
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return kCas;
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return kFaa;
    default:
      return 0;
  }
}

/// A WR's local memory, checked against our MRs: success, or the error its completion gets.
int local_memory(VContext& ctx, VQp& qp, const ibv_send_wr& wr, Inflight& e, MemSpan* out,
                 size_t& n) {
  const uint32_t need = answered_by_data(wr.opcode) ? IBV_ACCESS_LOCAL_WRITE : 0;
  uint64_t len = 0;
  if (const int st = local_sges(ctx, qp, wr, need, out, n, len); st != IBV_WC_SUCCESS) return st;
  e.len = static_cast<uint32_t>(len);
  return IBV_WC_SUCCESS;
}

/// A WR that cannot go out (an error of its own, or of one before it, or the connection ended)
/// completes in order with its error, or flushed after one. True: the QP fails now (the caller
/// moves it to ERR). After the peer's library went it fails with the rest when the retry budget
/// runs out (doom; the reader that saw the connection end may not have got to it yet). Once the
/// QP has failed (a NAK flushed it: its own to_error ends the connection too), or the budget ran
/// out, the rest of a chain is flushed at once: doomed then, it waited for the budget and took
/// RETRY_EXC_ERR as the new head (1 run in 8 of WorkOutstandingAtErrorIsFlushedInOrder).
bool queue_failed(VQp& qp, RemoteQp& r, Inflight& e, int st) {
  const bool failing = r.failing;
  e.status = failing ? IBV_WC_WR_FLUSH_ERR : st != IBV_WC_SUCCESS ? st : IBV_WC_RETRY_EXC_ERR;
  r.failing = true;
  r.inflight.push_back(e);
  const bool later = !r.failed.load() &&
                     (r.doomed_at || (!failing && st == IBV_WC_SUCCESS && r.out &&
                                      r.out->broken.load() && doom(*r.out->hub, qp, r, kPeerGone)));
  if (r.inflight.size() != 1 || later) return false;
  flush_inflight(qp, r, -1, "a WR failed on the direct path");
  return true;
}

}  // namespace

bool remote_post(VQp& qp, ibv_send_wr*& wr, int& rc, ibv_send_wr** bad) {
  // A QP posted to through ibv_wr_* writes its WQEs straight into the ring: it stays there. So
  // does one that may bind windows: binds and invalidations are the backend's to execute, in
  // order with the rest of the send queue.
  if (!remote_type(qp) || qp.qp_ex.wr_start) return false;
  if (qp.mw_bind && !(qp.remote && qp.remote->active.load(std::memory_order_acquire))) return false;
  VContext& ctx = *to_vctx(qp.qp.context);
  if (!(ctx.control_page()->features & kFeatureDirectRemote)) return false;
  RemoteQp* r = qp.remote.get();
  if (r && r->revoking.load(std::memory_order_acquire)) return false;  // back to the backends
  if (r && r->afresh.load(std::memory_order_relaxed) && r->afresh.exchange(false)) {
    // Direct again after a revoke (remote_revoke.cc, rejoin): another backend may say yes.
    r->ask_wait = r->backoff = 0;
    r->ask_by_ns = 0;
    r->never = false;
  }
  if (!r || !r->active.load(std::memory_order_acquire)) {
    if (r && (r->failed.load() || r->never || r->dead)) return false;
    if (ctx.mr_imports.load(std::memory_order_relaxed)) return false;  // see VContext
    if (!connect_out(qp)) return false;
    r = qp.remote.get();
  }
  rc = 0;
  bool fail = false, revoked = false;
  for (; wr; wr = wr->next) {
    const uint8_t type = frame_type(wr->opcode);
    Inflight e;
    e.wr_id = wr->wr_id;
    e.opcode = wr->opcode;
    e.signaled = qp.sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
    MemSpan data[kMaxSge];
    size_t nd = 0;
    const int st = local_memory(ctx, qp, *wr, e, data, nd);
    std::lock_guard<std::mutex> fl(r->fl_mu);
    // Going back to the backends since the chain began: the ring takes this WR and the rest,
    // and the backend holds them until everything sent here is settled (remote_revoke.cc).
    if (r->revoking.load(std::memory_order_relaxed)) {
      revoked = true;
      break;
    }
    // A full queue first, then the WR's rules (proto/post_rules.h), as the mediated ring.
    if (r->inflight.size() >= qp.sq_size) {
      rc = ENOMEM;
      break;
    }
    if ((rc = check_post_send(qp.qp.qp_type, *wr, send_caps(qp)))) break;
    // A connected QP never had MW_BIND: a bind through it is MW_BIND_ERR, and no window is
    // bound through it to invalidate, as the backend would complete them (check_bind_mw,
    // check_invalidate). One that gained MW_BIND since cannot hand its binds to the backend,
    // which executes nothing of its send queue any more (docs/ARCHITECTURE.md, "Memory
    // windows").
    int mw_st = IBV_WC_SUCCESS;
    if (is_local_mw_op(wr->opcode)) {
      if (qp.access & IBV_ACCESS_MW_BIND) {
        rc = EOPNOTSUPP;
        break;
      }
      mw_st = wr->opcode == IBV_WR_BIND_MW ? IBV_WC_MW_BIND_ERR : IBV_WC_LOC_QP_OP_ERR;
    }
    if (r->failing || st != IBV_WC_SUCCESS || mw_st != IBV_WC_SUCCESS || !r->out ||
        r->out->broken.load()) {
      fail |= queue_failed(qp, *r, e, st != IBV_WC_SUCCESS ? st : mw_st);
      continue;
    }
    e.sent = true;
    e.seq = r->sent++;
    Frame& f = e.f;
    f.type = type;
    f.flags = static_cast<uint16_t>(wr->send_flags & IBV_SEND_SOLICITED);
    f.imm = wr->imm_data;
    f.len = e.len;
    if (type == kCas || type == kFaa) {
      f.rkey = wr->wr.atomic.rkey;
      f.raddr = wr->wr.atomic.remote_addr;
      f.arg0 = wr->wr.atomic.compare_add;
      f.arg1 = wr->wr.atomic.swap;
    } else if (type == kSendInv) {
      f.rkey = wr->invalidate_rkey;
    } else {
      f.rkey = wr->wr.rdma.rkey;
      f.raddr = wr->wr.rdma.remote_addr;
    }
    Inflight& q = r->inflight.emplace_back(e);
    if (is_inline(wr->opcode, wr->send_flags)) {
      // The application may reuse inline data at once: a resend takes it from here.
      q.inl = true;
      uint8_t* at = q.inl_data;
      for (size_t i = 0; i < nd; ++i) at = std::copy_n(data[i].p, data[i].n, at);
    } else {
      q.nl = static_cast<uint8_t>(nd);
      std::copy(data, data + nd, q.local);
    }
    r->awaiting.fetch_add(1, std::memory_order_relaxed);
    // After a kRnr it waits in line for the peer's kResume (resend()).
    // A connection that breaks as we write: the peer's library went (doom), or we fail now.
    if (!r->rnr && !write_request(*r, *r->out, q, true) && !doom(*r->out->hub, qp, *r, kPeerGone)) {
      flush_inflight(qp, *r, IBV_WC_RETRY_EXC_ERR, "a WR failed on the direct path");
      fail = true;
    }
  }
  if (fail) to_error(qp, "a WR failed on the direct path");
  if (revoked) return false;
  if (rc) *bad = wr;
  return true;
}

void remote_before_modify(VQp& qp, int mask, const ibv_qp_attr& attr) {
  if (!(mask & IBV_QP_STATE) || !qp.remote) return;
  const ibv_qp_state to = attr.qp_state;
  if (to == IBV_QPS_RTS && qp.qp.state == IBV_QPS_RTS) return;  // attributes only
  if (to == IBV_QPS_RTR || to == IBV_QPS_RTS) return;           // on its way up
  // Leaving RTS: in ERR the WRs in flight are flushed; in RESET they are dropped.
  Hub* h = to_vctx(qp.qp.context)->hub_raw.load(std::memory_order_acquire);
  qp.sq_lock.lock();
  std::unique_lock<std::mutex> q;  // the revoke tick reads the QP under it
  if (h) q = std::unique_lock<std::mutex>(h->qps_mu);
  if (to == IBV_QPS_ERR || to == IBV_QPS_SQE || to == IBV_QPS_SQD) {
    std::lock_guard<std::mutex> g(qp.remote->fl_mu);
    if (!qp.remote->inflight.empty()) flush_inflight(qp, *qp.remote, IBV_WC_WR_FLUSH_ERR, nullptr);
  }
  teardown(qp);
  qp.remote->failed.store(true);
  if (to == IBV_QPS_RESET) {
    if (h) forget_qp(*h, qp);
    qp.remote.reset();
  }
  q = {};
  qp.sq_lock.unlock();
}

void remote_after_modify(VQp& qp, int mask, const ibv_qp_attr& attr) {
  if (mask & IBV_QP_ACCESS_FLAGS) qp.access = attr.qp_access_flags;
  if (qp.access & IBV_ACCESS_MW_BIND) qp.mw_bind = true;
  if (mask & IBV_QP_RNR_RETRY) qp.rnr_retry = attr.rnr_retry;
  if (mask & IBV_QP_MIN_RNR_TIMER) qp.min_rnr_timer = attr.min_rnr_timer;
  if (mask & IBV_QP_TIMEOUT) qp.ack_timeout = attr.timeout;
  if (mask & IBV_QP_RETRY_CNT) qp.retry_cnt = attr.retry_cnt;
  if (!(mask & IBV_QP_STATE) || (attr.qp_state != IBV_QPS_RTR && attr.qp_state != IBV_QPS_RTS))
    return;
  VContext& ctx = *to_vctx(qp.qp.context);
  // A QP that may bind windows answers its peer through the backend, which knows them.
  if (!remote_type(qp) || (qp.qp.srq && to_vsrq(qp.qp.srq)->xrc) || qp.mw_bind ||
      ctx.mr_imports.load() || !(ctx.control_page()->features & kFeatureDirectRemote) ||
      (qp.remote && (qp.remote->offered || qp.remote->reoffer.load() || qp.remote->dead ||
                     qp.remote->revoking.load())))
    return;
  Hub* h = hub_of(ctx);
  if (!h) return;
  RemoteQp& r = remote_of(*h, qp);
  if (offer(*h, qp, r, false) == EAGAIN) {
    // Not yet (no connection to the peer's backend at this moment, its destination not located
    // yet, ...): the hub's tick offers again, 1 to 32 ticks apart (reoffer). Before, such a QP
    // stayed on the backends for its whole life unless its peer's own offer went through.
    watch_qp(*h, qp);
    {
      std::lock_guard<std::mutex> q(h->qps_mu);
      r.reoffer_first = true;
      r.reoffer.store(true);
    }
    wake_hub(*h);  // its wait gets the tick (hub_timeout)
  }
}

void remote_destroy(VQp& qp) {
  if (!qp.remote) return;
  Hub* h = to_vctx(qp.qp.context)->hub_raw.load(std::memory_order_acquire);
  qp.sq_lock.lock();
  {
    std::unique_lock<std::mutex> q;  // the revoke tick reads the QP under it
    if (h) q = std::unique_lock<std::mutex>(h->qps_mu);
    teardown(qp, /*take_arrived=*/true);
    if (h) forget_qp(*h, qp);
  }
  qp.sq_lock.unlock();
}

namespace {
/// The connections of `cq`'s QPs, as of the hub's generation.
void learn_conns(VCq& cq, Hub& h) {
  const uint32_t gen = h.gen.load(std::memory_order_acquire);
  if (gen == cq.rgen) return;
  std::lock_guard<std::mutex> g(h.mu);
  cq.rconns.clear();
  for (const auto& c : h.conns) {
    if (c->send_cq == &cq.cq || c->recv_cq == &cq.cq) cq.rconns.push_back(c);
  }
  cq.rgen = gen;
}

/// Whether an armed CQ: the application is about to sleep in ibv_get_cq_event (it polls until
/// empty after arming, as rping does), so the hub keeps watching its connections: a claim would
/// hold each event back until the claim's 10 ms ran out.
bool armed_for_events(const VCq& cq) {
  return cq.cq.channel && cq.hdr->armed.load(std::memory_order_relaxed) != 0;
}

/// The application's polls of `cq` read `c` from now on, not the hub (Conn::claimed).
void claim(VCq& cq, Conn& c) {
  c.claimed.store(true);
  rearm(c);
  cq.rclaimed = true;
}
}  // namespace

bool remote_progress(VCq& cq) {
  Hub* h = to_vctx(cq.cq.context)->hub_raw.load(std::memory_order_acquire);
  if (!h) return false;
  learn_conns(cq, *h);
  bool did = false;
  const bool armed = armed_for_events(cq);
  const uint64_t now = mono_ns(), gap = now - cq.rpoll_ns;
  cq.rpoll_ns = now;
  const bool seldom = gap > kUnclaimGapNs;
  for (const auto& c : cq.rconns) {
    if (c->broken.load(std::memory_order_relaxed)) continue;
    // The application polls again without having posted: what it owes goes now.
    const bool req_in = c->req_in.load(std::memory_order_relaxed);
    if (req_in) send_ack(*c);
    c->polls.store(c->polls.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    // A seldom poller leaves the peer's requests to the hub, on a connection that brought some
    // since the last poll: the peer waits for us to read them. (Not on one with answers only,
    // nor for a long gap alone: ib_write_bw's polls come between bursts of posts.)
    const uint64_t ex = c->executed.load(std::memory_order_relaxed);
    const bool leave = seldom && ex != c->executed_polled.exchange(ex, std::memory_order_relaxed);
    if (!armed && !leave && !c->claimed.load(std::memory_order_relaxed)) {
      claim(cq, *c);
    } else if (leave && c->claimed.load(std::memory_order_relaxed)) {
      unclaim(*c);
    }
    // What the socket did not take, and requests held for this poll (Conn::held).
    if (c->want_out.load(std::memory_order_relaxed) || c->held.load(std::memory_order_relaxed)) {
      std::unique_lock<std::mutex> t(c->tx_mu, std::try_to_lock);
      if (t) flush_locked(*c);
    }
    std::unique_lock<std::mutex> l(c->rx_mu, std::try_to_lock);
    if (!l || !c->qp) continue;
    RemoteQp& r = *c->qp->remote;
    if (c->resp_in.load(std::memory_order_relaxed)) rnr_retry_due(*c, *c->qp, r);
    // Nothing of ours waits for an answer: a connection of responses only has nothing we need,
    // and reading it costs a syscall a poll; but now and then, for the peer's kRevoke (a
    // claimed connection is not the hub's to read).
    if (!req_in && r.awaiting.load(std::memory_order_relaxed) == 0 &&
        c->polls.load(std::memory_order_relaxed) % kRevokeReadEvery)
      continue;
    // (Claimed, the ACK waits for our next post or poll, or for the hub once the polls stop
    // (unclaim); unclaimed or armed, nothing need follow soon: it goes now.)
    did |= drain(*c, !armed && c->claimed.load(std::memory_order_relaxed));
    if (req_in) try_resume(*c, *c->qp, r);
  }
  return did;
}

namespace {
/// remote_found claims only for a CQ of at most this many connections, where it was measured
/// (a process's default cap, VRDMA_DIRECT_REMOTE_QPS): 4 KiB `ib_write_bw -q 16` and `-q 64`
/// with every QP direct varied by 40 % between batches of runs either way.
constexpr size_t kClaimFoundMax = kDirectConnsDefault;

/// remote_found with no claim.
void remote_claim(VCq& cq) {
  Hub* h = to_vctx(cq.cq.context)->hub_raw.load(std::memory_order_acquire);
  if (!h) return;
  learn_conns(cq, *h);
  if (cq.rconns.empty() || cq.rconns.size() > kClaimFoundMax || armed_for_events(cq)) return;
  for (const auto& c : cq.rconns) {
    // Only a connection that has brought no request of the peer's (answers to ours, or nothing
    // yet): those stay the hub's until an empty poll takes them (remote_progress's rules).
    if ((c->req_in.load(std::memory_order_relaxed) &&
         c->executed.load(std::memory_order_relaxed) != 0) ||
        c->broken.load(std::memory_order_relaxed) || c->claimed.load(std::memory_order_relaxed))
      continue;
    claim(cq, *c);
  }
}

/// remote_found with claims.
void remote_release(VCq& cq) {
  // Only the connections that bring what the application may now wait for in memory: the peer's
  // requests to a QP with no receive posted (WRITEs, which complete nothing here). A QP with
  // receives posted, or with requests of ours unanswered, is waited on by polling; so is one
  // whose peer has sent no request yet (a READ ping-pong's requester: a release would cost
  // two epoll_ctl a round trip). The rest stays claimed until the polls stop (kClaimMs).
  bool any = false;
  for (const auto& c : cq.rconns) {
    if (!c->claimed.load(std::memory_order_relaxed)) continue;
    bool keep = !c->req_in.load(std::memory_order_relaxed) ||
                c->executed.load(std::memory_order_relaxed) == 0 ||
                c->broken.load(std::memory_order_relaxed) ||
                c->rq_hdr->producer.load(std::memory_order_relaxed) !=
                    c->rq_hdr->consumer.load(std::memory_order_relaxed);
    if (!keep && c->resp_in.load(std::memory_order_relaxed)) {
      std::unique_lock<std::mutex> l(c->rx_mu, std::try_to_lock);
      keep = !l || !c->qp || c->qp->remote->awaiting.load(std::memory_order_relaxed) != 0;
    }
    if (keep) {
      any = true;
      continue;
    }
    unclaim(*c, /*ack_now=*/false);  // it rides on our next request (kAckDeferNs)
  }
  cq.rclaimed = any;
}
}  // namespace

void remote_found(VCq& cq) {
  if (cq.rclaimed)
    remote_release(cq);
  else
    remote_claim(cq);
}

void fire_cq(VCq& cq, bool solicited) {
  if (!cq.cq.channel) return;
  std::lock_guard<std::mutex> g(cq.notify_mu);
  fire(cq.notify, solicited);
}

bool take_cq_notify(VCq& cq, std::vector<UniqueFd>& fds, size_t at) {
  if (fds.size() < at + kDirectNotifyFds || !fds[at + 1].valid() || !fds[at + 2].valid())
    return false;
  std::lock_guard<std::mutex> g(cq.notify_mu);
  cq.notify.write_end = std::move(fds[at + 1]);
  cq.notify.read_end = std::move(fds[at + 2]);
  cq.notify.cq = cq.handle;
  cq.notify.hdr = cq.hdr;
  return true;
}

void remote_armed(VCq& cq) {
  // The application is about to sleep in ibv_get_cq_event: what it claimed goes back to the hub
  // now (the hub reads, completes and fires the channel), not when the polls have stopped for
  // kClaimMs, which a blocked waiter would wait out per event.
  for (const auto& c : cq.rconns) {
    if (c->claimed.load(std::memory_order_relaxed)) unclaim(*c);
  }
  cq.rclaimed = false;
}

void remote_receives_posted(VQp& qp) {
  RemoteQp* r = qp.remote.get();
  if (!r) return;
  // The receive's producer index before the flag (send_rnr() stores them the other way round).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!r->resume_owed.load(std::memory_order_seq_cst)) return;
  Hub* h = to_vctx(qp.qp.context)->hub_raw.load(std::memory_order_acquire);
  if (!h) return;
  std::shared_ptr<Conn> c;
  {
    std::lock_guard<std::mutex> g(h->mu);
    c = r->in;
  }
  if (!c) return;
  std::lock_guard<std::mutex> l(c->rx_mu);
  if (c->qp) try_resume(*c, qp, *r);
}

void remote_srq_posted(VSrq& srq) {
  Hub* h = to_vctx(srq.srq.context)->hub_raw.load(std::memory_order_acquire);
  if (!h) return;
  std::vector<std::shared_ptr<Conn>> on;
  {
    std::lock_guard<std::mutex> g(h->mu);
    for (const auto& c : h->conns) {
      if (c->rq_hdr == srq.hdr) on.push_back(c);
    }
  }
  for (const auto& c : on) {
    std::lock_guard<std::mutex> l(c->rx_mu);
    if (c->qp && c->qp->remote) try_resume(*c, *c->qp, *c->qp->remote);
  }
}

void remote_shutdown(VContext& ctx) {
  std::shared_ptr<Hub> h;
  {
    std::lock_guard<std::mutex> g(ctx.hub_make);
    h = std::move(ctx.hub);
    ctx.hub_raw.store(nullptr);
  }
  if (!h) return;
  const uint64_t one = 1;
  if (::write(h->stop.get(), &one, sizeof(one)) < 0) {
    VLOG_WARN("direct path: cannot stop the hub thread: {}", std::strerror(errno));
    h->thr.detach();
    return;
  }
  h->thr.join();
}

}  // namespace vrdma::verbs
