// An attacker on the backends' network, for the trust tests (tests/hosts/trust_*.sh): it speaks
// the backend-to-backend wire format (proto/wire.h) itself, over plain TCP or over TLS with a
// certificate of the cluster, and claims whatever node name it is told. It asserts nothing: it
// prints one JSON line of what came back, and the scripts judge.
//
//   net_attacker plain ADDR:PORT --as NODE [ACTIONS]
//   net_attacker tls ADDR:PORT --dir CLUSTERDIR --cert NODE --as CLAIMED [ACTIONS]
//   net_attacker plain ADDR:PORT --idle N --hold SECONDS
// ACTIONS, sent in this order after the Hello, each frame well-formed:
//   --guest-up NAME:LID:GIDHEX          a directory entry (repeatable)
//   --probe DLID:DQPN:SQPN:SLID --window PSN0:COUNT
//                                       for every PSN of the window, a READ with a key nobody
//                                       issued, then a 64-byte SEND: an injection attempt
//   --linger MS                         how long to listen after the last frame (default 1500)
// `--idle`: N TCP connections that never send a byte, held SECONDS; "idle: N connected" goes to
// stderr once they are all up (or failed), the JSON line at the end.
// Exit status: 0 it ran (whatever the backend did), 2 a usage or local error.
#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "proto/wire.h"
#include "transport/tcp/tcp_transport.h"

using namespace vrdma;
using namespace vrdma::proto::wire;

namespace {

uint64_t now_ms() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000 + uint64_t(ts.tv_nsec) / 1000000;
}

[[noreturn]] void die(const std::string& why) {
  std::fprintf(stderr, "net_attacker: %s\n", why.c_str());
  std::exit(2);
}

std::string addr_text(const sockaddr_in& sa) {
  char ip[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
  return std::string(ip) + ":" + std::to_string(ntohs(sa.sin_port));
}

std::string ssl_error() {
  char buf[256] = "";
  const unsigned long e = ERR_get_error();
  if (e) ERR_error_string_n(e, buf, sizeof(buf));
  ERR_clear_error();
  return e ? buf : "no OpenSSL error";
}

/// A non-blocking connect to `sa`; empty on success, else why.
std::string connect_to(UniqueFd& fd, const sockaddr_in& sa, int timeout_ms) {
  fd = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return std::strerror(errno);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) == 0) return "";
  if (errno != EINPROGRESS) return std::strerror(errno);
  pollfd p{fd.get(), POLLOUT, 0};
  if (::poll(&p, 1, timeout_ms) != 1) return "connect timed out";
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
  return err ? std::strerror(err) : "";
}

/// What came back, frame by frame (the backend's wire format), or the bytes it could not decode.
struct Tally {
  std::vector<uint8_t> buf;
  uint64_t skip = 0;  ///< payload bytes of the current frame still to come
  uint64_t bytes = 0;
  std::map<std::string, uint64_t> frames;
  std::string peer_hello;   ///< the node name in the backend's Hello
  std::string undecodable;  ///< why the bytes stopped making sense; then they are only counted

  void feed(const uint8_t* p, size_t n) {
    bytes += n;
    if (!undecodable.empty()) return;
    buf.insert(buf.end(), p, p + n);
    size_t at = 0;
    for (;;) {
      const size_t avail = buf.size() - at;
      if (skip) {
        const size_t k = std::min<uint64_t>(skip, avail);
        skip -= k;
        at += k;
        if (skip) break;
        continue;
      }
      if (avail < sizeof(FrameHeader)) break;
      FrameHeader h;
      std::memcpy(&h, buf.data() + at, sizeof(h));
      Status st = check_header(h);
      if (st.is_ok() && avail < sizeof(h) + h.body) break;
      Frame f;
      if (st.is_ok()) st = decode(h, {buf.data() + at + sizeof(h), h.body}, f);
      if (!st.is_ok()) {
        undecodable = st.message();
        buf.clear();
        return;
      }
      ++frames[type_name(f.type())];
      if (f.type() == Type::kHello) peer_hello = std::string(get_name(f.hello.node));
      at += sizeof(h) + h.body;
      skip = h.payload;
    }
    buf.erase(buf.begin(), buf.begin() + static_cast<ptrdiff_t>(at));
  }

  static const char* type_name(Type t) {
    switch (t) {
      case Type::kHello:
        return "hello";
      case Type::kGuestUp:
        return "guest_up";
      case Type::kGuestDown:
        return "guest_down";
      case Type::kRequest:
        return "request";
      case Type::kReply:
        return "reply";
      case Type::kDirectOffer:
        return "direct_offer";
      case Type::kCm:
        return "cm";
      case Type::kPing:
        return "ping";
      case Type::kClose:
        return "close";
      case Type::kMax:
        break;
    }
    return "?";
  }
};

struct SslFree {
  void operator()(SSL* s) const { SSL_free(s); }
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};

/// One connection to a backend, plain or TLS, non-blocking.
class Channel {
 public:
  explicit Channel(UniqueFd fd) : fd_(std::move(fd)) {}

  /// TLS 1.3 as client with NODE's certificate of the cluster in DIR. Empty on success.
  std::string start_tls(const std::string& dir, const std::string& node, int timeout_ms) {
    ctx_.reset(SSL_CTX_new(TLS_client_method()));
    if (!ctx_) die("SSL_CTX_new: " + ssl_error());
    SSL_CTX_set_min_proto_version(ctx_.get(), TLS1_3_VERSION);
    const std::string cert = dir + "/" + node + ".pem", key = dir + "/" + node + ".key";
    if (SSL_CTX_use_certificate_chain_file(ctx_.get(), cert.c_str()) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx_.get(), key.c_str(), SSL_FILETYPE_PEM) != 1)
      die(cert + ": " + ssl_error());
    // The attacker does not care who answers: no verification of the backend.
    SSL_CTX_set_verify(ctx_.get(), SSL_VERIFY_NONE, nullptr);
    ssl_.reset(SSL_new(ctx_.get()));
    SSL_set_fd(ssl_.get(), fd_.get());
    SSL_set_mode(ssl_.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    const uint64_t until = now_ms() + timeout_ms;
    for (;;) {
      const int r = SSL_connect(ssl_.get());
      if (r == 1) break;
      const int e = SSL_get_error(ssl_.get(), r);
      if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE)
        return e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0 ? "connection closed" : ssl_error();
      const int left = static_cast<int>(until - std::min(until, now_ms()));
      if (left == 0) return "handshake timed out";
      pollfd p{fd_.get(), static_cast<short>(e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
      ::poll(&p, 1, left);
    }
    // A TLS 1.3 server may still refuse the client's certificate after the client's side of the
    // handshake finished: that shows up as an alert (a closed connection) on the first read.
    return "";
  }
  std::string cipher() const { return ssl_ ? SSL_get_cipher_name(ssl_.get()) : ""; }

  /// Bytes written (> 0), 0 for "not now", -1 when the connection failed.
  ssize_t write_some(const uint8_t* p, size_t n) {
    if (!ssl_) {
      const ssize_t r = ::send(fd_.get(), p, n, MSG_NOSIGNAL);
      return r >= 0 ? r : (errno == EAGAIN || errno == EINTR ? 0 : fail(std::strerror(errno)));
    }
    const int r = SSL_write(ssl_.get(), p, static_cast<int>(std::min<size_t>(n, 1 << 20)));
    return r > 0 ? r : tls_result(r);
  }
  /// Bytes read (> 0), 0 for "not now", -1 when the connection ended or failed.
  ssize_t read_some(uint8_t* p, size_t n) {
    if (!ssl_) {
      const ssize_t r = ::recv(fd_.get(), p, n, 0);
      if (r > 0) return r;
      if (r == 0) return fail("closed by the backend");
      return errno == EAGAIN || errno == EINTR ? 0 : fail(std::strerror(errno));
    }
    const int r = SSL_read(ssl_.get(), p, static_cast<int>(n));
    return r > 0 ? r : tls_result(r);
  }
  int fd() const { return fd_.get(); }
  const std::string& error() const { return error_; }

 private:
  ssize_t fail(const std::string& why) {
    if (error_.empty()) error_ = why;
    return -1;
  }
  ssize_t tls_result(int r) {
    const int e = SSL_get_error(ssl_.get(), r);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) return 0;
    if (e == SSL_ERROR_ZERO_RETURN) return fail("closed by the backend");
    if (e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)
      return fail(errno ? std::strerror(errno) : "closed by the backend");
    return fail(ssl_error());
  }

  UniqueFd fd_;
  std::unique_ptr<SSL_CTX, SslFree> ctx_;
  std::unique_ptr<SSL, SslFree> ssl_;
  std::string error_;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == sep) {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}

uint32_t number(const std::string& s, const char* what) {
  try {
    size_t end = 0;
    const unsigned long v = std::stoul(s, &end, 0);
    if (end == s.size() && v <= 0xffffffffu) return static_cast<uint32_t>(v);
  } catch (const std::exception&) {
  }
  die(std::string("bad ") + what + ": '" + s + "'");
}

/// NAME:LID:GIDHEX (the GID as 32 hex digits, colons allowed) as a GuestUp body.
GuestEntry guest_entry(const std::string& arg) {
  const auto f = split(arg, ':');
  if (f.size() < 3) die("--guest-up NAME:LID:GIDHEX, not '" + arg + "'");
  GuestEntry e{};
  if (!put_name(e.name, f[0])) die("bad guest name '" + f[0] + "'");
  e.lid = static_cast<uint16_t>(number(f[1], "LID"));
  std::string hex;
  for (size_t i = 2; i < f.size(); ++i) hex += f[i];
  if (hex.size() != 32) die("a GID is 32 hex digits, not '" + hex + "'");
  for (size_t i = 0; i < 16; ++i)
    e.gid[i] = static_cast<uint8_t>(number("0x" + hex.substr(2 * i, 2), "GID"));
  return e;
}

/// For every PSN of the window: a READ with a key nobody issued and a 64-byte SEND, both from
/// QP SQPN (LID SLID) to QP DQPN (LID DLID), as the QP's peer would send them.
void add_probes(const std::string& probe, const std::string& window, std::vector<uint8_t>& out,
                uint64_t& frames) {
  const auto p = split(probe, ':'), w = split(window, ':');
  if (p.size() != 4) die("--probe DLID:DQPN:SQPN:SLID, not '" + probe + "'");
  if (w.size() != 2) die("--window PSN0:COUNT, not '" + window + "'");
  Request r{};
  r.dlid = static_cast<uint16_t>(number(p[0], "DLID"));
  r.dst_qpn = number(p[1], "DQPN");
  r.src_qpn = number(p[2], "SQPN");
  r.slid = static_cast<uint16_t>(number(p[3], "SLID"));
  r.qp_type = IBV_QPT_RC;
  const uint32_t psn0 = number(w[0], "PSN0") & 0xffffff, count = number(w[1], "COUNT");
  static constexpr uint32_t kLen = 64;
  const std::vector<uint8_t> data(kLen, 0xa5);
  for (uint32_t k = 0; k < count; ++k) {
    r.psn = psn_add(psn0, k);
    r.opcode = IBV_WR_RDMA_READ;
    r.rkey = 0x0badc0de ^ k;
    r.remote_addr = 0x100000;
    r.length = kLen;
    encode(Type::kRequest, &r, 0, out);
    r.opcode = IBV_WR_SEND;
    r.rkey = 0;
    r.remote_addr = 0;
    encode(Type::kRequest, &r, kLen, out);
    out.insert(out.end(), data.begin(), data.end());
    frames += 2;
  }
}

void raise_nofile() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0) {
    r.rlim_cur = r.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &r);
  }
}

/// N connections that never send a byte, held SECONDS: how many got up, and how many the backend
/// closed (and when the first went).
nlohmann::json idle(const sockaddr_in& sa, int n, int hold_s) {
  raise_nofile();
  const uint64_t t0 = now_ms();
  std::vector<UniqueFd> fds;
  std::vector<pollfd> ps;
  int failed = 0;
  for (int i = 0; i < n; ++i) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) die(std::string("socket: ") + std::strerror(errno));
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0 &&
        errno != EINPROGRESS) {
      ++failed;
      continue;
    }
    ps.push_back({fd.get(), POLLOUT, 0});
    fds.push_back(std::move(fd));
  }
  // Connected (or failed) within 5 s: the kernel completes them whether or not the backend
  // accepts, up to its listen backlog.
  std::vector<bool> up(ps.size(), false), done(ps.size(), false);
  size_t pending = ps.size();
  for (const uint64_t until = now_ms() + 5000; pending && now_ms() < until;) {
    if (::poll(ps.data(), ps.size(), 100) <= 0) continue;
    for (size_t i = 0; i < ps.size(); ++i) {
      if (done[i] || !ps[i].revents) continue;
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(ps[i].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      up[i] = err == 0;
      done[i] = true;
      ps[i].events = 0;
      --pending;
    }
  }
  int opened = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i].events = up[i] ? POLLIN | POLLRDHUP : 0;
    opened += up[i];
  }
  failed += static_cast<int>(ps.size()) - opened;
  std::fprintf(stderr, "idle: %d connected, %d failed\n", opened, failed);
  std::fflush(stderr);
  int closed = 0;
  int64_t first_close_ms = -1;
  uint64_t bytes = 0;
  for (const uint64_t until = now_ms() + uint64_t(hold_s) * 1000; now_ms() < until;) {
    if (::poll(ps.data(), ps.size(), 100) <= 0) continue;
    for (pollfd& p : ps) {
      if (!p.revents) continue;
      uint8_t buf[4096];
      const ssize_t r = ::recv(p.fd, buf, sizeof(buf), 0);
      if (r > 0) {
        bytes += static_cast<uint64_t>(r);
        continue;
      }
      if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      p.events = 0;
      p.fd = -p.fd - 1;  // poll ignores negative descriptors
      ++closed;
      if (first_close_ms < 0) first_close_ms = static_cast<int64_t>(now_ms() - t0);
    }
  }
  return {{"mode", "idle"},         {"target", addr_text(sa)},  {"opened", opened},
          {"failed", failed},       {"closed_by_peer", closed}, {"first_close_ms", first_close_ms},
          {"received_bytes", bytes}};
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"An attacker on the backends' network (tests/hosts/trust_*.sh)"};
  std::string mode, target, dir, cert, as, probe, window;
  std::vector<std::string> guest_ups;
  int idle_n = 0, hold_s = 10, linger_ms = 1500;
  app.add_option("mode", mode, "plain or tls")->required()->check(CLI::IsMember({"plain", "tls"}));
  app.add_option("target", target, "ADDR:PORT of a backend")->required();
  app.add_option("--dir", dir, "cluster directory (tls)");
  app.add_option("--cert", cert, "the node whose certificate and key to present (tls)");
  app.add_option("--as", as, "the node name to claim in the Hello");
  app.add_option("--guest-up", guest_ups, "NAME:LID:GIDHEX, a directory entry to announce");
  app.add_option("--probe", probe, "DLID:DQPN:SQPN:SLID of the requests to inject");
  app.add_option("--window", window, "PSN0:COUNT, the PSNs to try");
  app.add_option("--idle", idle_n, "open this many idle TCP connections instead");
  app.add_option("--hold", hold_s, "seconds to hold the idle connections");
  app.add_option("--linger", linger_ms, "ms to listen after the last frame");
  CLI11_PARSE(app, argc, argv);

  auto ep = transport::tcp::parse_endpoint(target);
  if (!ep.is_ok()) die(target + ": " + ep.status().message());
  if (ep.value().family() != AF_INET) die(target + ": IPv4 only");
  sockaddr_in sa{};
  std::memcpy(&sa, ep.value().sa(), sizeof(sa));
  if (idle_n > 0) {
    std::printf("%s\n", idle(sa, idle_n, hold_s).dump().c_str());
    return 0;
  }
  if (as.empty()) die("--as NODE: the name to claim");
  if (mode == "tls" && (dir.empty() || cert.empty())) die("tls needs --dir and --cert");
  if (probe.empty() != window.empty()) die("--probe and --window go together");

  // Everything to send, built first: the Hello, the directory entries, the probes.
  std::vector<uint8_t> out;
  uint64_t frames_out = 1;
  Hello h{};
  if (!put_name(h.node, as)) die("bad node name '" + as + "'");
  h.wire_version = kWireVersion;
  encode(Type::kHello, &h, 0, out);
  for (const std::string& g : guest_ups) {
    const GuestEntry e = guest_entry(g);
    encode(Type::kGuestUp, &e, 0, out);
    ++frames_out;
  }
  if (!probe.empty()) add_probes(probe, window, out, frames_out);

  nlohmann::json res = {{"mode", mode}, {"target", target}, {"as", as}};
  if (mode == "tls") res["cert"] = cert;
  UniqueFd fd;
  const uint64_t t0 = now_ms();
  if (std::string why = connect_to(fd, sa, 3000); !why.empty()) {
    res["connected"] = false;
    res["error"] = why;
    std::printf("%s\n", res.dump().c_str());
    return 0;
  }
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len);
  res["connected"] = true;
  res["local"] = addr_text(local);
  Channel ch(std::move(fd));
  Tally got;
  bool closed = false;
  std::string close_reason;
  if (mode == "tls") {
    close_reason = ch.start_tls(dir, cert, 5000);
    res["handshake"] = close_reason.empty() ? "ok" : "failed";
    if (close_reason.empty()) res["cipher"] = ch.cipher();
    closed = !close_reason.empty();
  }
  // Write what is queued while reading whatever comes back (a backend that answers a flood of
  // probes must not stall it), then listen `linger_ms` more.
  size_t sent = 0;
  uint64_t last_write = now_ms();
  std::vector<uint8_t> buf(1 << 16);
  while (!closed) {
    const bool more = sent < out.size();
    if (!more && now_ms() - last_write >= static_cast<uint64_t>(linger_ms)) break;
    pollfd p{ch.fd(), static_cast<short>(POLLIN | (more ? POLLOUT : 0)), 0};
    ::poll(&p, 1, 20);
    if (more) {
      const ssize_t w = ch.write_some(out.data() + sent, out.size() - sent);
      if (w < 0) {
        closed = true;
        break;
      }
      sent += static_cast<size_t>(w);
      if (w > 0) last_write = now_ms();
    }
    for (;;) {
      const ssize_t r = ch.read_some(buf.data(), buf.size());
      if (r < 0) closed = true;
      if (r <= 0) break;
      got.feed(buf.data(), static_cast<size_t>(r));
    }
  }
  res["sent_bytes"] = sent;
  res["sent_all"] = sent == out.size();
  res["frames_to_send"] = frames_out;
  res["received_bytes"] = got.bytes;
  res["frames"] = got.frames;
  if (!got.peer_hello.empty()) res["peer_hello"] = got.peer_hello;
  if (!got.undecodable.empty()) res["undecodable"] = got.undecodable;
  res["closed"] = closed;
  if (closed) {
    res["closed_after_ms"] = now_ms() - t0;
    res["close_reason"] = close_reason.empty() ? ch.error() : close_reason;
  }
  std::printf("%s\n", res.dump().c_str());
  return 0;
}
