// Data path toward other backends. Requester: RC/UC over a transport with a PSN per message,
// the unacknowledged WQEs kept (private copies) and replayed after a reconnect, a timeout, or
// an RNR NAK, and completed strictly in order; IBV_WC_RETRY_EXC_ERR when the retry budget
// (timeout x retry_cnt) passes with no progress. The responder is device_remote_respond.cc. No
// allocation beyond what the transport needs to hold guest memory alive while it is in flight.
#include <cstring>

#include "common/log.h"
#include "engine/datapath_util.h"

namespace vrdma::engine {

using namespace vrdma::proto;
using wire::Syndrome;
using wire::Type;

namespace {

static_assert(sizeof(Response) <= sizeof(transport::RxSink::ctx));
static_assert(std::is_trivially_copyable_v<Response>);

}  // namespace

void Device::warn_one_default_guest(const Qp& qp, const Guest& dest) const {
  // Two background jobs of one shell script share a process group, so by default one guest:
  // their pair works, but moves, snapshots and limits treat them as one device.
  if (&dest != qp.guest || qp.type != IBV_QPT_RC || !dest.name.starts_with("pgrp-")) return;
  auto peer = dest.qps.find(qp.attr.dest_qp_num);
  if (peer == dest.qps.end() || !peer->second->owner || !qp.owner ||
      peer->second->owner->pid == qp.owner->pid)
    return;
  VLOG_WARN(
      "qp {:#x} (guest {}, pid {}): both ends of this RC connection are in one guest, with "
      "pid {}: processes of one process group (background jobs of one shell script) share "
      "the default guest; give each its own (vrdma run --guest NAME)",
      qp.qpn, dest.name, qp.owner->pid, peer->second->owner->pid);
}

void Device::choose_route(Qp& qp, bool quiet) {
  qp.remote = false;
  qp.route_pending = false;
  qp.transport = "shm";
  qp.peer_node.clear();
  if (qp.type == IBV_QPT_UD) {
    qp.transport_why = "datagrams: chosen per destination";
    return;
  }
  const QpAttr& a = qp.attr;
  Guest* local = nullptr;
  if (a.is_global) {
    local = guest_by_gid(a.dgid);
  } else if (auto it = guests_by_lid_.find(static_cast<uint16_t>(a.dlid));
             it != guests_by_lid_.end()) {
    local = it->second;
  }
  auto use_tcp = [&](const std::string& node, std::string why) {
    qp.remote = true;
    qp.transport = "tcp";
    qp.peer_node = node;
    qp.transport_why = std::move(why);
    if (!quiet)
      VLOG_INFO("qp {:#x} (guest {}): tcp to {} ({})", qp.qpn, qp.guest->name, node,
                qp.transport_why);
  };
  if (local && !a.is_global && transport_) {
    // A LID is not a name: a local guest that holds one a peer backend's guest also holds (it
    // took it before the directory heard of the other) could be anyone. Neither is chosen; GIDs
    // (the guest's name) are unambiguous.
    // (The same guest, by its GID, listed there too has just moved here: that entry is stale.)
    const std::string there = transport_->locate_lid(static_cast<uint16_t>(a.dlid));
    if (!there.empty() && there != transport_->self() &&
        transport_->locate_gid(local->gid) != there) {
      std::string why = fmt::format(
          "LID {:#x} is both guest {} here and a guest of backend {}: "
          "not connected (use GIDs)",
          a.dlid, local->name, there);
      // Looked up again on every send: said once.
      if (why != qp.transport_why)
        VLOG_WARN("qp {:#x} (guest {}): {}", qp.qpn, qp.guest->name, why);
      qp.transport = "none";
      qp.transport_why = std::move(why);
      qp.route_pending = true;
      return;
    }
  }
  if (local) {
    if (transport_ && transport_->forced()) {
      use_tcp(transport_->self(), "forced (VRDMA_TRANSPORT=tcp)");
    } else {
      qp.transport_why = "destination guest on this backend";
    }
    warn_one_default_guest(qp, *local);
    return;
  }
  const std::string node = !transport_   ? std::string()
                           : a.is_global ? transport_->locate_gid(a.dgid)
                                         : transport_->locate_lid(static_cast<uint16_t>(a.dlid));
  if (node.empty()) {
    const std::string away = transport_ ? transport_->directory_unavailable() : std::string();
    std::string why = "destination not known (yet); looked up again on send";
    if (!transport_) {
      // No TCP: nothing will ever make it known. Two programs on two backends by mistake (a
      // typo in VRDMA_SOCKET, a root and a user program each starting its own): said once.
      const std::string dest = a.is_global ? "GID" : fmt::format("LID {:#x}", a.dlid);
      why = fmt::format(
          "destination {} unknown to this backend (tcp off): are both programs on "
          "the same VRDMA_SOCKET? Retried, then IBV_WC_RETRY_EXC_ERR",
          dest);
      if (why != qp.transport_why)
        VLOG_WARN("qp {:#x} (guest {}): {}", qp.qpn, qp.guest->name, why);
    } else if (!away.empty()) {
      // Looked up again on every send: said once (the reason's text changes as members are
      // tried in turn).
      const bool said = qp.transport_why.starts_with("destination not known: ");
      why = fmt::format("destination not known: {}; retried, then IBV_WC_RETRY_EXC_ERR", away);
      if (!said) VLOG_WARN("qp {:#x} (guest {}): {}", qp.qpn, qp.guest->name, why);
    }
    qp.transport_why = std::move(why);
    qp.route_pending = true;
    return;
  }
  use_tcp(node, fmt::format("destination {} is on backend {}",
                            a.is_global ? "GID" : fmt::format("LID {:#x}", a.dlid), node));
}

bool Device::destination_unknown(Session& s, uint32_t handle) {
  const Qp* qp = find_qp(s, handle);
  // With a transport, a destination not known yet may be announced later (choose_route).
  return qp && !transport_ && qp->route_pending;
}

uint64_t Device::ack_ns(const Qp& qp) const {
  // A floor keeps a tiny timeout from flooding the connection with replays.
  return std::max<uint64_t>(ack_timeout_ns(qp.attr.timeout), 1000000);
}

void Device::holds_of(const Mr& mr, std::vector<transport::Hold>& out) const {
  for (const auto& seg : mr.segments) out.push_back(seg);
}

void Device::sge_holds(const Qp& qp, const Sge* sge, uint32_t n, uint32_t pd) {
  for (uint32_t i = 0; i < n; ++i) {
    if (sge[i].length == 0) continue;
    if (const Mr* mr = find_mr(qp, sge[i].lkey, pd)) holds_of(*mr, holds_);
  }
}

// ---- requester ----

bool Device::send_request(Qp& qp, Qp::Outstanding& o) {
  const SendWqe& w = o.w;
  wire::Request rq{};
  fill_route(rq, qp);
  rq.qp_type = static_cast<uint8_t>(qp.type);
  rq.sl = static_cast<uint8_t>(qp.attr.sl);
  rq.src_qpn = qp.qpn;
  rq.dst_qpn = qp.attr.dest_qp_num;
  rq.psn = o.psn;
  rq.opcode = w.opcode;
  rq.send_flags = w.send_flags;
  rq.imm_data = w.imm_data;
  rq.rkey = w.rkey;
  rq.remote_addr = w.remote_addr;
  rq.compare_add = w.compare_add;
  rq.swap = w.swap;
  rq.length = o.len;
  if (qp.type == IBV_QPT_XRC_SEND) rq.xrc_srqn = w.ud_remote_qkey & 0xffffff;
  src_.clear();
  holds_.clear();
  if (is_send(w.opcode) || is_write(w.opcode)) {
    // The payload is gathered from the guest's memory again on every (re)send: the guest may
    // not touch the buffer before the completion, so it is what was posted.
    if (w.send_flags & IBV_SEND_INLINE) {
      if (o.len) src_.push_back({const_cast<uint8_t*>(w.inline_data), o.len});
    } else {
      uint64_t len = 0;
      if (!resolve_sges(qp, w.sge, w.num_sge, 0, src_, len) || len != o.len) {
        // The MR went away under a WQE in flight: nothing valid to send; the requester times out.
        VLOG_WARN("qp {:#x}: send buffer deregistered while in flight", qp.qpn);
        return false;
      }
      sge_holds(qp, w.sge, w.num_sge, qp.pd);
    }
  }
  if (!transport_->send(qp.peer_node, Type::kRequest, &rq, src_, holds_, qp.flow)) return false;
  o.mark = transport_->tx_mark(qp.peer_node);
  qp.tx_last = o.mark;
  return true;
}

bool Device::resend(Qp& qp, Qp::Outstanding& o) {
  if (!send_request(qp, o)) return false;
  qp.cnt.replays++;
  qp.cnt.replayed_bytes += o.len;
  return true;
}

void Device::resend_all(Qp& qp) {
  qp.probe = false;
  for (Qp::Outstanding& o : qp.unacked) {
    if (!resend(qp, o)) break;
  }
}

void Device::take_back(Qp& qp) {
  if (qp.remote && transport_) transport_->drop_flow(qp.peer_node, qp.flow);
}

bool Device::ack_timeout(Qp& qp, uint64_t now_ns) {
  // IBV_WC_RETRY_EXC_ERR means no forward progress from the peer for timeout x (retry_cnt + 1).
  // Over TCP a request may still sit in this backend's queue or the kernel's, behind other
  // bytes, TCP's own recovery and the RTT: while the connection moves (the peer acknowledges
  // our bytes or sends its own), that is not the peer failing to answer, and a replay would
  // only queue duplicates behind the same bytes.
  // Input from the peer that is not read yet may hold the answer (a backend that was not
  // scheduled sees its timers first): read it, then judge, 1 ms later. Once per timeout, so
  // traffic that never answers this QP cannot keep it waiting.
  if (!qp.ack_deferred && transport_->rx_pending(qp.peer_node)) {
    qp.ack_deferred = true;
    qp.wait_until_ns = now_ns + 1000000;
    return false;
  }
  qp.ack_deferred = false;
  const Qp::Outstanding& front = qp.unacked.front();
  // The connection frames to the peer go on now; `live`: the head was sent on it.
  const uint64_t conn = transport_->tx_mark(qp.peer_node).conn;
  const bool live = front.mark.conn != 0 && front.mark.conn == conn;
  // The head went on a connection we dialed that the peer's host accepted and no backend has
  // taken yet (one restarting under keep_state, whose keeper holds its listener): a slow peer
  // backend on a path that delivers, waited for as long as the transport waits for its Hello
  // (it then closes the connection, and a timeout on the next one spends a retry).
  if (live && transport_->peer_not_taken(qp.peer_node)) {
    if (qp.peer_has_since_ns == 0) qp.peer_has_since_ns = now_ns;
    qp.wait_until_ns = now_ns + ack_ns(qp);
    slow_peer_note(qp, front.psn, now_ns, qp.peer_has_since_ns,
                   "its host accepted our connection, and no backend has taken it yet");
    return false;
  }
  const bool in_pipe = live && !transport_->tx_delivered(qp.peer_node, front.mark);
  if (in_pipe && pipe_waits(qp, front.psn, now_ns)) {
    qp.wait_until_ns = now_ns + ack_ns(qp);
    return false;
  }
  if (!in_pipe && live) {
    // The peer's TCP holds the request on this very connection and its backend has not answered:
    // every request a responder drops is answered (a NAK), so its backend did not run, or its
    // answer is in TCP's recovery, or the path went down after the request crossed it. On a
    // loaded host a backend preempted once waited 638 ms for a CPU, more than `timeout` 14's
    // whole budget. So the path is probed with a frame of our own (kPing): once the peer's TCP
    // has taken it, the path delivers and the peer backend is waited for, kSlowPeerNs at most;
    // while it has not, this is an outage, and the timeouts spend retries as on a fabric (as
    // after the wait: a peer QP that is gone answers nothing).
    if (qp.peer_has_since_ns == 0 || qp.path_probe.conn != conn) {  // this wait, this connection
      qp.peer_has_since_ns = now_ns;
      const wire::Ping ping{++pings_sent_};
      qp.path_probe = transport_->send(qp.peer_node, Type::kPing, &ping)
                          ? transport_->tx_mark(qp.peer_node)
                          : transport::TxMark{};
      conn_moving(qp, now_ns);  // notes where the connection stands
    }
    const bool path_delivers = qp.path_probe.conn != 0 && qp.path_probe.conn == conn &&
                               transport_->tx_delivered(qp.peer_node, qp.path_probe);
    // The probe queues behind this backend's own backlog on the connection (other QPs' bulk):
    // while that moves, the path is delivering, only not the probe yet. Free, as for a request
    // still in the pipe, and the wait for the peer backend starts once the probe is through.
    if (!path_delivers && qp.path_probe.conn == conn && conn_moving(qp, now_ns)) {
      qp.peer_has_since_ns = now_ns;
      qp.wait_until_ns = now_ns + ack_ns(qp);
      return false;
    }
    if (path_delivers && now_ns - qp.peer_has_since_ns < slow_peer_ns(qp)) {
      qp.wait_until_ns = now_ns + ack_ns(qp);
      slow_peer_note(qp, front.psn, now_ns, qp.peer_has_since_ns, "the peer has it");
      return false;
    }
  }
  if (qp.retry_left == 0) {
    const SendWqe w = front.w;
    qp.unacked.pop_front();
    complete_send(qp, w, IBV_WC_RETRY_EXC_ERR, 0);
    // What TCP says of the path then, for whoever reads why (once per QP: it leaves RTS).
    if (const std::string st = transport_->path_state(qp.peer_node); !st.empty())
      VLOG_INFO("qp {:#x} (guest {}): retries exhausted to {}: {}", qp.qpn, qp.guest->name,
                qp.peer_node, st);
    enter_error(qp, in_pipe ? "transport retries exhausted (the connection to the peer backend "
                              "moved nothing for the QP's whole retry budget)"
                            : "transport retries exhausted (the peer backend has the request but "
                              "did not answer)");
    qp.wait = Wait::kNone;
    return true;
  }
  --qp.retry_left;
  qp.cnt.retries++;
  qp.wait_until_ns = now_ns + ack_ns(qp);
  // The peer's TCP has it on this very connection: TCP loses nothing, and every request a
  // responder drops is NAKed (a gap, a QP not ready, RNR), so its answer is on its way (TCP
  // retransmitting it) or the peer QP is gone or in error: sending it again would only repeat
  // bytes. Spent as a retry, replayed only as the last try. Sent on a connection that broke
  // (or a transport that cannot tell): replayed.
  const bool replay = !in_pipe && (!live || qp.retry_left == 0);
  uint64_t held = 0;
  if (ack_log_.ready(now_ns, held))
    VLOG_INFO("qp {:#x} (guest {}): ACK timeout for PSN {:#x} to {}: {}; {} retries left{}", qp.qpn,
              qp.guest->name, front.psn, qp.peer_node,
              in_pipe  ? "the connection moved nothing, not replaying (still queued)"
              : replay ? "the peer has it, replaying what reached it"
                       : "the peer has it and has not answered yet, not replaying",
              qp.retry_left, log::held_note(held));
  if (!replay) return false;
  // Replayed: what the peer's TCP acknowledged (the rest is still on its way).
  bool did = false;
  for (Qp::Outstanding& o : qp.unacked) {
    if (o.mark.conn != 0 && o.mark.conn == conn && !transport_->tx_delivered(qp.peer_node, o.mark))
      break;
    if (!resend(qp, o)) break;
    did = true;
    if (qp.probe) break;  // the head alone: its ACK sends the rest
  }
  return did;
}

uint64_t Device::slow_peer_ns(const Qp& qp) {
  // An answer lost on the way back comes through the peer's TCP recovery, which backs off as
  // ours does (lost three times in a row, at 10 % loss now and then: 3 s at the 200 ms floor,
  // beyond kSlowPeerNs): a path that still delivers, not a peer that does not answer.
  return std::max(kSlowPeerNs, transport_->peer_recovery_ns(qp.peer_node));
}

bool Device::pipe_waits(Qp& qp, uint32_t psn, uint64_t now_ns) {
  // Progress is judged from the second timeout of a wait on: the first one only notes where
  // the connection stands, and counts as a retry, as on a fabric. Later,
  // a timeout costs nothing if the connection moved, or if it has been still for less than
  // the path's own round trip (a long path: the answer cannot be there yet).
  const bool first = !qp.ack_looked;
  if (conn_moving(qp, now_ns)) return true;
  // The peer's TCP has all we sent and closed its window: the path delivers, but the peer
  // backend does not read (a backend starved of CPU for a second and a half closed it under
  // ib_write_bw). A slow peer backend, waited for as one, from when the connection stopped.
  if (first || now_ns - qp.ack_moved_ns >= slow_peer_ns(qp) ||
      !transport_->peer_window_closed(qp.peer_node))
    return false;
  slow_peer_note(qp, psn, now_ns, qp.ack_moved_ns, "its window is closed");
  return true;
}

void Device::slow_peer_note(const Qp& qp, uint32_t psn, uint64_t now_ns, uint64_t since_ns,
                            const char* what) {
  uint64_t held = 0;
  if (ack_log_.ready(now_ns, held))
    VLOG_INFO(
        "qp {:#x} (guest {}): ACK timeout for PSN {:#x} to {}: {}, the path delivers, and its "
        "backend has not answered for {} ms; waiting for it, {} retries left{}",
        qp.qpn, qp.guest->name, psn, qp.peer_node, what, (now_ns - since_ns) / 1000000,
        qp.retry_left, log::held_note(held));
}

bool Device::conn_moving(Qp& qp, uint64_t now_ns) {
  const uint64_t prog = transport_->tx_progress(qp.peer_node);
  const bool looked = qp.ack_looked;
  const bool moved = looked && prog != qp.ack_progress;
  if (!looked || moved) qp.ack_moved_ns = now_ns;
  qp.ack_progress = prog;
  qp.ack_looked = true;
  return moved || (looked && now_ns - qp.ack_moved_ns < transport_->tx_patience_ns(qp.peer_node));
}

void Device::acked(Qp& qp, uint32_t psn, uint64_t now_ns) {
  bool progress = false;
  while (!qp.unacked.empty() && wire::psn_diff(psn, qp.unacked.front().psn) >= 0) {
    const Qp::Outstanding& o = qp.unacked.front();
    // A READ or atomic completes with its data, which comes before any later ACK.
    if ((o.w.opcode == IBV_WR_RDMA_READ || is_atomic(o.w.opcode)) && !o.has_result) break;
    const SendWqe w = o.w;
    const uint32_t len = o.len;
    qp.unacked.pop_front();
    complete_send(qp, w, IBV_WC_SUCCESS, len);
    progress = true;
  }
  if (!progress) return;
  qp.ack_looked = false;
  qp.ack_deferred = false;
  qp.peer_has_since_ns = 0;
  qp.path_probe = {};
  qp.not_ready_since_ns = 0;
  // The message probing after an RNR wait got through: the rest of the window follows it (the
  // responder dropped them as a gap, or as not ready).
  if (qp.probe) resend_all(qp);
  qp.retry_left = qp.attr.retry_cnt;
  qp.rnr_left = qp.attr.rnr_retry;
  if (qp.wait == Wait::kAck) {
    if (qp.unacked.empty()) {
      qp.wait = Wait::kNone;
    } else {
      qp.wait_until_ns = now_ns + ack_ns(qp);
    }
  }
}

bool Device::process_sq_remote(Qp& qp, uint64_t now_ns, bool hold_new) {
  bool did = false;
  if (qp.replay_now) {
    qp.replay_now = false;
    qp.wait_until_ns = now_ns + ack_ns(qp);
    resend_all(qp);
    did = true;
  }
  if (is_reliable(qp.type)) {
    if (qp.wait == Wait::kRnr) {
      if (now_ns < qp.wait_until_ns) return false;
      qp.wait = Wait::kAck;
      qp.wait_until_ns = now_ns + ack_ns(qp);
      // The head message goes alone; the rest follow its ACK (acked()): an RNR round costs one
      // message, not the whole window again (on a long path many rounds fit in one RTT).
      if (!qp.unacked.empty() && resend(qp, qp.unacked.front())) qp.probe = true;
      did = true;
    } else if (qp.wait == Wait::kAck && now_ns >= qp.wait_until_ns) {
      if (qp.unacked.empty()) {
        qp.wait = Wait::kNone;
        return true;
      }
      did |= ack_timeout(qp, now_ns);
      if (qp.wait == Wait::kNone) return true;  // failed: the QP is in ERR
    }
  }
  if (hold_new) return did;  // the library is leaving the direct path (revoke_holds)
  const uint32_t prod = qp.sq_hdr->producer.load(std::memory_order_acquire);
  if (prod - qp.sq_cons > qp.sq_size) {
    enter_error(qp, "send queue indices corrupt");
    post_async(*qp.owner, IBV_EVENT_QP_FATAL, qp.handle);
    return true;
  }
  // Many messages in flight (bounded by the SQ); a batch per visit, as on one host.
  for (int budget = 64; qp.sq_sent != prod && budget && qp.wait != Wait::kRnr && !qp.probe;
       --budget) {
    // Back-pressure: while its last frame is deep in the connection's queue, new WQEs stay in
    // the send queue (their ACK clocks not started); the transport's progress brings it back.
    if (transport_->tx_unwritten(qp.peer_node, qp.tx_last) > kQpQueuedMax) {
      if (!qp.held) qp.cnt.held++;
      qp.held = true;
      break;
    }
    qp.held = false;
    const SendWqe w = qp.sq[qp.sq_sent & (qp.sq_size - 1)];
    // A bind or local invalidation sends nothing; its completion follows those in flight.
    if (proto::is_local_mw_op(w.opcode) && proto::opcode_allowed(qp.type, w.opcode)) {
      if (!qp.unacked.empty()) break;
      const char* why = "";
      const ibv_wc_status st = execute_mw_op(qp, w, why);
      qp.sq_sent++;
      complete_send(qp, w, st, 0);
      did = true;
      if (st != IBV_WC_SUCCESS) {
        enter_error(qp, why);
        return true;
      }
      continue;
    }
    src_.clear();
    dst_.clear();
    uint64_t len = 0;
    uint8_t inline_copy[kMaxInline];
    const char* why = "";
    const ibv_wc_status st = local_check(qp, w, inline_copy, len, why);
    if (st != IBV_WC_SUCCESS) {
      if (!qp.unacked.empty()) break;  // completions stay in order: after what is in flight
      complete_send(qp, w, st, 0);
      enter_error(qp, why);
      qp.sq_sent = qp.sq_cons;
      return true;
    }
    qp.sq_sent++;
    did = true;
    qp.cnt.msgs_sent++;
    qp.cnt.bytes_sent += len;
    Qp::Outstanding o{w, qp.next_psn, static_cast<uint32_t>(len), false, {}};
    qp.next_psn = wire::psn_add(qp.next_psn, 1);
    if (qp.type == IBV_QPT_UC) {  // unreliable: sent once, lost if the connection is down
      send_request(qp, o);
      complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));
      continue;
    }
    qp.unacked.push_back(o);
    if (qp.wait == Wait::kNone) {
      qp.wait = Wait::kAck;
      qp.wait_until_ns = now_ns + ack_ns(qp);
    }
    // Not connected now: the ACK timeout or the reconnect replays it.
    send_request(qp, qp.unacked.back());
  }
  return did;
}

wire::Request Device::ud_request(const Qp& qp, const SendWqe& w, const UdDest& dest, uint64_t len) {
  wire::Request rq{};
  std::memcpy(rq.sgid, qp.guest->gid, 16);
  std::memcpy(rq.dgid, dest.dgid, 16);
  rq.slid = qp.guest->lid;
  rq.dlid = dest.dlid;
  rq.is_global = dest.is_global;
  rq.qp_type = IBV_QPT_UD;
  rq.sl = dest.sl;
  rq.src_qpn = qp.qpn;
  rq.dst_qpn = w.ud_remote_qpn & 0xffffff;
  rq.opcode = w.opcode;
  rq.send_flags = w.send_flags;
  rq.imm_data = w.imm_data;
  rq.length = static_cast<uint32_t>(len);
  // The high bit of the WR's qkey says "use the QP's own qkey" (IB spec 10.2.5).
  rq.qkey = (w.ud_remote_qkey & 0x80000000u) ? qp.attr.qkey : w.ud_remote_qkey;
  return rq;
}

void Device::send_ud_remote(Qp& qp, const SendWqe& w, const std::string& node, uint64_t len) {
  const wire::Request rq = ud_request(qp, w, unpack_ud_dest(w), len);
  // Datagrams are at most an MTU: the transport copies them, so no hold is needed.
  if (!transport_->send(node, Type::kRequest, &rq, src_, {})) qp.cnt.ud_dropped++;
  complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));
  qp.cnt.msgs_sent++;
  qp.cnt.bytes_sent += len;
}

void Device::on_peer_up(const std::string& node) {
  // Whatever was in flight on the old connection may be lost: replay it; duplicates are dropped
  // by the responder.
  for (Qp* qp : active_) {
    if (qp->remote && qp->peer_node == node && is_reliable(qp->type) && !qp->unacked.empty() &&
        sq_open(qp->state) && qp->wait != Wait::kRnr) {
      VLOG_DEBUG("qp {:#x}: peer {} back, replaying {} message(s)", qp->qpn, node,
                 qp->unacked.size());
      resend_all(*qp);
    }
  }
}

bool Device::uses_peer(const std::string& node) const {
  for (const Qp* qp : active_) {
    if (qp->remote && qp->peer_node == node && qp->state != IBV_QPS_ERR &&
        qp->state != IBV_QPS_RESET)
      return true;
  }
  return false;
}

Qp* Device::reply_target(const std::string& node, const wire::Reply& rp) {
  Guest* g = guest_by_gid(rp.dgid);
  if (!g) return nullptr;
  auto it = g->qps.find(rp.dst_qpn);
  if (it == g->qps.end()) return nullptr;
  Qp* qp = it->second;
  if (!is_reliable(qp->type) || !sq_open(qp->state)) return nullptr;
  if (!qp->remote || qp->peer_node != node || qp->attr.dest_qp_num != rp.src_qpn) {
    transport_->refused_frame(
        node, fmt::format("reply for qp {:#x} from qp {:#x}: {}", rp.dst_qpn, rp.src_qpn,
                          qp->remote && qp->peer_node == node ? "not the QP's peer QP"
                                                              : "the QP's peer is elsewhere"));
    return nullptr;
  }
  return qp;
}

void Device::on_reply(const std::string& node, const wire::Frame& f, transport::RxSink& sink) {
  const wire::Reply& rp = f.reply;
  Qp* qp = reply_target(node, rp);
  if (!qp) return;
  const uint64_t now = now_ns_;
  auto find = [&]() -> Qp::Outstanding* {
    for (Qp::Outstanding& o : qp->unacked) {
      if (o.psn == rp.psn) return &o;
    }
    return nullptr;
  };
  auto fail_front = [&](ibv_wc_status st, const char* why) {
    if (qp->unacked.empty() || qp->unacked.front().psn != rp.psn) return;
    const SendWqe w = qp->unacked.front().w;
    qp->unacked.pop_front();
    complete_send(*qp, w, st, 0);
    enter_error(*qp, why);
  };
  const uint32_t before = wire::psn_add(rp.psn, 0xffffff);  // rp.psn - 1
  switch (static_cast<Syndrome>(rp.syndrome)) {
    case Syndrome::kAck:
      acked(*qp, rp.psn, now);
      break;
    case Syndrome::kRnrNak:
      // A NAK of the responder's expected PSN says all before it executed; "not ready" does not:
      // the responder QP executed nothing yet, and it answers each request of the window, so
      // the NAK of the second message must not retire the first (it was lost that way).
      if (rp.status != wire::kRnrNotReady) acked(*qp, before, now);
      // Replays of the same message may bring the same NAK more than once: one wait.
      if (qp->unacked.empty() || qp->unacked.front().psn != rp.psn || qp->wait == Wait::kRnr) break;
      if (rp.status == wire::kRnrNotReady) {
        // The peer QP is not at RTR yet (it is being connected): what a fabric drops silently,
        // and the requester's transport retries ride out. Asked again after the timer, for
        // at most that same budget, spending no RNR retry.
        qp->cnt.rnr_naks++;
        if (!qp->not_ready_since_ns) qp->not_ready_since_ns = now;
        if (now - qp->not_ready_since_ns > ack_ns(*qp) * (qp->attr.retry_cnt + 1)) {
          fail_front(IBV_WC_RETRY_EXC_ERR,
                     "transport retries exhausted (the peer QP never became ready: not at RTR)");
          break;
        }
        qp->wait = Wait::kRnr;
        qp->wait_until_ns = now + rnr_delay_ns(rp.rnr_timer);
        break;
      }
      if (!rnr_wait(*qp, rp.rnr_timer, now, false))
        fail_front(IBV_WC_RNR_RETRY_EXC_ERR, "RNR retries exhausted");
      break;
    case Syndrome::kSeqNak:
      // The responder is missing `psn` (lost with a connection, or sent while an RNR wait was
      // being decided): everything before it executed, everything from it goes again. It
      // answered, so no retry is spent; it says so once per gap.
      acked(*qp, before, now);
      qp->cnt.seq_naks++;
      // (While a probe is out, its ACK sends the rest.)
      if (qp->unacked.empty() || qp->unacked.front().psn != rp.psn || qp->wait == Wait::kRnr ||
          qp->probe)
        break;
      qp->wait_until_ns = now + ack_ns(*qp);
      resend_all(*qp);
      break;
    case Syndrome::kErrNak:
      acked(*qp, before, now);
      fail_front(static_cast<ibv_wc_status>(rp.status), "NAK from the responder");
      break;
    case Syndrome::kReadData:
    case Syndrome::kAtomicData: {
      Qp::Outstanding* o = find();
      const bool read = static_cast<Syndrome>(rp.syndrome) == Syndrome::kReadData;
      if (!o || o->has_result ||
          (read ? o->w.opcode != IBV_WR_RDMA_READ || o->len != f.h.payload
                : !is_atomic(o->w.opcode)))
        break;  // a duplicate, or for a WQE already completed: dropped
      dst_.clear();
      holds_.clear();
      uint64_t len = 0;
      if (!resolve_sges(*qp, o->w.sge, o->w.num_sge, IBV_ACCESS_LOCAL_WRITE, dst_, len) ||
          len < o->len)
        break;  // the MR went away meanwhile: no completion; the requester times out
      trim(dst_, o->len);
      if (!read) {
        const Span result{reinterpret_cast<uint8_t*>(const_cast<uint64_t*>(&rp.atomic_orig)), 8};
        uintptr_t fault = 0;
        if (!guarded_copy({&result, 1}, dst_, 8, fault)) {
          VLOG_WARN(
              "guest {} QP {:#x}: memory at {:#x} faulted (SIGBUS/SIGSEGV) taking an "
              "atomic's result",
              qp->guest->name, qp->qpn, fault);
          fail_front(IBV_WC_LOC_PROT_ERR, "its memory faulted");
          break;
        }
        o->has_result = true;
        acked(*qp, rp.psn, now);
        break;
      }
      sge_holds(*qp, o->w.sge, o->w.num_sge, qp->pd);
      sink.spans.assign(dst_.begin(), dst_.end());
      sink.holds.assign(holds_.begin(), holds_.end());
      sink.accepted = true;
      break;
    }
    case Syndrome::kMax:
      break;
  }
}

}  // namespace vrdma::engine
