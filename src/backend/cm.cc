#include "backend/cm.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "engine/device.h"

namespace vrdma::backend {

using namespace vrdma::proto;

namespace {

constexpr uint16_t kEphemeralFirst = 32768, kEphemeralCount = 28232;  // Linux's 32768..60999
constexpr int kEventSocketBuffer = 1 << 20;  ///< capped by net.core.wmem_max
/// What one session may hold: each channel is a descriptor in the backend, each id a record.
constexpr uint32_t kMaxChannelsPerSession = 1024;
constexpr uint32_t kMaxIdsPerSession = 16384;

uint64_t cm_clock_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

bool is_wildcard(const CmAddr& a) {
  static constexpr uint8_t kZero[16] = {};
  return std::memcmp(a.addr, kZero, a.family == AF_INET ? 4 : 16) == 0;
}

bool same_addr(const CmAddr& a, const CmAddr& b) {
  return a.family == b.family && std::memcmp(a.addr, b.addr, a.family == AF_INET ? 4 : 16) == 0;
}

/// Whether `a` names this host (in the backend's network namespace): loopback, or an address
/// a socket can bind to. Every such address is vrdma0 port 1 here.
bool is_local(const CmAddr& a) {
  if (a.family == AF_INET) {
    if (a.addr[0] == 127) return true;
  } else if (a.family == AF_INET6) {
    static constexpr uint8_t kLoop6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    if (std::memcmp(a.addr, kLoop6, 16) == 0) return true;
  } else {
    return false;
  }
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

CmService::Id* CmService::find(const engine::Session& s, uint32_t id) {
  auto it = ids_.find(id);
  return it == ids_.end() || it->second.owner != s.id ? nullptr : &it->second;
}

std::vector<uint8_t> CmService::handle(const engine::Session& s, const MsgHeader& h,
                                       std::span<const uint8_t> msg, UniqueFd& give) {
  const Op op = static_cast<Op>(h.op);
  auto fail = [&](int err) { return encode(op, h.seq, -err, Empty{}); };
  auto done = [&](const Status& st) {
    if (!st.is_ok()) VLOG_DEBUG("cm: {} failed: {}", op_name(h.op), st.message());
    return encode(op, h.seq, -st.err(), Empty{});
  };
  // Events that found no room before: the library that sends a command reads too.
  for (auto it = backlogged_.begin(); it != backlogged_.end();) {
    auto ch = channels_.find(*it);
    if (ch != channels_.end() && ch->second.owner == s.id) flush(ch->second);
    if (ch == channels_.end() || ch->second.backlog.empty())
      it = backlogged_.erase(it);
    else
      ++it;
  }
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
      const uint32_t id = next_handle_++;
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
      abandon(*id);
      ids_.erase(handle);
      --usage_[s.id].ids;
      return done(Status::ok());
    case Op::kCmBind: {
      Status st = bind(handle, *id, body_of<CmAddrReq>(msg).value().addr);
      if (!st.is_ok()) return done(st);
      return encode(op, h.seq, 0, CmAddrResp{id->src});
    }
    case Op::kCmListen: {
      if (id->state == State::kListen) return done(Status::ok());  // a new backlog
      if (id->state == State::kIdle) {
        // Unbound: the wildcard address, an ephemeral port (as rdma_listen does).
        CmAddr any{};
        any.family = AF_INET6;
        Status st = bind(handle, *id, any);
        if (!st.is_ok()) return done(st);
      }
      if (id->state != State::kBound) return fail(EINVAL);
      id->state = State::kListen;
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
      return done(accept(*id, body_of<CmConnReq>(msg).value()));
    case Op::kCmReject:
      return done(reject(*id, body_of<CmConnReq>(msg).value()));
    case Op::kCmEstablish:
      return done(establish(*id));
    case Op::kCmDisconnect:
      return done(disconnect(handle, *id));
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
  const uint32_t handle = next_handle_++;
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
  if (!is_local(a)) return error(EADDRNOTAVAIL, "not an address of this host");
  id.src = a;
  RETURN_IF_ERROR(take_port(handle, id, a.port));
  id.state = State::kBound;
  return Status::ok();
}

Status CmService::resolve_addr(uint32_t handle, Id& id, const CmResolveReq& r) {
  if (!valid_family(r.dst)) return error(EAFNOSUPPORT, "not an IP address");
  if (is_wildcard(r.dst) || !is_local(r.dst)) {
    // No backend serves that address (across hosts is a later step): no neighbour to find.
    id.dst = r.dst;
    emit(handle, CmEventType::kAddrError, -EHOSTUNREACH);
    return Status::ok();
  }
  if (id.state == State::kIdle) {
    CmAddr src = r.src;
    if (!src.family) {
      src = r.dst;  // a local destination is reached from itself
      src.port = 0;
    }
    RETURN_IF_ERROR(bind(handle, id, src));
  } else if (id.state != State::kBound && id.state != State::kAddrResolved &&
             id.state != State::kRouteResolved) {
    return error(EINVAL, "resolve_addr on an id in use");
  }
  id.dst = r.dst;
  if (is_wildcard(id.src)) {
    const uint16_t port = id.src.port;
    id.src = r.dst;
    id.src.port = port;
  }
  id.state = State::kAddrResolved;
  emit(handle, CmEventType::kAddrResolved, 0);
  return Status::ok();
}

uint32_t CmService::listener_for(uint16_t ps, const CmAddr& dst) const {
  auto it = ports_.find({ps, dst.port});
  if (it == ports_.end()) return 0;
  auto l = ids_.find(it->second);
  if (l == ids_.end() || l->second.state != State::kListen) return 0;
  if (!is_wildcard(l->second.src) && !same_addr(l->second.src, dst)) return 0;
  return it->second;
}

Status CmService::connect(uint32_t handle, Id& id, const CmConnReq& r) {
  if (id.state != State::kAddrResolved && id.state != State::kRouteResolved)
    return error(EINVAL, "connect before the address is resolved");
  if (r.private_len > kCmPrivateMax) return error(EINVAL, "private data too long");
  id.qp = r.qp;
  const uint32_t lh = listener_for(id.ps, id.dst);
  if (!lh) {
    emit(handle, CmEventType::kRejected, kCmRejInvalidService);
    return Status::ok();
  }
  const Id& l = ids_.at(lh);
  if (usage_[l.owner].ids >= kMaxIdsPerSession) {  // as a full backlog: refused
    emit(handle, CmEventType::kRejected, kCmRejInvalidService);
    return Status::ok();
  }
  ++usage_[l.owner].ids;
  const uint32_t nh = next_handle_++;
  Id& n = ids_[nh];  // may rehash: `id` and `l` are looked up again below
  n.owner = l.owner;
  n.channel = l.channel;
  n.ps = l.ps;
  n.qp_type = r.qp.qp_type;
  n.state = State::kReqRcvd;
  Id& a = ids_.at(handle);
  n.src = a.dst;
  n.dst = a.src;
  n.peer = handle;
  a.peer = nh;
  a.state = State::kReqSent;
  emit(nh, CmEventType::kConnectRequest, 0, &r.qp, {r.private_data, r.private_len}, lh);
  return Status::ok();
}

Status CmService::accept(Id& id, const CmConnReq& r) {
  if (id.state != State::kReqRcvd) return error(EINVAL, "accept of no connect request");
  if (r.private_len > kCmPrivateMax) return error(EINVAL, "private data too long");
  auto p = ids_.find(id.peer);
  if (!id.peer || p == ids_.end()) return error(ECONNRESET, "the requester is gone");
  id.qp = r.qp;
  const std::span<const uint8_t> pdata{r.private_data, r.private_len};
  if (id.qp_type == 4 /* IBV_QPT_UD: SIDR, no connection */) {
    id.state = State::kIdle;
    id.peer = p->second.peer = 0;
    p->second.state = State::kRouteResolved;
    emit(p->first, CmEventType::kEstablished, 0, &r.qp, pdata);
    return Status::ok();
  }
  id.state = State::kRepSent;
  p->second.state = State::kRepRcvd;
  emit(p->first, CmEventType::kConnectResponse, 0, &r.qp, pdata);
  return Status::ok();
}

Status CmService::reject(Id& id, const CmConnReq& r) {
  if (id.state != State::kReqRcvd && id.state != State::kRepRcvd)
    return error(EINVAL, "nothing to reject");
  if (r.private_len > kCmPrivateMax) return error(EINVAL, "private data too long");
  if (auto p = ids_.find(id.peer); id.peer && p != ids_.end()) {
    p->second.state = id.state == State::kReqRcvd ? State::kRouteResolved : State::kIdle;
    p->second.peer = 0;
    emit(p->first, CmEventType::kRejected, kCmRejConsumer, nullptr,
         {r.private_data, r.private_len});
  }
  id.state = id.state == State::kReqRcvd ? State::kIdle : State::kRouteResolved;
  id.peer = 0;
  return Status::ok();
}

Status CmService::establish(Id& id) {
  if (id.state != State::kRepRcvd) return error(EINVAL, "no connect response to confirm");
  auto p = ids_.find(id.peer);
  if (!id.peer || p == ids_.end()) return error(ECONNRESET, "the acceptor is gone");
  id.state = p->second.state = State::kEstablished;
  emit(p->first, CmEventType::kEstablished, 0);
  return Status::ok();
}

Status CmService::disconnect(uint32_t handle, Id& id) {
  switch (id.state) {
    case State::kDisconnected:
      return Status::ok();  // the answer to the peer's DREQ
    case State::kReqSent:
    case State::kReqRcvd:
      abandon(id);
      id.state = State::kIdle;
      return Status::ok();
    case State::kRepSent:
    case State::kRepRcvd:
    case State::kEstablished:
      break;
    default:
      return error(EINVAL, "not connected");
  }
  if (auto p = ids_.find(id.peer); id.peer && p != ids_.end()) {
    p->second.state = State::kDisconnected;
    p->second.peer = 0;
    emit(p->first, CmEventType::kDisconnected, 0);
  }
  id.state = State::kDisconnected;
  id.peer = 0;
  emit(handle, CmEventType::kDisconnected, 0);  // as the DREP comes back
  return Status::ok();
}

void CmService::abandon(Id& id) {
  release_port(id);
  auto p = ids_.find(id.peer);
  id.peer = 0;
  if (p == ids_.end()) return;
  Id& peer = p->second;
  peer.peer = 0;
  switch (peer.state) {
    case State::kReqSent:  // its listener side went away before accepting
      peer.state = State::kRouteResolved;
      emit(p->first, CmEventType::kRejected, kCmRejTimeout);
      break;
    case State::kReqRcvd:  // its requester went away
      peer.state = State::kIdle;
      emit(p->first, CmEventType::kRejected, kCmRejTimeout);
      break;
    case State::kRepSent:  // no RTU will come: the REP times out
      peer.state = State::kIdle;
      emit(p->first, CmEventType::kUnreachable, -ETIMEDOUT);
      break;
    case State::kRepRcvd:
    case State::kEstablished:
      peer.state = State::kDisconnected;
      emit(p->first, CmEventType::kDisconnected, 0);
      break;
    default:
      break;
  }
}

void CmService::session_closed(const engine::Session* session) {
  const uint32_t s = session->id;
  std::vector<uint32_t> gone;
  for (const auto& [h, id] : ids_) {
    if (id.owner == s) gone.push_back(h);
  }
  std::sort(gone.begin(), gone.end());  // peers hear of them in the order they were made
  for (uint32_t h : gone) {
    auto it = ids_.find(h);
    abandon(it->second);
    ids_.erase(it);
  }
  std::erase_if(channels_, [s](const auto& kv) { return kv.second.owner == s; });
  std::erase_if(closing_, [s](const auto& c) { return c.first == s; });
  usage_.erase(s);
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
                     std::span<const uint8_t> pdata, uint32_t listen_id) {
  auto it = ids_.find(handle);
  if (it == ids_.end()) return;
  auto ch = channels_.find(it->second.channel);
  if (ch == channels_.end()) return;
  CmEvent e{};
  e.event = static_cast<uint32_t>(ev);
  e.status = status;
  e.id = handle;
  e.listen_id = listen_id;
  e.src = it->second.src;
  e.dst = it->second.dst;
  if (peer) e.peer = *peer;
  e.private_len = static_cast<uint32_t>(std::min(pdata.size(), kCmPrivateMax));
  if (e.private_len) std::memcpy(e.private_data, pdata.data(), e.private_len);
  ch->second.backlog.push_back(encode(Op::kCmEvent, 0, 0, e));
  flush(ch->second);
  if (!ch->second.backlog.empty()) backlogged_.insert(ch->first);
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
