#include "backend/metrics_http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "common/log.h"
#include "common/paths.h"
#include "common/socket.h"

namespace vrdma::backend {

MetricsHttp::MetricsHttp(int epoll, uint64_t tag, Render render)
    : epoll_(epoll), tag_(tag), render_(std::move(render)) {}

MetricsHttp::~MetricsHttp() {
  if (unix_path_.empty()) return;
  // Only the file we bound: never one that replaced it.
  struct stat st {};
  const std::string base = unix_path_.substr(unix_path_.rfind('/') + 1);
  if (::fstatat(dir_.get(), base.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      st.st_dev == unix_dev_ && st.st_ino == unix_ino_)
    unlink_beside(dir_, unix_path_);
}

Status MetricsHttp::listen(const std::string& addr_port, mode_t socket_mode) {
  if (addr_port.starts_with("unix:")) return listen_unix(addr_port.substr(5), socket_mode);
  auto colon = addr_port.rfind(':');
  if (colon == std::string::npos)
    return error(EINVAL, "metrics listen \"" + addr_port + "\" is not ADDR:PORT or unix:PATH");
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
  where_ = fmt::format("http://{}/metrics", addr_port);
  return watch(std::move(fd));
}

Status MetricsHttp::listen_unix(const std::string& path, mode_t mode) {
  const std::string what = "metrics listen unix:" + path;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.empty() || path.front() != '/' || path.back() == '/')
    return error(EINVAL, what + ": expected an absolute path to a socket file");
  if (path.size() >= sizeof(a.sun_path))
    return error(ENAMETOOLONG, fmt::format("{}: longer than a unix socket path may be ({} bytes)",
                                           what, sizeof(a.sun_path) - 1));
  if ((mode & ~mode_t{0666}) != 0 || (mode & 0600) != 0600)
    return error(EINVAL, fmt::format("{}: socket mode {:04o}: the owner must read and write it, "
                                     "and no execute or special bits",
                                     what, mode));
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  // The directory is checked as the backend's own: another user who could write it could
  // replace the socket with theirs, or plant a symlink for our chmod and unlink to follow.
  auto dir = open_socket_dir(path, false);
  if (!dir.is_ok()) return error(dir.err(), what + ": " + dir.status().message());
  const std::string base = path.substr(path.rfind('/') + 1);
  struct stat st {};
  if (::fstatat(dir->get(), base.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (!S_ISSOCK(st.st_mode))
      return error(EEXIST, fmt::format("{}: {} exists and is not a socket{}; remove it or choose "
                                       "another path",
                                       what, path, S_ISLNK(st.st_mode) ? " but a symlink" : ""));
    // A socket file left by a backend that died (the caller holds the backend's lock), unless
    // something else listens on it: then the path is another program's.
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!probe.valid()) return error(errno, what + ": socket: " + std::strerror(errno));
    if (::connect(probe.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 ||
        errno == EAGAIN || errno == EPROTOTYPE)
      return error(EADDRINUSE, fmt::format("{}: something listens on {} already", what, path));
    if (errno != ECONNREFUSED)
      return error(errno, fmt::format("{}: {} exists and connecting to it to see whether it is "
                                      "stale failed: {}",
                                      what, path, std::strerror(errno)));
    unlink_beside(dir.value(), path);
  }
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return error(errno, what + ": socket: " + std::strerror(errno));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0)
    return error(errno, fmt::format("{}: bind: {}", what, std::strerror(errno)));
  // Bound but not listening yet: no one can connect before the mode is what was asked.
  int err = 0;
  if (::fchmodat(dir->get(), base.c_str(), mode, 0) < 0 ||
      ::fstatat(dir->get(), base.c_str(), &st, AT_SYMLINK_NOFOLLOW) < 0 ||
      ::listen(fd.get(), 16) < 0)
    err = errno;
  if (err) {
    unlink_beside(dir.value(), path);
    return error(err, fmt::format("{}: {}", what, std::strerror(err)));
  }
  dir_ = std::move(dir.value());
  unix_path_ = path;
  unix_dev_ = st.st_dev;
  unix_ino_ = st.st_ino;
  where_ = "unix:" + path;
  return watch(std::move(fd));
}

Status MetricsHttp::watch(UniqueFd fd) {
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
    UniqueFd sock(fd);
    std::optional<uint32_t> uid;
    if (!unix_path_.empty()) {
      // Over the unix socket the kernel says who scrapes; without it, no answer.
      auto cred = peer_cred(fd);
      if (!cred.is_ok()) continue;
      uid = cred->uid;
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
    c.sock = std::move(sock);
    c.since_ns = now_ns;
    c.uid = uid;
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
    respond(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", render_(c.uid));
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
