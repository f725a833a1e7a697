// The TCP options of every connection that carries RC traffic between hosts: the backends'
// transport (transport/tcp) and the libraries' own connections (the direct path across
// backends, verbs/remote*.cc). One set, so a lossy or slow link treats a QP the same on both
// paths (issue 30; docs/ARCHITECTURE.md, "RC over a bad network").
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

namespace vrdma {

/// No Nagle delay; a lost segment sent again after 50 ms (or the path's RTO if longer), not
/// TCP's 200 ms floor, and an outage's backoff stopped at 1 s, so the connection resumes soon
/// after the link does (RC's budget, `timeout` 14, is 67 ms a try). Not lower: at 5 ms a path
/// whose RTT jumped from 0.1 to 20 ms saw 126 spurious retransmissions and its window collapse.
/// (Linux 6.15+; older kernels keep their defaults.) With few segments in flight (a ping-pong:
/// no duplicate ACKs to trigger a fast retransmit), a segment lost again is retried after the
/// same RTO, not a doubled one, for its first 6 retries: as a fabric retries, each try
/// independent. Doubling, three losses of one segment in a row at 10 % loss took 50+100+200+400
/// ms, more than `timeout` 14's budget. Then: unacknowledged data for `user_timeout_ms` ends
/// the connection.
inline void set_rc_tcp_options(int fd, unsigned user_timeout_ms) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
  constexpr int kTcpRtoMaxMs = 44, kTcpRtoMinUs = 45;  // <linux/tcp.h> of 6.15
  const int rto_min_us = 50000, rto_max_ms = 1000;
  ::setsockopt(fd, IPPROTO_TCP, kTcpRtoMinUs, &rto_min_us, sizeof(rto_min_us));
  ::setsockopt(fd, IPPROTO_TCP, kTcpRtoMaxMs, &rto_max_ms, sizeof(rto_max_ms));
  ::setsockopt(fd, IPPROTO_TCP, TCP_THIN_LINEAR_TIMEOUTS, &one, sizeof(one));
}

}  // namespace vrdma
