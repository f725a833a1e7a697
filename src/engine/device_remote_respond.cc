// Data path toward other backends, the responder: frames from the wire go through the same
// respond_begin/respond_finish as a same-host requester, so the same faults give the same
// completions; each PSN executes once (duplicates are re-acknowledged, READs re-executed,
// atomics answered from a small cache of results). The requester is device_remote.cc.
#include <cstring>

#include "common/log.h"
#include "engine/datapath_util.h"

namespace vrdma::engine {

using namespace vrdma::proto;
using wire::Syndrome;
using wire::Type;

Qp* Device::request_target(const std::string& node, const wire::Request& rq, const char** why) {
  auto refuse = [&](const char* w) -> Qp* {
    if (why) *why = w;
    return nullptr;
  };
  Guest* g = dest_guest(rq);
  if (!g) return refuse("no guest here has that destination LID/GID");
  auto it = g->qps.find(rq.dst_qpn);
  if (it == g->qps.end() || !rq_open(it->second->state)) return nullptr;
  Qp* to = it->second;
  if (rq.qp_type == IBV_QPT_UD) {
    if (to->type != IBV_QPT_UD) return refuse("a datagram for a QP that is not UD");
    if (!ud_source_ok(node, rq))
      return refuse("a datagram whose source LID/GID is not that node's");
    return to;
  }
  // Exactly the check a same-host requester passes (connected to this requester), and the
  // frame came from the node the QP chose for its peer: a guest elsewhere that claims the
  // peer's LID or GID is not heard.
  if (!accepts_from(*to, static_cast<ibv_qp_type>(rq.qp_type), rq.src_qpn, rq.slid, rq.sgid))
    return refuse("the QP is not connected to that requester");
  if (to->route_pending) choose_route(*to);
  if (!to->remote || to->peer_node != node)
    return refuse(to->remote ? "the QP's peer is on another node" : "the QP's peer is local");
  return to;
}

bool Device::ud_source_ok(const std::string& node, const wire::Request& rq) {
  // Never one of ours or another node's guest.
  // (Forced TCP on one host: our own node, and the source is one of our guests.)
  const bool ours =
      rq.is_global ? guest_by_gid(rq.sgid) != nullptr : guests_by_lid_.count(rq.slid) != 0;
  const std::string src =
      rq.is_global ? transport_->locate_gid(rq.sgid) : transport_->locate_lid(rq.slid);
  return node == transport_->self() ? ours : src == node;
}

void Device::reply(const std::string& node, const wire::Request& rq, Syndrome s, uint32_t status,
                   uint8_t rnr_timer, uint64_t atomic_orig, std::span<const Span> data,
                   std::span<const transport::Hold> holds, uint64_t flow) {
  wire::Reply rp{};
  std::memcpy(rp.dgid, rq.sgid, 16);
  rp.dst_qpn = rq.src_qpn;
  rp.src_qpn = rq.dst_qpn;
  rp.psn = rq.psn;
  rp.syndrome = static_cast<uint8_t>(s);
  rp.rnr_timer = rnr_timer;
  rp.status = status;
  rp.atomic_orig = atomic_orig;
  transport_->send(node, Type::kReply, &rp, data, holds, flow);
}

void Device::nak(const std::string& node, Qp& to, const wire::Request& rq, Syndrome s,
                 uint32_t status, uint8_t rnr_timer) {
  to.cnt.naks_sent++;
  reply(node, rq, s, status, rnr_timer);
}

void Device::advance_expected(Qp& to) {
  to.expected_psn = wire::psn_add(to.expected_psn, 1);
  to.seq_nak_sent = false;
  publish_psns(to);
}

Guest* Device::dest_guest(const wire::Request& rq) {
  if (rq.is_global) return guest_by_gid(rq.dgid);
  auto it = guests_by_lid_.find(rq.dlid);
  return it == guests_by_lid_.end() ? nullptr : it->second;
}

Qp* Device::not_ready_target(const wire::Request& rq) {
  Guest* g = is_reliable(rq.qp_type) ? dest_guest(rq) : nullptr;
  if (!g) return nullptr;
  auto it = g->qps.find(rq.dst_qpn);
  if (it == g->qps.end()) return nullptr;
  Qp* qp = it->second;
  const bool early = qp->state == IBV_QPS_RESET || qp->state == IBV_QPS_INIT;
  return is_reliable(qp->type) && early ? qp : nullptr;
}

Inbound Device::inbound_of(const wire::Request& rq) {
  Inbound in;
  in.op = rq.opcode;
  in.send_flags = rq.send_flags;
  in.imm_data = rq.imm_data;
  in.rkey = rq.rkey;
  in.remote_addr = rq.remote_addr;
  in.compare_add = rq.compare_add;
  in.swap = rq.swap;
  in.len = rq.length;
  in.src_qpn = rq.src_qpn;
  in.slid = rq.slid;
  in.type = static_cast<ibv_qp_type>(rq.qp_type);
  in.xrc_srqn = rq.xrc_srqn;
  return in;
}

void Device::on_duplicate(const std::string& node, Qp& to, const wire::Request& rq,
                          const Inbound& in) {
  if (rq.opcode == IBV_WR_RDMA_READ) {
    // READ has no side effect: executed again (the first answer may have been lost).
    src_.clear();
    const Response r = respond_begin(to, in);
    if (r.kind != Response::kOk) {
      reply(node, rq, Syndrome::kErrNak, r.status ? r.status : IBV_WC_REM_INV_REQ_ERR);
      return;
    }
    holds_.clear();
    holds_of(*r.mr, holds_);
    reply(node, rq, Syndrome::kReadData, 0, 0, 0, src_, holds_);
    return;
  }
  if (is_atomic(rq.opcode)) {
    for (const auto& [psn, value] : to.atomic_cache) {
      if (psn == (rq.psn | Qp::kAtomicCacheValid)) {
        reply(node, rq, Syndrome::kAtomicData, 0, 0, value);
        return;
      }
    }
    reply(node, rq, Syndrome::kErrNak, IBV_WC_REM_INV_REQ_ERR);
    return;
  }
  reply(node, rq, Syndrome::kAck);  // executed before: acknowledge again, never twice
}

void Device::on_request(const std::string& node, const wire::Frame& f, transport::RxSink& sink) {
  const wire::Request& rq = f.req;
  if (is_mcast(rq)) {
    on_mcast(node, rq, sink);
    return;
  }
  const char* why = nullptr;
  Qp* to = request_target(node, rq, &why);
  // No such QP, or not connected to this requester: no answer, as on one host (the requester
  // times out and retries), and nothing that depends on the QP's state (its PSN).
  if (!to) {
    if (why)
      transport_->refused_frame(
          node, fmt::format("request for qp {:#x} (dlid {:#x}): {}", rq.dst_qpn, rq.dlid, why));
    else if (Qp* early = not_ready_target(rq))
      nak(node, *early, rq, Syndrome::kRnrNak, wire::kRnrNotReady, kNotReadyRnrTimer);
    return;
  }
  const Inbound in = inbound_of(rq);
  if (rq.qp_type == IBV_QPT_UD) {
    if (to->attr.qkey != rq.qkey) {
      to->cnt.ud_dropped++;
      return;
    }
    sink.scratch.resize(wire::kMaxUdPayload);
    if (rq.length) sink.spans.push_back({sink.scratch.data(), rq.length});
    sink.accepted = true;
    return;
  }
  src_.clear();
  dst_.clear();
  holds_.clear();
  const bool rc = is_reliable(rq.qp_type);
  if (rc) {
    const int32_t d = wire::psn_diff(rq.psn, to->expected_psn);
    if (d > 0) {
      // A gap (after an RNR NAK or a lost connection): said once, the requester goes back.
      if (!to->seq_nak_sent) {
        to->seq_nak_sent = true;
        wire::Request at = rq;
        at.psn = to->expected_psn;
        nak(node, *to, at, Syndrome::kSeqNak);
      }
      return;
    }
    if (d < 0) {
      on_duplicate(node, *to, rq, in);
      return;
    }
  }
  // An SRQ that libraries feed too: one consumer at a time while its receive is chosen. Held
  // for a moment by a library: asked again shortly, as a QP not ready yet (no RNR retry spent).
  Response r;
  if (is_send(in.op) || in.op == IBV_WR_RDMA_WRITE_WITH_IMM) {
    RxHold rx(*this, *to);
    if (!rx.held) {
      if (rc) nak(node, *to, rq, Syndrome::kRnrNak, wire::kRnrNotReady, kBusyRnrTimer);
      return;
    }
    r = respond_begin(*to, in);
    // The payload comes over several turns: its receive is held from now on (take_recv).
    if (r.kind == Response::kOk) take_recv(*to, r.recv);
  } else {
    r = respond_begin(*to, in);
  }
  switch (r.kind) {
    case Response::kDrop:
      return;
    case Response::kRnr:
      if (rc)
        nak(node, *to, rq, Syndrome::kRnrNak, 0, static_cast<uint8_t>(to->attr.min_rnr_timer));
      return;
    case Response::kError:
      if (rc) nak(node, *to, rq, Syndrome::kErrNak, r.status);
      return;
    case Response::kOk:
      break;
  }
  if (rq.opcode == IBV_WR_RDMA_READ) {  // no side effect: executed again if replayed
    respond_finish(*to, in, r.recv);
    advance_expected(*to);
    holds_of(*r.mr, holds_);
    reply(node, rq, Syndrome::kReadData, 0, 0, 0, src_, holds_, to->flow);
    return;
  }
  if (is_atomic(rq.opcode)) {
    to->atomic_cache[to->atomic_cache_next++ % to->atomic_cache.size()] = {rq.psn | Qp::kAtomicCacheValid,
                                                                           r.atomic_old};
    // Its result in the ring before the PSN moves: a restart answers the replay from there
    // (recover_receive). A SIGKILL before the PSN moves executes it again.
    if (to->rq_hdr) {
      to->rq_hdr->atomic_value.store(r.atomic_old, std::memory_order_relaxed);
      to->rq_hdr->atomic_psn.store(rq.psn | kAtomicPsnValid, std::memory_order_release);
    }
    respond_finish(*to, in, r.recv);
    advance_expected(*to);
    if (killed_at(KillPoint::kAtomicExecuted)) return;
    reply(node, rq, Syndrome::kAtomicData, 0, 0, r.atomic_old);
    return;
  }
  // SEND / WRITE: the payload is read straight into the responder's memory; the message
  // completes (and is acknowledged) when all of it is there.
  trim(dst_, in.len);
  if (is_send(in.op)) {
    sge_holds(*to, r.recv.sge, std::min<uint32_t>(r.recv.num_sge, kMaxSge),
              to->srq ? to->srq->pd : to->pd);
  } else {
    holds_of(*r.mr, holds_);
  }
  sink.spans.assign(dst_.begin(), dst_.end());
  sink.holds.assign(holds_.begin(), holds_.end());
  std::memcpy(sink.ctx, &r, sizeof(r));
  sink.accepted = true;
}

void Device::on_frame(const std::string& node, const wire::Frame& f, transport::RxSink& sink) {
  if (killed_) return;  // tests only (kill_at)
  if (f.type() == Type::kRequest) {
    on_request(node, f, sink);
  } else if (f.type() == Type::kReply) {
    on_reply(node, f, sink);
  } else if (f.type() == Type::kDirectOffer) {
    on_direct_offer(node, f.offer);  // no payload: nothing for on_frame_done
  } else if (f.type() == Type::kCm && cm_rx_) {
    cm_rx_(node, f.cm);  // no payload either
  }
}

void Device::on_frame_done(const std::string& node, const wire::Frame& f, transport::RxSink& sink) {
  if (!sink.accepted || killed_) return;
  sink.accepted = false;
  if (f.type() == Type::kReply) {  // READ data is in place
    Qp* qp = reply_target(node, f.reply);
    if (!qp) return;
    for (Qp::Outstanding& o : qp->unacked) {
      if (o.psn == f.reply.psn && o.w.opcode == IBV_WR_RDMA_READ) o.has_result = true;
    }
    acked(*qp, f.reply.psn, now_ns_);
    return;
  }
  const wire::Request& rq = f.req;
  if (is_mcast(rq)) {
    on_mcast_done(rq, sink);
    return;
  }
  // Looked up again: the QP may have gone while the payload streamed in.
  Qp* to = request_target(node, rq);
  if (!to) return;
  const Inbound in = inbound_of(rq);
  if (rq.qp_type == IBV_QPT_UD) {
    const Span s{sink.scratch.data(), rq.length};
    deliver_ud(*to, in, rq.is_global != 0, rq.sgid, {&s, rq.length ? 1u : 0u}, rq.sl);
    return;
  }
  if (is_reliable(rq.qp_type) && rq.psn != to->expected_psn) return;
  Response r;
  std::memcpy(&r, sink.ctx, sizeof(r));
  // The responder's record carries the PSN expected after this message, so a restart between
  // the receive's completion and advance_expected knows it was delivered (recover_receive).
  const bool rc = is_reliable(rq.qp_type);
  respond_finish(*to, in, r.recv, rc ? kCommitPsn : 0, wire::psn_add(rq.psn, 1));
  if (killed_at(KillPoint::kReceiveCompleted)) return;
  if (rc) {
    advance_expected(*to);
    commit_done(*to);
    reply(node, rq, Syndrome::kAck);
  }
}

}  // namespace vrdma::engine
