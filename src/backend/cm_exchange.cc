// The exchange between two ids (backend/cm.h): a message from one end to the other (here, or
// a kCm frame to a peer backend), what it does at the other end, what a peer backend sends, and
// the service's timers (address resolution, TIMEWAIT_EXIT, handshakes across hosts).
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "backend/cm.h"
#include "transport/transport.h"

namespace vrdma::backend {

using namespace vrdma::proto;
using wire::CmKind;

namespace {

std::string_view kind_name(CmKind k) {
  static constexpr std::string_view kNames[] = {"?",          "REQ",        "REP",  "SIDR REP",
                                                "REJ",        "RTU",        "DREQ", "GONE",
                                                "ADDR QUERY", "ADDR REPLY", "MOVED"};
  const auto i = static_cast<size_t>(k);
  return i < std::size(kNames) ? kNames[i] : "?";
}

}  // namespace

void CmService::tell(uint32_t from, Id& id, CmKind k, int32_t status, const CmQpInfo* qp,
                     std::span<const uint8_t> pdata) {
  if (id.node.empty()) {
    auto p = ids_.find(id.peer);
    if (id.peer && p != ids_.end()) receive(p->first, p->second, from, k, status, qp, pdata);
    return;
  }
  wire::Cm m{};
  m.kind = static_cast<uint8_t>(k);
  m.qp_type = id.qp_type;
  m.ps = id.ps;
  m.src_id = from;
  m.dst_id = id.peer;
  m.status = status;
  if (qp) m.qp = *qp;
  m.private_len = static_cast<uint32_t>(std::min(pdata.size(), kCmPrivateMax));
  if (m.private_len) std::memcpy(m.private_data, pdata.data(), m.private_len);
  if (Status st = wire::check_cm(m); !st.is_ok()) {  // the guest's QP description: not sent
    VLOG_WARN("cm: {} for {} not sent: {}", kind_name(k), id.node, st.message());
    if (k == CmKind::kRep) arm(from, id, kHandshakeStepMs, TimerKind::kHandshake);
    return;
  }
  if (k == CmKind::kRep) return send_handshake(from, id, m);
  // Lost with the connection: the other end's handshake timer, or its QP's, settles it.
  if (!transport_ || !transport_->send(id.node, wire::Type::kCm, &m))
    VLOG_INFO("cm: {} for {} not sent: no connection", kind_name(k), id.node);
}

bool CmService::offer_handshake(uint32_t h, Id& id, const wire::Cm& m) {
  if (!transport_ || !transport_->send(id.node, wire::Type::kCm, &m)) return false;
  id.unsent.reset();
  id.tries = 0;
  arm(h, id, kHandshakeStepMs, TimerKind::kHandshake);
  return true;
}

void CmService::send_handshake(uint32_t h, Id& id, const wire::Cm& m) {
  if (offer_handshake(h, id, m)) return;
  id.unsent = m;
  id.tries = 0;
  arm(h, id, kUnsentStepMs, TimerKind::kHandshake);
}

void CmService::receive(uint32_t h, Id& id, uint32_t from, CmKind k, int32_t status,
                        const CmQpInfo* qp, std::span<const uint8_t> pdata) {
  switch (k) {
    case CmKind::kReq:
      break;  // take_request's
    case CmKind::kRep:
      if (id.state != State::kReqSent) return;
      id.peer = from;
      set_state(id, State::kRepRcvd);
      disarm(id);
      emit(h, CmEventType::kConnectResponse, 0, qp, pdata);
      break;
    case CmKind::kSidrRep:
      if (id.state != State::kReqSent) return;
      id.peer = 0;
      set_state(id, State::kRouteResolved);
      disarm(id);
      emit(h, CmEventType::kEstablished, 0, qp, pdata);
      break;
    case CmKind::kRej:
      if (id.state != State::kReqSent && id.state != State::kRepSent) return;
      set_state(id, id.state == State::kReqSent ? State::kRouteResolved : State::kIdle);
      id.peer = 0;
      disarm(id);
      emit(h, CmEventType::kRejected, status, nullptr, pdata);
      break;
    case CmKind::kRtu:
      if (id.state != State::kRepSent) return;
      set_state(id, State::kEstablished);
      disarm(id);
      emit(h, CmEventType::kEstablished, 0);
      break;
    case CmKind::kDreq:
      if (id.state != State::kRepSent && id.state != State::kRepRcvd &&
          id.state != State::kEstablished)
        return;
      set_state(id, State::kDisconnected);
      id.peer = 0;
      disarm(id);
      emit(h, CmEventType::kDisconnected, 0);
      break;
    case CmKind::kGone:  // by where the handshake was
      id.peer = 0;
      disarm(id);
      switch (id.state) {
        case State::kReqSent:  // its listener side went away before accepting
          set_state(id, State::kRouteResolved);
          emit(h, CmEventType::kRejected, kCmRejTimeout);
          break;
        case State::kReqRcvd:  // its requester went away
          set_state(id, State::kIdle);
          emit(h, CmEventType::kRejected, kCmRejTimeout);
          break;
        case State::kRepSent:  // no RTU will come: the REP times out
          set_state(id, State::kIdle);
          emit(h, CmEventType::kUnreachable, -ETIMEDOUT);
          break;
        case State::kRepRcvd:
        case State::kEstablished:
          set_state(id, State::kDisconnected);
          emit(h, CmEventType::kDisconnected, 0);
          break;
        default:
          break;
      }
      break;
    case CmKind::kAddrQuery:  // on_addr_wire's and on_moved_wire's; never between two ids
    case CmKind::kAddrReply:
    case CmKind::kMoved:
    case CmKind::kMax:
      break;
  }
}

void CmService::on_wire(const std::string& node, const wire::Cm& m) {
  const auto k = static_cast<CmKind>(m.kind);  // in range: the codec checked it
  auto refuse = [&](const std::string& why) {
    if (transport_) transport_->refused_frame(node, fmt::format("cm {}: {}", kind_name(k), why));
  };
  const std::span<const uint8_t> pdata{m.private_data, m.private_len};
  if (k == CmKind::kAddrQuery || k == CmKind::kAddrReply) return on_addr_wire(node, m);
  if (k == CmKind::kMoved) return on_moved_wire(node, m);
  if (k == CmKind::kReq) {
    int32_t reason;
    if (take_request(node, m, reason)) return;
    wire::Cm rej{};
    rej.kind = static_cast<uint8_t>(CmKind::kRej);
    rej.src_id = kNone;  // no id here: the requester knows its REQ by its own id
    rej.dst_id = m.src_id;
    rej.status = reason;
    if (transport_) transport_->send(node, wire::Type::kCm, &rej);
    return;
  }
  if (m.dst_id == 0) {  // a requester's GONE before it heard from us: its request ids here
    if (k != CmKind::kGone) return refuse("no id named");
    std::vector<uint32_t> hs;
    for (const auto& [h, id] : ids_) {
      if (id.node == node && id.peer == m.src_id && id.state == State::kReqRcvd) hs.push_back(h);
    }
    for (uint32_t h : hs) receive(h, ids_.at(h), m.src_id, k, 0, nullptr, {});
    return;
  }
  auto it = ids_.find(m.dst_id);
  if (it == ids_.end()) {
    // Gone here meanwhile: an acceptor waiting for our RTU, or a requester for our REP's
    // answer, hears it now rather than by its timer.
    if (k == CmKind::kRep || k == CmKind::kRtu) {
      wire::Cm gone{};
      gone.kind = static_cast<uint8_t>(CmKind::kGone);
      gone.src_id = m.dst_id;
      gone.dst_id = m.src_id;
      if (transport_) transport_->send(node, wire::Type::kCm, &gone);
    }
    return;  // an id that went away: not the peer's fault
  }
  Id& id = it->second;
  const bool answer_to_req = id.peer == 0 && id.state == State::kReqSent &&
                             (k == CmKind::kRep || k == CmKind::kSidrRep || k == CmKind::kRej);
  if (id.node != node || (id.peer != m.src_id && !answer_to_req))
    return refuse(fmt::format("id {} is not the peer of its id {}", m.dst_id, m.src_id));
  if (k == CmKind::kSidrRep && id.qp_type != 4 /* IBV_QPT_UD */)
    return refuse("a SIDR REP to a connected id");
  receive(it->first, id, m.src_id, k, m.status, &m.qp, pdata);
}

void CmService::arm(uint32_t h, Id& id, uint64_t after_ms, TimerKind k) {
  disarm(id);
  if (k == TimerKind::kTimewait) id.timewait = true;
  id.timer = timers_.emplace(cm_clock_ns() + after_ms * 1000000, Timer{h, k});
  id.timer_armed = true;
  rearm_timerfd();
}

void CmService::disarm(Id& id) {
  if (!id.timer_armed) return;
  timers_.erase(id.timer);
  id.timer_armed = false;
}

void CmService::rearm_timerfd() {
  itimerspec its{};
  if (!timers_.empty()) {
    const uint64_t at = std::max<uint64_t>(timers_.begin()->first, 1);
    its.it_value.tv_sec = static_cast<time_t>(at / 1000000000);
    its.it_value.tv_nsec = static_cast<long>(at % 1000000000);
  }
  ::timerfd_settime(timer_.get(), TFD_TIMER_ABSTIME, &its, nullptr);
}

void CmService::on_timer() {
  uint64_t expirations;
  while (::read(timer_.get(), &expirations, sizeof(expirations)) > 0) {
  }
  const uint64_t now = cm_clock_ns();
  while (!timers_.empty() && timers_.begin()->first <= now) {
    const Timer t = timers_.begin()->second;
    timers_.erase(timers_.begin());
    auto it = ids_.find(t.id);  // always there: an id takes its timer with it
    if (it == ids_.end()) continue;
    Id& id = it->second;
    id.timer_armed = false;
    switch (t.kind) {
      case TimerKind::kAddr: {
        if (now >= id.resolve_deadline_ns) {
          emit(t.id, CmEventType::kAddrError, -ETIMEDOUT);
          break;
        }
        // Not answered yet: the address may be a peer's own now (a connection that was being
        // replaced is up again), else the peers are asked again.
        if (const std::string node = node_for(id.dst); !node.empty()) {
          resolve_to(t.id, id, node);
          break;
        }
        arm(t.id, id, std::min(kAddrAskMs, (id.resolve_deadline_ns - now + 999999) / 1000000),
            TimerKind::kAddr);
        ask_peers(t.id, id.dst);
        break;
      }
      case TimerKind::kTimewait:
        emit(t.id, CmEventType::kTimewaitExit, 0);
        break;
      case TimerKind::kHandshake: {
        if (id.state != State::kReqSent && id.state != State::kRepSent) break;
        if (id.unsent) {
          // Not taken by the transport yet: offered again, as a peer that is down after a while.
          if (offer_handshake(t.id, id, wire::Cm(*id.unsent))) break;
          if (++id.tries < kUnsentTries) {
            arm(t.id, id, kUnsentStepMs, TimerKind::kHandshake);
            break;
          }
          id.unsent.reset();
          VLOG_INFO("cm: id {}: no connection to {}; UNREACHABLE", t.id, id.node);
        } else {
          const auto up = peers_ ? peers_() : std::vector<std::string>{};
          if (std::find(up.begin(), up.end(), id.node) != up.end() &&
              ++id.tries < kHandshakeTries) {
            arm(t.id, id, kHandshakeStepMs, TimerKind::kHandshake);
            break;
          }
          VLOG_INFO("cm: id {}: no answer from {}; UNREACHABLE", t.id, id.node);
        }
        tell(t.id, id, CmKind::kGone);
        set_state(id, id.state == State::kReqSent ? State::kRouteResolved : State::kIdle);
        id.peer = 0;
        emit(t.id, CmEventType::kUnreachable, -ETIMEDOUT);
        break;
      }
    }
  }
  rearm_timerfd();
}

}  // namespace vrdma::backend
