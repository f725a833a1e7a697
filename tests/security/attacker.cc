// A hostile local user's program for the security tests (tests/security/*.sh): it speaks the
// backend's control protocol itself, as a modified library could, and uses what the backend
// gives every guest to exhaust what it shares with the others. It asserts nothing: it prints
// what happened, one `key value...` line at a time, and the scripts judge.
//
//   attacker idle SOCKET N          N connections that never say Hello
//   attacker segments SOCKET N      one session registering a sealed sparse 1 TiB memfd, then
//                                   up to N one-page segments
//   attacker hugetlb SOCKET         a sealed MFD_HUGETLB memfd with its huge page touched
//
// `idle` and `segments` print `ready ...`, then hold what they made until a line (or EOF)
// arrives on stdin; `idle` then prints how many of its connections the backend has closed.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/memfd.h"
#include "common/socket.h"
#include "common/unique_fd.h"
#include "proto/command.h"

using namespace vrdma;
using namespace vrdma::proto;

namespace {

void nap_ms(int ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1000000L};
  ::nanosleep(&ts, nullptr);
}

void raise_nofile() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0) {
    r.rlim_cur = r.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &r);
  }
}

void wait_for_stdin() {
  char line[64];
  (void)!std::fgets(line, sizeof(line), stdin);
}

/// One command and its answer: 0 or the backend's errno (negative: the connection failed).
template <typename Req, typename Resp>
int call(int sock, Op op, const Req& req, Resp* resp, int fd = -1) {
  static uint32_t seq = 0;
  std::vector<uint8_t> msg = encode(op, ++seq, 0, req);
  std::vector<int> fds;
  if (fd >= 0) fds.push_back(fd);
  if (!send_msg(sock, msg, fds).is_ok()) return -1;
  std::vector<UniqueFd> got;
  if (!recv_msg(sock, msg, kMaxResponse, got).is_ok()) return -1;
  auto h = decode_header(msg);
  if (!h.is_ok()) return -1;
  if (h->status != 0) return -h->status;
  if (resp && msg.size() == sizeof(MsgHeader) + sizeof(Resp))
    std::memcpy(resp, msg.data() + sizeof(MsgHeader), sizeof(Resp));
  return 0;
}

Result<UniqueFd> session(const std::string& socket, const std::string& guest) {
  ASSIGN_OR_RETURN(UniqueFd s, connect_unix(socket, 5000));
  HelloReq req{};
  std::snprintf(req.guest, sizeof(req.guest), "%s", guest.c_str());
  req.pid = static_cast<uint32_t>(::getpid());
  HelloResp resp{};
  if (int rc = call(s.get(), Op::kHello, req, &resp); rc != 0)
    return error(rc < 0 ? EIO : rc, "hello refused");
  return s;
}

/// A non-blocking connect that never says anything; invalid when the backend's queue of new
/// connections stayed full.
UniqueFd idle_connection(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
  for (int tries = 0; tries < 200; ++tries) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) return {};
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return fd;
    if (errno != EAGAIN) return {};
    nap_ms(10);  // the backlog is full: the backend is accepting (and closing) them
  }
  return {};
}

int idle(const std::string& socket, int n) {
  std::vector<UniqueFd> conns;
  for (int i = 0; i < n; ++i) {
    UniqueFd fd = idle_connection(socket);
    if (!fd.valid()) break;
    conns.push_back(std::move(fd));
  }
  std::printf("ready %zu\n", conns.size());
  std::fflush(stdout);
  wait_for_stdin();
  size_t closed = 0;
  for (const UniqueFd& c : conns) {
    pollfd p{c.get(), POLLRDHUP, 0};
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) ++closed;
  }
  std::printf("closed %zu of %zu\n", closed, conns.size());
  return 0;
}

int segments(const std::string& socket, int n) {
  auto s = session(socket, "attacker-seg");
  if (!s.is_ok()) {
    std::printf("hello failed %s\n", std::strerror(s.err()));
    return 1;
  }
  // A sealed sparse memfd of 1 TiB costs us nothing; mapped by the backend, 1 TiB of its
  // address space.
  auto big = make_sealed_memfd("sparse", 1ull << 40);
  if (big.is_ok()) {
    HandleResp resp{};
    const int rc = call(s->get(), Op::kRegSegment, RegSegmentReq{1ull << 40}, &resp, big->get());
    std::printf("sparse %s\n", rc == 0 ? "accepted" : rc > 0 ? std::strerror(rc) : "lost");
  } else {
    std::printf("sparse cannot make it: %s\n", big.status().message().c_str());
  }
  int made = 0, rc = 0;
  for (; made < n; ++made) {
    auto fd = make_sealed_memfd("seg", 4096);
    if (!fd.is_ok()) {
      rc = fd.err();
      break;
    }
    HandleResp resp{};
    rc = call(s->get(), Op::kRegSegment, RegSegmentReq{4096}, &resp, fd->get());
    if (rc != 0) break;  // our copy closes here; the backend holds its own
  }
  std::printf("segments %d stopped %s\n", made,
              rc > 0   ? std::strerror(rc)
              : rc < 0 ? "connection lost"
                       : "at N");
  std::printf("ready\n");
  std::fflush(stdout);
  wait_for_stdin();
  return 0;
}

int hugetlb(const std::string& socket) {
  constexpr size_t kHuge = 2u << 20;
  UniqueFd fd(::memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB));
  if (!fd.valid()) {
    std::printf("no-hugetlb %s\n", std::strerror(errno));
    return 77;
  }
  if (::ftruncate(fd.get(), kHuge) != 0) {
    std::printf("no-hugetlb ftruncate %s\n", std::strerror(errno));
    return 77;
  }
  void* p = ::mmap(nullptr, kHuge, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) {
    std::printf("no-hugetlb mmap %s\n", std::strerror(errno));
    return 77;
  }
  std::memset(p, 0x5a, 4096);  // takes a huge page (SIGBUS here when none is free)
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    std::printf("seal-failed %s\n", std::strerror(errno));
    return 1;
  }
  auto s = session(socket, "attacker-huge");
  if (!s.is_ok()) {
    std::printf("hello failed %s\n", std::strerror(s.err()));
    return 1;
  }
  HandleResp resp{};
  const int rc = call(s->get(), Op::kRegSegment, RegSegmentReq{kHuge}, &resp, fd.get());
  std::printf("hugetlb %s\n", rc == 0 ? "accepted" : rc > 0 ? std::strerror(rc) : "lost");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s idle|segments|hugetlb SOCKET [N]\n", argv[0]);
    return 2;
  }
  raise_nofile();
  const std::string mode = argv[1], socket = argv[2];
  const int n = argc > 3 ? std::atoi(argv[3]) : 0;
  if (mode == "idle") return idle(socket, n);
  if (mode == "segments") return segments(socket, n);
  if (mode == "hugetlb") return hugetlb(socket);
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
