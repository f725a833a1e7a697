#include "backend/activation.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace vrdma::backend {

namespace {
constexpr int kListenFdsStart = 3;  ///< SD_LISTEN_FDS_START
}

Result<UniqueFd> inherited_listener(std::string& path) {
  const char* pid = std::getenv("LISTEN_PID");
  const char* n = std::getenv("LISTEN_FDS");
  if (!pid || !n || std::strtol(pid, nullptr, 10) != ::getpid() || std::strtol(n, nullptr, 10) < 1)
    return UniqueFd();
  ::unsetenv("LISTEN_PID");
  ::unsetenv("LISTEN_FDS");
  ::unsetenv("LISTEN_FDNAMES");
  const int fd = kListenFdsStart;
  int type = 0, listening = 0;
  socklen_t len = sizeof(type);
  sockaddr_un a{};
  socklen_t alen = sizeof(a);
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) < 0 ||
      ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &(len = sizeof(listening))) < 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &alen) < 0 || a.sun_family != AF_UNIX ||
      type != SOCK_SEQPACKET || !listening) {
    return error(EINVAL,
                 "socket activation: fd 3 is not a listening SOCK_SEQPACKET unix socket "
                 "(the .socket unit needs ListenSequentialPacket=)");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  path.assign(a.sun_path, strnlen(a.sun_path, sizeof(a.sun_path)));
  return UniqueFd(fd);
}

}  // namespace vrdma::backend
