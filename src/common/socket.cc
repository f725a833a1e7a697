#include "common/socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace vrdma {

Status send_msg(int sock, std::span<const uint8_t> bytes, std::span<const int> fds) {
  if (fds.size() > kMaxFdsPerMessage) return error(EINVAL, "too many fds in one message");
  iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)] = {};
  if (!fds.empty()) {
    msg.msg_control = ctl;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) return Status::ok();
    if (errno == EINTR) continue;
    return error(errno, std::string("sendmsg: ") + std::strerror(errno));
  }
}

Status recv_msg(int sock, std::vector<uint8_t>& buf, size_t cap, std::vector<UniqueFd>& fds,
                int flags) {
  buf.resize(cap);
  iovec iov{buf.data(), cap};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)] = {};
  msg.msg_control = ctl;
  msg.msg_controllen = sizeof(ctl);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags);
  } while (n < 0 && errno == EINTR);
  fds.clear();
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < nfd; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.emplace_back(fd);
    }
  }
  if (n < 0) return error(errno, std::string("recvmsg: ") + std::strerror(errno));
  if (n == 0) return error(ECONNRESET, "peer closed the connection");
  if (msg.msg_flags & MSG_TRUNC) return error(EMSGSIZE, "message truncated");
  buf.resize(static_cast<size_t>(n));
  if (msg.msg_flags & MSG_CTRUNC)
    return error(EMFILE,
                 "descriptors attached to the message were dropped (no room in the "
                 "descriptor table, or more than the receiver takes)");
  return Status::ok();
}

Status call_msg(int sock, std::span<const uint8_t> request, std::span<const int> fds,
                std::vector<uint8_t>& buf, size_t cap, std::vector<UniqueFd>& got, int timeout_ms) {
  if (timeout_ms > 0) {
    // The send waits on SO_SNDTIMEO: a peer that does not read fills the buffer.
    timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    (void)::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }
  Status st = send_msg(sock, request, fds);
  if (st.err() == EAGAIN) return error(ETIMEDOUT, "the request was not taken");
  RETURN_IF_ERROR(st);
  if (timeout_ms > 0) {
    pollfd p{sock, POLLIN, 0};
    int n;
    do {
      n = ::poll(&p, 1, timeout_ms);  // a signal restarts the wait: the CLI has none
    } while (n < 0 && errno == EINTR);
    if (n < 0) return error(errno, std::string("poll: ") + std::strerror(errno));
    if (n == 0) return error(ETIMEDOUT, "no answer");
  }
  return recv_msg(sock, buf, cap, got);
}

namespace {
Result<sockaddr_un> unix_addr(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.size() >= sizeof(a.sun_path)) return error(ENAMETOOLONG, "socket path too long: " + path);
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  return a;
}
}  // namespace

Result<UniqueFd> connect_unix(const std::string& path, int send_timeout_ms) {
  ASSIGN_OR_RETURN(sockaddr_un a, unix_addr(path));
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return error(errno, "socket");
  if (send_timeout_ms > 0) {
    // A unix connect waits on the send timeout too (a full backlog).
    timeval tv{send_timeout_ms / 1000, (send_timeout_ms % 1000) * 1000};
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0)
    return error(errno, "connect " + path + ": " + std::strerror(errno));
  return fd;
}

Result<UniqueFd> listen_unix(const std::string& path) {
  ASSIGN_OR_RETURN(sockaddr_un a, unix_addr(path));
  // The socket appears at `path` only once it listens: it is bound under a temporary name beside
  // it and renamed into place, so whoever waits for the file (an auto-starting library, a test,
  // a supervisor) never connects between bind and listen and gets ECONNREFUSED. A path too long
  // for the temporary name is bound in place.
  const std::string tmp = path + ".new" + std::to_string(::getpid());
  auto ta = unix_addr(tmp);
  const bool staged = ta.is_ok();
  if (staged) a = ta.value();
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return error(errno, "socket");
  if (staged) (void)::unlink(tmp.c_str());  // one left by a process of our pid that died
  const std::string& bound = staged ? tmp : path;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0)
    return error(errno, "bind " + bound + ": " + std::strerror(errno));
  if (::listen(fd.get(), 128) < 0) {
    const int e = errno;
    (void)::unlink(bound.c_str());
    return error(e, "listen");
  }
  if (staged && ::rename(tmp.c_str(), path.c_str()) < 0) {
    const int e = errno;
    (void)::unlink(tmp.c_str());
    return error(e, "rename " + tmp + " to " + path + ": " + std::strerror(e));
  }
  return fd;
}

void fit_send_buffer(int sock, size_t bytes) {
  int have = 0;
  socklen_t len = sizeof(have);
  if (::getsockopt(sock, SOL_SOCKET, SO_SNDBUF, &have, &len) == 0 &&
      static_cast<size_t>(have) >= bytes * 2)
    return;
  // The kernel doubles what it is given and counts its own overhead in it.
  const int want = static_cast<int>(bytes + 64 * 1024);
  (void)::setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &want, sizeof(want));
}

Result<PeerCred> peer_cred(int sock) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
    return error(errno, std::string("SO_PEERCRED: ") + std::strerror(errno));
  return PeerCred{static_cast<uint32_t>(cred.pid), static_cast<uint32_t>(cred.uid),
                  static_cast<uint32_t>(cred.gid)};
}

Result<uint32_t> peer_uid(int sock) {
  ASSIGN_OR_RETURN(PeerCred c, peer_cred(sock));
  return c.uid;
}

}  // namespace vrdma
