// The responder of the device model: what a request may touch (rkeys, windows, receive WQEs),
// the NAK or completion of each fault, and UD delivery. One responder for every requester: the
// same host (device_datapath.cc) and other backends (device_remote_respond.cc). Data path: no
// allocation, no locks, no syscalls here except the write that wakes a completion channel.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <span>

#include "common/log.h"
#include "engine/device.h"
#include "engine/datapath_util.h"
#include "proto/device_caps.h"

namespace vrdma::engine {

using namespace vrdma::proto;

namespace {

/// What a zero-length WRITE or READ reaches: no chunk, no segment.
const Mr kNoMemory{};

/// Whether [off, off + len) of the MR lies in one chunk, i.e. in one mapping.
bool in_one_chunk(const Mr& mr, uint64_t off, uint64_t len) {
  for (const MrChunk& c : mr.chunks) {
    if (off >= c.mr_offset && off - c.mr_offset < c.length)
      return len <= c.length - (off - c.mr_offset);
  }
  return false;
}

/// The backend address of byte `off` of the MR (which lies in one of its chunks), as a number.
uintptr_t host_address(const Mr& mr, uint64_t off) {
  for (const MrChunk& c : mr.chunks) {
    if (off >= c.mr_offset && off - c.mr_offset < c.length)
      return reinterpret_cast<uintptr_t>(c.base) + (off - c.mr_offset);
  }
  return 0;
}

/// A receive completion for a message from the requester `in` names.
Cqe recv_cqe(const Qp& to, uint64_t wr_id, const Inbound& in, uint32_t opcode) {
  Cqe rc{};
  rc.wr_id = wr_id;
  rc.qp_num = to.qpn;
  rc.src_qp = in.src_qpn;
  rc.slid = in.slid;
  rc.opcode = opcode;
  return rc;
}

}  // namespace

const Mr* Device::rkey_mr(const Qp& to, uint32_t rkey) const {
  auto it = to.guest->mrs.find(rkey);
  if (it == to.guest->mrs.end()) return nullptr;
  const Mr* mr = it->second;
  return mr->pd == mem_pd(to) && mr->owner == mem_session(to) ? mr : nullptr;
}

Mw* Device::rkey_mw(const Qp& to, uint32_t rkey, RemoteMwView& v) const {
  v = {};
  auto it = to.guest->mws.find(rkey >> 8);
  // Windows, as MRs, are the session's: another session's is not there for this QP.
  if (it == to.guest->mws.end() || it->second->owner != mem_session(to)) return nullptr;
  Mw* mw = it->second;
  v.found = true;
  v.type = mw->type;
  v.bound = mw->bound;
  v.same_key = mw->rkey == rkey;
  v.same_pd = mw->pd == mem_pd(to);
  v.same_qp = mw->qpn == to.qpn;
  v.access = mw->access;
  v.addr = mw->addr;
  v.length = mw->length;
  return mw;
}

const Mr* Device::rkey_target(const Qp& to, uint32_t rkey, RemoteMrView& view) const {
  if (const Mr* mr = rkey_mr(to, rkey)) {
    view = RemoteMrView{true, mr->access, mr->iova, mr->length};
    return mr;
  }
  RemoteMwView wv;
  const Mw* mw = rkey_mw(to, rkey, wv);
  view = window_view(wv);
  if (!view.found) return nullptr;
  // A bound window's MR stays (dereg_mr and rereg_mr are EBUSY while it is bound).
  auto it = mw->owner->mrs.find(mw->mr);
  if (it == mw->owner->mrs.end()) {
    view = RemoteMrView{};
    return nullptr;
  }
  return it->second.get();
}

bool Device::peek_recv(Qp& to, RecvWqe& out, bool& corrupt) {
  corrupt = false;
  if (holds_srq_recv(to)) {
    out = to.rq[0];  // taken for a message that has not landed yet: that message's
    return true;
  }
  // Direct path: the peer's library consumes this RQ too (never while we do): resume at the
  // guest-visible cursor. A bad one is caught by the `avail` check below.
  // So do libraries an SRQ's (Srq::direct; the caller holds its rx_lock).
  if (to.own_recv && !to.srq) to.rq_cons = to.rq_hdr->consumer.load(std::memory_order_acquire);
  if (to.srq && to.srq->direct)
    to.srq->cons = to.srq->hdr->consumer.load(std::memory_order_acquire);
  RingHeader* hdr = to.srq ? to.srq->hdr : to.rq_hdr;
  const uint32_t cons = to.srq ? to.srq->cons : to.rq_cons;
  const uint32_t size = to.srq ? to.srq->size : to.rq_size;
  const uint32_t avail = hdr->producer.load(std::memory_order_acquire) - cons;
  corrupt = avail > size;
  if (corrupt || avail == 0) return false;
  out = (to.srq ? to.srq->entries : to.rq)[cons & (size - 1)];
  return true;
}

void Device::take_recv(Qp& to, const RecvWqe& r) {
  // (An XRC receive QP has no ring: it takes its receive when the message lands.)
  if (!to.srq || !to.rq_hdr || holds_srq_recv(to)) return;
  hold_srq_wqe(*to.rq_hdr, to.rq[0], r, to.srq->cons);
  srq_consume(*to.srq);
}

void Device::srq_consume(Srq& q) {
  q.cons++;
  q.hdr->consumer.store(q.cons, std::memory_order_release);
  srq_limit_check(q, q.cons);
}

void Device::tend_fed_srq(Qp& qp) {
  // A library that took the receive crossing the armed limit, or that found the lock held past
  // its spins, marks the QP: the event, and a lock left by a process that died (rx_lock_try
  // takes an orphan's).
  Srq& q = *qp.srq;
  if (q.limit) srq_limit_check(q, q.hdr->consumer.load(std::memory_order_acquire));
  if (q.hdr->rx_lock.load(std::memory_order_relaxed) != 0) RxHold rx(*this, qp);
}

void Device::srq_limit_check(Srq& q, uint32_t cons) {
  // The SRQ limit event fires once when the posted WQEs drop below the armed limit.
  if (q.limit && q.hdr->producer.load(std::memory_order_acquire) - cons < q.limit) {
    // Libraries may take receives past it again (we hold its rx_lock if they feed it).
    q.limit = 0;
    q.hdr->srq_limit.store(0, std::memory_order_release);
    post_async(*q.owner, IBV_EVENT_SRQ_LIMIT_REACHED, q.handle);
  }
}

void Device::consume_recv(Qp& to) {
  if (holds_srq_recv(to)) {
    // The receive the QP held is used (for a message, keep_state's commit).
    to.rq_hdr->srq_taken.store(0, std::memory_order_release);
  } else if (to.srq) {
    srq_consume(*to.srq);
  } else {
    to.rq_cons++;
    to.rq_hdr->consumer.store(to.rq_cons, std::memory_order_release);
  }
}

bool Device::resolve_recv(const Qp& to, const RecvWqe& r, uint64_t& cap) {
  const uint32_t max_sge = to.srq ? to.srq->max_sge : to.caps.max_recv_sge;
  if (r.num_sge > max_sge) return false;
  // An SRQ's buffers are in the SRQ's PD, which may differ from the QP's.
  return resolve_sges(to, r.sge, r.num_sge, IBV_ACCESS_LOCAL_WRITE, dst_, cap,
                      to.srq ? to.srq->pd : to.pd);
}

void Device::deliver_ud(Qp& to, const Inbound& in, bool global, const uint8_t sgid[16],
                        std::span<const Span> src, uint8_t sl, std::optional<uint32_t> local_sq) {
  // Direct senders deliver into this receive side too (kDirectGrantUd): one at a time.
  if (!rx_lock_take(to)) {
    to.cnt.ud_dropped++;
    return;
  }
  deliver_ud_held(to, in, global, sgid, src, sl, local_sq);
  rx_lock_give(to);
}

void Device::deliver_ud_held(Qp& to, const Inbound& in, bool global, const uint8_t sgid[16],
                             std::span<const Span> src, uint8_t sl,
                             std::optional<uint32_t> local_sq) {
  const uint64_t len = in.len;
  dst_.clear();
  RecvWqe r;
  bool corrupt = false;
  if (!peek_recv(to, r, corrupt)) {
    if (corrupt) {
      enter_error(to, "receive queue indices corrupt");
      post_async(*to.owner, IBV_EVENT_QP_FATAL, to.handle);
    }
    to.cnt.ud_dropped++;  // no receive posted: a datagram is simply lost
    return;
  }
  Cqe rc = recv_cqe(to, r.wr_id, in, IBV_WC_RECV);
  rc.sl = sl;
  uint64_t cap = 0;
  if (!resolve_recv(to, r, cap)) {
    consume_recv(to);
    rc.status = IBV_WC_LOC_PROT_ERR;
    push_cqe(recv_ring(to), rc, false);
    to.cnt.wc_errors[rc.status]++;
    enter_error(to, "receive SGE outside a valid MR");
    return;
  }
  if (cap < kGrhBytes + len) {
    consume_recv(to);
    rc.status = IBV_WC_LOC_LEN_ERR;
    push_cqe(recv_ring(to), rc, false);
    to.cnt.wc_errors[rc.status]++;
    return;
  }
  // The first 40 bytes of the receive buffer are the GRH: written when the sender used one
  // (IPv6 header: version 6, next header 0x1b, hop limit, source and destination GIDs).
  uint8_t grh[kGrhBytes] = {};
  if (global) {
    fill_grh(grh, len, sgid, to.guest->gid);
    rc.wc_flags |= IBV_WC_GRH;
  }
  // The receive spans: the GRH's room first, then the payload.
  const Span grh_span{grh, kGrhBytes};
  uintptr_t fault = 0;
  bool copied = !global || guarded_copy({&grh_span, 1}, dst_, kGrhBytes, fault);
  size_t skip = kGrhBytes;
  size_t di = 0;
  while (skip && di < dst_.size()) {
    const size_t n = std::min<uint64_t>(skip, dst_[di].n);
    dst_[di].p += n;
    dst_[di].n -= n;
    skip -= n;
    if (dst_[di].n == 0) ++di;
  }
  if (copied) copied = guarded_copy(src, std::span<const Span>(dst_).subspan(di), len, fault);
  if (!copied) {
    // The sender's memory faulted: the datagram is lost (UD is unreliable), the receive stays
    // posted. The receiver's: its receive fails and its QP with it.
    const bool sender = in_spans(src, fault);
    VLOG_WARN(
        "guest {} QP {:#x}: {} memory at {:#x} faulted (SIGBUS/SIGSEGV) delivering a "
        "datagram; {}",
        to.guest->name, to.qpn, sender ? "the sender's" : "its", fault,
        sender ? "the datagram is lost" : "the receive fails");
    if (sender) {
      to.cnt.ud_dropped++;
      return;
    }
    consume_recv(to);
    rc.status = IBV_WC_LOC_PROT_ERR;
    push_cqe(recv_ring(to), rc, false);
    to.cnt.wc_errors[rc.status]++;
    enter_error(to, "its memory faulted");
    post_async(*to.owner, IBV_EVENT_QP_FATAL, to.handle);
    return;
  }
  rc.status = IBV_WC_SUCCESS;
  rc.byte_len = static_cast<uint32_t>(kGrhBytes + len);
  if (in.op == IBV_WR_SEND_WITH_IMM) {
    rc.wc_flags |= IBV_WC_WITH_IMM;
    rc.imm_data = in.imm_data;
  }
  // As respond_finish does for a SEND: the record first, then the receive taken (the commit),
  // then its completion.
  Cq& ring = recv_ring(to);
  const bool commit = local_sq && to.rq_hdr;
  if (commit) begin_commit(to, ring, rc, kCommitLocal | kCommitUd, *local_sq, in.src_qpn);
  consume_recv(to);
  if (killed_at(KillPoint::kReceiveTaken)) return;
  if (!push_cqe(ring, rc, (in.send_flags & IBV_SEND_SOLICITED) != 0) && commit)
    to.rq_hdr->commit_cq.store(ring.prod, std::memory_order_relaxed);  // lost to an overrun
  to.cnt.msgs_received++;
  to.cnt.bytes_received += len;
}

bool Device::rnr_wait(Qp& qp, uint8_t rnr_timer, uint64_t now_ns, bool fresh) {
  // RNR NAK: retry after the responder's min_rnr_timer, rnr_retry times (proto/responder_rules.h).
  qp.wait = Wait::kRnr;
  qp.cnt.rnr_naks++;
  if (!rnr_may_retry(qp.attr.rnr_retry, fresh, qp.rnr_left)) return false;
  qp.wait_until_ns = now_ns + rnr_delay_ns(rnr_timer);
  return true;
}

Response Device::respond_begin(Qp& to, const Inbound& in) {
  Response out;
  auto nak = [&](ibv_wc_status st, const char* why) {
    out.kind = Response::kError;
    out.status = st;
    out.why = why;
    return out;
  };
  const uint32_t op = in.op;
  // XRC: the request names the SRQ (receives, completions, and the PD whose MRs it reaches);
  // one of another domain, or none, is the requester's invalid request (the IB spec's NAK for
  // an XRCETH that names no SRQ of the target's domain).
  if (to.type == IBV_QPT_XRC_RECV && !bind_xrc_srq(to, in.xrc_srqn))
    return nak(IBV_WC_REM_INV_REQ_ERR, "no XRC SRQ of that number in the target QP's domain");
  // SENDs (with immediate or invalidate too) and WRITE_WITH_IMM consume a receive WQE.
  const bool consumes_recv = is_send(op) || op == IBV_WR_RDMA_WRITE_WITH_IMM;
  if (consumes_recv) {
    bool corrupt = false;
    if (!peek_recv(to, out.recv, corrupt)) {
      if (corrupt) {
        enter_error(to, "receive queue indices corrupt");
        post_async(*to.owner, IBV_EVENT_QP_FATAL, to.handle);
        out.kind = Response::kDrop;
        return out;
      }
      out.kind = Response::kRnr;
      return out;
    }
  }
  // Remote memory for WRITE, READ and atomics: the rkey in the responder's namespace, PD and
  // session, then the rules every executor applies (proto/responder_rules.h). A zero-length
  // WRITE or READ reaches no memory (kNoMemory) whatever its rkey.
  uint64_t mr_off = 0;  // where the request's first byte lies in out.mr
  if (!is_send(op)) {
    RemoteMrView view;
    const Mr* mr = rkey_target(to, in.rkey, view);
    const char* why = nullptr;
    const ibv_wc_status st =
        check_remote_request(op, to.attr.qp_access_flags, in.remote_addr, in.len, view, &why);
    if (st != IBV_WC_SUCCESS) return nak(st, why);
    out.mr = is_atomic(op) || names_remote_memory(in.len) ? mr : &kNoMemory;
    mr_off = mr_iova_of(view, in.remote_addr) - out.mr->iova;
    // ODP: pages the owner's library has not faulted in yet are asked of its pager, and the
    // requester waits as for an RNR NAK; pages the pager cannot reach (or no pager) are memory
    // outside the MR.
    if (const uint64_t len = is_atomic(op) ? 8 : in.len; !odp_covers(*out.mr, mr_off, len)) {
      Session& owner = to.type == IBV_QPT_XRC_RECV && to.srq ? *to.srq->owner : *to.owner;
      if (!odp_page_request(owner, *out.mr, out.mr->iova + mr_off, len))
        return nak(IBV_WC_REM_ACCESS_ERR, "ODP pages the owner cannot fault in");
      out.kind = Response::kRnr;
      return out;
    }
    // A guest can lay out an MR whose extents end mid-word: the 8 bytes would then sit in two
    // mappings, and one CPU atomic on the first would run past its end.
    if (is_atomic(op) && !in_one_chunk(*out.mr, mr_off, 8))
      return nak(IBV_WC_REM_INV_REQ_ERR, "atomic target straddles two segments of the MR");
    // The host address must be aligned as well: an MR whose address and iova differ mod 8
    // (ibv_reg_mr_iova, or extents at odd segment offsets) turns an aligned iova into a
    // misaligned word, and a CPU atomic on it is a split lock (a bus lock per atomic on x86,
    // SIGBUS on arm64). The spec's status for a misaligned atomic, as above.
    if (is_atomic(op) && (host_address(*out.mr, mr_off) & 7))
      return nak(IBV_WC_REM_INV_REQ_ERR, "atomic on a misaligned host address");
  }
  auto recv_error = [&](ibv_wc_status st, const char* why) {
    consume_recv(to);
    Cqe rc = recv_cqe(to, out.recv.wr_id, in, IBV_WC_RECV);
    rc.status = st;
    push_cqe(recv_ring(to), rc, false);
    to.cnt.wc_errors[st]++;
    enter_error(to, why);
  };
  if (is_send(op)) {
    uint64_t cap = 0;
    if (!resolve_recv(to, out.recv, cap)) {
      recv_error(IBV_WC_LOC_PROT_ERR, "receive SGE outside a valid MR");
      return nak(IBV_WC_REM_OP_ERR, "responder protection error");
    }
    if (cap < in.len) {
      recv_error(IBV_WC_LOC_LEN_ERR, "receive buffer too small");
      return nak(IBV_WC_REM_INV_REQ_ERR, "message longer than the receive buffer");
    }
    // SEND_WITH_INV: the window it names must be one to invalidate (respond_finish does).
    if (op == IBV_WR_SEND_WITH_INV) {
      RemoteMwView v;
      (void)rkey_mw(to, in.imm_data, v);
      const char* why = "";
      if (const ibv_wc_status st = check_invalidate(v, IBV_WC_REM_INV_REQ_ERR, &why);
          st != IBV_WC_SUCCESS) {
        recv_error(IBV_WC_LOC_PROT_ERR, why);
        return nak(st, why);
      }
    }
  } else if (is_write(op)) {
    append_spans(*out.mr, mr_off, in.len, dst_);
  } else if (op == IBV_WR_RDMA_READ) {
    append_spans(*out.mr, mr_off, in.len, src_);
  } else {
    // Atomics: a CPU atomic (rdma_atomic), so atomic against the other atomics of this host,
    // whoever executes them (this thread, or a library on the direct path across backends), and
    // against guests touching the word themselves. The word is in one chunk (checked above).
    append_spans(*out.mr, mr_off, 8, src_);
    auto* word = reinterpret_cast<uint64_t*>(src_.back().p);
    src_.pop_back();
    uintptr_t fault = 0;
    if (!guarded_atomic(word, op == IBV_WR_ATOMIC_FETCH_AND_ADD, in.compare_add, in.swap,
                        out.atomic_old, fault)) {
      VLOG_WARN(
          "guest {} QP {:#x}: memory at {:#x} faulted (SIGBUS/SIGSEGV) under an atomic; "
          "the atomic fails",
          to.guest->name, to.qpn, fault);
      enter_error(to, "its memory faulted");
      post_async(*to.owner, IBV_EVENT_QP_FATAL, to.handle);
      return nak(IBV_WC_REM_ACCESS_ERR, "the responder's memory faulted");
    }
  }
  return out;
}

void Device::respond_finish(Qp& to, const Inbound& in, const RecvWqe& r, uint32_t commit,
                            uint32_t tag) {
  if (is_send(in.op) || in.op == IBV_WR_RDMA_WRITE_WITH_IMM) {
    Cqe rc = recv_cqe(to, r.wr_id, in, is_send(in.op) ? IBV_WC_RECV : IBV_WC_RECV_RDMA_WITH_IMM);
    rc.status = IBV_WC_SUCCESS;
    rc.byte_len = static_cast<uint32_t>(in.len);
    if (has_imm(in.op)) {
      rc.wc_flags = IBV_WC_WITH_IMM;
      rc.imm_data = in.imm_data;
    }
    if (in.op == IBV_WR_SEND_WITH_INV) {
      // Checked in respond_begin; looked at again, as the data may have come in pieces (TCP)
      // while a command ran. ibv_wc's invalidated_rkey shares imm_data's place.
      RemoteMwView v;
      Mw* mw = rkey_mw(to, in.imm_data, v);
      if (check_invalidate(v, IBV_WC_REM_INV_REQ_ERR) == IBV_WC_SUCCESS) mw->bound = false;
      rc.wc_flags = IBV_WC_WITH_INV;
      rc.imm_data = in.imm_data;
    }
    Cq& ring = recv_ring(to);
    if (commit && to.rq_hdr) begin_commit(to, ring, rc, commit, tag);
    consume_recv(to);
    if (killed_at(KillPoint::kReceiveTaken)) return;
    if (!push_cqe(ring, rc, (in.send_flags & IBV_SEND_SOLICITED) != 0) && commit && to.rq_hdr)
      to.rq_hdr->commit_cq.store(ring.prod, std::memory_order_relaxed);  // lost to an overrun
  }
  to.cnt.msgs_received++;
  to.cnt.bytes_received += in.len;
}

void Device::begin_commit(Qp& to, const Cq& ring, const Cqe& rc, uint32_t commit, uint32_t tag,
                          uint32_t sender) {
  RingHeader& h = *to.rq_hdr;
  // A QP's own ring (direct path) has the libraries as producers too: push_cqe starts there.
  const uint32_t prod =
      ring.shared_producer ? ring.hdr->producer.load(std::memory_order_acquire) : ring.prod;
  h.commit_recv = RecvDone{rc.wr_id,
                           rc.byte_len,
                           rc.imm_data,
                           rc.src_qp,
                           rc.slid,
                           static_cast<uint8_t>(rc.opcode),
                           static_cast<uint8_t>(rc.wc_flags)};
  h.commit_cq.store(prod + 1, std::memory_order_relaxed);
  // A receive the QP holds (take_recv): its SRQ index, and taking it is clearing srq_taken.
  if (holds_srq_recv(to)) {
    commit |= kCommitHeld;
    h.commit_rq.store(h.srq_taken_at.load(std::memory_order_relaxed) + 1,
                      std::memory_order_relaxed);
  } else {
    h.commit_rq.store((to.srq ? to.srq->cons : to.rq_cons) + 1, std::memory_order_relaxed);
  }
  (commit & kCommitPsn ? h.commit_psn : h.commit_sq).store(tag, std::memory_order_relaxed);
  if (commit & kCommitUd) h.commit_psn.store(sender, std::memory_order_relaxed);
  // Release: a SIGKILL leaves memory as the stores were made, in this order (as on another core).
  h.commit_flags.store(kCommitValid | commit, std::memory_order_release);
}

void Device::commit_done(Qp& to) {
  if (to.rq_hdr) to.rq_hdr->commit_flags.store(0, std::memory_order_release);
}

void Device::recover_receive(Qp& qp) {
  if (!qp.rq_hdr || !qp.recv_cq) return;
  RingHeader& h = *qp.rq_hdr;
  // The last atomic's result, for its replay (the blob's cache is the last command's).
  if (const uint32_t a = h.atomic_psn.load(std::memory_order_acquire); a & kAtomicPsnValid) {
    const uint32_t psn = (a & 0xffffff) | Qp::kAtomicCacheValid;
    if (std::none_of(qp.atomic_cache.begin(), qp.atomic_cache.end(),
                     [&](const auto& e) { return e.first == psn; }))
      qp.atomic_cache[qp.atomic_cache_next++ % qp.atomic_cache.size()] = {
          psn, h.atomic_value.load(std::memory_order_relaxed)};
  }
  // A receive taken from the SRQ for a message in progress, the SRQ's cursor not moved past it
  // yet: moved now (take_recv's order), so that it is the QP's alone.
  const bool held = holds_srq_recv(qp);
  if (held && qp.srq->cons == h.srq_taken_at.load(std::memory_order_relaxed)) {
    qp.srq->cons++;
    qp.srq->hdr->consumer.store(qp.srq->cons, std::memory_order_release);
  }
  const uint32_t flags = h.commit_flags.load(std::memory_order_acquire);
  if (!(flags & kCommitValid)) return;
  // Not taken: it never began (the requester sends it again; the record goes, or another QP
  // of an SRQ could take that receive and make it look taken). Taken: delivered. A receive the
  // QP held is taken when the QP holds it no more.
  const uint32_t cons = qp.srq ? qp.srq->cons : qp.rq_cons;
  const bool taken =
      flags & kCommitHeld
          ? !held || h.srq_taken_at.load(std::memory_order_relaxed) + 1 !=
                         h.commit_rq.load(std::memory_order_relaxed)
          : cons == h.commit_rq.load(std::memory_order_relaxed);
  if (!taken) {
    h.commit_flags.store(0, std::memory_order_release);
    return;
  }
  Cq& ring = recv_ring(qp);
  const uint32_t prod = ring.hdr->producer.load(std::memory_order_acquire);
  if (prod == h.commit_cq.load(std::memory_order_relaxed) - 1 &&
      prod - ring.hdr->consumer.load(std::memory_order_acquire) < ring.size) {
    // Its completion was not published: pushed now (the import fires the owed event).
    const RecvDone d = h.commit_recv;
    Cqe rc{};
    rc.wr_id = d.wr_id;
    rc.status = IBV_WC_SUCCESS;
    rc.opcode = d.opcode;
    rc.byte_len = d.byte_len;
    rc.imm_data = d.imm_data;
    rc.qp_num = qp.qpn;
    rc.src_qp = d.src_qp;
    rc.wc_flags = d.wc_flags;
    rc.slid = d.slid;
    ring.prod = prod;
    put_cqe(ring, rc);
  }
  if (flags & kCommitPsn) {
    const uint32_t psn = h.commit_psn.load(std::memory_order_relaxed) & 0xffffff;
    if (wire::psn_diff(psn, qp.expected_psn) > 0) qp.expected_psn = psn;
    h.backend_psn.store(qp.expected_psn, std::memory_order_relaxed);
    h.commit_flags.store(0, std::memory_order_release);
  }
  if (flags & kCommitLocal) {
    // Kept in the ring: a second restart before the requester's replay finds it again.
    qp.replay_known = true;
    qp.replay_sq = h.commit_sq.load(std::memory_order_relaxed);
    qp.replay_ud = (flags & kCommitUd) != 0;
    qp.replay_qpn = qp.replay_ud ? h.commit_psn.load(std::memory_order_relaxed) : 0;
  }
}

}  // namespace vrdma::engine
