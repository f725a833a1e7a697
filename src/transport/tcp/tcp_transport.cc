#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/sockios.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <ctime>

#include "common/guest_fault.h"
#include "common/log.h"

namespace vrdma::transport::tcp {

using namespace vrdma::proto::wire;

namespace {

constexpr size_t kRbufBytes = 64 * 1024;
/// Payload bytes at or below this are copied into the batch; above, written from guest memory.
constexpr uint32_t kCopyPayloadMax = 8192;
/// Payload still to come at or above this is read straight into its spans, not via rbuf.
constexpr uint64_t kDirectReadMin = 16 * 1024;
constexpr size_t kBatchMax = 256 * 1024;
constexpr int kMaxIov = 64;
/// Guest memory is copied through this (fault-safe) before TLS encrypts it.
constexpr size_t kStageBytes = 16384;

std::string address_of(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0 || sa.sin_family != AF_INET)
    return "?";
  char ip[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
  return fmt::format("{}:{}", ip, ntohs(sa.sin_port));
}

void set_options(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // Unacknowledged data for this long ends the connection (a link that is down), so it is
  // redialed rather than left hanging in kernel retransmits.
  const unsigned user_timeout_ms = 2000;
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
  // An idle connection is probed too (a peer host that vanished while nothing was in flight):
  // 10 s of silence, then probes whose loss the user timeout above turns into a redial.
  // (QPs do not wait for this: their ACK clock spends their own budget while nothing moves.)
  const int idle_s = 10, interval_s = 2, probes = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  // A lost segment is sent again after 50 ms (or the path's RTO if longer), not TCP's 200 ms
  // floor, and an outage's backoff stops at 1 s, so the connection resumes soon after the link
  // does (RC's budget, `timeout` 14, is 67 ms a try). Not lower: at 5 ms a path whose RTT
  // jumped from 0.1 to 20 ms saw 126 spurious retransmissions and its window collapse.
  // Linux 6.15+; older kernels keep their defaults.
  constexpr int kTcpRtoMaxMs = 44, kTcpRtoMinUs = 45;  // <linux/tcp.h> of 6.15
  const int rto_min_us = 50000, rto_max_ms = 1000;
  ::setsockopt(fd, IPPROTO_TCP, kTcpRtoMinUs, &rto_min_us, sizeof(rto_min_us));
  ::setsockopt(fd, IPPROTO_TCP, kTcpRtoMaxMs, &rto_max_ms, sizeof(rto_max_ms));
  // With few segments in flight (a ping-pong: no duplicate ACKs to trigger a fast
  // retransmit), a segment lost again is retried after the same RTO, not a doubled one, for
  // its first 6 retries: as a fabric retries, each try independent. Doubling, three losses of
  // one segment in a row at 10 % loss took 50+100+200+400 ms, more than `timeout` 14's budget.
  ::setsockopt(fd, IPPROTO_TCP, TCP_THIN_LINEAR_TIMEOUTS, &one, sizeof(one));
}

std::array<uint8_t, 16> gid_key(const uint8_t gid[16]) {
  std::array<uint8_t, 16> k;
  std::memcpy(k.data(), gid, 16);
  return k;
}

}  // namespace

Result<sockaddr_in> parse_endpoint(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos) return error(EINVAL, fmt::format("\"{}\" is not ADDR:PORT", s));
  std::string host = s.substr(0, colon);
  int port = 0;
  if (std::sscanf(s.c_str() + colon + 1, "%d", &port) != 1 || port < 0 || port > 65535)
    return error(EINVAL, fmt::format("\"{}\": bad port", s));
  if (host == "localhost") host = "127.0.0.1";
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1)
    return error(EINVAL, fmt::format("\"{}\": not an IPv4 address", s));
  return sa;
}

Result<PeerSpec> parse_peer(const std::string& s) {
  PeerSpec p;
  p.addr = s;
  if (const auto at = s.find('@'); at != std::string::npos) {
    p.node = s.substr(0, at);
    p.addr = s.substr(at + 1);
    if (p.node.empty() || p.node.size() >= kNameMax)
      return error(EINVAL, fmt::format("\"{}\": the node name before @ must be 1..63 bytes", s));
  }
  ASSIGN_OR_RETURN(p.sa, parse_endpoint(p.addr));
  return p;
}

bool is_loopback(const sockaddr_in& sa) { return (ntohl(sa.sin_addr.s_addr) >> 24) == 127; }

Result<std::unique_ptr<TcpTransport>> TcpTransport::create(Options o, Receiver& rx) {
  if (o.node.empty() || o.node.size() >= kNameMax)
    return error(EINVAL, "transport: node name must be 1..63 bytes");
  std::unique_ptr<TcpTransport> t(new TcpTransport(std::move(o), rx));
  RETURN_IF_ERROR(t->start());
  return t;
}

TcpTransport::~TcpTransport() = default;

Status TcpTransport::start() {
  epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) return error(errno, "epoll_create1");
  if (opt_.listen.empty()) return error(EINVAL, "transport: no listen address");
  ASSIGN_OR_RETURN(sockaddr_in la, parse_endpoint(opt_.listen));
  listen_ = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!listen_.valid()) return error(errno, "socket");
  const int one = 1;
  ::setsockopt(listen_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(listen_.get(), reinterpret_cast<sockaddr*>(&la), sizeof(la)) < 0)
    return error(errno, fmt::format("transport: bind {}: {}", opt_.listen, std::strerror(errno)));
  if (::listen(listen_.get(), 64) < 0) return error(errno, "listen");
  if (la.sin_port == 0) {  // an ephemeral port (forced TCP on one host): dial what we got
    socklen_t len = sizeof(la);
    ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&la), &len);
    char ip[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &la.sin_addr, ip, sizeof(ip));
    opt_.listen = fmt::format("{}:{}", ip, ntohs(la.sin_port));
  }
  watch_listener(true);
  accept_rest_.bind(epoll_.get(), listen_.get(), 0);  // data 0: the listener (watch_listener)
  std::vector<std::string> to_dial = opt_.peers;
  // Forced: pairs on this backend go through our own listener, like any peer.
  if (opt_.force) to_dial.push_back(opt_.listen);
  for (const std::string& p : to_dial) {
    ASSIGN_OR_RETURN(PeerSpec spec, parse_peer(p));
    if (!spec.node.empty()) allow_.push_back(spec.node);
    dials_.push_back(Dial{spec.addr, spec.node, spec.sa, nullptr, 0, kRedialMs, "", "", 0, 0});
  }
  VLOG_INFO("transport tcp: node {} listening on {}, {} peer(s){}; {}", opt_.node, opt_.listen,
            opt_.peers.size(), opt_.force ? ", forced for every pair" : "",
            opt_.tls ? "TLS 1.3, peers authenticated by the cluster CA"
                     : "INSECURE: no authentication, no encryption");
  return Status::ok();
}

TcpTransport::Conn* TcpTransport::add_conn(UniqueFd fd, const std::string& dialed,
                                           uint64_t now_ns) {
  auto c = std::make_unique<Conn>();
  c->fd = std::move(fd);
  c->dialed = dialed;
  c->addr = dialed.empty() ? address_of(c->fd.get()) : dialed;
  c->opened_ns = now_ns;
  c->id = next_conn_id_++;
  ++prehello_;
  if (opt_.tls) c->tls = std::make_unique<TlsStream>(*opt_.tls, dialed.empty());
  c->rbuf.resize(kRbufBytes);
  set_options(c->fd.get());
  Conn* raw = c.get();
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = raw;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, raw->fd.get(), &ev);
  conns_[raw->fd.get()] = std::move(c);
  return raw;
}

void TcpTransport::set_out(Conn& c, bool on) {
  if (c.want_out == on) return;
  c.want_out = on;
  epoll_event ev{};
  ev.events = EPOLLIN | (on ? EPOLLOUT : 0u);
  ev.data.ptr = &c;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
}

void TcpTransport::close_conn(Conn* c, const std::string& why) {
  if (c->dead) return;
  c->dead = true;
  if (c->hello) {
    VLOG_WARN("transport tcp: connection to {} ({}, {}) closed: {}", c->node,
              c->dialed.empty() ? "accepted" : "dialed", c->addr, why);
  } else {
    VLOG_DEBUG("transport tcp: connection {} closed before hello: {}", c->addr, why);
    if (c->dialed.empty()) --unauthenticated_;
    --prehello_;
  }
  auto bn = by_node_.find(c->node);
  if (bn != by_node_.end() && bn->second == c) {
    by_node_.erase(bn);
    down_since_[c->node] = now_ns_;
  }
  std::erase(rx_again_, c);
  for (Dial& d : dials_) {
    if (d.conn != c) continue;
    d.conn = nullptr;  // redialed by the next poll after kRedialMs
    note_failure(d, why);
  }
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c->fd.get(), nullptr);
  auto it = conns_.find(c->fd.get());
  graveyard_.push_back(std::move(it->second));
  conns_.erase(it);
  c->fd.reset();
  accept_rest_.end();  // a descriptor is free again
  c->txq.clear();  // drops the holds on guest memory; the engine replays what is unacknowledged
  c->sink = {};
}

void TcpTransport::watch_listener(bool on) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // null: the listener
  ::epoll_ctl(epoll_.get(), on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, listen_.get(), &ev);
}

bool TcpTransport::accept_all(uint64_t now_ns) {
  for (;;) {
    int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      const int err = errno;
      if (!ListenerRest::out_of_descriptors(err)) return true;
      // The connection stays queued and the listener readable: rest it (poll() takes it back),
      // or the backend's loop would see work on every turn.
      uint64_t held = 0;
      if (accept_rest_.start(now_ns, held))
        VLOG_WARN("tcp: accept: {}; not accepting for {} ms{}", std::strerror(err),
                  ListenerRest::kRestNs / 1000000, log::held_note(held));
      return false;
    }
    if (unauthenticated_ >= kMaxUnauthenticated) {
      ++refused_.pending;
      uint64_t held = 0;
      if (refuse_log_.ready(now_ns, held))
        VLOG_WARN(
            "transport tcp: refused a connection from {}: {} connections have not "
            "finished their hello{}",
            address_of(fd), unauthenticated_, log::held_note(held));
      ::close(fd);
      continue;
    }
    Conn* c = add_conn(UniqueFd(fd), "", now_ns);
    ++unauthenticated_;
    Hello h{};
    put_name(h.node, opt_.node);
    h.wire_version = kWireVersion;
    queue(*c, Type::kHello, &h, {}, {});
  }
}

void TcpTransport::note_failure(Dial& d, const std::string& why) {
  d.last_error = why;
  d.last_error_unix = static_cast<uint64_t>(::time(nullptr));
  ++d.failures;
}

void TcpTransport::dial(Dial& d, uint64_t now_ns) {
  d.next_ns = now_ns + d.backoff_ms * 1000000;
  d.backoff_ms = std::min(d.backoff_ms * 2, kRedialMaxMs);  // reset when a Hello arrives
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return note_failure(d, std::strerror(errno));
  int r = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&d.sa), sizeof(d.sa));
  if (r < 0 && errno != EINPROGRESS) {
    return note_failure(d, std::strerror(errno));  // refused at once: try again later
  }
  Conn* c = add_conn(std::move(fd), d.addr, now_ns);
  c->expect = d.expect;
  c->connecting = r < 0;
  c->dialed_ns = now_ns;
  d.conn = c;
  Hello h{};
  put_name(h.node, opt_.node);
  h.wire_version = kWireVersion;
  queue(*c, Type::kHello, &h, {}, {});
  if (c->connecting || c->tls) set_out(*c, true);  // TLS: the handshake starts when writable
}

void TcpTransport::queue(Conn& c, Type t, const void* body, std::span<const Span> payload,
                         std::span<const Hold> holds, uint64_t flow) {
  uint64_t plen = 0;
  for (const Span& s : payload) plen += s.n;
  const bool copy = plen <= kCopyPayloadMax;
  // Batch: append to the last item unless it carries a large payload or is big already (an
  // item partly written keeps growing at its end, which is safe: `sent` counts from its start).
  if (c.txq.empty() || !c.txq.back().spans.empty() || c.txq.back().dropped ||
      c.txq.back().bytes.size() > kBatchMax) {
    c.txq.emplace_back();
    c.txq.back().flow = flow;
  }
  TxItem* it = &c.txq.back();
  if (it->flow != flow) it->flow = 0;  // mixed: no longer one flow's to take back
  const size_t before = it->bytes.size();
  encode(t, body, static_cast<uint32_t>(plen), it->bytes);
  c.queued_end += it->bytes.size() - before + plen;
  if (copy) {
    for (const Span& s : payload) it->bytes.insert(it->bytes.end(), s.p, s.p + s.n);
    it->total = it->bytes.size();
    return;
  }
  it->spans.assign(payload.begin(), payload.end());
  it->holds.assign(holds.begin(), holds.end());
  it->total = it->bytes.size() + plen;
}

bool TcpTransport::send(const std::string& node, Type t, const void* body,
                        std::span<const Span> payload, std::span<const Hold> holds, uint64_t flow) {
  auto it = by_node_.find(node);
  if (it == by_node_.end()) return false;
  queue(*it->second, t, body, payload, holds, flow);
  return true;
}

void TcpTransport::drop_flow(const std::string& node, uint64_t flow) {
  auto found = by_node_.find(node);
  if (flow == 0 || found == by_node_.end()) return;
  Conn& c = *found->second;
  for (size_t i = 0; i < c.txq.size(); ++i) {
    TxItem& it = c.txq[i];
    if (it.flow != flow || it.dropped || (i == 0 && c.sent > 0)) continue;  // begun: it goes
    it.dropped = true;
    // Guest memory is let go now; only the size stays, for the stream's offsets.
    it.bytes = {};
    it.spans = {};
    it.holds = {};
    c.dropped_bytes += it.total;
    c.dropped_queued += it.total;
  }
  skip_dropped(c);
}

void TcpTransport::skip_dropped(Conn& c) {
  while (!c.txq.empty() && c.txq.front().dropped) {
    const uint64_t total = c.txq.front().total;
    c.txq.pop_front();
    c.written += total;
    c.dropped_queued -= total;
    if (c.tls) {
      // Acknowledged once the record before it is: nothing of it goes to the socket.
      c.marks.emplace_back(c.tls->produced(), c.written);
    } else {
      c.skipped += total;
      c.skips.emplace_back(c.written - c.skipped, c.skipped);
    }
  }
}

uint64_t TcpTransport::tx_unwritten(const std::string& node, const TxMark& m) const {
  auto it = by_node_.find(node);
  if (it == by_node_.end() || it->second->id != m.conn) return 0;
  // Dropped items still queued do not count (they are passed over, not written): a mark
  // before them is then seen a little shallower than it is.
  const Conn& c = *it->second;
  const uint64_t behind = m.end > c.written ? m.end - c.written : 0;
  return behind - std::min(behind, c.dropped_queued);
}

TxMark TcpTransport::tx_mark(const std::string& node) const {
  auto it = by_node_.find(node);
  if (it == by_node_.end()) return {};
  return {it->second->id, it->second->queued_end};
}

uint64_t TcpTransport::acked_of(Conn& c) {
  int outq = 0;
  if (::ioctl(c.fd.get(), SIOCOUTQ, &outq) != 0) return c.plain_acked;
  if (!c.tls) {
    const uint64_t wire = c.written - c.skipped;
    const uint64_t wire_acked = wire - std::min<uint64_t>(wire, outq);
    while (!c.skips.empty() && c.skips.front().first <= wire_acked) {
      c.skipped_acked = c.skips.front().second;
      c.skips.pop_front();
    }
    c.plain_acked = std::max(c.plain_acked, wire_acked + c.skipped_acked);
    return c.plain_acked;
  }
  // Ciphertext the peer acknowledged, mapped back to the plaintext its records carried.
  const uint64_t cipher = c.tls->sent() - std::min<uint64_t>(c.tls->sent(), outq);
  while (!c.marks.empty() && c.marks.front().first <= cipher) {
    c.plain_acked = c.marks.front().second;
    c.marks.pop_front();
  }
  return c.plain_acked;
}

bool TcpTransport::tx_delivered(const std::string& node, const TxMark& m) {
  auto it = by_node_.find(node);
  if (it == by_node_.end() || it->second->id != m.conn) return false;
  return acked_of(*it->second) >= m.end;
}

uint64_t TcpTransport::tx_progress(const std::string& node) {
  auto it = by_node_.find(node);
  if (it == by_node_.end()) return 0;
  Conn& c = *it->second;
  return (c.id << 48) + acked_of(c) + c.rx_bytes;
}

namespace {

/// The IPv4 address of one end of `fd` (getpeername or getsockname), or 0.
uint32_t ipv4_of(int fd, int (*name)(int, sockaddr*, socklen_t*)) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (name(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0 || sa.sin_family != AF_INET) return 0;
  return sa.sin_addr.s_addr;
}

}  // namespace

uint64_t TcpTransport::tx_patience_ns(const std::string& node) {
  auto it = by_node_.find(node);
  if (it == by_node_.end()) return 0;
  tcp_info ti{};
  socklen_t len = sizeof(ti);
  if (::getsockopt(it->second->fd.get(), IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return 0;
  return (uint64_t{ti.tcpi_rtt} + 4 * uint64_t{ti.tcpi_rttvar}) * 1000;
}

bool TcpTransport::rx_pending(const std::string& node) {
  auto it = by_node_.find(node);
  if (it == by_node_.end()) return false;
  const Conn& c = *it->second;
  if (c.rpos != c.rend || (c.tls && c.tls->has_buffered())) return true;
  int inq = 0;
  return ::ioctl(c.fd.get(), SIOCINQ, &inq) == 0 && inq > 0;
}

uint32_t TcpTransport::peer_ipv4(const std::string& node) const {
  auto it = by_node_.find(node);
  return it == by_node_.end() ? 0 : ipv4_of(it->second->fd.get(), ::getpeername);
}

uint32_t TcpTransport::local_ipv4(const std::string& node) const {
  auto it = by_node_.find(node);
  return it == by_node_.end() ? 0 : ipv4_of(it->second->fd.get(), ::getsockname);
}

bool TcpTransport::flush(Conn& c) {
  if (c.tls) return flush_tls(c);
  for (skip_dropped(c); !c.txq.empty(); skip_dropped(c)) {
    iovec iov[kMaxIov];
    int n = 0;
    uint64_t skip = c.sent;
    for (const TxItem& it : c.txq) {
      if (it.dropped) break;
      auto add = [&](const uint8_t* p, uint64_t len) {
        if (skip >= len) {
          skip -= len;
          return;
        }
        if (n < kMaxIov) iov[n++] = {const_cast<uint8_t*>(p) + skip, len - skip};
        skip = 0;
      };
      add(it.bytes.data(), it.bytes.size());
      for (const Span& s : it.spans) add(s.p, s.n);
      if (n >= kMaxIov) break;
    }
    ssize_t w = ::writev(c.fd.get(), iov, n);
    if (w < 0) {
      if (errno == EAGAIN || errno == EINTR) {
        set_out(c, true);
        return true;
      }
      close_conn(&c, std::strerror(errno));
      return false;
    }
    uint64_t done = static_cast<uint64_t>(w);
    c.written += done;
    while (done && !c.txq.empty()) {
      const uint64_t rest = c.txq.front().total - c.sent;
      if (done < rest) {
        c.sent += done;
        done = 0;
      } else {
        done -= rest;
        c.sent = 0;
        c.txq.pop_front();
      }
    }
  }
  set_out(c, false);
  return true;
}

bool TcpTransport::read_some(Conn& c) {
  if (c.rpos == c.rend) c.rpos = c.rend = 0;
  if (c.rend == c.rbuf.size()) {  // compact: a partial frame sits at the end
    std::memmove(c.rbuf.data(), c.rbuf.data() + c.rpos, c.rend - c.rpos);
    c.rend -= c.rpos;
    c.rpos = 0;
  }
  const ssize_t r = read_into(c, c.rbuf.data() + c.rend, c.rbuf.size() - c.rend);
  if (r < 0) return false;
  c.rend += static_cast<size_t>(r);
  return true;
}

ssize_t TcpTransport::check_read(Conn& c, ssize_t r) {
  if (r > 0) {
    c.rx_bytes += static_cast<uint64_t>(r);
    return r;
  }
  if (r < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
  close_conn(&c, r == 0 ? "closed by the peer" : std::strerror(errno));
  return -1;
}

bool TcpTransport::consume(Conn& c) {
  for (;;) {
    if (c.rx == Rx::kPayload) {
      // Payload: whatever rbuf holds goes to the spans (or is dropped) ...
      while (c.left && c.rpos < c.rend) {
        uint64_t n = std::min<uint64_t>(c.left, c.rend - c.rpos);
        if (!c.sink.spans.empty()) {
          const Span& s = c.sink.spans[c.span_i];
          n = std::min(n, s.n - c.span_off);
          // Guest memory: a fault there loses these bytes of the message, not the backend
          // (the engine saw the same fault or will: common/guest_fault.h).
          uintptr_t fault = 0;
          if (!guarded_memcpy(s.p + c.span_off, c.rbuf.data() + c.rpos, n, fault))
            VLOG_WARN(
                "tcp: guest memory at {:#x} faulted (SIGBUS/SIGSEGV) taking a payload "
                "from {}; those bytes are lost",
                fault, c.node);
          if ((c.span_off += n) == s.n) ++c.span_i, c.span_off = 0;
        }
        c.rpos += n;
        c.left -= n;
      }
      // ... and a large rest is read straight into the spans.
      while (c.left >= kDirectReadMin && !c.sink.spans.empty() && !c.tls) {
        iovec iov[kMaxIov];
        int n = 0;
        for (size_t i = c.span_i; i < c.sink.spans.size() && n < kMaxIov; ++i) {
          const uint64_t off = i == c.span_i ? c.span_off : 0;
          iov[n++] = {c.sink.spans[i].p + off, c.sink.spans[i].n - off};
        }
        const ssize_t r = check_read(c, ::readv(c.fd.get(), iov, n));
        if (r <= 0) return r == 0;
        uint64_t got = static_cast<uint64_t>(r);
        c.left -= got;
        while (got) {
          const uint64_t room = c.sink.spans[c.span_i].n - c.span_off;
          const uint64_t n2 = std::min(room, got);
          got -= n2;
          if ((c.span_off += n2) == c.sink.spans[c.span_i].n) ++c.span_i, c.span_off = 0;
        }
      }
      if (c.left) return true;  // more to read later
      c.rx = Rx::kHead;
      rx_.on_frame_done(c.node, c.frame, c.sink);
      c.sink.spans.clear();
      c.sink.holds.clear();
      if (c.dead) return false;
      continue;
    }
    const size_t avail = c.rend - c.rpos;
    if (avail < sizeof(FrameHeader)) return true;
    FrameHeader h;
    std::memcpy(&h, c.rbuf.data() + c.rpos, sizeof(h));
    Status st = check_header(h);
    if (st.is_ok() && avail < sizeof(h) + h.body) return true;
    if (st.is_ok()) st = decode(h, {c.rbuf.data() + c.rpos + sizeof(h), h.body}, c.frame);
    if (st.is_ok() && !c.hello && c.frame.type() != Type::kHello)
      st = error(EPROTO, "frame before hello");
    if (!st.is_ok()) {
      VLOG_ERROR("transport tcp: from {}: {}; closing the connection",
                 c.node.empty() ? c.dialed : c.node, st.message());
      close_conn(&c, st.message());
      return false;
    }
    c.rpos += sizeof(h) + h.body;
    switch (c.frame.type()) {
      case Type::kHello:
        on_hello(c);
        break;
      case Type::kGuestUp:
        on_guest(c, true);
        break;
      case Type::kGuestDown:
        on_guest(c, false);
        break;
      case Type::kPing:  // its sender's TCP has what it wanted to know
        break;
      default: {
        c.sink.spans.clear();
        c.sink.holds.clear();
        c.sink.accepted = false;
        rx_.on_frame(c.node, c.frame, c.sink);
        if (c.dead) return false;
        uint64_t room = 0;
        for (const Span& s : c.sink.spans) room += s.n;
        if (room != h.payload) {  // the engine found no place (or a wrong one): drop it
          if (room) VLOG_ERROR("transport tcp: receiver gave {} bytes for {}", room, h.payload);
          c.sink.spans.clear();
          c.sink.holds.clear();
        }
        c.left = h.payload;
        c.span_i = 0;
        c.span_off = 0;
        c.rx = Rx::kPayload;
        break;
      }
    }
    if (c.dead) return false;
  }
}

void TcpTransport::on_hello(Conn& c) {
  if (c.hello) {
    close_conn(&c, "second hello");
    return;
  }
  const std::string name(get_name(c.frame.hello.node));
  // The name is the certificate's, never what a peer says; and, with named peers, one of them.
  if (c.tls && name != c.tls->peer_name()) {
    refuse(refused_.name, "transport tcp: {} claims node {} but its certificate names {}; closing",
           c.addr, name, c.tls->peer_name());
    close_conn(&c, "hello under another node's name");
    return;
  }
  if (!allowed(name) && name != opt_.node) {
    refuse(refused_.name, "transport tcp: {} is node {}, not one of [transport] peers; closing",
           c.addr, name);
    close_conn(&c, "not an allowed peer");
    return;
  }
  if (c.dialed.empty()) --unauthenticated_;
  --prehello_;
  c.hello = true;
  c.node = name;
  c.since_unix = static_cast<uint64_t>(::time(nullptr));
  for (Dial& d : dials_) {
    if (d.conn != &c) continue;
    d.node = c.node;
    d.backoff_ms = kRedialMs;
    d.failures = 0;
  }
  if (c.node == opt_.node) {
    // Our own listener (forced TCP): frames go out on the connection we dialed.
    if (!c.dialed.empty()) {
      by_node_[c.node] = &c;
      rx_.on_peer_up(c.node);
    }
    return;
  }
  auto it = by_node_.find(c.node);
  if (it != by_node_.end()) {
    // Both sides dialed: keep the connection the smaller node name dialed; both agree.
    Conn* old = it->second;
    const bool keep_new = (opt_.node < c.node) == !c.dialed.empty();
    VLOG_INFO("transport tcp: second connection to {}; keeping the {} one", c.node,
              keep_new ? "new" : "old");
    if (!keep_new) {
      close_conn(&c, "duplicate connection");
      return;
    }
    close_conn(old, "duplicate connection");
  }
  by_node_[c.node] = &c;
  down_since_.erase(c.node);
  VLOG_INFO("transport tcp: connected to {} ({}, {}; {})", c.node,
            c.dialed.empty() ? "accepted" : "dialed", c.addr,
            c.tls ? fmt::format("authenticated, {}", c.tls->cipher()) : "INSECURE");
  // A fresh directory from this peer replaces what it said before: entries it does not announce
  // again soon are dropped (they still hold against other nodes' claims meanwhile).
  for (auto& [lid, r] : by_lid_) r.stale |= r.node == c.node;
  for (auto& [gid, r] : by_gid_) r.stale |= r.node == c.node;
  stale_until_[c.node] = now_ns_ + kRedirectoryMs * 1000000;
  send_directory(c);
  rx_.on_peer_up(c.node);
}

void TcpTransport::send_directory(Conn& c) {
  for (const auto& [name, g] : local_) {
    GuestEntry e{};
    put_name(e.name, g.name);
    std::memcpy(e.gid, g.gid, 16);
    e.lid = g.lid;
    queue(c, Type::kGuestUp, &e, {}, {});
  }
}

void TcpTransport::on_guest(Conn& c, bool up) {
  if (c.node == opt_.node) return;
  const GuestEntry& e = c.frame.guest;
  GuestInfo g{std::string(get_name(e.name)), e.lid, {}};
  std::memcpy(g.gid, e.gid, 16);
  const auto key = gid_key(e.gid);
  if (!up) {
    // Only the holder lets go of an entry; a claim another node waits with may apply now.
    auto l = by_lid_.find(e.lid);
    if (l != by_lid_.end() && l->second.node == c.node && l->second.name == g.name)
      by_lid_.erase(l);
    auto gi = by_gid_.find(key);
    if (gi != by_gid_.end() && gi->second.node == c.node) by_gid_.erase(gi);
    auto cl = claims_.find(e.lid);
    if (cl != claims_.end() && cl->second.node == c.node) claims_.erase(cl);
    VLOG_DEBUG("directory: guest {} left {}", g.name, c.node);
    settle_claims(now_ns_);
    return;
  }
  for (const auto& [lname, lg] : local_) {
    if (lg.lid == e.lid || std::memcmp(lg.gid, e.gid, 16) == 0) {
      refuse(refused_.directory,
             "directory: refused guest {} (lid {:#x}) from {} ({}): guest {} of this backend "
             "holds that LID/GID",
             g.name, e.lid, c.node, c.addr, lname);
      return;
    }
  }
  const std::string holder = holder_against(c.node, g, now_ns_);
  if (!holder.empty()) {
    refuse(refused_.directory,
           "directory: refused guest {} (lid {:#x}) from {} ({}): {} holds that LID/GID; the "
           "claim applies if {} lets it go (a migration) or is gone for {} s",
           g.name, e.lid, c.node, c.addr, holder, holder, kOwnerGoneMs / 1000);
    claims_[e.lid] = Claim{c.node, g};
    return;
  }
  apply_guest(c.node, g);
}

std::string TcpTransport::holder_against(const std::string& node, const GuestInfo& g,
                                         uint64_t now_ns) const {
  auto holds = [&](const Remote& r) {
    if (r.node == node) return false;
    if (connected_to(r.node)) return true;
    auto d = down_since_.find(r.node);
    return d != down_since_.end() && now_ns - d->second < kOwnerGoneMs * 1000000;
  };
  if (auto l = by_lid_.find(g.lid); l != by_lid_.end() && holds(l->second)) return l->second.node;
  if (auto x = by_gid_.find(gid_key(g.gid)); x != by_gid_.end() && holds(x->second))
    return x->second.node;
  return {};
}

void TcpTransport::apply_guest(const std::string& node, const GuestInfo& g) {
  by_lid_[g.lid] = Remote{node, g.name, false};
  by_gid_[gid_key(g.gid)] = Remote{node, g.name, false};
  claims_.erase(g.lid);
  VLOG_DEBUG("directory: guest {} (lid {:#x}) is on {}", g.name, g.lid, node);
  rx_.on_guest_located(g, node);
}

void TcpTransport::settle_claims(uint64_t now_ns) {
  for (auto it = stale_until_.begin(); it != stale_until_.end();) {
    if (now_ns < it->second) {
      ++it;
      continue;
    }
    const std::string& node = it->first;
    std::erase_if(by_lid_, [&](const auto& e) { return e.second.node == node && e.second.stale; });
    std::erase_if(by_gid_, [&](const auto& e) { return e.second.node == node && e.second.stale; });
    it = stale_until_.erase(it);
  }
  std::vector<Claim> ready;
  for (auto it = claims_.begin(); it != claims_.end();) {
    if (!connected_to(it->second.node)) {
      it = claims_.erase(it);  // its node is gone: it announces again when it is back
    } else if (holder_against(it->second.node, it->second.g, now_ns).empty()) {
      ready.push_back(std::move(it->second));
      it = claims_.erase(it);
    } else {
      ++it;
    }
  }
  for (const Claim& cl : ready) {
    VLOG_INFO("directory: guest {} (lid {:#x}) moved to {}", cl.g.name, cl.g.lid, cl.node);
    apply_guest(cl.node, cl.g);
  }
}

bool TcpTransport::allowed(const std::string& node) const {
  return allow_.empty() || std::find(allow_.begin(), allow_.end(), node) != allow_.end();
}

template <typename... Args>
void TcpTransport::refuse(uint64_t& counter, fmt::format_string<Args...> f, Args&&... args) {
  ++counter;
  uint64_t held = 0;
  if (refuse_log_.ready(now_ns_, held))
    VLOG_WARN("{}{}", fmt::format(f, std::forward<Args>(args)...), log::held_note(held));
}

void TcpTransport::refused_frame(const std::string& node, const std::string& why) {
  auto it = by_node_.find(node);
  refuse(refused_.frames, "transport tcp: refused a frame from {} ({}): {}", node,
         it == by_node_.end() ? "?" : it->second->addr, why);
}

void TcpTransport::announce(const GuestInfo& g, bool up) {
  if (directory_) directory_->announce(g, up);
  if (up) {
    local_[g.name] = g;
  } else {
    local_.erase(g.name);
  }
  GuestEntry e{};
  put_name(e.name, g.name);
  std::memcpy(e.gid, g.gid, 16);
  e.lid = g.lid;
  for (auto& [node, c] : by_node_) {
    if (node != opt_.node) queue(*c, up ? Type::kGuestUp : Type::kGuestDown, &e, {}, {});
  }
}

// With a directory outside (etcd), its answer decides. What a peer announced over its own
// connection is used only for what that directory does not list yet while it is reachable: a
// guest that just joined there is announced on the connection its first request follows, but
// reaches our copy of etcd a moment later. While etcd is away nothing new is located.
std::string TcpTransport::locate_lid(uint16_t lid) const {
  if (directory_) {
    std::string node = directory_->locate_lid(lid);
    if (!node.empty() || !directory_->unavailable().empty()) return node;
  }
  auto it = by_lid_.find(lid);
  return it == by_lid_.end() ? std::string() : it->second.node;
}

std::string TcpTransport::locate_gid(const uint8_t gid[16]) const {
  if (directory_) {
    std::string node = directory_->locate_gid(gid);
    if (!node.empty() || !directory_->unavailable().empty()) return node;
  }
  auto it = by_gid_.find(gid_key(gid));
  return it == by_gid_.end() ? std::string() : it->second.node;
}

Status TcpTransport::add_peer(const std::string& node, const std::string& addr) {
  ASSIGN_OR_RETURN(sockaddr_in sa, parse_endpoint(addr));
  for (Dial& d : dials_) {
    if (d.expect != node) continue;
    if (d.addr == addr) return Status::ok();
    d.addr = addr;  // it moved: the next dial goes there
    d.sa = sa;
    d.next_ns = 0;
    return Status::ok();
  }
  Dial d;
  d.addr = addr;
  d.expect = node;
  d.sa = sa;
  dials_.push_back(std::move(d));
  return Status::ok();
}

void TcpTransport::drop_peer(const std::string& node) {
  for (auto it = dials_.begin(); it != dials_.end();) {
    if (it->expect != node) {
      ++it;
      continue;
    }
    if (it->conn) close_conn(it->conn, "left the directory");
    it = dials_.erase(it);
  }
  if (auto c = by_node_.find(node); c != by_node_.end())
    close_conn(c->second, "left the directory");
  // Closed connections are freed at the end of poll(): nothing of them is used before.
}

std::vector<std::string> TcpTransport::connected() const {
  std::vector<std::string> out;
  for (const auto& [node, c] : by_node_) out.push_back(node);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<TcpTransport::PeerInfo> TcpTransport::peers() {
  std::vector<PeerInfo> out;
  for (const auto& [node, c] : by_node_) {
    const uint64_t acked = acked_of(*c);
    out.push_back({node, c->addr, c->tls ? c->tls->peer_name() : "",
                   c->tls ? c->tls->cipher() : "none", c->since_unix, c->queued_end - c->written,
                   c->written - std::min(c->written, acked), c->rx_bytes, c->dropped_bytes});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.node < b.node; });
  return out;
}

std::vector<TcpTransport::DialInfo> TcpTransport::dials() const {
  std::vector<DialInfo> out;
  for (const Dial& d : dials_) {
    const bool up = !d.node.empty() && by_node_.count(d.node);
    out.push_back({d.addr, d.expect,
                   up       ? "connected"
                   : d.conn ? "connecting"
                            : "not connected",
                   d.last_error, d.last_error_unix, d.failures});
  }
  return out;
}

uint64_t TcpTransport::next_deadline() const {
  uint64_t d = 0;
  auto at = [&](uint64_t t) { d = d == 0 ? t : std::min(d, t); };
  for (const Dial& x : dials_) {
    if (!x.conn && (x.node.empty() || !by_node_.count(x.node))) at(x.next_ns);
    if (x.conn && x.conn->connecting) at(x.conn->dialed_ns + kConnectTimeoutMs * 1000000);
  }
  if (accept_rest_.until_ns()) at(accept_rest_.until_ns());
  if (!rx_again_.empty()) at(1);  // plaintext is waiting inside TLS: no event will say so
  for (const auto& [fd, c] : conns_) {
    if (!prehello_) break;
    if (!c->hello) at(c->opened_ns + kHelloTimeoutMs * 1000000);
  }
  for (const auto& [node, t] : stale_until_) at(t);
  if (!claims_.empty()) at(now_ns_ + 100'000'000);
  return d;
}

bool TcpTransport::handshake(Conn& c) {
  TlsStream& t = *c.tls;
  for (;;) {
    std::string why;
    const int h = t.handshake(why);
    if (t.push(c.fd.get()) < 0) {
      close_conn(&c, std::strerror(errno));
      return false;
    }
    if (h < 0) {
      refuse(refused_.handshake,
             "transport tcp: TLS handshake with {} failed: {}; closing the connection", c.addr,
             why);
      close_conn(&c, "TLS handshake failed: " + why);
      return false;
    }
    if (h > 0) break;
    const ssize_t r = t.pull(c.fd.get());
    if (r < 0) {
      close_conn(&c, errno ? std::strerror(errno) : "closed by the peer during the TLS handshake");
      return false;
    }
    if (r == 0) {
      set_out(c, t.out_pending());
      return true;
    }
  }
  if (!c.expect.empty() && t.peer_name() != c.expect) {
    refuse(refused_.name, "transport tcp: {} is node {}, but [transport] peers expects {} there",
           c.addr, t.peer_name(), c.expect);
    close_conn(&c, "another node answered");
    return false;
  }
  // The directory on etcd pins each node's certificate: a node that registered with one and
  // presents another (a stolen name's second credential, or a re-keyed node not yet registered
  // again) is refused.
  if (directory_) {
    const std::string pinned = directory_->fingerprint_of(t.peer_name());
    if (!pinned.empty() && pinned != t.peer_fingerprint()) {
      refuse(refused_.name,
             "transport tcp: {} is node {} with certificate {}, but {} registered {} in the "
             "directory; closing",
             c.addr, t.peer_name(), t.peer_fingerprint(), t.peer_name(), pinned);
      close_conn(&c, "not the certificate its node registered");
      return false;
    }
  }
  // Who answers at a dialed address is known now: no redial while we hold a connection to it,
  // even if this one is closed as a duplicate before the peer's Hello reaches us.
  for (Dial& d : dials_) {
    if (d.conn == &c) d.node = t.peer_name();
  }
  VLOG_DEBUG("transport tcp: TLS with {} ({}): {}", c.addr, t.peer_name(), t.cipher());
  set_out(c, t.out_pending());  // our Hello, queued, goes at the end of this poll
  return true;
}

ssize_t TcpTransport::read_into(Conn& c, void* p, size_t n) {
  if (!c.tls) return check_read(c, ::read(c.fd.get(), p, n));
  for (;;) {
    std::string why;
    const ssize_t r = c.tls->read(p, n, why);
    if (r > 0) return check_read(c, r);
    if (r < 0) {
      VLOG_ERROR("transport tcp: from {} ({}): {}; closing the connection",
                 c.node.empty() ? "?" : c.node, c.addr, why);
      close_conn(&c, why);
      return -1;
    }
    // A read that got less than it had room for drained the socket: the next would only say
    // EAGAIN (syscalls are most of a small message's cost), until the next visit.
    if (c.drained) return 0;
    const ssize_t got = c.tls->pull(c.fd.get(), &c.drained);
    if (got == 0) return 0;
    if (got < 0) return check_read(c, errno == 0 ? 0 : -1);
  }
}

bool TcpTransport::flush_tls(Conn& c) {
  TlsStream& t = *c.tls;
  bool blocked = false;
  while (t.established() && !blocked) {
    skip_dropped(c);
    if (c.txq.empty()) break;
    TxItem& it = c.txq.front();
    const uint8_t* p = nullptr;
    uint64_t n = 0;
    if (c.sent < it.bytes.size()) {
      p = it.bytes.data() + c.sent;
      n = it.bytes.size() - c.sent;
    } else {
      uint64_t off = c.sent - it.bytes.size();
      for (const Span& s : it.spans) {
        if (off < s.n) {
          // Guest memory: copied with a fault guard before OpenSSL reads it.
          n = std::min<uint64_t>(s.n - off, kStageBytes);
          stage_.resize(kStageBytes);
          uintptr_t fault = 0;
          if (!guarded_memcpy(stage_.data(), s.p + off, n, fault)) {
            VLOG_WARN(
                "tcp: guest memory at {:#x} faulted (SIGBUS/SIGSEGV) sending to {}; zeros "
                "are sent instead",
                fault, c.node);
            std::memset(stage_.data(), 0, n);
          }
          p = stage_.data();
          break;
        }
        off -= s.n;
      }
    }
    std::string why;
    const ssize_t w = t.write(p, n, why);
    if (w < 0) {
      close_conn(&c, "TLS: " + why);
      return false;
    }
    if (w == 0) {  // the session's buffer is full: to the socket with it
      const int r = t.push(c.fd.get());
      if (r < 0) {
        close_conn(&c, std::strerror(errno));
        return false;
      }
      blocked = r == 0;
      continue;
    }
    c.sent += static_cast<uint64_t>(w);
    c.written += static_cast<uint64_t>(w);
    c.marks.emplace_back(t.produced(), c.written);
    if (c.sent == it.total) {
      c.sent = 0;
      c.txq.pop_front();
    }
  }
  if (t.push(c.fd.get()) < 0) {
    close_conn(&c, std::strerror(errno));
    return false;
  }
  set_out(c, t.out_pending() || (!c.txq.empty() && t.established()));
  return true;
}

void TcpTransport::expire_unauthenticated(uint64_t now_ns) {
  std::vector<Conn*> late;
  for (auto& [fd, c] : conns_) {
    if (!c->hello && !c->connecting && now_ns - c->opened_ns > kHelloTimeoutMs * 1000000)
      late.push_back(c.get());
  }
  for (Conn* c : late) {
    if (c->dialed.empty()) {
      refuse(refused_.pending, "transport tcp: {} did not finish its {}hello in {} ms; closing",
             c->addr, c->tls ? "TLS handshake and " : "", kHelloTimeoutMs);
    }
    close_conn(c, "no hello in time");
  }
}

bool TcpTransport::read_conn(Conn& c) {
  bool did = false;
  // Bounded per visit so one busy peer cannot starve the engine's rings: about 1 MiB (a TLS
  // read returns one 16 KiB record at most).
  const int rounds = c.tls ? 64 : 16;
  c.drained = false;
  for (int round = 0; round < rounds && !c.dead; ++round) {
    const uint64_t before = c.rx_bytes;
    // A large payload with nothing buffered is read by consume() into its spans directly.
    const bool direct = !c.tls && c.rx == Rx::kPayload && c.left >= kDirectReadMin &&
                        !c.sink.spans.empty() && c.rpos == c.rend;
    const size_t room = c.rbuf.size() - c.rend;
    if (!direct && !read_some(c)) break;
    if (!consume(c)) break;
    if (c.rx_bytes == before) break;  // nothing more now
    did = true;
    // A read that did not fill the buffer drained the socket: skip the read that would
    // only say EAGAIN (syscalls are most of a small message's cost).
    if (!direct && !c.tls && c.rx_bytes - before < room) break;
  }
  if (!c.dead && c.tls && c.tls->has_buffered() && !c.again) {
    c.again = true;
    rx_again_.push_back(&c);
  }
  return did;
}

bool TcpTransport::poll(uint64_t now_ns) {
  bool did = false;
  now_ns_ = now_ns;
  accept_rest_.poll(now_ns);
  for (Dial& d : dials_) {
    if (d.conn && d.conn->connecting && now_ns - d.conn->dialed_ns > kConnectTimeoutMs * 1000000)
      close_conn(d.conn, "connect timed out");
    if (!d.conn && now_ns >= d.next_ns && (d.node.empty() || !by_node_.count(d.node)))
      dial(d, now_ns);
  }
  if (prehello_) expire_unauthenticated(now_ns);
  if (!claims_.empty() || !stale_until_.empty()) settle_claims(now_ns);
  if (!rx_again_.empty()) {
    std::vector<Conn*> again;
    again.swap(rx_again_);
    for (Conn* c : again) {
      c->again = false;
      if (!c->dead) did |= read_conn(*c);
    }
  }
  epoll_event evs[64];
  const int n = ::epoll_wait(epoll_.get(), evs, 64, 0);
  for (int i = 0; i < n; ++i) {
    auto* c = static_cast<Conn*>(evs[i].data.ptr);
    if (!c) {
      did |= accept_all(now_ns);
      continue;
    }
    if (c->dead) continue;
    if (c->connecting) {
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(c->fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        close_conn(c, std::strerror(err));
        continue;
      }
      c->connecting = false;
    }
    if (evs[i].events & EPOLLOUT) c->out_ready = true;
    if (c->tls && !c->tls->established()) {
      did = true;
      if (!handshake(*c) || !c->tls->established()) continue;
    }
    if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) did |= read_conn(*c);
  }
  std::vector<Conn*> out;
  for (auto& [fd, c] : conns_) {
    // A connection waiting for room (EPOLLOUT registered) is written when the room is there;
    // a TLS one in its handshake only by handshake().
    const bool has = c->tls ? c->tls->established() && (!c->txq.empty() || c->tls->out_pending())
                            : !c->txq.empty();
    if (!c->connecting && has && (!c->want_out || c->out_ready)) out.push_back(c.get());
    c->out_ready = false;
  }
  for (Conn* c : out) {
    if (!c->dead) flush(*c);
    did = true;
  }
  graveyard_.clear();
  return did;
}

}  // namespace vrdma::transport::tcp
