#include "backend/metrics_http.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "common/log.h"

namespace vrdma::backend {

MetricsHttp::MetricsHttp(int epoll, uint64_t tag, Render render)
    : epoll_(epoll), tag_(tag), render_(std::move(render)) {}

Status MetricsHttp::listen(const std::string& addr_port) {
  auto colon = addr_port.rfind(':');
  if (colon == std::string::npos)
    return error(EINVAL, "metrics listen \"" + addr_port + "\" is not ADDR:PORT");
  std::string host = addr_port.substr(0, colon);
  const std::string port = addr_port.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
      rc != 0)
    return error(EINVAL, fmt::format("metrics listen {}: {}", addr_port, ::gai_strerror(rc)));
  UniqueFd fd(::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  int err = errno;
  if (fd.valid()) {
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), res->ai_addr, res->ai_addrlen) < 0 || ::listen(fd.get(), 16) < 0) {
      err = errno;
      fd.reset();
    }
  }
  ::freeaddrinfo(res);
  if (!fd.valid())
    return error(err, fmt::format("metrics listen {}: {}", addr_port, std::strerror(err)));
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  listen_ = std::move(fd);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = tag_ | static_cast<uint32_t>(listen_.get());
  if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, listen_.get(), &ev) < 0)
    return error(errno, std::string("metrics: epoll_ctl: ") + std::strerror(errno));
  rest_.bind(epoll_, listen_.get(), ev.data.u64);
  return Status::ok();
}

void MetricsHttp::on_event(int fd, uint32_t events, uint64_t now_ns) {
  if (fd == listen_.get()) {
    accept_all(now_ns);
    return;
  }
  auto it = clients_.find(fd);
  if (it == clients_.end()) return;
  if (events & (EPOLLERR | EPOLLHUP)) {
    close_client(fd);
  } else if (!it->second.out.empty()) {
    flush(fd);
  } else {
    on_readable(it->second);
  }
}

void MetricsHttp::expire(uint64_t now_ns) {
  for (auto it = clients_.begin(); it != clients_.end();) {
    int fd = it->first;
    ++it;
    if (now_ns - clients_[fd].since_ns > kClientTimeoutNs) close_client(fd);
  }
}

void MetricsHttp::accept_all(uint64_t now_ns) {
  for (;;) {
    ++accepts_;
    int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      // The scrape stays queued and the listener readable: rest it, or the loop would spin.
      if (const int err = errno; ListenerRest::out_of_descriptors(err)) {
        uint64_t held = 0;
        if (rest_.start(now_ns, held))
          VLOG_WARN("metrics: accept: {}; not accepting for {} ms or until a client closes{}",
                    std::strerror(err), ListenerRest::kRestNs / 1000000, log::held_note(held));
      }
      return;
    }
    if (clients_.size() >= kMaxClients) {
      // Full: the client that has waited longest is the likeliest to be stuck.
      auto oldest = clients_.begin();
      for (auto it = clients_.begin(); it != clients_.end(); ++it)
        if (it->second.since_ns < oldest->second.since_ns) oldest = it;
      VLOG_WARN("metrics: {} clients open; dropping the oldest", clients_.size());
      close_client(oldest->first);
    }
    Client& c = clients_[fd];
    c.sock = UniqueFd(fd);
    c.since_ns = now_ns;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = tag_ | static_cast<uint32_t>(fd);
    ::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
  }
}

void MetricsHttp::on_readable(Client& c) {
  const int fd = c.sock.get();
  char buf[2048];
  bool eof = false;  ///< a client may half-close after its request: still answer it
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n == 0) {
      eof = true;
      break;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) break;
      close_client(fd);
      return;
    }
    c.in.append(buf, static_cast<size_t>(n));
    if (c.in.size() > kMaxRequest) {
      respond(c, 431, "Request Header Fields Too Large", "text/plain", "request too large\n");
      return;
    }
  }
  const auto end = c.in.find("\r\n\r\n");
  if (end == std::string::npos) {  // headers not complete yet
    if (eof) close_client(fd);
    return;
  }
  const std::string line = c.in.substr(0, c.in.find("\r\n"));
  const auto sp1 = line.find(' ');
  const auto sp2 = sp1 == std::string::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos || line.compare(sp2 + 1, 5, "HTTP/") != 0) {
    respond(c, 400, "Bad Request", "text/plain", "malformed request line\n");
    return;
  }
  const std::string method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (method != "GET") {
    respond(c, 405, "Method Not Allowed", "text/plain", "only GET\n");
  } else if (target == "/metrics" || target.starts_with("/metrics?")) {
    respond(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", render_());
  } else {
    respond(c, 404, "Not Found", "text/plain", "vrdmad serves /metrics only\n");
  }
}

void MetricsHttp::respond(Client& c, int code, const char* reason, const char* type,
                          const std::string& body) {
  c.out = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n"
      "Connection: close\r\n\r\n",
      code, reason, type, body.size());
  c.out += body;
  c.sent = 0;
  epoll_event ev{};
  ev.events = EPOLLOUT;
  ev.data.u64 = tag_ | static_cast<uint32_t>(c.sock.get());
  ::epoll_ctl(epoll_, EPOLL_CTL_MOD, c.sock.get(), &ev);
  flush(c.sock.get());
}

void MetricsHttp::flush(int fd) {
  Client& c = clients_[fd];
  while (c.sent < c.out.size()) {
    ssize_t n = ::send(fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return;  // EPOLLOUT brings us back
      break;
    }
    c.sent += static_cast<size_t>(n);
  }
  // Done (or the client went away): half-close so the client sees the end of the body.
  ::shutdown(fd, SHUT_WR);
  close_client(fd);
}

void MetricsHttp::close_client(int fd) {
  ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
  if (clients_.erase(fd)) rest_.end();  // a descriptor is free again
}

}  // namespace vrdma::backend
