#include "backend/cm.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "engine/device.h"
#include "transport/transport.h"

namespace vrdma::backend {

using namespace vrdma::proto;
using wire::CmKind;

namespace {

constexpr uint16_t kEphemeralFirst = 32768, kEphemeralCount = 28232;  // Linux's 32768..60999
constexpr int kEventSocketBuffer = 1 << 20;  ///< capped by net.core.wmem_max
/// What one session may hold: each channel is a descriptor in the backend, each id a record.
constexpr uint32_t kMaxChannelsPerSession = 1024;
constexpr uint32_t kMaxIdsPerSession = 16384;
/// rdma_listen's backlog: 1..1024, as the kernel's ucma clamps it (its max_backlog default).
constexpr uint32_t kMaxBacklog = 1024;
/// TIMEWAIT_EXIT follows an end's DREQ or DREP by this much: the IB CM's timewait keeps a QPN
/// from being reused while late packets may arrive; over the transport none arrive late.

}  // namespace

uint64_t cm_clock_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

namespace {

bool is_wildcard(const CmAddr& a) {
  static constexpr uint8_t kZero[16] = {};
  return std::memcmp(a.addr, kZero, a.family == AF_INET ? 4 : 16) == 0;
}

bool same_addr(const CmAddr& a, const CmAddr& b) {
  return a.family == b.family && std::memcmp(a.addr, b.addr, a.family == AF_INET ? 4 : 16) == 0;
}

bool is_loopback(const CmAddr& a) {
  static constexpr uint8_t kLoop6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  return (a.family == AF_INET && a.addr[0] == 127) ||
         (a.family == AF_INET6 && std::memcmp(a.addr, kLoop6, 16) == 0);
}

/// Whether `a` names this host (in the backend's network namespace): loopback, or an address
/// a socket can bind to. Every such address is vrdma0 port 1 here.
bool bindable_here(const CmAddr& a) {
  if (a.family != AF_INET && a.family != AF_INET6) return false;
  if (is_loopback(a)) return true;
  if (is_wildcard(a)) return true;
  UniqueFd s(::socket(a.family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) return false;
  sockaddr_storage ss{};
  socklen_t len;
  if (a.family == AF_INET) {
    auto* sin = reinterpret_cast<sockaddr_in*>(&ss);
    sin->sin_family = AF_INET;
    std::memcpy(&sin->sin_addr, a.addr, 4);
    len = sizeof(*sin);
  } else {
    auto* sin6 = reinterpret_cast<sockaddr_in6*>(&ss);
    sin6->sin6_family = AF_INET6;
    sin6->sin6_scope_id = a.scope_id;
    std::memcpy(&sin6->sin6_addr, a.addr, 16);
    len = sizeof(*sin6);
  }
  return ::bind(s.get(), reinterpret_cast<sockaddr*>(&ss), len) == 0;
}

bool valid_family(const CmAddr& a) { return a.family == AF_INET || a.family == AF_INET6; }

}  // namespace

bool is_multicast(const CmAddr& a) {
  return (a.family == AF_INET && (a.addr[0] & 0xf0) == 0xe0) ||
         (a.family == AF_INET6 && a.addr[0] == 0xff);
}

namespace {

/// Where this host sends to `dst` from (the kernel's route, as a connected UDP socket shows),
/// or the errno of a destination no route reaches (ENETUNREACH).
Result<CmAddr> route_source(const CmAddr& dst) {
  UniqueFd s(::socket(dst.family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) return error(errno, "socket");
  sockaddr_storage ss{};
  socklen_t len;
  if (dst.family == AF_INET) {
    auto* sin = reinterpret_cast<sockaddr_in*>(&ss);
    sin->sin_family = AF_INET;
    sin->sin_port = htons(dst.port ? dst.port : 9);
    std::memcpy(&sin->sin_addr, dst.addr, 4);
    len = sizeof(*sin);
  } else {
    auto* sin6 = reinterpret_cast<sockaddr_in6*>(&ss);
    sin6->sin6_family = AF_INET6;
    sin6->sin6_port = htons(dst.port ? dst.port : 9);
    sin6->sin6_scope_id = dst.scope_id;
    std::memcpy(&sin6->sin6_addr, dst.addr, 16);
    len = sizeof(*sin6);
  }
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&ss), len) < 0)
    return error(errno, "no route to the address");
  len = sizeof(ss);
  if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&ss), &len) < 0)
    return error(errno, "getsockname");
  CmAddr src{};
  src.family = dst.family;
  if (dst.family == AF_INET) {
    std::memcpy(src.addr, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, 4);
  } else {
    std::memcpy(src.addr, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, 16);
    src.scope_id = reinterpret_cast<sockaddr_in6*>(&ss)->sin6_scope_id;
  }
  return src;
}

}  // namespace

CmService::CmService() : timer_(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)) {
  if (::getrandom(&next_handle_, sizeof(next_handle_), 0) != sizeof(next_handle_))
    next_handle_ = static_cast<uint32_t>(cm_clock_ns());
}

uint32_t CmService::new_handle() {
  for (;;) {
    const uint32_t h = next_handle_++;
    if (h != 0 && h != kNone && !ids_.count(h) && !channels_.count(h)) return h;
  }
}

void CmService::set_transport(transport::Transport* t,
                              std::function<std::vector<std::string>()> peers) {
  transport_ = t;
  peers_ = std::move(peers);
}

CmService::Id* CmService::find(const engine::Session& s, uint32_t id) {
  auto it = ids_.find(id);
  return it == ids_.end() || it->second.owner != s.id ? nullptr : &it->second;
}

std::vector<uint8_t> CmService::handle(const engine::Session& s, const MsgHeader& h,
                                       std::span<const uint8_t> msg, UniqueFd& give) {
  const Op op = static_cast<Op>(h.op);
  note(s.id);  // its ids, channels or waiting events (keep_state: a failed command costs a look)
  auto fail = [&](int err) { return encode(op, h.seq, -err, Empty{}); };
  auto done = [&](const Status& st) {
    if (!st.is_ok()) VLOG_DEBUG("cm: {} failed: {}", op_name(h.op), st.message());
    return encode(op, h.seq, -st.err(), Empty{});
  };
  flush_backlogs(s.id);  // the library that sends a command reads too
  sweep_closing();
  // Every body starts with the id (or channel) handle it is about.
  uint32_t handle = 0;
  if (msg.size() >= sizeof(MsgHeader) + 4) std::memcpy(&handle, msg.data() + sizeof(MsgHeader), 4);
  switch (op) {
    case Op::kCmCreateChannel:
      return create_channel(s, h, give);
    case Op::kCmDestroyChannel: {
      auto it = channels_.find(handle);
      if (it == channels_.end() || it->second.owner != s.id) return fail(ENOENT);
      // Not closed yet: a thread of the guest may still be blocked reading its end, which must
      // stay blocked (as on a kernel's rdma_cm fd), not see the end of the stream.
      closing_.emplace_back(s.id, std::move(it->second.sock));
      channels_.erase(it);  // still counted in usage_ until sweep_closing closes it
      return done(Status::ok());
    }
    case Op::kCmCreateId: {
      const auto r = body_of<CmCreateIdReq>(msg).value();
      auto ch = channels_.find(r.channel);
      if (ch == channels_.end() || ch->second.owner != s.id) return fail(ENOENT);
      if (usage_[s.id].ids >= kMaxIdsPerSession) return fail(ENOMEM);
      ++usage_[s.id].ids;
      const uint32_t id = new_handle();
      Id& n = ids_[id];
      n.owner = s.id;
      n.channel = r.channel;
      n.ps = r.port_space;
      n.qp_type = r.qp_type;
      return encode(op, h.seq, 0, HandleResp{id, 0});
    }
    case Op::kCmMigrateId: {
      const auto r = body_of<CmMigrateReq>(msg).value();
      Id* id = find(s, r.id);
      auto ch = channels_.find(r.channel);
      if (!id || ch == channels_.end() || ch->second.owner != s.id) return fail(ENOENT);
      id->channel = r.channel;
      return done(Status::ok());
    }
    default:
      break;
  }
  Id* id = find(s, handle);
  if (!id) return fail(ENOENT);
  switch (op) {
    case Op::kCmDestroyId:
      abandon(handle, *id);
      disarm(*id);
      ids_.erase(handle);
      --usage_[s.id].ids;
      return done(Status::ok());
    case Op::kCmBind: {
      Status st = bind(handle, *id, body_of<CmAddrReq>(msg).value().addr);
      if (!st.is_ok()) return done(st);
      return encode(op, h.seq, 0, CmAddrResp{id->src});
    }
    case Op::kCmListen: {
      const int32_t want = static_cast<int32_t>(body_of<CmListenReq>(msg).value().backlog);
      const uint32_t backlog = want > 0 && uint32_t(want) < kMaxBacklog ? want : kMaxBacklog;
      if (id->state == State::kListen) {  // a new backlog
        id->backlog = backlog;
        return done(Status::ok());
      }
      if (id->state == State::kIdle) {
        // Unbound: the wildcard address, an ephemeral port (as rdma_listen does).
        CmAddr any{};
        any.family = AF_INET6;
        Status st = bind(handle, *id, any);
        if (!st.is_ok()) return done(st);
      }
      if (id->state != State::kBound) return fail(EINVAL);
      id->state = State::kListen;
      id->backlog = backlog;
      return done(Status::ok());
    }
    case Op::kCmResolveAddr:
      return done(resolve_addr(handle, *id, body_of<CmResolveReq>(msg).value()));
    case Op::kCmResolveRoute: {
      if (id->state != State::kAddrResolved && id->state != State::kRouteResolved)
        return fail(EINVAL);
      id->state = State::kRouteResolved;
      emit(handle, CmEventType::kRouteResolved, 0);
      return done(Status::ok());
    }
    case Op::kCmConnect:
      return done(connect(handle, *id, body_of<CmConnReq>(msg).value()));
    case Op::kCmAccept:
      return done(accept(handle, *id, body_of<CmConnReq>(msg).value()));
    case Op::kCmReject:
      return done(reject(handle, *id, body_of<CmConnReq>(msg).value()));
    case Op::kCmEstablish:
      return done(establish(handle, *id));
    case Op::kCmDisconnect:
      return done(disconnect(handle, *id));
    case Op::kCmJoinMcast:
      return done(join_mcast(handle, *id, body_of<CmAddrReq>(msg).value().addr));
    case Op::kCmLeaveMcast:  // the library detaches its QP; the group has no state here
      return done(is_multicast(body_of<CmAddrReq>(msg).value().addr)
                      ? Status::ok()
                      : error(EINVAL, "not a multicast address"));
    default:
      return fail(EOPNOTSUPP);
  }
}

std::vector<uint8_t> CmService::create_channel(const engine::Session& s, const MsgHeader& h,
                                               UniqueFd& give) {
  if (usage_[s.id].channels >= kMaxChannelsPerSession)
    return encode(Op::kCmCreateChannel, h.seq, -EMFILE, Empty{});
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
    return encode(Op::kCmCreateChannel, h.seq, -errno, Empty{});
  UniqueFd mine(sv[0]);
  give.reset(sv[1]);
  // Ours never blocks the server thread: what finds no room waits in the backlog.
  int fl = ::fcntl(mine.get(), F_GETFL);
  ::fcntl(mine.get(), F_SETFL, fl | O_NONBLOCK);
  ::setsockopt(mine.get(), SOL_SOCKET, SO_SNDBUF, &kEventSocketBuffer, sizeof(kEventSocketBuffer));
  ::shutdown(give.get(), SHUT_WR);  // the library only reads it
  ++usage_[s.id].channels;
  const uint32_t handle = new_handle();
  Channel& ch = channels_[handle];
  ch.owner = s.id;
  ch.sock = std::move(mine);
  return encode(Op::kCmCreateChannel, h.seq, 0, HandleResp{handle, 0});
}

Status CmService::take_port(uint32_t handle, Id& id, uint16_t port) {
  if (port == 0) {
    for (uint32_t i = 0; i < kEphemeralCount; ++i) {
      const uint16_t p = kEphemeralFirst + (next_ephemeral_++ % kEphemeralCount);
      if (!ports_.count({id.ps, p})) {
        port = p;
        break;
      }
    }
    if (port == 0) return error(EADDRINUSE, "no ephemeral port left");
  } else if (ports_.count({id.ps, port})) {
    return error(EADDRINUSE, "port in use");
  }
  ports_[{id.ps, port}] = handle;
  id.src.port = port;
  id.holds_port = true;
  return Status::ok();
}

void CmService::release_port(Id& id) {
  if (!id.holds_port) return;
  auto it = ports_.find({id.ps, id.src.port});
  if (it != ports_.end()) ports_.erase(it);
  id.holds_port = false;
}

Status CmService::bind(uint32_t handle, Id& id, const CmAddr& a) {
  if (id.state != State::kIdle) return error(EINVAL, "already bound");
  if (!valid_family(a)) return error(EAFNOSUPPORT, "not an IP address");
  if (!local(a)) return error(EADDRNOTAVAIL, "not an address of this host");
  id.src = a;
  RETURN_IF_ERROR(take_port(handle, id, a.port));
  id.state = State::kBound;
  return Status::ok();
}

Status CmService::resolve_addr(uint32_t handle, Id& id, const CmResolveReq& r) {
  if (!valid_family(r.dst)) return error(EAFNOSUPPORT, "not an IP address");
  if (id.state != State::kIdle && id.state != State::kBound && id.state != State::kAddrResolved &&
      id.state != State::kRouteResolved)
    return error(EINVAL, "resolve_addr on an id in use");
  CmAddr src = r.src;
  std::string node;
  if (is_wildcard(r.dst)) {
    id.dst = r.dst;
    emit(handle, CmEventType::kAddrError, -EHOSTUNREACH);
    return Status::ok();
  }
  if (!is_multicast(r.dst) && !local(r.dst)) {
    // Another host: as the kernel, an address no route reaches fails now; one on a network
    // whose host has no backend is a neighbour that never answers: ADDR_ERROR after the
    // timeout (-ETIMEDOUT, as an ARP request that got no reply).
    ASSIGN_OR_RETURN(CmAddr via, route_source(r.dst));
    if (!src.family) src = via;
    node = node_for(r.dst);
    if (node.empty()) {
      // Not a peer's transport address: the peers are asked whose host it is (an IPv6
      // address, a peer's second address), as a neighbour solicitation; the first answer
      // resolves it (on_wire), none by the timeout is ADDR_ERROR; asked again every
      // kAddrAskMs meanwhile (on_timer).
      id.dst = r.dst;
      id.resolve_src = src;
      const uint64_t timeout_ms = r.timeout_ms ? r.timeout_ms : 2000;
      id.resolve_deadline_ns = cm_clock_ns() + timeout_ms * 1000000;
      arm(handle, id, std::min(timeout_ms, kAddrAskMs), TimerKind::kAddr);
      note(id.owner);  // keep_state: the keeper's copy carries the resolution too
      ask_peers(handle, r.dst);
      return Status::ok();
    }
  } else if (!src.family && is_multicast(r.dst)) {
    // A group: joined from the host's address toward it (loopback when no route says).
    auto via = route_source(r.dst);
    src = via.is_ok() ? via.value() : CmAddr{};
    if (!via.is_ok()) {
      src.family = r.dst.family;
      if (src.family == AF_INET)
        src.addr[0] = 127, src.addr[3] = 1;
      else
        src.addr[15] = 1;
    }
  } else if (!src.family) {
    src = r.dst;  // a local destination is reached from itself
    src.port = 0;
  }
  return resolved(handle, id, src, r.dst, node);
}

Status CmService::resolved(uint32_t handle, Id& id, const CmAddr& src, const CmAddr& dst,
                           const std::string& node) {
  if (id.state == State::kIdle) RETURN_IF_ERROR(bind(handle, id, src));
  id.dst = dst;
  id.node = node;
  if (is_wildcard(id.src)) {
    const uint16_t port = id.src.port;
    id.src = src.family ? src : dst;
    id.src.port = port;
  }
  id.state = State::kAddrResolved;
  disarm(id);  // an earlier resolution's timeout
  emit(handle, CmEventType::kAddrResolved, 0);
  return Status::ok();
}

void CmService::ask_peers(uint32_t handle, const CmAddr& dst) {
  if (!transport_ || !peers_) return;
  wire::Cm q{};
  q.kind = static_cast<uint8_t>(CmKind::kAddrQuery);
  q.src_id = handle;
  q.dst = dst;
  for (const std::string& n : peers_()) transport_->send(n, wire::Type::kCm, &q);
}

void CmService::on_addr_wire(const std::string& node, const wire::Cm& m) {
  if (m.kind == static_cast<uint8_t>(CmKind::kAddrQuery)) {
    // Ours when a connection to it would reach a listener here (take_request's rule).
    if (is_wildcard(m.dst) || is_loopback(m.dst) || is_multicast(m.dst) || !local(m.dst))
      return;  // not ours: silence, as a host that is not the neighbour asked for
    wire::Cm a{};
    a.kind = static_cast<uint8_t>(CmKind::kAddrReply);
    a.src_id = kNone;
    a.dst_id = m.src_id;
    a.dst = m.dst;
    if (transport_) transport_->send(node, wire::Type::kCm, &a);
    return;
  }
  // A reply: only to an id that asked (its kAddr timer runs) for that address.
  auto it = ids_.find(m.dst_id);
  if (it == ids_.end()) return;  // gone meanwhile
  Id& id = it->second;
  if (!id.timer_armed || id.timer->second.kind != TimerKind::kAddr || !same_addr(id.dst, m.dst)) {
    // Asked again until answered (kAddrAskMs), or answered after the timeout: a late answer.
    if (same_addr(id.dst, m.dst)) return;
    if (transport_) transport_->refused_frame(node, "cm address reply nobody asked for");
    return;
  }
  resolve_to(it->first, id, node);
}

void CmService::resolve_to(uint32_t h, Id& id, const std::string& node) {
  const CmAddr dst = id.dst;
  if (Status st = resolved(h, id, id.resolve_src, dst, node); !st.is_ok()) {
    disarm(id);
    emit(h, CmEventType::kAddrError, -st.err());
  }
}

bool CmService::local(const CmAddr& a) {
  // A connection's setup asks about the same address two or three times (resolve, bind, a
  // peer's REQ); each answer of the kernel is a socket, a bind and a close.
  const uint64_t now = cm_clock_ns();
  for (const auto& [addr, at] : local_cache_) {
    if (now - at < kLocalCacheNs && same_addr(addr, a) && addr.scope_id == a.scope_id) return true;
  }
  if (!bindable_here(a)) return false;
  std::erase_if(local_cache_, [now](const auto& e) { return now - e.second >= kLocalCacheNs; });
  if (local_cache_.size() < kLocalCacheSize) local_cache_.emplace_back(a, now);
  return true;
}

std::string CmService::node_for(const CmAddr& a) const {
  if (!transport_ || !peers_ || a.family != AF_INET) return {};
  uint32_t want;
  std::memcpy(&want, a.addr, 4);
  for (const std::string& n : peers_()) {
    if (transport_->peer_ipv4(n) == want) return n;
  }
  return {};
}

uint32_t CmService::listener_for(uint16_t ps, const CmAddr& dst) const {
  auto it = ports_.find({ps, dst.port});
  if (it == ports_.end()) return 0;
  auto l = ids_.find(it->second);
  if (l == ids_.end() || l->second.state != State::kListen) return 0;
  if (!is_wildcard(l->second.src) && !same_addr(l->second.src, dst)) return 0;
  return it->second;
}

void CmService::set_state(Id& id, State st) {
  if (id.state == State::kReqRcvd && st != State::kReqRcvd && id.listener) {
    if (auto l = ids_.find(id.listener); l != ids_.end() && l->second.pending) --l->second.pending;
    id.listener = 0;
  }
  id.state = st;
  note(id.owner);
}

uint32_t CmService::take_request(const std::string& node, const wire::Cm& m, int32_t& reason) {
  reason = kCmRejInvalidService;
  // From a peer: the address it connects to must be this host's (ours are, by resolve_addr),
  // and not loopback: a listener there is for this host only, as a TCP one on 127.0.0.1.
  if (!node.empty() && (is_wildcard(m.dst) || is_loopback(m.dst) || !local(m.dst))) return 0;
  const uint32_t lh = listener_for(m.ps, m.dst);
  if (!lh) return 0;
  Id& l = ids_.at(lh);
  if (usage_[l.owner].ids >= kMaxIdsPerSession) return 0;  // refused as if nobody listened
  if (l.pending >= l.backlog) {
    // As the kernel's ucma with its backlog used up: the IB CM rejects (consumer defined).
    reason = kCmRejConsumer;
    return 0;
  }
  ++l.pending;
  ++usage_[l.owner].ids;
  const uint32_t nh = new_handle();
  Id& n = ids_[nh];  // may rehash: `l` is not used below
  const Id& lst = ids_.at(lh);
  n.owner = lst.owner;
  n.channel = lst.channel;
  n.ps = lst.ps;
  n.qp_type = m.qp_type;
  n.state = State::kReqRcvd;
  n.src = m.dst;
  n.dst = m.src;
  n.peer = m.src_id;
  n.node = node;
  n.listener = lh;
  emit(nh, CmEventType::kConnectRequest, 0, &m.qp, {m.private_data, m.private_len}, lh);
  return nh;
}

Status CmService::connect(uint32_t handle, Id& id, const CmConnReq& r) {
  if (id.state != State::kAddrResolved && id.state != State::kRouteResolved)
    return error(EINVAL, "connect before the address is resolved");
  if (r.private_len > cm_private_limit(id.ps, r.qp.qp_type, Op::kCmConnect))
    return error(EINVAL, "private data too long");
  id.qp = r.qp;
  wire::Cm m{};
  m.kind = static_cast<uint8_t>(CmKind::kReq);
  m.qp_type = r.qp.qp_type;
  m.ps = id.ps;
  m.src_id = handle;
  m.src = id.src;
  m.dst = id.dst;
  m.qp = r.qp;
  m.private_len = r.private_len;
  std::memcpy(m.private_data, r.private_data, r.private_len);
  // What a peer's codec would refuse (and close the connection for) is the guest's error.
  if (Status st = wire::check_cm(m); !st.is_ok()) return error(EINVAL, st.message());
  if (!id.node.empty()) {  // to the backend of that host
    set_state(id, State::kReqSent);
    id.peer = 0;  // its id there is known from its answer
    send_handshake(handle, id, m);
    return Status::ok();
  }
  int32_t reason;
  const uint32_t nh = take_request("", m, reason);  // may rehash: `id` is looked up again
  if (!nh) {
    emit(handle, CmEventType::kRejected, reason);
    return Status::ok();
  }
  Id& a = ids_.at(handle);
  a.peer = nh;
  set_state(a, State::kReqSent);
  return Status::ok();
}

Status CmService::accept(uint32_t handle, Id& id, const CmConnReq& r) {
  if (id.state != State::kReqRcvd) return error(EINVAL, "accept of no connect request");
  if (r.private_len > cm_private_limit(id.ps, id.qp_type, Op::kCmAccept))
    return error(EINVAL, "private data too long");
  if (id.node.empty() && !ids_.count(id.peer)) return error(ECONNRESET, "the requester is gone");
  id.qp = r.qp;
  const std::span<const uint8_t> pdata{r.private_data, r.private_len};
  if (id.qp_type == 4 /* IBV_QPT_UD: SIDR, no connection */) {
    set_state(id, State::kIdle);
    tell(handle, id, CmKind::kSidrRep, 0, &r.qp, pdata);
    id.peer = 0;
    return Status::ok();
  }
  set_state(id, State::kRepSent);
  tell(handle, id, CmKind::kRep, 0, &r.qp, pdata);  // (its timer: send_handshake)
  return Status::ok();
}

Status CmService::reject(uint32_t handle, Id& id, const CmConnReq& r) {
  if (id.state != State::kReqRcvd && id.state != State::kRepRcvd)
    return error(EINVAL, "nothing to reject");
  if (r.private_len > cm_private_limit(id.ps, id.qp_type, Op::kCmReject))
    return error(EINVAL, "private data too long");
  tell(handle, id, CmKind::kRej, kCmRejConsumer, nullptr, {r.private_data, r.private_len});
  set_state(id, id.state == State::kReqRcvd ? State::kIdle : State::kRouteResolved);
  id.peer = 0;
  return Status::ok();
}

Status CmService::establish(uint32_t handle, Id& id) {
  if (id.state != State::kRepRcvd) return error(EINVAL, "no connect response to confirm");
  if (id.node.empty() && !ids_.count(id.peer)) return error(ECONNRESET, "the acceptor is gone");
  set_state(id, State::kEstablished);
  tell(handle, id, CmKind::kRtu);
  return Status::ok();
}

Status CmService::disconnect(uint32_t handle, Id& id) {
  switch (id.state) {
    case State::kDisconnected:
      // The answer (DREP) to the peer's DREQ: this end's timewait starts.
      if (!id.timewait) arm(handle, id, kTimewaitMs, TimerKind::kTimewait);
      return Status::ok();
    case State::kReqSent:
    case State::kReqRcvd:
      abandon(handle, id);
      set_state(id, State::kIdle);
      return Status::ok();
    case State::kRepSent:
    case State::kRepRcvd:
    case State::kEstablished:
      break;
    default:
      return error(EINVAL, "not connected");
  }
  tell(handle, id, CmKind::kDreq);
  set_state(id, State::kDisconnected);
  id.peer = 0;
  emit(handle, CmEventType::kDisconnected, 0);  // as the DREP comes back
  arm(handle, id, kTimewaitMs, TimerKind::kTimewait);
  return Status::ok();
}

void CmService::abandon(uint32_t handle, Id& id) {
  release_port(id);
  // A requester whose REQ is not answered yet does not know its peer's id: the peer backend
  // finds the request by ours (dst_id 0).
  if (id.peer || (!id.node.empty() && id.state == State::kReqSent)) tell(handle, id, CmKind::kGone);
  if (id.state == State::kReqRcvd) set_state(id, State::kIdle);  // leaves the backlog
  id.peer = 0;
}

Status CmService::join_mcast(uint32_t handle, Id& id, const CmAddr& group) {
  if (!is_multicast(group)) return error(EINVAL, "not a multicast address");
  if (id.state != State::kBound && id.state != State::kAddrResolved &&
      id.state != State::kRouteResolved)
    return error(EINVAL, "join before the id has an address");
  // The group's GID: an IPv6 group is its own; an IPv4 one maps as IPoIB maps it
  // (ff12:401b:<pkey>::<address>). Its LID: a multicast LID from the GID.
  CmQpInfo g{};
  if (group.family == AF_INET6) {
    std::memcpy(g.gid, group.addr, 16);
  } else {
    static constexpr uint8_t kPrefix[6] = {0xff, 0x12, 0x40, 0x1b, 0xff, 0xff};
    std::memcpy(g.gid, kPrefix, sizeof(kPrefix));
    std::memcpy(g.gid + 12, group.addr, 4);
  }
  uint32_t h = 2166136261u;  // FNV-1a
  for (uint8_t b : g.gid) h = (h ^ b) * 16777619u;
  g.lid = static_cast<uint16_t>(0xc000 + h % 0x3fff);
  g.qpn = 0xffffff;
  g.qp_type = 4;        // IBV_QPT_UD
  g.qkey = 0x01234567;  // RDMA_UDP_QKEY, what rdma_cm gives UDP and IPoIB groups
  g.mtu = 5;            // IBV_MTU_4096
  emit(handle, CmEventType::kMulticastJoin, 0, &g, {}, kNone, &group);
  return Status::ok();
}

void CmService::session_closed(const engine::Session* session) {
  // Peers hear of its ids in the order they were made.
  for (uint32_t h : ids_of(session->id)) {
    auto it = ids_.find(h);
    abandon(h, it->second);
    disarm(it->second);
    ids_.erase(it);
  }
  forget_channels(session->id);
}

std::vector<uint32_t> CmService::ids_of(uint32_t session) const {
  std::vector<uint32_t> hs;
  for (const auto& [h, id] : ids_) {
    if (id.owner == session) hs.push_back(h);
  }
  std::sort(hs.begin(), hs.end());
  return hs;
}

void CmService::forget_channels(uint32_t session) {
  std::erase_if(channels_, [&](const auto& kv) {
    if (kv.second.owner != session) return false;
    backlogged_.erase(kv.first);
    return true;
  });
  std::erase_if(closing_, [session](const auto& c) { return c.first == session; });
  usage_.erase(session);
}

void CmService::sweep_closing() {
  std::erase_if(closing_, [this](const auto& c) {
    pollfd p{c.second.get(), 0, 0};
    if (::poll(&p, 1, 0) == 0) return false;  // POLLHUP: the guest's end is closed
    --usage_[c.first].channels;
    return true;
  });
}

void CmService::emit(uint32_t handle, CmEventType ev, int32_t status, const CmQpInfo* peer,
                     std::span<const uint8_t> pdata, uint32_t listen_id, const CmAddr* dst) {
  auto it = ids_.find(handle);
  if (it == ids_.end()) return;
  auto ch = channels_.find(it->second.channel);
  if (ch == channels_.end()) return;
  note(it->second.owner);
  CmEvent e{};
  e.event = static_cast<uint32_t>(ev);
  e.status = status;
  e.id = handle;
  e.listen_id = listen_id;
  e.src = it->second.src;
  e.dst = dst ? *dst : it->second.dst;
  if (peer) e.peer = *peer;
  e.private_len = static_cast<uint32_t>(std::min(pdata.size(), kCmPrivateMax));
  if (e.private_len) std::memcpy(e.private_data, pdata.data(), e.private_len);
  ch->second.backlog.push_back(encode(Op::kCmEvent, 0, 0, e));
  flush(ch->second);
  if (!ch->second.backlog.empty()) backlogged_.insert(ch->first);
}

void CmService::flush_backlogs(uint32_t session) {
  for (auto it = backlogged_.begin(); it != backlogged_.end();) {
    auto ch = channels_.find(*it);
    if (ch != channels_.end() && ch->second.owner == session) flush(ch->second);
    if (ch == channels_.end() || ch->second.backlog.empty())
      it = backlogged_.erase(it);
    else
      ++it;
  }
}

void CmService::flush(Channel& ch) {
  while (!ch.backlog.empty()) {
    const auto& m = ch.backlog.front();
    if (::send(ch.sock.get(), m.data(), m.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        uint64_t held = 0;
        if (backlog_log_.ready(cm_clock_ns(), held))
          VLOG_WARN("cm: an event channel is full ({} events waiting){}", ch.backlog.size(),
                    log::held_note(held));
        return;
      }
      ch.backlog.clear();  // the library closed it: nobody will read them
      return;
    }
    ch.backlog.pop_front();
  }
}

}  // namespace vrdma::backend
