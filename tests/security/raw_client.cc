// An attacker's own client for the security tests: speaks the control protocol to a backend
// without the library (so no check of the library's stands between it and the backend).
//   raw_client SOCKET status                    the Status command before any hello: prints the
//                                               JSON the backend gave this uid
//   raw_client SOCKET hello GUEST PID [status]  a hello into GUEST claiming to be process PID,
//                                               then (with `status`) the Status command on that
//                                               session; prints the JSON
// Exit status: 0 done; 3 the backend refused (its errno on stderr, e.g. "hello: EPERM"); 1 any
// other failure. The descriptors a hello hands over are closed at exit.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/socket.h"
#include "proto/command.h"

namespace {

using namespace vrdma;
using namespace vrdma::proto;

int usage() {
  std::fprintf(stderr,
               "usage: raw_client SOCKET status | raw_client SOCKET hello GUEST PID [status]\n");
  return 1;
}

/// "EPERM (Operation not permitted)" for a response's -errno.
std::string errno_text(int status) {
  const char* name = strerrorname_np(-status);
  return std::string(name ? name : "E?") + " (" + std::strerror(-status) + ")";
}

/// Sends one request and returns the response's status (0 or -errno); `buf` holds the response.
int call(int sock, const std::vector<uint8_t>& req, std::vector<uint8_t>& buf, const char* what) {
  std::vector<UniqueFd> fds;
  if (Status st = send_msg(sock, req); !st.is_ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.message().c_str());
    std::exit(1);
  }
  if (Status st = recv_msg(sock, buf, kMaxResponse, fds); !st.is_ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.message().c_str());
    std::exit(1);
  }
  auto h = decode_header(buf);
  if (!h.is_ok()) {
    std::fprintf(stderr, "%s: bad response: %s\n", what, h.status().message().c_str());
    std::exit(1);
  }
  return h.value().status;
}

int status(int sock) {
  std::vector<uint8_t> buf;
  const int st = call(sock, encode(Op::kStatus, 2, 0, StatusReq{}), buf, "status");
  if (st != 0) {
    std::fprintf(stderr, "status: %s\n", errno_text(st).c_str());
    return 3;
  }
  const size_t off = sizeof(MsgHeader);
  uint32_t len = 0;
  if (buf.size() < off + sizeof(len)) return 1;
  std::memcpy(&len, buf.data() + off, sizeof(len));
  if (buf.size() - off - sizeof(len) < len) return 1;
  std::fwrite(buf.data() + off + sizeof(len), 1, len, stdout);
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return usage();
  auto sock = connect_unix(argv[1]);
  if (!sock.is_ok()) {
    std::fprintf(stderr, "connect: %s\n", sock.status().message().c_str());
    return 1;
  }
  const std::string cmd = argv[2];
  if (cmd == "status" && argc == 3) return status(sock.value().get());
  if (cmd != "hello" || argc < 5 || argc > 6 || (argc == 6 && std::string(argv[5]) != "status"))
    return usage();
  HelloReq req{};
  std::snprintf(req.guest, sizeof(req.guest), "%s", argv[3]);
  req.pid = static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 0));
  std::vector<uint8_t> buf;
  const int st = call(sock.value().get(), encode(Op::kHello, 1, 0, req), buf, "hello");
  if (st != 0) {
    std::fprintf(stderr, "hello: %s\n", errno_text(st).c_str());
    return 3;
  }
  std::fprintf(stderr, "hello: session opened in guest %s\n", argv[3]);
  return argc == 6 ? status(sock.value().get()) : 0;
}
