// The TCP transport's connections: endpoints, the listener, dials and redials, the TLS
// handshake, Hello and who may be a peer. Owned by the engine thread (tcp_transport.h).
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
#include <utility>

#include "common/guest_fault.h"
#include "common/log.h"
#include "common/rc_tcp.h"

namespace vrdma::transport::tcp {

using namespace vrdma::proto::wire;

namespace {

void set_options(int fd) {
  const int one = 1;
  // Unacknowledged data for 2 s ends the connection (a link that is down), so it is redialed
  // rather than left hanging in kernel retransmits.
  set_rc_tcp_options(fd, 2000);
  // An idle connection is probed too (a peer host that vanished while nothing was in flight):
  // 10 s of silence, then probes whose loss the user timeout above turns into a redial.
  // (QPs do not wait for this: their ACK clock spends their own budget while nothing moves.)
  const int idle_s = 10, interval_s = 2, probes = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
}

}  // namespace

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

TcpTransport::Conn* TcpTransport::add_conn(UniqueFd fd, const std::string& dialed,
                                           uint64_t now_ns) {
  auto c = std::make_unique<Conn>();
  c->fd = std::move(fd);
  c->dialed = dialed;
  c->addr = dialed.empty() ? endpoint_of(c->fd.get(), ::getpeername) : dialed;
  c->opened_ns = now_ns;
  c->active_ns = now_ns;
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

void TcpTransport::close_conn(Conn* c, const std::string& why) {
  if (c->dead) return;
  c->dead = true;
  if (c->closing) {
    --closing_;
    VLOG_INFO("transport tcp: connection to {} ({}, {}) closed: {}", c->node,
              c->dialed.empty() ? "accepted" : "dialed", c->addr, why);
  } else if (c->hello) {
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
    if (d.probe == c) d.probe = nullptr;
    if (d.conn != c) continue;
    // Redialed by the next poll after kRedialMs; or a probe still under way carries on.
    d.conn = std::exchange(d.probe, nullptr);
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
            endpoint_of(fd, ::getpeername), unauthenticated_, log::held_note(held));
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
  d.conn = connect_to(d, now_ns);
}

TcpTransport::Conn* TcpTransport::connect_to(Dial& d, uint64_t now_ns) {
  ++counters_.dials;
  UniqueFd fd(::socket(d.sa.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    note_failure(d, std::strerror(errno));
    return nullptr;
  }
  int r = ::connect(fd.get(), d.sa.sa(), d.sa.len);
  if (r < 0 && errno != EINPROGRESS) {
    note_failure(d, std::strerror(errno));  // refused at once: try again later
    return nullptr;
  }
  Conn* c = add_conn(std::move(fd), d.addr, now_ns);
  c->expect = d.expect;
  c->connecting = r < 0;
  c->dialed_ns = now_ns;
  Hello h{};
  put_name(h.node, opt_.node);
  h.wire_version = kWireVersion;
  queue(*c, Type::kHello, &h, {}, {});
  if (c->connecting || c->tls) set_out(*c, true);  // TLS: the handshake starts when writable
  return c;
}

void TcpTransport::probe(Dial& d, uint64_t now_ns) {
  const uint64_t last = d.probe ? d.probe->dialed_ns : d.conn->dialed_ns;
  if (now_ns - last < kProbeMs * 1000000) return;
  if (d.probe) close_conn(d.probe, "a later attempt took over");
  d.probe = connect_to(d, now_ns);
}

void TcpTransport::connected(Conn& c) {
  for (Dial& d : dials_) {
    if (d.probe == &c) {
      // The probe got through first (the link is back; the first attempt's SYNs wait for the
      // kernel's next try): it carries on as the dial, the first attempt goes.
      Conn* first = d.conn;
      d.conn = &c;
      d.probe = nullptr;
      if (first) close_conn(first, "a later attempt got through first");
    } else if (d.conn == &c && d.probe) {
      close_conn(d.probe, "the first attempt got through");
    }
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
    // Both sides dialed: keep the connection the smaller node name dialed; both agree. The
    // other closes as an agreed close does (each side writes out what it queued there, shuts
    // its side and reads until the peer's FIN), so no frame on it is lost: frames the peer sent
    // on it before it saw this Hello are read, and nothing is lost from our queue there. (A
    // plain close threw away what was unread or unsent: an RDMA CM request sent on it, which
    // nothing replays, was lost; hosts.rdmacm's rping waited for it under ASan.)
    Conn* old = it->second;
    const bool keep_new = (opt_.node < c.node) == !c.dialed.empty();
    VLOG_INFO("transport tcp: second connection to {}; keeping the {} one", c.node,
              keep_new ? "new" : "old");
    if (!keep_new) {
      begin_closing(c, true);
      return;
    }
    begin_closing(*old, true);
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

bool TcpTransport::allowed(const std::string& node) const {
  return allow_.empty() || std::find(allow_.begin(), allow_.end(), node) != allow_.end();
}

Status TcpTransport::add_peer(const std::string& node, const std::string& addr) {
  ASSIGN_OR_RETURN(Endpoint sa, parse_endpoint(addr));
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
  d.wanted = false;  // dialed by the first frame for it (send)
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

TcpTransport::Dial* TcpTransport::dial_of(const std::string& node) {
  for (Dial& d : dials_) {
    if (d.expect == node || d.node == node) return &d;
  }
  return nullptr;
}

TcpTransport::Conn* TcpTransport::tx_conn(const std::string& node) const {
  if (auto it = by_node_.find(node); it != by_node_.end()) return it->second;
  for (const Dial& d : dials_) {
    if (d.conn && !d.conn->dead && (d.expect == node || d.node == node)) return d.conn;
  }
  return nullptr;
}

// Closing an idle connection (wire kClose): A asks; B accepts unless a QP of its own faces A
// (then it refuses and A waits another idle period). From its accept on, B queues nothing
// more on the connection, and A from the accept's arrival: a frame either side needs to send
// later goes on a new connection (dialed on demand). Each writes out what it had queued,
// shuts its side (FIN) and reads until the peer's FIN, so every frame sent before is
// delivered: A's frames sent between its ask and B's accept are read by B before A's FIN,
// and B sends nothing after its accept. Both asking at once: each takes the other's ask as
// its accept.
void TcpTransport::check_idle(uint64_t now_ns) {
  idle_checked_ns_ = now_ns;
  const uint64_t idle_ns = opt_.idle_close_ms * 1000000;
  std::vector<Conn*> ask, done;
  for (auto& [fd, cp] : conns_) {
    Conn& c = *cp;
    if (c.dead) continue;
    if (c.closing) {
      if (now_ns - c.closing_ns > kCloseWaitMs * 1000000) {
        done.push_back(&c);
      } else {
        finish_closing(c);
      }
      continue;
    }
    if (!idle_ns || !c.hello || c.node == opt_.node) continue;
    if (auto bn = by_node_.find(c.node); bn == by_node_.end() || bn->second != &c) continue;
    if (c.asked_ns) {
      if (now_ns - c.asked_ns > kCloseWaitMs * 1000000) {
        c.asked_ns = 0;  // no answer: it stays, and is asked again after another idle period
        c.active_ns = now_ns;
      }
      continue;
    }
    if (now_ns - c.active_ns < idle_ns) continue;
    if (!c.txq.empty() || c.rx != Rx::kHead || c.rpos != c.rend || acked_of(c) < c.written)
      continue;
    if (rx_.uses_peer(c.node)) {
      c.active_ns = now_ns;  // looked at again after another idle period
      continue;
    }
    ask.push_back(&c);
  }
  for (Conn* c : done) close_conn(c, "the peer did not finish the agreed close in time");
  for (Conn* c : ask) {
    Close m{};
    m.kind = static_cast<uint8_t>(CloseKind::kAsk);
    queue(*c, Type::kClose, &m, {}, {});
    c->asked_ns = now_ns;
    VLOG_DEBUG("transport tcp: connection to {} idle for {} ms: asking to close it", c->node,
               opt_.idle_close_ms);
  }
}

void TcpTransport::on_close(Conn& c) {
  if (c.closing) return;  // the other's answer to a close both asked for
  const auto kind = static_cast<CloseKind>(c.frame.close.kind);
  if (kind == CloseKind::kRefuse) {
    c.asked_ns = 0;
    c.active_ns = now_ns_;
    VLOG_DEBUG("transport tcp: {} keeps the connection (a QP there uses it)", c.node);
    return;
  }
  if (kind == CloseKind::kAccept) {
    // The peer sends nothing more here (even if our ask had timed out meanwhile): close too.
    begin_closing(c);
    return;
  }
  // Asked: both at once, or nothing here uses it.
  const bool ok = c.asked_ns || (c.node != opt_.node && !rx_.uses_peer(c.node));
  Close m{};
  m.kind = static_cast<uint8_t>(ok ? CloseKind::kAccept : CloseKind::kRefuse);
  queue(c, Type::kClose, &m, {}, {});
  set_out(c, true);
  if (ok) {
    begin_closing(c);
  } else {
    c.active_ns = now_ns_;
  }
}

void TcpTransport::begin_closing(Conn& c, bool duplicate) {
  c.closing = true;
  c.duplicate = duplicate;
  c.closing_ns = now_ns_;
  c.asked_ns = 0;
  ++closing_;
  if (!duplicate) ++counters_.idle_closes;
  if (auto bn = by_node_.find(c.node); bn != by_node_.end() && bn->second == &c) {
    by_node_.erase(bn);
    down_since_[c.node] = now_ns_;
  }
  for (Dial& d : dials_) {
    if (d.conn != &c) continue;
    d.conn = nullptr;
    d.wanted = false;  // dialed again by the next frame for it
    d.next_ns = 0;
    d.backoff_ms = kRedialMs;
  }
  if (duplicate) {
    finish_closing(c);  // our FIN now if nothing is queued there; else after the queue (poll)
    return;             // on_hello said so
  }
  VLOG_INFO("transport tcp: connection to {} ({}) idle, unused on both sides: closing it", c.node,
            c.addr);
}

void TcpTransport::finish_closing(Conn& c) {
  if (c.dead || !c.closing) return;
  if (!c.shut && c.txq.empty() && !(c.tls && c.tls->out_pending())) {
    ::shutdown(c.fd.get(), SHUT_WR);
    c.shut = true;
  }
  if (c.shut && c.peer_eof)
    close_conn(&c, c.duplicate ? "duplicate, closed by agreement" : "idle, closed by agreement");
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

}  // namespace vrdma::transport::tcp
