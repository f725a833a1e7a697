#include "transport/tcp/endpoint.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>

#include <cstdio>
#include <cstring>

namespace vrdma::transport::tcp {

uint16_t Endpoint::port() const {
  if (family() == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (family() == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

bool Endpoint::unspecified() const {
  if (family() == AF_INET)
    return reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr.s_addr == htonl(INADDR_ANY);
  if (family() == AF_INET6)
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr);
  return false;
}

bool Endpoint::loopback() const {
  if (family() == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr.s_addr) >> 24) == 127;
  if (family() != AF_INET6) return false;
  const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
}

Result<Endpoint> parse_endpoint(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos) return error(EINVAL, fmt::format("\"{}\" is not ADDR:PORT", s));
  std::string host = s.substr(0, colon);
  int port = 0;
  char extra = 0;
  if (std::sscanf(s.c_str() + colon + 1, "%d%c", &port, &extra) != 1 || port < 0 || port > 65535)
    return error(EINVAL, fmt::format("\"{}\": bad port", s));
  Endpoint e;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    auto* sa6 = reinterpret_cast<sockaddr_in6*>(&e.ss);
    sa6->sin6_family = AF_INET6;
    sa6->sin6_port = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), &sa6->sin6_addr) != 1)
      return error(EINVAL, fmt::format("\"{}\": not an IPv6 address in brackets", s));
    e.len = sizeof(sockaddr_in6);
    return e;
  }
  if (host.find(':') != std::string::npos)
    return error(EINVAL,
                 fmt::format("\"{}\": an IPv6 address goes in brackets, \"[ADDR]:PORT\"", s));
  if (host == "localhost") host = "127.0.0.1";
  auto* sa4 = reinterpret_cast<sockaddr_in*>(&e.ss);
  sa4->sin_family = AF_INET;
  sa4->sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &sa4->sin_addr) != 1)
    return error(EINVAL, fmt::format("\"{}\": not an IPv4 address (IPv6 goes in brackets)", s));
  e.len = sizeof(sockaddr_in);
  return e;
}

std::string format_endpoint(const sockaddr* sa) {
  char ip[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &a->sin_addr, ip, sizeof(ip));
    return fmt::format("{}:{}", ip, ntohs(a->sin_port));
  }
  if (sa->sa_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(sa);
    ::inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof(ip));
    return fmt::format("[{}]:{}", ip, ntohs(a->sin6_port));
  }
  return "?";
}

std::string endpoint_of(int fd, int (*name)(int, sockaddr*, socklen_t*)) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (name(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  return format_endpoint(reinterpret_cast<const sockaddr*>(&ss));
}

}  // namespace vrdma::transport::tcp
