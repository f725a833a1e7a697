// The TCP transport's frames: queued, batched and written (plain or through TLS), read and
// dispatched, and where each sits in the stream (TxMark). Owned by the engine thread.
#include "transport/tcp/tcp_delivered.h"
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

/// Payload bytes at or below this are copied into the batch; above, written from guest memory.
constexpr uint32_t kCopyPayloadMax = 8192;
/// Payload still to come at or above this is read straight into its spans, not via rbuf.
constexpr uint64_t kDirectReadMin = 16 * 1024;
constexpr size_t kBatchMax = 256 * 1024;
constexpr int kMaxIov = 64;

/// The IPv4 address of one end of `fd` (getpeername or getsockname), or 0.
uint32_t ipv4_of(int fd, int (*name)(int, sockaddr*, socklen_t*)) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (name(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0 || sa.sin_family != AF_INET) return 0;
  return sa.sin_addr.s_addr;
}

}  // namespace

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
  Conn* c = tx_conn(node);
  if (!c) {
    // A known peer not connected (on demand, or closed for being idle): dialed now, unless
    // its dials are failing and backing off (then as a peer that is down: false).
    Dial* d = want_dial(node);
    if (!d || !d->conn) return false;
    c = d->conn;  // the frame waits behind the handshake and our Hello
  }
  c->active_ns = now_ns_;
  queue(*c, t, body, payload, holds, flow);
  return true;
}

void TcpTransport::drop_flow(const std::string& node, uint64_t flow) {
  Conn* found = tx_conn(node);
  if (flow == 0 || !found) return;
  Conn& c = *found;
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
  const Conn* found = tx_conn(node);
  if (!found || found->id != m.conn) return 0;
  // Dropped items still queued do not count (they are passed over, not written): a mark
  // before them is then seen a little shallower than it is.
  const Conn& c = *found;
  const uint64_t behind = m.end > c.written ? m.end - c.written : 0;
  return behind - std::min(behind, c.dropped_queued);
}

TxMark TcpTransport::tx_mark(const std::string& node) const {
  const Conn* c = tx_conn(node);
  if (!c) return {};
  return {c->id, c->queued_end};
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
  Conn* c = tx_conn(node);
  if (!c || c->id != m.conn) return false;
  return acked_of(*c) >= m.end;
}

uint64_t TcpTransport::tx_progress(const std::string& node) {
  Conn* found = tx_conn(node);
  if (!found) return 0;
  Conn& c = *found;
  // And segments the peer's TCP took beyond a hole at the front (SACKed): with a quarter of the
  // frames reordered and 1 % lost, TCP recovers a hole while the rest still crosses; judged by
  // the cumulative ACK alone, a QP under ib_write_bw spent its retries (RETRY_EXC_ERR) in 2 of
  // 6 runs of hosts.impaired_mix beside two busy loops.
  return (c.id << 48) + acked_of(c) + c.rx_bytes + tcp_delivered(c.fd.get());
}

bool TcpTransport::tcp_info_of(const std::string& node, tcp_info& ti) {
  const Conn* c = tx_conn(node);
  socklen_t len = sizeof(ti);
  return c && ::getsockopt(c->fd.get(), IPPROTO_TCP, TCP_INFO, &ti, &len) == 0;
}

uint64_t TcpTransport::tx_patience_ns(const std::string& node) {
  tcp_info ti{};
  if (!tcp_info_of(node, ti)) return 0;
  uint64_t us = uint64_t{ti.tcpi_rtt} + 4 * uint64_t{ti.tcpi_rttvar};
  // A segment not acknowledged yet, before TCP's own retransmission timer fired: the peer's TCP
  // may hold its ACK (delayed ACK: 40 ms on Linux, up to the round trip on a long path) when
  // its backend is not there to answer at once, and TCP itself calls nothing lost before its
  // timeout (its floor included). A QP timeout shorter than that (`timeout` 8: 1 ms) spent its
  // whole budget on a loopback path whose peer backend was preempted for 4 ms (TSan, load 9).
  if (ti.tcpi_unacked > 0 && ti.tcpi_backoff == 0)
    us = std::max<uint64_t>(us, uint64_t{ti.tcpi_rto} + ti.tcpi_rtt);
  // TCP recovering a lost segment by its retransmission timer, which backs off (50, 100, 200,
  // 400 ms: a retransmission lost again doubles it): the connection stands still until TCP's
  // next try, a stall of TCP's own on a path that still delivers. Waited out through
  // kBackoffsWaited backoffs (twice the current timeout covers those before it), so a lossy
  // path is not a transport error; beyond, as in an outage, the QPs' ACK timers spend their
  // retries as on a fabric (and TCP_USER_TIMEOUT redials).
  constexpr unsigned kBackoffsWaited = 3;
  if (ti.tcpi_unacked > 0 && ti.tcpi_backoff > 0 && ti.tcpi_backoff <= kBackoffsWaited)
    us = std::max<uint64_t>(us, 2 * uint64_t{ti.tcpi_rto} + ti.tcpi_rtt);
  return us * 1000;
}

uint64_t TcpTransport::peer_recovery_ns(const std::string& node) {
  tcp_info ti{};
  if (!tcp_info_of(node, ti)) return 0;
  // The timeout before our own backoffs (tcpi_rto doubles with each), standing for the peer's on
  // the same path: a segment sent and lost again kBackoffsWaited times is tried a last time
  // after 1 + 2 + 4 + 8 of it (15 x 200 ms = 3 s at Linux's floor), then crosses the path.
  const uint64_t rto_us = uint64_t{ti.tcpi_rto} >> std::min<uint32_t>(ti.tcpi_backoff, 16);
  return (15 * rto_us + uint64_t{ti.tcpi_rtt}) * 1000;
}

bool TcpTransport::peer_window_closed(const std::string& node) {
  const Conn* c = tx_conn(node);
  tcp_info ti{};
  if (!c || !tcp_info_of(node, ti) || ti.tcpi_unacked != 0) return false;
  // Nothing in flight, yet bytes in the socket not sent: only a closed window holds them (the
  // socket has TCP_NODELAY, and autocorking waits only behind a segment in flight). Our own
  // queue is not looked at: it waits behind the socket's.
  int unsent = 0;
  return ::ioctl(c->fd.get(), SIOCOUTQNSD, &unsent) == 0 && unsent > 0;
}

bool TcpTransport::peer_not_taken(const std::string& node) {
  const Conn* c = tx_conn(node);
  if (!c || c->hello || c->connecting || c->dialed.empty()) return false;
  // Something of ours (our Hello, TLS: the ClientHello) went, and the peer's TCP has all of it
  // (nothing in our socket): its kernel accepted the connection, its backend did not answer.
  int outq = 0;
  const uint64_t sent = c->tls ? c->tls->sent() : c->written - c->skipped;
  return sent > 0 && ::ioctl(c->fd.get(), SIOCOUTQ, &outq) == 0 && outq == 0;
}

std::string TcpTransport::path_state(const std::string& node) {
  const Conn* c = tx_conn(node);
  tcp_info ti{};
  if (!c || !tcp_info_of(node, ti)) return {};
  int unsent = 0, unread = 0;
  (void)::ioctl(c->fd.get(), SIOCOUTQNSD, &unsent);
  (void)::ioctl(c->fd.get(), SIOCINQ, &unread);
  return fmt::format(
      "tcp: {} segments unacknowledged, {} bytes not sent, {} here not read, backoff {}, rto {} "
      "ms, "
      "rtt {:.1f} ms, {} retransmissions in all",
      ti.tcpi_unacked, unsent, unread, ti.tcpi_backoff, ti.tcpi_rto / 1000, ti.tcpi_rtt / 1000.0,
      ti.tcpi_total_retrans);
}

bool TcpTransport::rx_pending(const std::string& node) {
  const Conn* found = tx_conn(node);
  if (!found) return false;
  const Conn& c = *found;
  if (c.rpos != c.rend || (c.tls && c.tls->has_buffered())) return true;
  int inq = 0;
  return ::ioctl(c.fd.get(), SIOCINQ, &inq) == 0 && inq > 0;
}

TcpTransport::Dial* TcpTransport::want_dial(const std::string& node) {
  Dial* d = dial_of(node);
  if (!d) return nullptr;
  d->wanted = true;
  if (!d->conn && now_ns_ >= d->next_ns && !connected_to(node)) dial(*d, now_ns_);
  return d;
}

bool TcpTransport::want_connection(const std::string& node) {
  return tx_conn(node) != nullptr || want_dial(node) != nullptr;
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
    c.active_ns = now_ns_;
    return r;
  }
  if (r < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
  if (r == 0 && c.closing) {
    // The peer shut its side of a connection we agreed to close: all it sent has been read.
    c.peer_eof = true;
    epoll_event ev{};
    ev.events = c.want_out ? EPOLLOUT : 0u;
    ev.data.ptr = &c;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
    finish_closing(c);
    return -1;
  }
  if (r == 0 && c.hello && !c.txq.empty() && !flush(c)) return -1;  // flush closed it
  // (The peer shut its side: it may be dropping this one of two connections dialed at once,
  // on_hello, before its Hello on the other reached us, and reads here until our FIN: what we
  // queued here went out above, as far as the socket took it at once.)
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
      case Type::kClose:
        on_close(c);
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
    const bool guest = c.sent >= it.bytes.size();
    if (!guest) {
      p = it.bytes.data() + c.sent;
      n = it.bytes.size() - c.sent;
    } else {
      uint64_t off = c.sent - it.bytes.size();
      for (const Span& s : it.spans) {
        if (off < s.n) {
          p = s.p + off;
          n = s.n - off;
          break;
        }
        off -= s.n;
      }
    }
    std::string why;
    uintptr_t fault = 0;
    // Guest memory is sealed under a fault guard, straight from where it is.
    const ssize_t w = t.write(p, n, why, guest ? &fault : nullptr);
    if (fault)
      VLOG_WARN(
          "tcp: guest memory at {:#x} faulted (SIGBUS/SIGSEGV) sending to {}; zeros are sent "
          "instead",
          fault, c.node);
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

bool TcpTransport::read_conn(Conn& c) {
  bool did = false;
  // Bounded per visit so one busy peer cannot starve the engine's rings: about 1 MiB.
  const int rounds = 16;
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

}  // namespace vrdma::transport::tcp
