// The direct path across backends: requests, their responses and completions, as the
// application's thread and the hub read and write them (see remote_impl.h for the locks).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
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

namespace vrdma::verbs::dlink {

// ---- completions and errors ----

/// Drops the oldest WR in flight (fl_mu held).
void pop_head(RemoteQp& r) {
  if (r.inflight.front().sent) r.awaiting.fetch_sub(1, std::memory_order_relaxed);
  r.inflight.pop_front();
}

/// Writes the completion of a requester's WR (tx: fl_mu held).
void complete(VQp& qp, RemoteQp& r, const Inflight& e, int status) {
  if (status == IBV_WC_SUCCESS) count(r.send, e.len);
  if (!e.signaled && status == IBV_WC_SUCCESS) return;
  if (!has_room(r.send)) {
    // As the backend does for a CQ it fills (Device::push_cqe): one line, and the CQ's async
    // error (a write to the async pipe: once per ring, on a path that already lost data).
    if (!r.send_overrun) {
      r.send_overrun = true;
      VLOG_ERROR("direct path: send CQ of QP {:#x} overrun; completions are being lost",
                 qp.qp.qp_num);
      if (!raise_async_event(qp.qp.context, IBV_EVENT_CQ_ERR, to_vcq(qp.qp.send_cq)->handle))
        VLOG_ERROR("direct path: could not queue the CQ error event of QP {:#x}: {}", qp.qp.qp_num,
                   std::strerror(errno));
    }
    return;
  }
  Cqe c{};
  c.wr_id = e.wr_id;
  c.status = static_cast<uint32_t>(status);
  c.opcode = send_wc_opcode(e.opcode);
  c.byte_len = status == IBV_WC_SUCCESS ? e.len : 0;
  c.qp_num = qp.qp.qp_num;
  push(r.send, c);
  fire_cq(*to_vcq(qp.qp.send_cq), status != IBV_WC_SUCCESS);  // an error: either arm
}

void flush_inflight(VQp& qp, RemoteQp& r, int head_status, const char* why) {
  // As on a device, a poller that sees the error completion finds the QP in ERR already.
  if (why) to_error(qp, why);
  bool head = true;
  while (!r.inflight.empty()) {
    const Inflight& e = r.inflight.front();
    int st = IBV_WC_WR_FLUSH_ERR;
    if (head) st = head_status >= 0 ? head_status : (!e.sent ? e.status : IBV_WC_WR_FLUSH_ERR);
    complete(qp, r, e, st);
    pop_head(r);
    head = false;
  }
  r.failing = true;
}

void to_error(VQp& qp, const char* why, bool quiet) {
  RemoteQp& r = *qp.remote;
  if (r.failed.exchange(true)) return;
  r.active.store(false);
  VLOG_WARN("direct path: QP {:#x} to the error state: {}", qp.qp.qp_num, why);
  std::shared_ptr<Conn> conns[2];
  Hub* h = to_vctx(qp.qp.context)->hub_raw.load(std::memory_order_acquire);
  if (h && !quiet) {
    std::lock_guard<std::mutex> g(h->mu);  // teardown may be taking them away
    conns[0] = r.out;
    conns[1] = r.in;
  }
  for (const auto& c : conns) {
    if (!c) continue;
    // What a reader's batch held (t_corked: a NAK, ACKs, answers) goes before the end.
    if (c->held.load(std::memory_order_relaxed)) flush_held(*c);
    ::shutdown(c->fd.get(), SHUT_RDWR);
  }
  ModifyQpReq req{};
  req.handle = qp.handle;
  req.mask = IBV_QP_STATE;
  req.attr.qp_state = IBV_QPS_ERR;
  Empty resp;
  to_vctx(qp.qp.context)->call(Op::kModifyQp, &req, sizeof(req), &resp, 0);
}

/// No WR of ours waits for an answer any more (fl_mu held): the QP failed (flush_inflight), or
/// what is left failed locally and waits only for its turn. A WR that fails locally behind WRs
/// in flight sets `failing` (nothing more is sent), but their answers still complete them, and
/// then it (acked_upto).
bool nothing_awaited(const RemoteQp& r) {
  return r.failing && (r.inflight.empty() || !r.inflight.front().sent);
}

/// The peer has executed `n` of our requests (fl_mu held): those answered by an ACK complete,
/// up to the first that waits for its data (READ, atomic); then a WR that failed locally, if it
/// is now the head, completes with its error (`fail`: the QP goes to ERR). False: the peer
/// claims more than was sent (a broken peer).
bool acked_upto(VQp& qp, RemoteQp& r, uint64_t n, bool& fail) {
  if (n > r.sent) return false;
  r.peer_executed = std::max(r.peer_executed, n);
  while (!r.inflight.empty() && r.inflight.front().sent &&
         r.inflight.front().seq < r.peer_executed && !answered_by_data(r.inflight.front().opcode)) {
    complete(qp, r, r.inflight.front(), IBV_WC_SUCCESS);
    pop_head(r);
  }
  if (!r.inflight.empty() && !r.inflight.front().sent) {
    flush_inflight(qp, r, -1, "a WR failed on the direct path");
    fail = true;
  }
  return true;
}

bool write_request(RemoteQp& r, Conn& out, Inflight& e, bool may_hold) {
  Conn* in = r.in_raw.load(std::memory_order_acquire);
  e.f.ack = in ? in->executed.load() : 0;
  if (in && e.f.ack) in->acked.store(e.f.ack);
  if (!carries_data(e.f.type)) return send_frame(out, e.f, nullptr, 0, true, may_hold);
  const MemSpan inl{e.inl_data, e.len};
  return e.inl ? send_frame(out, e.f, &inl, 1, true, may_hold)
               : send_frame(out, e.f, e.local, e.nl, false, may_hold);
}

/// The peer's kResume, or a counted RNR retry's timer: kRewind, then every request from the one
/// it dropped on, in order (fl_mu held). A write that fails leaves it to the reader, which finds
/// the connection broken.
void resend(RemoteQp& r, Conn& out) {
  r.rnr = false;
  r.rnr_until.store(0, std::memory_order_relaxed);
  Frame w{};
  w.type = kRewind;
  if (!send_frame(out, w, nullptr, 0, true)) return;
  for (Inflight& e : r.inflight) {
    if (!e.sent) break;  // failed locally: completes in its turn, and the QP goes to ERR
    if (e.seq >= r.resend_from && !write_request(r, out, e)) return;
  }
}

// ---- receiving ----

/// Reads into the buffer: 1 got bytes, 0 none now, -1 closed or failed.
int fill(Conn& c) {
  if (c.beg == c.end) {
    c.beg = c.end = 0;
  } else if (c.buf.size() - c.end < sizeof(Frame)) {
    std::memmove(c.buf.data(), c.buf.data() + c.beg, c.end - c.beg);
    c.end -= c.beg;
    c.beg = 0;
  }
  size_t want = c.buf.size() - c.end;
  if (c.large && c.rx == Conn::Rx::kHeader) want = std::min(want, kHeaderReadAfterLarge);
  bool more = false;
  const ssize_t r = tls_read(c, c.buf.data() + c.end, want, more);
  if (r > 0) {
    tsan_ring_acquire();
    c.end += static_cast<size_t>(r);
    c.emptied = !more;
    return 1;
  }
  c.emptied = true;
  return r == 0 ? 0 : -1;
}

void advance(Conn& c, uint64_t n) {
  while (n) {
    const uint64_t k = std::min(n, c.dst[c.di].n - c.doff);
    c.doff += k;
    n -= k;
    if (c.doff == c.dst[c.di].n) ++c.di, c.doff = 0;
  }
}

/// Moves payload into its destination: 1 all of it is there, 0 more to come, -1 broken.
int rx_payload(Conn& c) {
  while (c.left) {
    if (c.beg < c.end) {
      uint64_t n = std::min<uint64_t>(c.left, c.end - c.beg);
      c.left -= n;
      if (!c.discard) {
        const uint8_t* p = c.buf.data() + c.beg;
        const DmaUnseen dma;
        while (n) {
          const uint64_t k = std::min(n, c.dst[c.di].n - c.doff);
          std::memcpy(c.dst[c.di].p + c.doff, p, k);
          p += k;
          n -= k;
          c.beg += k;
          advance(c, k);
        }
      } else {
        c.beg += n;
      }
      continue;
    }
    if (c.discard || c.left < kDirectReadMin) {
      const int r = fill(c);
      if (r <= 0) return r;
      continue;
    }
    // Large: straight into the destination, a record at a time.
    bool more = false;
    ssize_t r;
    {
      const DmaUnseen dma;
      r = tls_read(c, c.dst[c.di].p + c.doff, std::min(c.left, c.dst[c.di].n - c.doff), more,
                   false);
    }
    c.emptied = r <= 0 || !more;
    if (r > 0) {
      tsan_ring_acquire();
      advance(c, static_cast<uint64_t>(r));
      c.left -= static_cast<uint64_t>(r);
    } else {
      return static_cast<int>(r);
    }
  }
  return 1;
}

/// What taking a frame in came to, one value for every reader of it (drain). kGo: go on with
/// it. kBroken: the peer broke the protocol; the connection ends as a lost one (broken()).
/// kFailed: a WR or a request failed; the QP goes to ERR, its completions already written.
struct Outcome {
  enum Kind : uint8_t { kGo, kBroken, kFailed } kind = kGo;
  const char* why = nullptr;
};
constexpr Outcome kGo{};
constexpr Outcome broken_peer(const char* why) { return {Outcome::kBroken, why}; }
constexpr Outcome failed(const char* why) { return {Outcome::kFailed, why}; }
constexpr const char* kWrFailed = "a WR failed on the direct path";

void send_ack(Conn& c) {
  const uint64_t e = c.executed.load();
  if (e == c.acked.load() || c.nak_sent) return;
  Frame a{};
  a.type = kAck;
  a.arg0 = e;
  send_frame(c, a, nullptr, 0, true);
  c.acked.store(e);
}

void send_nak(Conn& c, ibv_wc_status st) {
  Frame f{};
  f.type = kNak;
  f.status = static_cast<uint8_t>(st);
  f.arg0 = c.executed.load();
  send_frame(c, f, nullptr, 0, true);
  c.acked.store(f.arg0);
  c.nak_sent = true;
}

const RingHeader* receive_queue(const VQp& qp) {
  return qp.qp.srq ? to_vsrq(qp.qp.srq)->hdr : qp.rq_hdr;
}

/// Whether a request that needs a receive can be executed now: one is posted (or, on an SRQ,
/// held already), and its completion has room (rx_mu held: this library is the ring's producer).
bool receivable(VQp& qp, RemoteQp& r) {
  if (r.srq_tag && srq_recv_held(*qp.rq_hdr))
    return has_room(r.recv);
  const RingHeader& h = *receive_queue(qp);
  const uint32_t size = r.srq_tag ? to_vsrq(qp.qp.srq)->size : qp.rq_size;
  const uint32_t cons = h.consumer.load(std::memory_order_acquire);
  const uint32_t prod = h.producer.load(std::memory_order_seq_cst);
  return prod != cons && prod - cons <= size && has_room(r.recv);
}

/// take_rx_lock's spins, times this: a holder is another process or the backend taking one
/// receive; a holder that died is the backend's to find (its orphan check), not ours.
constexpr int kSrqLockTries = 16;

/// A QP on an SRQ: the receive it holds (RingHeader::srq_taken, its RQ's slot 0), else the
/// SRQ's next, taken under the SRQ's rx_lock and held from now on, as the backend's responder
/// takes one (Device::take_recv): nothing else takes it while the payload comes, and a QP that
/// fails has it flushed by its backend. A receive that leaves fewer than the SRQ's armed limit
/// posted rings our backend's doorbell for the QP, which raises the event (Device::
/// tend_fed_srq). False: none posted, or the lock held past our spins (the peer hears kRnr and
/// sends the request again).
bool hold_srq_recv(VQp& qp) {
  RingHeader& mine = *qp.rq_hdr;
  if (srq_recv_held(mine)) return true;
  VSrq& q = *to_vsrq(qp.qp.srq);
  RingHeader& h = *q.hdr;
  const uint32_t tag = qp.remote->srq_tag;
  bool locked = false;
  for (int i = 0; i < kSrqLockTries && !locked; ++i) locked = take_rx_lock(h, tag);
  if (!locked) {
    // Held past our spins: perhaps by a process that died in it, which the backend frees.
    to_vctx(qp.qp.context)->ring_doorbell(qp.handle);
    return false;
  }
  const uint32_t cons = h.consumer.load(std::memory_order_acquire);
  const uint32_t avail = h.producer.load(std::memory_order_acquire) - cons;
  const bool ok = avail != 0 && avail <= q.size;
  uint32_t limit = 0;
  if (ok) {
    hold_srq_wqe(mine, qp.rq[0], q.entries[cons & (q.size - 1)], cons);  // as take_recv
    h.consumer.store(cons + 1, std::memory_order_release);
    limit = h.srq_limit.load(std::memory_order_acquire);
  }
  give_rx_lock(h);
  if (ok && limit && avail - 1 < limit) to_vctx(qp.qp.context)->ring_doorbell(qp.handle);
  return ok;
}

/// The responder's receive WQE for the frame, copied out (not consumed; on an SRQ held, see
/// hold_srq_recv). False: none posted yet, or no room for its completion.
bool peek_recv(Conn& c, VQp& qp, RemoteQp& r) {
  if (!has_room(r.recv)) return false;
  const RecvWqe* w;
  if (r.srq_tag) {
    if (!hold_srq_recv(qp)) return false;
    w = &qp.rq[0];
  } else {
    if (!receivable(qp, r)) return false;
    c.rcons = qp.rq_hdr->consumer.load(std::memory_order_relaxed);
    w = &qp.rq[c.rcons & (qp.rq_size - 1)];
  }
  c.rwqe.wr_id = w->wr_id;
  c.rwqe.num_sge = std::min<uint32_t>(w->num_sge, kMaxSge);
  std::memcpy(c.rwqe.sge, w->sge, c.rwqe.num_sge * sizeof(Sge));
  return true;
}

/// The receive peek_recv returned is used: the RQ's consumer moves (on an SRQ: the QP holds it no
/// more).
void consume_recv(Conn& c, VQp& qp, RemoteQp& r) {
  if (r.srq_tag)
    qp.rq_hdr->srq_taken.store(0, std::memory_order_release);
  else
    qp.rq_hdr->consumer.store(c.rcons + 1, std::memory_order_release);
}

void try_resume(Conn& c, VQp& qp, RemoteQp& r) {
  if (!r.resume_owed.load(std::memory_order_seq_cst) || !receivable(qp, r) ||
      !r.resume_owed.exchange(false))
    return;
  Frame f{};
  f.type = kResume;
  f.arg0 = c.executed.load();
  send_frame(c, f, nullptr, 0, true);
  c.acked.store(f.arg0);
}

/// The request being read found no receive: the peer is told (kRnr, with how many of its
/// requests were executed: the number of this one), and this one and those after it are dropped
/// until its kRewind (rx_mu held).
void send_rnr(Conn& c, VQp& qp, RemoteQp& r) {
  Frame f{};
  f.type = kRnr;
  f.status = qp.min_rnr_timer;  // how long the requester waits before it sends them again
  f.arg0 = c.executed.load();
  send_frame(c, f, nullptr, 0, true);
  c.acked.store(f.arg0);
  c.rnr = true;
  VLOG_DEBUG("direct path: QP {:#x} has no receive for request {} of its peer: kRnr", qp.qp.qp_num,
             f.arg0);
  // Owed before looking again: a receive posted in between either is seen here or sees the flag.
  r.resume_owed.store(true, std::memory_order_seq_cst);
  if (r.srq_tag) to_vsrq(qp.qp.srq)->resume_owed.store(true, std::memory_order_seq_cst);
  try_resume(c, qp, r);
}

void rnr_retry_due(Conn& c, VQp& qp, RemoteQp& r) {
  const uint64_t until = r.rnr_until.load(std::memory_order_relaxed);
  if (!until || mono_ns() < until) return;
  std::lock_guard<std::mutex> g(r.fl_mu);
  if (!r.rnr || nothing_awaited(r) || !r.rnr_until.load(std::memory_order_relaxed)) return;
  VLOG_DEBUG("direct path: QP {:#x} sends its requests from {} again (RNR retries left: {})",
             qp.qp.qp_num, r.resend_from, r.rnr_left);
  r.resume_may_cross = true;
  resend(r, c);
}

/// The receive completion of a consumed WQE; `taken`: the RQ's consumer index says so already.
void push_recv(Conn& c, VQp& qp, RemoteQp& r, int status, bool taken) {
  if (!taken) consume_recv(c, qp, r);
  Cqe e{};
  e.wr_id = c.rwqe.wr_id;
  e.status = static_cast<uint32_t>(status);
  e.opcode = c.f.type == kWriteImm ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
  if (status == IBV_WC_SUCCESS) {
    e.byte_len = c.f.len;
    if (c.f.type == kSendInv) {  // ibv_wc's invalidated_rkey shares imm_data's place
      e.wc_flags = IBV_WC_WITH_INV;
      e.imm_data = c.f.rkey;
    } else if (c.f.type != kSend) {
      e.wc_flags = IBV_WC_WITH_IMM;
      e.imm_data = c.f.imm;
    }
  }
  e.qp_num = qp.qp.qp_num;
  e.src_qp = r.peer_qpn;
  e.slid = static_cast<uint16_t>(r.peer_lid);
  push(r.recv, e);
  fire_cq(*to_vcq(qp.qp.recv_cq), status != IBV_WC_SUCCESS || (c.f.flags & IBV_SEND_SOLICITED));
}

/// A SEND the receive WQE cannot take: the requester is told (`nak`), the WQE is taken (the
/// backend's flush of the RQ starts after it), the QP goes to ERR, then the completion (`st`)
/// shows: a poller that sees it finds the QP in ERR, as on a device.
Outcome receive_failed(Conn& c, VQp& qp, RemoteQp& r, int st, ibv_wc_status nak) {
  if (qp.qp.qp_type == IBV_QPT_UC) {
    // UC: no NAK, so the requester completes it (IB spec class D/E, as the backends' UC
    // responder); our WQE completes in error, our QP goes to ERR (flushing what we sent), and
    // what comes next on the connection is lost.
    consume_recv(c, qp, r);
    {
      std::lock_guard<std::mutex> g(r.fl_mu);
      to_error(qp, "a UC receive failed at this responder", /*quiet=*/true);
      if (!r.inflight.empty()) flush_inflight(qp, r, IBV_WC_WR_FLUSH_ERR, nullptr);
    }
    push_recv(c, qp, r, st, /*taken=*/true);
    c.uc_dead = c.discard = c.lost = true;
    c.left = c.f.len;
    return kGo;
  }
  send_nak(c, nak);
  consume_recv(c, qp, r);
  to_error(qp, "a request failed at this responder");
  push_recv(c, qp, r, st, /*taken=*/true);
  return failed("a request failed at this responder");
}

/// An atomic request (kCas, kFaa): executed on our memory and answered with the old value, or
/// NAKed (rx_mu held).
void execute_atomic(Conn& c, VQp& qp, RemoteQp& r) {
  const Frame& f = c.f;
  uint8_t* p;
  const uint32_t op = f.type == kFaa ? IBV_WR_ATOMIC_FETCH_AND_ADD : IBV_WR_ATOMIC_CMP_AND_SWP;
  ibv_wc_status st = rkey_memory(qp, op, f.rkey, f.raddr, 8, p);
  // Aligned where it lies in this process too (split locks, as the backend checks).
  if (st == IBV_WC_SUCCESS && (reinterpret_cast<uintptr_t>(p) & 7)) st = IBV_WC_REM_INV_REQ_ERR;
  if (st != IBV_WC_SUCCESS) {
    send_nak(c, st);
    return;
  }
  uint64_t old;
  {
    const DmaUnseen dma(true);
    old = rdma_atomic(reinterpret_cast<uint64_t*>(p), f.type == kFaa, f.arg0, f.arg1);
  }
  Frame a{};
  a.type = kAtomicResp;
  a.len = 8;
  a.arg0 = c.executed.fetch_add(1) + 1;
  a.arg1 = old;
  send_frame(c, a, nullptr, 0, true);
  c.acked.store(a.arg0);
  count(r.recv, 8);
}

/// A request's header has arrived: check it against our memory and say where its data goes.
Outcome start_request(Conn& c, VQp& qp, RemoteQp& r) {
  const Frame& f = c.f;
  c.nd = c.di = 0;
  c.doff = 0;
  c.discard = c.lost = false;
  c.left = 0;
  // UC: no READ, atomics or SEND_WITH_INV (the requester's post rules refuse them; a peer that
  // sends one anyway is broken), and no RNR or NAK: what cannot land is lost (the backend's UC
  // responder across backends drops it the same way).
  const bool uc = qp.qp.qp_type == IBV_QPT_UC;
  if (uc && !carries_data(f.type) && f.type != kRewind)
    return broken_peer("the peer sent a UC QP an opcode UC does not have");
  if (uc && f.type == kSendInv) return broken_peer("the peer sent a UC QP a SEND_WITH_INV");
  auto lose = [&] {
    c.discard = c.lost = true;
    c.left = f.len;
    return kGo;
  };
  if (c.uc_dead) return lose();
  // Dropped: after a NAK; after a kRnr until the peer's resend begins (kRewind, which is
  // dropped too: it only ends that; a stray one is ignored); one that finds no receive.
  bool drop = c.nak_sent || c.rnr || f.type == kRewind;
  if (!drop && consumes_recv(f.type) && !peek_recv(c, qp, r)) {
    if (uc) return lose();
    send_rnr(c, qp, r);
    drop = true;
  }
  if (drop) {
    if (f.type == kRewind) {
      // It resends without waiting for a kResume (a counted retry): none is owed any more.
      c.rnr = false;
      r.resume_owed.store(false, std::memory_order_seq_cst);
    }
    c.discard = true;
    c.left = carries_data(f.type) ? f.len : 0;
    return kGo;
  }
  VContext& ctx = *to_vctx(qp.qp.context);
  switch (f.type) {
    case kSend:
    case kSendImm:
    case kSendInv: {
      uint64_t cap = 0;
      // An SRQ's receives are in the SRQ's PD, which may differ from the QP's.
      const uint32_t pd = qp.qp.srq ? reinterpret_cast<VPd*>(qp.qp.srq->pd)->handle : qp.pd;
      for (uint32_t i = 0; i < c.rwqe.num_sge; ++i) {
        const Sge& s = c.rwqe.sge[i];
        if (!s.length) continue;
        LocalMr mr;
        if (!find_mr(ctx, pd, s.lkey, mr) || !(mr.access & IBV_ACCESS_LOCAL_WRITE) ||
            !in_range(mr.addr, mr.length, s.addr, s.length)) {
          return receive_failed(c, qp, r, IBV_WC_LOC_PROT_ERR, IBV_WC_REM_OP_ERR);
        }
        c.dst[c.nd++] = MemSpan{local_ptr(mr, s.addr), s.length};
        cap += s.length;
      }
      if (cap < f.len) {
        return receive_failed(c, qp, r, IBV_WC_LOC_LEN_ERR, IBV_WC_REM_INV_REQ_ERR);
      }
      // SEND_WITH_INV: the backend invalidates the window if this QP may (check_invalidate);
      // otherwise the receive fails, as the backend's responder fails it.
      if (f.type == kSendInv && !invalidate_window(qp, f.rkey))
        return receive_failed(c, qp, r, IBV_WC_LOC_PROT_ERR, IBV_WC_REM_INV_REQ_ERR);
      c.left = f.len;
      return kGo;
    }
    case kWrite:
    case kWriteImm: {
      uint8_t* p;
      if (const ibv_wc_status st = rkey_memory(qp, IBV_WR_RDMA_WRITE, f.rkey, f.raddr, f.len, p);
          st != IBV_WC_SUCCESS) {
        if (uc) return lose();
        send_nak(c, st);
        c.discard = true;
        c.left = f.len;
        return kGo;
      }
      if (p) c.dst[c.nd++] = MemSpan{p, f.len};
      c.left = f.len;
      return kGo;
    }
    case kRead: {
      uint8_t* p;
      if (const ibv_wc_status st = rkey_memory(qp, IBV_WR_RDMA_READ, f.rkey, f.raddr, f.len, p);
          st != IBV_WC_SUCCESS) {
        send_nak(c, st);
        return kGo;
      }
      Frame a{};
      a.type = kReadResp;
      a.len = f.len;
      a.arg0 = c.executed.fetch_add(1) + 1;
      const MemSpan d{p, f.len};
      {
        const DmaUnseen dma;
        send_frame(c, a, &d, 1, true);
      }
      c.acked.store(a.arg0);
      count(r.recv, f.len);
      return kGo;
    }
    case kCas:
    case kFaa:
      execute_atomic(c, qp, r);
      return kGo;
    default:  // not a request: checked by the caller
      return broken_peer("the peer sent a malformed frame");
  }
}

void finish_request(Conn& c, VQp& qp, RemoteQp& r) {
  if (c.lost) c.executed.fetch_add(1);  // answered as done: UC's requester completes it
  if (c.nak_sent || c.discard) return;
  const uint8_t t = c.f.type;
  if (t == kRead || t == kCas || t == kFaa) return;  // answered at the start
  if (consumes_recv(t)) push_recv(c, qp, r, IBV_WC_SUCCESS, /*taken=*/false);
  count(r.recv, c.f.len);
  c.executed.fetch_add(1);
}

/// An ACK riding on the peer's request: it executed `n` of ours (fl_mu taken here).
Outcome ack_riding(VQp& qp, RemoteQp& r, uint64_t n) {
  std::lock_guard<std::mutex> g(r.fl_mu);
  bool fail = false;
  if (!nothing_awaited(r) && !acked_upto(qp, r, n, fail))
    return broken_peer("the peer acknowledged requests that were not sent");
  return fail ? failed(kWrFailed) : kGo;
}

/// A response's header has arrived (requester).
Outcome start_response(Conn& c, VQp& qp, RemoteQp& r) {
  const Frame& f = c.f;
  c.nd = c.di = 0;
  c.doff = 0;
  c.discard = false;
  c.left = 0;
  std::lock_guard<std::mutex> g(r.fl_mu);
  bool fail = false;  // acked_upto completed a WR that failed locally: the QP goes to ERR
  if (nothing_awaited(r)) {  // already in error: take the bytes, do nothing
    c.discard = true;
    c.left = f.type == kReadResp ? f.len : 0;
    return kGo;
  }
  const bool data = f.type == kReadResp || f.type == kAtomicResp;
  const uint64_t before = data ? f.arg0 - 1 : f.arg0;
  if ((data && f.arg0 == 0) || !acked_upto(qp, r, before, fail))
    return broken_peer("the peer answered out of order");
  if (fail) return failed(kWrFailed);
  if (f.type == kAck) return kGo;
  if (f.type == kRnr) {
    if (r.rnr || f.arg0 != r.peer_executed || f.arg0 >= r.sent)
      return broken_peer("the peer refused a request that was not sent for want of a receive");
    r.rnr = true;  // nothing more is written until its kResume or the RNR timer
    r.resend_from = f.arg0;
    r.resume_may_cross = false;  // its kResume for an earlier kRnr came before this one
    // An RNR NAK, counted as the backend counts it; rnr_retry 7 waits for the kResume alone.
    if (!rnr_may_retry(qp.rnr_retry, f.arg0 != r.rnr_seq, r.rnr_left)) {
      flush_inflight(qp, r, IBV_WC_RNR_RETRY_EXC_ERR, "RNR retries exhausted");
      return failed("RNR retries exhausted");
    }
    r.rnr_seq = f.arg0;
    if (qp.rnr_retry != kRnrRetryForever)
      r.rnr_until.store(mono_ns() + rnr_delay_ns(f.status), std::memory_order_relaxed);
    return kGo;
  }
  if (f.type == kResume) {
    if (!r.rnr && r.resume_may_cross) {  // sent before the peer saw our timer's kRewind
      r.resume_may_cross = false;
      return kGo;
    }
    if (!r.rnr) return broken_peer("the peer asked to resend what it had not refused");
    VLOG_DEBUG("direct path: QP {:#x} sends its requests from {} again", qp.qp.qp_num,
               r.resend_from);
    resend(r, c);
    return kGo;
  }
  Inflight* e = r.inflight.empty() ? nullptr : &r.inflight.front();
  if (!e || !e->sent || e->seq != before)
    return broken_peer("the peer answered a request that was not sent");
  if (f.type == kNak) {
    flush_inflight(qp, r, f.status, "the peer refused a request");
    return failed("the peer refused a request");
  }
  if (f.type == kAtomicResp) {
    if (!answered_by_data(e->opcode) || e->opcode == IBV_WR_RDMA_READ)
      return broken_peer("an atomic result for another WR");
    // The 8 bytes of the result, into the WR's SGEs (check_send_length: 8 in all).
    const auto* v = reinterpret_cast<const uint8_t*>(&f.arg1);
    for (uint8_t i = 0; i < e->nl; v += e->local[i].n, ++i)
      std::memcpy(e->local[i].p, v, e->local[i].n);
    complete(qp, r, *e, IBV_WC_SUCCESS);
    pop_head(r);
    acked_upto(qp, r, f.arg0, fail);
    return fail ? failed(kWrFailed) : kGo;
  }
  // kReadResp
  if (e->opcode != IBV_WR_RDMA_READ || f.len != e->len)
    return broken_peer("READ data for another WR");
  for (uint8_t i = 0; i < e->nl; ++i) c.dst[c.nd++] = e->local[i];
  c.left = f.len;
  return kGo;
}

/// False: the QP goes to ERR (a WR after it failed locally).
bool finish_response(Conn& c, VQp& qp, RemoteQp& r) {
  if (c.f.type != kReadResp || c.discard) return true;
  std::lock_guard<std::mutex> g(r.fl_mu);
  if (r.inflight.empty()) return true;
  complete(qp, r, r.inflight.front(), IBV_WC_SUCCESS);
  pop_head(r);
  bool fail = false;
  acked_upto(qp, r, c.f.arg0, fail);
  return !fail;
}

/// The connection closed or failed. A requester with WRs in flight puts its QP in ERR (they
/// complete with RETRY_EXC_ERR, as a peer that stopped answering does); otherwise the peer is
/// just gone, and the next post finds out.
void broken(Conn& c, VQp& qp, const char* why, bool lost = false) {
  c.broken.store(true);
  rearm(c);
  if (!c.resp_in.load()) return;
  RemoteQp& r = *qp.remote;
  std::lock_guard<std::mutex> g(r.fl_mu);
  if (r.inflight.empty()) return;
  // The peer's library went (closed, reset): what is in flight fails later (doom).
  if (lost && doom(*c.hub, qp, r, why)) return;
  flush_inflight(qp, r, IBV_WC_RETRY_EXC_ERR, why);  // (and moves the QP to ERR)
}

bool drain(Conn& c, bool defer_ack) {
  VQp& qp = *c.qp;
  RemoteQp& r = *qp.remote;
  if (c.broken.load()) return false;
  // What the batch sends goes out in one write when it ends; released before the QP or the
  // connection fails, so that its NAK goes first.
  Cork cork(c);
  bool did = false;
  for (;;) {
    if (c.rx == Conn::Rx::kHeader) {
      if (c.end - c.beg < sizeof(Frame)) {
        // A read that left nothing in the TLS session most likely left the socket empty too:
        // another read now would find nothing, and cost a syscall between every request and its
        // answer (the next poll, or the hub's next EPOLLIN, reads what comes later; what the
        // session holds, epoll does not see: it is read now).
        if (did && c.beg == c.end && c.emptied) break;
        const int got = fill(c);
        if (got < 0) {
          cork.release();
          broken(c, qp, !c.tls_err.empty() ? c.tls_err.c_str() : "the peer's library closed the connection",
                 /*lost=*/c.tls_err.empty());
          return true;
        }
        if (got == 0) break;
        continue;
      }
      std::memcpy(&c.f, c.buf.data() + c.beg, sizeof(Frame));
      c.beg += sizeof(Frame);
      c.rx = Conn::Rx::kStart;
      did = true;
      if (const Status st = check_frame(c.f); !st.is_ok()) {  // a broken peer: a lost connection
        cork.release();
        ::shutdown(c.fd.get(), SHUT_RDWR);
        broken(c, qp, st.message().c_str());
        return true;
      }
      if (c.f.type == kRevoke) {  // either way, no data: taken whole here
        peer_revoked(c, qp, r);
        c.rx = Conn::Rx::kHeader;
        continue;
      }
    }
    const bool req = request_dir(c.f.type);
    if (c.rx == Conn::Rx::kStart) {
      Outcome o;
      if (req ? !c.req_in.load(std::memory_order_acquire) || c.f.len > kMaxMsgSize
              : !response_dir(c.f.type) || !c.resp_in.load(std::memory_order_acquire))
        o = broken_peer("the peer sent a malformed frame");
      else if (req && c.f.ack)
        o = ack_riding(qp, r, c.f.ack);
      if (o.kind == Outcome::kGo) o = req ? start_request(c, qp, r) : start_response(c, qp, r);
      if (o.kind == Outcome::kBroken) {  // end it as a lost connection
        cork.release();
        ::shutdown(c.fd.get(), SHUT_RDWR);
        broken(c, qp, o.why);
        return true;
      }
      if (o.kind == Outcome::kFailed) {
        cork.release();
        to_error(qp, o.why);
        c.broken.store(true);
        rearm(c);
        return true;
      }
      c.rx = Conn::Rx::kPayload;
      c.large = !c.discard && c.left >= kDirectReadMin;
    }
    const int got = rx_payload(c);
    if (got < 0) {
      cork.release();
      broken(c, qp, !c.tls_err.empty() ? c.tls_err.c_str() : "the peer's library closed the connection",
             /*lost=*/c.tls_err.empty());
      return true;
    }
    if (got == 0) break;
    if (req) {
      finish_request(c, qp, r);
    } else if (!finish_response(c, qp, r)) {
      cork.release();
      to_error(qp, "a WR failed on the direct path");
      return true;
    }
    c.rx = Conn::Rx::kHeader;
  }
  // One cumulative ACK for what this batch executed.
  if (c.req_in.load(std::memory_order_relaxed) && !defer_ack) send_ack(c);
  return did;
}

}  // namespace vrdma::verbs::dlink
