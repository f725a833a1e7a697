// Transport addresses: "ADDR:PORT" with an IPv4 dotted quad or "localhost", or "[ADDR]:PORT"
// with an IPv6 address in brackets (as in URLs). What the listener binds, dials connect to,
// the directory advertises and status shows. Plain functions, any thread.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>

#include "common/status.h"

namespace vrdma::transport::tcp {

/// A parsed endpoint: a sockaddr_in or sockaddr_in6, ready for bind/connect.
struct Endpoint {
  sockaddr_storage ss{};
  socklen_t len = 0;

  int family() const { return ss.ss_family; }
  const sockaddr* sa() const { return reinterpret_cast<const sockaddr*>(&ss); }
  sockaddr* sa() { return reinterpret_cast<sockaddr*>(&ss); }
  uint16_t port() const;
  /// 0.0.0.0 or :: (a listener on every address; nobody can dial it).
  bool unspecified() const;
  /// 127.0.0.0/8, ::1 or an IPv4-mapped 127.x (what an unauthenticated transport may use).
  bool loopback() const;
};

/// Parses "ADDR:PORT" (IPv4 or "localhost") or "[IPV6]:PORT"; an unbracketed IPv6 address is
/// refused (its last colon would be taken for the port's).
Result<Endpoint> parse_endpoint(const std::string& s);
/// "1.2.3.4:5" or "[fd00::1]:5" (what parse_endpoint reads back); "?" for another family.
std::string format_endpoint(const sockaddr* sa);
/// The address of one end of a socket (getpeername or getsockname), formatted; "?" on error.
std::string endpoint_of(int fd, int (*name)(int, sockaddr*, socklen_t*));
/// True for a loopback endpoint (Endpoint::loopback).
inline bool is_loopback(const Endpoint& e) { return e.loopback(); }

}  // namespace vrdma::transport::tcp
