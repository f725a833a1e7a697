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

Result<std::unique_ptr<TcpTransport>> TcpTransport::create(Options o, Receiver& rx) {
  if (o.node.empty() || o.node.size() >= kNameMax)
    return error(EINVAL, "transport: node name must be 1..63 bytes");
  std::unique_ptr<TcpTransport> t(new TcpTransport(std::move(o), rx));
  RETURN_IF_ERROR(t->start());
  return t;
}

TcpTransport::~TcpTransport() = default;

namespace {

/// True when `fd` is a TCP socket listening at `la` (at any port when `la`'s is 0).
bool listens_at(int fd, const Endpoint& la) {
  Endpoint got;
  got.len = sizeof(got.ss);
  int on = 0;
  socklen_t len = sizeof(on);
  if (::getsockname(fd, got.sa(), &got.len) < 0 ||
      ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &len) < 0 || !on ||
      got.family() != la.family() || (la.port() != 0 && got.port() != la.port()))
    return false;
  const std::string a = format_endpoint(got.sa()), b = format_endpoint(la.sa());
  return a.substr(0, a.rfind(':')) == b.substr(0, b.rfind(':'));  // the addresses
}

}  // namespace

Status TcpTransport::start() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);  // the clock poll() is given: a send() before it dials
  now_ns_ = static_cast<uint64_t>(ts.tv_sec) * 1000000000 + static_cast<uint64_t>(ts.tv_nsec);
  epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) return error(errno, "epoll_create1");
  if (opt_.listen.empty()) return error(EINVAL, "transport: no listen address");
  ASSIGN_OR_RETURN(Endpoint la, parse_endpoint(opt_.listen));
  if (opt_.listener.valid() && listens_at(opt_.listener.get(), la)) {
    listen_ = std::move(opt_.listener);
    VLOG_INFO("transport tcp: listening on the socket kept across the restart");
  } else {
    if (opt_.listener.valid())
      VLOG_WARN("transport tcp: the kept listener ({}) is not at {}; binding anew",
                endpoint_of(opt_.listener.get(), ::getsockname), opt_.listen);
    opt_.listener.reset();
    listen_ = UniqueFd(::socket(la.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!listen_.valid()) return error(errno, "socket");
    const int one = 1;
    ::setsockopt(listen_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(listen_.get(), la.sa(), la.len) < 0)
      return error(errno, fmt::format("transport: bind {}: {}", opt_.listen, std::strerror(errno)));
    if (::listen(listen_.get(), 64) < 0) return error(errno, "listen");
  }
  // An ephemeral port (forced TCP on one host): dial what we got.
  if (la.port() == 0) opt_.listen = endpoint_of(listen_.get(), ::getsockname);
  watch_listener(true);
  accept_rest_.bind(epoll_.get(), listen_.get(), 0);  // data 0: the listener (watch_listener)
  std::vector<std::string> to_dial = opt_.peers;
  // Forced: pairs on this backend go through our own listener, like any peer.
  if (opt_.force) to_dial.push_back(opt_.listen);
  for (const std::string& p : to_dial) {
    ASSIGN_OR_RETURN(PeerSpec spec, parse_peer(p));
    if (!spec.node.empty()) allow_.push_back(spec.node);
    Dial d;
    d.addr = spec.addr;
    d.expect = spec.node;
    d.sa = spec.sa;
    dials_.push_back(std::move(d));
  }
  VLOG_INFO("transport tcp: node {} listening on {}, {} peer(s){}; {}", opt_.node, opt_.listen,
            opt_.peers.size(), opt_.force ? ", forced for every pair" : "",
            opt_.tls ? "TLS 1.3, peers authenticated by the cluster CA"
                     : "INSECURE: no authentication, no encryption");
  return Status::ok();
}

void TcpTransport::set_out(Conn& c, bool on) {
  if (c.want_out == on) return;
  c.want_out = on;
  epoll_event ev{};
  ev.events = (c.peer_eof ? 0u : EPOLLIN) | (on ? EPOLLOUT : 0u);
  ev.data.ptr = &c;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
}

std::vector<std::string> TcpTransport::connected() const {
  std::vector<std::string> out;
  for (const auto& [node, c] : by_node_) out.push_back(node);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> TcpTransport::known() const {
  std::vector<std::string> out;
  for (const Dial& d : dials_) {
    const std::string& n = d.expect.empty() ? d.node : d.expect;
    if (!n.empty() && n != opt_.node) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<std::string> TcpTransport::group_peers() const {
  std::vector<std::string> out = connected(), k = known();
  out.insert(out.end(), k.begin(), k.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
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
    const std::string& n = d.node.empty() ? d.expect : d.node;
    const bool up = !n.empty() && by_node_.count(n);
    out.push_back({d.addr, d.expect,
                   up         ? "connected"
                   : d.conn   ? "connecting"
                   : d.wanted ? "not connected"
                              : "idle",
                   d.last_error, d.last_error_unix, d.failures});
  }
  return out;
}

uint64_t TcpTransport::next_deadline() const {
  uint64_t d = 0;
  auto at = [&](uint64_t t) { d = d == 0 ? t : std::min(d, t); };
  for (const Dial& x : dials_) {
    if (!x.conn && x.wanted && !connected_to(x.node.empty() ? x.expect : x.node)) at(x.next_ns);
    if (x.conn && x.conn->connecting) {
      at(x.conn->dialed_ns + kConnectTimeoutMs * 1000000);
      at((x.probe ? x.probe->dialed_ns : x.conn->dialed_ns) + kProbeMs * 1000000);
    }
  }
  if (accept_rest_.until_ns()) at(accept_rest_.until_ns());
  if (!rx_again_.empty()) at(1);  // plaintext is waiting inside TLS: no event will say so
  for (const auto& [fd, c] : conns_) {
    if (!prehello_) break;
    if (!c->hello) at(c->opened_ns + kHelloTimeoutMs * 1000000);
  }
  for (const auto& [node, t] : stale_until_) at(t);
  if (opt_.idle_close_ms || closing_) at(idle_checked_ns_ + kIdleCheckNs);
  if (!claims_.empty()) at(now_ns_ + 100'000'000);
  return d;
}

bool TcpTransport::poll(uint64_t now_ns) {
  bool did = false;
  now_ns_ = now_ns;
  accept_rest_.poll(now_ns);
  for (Dial& d : dials_) {
    if (d.conn && d.conn->connecting && now_ns - d.conn->dialed_ns > kConnectTimeoutMs * 1000000) {
      close_conn(d.conn, "connect timed out");
      // A slow failure (it took the whole timeout): dialed again at once, not after a backoff.
      if (!d.conn) d.next_ns = now_ns;
    }
    if (d.conn && d.conn->connecting) probe(d, now_ns);
    if (!d.conn && d.wanted && now_ns >= d.next_ns &&
        !connected_to(d.node.empty() ? d.expect : d.node))
      dial(d, now_ns);
  }
  if (lookup_missed_) {
    // Embedded directory: a lookup found nothing; the configured peers not connected are
    // dialed, and their Hello brings their guests.
    lookup_missed_ = false;
    if (now_ns - asked_all_ns_ >= kAskAllMs * 1000000) {
      asked_all_ns_ = now_ns;
      for (Dial& d : dials_) d.wanted = true;
    }
  }
  if ((opt_.idle_close_ms || closing_) && now_ns - idle_checked_ns_ >= kIdleCheckNs)
    check_idle(now_ns);
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
      connected(*c);
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
    if (!c->dead && c->closing) finish_closing(*c);
    did = true;
  }
  graveyard_.clear();
  return did;
}

}  // namespace vrdma::transport::tcp
