// Data path of the device model: reads WQEs from the guests' rings, validates each one against
// the backend's own records, moves the bytes with memcpy between the two guests' registered
// memory, and writes completions. No allocation, no locks, no syscalls here, except the write
// that wakes a completion channel and the async-event write on an error.
// The responder side is device_respond.cc.
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <span>

#include "common/log.h"
#include "engine/datapath_util.h"
#include "engine/device.h"
#include "proto/device_caps.h"

namespace vrdma::engine {

using namespace vrdma::proto;

void Device::set_sleeping(bool sleeping) {
  for (auto& [id, s] : sessions_)
    s->control_page()->backend_sleeping.store(sleeping ? 1 : 0, std::memory_order_seq_cst);
}

uint64_t Device::next_deadline() const {
  uint64_t d = 0;
  for (const Guest* g : active_guests_) {
    for (const Qp* qp : g->ready) {
      if ((qp->wait != Wait::kNone || qp->rx_busy_since_ns) && (d == 0 || qp->wait_until_ns < d))
        d = qp->wait_until_ns;
    }
  }
  return d;
}

void Device::mark_ready(Qp& qp) {
  if (qp.ready || !qp.sq_hdr) return;  // an XRC receive QP has no rings to look at
  qp.ready = true;
  qp.guest->ready.push_back(&qp);
}

bool Device::has_work(const Qp& qp) const {
  // Over tcp the transport's frames move a QP (ACKs, replays, back-pressure): always looked at.
  if (qp.remote || qp.route_pending || qp.wait != Wait::kNone || qp.rx_busy_since_ns) return true;
  const uint32_t sprod = qp.sq_hdr->producer.load(std::memory_order_acquire);
  const bool sq_work = sprod != qp.sq_cons && sprod - qp.sq_cons <= qp.sq_size;
  if (qp.state != IBV_QPS_ERR) return sq_open(qp.state) && sprod != qp.sq_cons;
  // ERR: a flush that a full CQ stopped goes on. A receive queue a direct peer fed takes
  // posts without a mark (the library rings nothing then): looked at while in ERR.
  if (sq_work) return true;
  if (qp.srq)  // a receive it held that a full CQ kept from being flushed
    return holds_srq_recv(qp);
  if (qp.rq_hdr->armed.load(std::memory_order_relaxed)) return true;
  const uint32_t rprod = qp.rq_hdr->producer.load(std::memory_order_acquire);
  return rprod != qp.rq_cons && rprod - qp.rq_cons <= qp.rq_size;
}

void Device::harvest_ready() {
  for (auto& [id, sp] : sessions_) {
    Session& s = *sp;
    if (s.qps.empty()) continue;
    if (s.qp_slots.size() != s.qps.size()) {
      // QPs this backend did not create (an import, device_state_import.cc): indexed here, and
      // looked at once, whatever their bits say.
      s.qp_slots.clear();
      for (auto& [h, qp] : s.qps) {
        s.qp_slots.emplace(h % kReadySlots, qp.get());
        mark_ready(*qp);
      }
    }
    ReadyBits& r = *ready_bits(s.control_page());
    if (r.marks.load(std::memory_order_relaxed) != 1) {
      for (auto& [h, qp] : s.qps) mark_ready(*qp);  // a library that does not mark its posts
      continue;
    }
    // seq_cst: when about to sleep, pairs with the post's fence (set_sleeping's comment).
    if (r.summary.load(std::memory_order_seq_cst) == 0) continue;
    for (uint64_t sum = r.summary.exchange(0, std::memory_order_seq_cst); sum; sum &= sum - 1) {
      const uint32_t w = static_cast<uint32_t>(std::countr_zero(sum));
      for (uint64_t bits = r.words[w].exchange(0, std::memory_order_seq_cst); bits;
           bits &= bits - 1) {
        const uint32_t slot = w * 64 + static_cast<uint32_t>(std::countr_zero(bits));
        auto [from, to] = s.qp_slots.equal_range(slot);
        for (auto it = from; it != to; ++it) mark_ready(*it->second);
      }
    }
  }
}

// Keys live in the guest's namespace; the MR must also be in the given PD of the QP's session.
const Mr* Device::find_mr(const Qp& qp, uint32_t key, uint32_t pd) const {
  auto it = qp.guest->mrs.find(key);
  if (it == qp.guest->mrs.end()) return nullptr;
  const Mr* mr = it->second;
  return mr->pd == pd && mr->owner == mem_session(qp) ? mr : nullptr;
}

bool Device::resolve_sges(const Qp& qp, const Sge* sge, uint32_t n, uint32_t need_access,
                          std::vector<Span>& out, uint64_t& total, uint32_t pd) const {
  if (pd == proto::kNone) pd = mem_pd(qp);
  total = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const Sge s = sge[i];
    if (s.length == 0) continue;
    const Mr* mr = find_mr(qp, s.lkey, pd);
    if (!mr || (mr->access & need_access) != need_access) return false;
    if (s.addr < mr->addr || s.length > mr->length || s.addr - mr->addr > mr->length - s.length)
      return false;
    // ODP: the library faulted the SGE's pages in before it posted; pages still missing are
    // ones it could not reach (unmapped, or without the access): a protection error.
    if (!odp_covers(*mr, s.addr - mr->addr, s.length)) return false;
    // An SGE may cross segment boundaries: one span per chunk it touches.
    append_spans(*mr, s.addr - mr->addr, s.length, out);
    total += s.length;
  }
  return true;
}

bool Device::push_cqe(Cq& cq, const Cqe& e, bool solicited) {
  // A completion in error counts as solicited (ibv_req_notify_cq(3)): it fires either arm.
  solicited = solicited || e.status != IBV_WC_SUCCESS;
  // A QP's own ring (direct path) has a second producer, the peer's library, which only writes
  // while this side does not: take up where it left off. A bad value only fails the check below.
  if (cq.shared_producer) cq.prod = cq.hdr->producer.load(std::memory_order_acquire);
  const uint32_t cons = cq.hdr->consumer.load(std::memory_order_acquire);
  if (cq.prod - cons >= cq.size) {
    // Full, or the guest wrote a consumer index that is not between ours and ours - size.
    if (!cq.overrun) {
      VLOG_ERROR("guest {} session {}: CQ {} overrun; completions are being lost",
                 cq.owner->guest->name, cq.owner->id, cq.handle);
      cq.overrun = true;
      post_async(*cq.owner, IBV_EVENT_CQ_ERR, cq.handle);
    }
    return false;
  }
  put_cqe(cq, e);
  if (cq.shared_producer) {
    // A QP's own ring stands for its CQ (same handle): the CQ's `armed` word and channel.
    auto of = cq.owner->cqs.find(cq.handle);
    if (of != cq.owner->cqs.end()) notify(*of->second, solicited);
    return true;
  }
  notify(cq, solicited);
  return true;
}

void Device::put_cqe(Cq& cq, const Cqe& e) {
  cq.entries[cq.prod & (cq.size - 1)] = e;
  if (cq.stamp) stamp_now(cq.stamp[cq.prod & (cq.size - 1)], cq.stamps);
  cq.prod++;
  cq.hdr->producer.store(cq.prod, std::memory_order_release);
}

void Device::notify(Cq& cq, bool solicited) {
  if (cq.channel == kNone) return;  // nobody to notify
  // The arm taken back is noted until its event is written (proto::fire_armed): killed between
  // the two, this backend left a disarmed CQ with a completion and no event (keep_state's stream
  // slept for ever beside it: `lost event` in e2e.keep_state under ASan, one CI run).
  proto::fire_armed(*cq.hdr, solicited, [&] {
    auto ch = cq.owner->channels.find(cq.channel);
    if (ch == cq.owner->channels.end()) return;
    uint32_t h = cq.handle;
    if (::write(ch->second.write_end.get(), &h, sizeof(h)) != sizeof(h))
      VLOG_WARN("guest {} session {}: completion channel {} full", cq.owner->guest->name,
                cq.owner->id, cq.channel);
  });
}

// Retires the WQE at the head of the SQ. The slot is released before the completion is
// published: a guest that sees the completion may post into that slot at once (a QP with a
// send queue of one, as perftest's latency tests make, does exactly that).
void Device::publish_psns(Qp& qp) {
  if (!qp.sq_hdr) return;  // an XRC receive QP has no rings (its PSN moves in the blob only)
  publish_backend_psns(qp, publish_psn_at(qp));
}

void Device::publish_backend_psns(Qp& qp, uint32_t sq_psn) {
  qp.sq_hdr->backend_psn.store(sq_psn, std::memory_order_relaxed);
  qp.rq_hdr->backend_psn.store(qp.expected_psn, std::memory_order_relaxed);
}

uint32_t Device::publish_psn_at(Qp& qp) {
  const uint32_t at_cons = (qp.unacked.empty() ? qp.next_psn : qp.unacked.front().psn) & 0xffffff;
  qp.sq_hdr->psn_at.store(uint64_t{qp.sq_cons} << 32 | kPsnAtValid | at_cons,
                          std::memory_order_release);
  return at_cons;
}

void Device::complete_send(Qp& qp, const SendWqe& w, ibv_wc_status st, uint32_t len) {
  qp.sq_cons++;
  // The new index's PSN before the index, backend_psn after it (RingHeader::psn_at).
  const uint32_t at_cons = qp.remote ? publish_psn_at(qp) : 0;
  if (killed_at(KillPoint::kSendPsnPublished)) return;
  qp.sq_hdr->consumer.store(qp.sq_cons, std::memory_order_release);
  if (qp.remote) publish_backend_psns(qp, at_cons);
  if (st != IBV_WC_SUCCESS) qp.cnt.wc_errors[st]++;
  const bool signaled = qp.sq_sig_all || (w.send_flags & IBV_SEND_SIGNALED);
  if (st == IBV_WC_SUCCESS && !signaled) {
    qp.sq_hdr->retired.store(qp.sq_cons, std::memory_order_release);
    return;
  }
  Cqe e{};
  e.wr_id = w.wr_id;
  e.status = st;
  switch (w.opcode) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM: e.opcode = IBV_WC_RDMA_WRITE; break;
    case IBV_WR_RDMA_READ: e.opcode = IBV_WC_RDMA_READ; break;
    case IBV_WR_ATOMIC_CMP_AND_SWP: e.opcode = IBV_WC_COMP_SWAP; break;
    case IBV_WR_ATOMIC_FETCH_AND_ADD: e.opcode = IBV_WC_FETCH_ADD; break;
    case IBV_WR_BIND_MW:
      e.opcode = IBV_WC_BIND_MW;
      break;
    case IBV_WR_LOCAL_INV:
      e.opcode = IBV_WC_LOCAL_INV;
      break;
    default: e.opcode = IBV_WC_SEND; break;
  }
  e.byte_len = len;
  e.qp_num = qp.qpn;
  push_cqe(send_ring(qp), e, false);
  qp.sq_hdr->retired.store(qp.sq_cons, std::memory_order_release);
}

void Device::enter_error(Qp& qp, const char* why) {
  if (qp.state == IBV_QPS_ERR) return;
  VLOG_INFO("qp {:#x} (guest {}) -> ERR: {}", qp.qpn, qp.guest->name, why);
  take_back(qp);
  qp.state = IBV_QPS_ERR;
  qp.attr.qp_state = IBV_QPS_ERR;
  qp.wait = Wait::kNone;
  qp.rx_busy_since_ns = 0;
  mark_ready(qp);  // its queues are flushed
  bump_epoch(*qp.guest);
}

Guest* Device::guest_by_gid(const uint8_t gid[16]) {
  // GID 0 of a guest is fe80::/64 + its port GUID.
  for (auto& [lid, cand] : guests_by_lid_) {
    if (std::memcmp(cand->gid, gid, 16) == 0) return cand;
  }
  return nullptr;
}

bool Device::accepts_from(const Qp& to, ibv_qp_type type, uint32_t src_qpn, uint16_t slid,
                          const uint8_t sgid[16]) {
  // A connected QP accepts traffic only from the QP it is connected to (an XRC receive QP from
  // its XRC send QP).
  const ibv_qp_type want = type == IBV_QPT_XRC_SEND ? IBV_QPT_XRC_RECV : type;
  if (to.type != want || to.attr.dest_qp_num != src_qpn) return false;
  if (!to.attr.is_global) return to.attr.dlid == slid;
  return std::memcmp(to.attr.dgid, sgid, 16) == 0;
}

Qp* Device::lookup_remote(const Qp& from) {
  Guest* g = nullptr;
  if (from.attr.is_global) {
    g = guest_by_gid(from.attr.dgid);
  } else {
    auto it = guests_by_lid_.find(from.attr.dlid);
    if (it != guests_by_lid_.end()) g = it->second;
  }
  if (!g) return nullptr;
  auto it = g->qps.find(from.attr.dest_qp_num);
  if (it == g->qps.end()) return nullptr;
  Qp* to = it->second;
  return accepts_from(*to, from.type, from.qpn, from.guest->lid, from.guest->gid) ? to : nullptr;
}

Qp* Device::local_responder(const Qp& from) {
  Qp* to = lookup_remote(from);
  if (!to) return nullptr;
  // It must have chosen this backend for its peer: a QP whose peer lives on another node hears
  // only that node's connection, never a local guest that took the peer's LID or GID.
  if (to->route_pending) choose_route(*to);
  return to->remote || to->route_pending ? nullptr : to;
}

ibv_wc_status Device::execute_mw_op(Qp& qp, const SendWqe& w, const char*& why) {
  Session& s = *qp.owner;
  if (w.opcode == IBV_WR_LOCAL_INV) {
    RemoteMwView v;
    Mw* mw = rkey_mw(qp, w.rkey, v);
    const ibv_wc_status st = check_invalidate(v, IBV_WC_LOC_QP_OP_ERR, &why);
    if (st == IBV_WC_SUCCESS) mw->bound = false;
    return st;
  }
  MwBindView b;
  auto it = s.mws.find(w.ud_remote_qpn);
  Mw* mw = it == s.mws.end() ? nullptr : it->second.get();
  if (mw) {
    b.mw_found = true;
    b.mw_type = mw->type;
    b.mw_bound = mw->bound;
    b.mw_same_pd = mw->pd == qp.pd;
    b.old_rkey = mw->rkey;
  }
  b.new_rkey = w.rkey;
  b.addr = w.remote_addr;
  b.length = w.compare_add;
  b.access = bind_access(w);
  const Mr* mr = nullptr;
  if (auto m = qp.guest->mrs.find(bind_lkey(w));
      m != qp.guest->mrs.end() && m->second->owner == &s) {
    mr = m->second;
    b.mr_found = true;
    b.mr_same_pd = mw && mr->pd == mw->pd;
    b.mr_access = mr->access;
    b.mr_iova = mr->iova;
    b.mr_length = mr->length;
  }
  if (const ibv_wc_status st = check_bind_mw(qp.attr.qp_access_flags, b, &why);
      st != IBV_WC_SUCCESS)
    return st;
  // The index stays; the key is the bind's (ibv_inc_rkey of the last one, from the library
  // for type 1, from the consumer for type 2).
  mw->rkey = (mw->rkey & ~0xffu) | (w.rkey & 0xffu);
  mw->bound = b.length != 0 || mw->type == IBV_MW_TYPE_2;
  mw->mr = mw->bound ? mr->handle : 0;
  mw->qpn = qp.qpn;
  mw->access = b.access;
  mw->addr = b.addr;
  mw->length = b.length;
  return IBV_WC_SUCCESS;
}

void Device::append_spans(const Mr& mr, uint64_t off, uint64_t len, std::vector<Span>& out) {
  for (const MrChunk& c : mr.chunks) {
    if (len == 0) break;
    if (off >= c.mr_offset + c.length) continue;
    uint64_t in = off - c.mr_offset;
    uint64_t take = std::min(len, c.length - in);
    out.push_back({c.base + in, take});
    off += take;
    len -= take;
  }
}

ibv_wc_status Device::gather(const Qp& qp, const SendWqe& w, uint8_t* inline_copy,
                             uint64_t& len, const char*& why) {
  if (w.send_flags & IBV_SEND_INLINE) {
    // Inline bytes are copied out of the ring first: the guest may rewrite them at any time.
    if (w.inline_len > qp.caps.max_inline_data) {
      why = "inline too long";
      return IBV_WC_LOC_LEN_ERR;
    }
    std::memcpy(inline_copy, w.inline_data, w.inline_len);
    if (w.inline_len) src_.push_back({inline_copy, w.inline_len});
    len = w.inline_len;
    return IBV_WC_SUCCESS;
  }
  if (w.num_sge > qp.caps.max_send_sge) {
    why = "too many SGEs";
    return IBV_WC_LOC_LEN_ERR;
  }
  if (!resolve_sges(qp, w.sge, w.num_sge, 0, src_, len)) {
    why = "SGE outside a valid MR";
    return IBV_WC_LOC_PROT_ERR;
  }
  return IBV_WC_SUCCESS;
}

bool Device::execute_ud(Qp& qp, const SendWqe& w) {
  if (w.opcode != IBV_WR_SEND && w.opcode != IBV_WR_SEND_WITH_IMM) {
    complete_send(qp, w, IBV_WC_LOC_QP_OP_ERR, 0);
    enter_error(qp, "UD sends only SEND and SEND_WITH_IMM");
    return true;
  }
  src_.clear();
  dst_.clear();
  uint64_t len = 0;
  uint8_t inline_copy[kMaxInline];
  const char* why = "";
  if (const ibv_wc_status st = gather(qp, w, inline_copy, len, why); st != IBV_WC_SUCCESS) {
    complete_send(qp, w, st, 0);
    enter_error(qp, why);
    return true;
  }
  // A datagram fits in one packet: the port's MTU.
  if (len > kUdMaxMessage) {
    complete_send(qp, w, IBV_WC_LOC_LEN_ERR, 0);
    enter_error(qp, "UD message longer than the MTU");
    return true;
  }
  const UdDest dest = unpack_ud_dest(w);
  if (is_mcast(dest)) {
    send_mcast(qp, w, dest, len);
    return true;
  }
  Guest* g = nullptr;
  if (dest.is_global) {
    g = guest_by_gid(dest.dgid);
  } else if (auto it = guests_by_lid_.find(dest.dlid); it != guests_by_lid_.end()) {
    g = it->second;
  }
  // A guest of another backend (or any guest, when TCP is forced): the datagram goes there.
  if (transport_ && (!g || transport_->forced())) {
    std::string node = g ? transport_->self()
                         : dest.is_global ? transport_->locate_gid(dest.dgid)
                                          : transport_->locate_lid(dest.dlid);
    if (!node.empty()) {
      send_ud_remote(qp, w, node, len);
      return true;
    }
  }
  Qp* to = nullptr;
  if (g) {
    auto it = g->qps.find(w.ud_remote_qpn);
    if (it != g->qps.end() && it->second->type == IBV_QPT_UD && rq_open(it->second->state))
      to = it->second;
  }
  // The high bit of the WR's qkey says "use the QP's own qkey" (IB spec 10.2.5).
  const uint32_t qkey = (w.ud_remote_qkey & 0x80000000u) ? qp.attr.qkey : w.ud_remote_qkey;
  // Sent, whatever happens to it; lost without a QP of that qkey there.
  auto sent = [&] {
    complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));
    qp.cnt.msgs_sent++;
    qp.cnt.bytes_sent += len;
  };
  if (!to || to->attr.qkey != qkey) {
    sent();
    qp.cnt.ud_dropped++;
    return true;
  }
  // keep_state: the dead backend delivered this WQE and died before retiring it.
  if (to->replay_known && replayed_delivery(qp, *to, w, len)) return true;
  Inbound in = inbound_of(qp, w, len);
  deliver_ud(*to, in, dest.is_global, qp.guest->gid, src_, dest.sl, qp.sq_cons);
  if (killed_at(KillPoint::kReceiveCompleted)) return false;
  sent();
  commit_done(*to);
  return true;
}

Step Device::execute(Qp& qp, const SendWqe& w, uint64_t now_ns) {
  auto fail = [&](ibv_wc_status st, const char* why) {
    complete_send(qp, w, st, 0);
    enter_error(qp, why);
    return Step::kDone;
  };
  if (qp.type == IBV_QPT_UD) return execute_ud(qp, w) ? Step::kDone : Step::kWait;
  // Binds and local invalidations touch no peer (a QP type that may not post them fails
  // in local_side, as any other opcode).
  if (proto::is_local_mw_op(w.opcode) && proto::opcode_allowed(qp.type, w.opcode)) {
    const char* why = "";
    if (const ibv_wc_status st = execute_mw_op(qp, w, why); st != IBV_WC_SUCCESS)
      return fail(st, why);
    complete_send(qp, w, IBV_WC_SUCCESS, 0);
    return Step::kDone;
  }
  src_.clear();
  dst_.clear();
  uint64_t len = 0;
  uint8_t inline_copy[kMaxInline];
  if (!local_side(qp, w, inline_copy, len)) return Step::kDone;

  Qp* to = local_responder(qp);
  if (!to || !rq_open(to->state)) {
    if (qp.type == IBV_QPT_UC) {  // unreliable: the message is silently lost
      complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));
      return Step::kDone;
    }
    // RC: no ACK comes back; the requester retries after its local ACK timeout, retry_cnt times.
    if (qp.wait != Wait::kAck) {
      qp.wait = Wait::kAck;
      qp.retry_left = qp.attr.retry_cnt;
    } else if (qp.retry_left == 0) {
      return fail(IBV_WC_RETRY_EXC_ERR, "transport retries exhausted");
    } else {
      --qp.retry_left;
    }
    qp.cnt.retries++;
    qp.wait_until_ns = now_ns + ack_timeout_ns(qp.attr.timeout);
    return Step::kWait;
  }

  if (to->replay_known && replayed_delivery(qp, *to, w, len)) return Step::kDone;
  // An SRQ that libraries feed too (direct path): one consumer at a time, until the message is
  // in (RxHold gives it back on every return).
  RxHold rx(*this, *to);
  if (!rx.held && srq_busy(qp, now_ns)) return Step::kWait;
  if (rx.held) qp.rx_busy_since_ns = 0;
  const Inbound in = inbound_of(qp, w, len);
  const Response r = rx.held ? respond_begin(*to, in) : Response{.kind = Response::kRnr};
  switch (r.kind) {
    case Response::kDrop: return Step::kWait;
    case Response::kRnr:
      if (qp.type == IBV_QPT_UC) {
        complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));
        return Step::kDone;
      }
      if (!rnr_wait(qp, to->attr.min_rnr_timer, now_ns, qp.wait != Wait::kRnr))
        return fail(IBV_WC_RNR_RETRY_EXC_ERR, "RNR retries exhausted");
      return Step::kWait;
    case Response::kError:
      qp.wait = Wait::kNone;
      // UC: no NAK, so the requester never hears of it (IB spec class D/E errors; as across
      // backends): the message is lost, and a receive it failed completed in error there.
      if (qp.type == IBV_QPT_UC) {
        complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));
        return Step::kDone;
      }
      return fail(r.status, r.why);
    case Response::kOk: break;
  }
  qp.wait = Wait::kNone;
  uintptr_t fault = 0;
  bool copied;
  std::span<const Span> theirs;  ///< the responder's side of the copy
  if (is_atomic(w.opcode)) {
    const Span result{reinterpret_cast<uint8_t*>(const_cast<uint64_t*>(&r.atomic_old)), 8};
    copied = guarded_copy({&result, 1}, dst_, 8, fault);
  } else {
    // SEND/WRITE: our gathered source into the responder's memory; READ: the other way.
    copied = guarded_copy(src_, dst_, len, fault);
    theirs = w.opcode == IBV_WR_RDMA_READ ? std::span<const Span>(src_) : dst_;
  }
  if (!copied) {
    // The requester's memory faulted: its WQE fails as with a bad local buffer. The
    // responder's: the responder's QP fails too (its memory is broken), and the requester sees
    // a remote access error.
    const bool remote = in_spans(theirs, fault);
    const Qp& owner = remote ? *to : qp;
    VLOG_WARN(
        "guest {} QP {:#x}: memory at {:#x} faulted (SIGBUS/SIGSEGV) while guest {} QP "
        "{:#x} moved a message; the message fails",
        owner.guest->name, owner.qpn, fault, qp.guest->name, qp.qpn);
    if (!remote) return fail(IBV_WC_LOC_PROT_ERR, "its memory faulted");
    enter_error(*to, "its memory faulted");
    post_async(*to->owner, IBV_EVENT_QP_FATAL, to->handle);
    return fail(IBV_WC_REM_ACCESS_ERR, "the responder's memory faulted");
  }
  // The responder's record names the WQE by our SQ index: a restart between its completion
  // and our retirement knows the WQE was delivered (recover_receive, replayed_delivery).
  respond_finish(*to, in, r.recv, kCommitLocal, qp.sq_cons);
  if (killed_at(KillPoint::kReceiveCompleted)) return Step::kWait;
  qp.cnt.msgs_sent++;
  qp.cnt.bytes_sent += len;
  complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));
  commit_done(*to);
  return Step::kDone;
}

bool Device::srq_busy(Qp& qp, uint64_t now_ns) {
  // A library is taking a receive from the responder's SRQ right now: not the responder's RNR.
  // The head WQE is tried again shortly (a deadline, which keeps the engine from sleeping on
  // it: next_deadline, has_work) and its RNR state is left alone. A lock held for long (a guest
  // that never gives it back) is an RNR NAK, as from a responder that posts no receive.
  constexpr uint64_t kRetryNs = 20'000, kMomentNs = 100'000'000;
  if (qp.rx_busy_since_ns == 0) qp.rx_busy_since_ns = now_ns;
  if (now_ns - qp.rx_busy_since_ns >= kMomentNs) {
    qp.rx_busy_since_ns = 0;  // one RNR NAK (UC: the message lost) per such hold
    return false;
  }
  qp.wait_until_ns = now_ns + kRetryNs;
  return true;
}

bool Device::replayed_delivery(Qp& qp, Qp& to, const SendWqe& w, uint64_t len) {
  // UD: another sender's datagram leaves the record for the one it names.
  if (to.replay_ud && to.replay_qpn != qp.qpn) return false;
  to.replay_known = false;
  if (to.replay_sq != qp.sq_cons) return false;
  // A backend that died delivered this WQE and did not retire it: retired now, not again.
  VLOG_INFO("qp {:#x} (guest {}): WQE {} was delivered before the restart; completed", qp.qpn,
            qp.guest->name, qp.sq_cons);
  qp.cnt.msgs_sent++;
  qp.cnt.bytes_sent += len;
  complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));
  commit_done(to);
  return true;
}

ibv_wc_status Device::local_check(const Qp& qp, const SendWqe& w, uint8_t* inline_copy,
                                  uint64_t& len, const char*& why) {
  const uint32_t op = w.opcode;
  // The library checked the post rules (proto/post_rules.h); a guest that writes the ring
  // itself gets them here, as a completion.
  if (!proto::opcode_allowed(qp.type, op)) {
    why = "opcode not valid here";
    return IBV_WC_LOC_QP_OP_ERR;
  }
  // SEND/WRITE: the source (gather). READ/atomics: the destination, which needs local write.
  if (op != IBV_WR_RDMA_READ && !is_atomic(op)) {
    if (auto st = gather(qp, w, inline_copy, len, why); st != IBV_WC_SUCCESS) return st;
  } else {
    if (w.num_sge > qp.caps.max_send_sge) {
      why = "too many SGEs";
      return IBV_WC_LOC_LEN_ERR;
    }
    if (!resolve_sges(qp, w.sge, w.num_sge, IBV_ACCESS_LOCAL_WRITE, dst_, len)) {
      why = "SGE outside a valid MR";
      return IBV_WC_LOC_PROT_ERR;
    }
  }
  return proto::check_send_length(op, len, &why);
}

bool Device::local_side(Qp& qp, const SendWqe& w, uint8_t* inline_copy, uint64_t& len) {
  const char* why = "";
  const ibv_wc_status st = local_check(qp, w, inline_copy, len, why);
  if (st == IBV_WC_SUCCESS) return true;
  complete_send(qp, w, st, 0);
  enter_error(qp, why);
  return false;
}

Inbound Device::inbound_of(const Qp& qp, const SendWqe& w, uint64_t len) {
  Inbound in;
  in.op = w.opcode;
  in.send_flags = w.send_flags;
  in.imm_data = w.imm_data;
  in.rkey = w.rkey;
  in.remote_addr = w.remote_addr;
  in.compare_add = w.compare_add;
  in.swap = w.swap;
  in.len = len;
  in.src_qpn = qp.qpn;
  in.slid = qp.guest->lid;
  in.type = qp.type;
  if (qp.type == IBV_QPT_XRC_SEND) in.xrc_srqn = w.ud_remote_qkey & 0xffffff;
  return in;
}

bool Device::flush(Qp& qp) {
  bool did = false;
  const uint32_t sprod = qp.sq_hdr->producer.load(std::memory_order_acquire);
  if (sprod - qp.sq_cons <= qp.sq_size) {
    while (qp.sq_cons != sprod) {
      const SendWqe& w = qp.sq[qp.sq_cons & (qp.sq_size - 1)];
      Cqe e{};
      e.wr_id = w.wr_id;
      e.status = IBV_WC_WR_FLUSH_ERR;
      e.opcode = IBV_WC_SEND;
      e.qp_num = qp.qpn;
      if (!push_cqe(send_ring(qp), e, false)) break;
      qp.cnt.wc_errors[IBV_WC_WR_FLUSH_ERR]++;
      qp.sq_cons++;
      did = true;
    }
    qp.sq_hdr->consumer.store(qp.sq_cons, std::memory_order_release);
    qp.sq_hdr->retired.store(qp.sq_cons, std::memory_order_release);
  }
  // What was in flight to a peer backend is flushed with the rest.
  qp.unacked.clear();
  qp.sq_sent = qp.sq_cons;
  // Receives posted to an SRQ belong to the SRQ, not to this QP: they stay for the others; but
  // one the QP took for a message that never landed (take_recv) is its own and is flushed.
  if (holds_srq_recv(qp)) {
    Cqe e{};
    e.wr_id = qp.rq[0].wr_id;
    e.status = IBV_WC_WR_FLUSH_ERR;
    e.opcode = IBV_WC_RECV;
    e.qp_num = qp.qpn;
    if (push_cqe(recv_ring(qp), e, false)) {
      qp.cnt.wc_errors[IBV_WC_WR_FLUSH_ERR]++;
      qp.rq_hdr->srq_taken.store(0, std::memory_order_release);
      did = true;
    }
  }
  const uint32_t rprod = qp.rq_hdr->producer.load(std::memory_order_acquire);
  // A UD RQ that direct senders feed: only while none delivers (else on a later turn).
  const bool rx_held = !qp.srq && rx_lock_take(qp);
  if (qp.own_recv && rx_held) qp.rq_cons = qp.rq_hdr->consumer.load(std::memory_order_acquire);
  if (rx_held && rprod - qp.rq_cons <= qp.rq_size) {
    while (qp.rq_cons != rprod) {
      Cqe e{};
      e.wr_id = qp.rq[qp.rq_cons & (qp.rq_size - 1)].wr_id;
      e.status = IBV_WC_WR_FLUSH_ERR;
      e.opcode = IBV_WC_RECV;
      e.qp_num = qp.qpn;
      if (!push_cqe(recv_ring(qp), e, false)) break;
      qp.cnt.wc_errors[IBV_WC_WR_FLUSH_ERR]++;
      qp.rq_cons++;
      did = true;
    }
    qp.rq_hdr->consumer.store(qp.rq_cons, std::memory_order_release);
  }
  if (rx_held) rx_lock_give(qp);
  return did;
}

bool Device::process_sq(Qp& qp, uint64_t now_ns, uint32_t& budget) {
  // Leaving the direct path across backends: what the library posted since then waits until all
  // it executed itself is settled (nothing in flight between the libraries); what the backend
  // has in flight goes on (its ACKs, retries).
  const bool hold_new = (qp.direct_remote || qp.offered) && revoke_holds(qp);
  if (qp.route_pending) choose_route(qp);
  if (qp.remote) return process_sq_remote(qp, now_ns, hold_new);
  if (hold_new) return false;
  const bool waits = qp.wait != Wait::kNone || qp.rx_busy_since_ns;  // srq_busy's too
  if (waits && now_ns < qp.wait_until_ns) return false;
  const uint32_t prod = qp.sq_hdr->producer.load(std::memory_order_acquire);
  if (prod - qp.sq_cons > qp.sq_size) {
    enter_error(qp, "send queue indices corrupt");
    post_async(*qp.owner, IBV_EVENT_QP_FATAL, qp.handle);
    return true;
  }
  bool did = false;
  for (; qp.sq_cons != prod && budget; --budget) {
    // Copy the WQE out of shared memory first: the guest may rewrite the slot at any time.
    const SendWqe w = qp.sq[qp.sq_cons & (qp.sq_size - 1)];
    if (execute(qp, w, now_ns) == Step::kWait) break;  // kDone: complete_send retired it
    did = true;
    if (qp.state == IBV_QPS_ERR) break;
  }
  return did;
}

// Fair across guests, not QPs: every guest with QPs gets one turn of at most kGuestBudget
// WQEs per pass, however many busy QPs it has, and the guest that goes first rotates. Inside a
// guest its QPs take turns the same way, so one busy QP cannot starve its siblings either.
// (QPs on the TCP transport are driven by process_sq_remote, outside this budget.)
// Only QPs that may have work are visited (Guest::ready): a pass costs O(QPs with work), not
// O(QPs), so thousands of idle QPs cost nothing between two commands.
bool Device::poll(uint64_t now_ns) {
  if (killed_) return false;
  now_ns_ = now_ns;
  bool did = false;
  const size_t n = active_guests_.size();
  if (n == 0) return false;
  harvest_ready();
  const size_t first = guest_turn_++ % n;
  for (size_t k = 0; k < n; ++k) did |= poll_guest(*active_guests_[(first + k) % n], now_ns);
  return did;
}

bool Device::poll_guest(Guest& g, uint64_t now_ns) {
  constexpr uint32_t kGuestBudget = 64;
  uint32_t budget = kGuestBudget;
  bool did = false;
  const size_t n = g.ready.size();
  if (n == 0) return false;
  const size_t first = g.turn % n;
  size_t visited = 0;
  // Indexed, not iterated: a responder's failure may append to this list (enter_error).
  for (; visited < n && budget; ++visited) {
    Qp& qp = *g.ready[(first + visited) % n];
    if (qp.srq && qp.srq->direct) tend_fed_srq(qp);
    if (qp.state == IBV_QPS_ERR) {
      did |= flush(qp);  // bounded by the ring's size; completions nobody reaps stop it early
    } else if (sq_open(qp.state)) {
      did |= process_sq(qp, now_ns, budget);
    }
  }
  g.turn = first + visited;
  // The QPs visited and left without work leave the list, in order; a post marks them again.
  size_t out = 0;
  for (size_t i = 0; i < g.ready.size(); ++i) {
    Qp* qp = g.ready[i];
    const bool seen = i < n && (i + n - first) % n < visited;
    if (seen && !has_work(*qp)) {
      qp->ready = false;
    } else {
      g.ready[out++] = qp;
    }
  }
  g.ready.resize(out);
  return did;
}

}  // namespace vrdma::engine
