// TCP's count of segments the peer has received (tcpi_delivered), in a file of its own: it is in
// the kernel's struct tcp_info (<linux/tcp.h>), not in glibc's (<netinet/tcp.h>), and the two
// headers cannot meet in one file.
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>

#include "transport/tcp/tcp_delivered.h"

namespace vrdma::transport {

uint32_t tcp_delivered(int fd) {
  tcp_info ti{};
  socklen_t len = sizeof(ti);
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 ||
      len < offsetof(tcp_info, tcpi_delivered) + sizeof(ti.tcpi_delivered))
    return 0;
  return ti.tcpi_delivered;
}

}  // namespace vrdma::transport
