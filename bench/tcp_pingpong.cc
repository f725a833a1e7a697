// The peer for bench/pingpong.sh and bench/crosshost.sh: the same ping-pong as ibv_rc_pingpong
// (N round trips of an S-byte message between two processes), over TCP with TCP_NODELAY and
// blocking reads, as a socket program would do it; with --busy, both ends spin on non-blocking
// reads and writes instead of sleeping (as a busy-polling RDMA program does). Prints "N iters in
// T seconds = U usec/iter", the format of ibv_rc_pingpong's result line.
// Usage: tcp_pingpong [-s S] [-n N] [--busy]                  (both ends on loopback, forked)
//        tcp_pingpong [-s S] [-n N] [--busy] --server PORT    (echo side, one client)
//        tcp_pingpong [-s S] [-n N] [--busy] --client HOST PORT
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

bool g_busy = false;  ///< --busy: the socket is non-blocking and xfer spins on EAGAIN

bool xfer(int fd, char* buf, size_t n, bool send) {
  for (size_t done = 0; done < n;) {
    ssize_t r = send ? ::send(fd, buf + done, n - done, MSG_NOSIGNAL) : ::recv(fd, buf + done, n - done, 0);
    if (r < 0 && g_busy && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r <= 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

/// TCP_NODELAY, and with --busy non-blocking; returns fd.
int tune(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (g_busy) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

/// The echo side: N times, receive S bytes and send them back.
int serve(int fd, std::vector<char>& buf, long iters) {
  for (long i = 0; i < iters; ++i)
    if (!xfer(fd, buf.data(), buf.size(), false) || !xfer(fd, buf.data(), buf.size(), true))
      return 1;
  return 0;
}

/// The timed side: N round trips; prints the result line.
int ping(int fd, std::vector<char>& buf, long iters) {
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
    if (!xfer(fd, buf.data(), buf.size(), true) || !xfer(fd, buf.data(), buf.size(), false)) {
      std::fprintf(stderr, "connection lost\n");
      return 1;
    }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%ld iters in %.2f seconds = %.2f usec/iter\n", iters, s, s * 1e6 / double(iters));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  size_t size = 4096;
  long iters = 1000;
  int port = 0;
  const char* host = nullptr;
  bool server = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-s" && i + 1 < argc) size = std::strtoul(argv[++i], nullptr, 10);
    else if (a == "-n" && i + 1 < argc) iters = std::strtol(argv[++i], nullptr, 10);
    else if (a == "--server" && i + 1 < argc) server = true, port = std::atoi(argv[++i]);
    else if (a == "--client" && i + 2 < argc) host = argv[++i], port = std::atoi(argv[++i]);
    else if (a == "--busy") g_busy = true;
  }
  const int one = 1;
  std::vector<char> buf(size, 'x');
  if (host) {  // remote client
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET, host, &a.sin_addr) != 1 ||
        ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0) {
      std::perror("connect");
      return 1;
    }
    return ping(tune(fd), buf, iters);
  }
  int ls = ::socket(AF_INET, SOCK_STREAM, 0);
  ::setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(server ? INADDR_ANY : INADDR_LOOPBACK);
  socklen_t al = sizeof(a);
  if (ls < 0 || ::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0 || ::listen(ls, 1) < 0 ||
      ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &al) < 0) {
    std::perror("listen");
    return 1;
  }
  if (server) {
    return serve(tune(::accept(ls, nullptr, nullptr)), buf, iters);
  }
  pid_t pid = ::fork();
  if (pid == 0) {  // the "server": echo every message back
    _exit(serve(tune(::accept(ls, nullptr, nullptr)), buf, iters));
  }
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0) {
    std::perror("connect");
    return 1;
  }
  const int rc = ping(tune(fd), buf, iters);
  int st = 0;
  ::waitpid(pid, &st, 0);
  return rc == 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}
