// TCP's count of segments the peer has received, cumulatively acknowledged or selectively
// (SACK): what moves while a hole at the front waits for its retransmission. 0 where the kernel
// does not say (before Linux 4.18).
#pragma once

#include <cstdint>

namespace vrdma::transport {

uint32_t tcp_delivered(int fd);

}  // namespace vrdma::transport
