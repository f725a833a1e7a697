// The direct path across backends: the hub (its thread, epoll, listeners), the hellos of
// connections that come in, dialing a peer's library, and the end of a QP's connections.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/core_names.h>
#include <openssl/err.h>
#include <openssl/kdf.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "common/listener_rest.h"
#include "common/log.h"
#include "common/rc_tcp.h"
#include "common/rdma_atomic.h"
#include "proto/device_caps.h"
#include "verbs/internal.h"
#include "verbs/remote_impl.h"
#include "verbs/stop_world.h"

namespace vrdma::verbs::dlink {

constexpr uint32_t kAskFirst = 64;      ///< posts between asks after a "not yet"
constexpr uint32_t kAskMax = 1u << 16;  ///< ... growing to this
/// ... but no longer than this after a "not yet" (a peer back from a move offers when it is
/// ready, whatever posts that takes here). A failed dial waits for posts only (kDialMs each).
constexpr uint64_t kAskAtLeastNs = 250'000'000;

uint64_t now_ms() { return mono_ns() / 1000000; }

uint64_t hub_spin_ns() {
  // VRDMA_SPIN_US was its first name, too near the backend's `spin_us` (its own rings' polling):
  // still read, with a line once per process saying the new one.
  const char* name = "VRDMA_POLL_SPIN_US";
  if (!::secure_getenv(name) && ::secure_getenv("VRDMA_SPIN_US")) {
    name = "VRDMA_SPIN_US";
    static std::once_flag once;
    std::call_once(once, [] {
      VLOG_WARN(
          "VRDMA_SPIN_US is deprecated: the library's poll spin is VRDMA_POLL_SPIN_US "
          "(the backend's is [datapath] spin_us)");
    });
  }
  return env_us(name, kHubSpinUs, 10'000'000) * 1000;
}

void epoll_set(Hub& h, int op, int fd, uint32_t events, Watch* w) {
  epoll_event e{};
  e.events = events;
  e.data.ptr = w;
  ::epoll_ctl(h.ep.get(), op, fd, &e);
}

void rearm(Conn& c) {
  std::lock_guard<std::mutex> g(c.arm_mu);
  // Claimed with nothing to write: out of the epoll (Conn::claimed); its polls see the end.
  if (c.broken.load() || (c.claimed.load() && !c.want_out.load())) {
    if (c.watched) epoll_set(*c.hub, EPOLL_CTL_DEL, c.fd.get(), 0, nullptr);
    c.watched = false;
    return;
  }
  uint32_t ev = EPOLLRDHUP;
  if (!c.claimed.load()) ev |= EPOLLIN;
  if (c.want_out.load()) ev |= EPOLLOUT;
  epoll_set(*c.hub, c.watched ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c.fd.get(), ev, &c);
  c.watched = true;
}

void set_sock_opts(int fd) {
  // As the backends' transport (RTO floor and ceiling, linear retries: a lossy link costs the
  // same on both paths), but 5 s before unacknowledged data ends the connection, and no
  // keepalive: a broken connection is not redialed (a QP with work in flight fails), so an
  // idle one is not ended for a peer that may come back.
  set_rc_tcp_options(fd, 5000);
}

// ---- the hub ----

void register_conn(Hub& h, const std::shared_ptr<Conn>& c) {
  {
    std::lock_guard<std::mutex> g(h.mu);
    h.conns.push_back(c);
    h.gen.fetch_add(1, std::memory_order_release);
  }
  rearm(*c);
  if (!wake_hub(h)) VLOG_WARN("direct path: cannot wake the hub thread: {}", std::strerror(errno));
}

bool wake_hub(Hub& h) {
  const uint64_t one = 1;
  return ::write(h.wake.get(), &one, sizeof(one)) >= 0;
}

void retire(Hub& h, const std::shared_ptr<Conn>& c) {
  {
    std::lock_guard<std::mutex> g(c->rx_mu);
    c->qp = nullptr;
  }
  {
    std::lock_guard<std::mutex> g(c->tx_mu);
    c->backlog.clear();
    c->broken.store(true);
  }
  rearm(*c);
  ::shutdown(c->fd.get(), SHUT_RDWR);
  std::lock_guard<std::mutex> g(h.mu);
  std::erase(h.conns, c);
  h.gen.fetch_add(1, std::memory_order_release);
}

std::shared_ptr<Conn> find_conn(Hub& h, const Watch* p) {
  std::lock_guard<std::mutex> g(h.mu);
  for (const auto& c : h.conns) {
    if (static_cast<const Watch*>(c.get()) == p) return c;
  }
  return nullptr;
}

/// "ADDR:PORT" of a peer, for log lines.
std::string addr_of(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof(ip));
  return fmt::format("{}:{}", ip, ntohs(a.sin_port));
}

/// Compares tokens in a time that does not depend on where they differ.
bool same_token(const uint8_t* a, const uint8_t* b) {
  uint8_t d = 0;
  for (size_t i = 0; i < kDirectTokenBytes; ++i) d |= a[i] ^ b[i];
  return d == 0;
}

/// Counts a stranger's connection and logs it (a line a second at most, with the count): it is
/// closed by the caller, unanswered.
void refuse(Hub& h, const Hub::Pending& p, const char* why) {
  const uint64_t n = h.refused.fetch_add(1, std::memory_order_relaxed) + 1;
  uint64_t held = 0;
  if (h.refused_log.ready(mono_ns(), held))
    VLOG_WARN("direct path: refused a connection from {}: {} ({} refused so far){}",
              addr_of(p.from), why, n, log::held_note(held));
}

/// Writes a hello's answer: false unless all of it went (tx_mu held, for a published one).
bool answer_hello(Conn& c, const HelloAck& ack) {
  const iovec v{const_cast<HelloAck*>(&ack), sizeof(ack)};
  if (tls_write(c, &v, 1, 0) != static_cast<ssize_t>(sizeof(ack))) return false;
  if (c.rs->out_pending()) c.want_out.store(true);  // the caller arms the connection
  return true;
}

/// A dialer's hello is complete, inside a TLS session whose key was that of the offer its
/// identity named. Unless the hello names the same QP pair and the offer is still the one the
/// key came from, nothing else is done: the connection is refused and closed, unanswered.
void accept_hello(Hub& h, Hub::Pending& p) {
  VContext& ctx = *h.ctx;
  if (const Status st = check_hello(p.h); !st.is_ok()) {
    refuse(h, p, st.message().c_str());
    return;
  }
  if (!p.known || p.h.from_qpn != p.id.from_qpn || p.h.to_qpn != p.id.to_qpn) {
    refuse(h, p, "a hello for another QP pair than its key's");
    return;
  }
  HelloAck ack{kDirectMagic, EPERM, 0, 0};
  auto c = std::make_shared<Conn>();
  // Taken before the connection is published: the answer goes out before anything of ours.
  std::unique_lock<std::mutex> tx(c->tx_mu);
  {
    std::lock_guard<std::mutex> go(ctx.objs_mu);
    std::lock_guard<std::mutex> g(h.mu);
    VQp* qp = offer_of(ctx, p.h.to_qpn, p.h.from_qpn);
    RemoteQp* r = qp ? qp->remote.get() : nullptr;
    // One per QP's life in RTR/RTS (a reset ends it and the offer); and none when our own
    // dial got there first: the peer's library then adopts that one (EBUSY tells it).
    if (r && same_token(r->token, p.token) && r->in) {
      ack.err = EBUSY;
    } else if (r && same_token(r->token, p.token)) {
      c->req_in.store(true);
      c->peer_takes_requests = (p.h.flags & kTakesRequests) != 0;
      c->fd = std::move(p.fd);
      c->rs = std::move(p.rs);
      c->hub = &h;
      c->qp = qp;
      c->send_cq = qp->qp.send_cq;
      c->recv_cq = qp->qp.recv_cq;
      c->rq_hdr = receive_queue(*qp);
      r->peer_lid = p.h.from_lid;
      ack.lid = r->my_lid;
      r->in = c;
      r->in_raw.store(c.get(), std::memory_order_release);
      h.conns.push_back(c);
      h.gen.fetch_add(1, std::memory_order_release);
      ack.err = 0;
    }
  }
  if (ack.err == EPERM) {
    refuse(h, p,
           fmt::format("no offer of QP {:#x} to QP {:#x} with that key", p.h.to_qpn, p.h.from_qpn)
               .c_str());
    return;
  }
  if (ack.err == 0) {
    if (!answer_hello(*c, ack)) c->broken.store(true);
    tx.unlock();
    rearm(*c);
    VLOG_INFO("direct path: QP {:#x} takes QP {:#x}'s requests from its library at {} ({}, {})",
              p.h.to_qpn, p.h.from_qpn, addr_of(p.from), SSL_get_version(p.ssl.get()),
              SSL_get_cipher_name(p.ssl.get()));
    return;
  }
  tx.unlock();
  c->fd = std::move(p.fd);
  c->rs = std::move(p.rs);
  answer_hello(*c, ack);
  VLOG_INFO("direct path: QP {:#x} has a connection from QP {:#x}'s library already", p.h.to_qpn,
            p.h.from_qpn);
}

/// A handshake's next step, then the hello: 1 it is all there, 0 more to come, -1 refused
/// (`why`). A connection that does not open with a TLS handshake record is refused before a
/// byte of it is read: nothing of a stranger's plaintext is parsed, nor answered.
int hello_step(Hub& h, Hub::Pending& p, std::string& why) {
  if (!p.ssl) {
    uint8_t first = 0;
    const ssize_t r = ::recv(p.fd.get(), &first, 1, MSG_PEEK);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (r <= 0) {
      why = r == 0 ? "closed before its hello" : "failed before its hello";
      return -1;
    }
    constexpr uint8_t kTlsHandshake = 22;  // a TLS record's content type
    if (first != kTlsHandshake) {
      why = "not TLS (a stranger, or a library of an older version)";
      return -1;
    }
    SSL_CTX* tls = hub_tls(h);
    p.ssl.reset(tls ? SSL_new(tls) : nullptr);
    if (!p.ssl || !set_socket(p.ssl.get(), p.fd.get())) {
      why = "no TLS session for it";
      return -1;
    }
    SSL_set_app_data(p.ssl.get(), &p);
    SSL_set_ex_data(p.ssl.get(), secrets_index(), &p.secrets);
    SSL_set_accept_state(p.ssl.get());
  }
  SSL* s = p.ssl.get();
  if (p.shook) {
    // The hello, through our records: no byte past its record is read.
    const ssize_t r = read_bounded(*p.rs, p.fd.get(), reinterpret_cast<uint8_t*>(&p.h) + p.got,
                                   sizeof(Hello) - p.got, why);
    if (r < 0) {
      why = why.empty() ? "closed before its hello" : "its hello: " + why;
      return -1;
    }
    p.got += static_cast<size_t>(r);
    return p.got == sizeof(Hello) ? 1 : 0;
  }
  ERR_clear_error();
  const int r = SSL_accept(s);
  if (r > 0) {
    p.shook = true;
    SSL_set_app_data(s, nullptr);
    const char* fail = nullptr;
    p.rs = take_over(s, p.secrets, fail);
    if (!p.rs) {
      why = fmt::format("after its TLS handshake: {}", fail);
      return -1;
    }
    return hello_step(h, p, why);  // the hello may have come with the handshake's end
  }
  const int e = SSL_get_error(s, r);
  p.want_out = e == SSL_ERROR_WANT_WRITE;
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) return 0;
  why = fmt::format("its TLS handshake failed: {}{}", tls_reason(),
                    p.why.empty() ? "" : " (" + p.why + ")");
  return -1;
}

/// Reads what came of a handshake and hello. True when the connection is done with (checked, or
/// refused: it is closed with `p`). A watched one (`deadline` set) is no longer watched then.
bool read_hello(Hub& h, Hub::Pending& p) {
  std::string why;
  const int step = hello_step(h, p, why);
  if (step == 0) {
    if (p.deadline)
      epoll_set(h, EPOLL_CTL_MOD, p.fd.get(), EPOLLIN | (p.want_out ? uint32_t{EPOLLOUT} : 0u), &p);
    return false;
  }
  // Unwatched before the descriptor may move to a connection, which the hub watches anew.
  if (p.deadline) epoll_set(h, EPOLL_CTL_DEL, p.fd.get(), 0, nullptr);
  if (step > 0)
    accept_hello(h, p);
  else
    refuse(h, p, why.c_str());
  return true;
}

void on_pending(Hub& h, Hub::Pending* p) {
  auto it =
      std::find_if(h.pending.begin(), h.pending.end(), [&](const auto& x) { return x.get() == p; });
  if (it == h.pending.end()) return;  // (checked by the caller too)
  if (read_hello(h, *p)) h.pending.erase(it);
}

/// Takes the connections waiting at listener `l`. A hello that is there in full at once is
/// checked at once; others wait in `pending`, at most kMaxPending of them: more are closed.
void accept_all(Hub& h, Hub::Listener& l) {
  for (;;) {
    auto p = std::make_unique<Hub::Pending>();
    socklen_t len = sizeof(p->from);
    p->fd = UniqueFd(::accept4(l.fd.get(), reinterpret_cast<sockaddr*>(&p->from), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!p->fd.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      uint64_t held = 0;
      if (ListenerRest::out_of_descriptors(errno) && l.rest.start(mono_ns(), held))
        VLOG_WARN(
            "direct path: cannot accept peers' libraries on port {}: {}; not listening for "
            "{} ms{}",
            l.port, std::strerror(errno), ListenerRest::kRestNs / 1000000, log::held_note(held));
      return;  // EAGAIN: all taken
    }
    set_sock_opts(p->fd.get());
    if (read_hello(h, *p)) continue;
    if (h.pending.size() >= kMaxPending) {
      const uint64_t n = h.over_cap.fetch_add(1, std::memory_order_relaxed) + 1;
      uint64_t held = 0;
      if (h.over_cap_log.ready(mono_ns(), held))
        VLOG_WARN(
            "direct path: closed a connection from {}: {} others have not said hello yet ({} "
            "closed so far){}",
            addr_of(p->from), kMaxPending, n, log::held_note(held));
      continue;
    }
    p->deadline = now_ms() + kHelloMs;
    epoll_set(h, EPOLL_CTL_ADD, p->fd.get(), EPOLLIN | (p->want_out ? uint32_t{EPOLLOUT} : 0u),
              p.get());
    h.pending.push_back(std::move(p));
  }
}

/// Closes the connections whose hello is late.
void expire_pending(Hub& h, uint64_t now) {
  std::erase_if(h.pending, [&](const auto& p) {
    if (p->deadline > now) return false;
    epoll_set(h, EPOLL_CTL_DEL, p->fd.get(), 0, nullptr);
    const uint64_t n = h.timed_out.fetch_add(1, std::memory_order_relaxed) + 1;
    uint64_t held = 0;
    if (h.timed_out_log.ready(mono_ns(), held))
      VLOG_WARN("direct path: closed a connection from {}: no hello within {} ms ({} so far){}",
                addr_of(p->from), kHelloMs, n, log::held_note(held));
    return true;
  });
}

/// How long the hub may wait for an event. While it has connections, kClaimMs: the application
/// may claim one at any time (it says nothing to the hub), and the hub must see when its polls
/// stop, to take the connection back and send the ACK it owes. While hellos are awaited, their
/// deadlines; while a listener rests, its end.
int hub_timeout(Hub& h, uint64_t now) {
  int ms = -1;
  auto at_most = [&](int m) { ms = ms < 0 ? m : std::min(ms, m); };
  {
    std::lock_guard<std::mutex> g(h.mu);
    if (!h.conns.empty()) at_most(kClaimMs);
  }
  // Our backend may ask a QP back at any time (before a move): looked for at each tick.
  if (h.nqps.load(std::memory_order_relaxed)) at_most(kRevokeTickMs);
  if (!h.pending.empty()) at_most(200);
  {
    std::lock_guard<std::mutex> d(h.doom_mu);
    if (!h.doomed.empty()) at_most(kClaimMs);
  }
  for (size_t i = 0; i < h.nlisteners.load(std::memory_order_acquire); ++i) {
    if (const uint64_t until = h.listeners[i].rest.until_ns())
      at_most(until > now ? static_cast<int>((until - now + 999999) / 1000000) : 0);
  }
  return ms;
}

/// Claims whose polls stopped without a completion: the hub watches those connections again.
void release_idle_claims(Hub& h) {
  std::vector<std::shared_ptr<Conn>> idle;
  {
    std::lock_guard<std::mutex> g(h.mu);
    for (const auto& c : h.conns) {
      if (!c->claimed.load(std::memory_order_relaxed)) continue;
      const uint32_t p = c->polls.load(std::memory_order_relaxed);
      if (p == c->polls_seen) idle.push_back(c);
      c->polls_seen = p;
    }
  }
  for (const auto& c : idle) unclaim(*c);
}

void unclaim(Conn& c, bool ack_now) {
  c.claimed.store(false);
  flush_held(c);  // requests held for a poll that did not come
  if (ack_now) {
    send_ack(c);  // (nothing on a connection that carries no requests to us)
  } else if (c.executed.load() != c.acked.load()) {
    c.ack_deferred_ns.store(mono_ns());
    if (!c.hub->ack_armed.exchange(true)) arm_ack_timer(*c.hub, kAckDeferNs);
  }
  rearm(c);
}

/// RNR waits: kResumes owed for receives posted since (post_recv sends them itself; this
/// catches a completion ring that had no room, and a post that raced with the kRnr), and
/// counted retries whose timer is over while the application does not poll.
void rnr_tick(Hub& h) {
  std::vector<std::shared_ptr<Conn>> owe;
  {
    std::lock_guard<std::mutex> g(h.mu);
    owe = h.conns;
  }
  for (const auto& c : owe) {
    std::lock_guard<std::mutex> g(c->rx_mu);
    if (!c->qp || !c->qp->remote) continue;
    if (c->req_in.load(std::memory_order_relaxed)) try_resume(*c, *c->qp, *c->qp->remote);
    if (c->resp_in.load(std::memory_order_relaxed)) rnr_retry_due(*c, *c->qp, *c->qp->remote);
  }
}

void run(Hub& h) {
  sigset_t all;
  ::sigfillset(&all);
  // Except the signal that stops it while memory is registered (stop_world.h): it allocates.
  ::sigdelset(&all, stop_signal());
  ::pthread_sigmask(SIG_BLOCK, &all, nullptr);
  epoll_event ev[32];
  uint64_t resumed_at = now_ms();
  const uint64_t spin_ns = hub_spin_ns();
  uint64_t busy_at = 0;  ///< when the hub last read a connection
  ::pthread_setname_np(::pthread_self(), "vrdma-hub");
  for (;;) {
    const uint64_t now = mono_ns();
    const bool spin = now - busy_at < spin_ns;
    const int n = ::epoll_wait(h.ep.get(), ev, 32, spin ? 0 : hub_timeout(h, now));
    if (n == 0 && spin) {
      // Polling: the CPU goes to whoever else wants it between polls (a spinning target has
      // to run to see its memory).
      ::sched_yield();
      continue;
    }
    for (int i = 0; i < n; ++i) {
      // A connection may have gone since epoll_wait returned: the pointer is only compared
      // with what still exists (find_conn, pending) before anything reads through it.
      // Listeners stay as long as the hub.
      auto* w = static_cast<Watch*>(ev[i].data.ptr);
      const size_t nl = h.nlisteners.load(std::memory_order_acquire);
      const bool listener = std::any_of(h.listeners.begin(), h.listeners.begin() + nl,
                                        [&](const Watch& l) { return &l == w; });
      const Watch::Kind kind = w == &h.stop_w    ? Watch::kStop
                               : w == &h.wake_w  ? Watch::kWake
                               : w == &h.ack_w   ? Watch::kAckTimer
                               : listener        ? Watch::kListen
                               : std::any_of(h.pending.begin(), h.pending.end(),
                                             [&](const auto& p) { return p.get() == w; })
                                   ? Watch::kPending
                                   : Watch::kConn;
      switch (kind) {
        case Watch::kStop:
          return;
        case Watch::kWake: {  // only empties the eventfd: the tick is set up below
          uint64_t n;
          [[maybe_unused]] const ssize_t got = ::read(h.wake.get(), &n, sizeof(n));
          break;
        }
        case Watch::kAckTimer:
          send_deferred_acks(h);
          break;
        case Watch::kListen:
          accept_all(h, *static_cast<Hub::Listener*>(w));
          break;
        case Watch::kPending:
          on_pending(h, static_cast<Hub::Pending*>(w));
          break;
        case Watch::kConn: {
          std::shared_ptr<Conn> c = find_conn(h, w);
          if (!c) break;
          if (ev[i].events & EPOLLOUT) {
            std::lock_guard<std::mutex> g(c->tx_mu);
            flush_locked(*c);
          }
          if (ev[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) {
            std::lock_guard<std::mutex> g(c->rx_mu);
            if (!c->qp) break;
            if (drain(*c, false)) busy_at = now;
          }
          break;
        }
      }
    }
    release_idle_claims(h);
    const uint64_t t = now_ms();
    if (t - resumed_at >= kClaimMs) {
      rnr_tick(h);
      revoke_tick(h);
      doom_tick(h);
      ack_tick(h);
      resumed_at = t;
    }
    expire_pending(h, t);
    const uint64_t tn = mono_ns();
    for (size_t i = 0; i < h.nlisteners.load(std::memory_order_acquire); ++i)
      h.listeners[i].rest.poll(tn);
  }
}

Hub* hub_of(VContext& ctx) {
  if (Hub* h = ctx.hub_raw.load(std::memory_order_acquire)) return h;
  std::lock_guard<std::mutex> g(ctx.hub_make);
  if (ctx.hub) return ctx.hub.get();
  auto h = std::make_shared<Hub>();
  h->ctx = &ctx;
  h->ep = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  h->stop = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  h->wake = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  h->ack_timer = UniqueFd(::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
  if (!h->ep.valid() || !h->stop.valid() || !h->wake.valid() || !h->ack_timer.valid()) {
    VLOG_WARN("direct path: cannot start the hub: {}", std::strerror(errno));
    return nullptr;
  }
  h->max_conns = env_num("VRDMA_DIRECT_REMOTE_QPS", kDirectConnsDefault, 1u << 20, "connections");
  epoll_set(*h, EPOLL_CTL_ADD, h->stop.get(), EPOLLIN, &h->stop_w);
  epoll_set(*h, EPOLL_CTL_ADD, h->wake.get(), EPOLLIN, &h->wake_w);
  epoll_set(*h, EPOLL_CTL_ADD, h->ack_timer.get(), EPOLLIN, &h->ack_w);
  Hub* raw = h.get();
  h->thr = std::thread([raw] { run(*raw); });
  ctx.hub = std::move(h);
  ctx.hub_raw.store(raw, std::memory_order_release);
  return raw;
}

uint16_t listen_on(Hub& h, uint32_t ipv4) {
  std::lock_guard<std::mutex> g(h.listen_mu);
  const size_t n = h.nlisteners.load(std::memory_order_relaxed);
  for (size_t i = 0; i < n; ++i) {
    if (h.listeners[i].ipv4 == ipv4) return h.listeners[i].port;
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = ipv4;
  const std::string at = addr_of(a);
  if (n == kMaxListeners) {
    VLOG_WARN("direct path: not listening on {} too: {} addresses already", at, kMaxListeners);
    return 0;
  }
  if (!hub_tls(h)) return 0;  // (said once)
  Hub::Listener& l = h.listeners[n];
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  socklen_t alen = sizeof(a);
  if (!fd.valid() || ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::listen(fd.get(), 64) != 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &alen) != 0) {
    VLOG_WARN("direct path: cannot listen for peers' libraries on {}: {}", at,
              std::strerror(errno));
    return 0;
  }
  l.fd = std::move(fd);
  l.ipv4 = ipv4;
  l.port = ntohs(a.sin_port);
  l.rest.bind(h.ep.get(), l.fd.get(), reinterpret_cast<uintptr_t>(static_cast<Watch*>(&l)));
  // Published before it is watched: the thread tells a listener's events by this count.
  h.nlisteners.store(n + 1, std::memory_order_release);
  epoll_set(h, EPOLL_CTL_ADD, l.fd.get(), EPOLLIN, &l);
  VLOG_DEBUG("direct path: listening for peers' libraries on {}", addr_of(a));
  return l.port;
}

RemoteQp& remote_of(Hub& h, VQp& qp) {
  std::lock_guard<std::mutex> g(h.mu);
  if (!qp.remote) qp.remote = std::make_unique<RemoteQp>();
  return *qp.remote;
}

void back_off(RemoteQp& r, uint32_t base) {
  r.backoff = std::min(std::max(r.backoff * 2, base), kAskMax);
  r.ask_wait = r.backoff;
}

namespace {
/// Whether the context has as many library connections as it may dial (Hub::max_conns): then
/// `qp` stays on the backends (said once per process).
bool at_max_conns(Hub& h, const VQp& qp) {
  std::lock_guard<std::mutex> g(h.mu);
  const bool full = h.conns.size() >= h.max_conns;
  if (full && !h.said_max) {
    h.said_max = true;
    VLOG_INFO("direct path: QP {:#x} and further QPs stay on the backends: this process has {} "
              "connections to peers' libraries already (VRDMA_DIRECT_REMOTE_QPS)",
              qp.qp.qp_num, h.conns.size());
  }
  return full;
}
}  // namespace

bool connect_out(VQp& qp) {
  VContext& ctx = *to_vctx(qp.qp.context);
  // Only when everything the backend took from this SQ is completed: nothing can pass it.
  if (qp.sq_hdr->retired.load(std::memory_order_acquire) != qp.sq_prod) return false;
  if (qp.remote && qp.remote->revoking.load()) return false;  // going back to the backends
  if (qp.remote && qp.remote->ask_wait &&
      (!qp.remote->ask_by_ns || mono_ns() < qp.remote->ask_by_ns)) {
    --qp.remote->ask_wait;
    return false;
  }
  Hub* h = hub_of(ctx);
  if (!h) return false;
  RemoteQp& r = remote_of(*h, qp);
  // A revoke that begins from here on waits for the dial (try_finish); one begun already stops
  // it (both flags seq_cst: one side sees the other's).
  const Dialing dialing(r);
  if (r.revoking.load()) return false;
  DirectRemoteResp resp{};
  std::vector<UniqueFd> fds;
  // A send CQ with a channel: we fire it ourselves (its descriptors follow the ring's).
  const bool notify = qp.qp.send_cq->channel != nullptr;
  HandleReq req{qp.handle, notify ? kDirectRemoteNotify : 0};
  r.ask_by_ns = 0;
  if (const int rc = ctx.call(Op::kDirectRemote, req, resp, {}, &fds)) {
    if (rc == EAGAIN) {
      back_off(r, kAskFirst);
      r.ask_by_ns = mono_ns() + kAskAtLeastNs;
    } else {
      r.never = true;
    }
    return false;
  }
  watch_qp(*h, qp);  // the backend counts it as direct now: it may ask it back (revoke_tick)
  if (fds.size() != 1 + (notify ? kDirectNotifyFds : 0) || !resp.send_ring_entries ||
      (resp.send_ring_entries & (resp.send_ring_entries - 1)) ||
      !map_ring(r.send, fds[0].get(), resp.send_ring_entries) ||
      (notify && !take_cq_notify(*to_vcq(qp.qp.send_cq), fds, 1))) {
    VLOG_WARN("direct path: unusable answer for QP {:#x}; staying on the backend", qp.qp.qp_num);
    r.never = true;
    return false;
  }
  r.send.seen = r.send.hdr->consumer.load(std::memory_order_acquire);
  // The peer's library has dialed us: its connection takes our requests too.
  auto adoptable = [&] {
    std::lock_guard<std::mutex> g(h->mu);
    return r.in && !r.in->broken.load() && r.in->peer_takes_requests && !r.revoking.load()
               ? r.in
               : nullptr;
  };
  std::shared_ptr<Conn> c = adoptable();
  if (!c) {
    if (at_max_conns(*h, qp)) {
      back_off(r, kAskMax / 4);
      return false;
    }
    const Hello hello{kDirectMagic,  kDirectVersion, qp.qp.qp_num,
                      resp.peer_qpn, resp.my_lid,    r.offered ? kTakesRequests : 0};
    uint32_t peer_lid = 0;
    std::unique_ptr<tls::RecordStream> rs;
    std::string why;
    UniqueFd fd = dial(*h, resp.peer_ipv4, resp.peer_port, hello, resp.token, rs, peer_lid, why);
    if (fd.valid()) {
      c = std::make_shared<Conn>();
      c->fd = std::move(fd);
      c->rs = std::move(rs);
      c->hub = h;
      c->qp = &qp;
      c->send_cq = qp.qp.send_cq;
      c->recv_cq = qp.qp.recv_cq;
      c->rq_hdr = receive_queue(qp);
      c->resp_in.store(true);
      {
        std::lock_guard<std::mutex> g(h->mu);
        r.out = c;
        // The peer's requests come on it too, unless its own dial got here first (then each
        // direction keeps its own connection).
        if (!r.in && r.offered) {
          c->req_in.store(true);
          r.peer_lid = peer_lid;
          r.in = c;
          r.in_raw.store(c.get(), std::memory_order_release);
        }
      }
      register_conn(*h, c);
      // Asked back to the backends while it dialed: the peer hears so on this one too (the
      // revoke then settles it as any other), and nothing of ours goes on it.
      if (r.revoking.load()) {
        tell_revoke(r, *c);
        return false;
      }
    } else if (errno == EBUSY) {
      c = adoptable();  // both dialed at once, and the peer's got there first
    }
    if (!c) {
      char ip[INET_ADDRSTRLEN] = "?";
      ::inet_ntop(AF_INET, &resp.peer_ipv4, ip, sizeof(ip));
      VLOG_WARN(
          "direct path: QP {:#x} cannot reach its peer's library at {}:{} ({}); staying on "
          "the backend",
          qp.qp.qp_num, ip, resp.peer_port, !why.empty() ? why : std::strerror(errno));
      back_off(r, kAskMax / 4);
      return false;
    }
  }
  if (!c->resp_in.load()) {  // adopted
    std::lock_guard<std::mutex> g(h->mu);
    c->resp_in.store(true);
    r.out = c;
  }
  r.active.store(true, std::memory_order_release);
  VLOG_INFO("direct path: QP {:#x} sends to QP {:#x} through its library (TLSv1.3, {}){}",
            qp.qp.qp_num, resp.peer_qpn, kTlsSuite, c == r.in ? " (one connection both ways)" : "");
  return true;
}

void teardown(VQp& qp, bool take_arrived) {
  Hub* h = to_vctx(qp.qp.context)->hub_raw.load(std::memory_order_acquire);
  if (!h || !qp.remote) return;
  std::shared_ptr<Conn> in, out;
  {
    std::lock_guard<std::mutex> g(h->mu);
    qp.remote->dead = true;
    qp.remote->in_raw.store(nullptr);
    in = std::move(qp.remote->in);
    out = std::move(qp.remote->out);
  }
  qp.remote->active.store(false);
  // What we executed and have not acknowledged yet (an ACK that was to ride on a request of
  // ours) goes before the connection closes: the peer's WRs complete.
  if (in) {
    if (take_arrived) {
      // And what has arrived is taken first: ibv_srq_pingpong's peer has up to one SEND per QP
      // in flight beyond what this side waits for, and closing on them unread (the application
      // claimed the connection, and destroys its QPs right after its loop) failed them with
      // RETRY_EXC_ERR at the peer, which then exited 1.
      std::lock_guard<std::mutex> l(in->rx_mu);
      if (in->qp) drain(*in, false);
    }
    send_ack(*in);
    retire(*h, in);
  }
  if (out && out != in) retire(*h, out);
}

}  // namespace vrdma::verbs::dlink
