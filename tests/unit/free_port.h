// A loopback TCP port for a server a test starts, as tests/e2e/lib.sh's free_port picks one:
// below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by default), where no
// connect() on the machine takes it between this check and the server's bind (a port bind(0)
// hands out is in that range: another test's client, or a backend's dial, can take it first).
// Tests run in parallel: one in 22000 that another test picks the same; a server that fails
// to bind should be started again on a new one.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <random>

namespace vrdma::testing_util {

/// A port in 10000-31999 that 127.0.0.1 can bind now (0 after 1000 tries).
inline uint16_t free_port() {
  static std::mt19937 rng{std::random_device{}()};
  std::uniform_int_distribution<int> pick(10000, 31999);
  for (int tries = 0; tries < 1000; ++tries) {
    const auto port = static_cast<uint16_t>(pick(rng));
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return 0;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    const bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    ::close(s);
    if (ok) return port;
  }
  return 0;
}

}  // namespace vrdma::testing_util
