// The peer for bench/pingpong.sh: the same ping-pong as ibv_rc_pingpong (N round trips of an
// S-byte message between two processes on this host), over a loopback TCP connection with
// TCP_NODELAY and blocking reads, as a socket program would do it. Prints "N iters in T seconds
// = U usec/iter", the format of ibv_rc_pingpong's result line.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

bool xfer(int fd, char* buf, size_t n, bool send) {
  for (size_t done = 0; done < n;) {
    ssize_t r = send ? ::send(fd, buf + done, n - done, MSG_NOSIGNAL) : ::recv(fd, buf + done, n - done, 0);
    if (r <= 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  size_t size = 4096;
  long iters = 1000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (argv[i][1] == 's') size = std::strtoul(argv[i + 1], nullptr, 10);
    if (argv[i][1] == 'n') iters = std::strtol(argv[i + 1], nullptr, 10);
  }
  int ls = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t al = sizeof(a);
  if (ls < 0 || ::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0 || ::listen(ls, 1) < 0 ||
      ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &al) < 0) {
    std::perror("listen");
    return 1;
  }
  const int one = 1;
  std::vector<char> buf(size, 'x');
  pid_t pid = ::fork();
  if (pid == 0) {  // the "server": echo every message back
    int fd = ::accept(ls, nullptr, nullptr);
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    for (long i = 0; i < iters; ++i)
      if (!xfer(fd, buf.data(), size, false) || !xfer(fd, buf.data(), size, true)) _exit(1);
    _exit(0);
  }
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0) {
    std::perror("connect");
    return 1;
  }
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
    if (!xfer(fd, buf.data(), size, true) || !xfer(fd, buf.data(), size, false)) {
      std::fprintf(stderr, "connection lost\n");
      return 1;
    }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int st = 0;
  ::waitpid(pid, &st, 0);
  std::printf("%ld iters in %.2f seconds = %.2f usec/iter\n", iters, s, s * 1e6 / double(iters));
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}
