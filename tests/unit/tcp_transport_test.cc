// The TCP transport between two backends in one process, over loopback: a direct offer frame
// reaches the other side's Receiver, and peer_ipv4 names the address the connection comes from.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/unique_fd.h"
#include "transport/tcp/tcp_transport.h"

namespace vrdma::transport::tcp {
namespace {

namespace wire = proto::wire;

uint64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

/// A loopback port nobody listens on now (bound, read, released).
uint16_t free_port() {
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&sa), &len) != 0)
    return 0;
  return ntohs(sa.sin_port);
}

struct Recorder final : Receiver {
  struct Got {
    std::string node;
    wire::DirectOffer offer;
  };
  std::vector<Got> offers;
  std::vector<std::string> up;
  void on_frame(const std::string& node, const wire::Frame& f, RxSink&) override {
    if (f.type() == wire::Type::kDirectOffer) offers.push_back({node, f.offer});
  }
  void on_frame_done(const std::string&, const wire::Frame&, RxSink&) override {}
  void on_peer_up(const std::string& node) override { up.push_back(node); }
  void on_guest_located(const GuestInfo&, const std::string&) override {}
};

TEST(TcpTransport, DirectOfferArrivesWithThePeersAddress) {
  const uint16_t port = free_port();
  ASSERT_NE(port, 0);
  Recorder ra, rb;
  const std::string addr_a = "127.0.0.1:" + std::to_string(port);
  auto a = TcpTransport::create({"node-a", addr_a, {}, false}, ra);
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  auto b = TcpTransport::create({"node-b", "127.0.0.1:0", {addr_a}, false}, rb);
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  auto connected = [](const TcpTransport& t, const std::string& node) {
    auto c = t.connected();
    return std::find(c.begin(), c.end(), node) != c.end();
  };
  auto run_until = [&](auto done) {
    for (uint64_t end = now_ns() + 5000000000ull; now_ns() < end;) {
      (*a)->poll(now_ns());
      (*b)->poll(now_ns());
      if (done()) return true;
    }
    return false;
  };
  ASSERT_TRUE(run_until([&] { return connected(**a, "node-b") && connected(**b, "node-a"); }));
  EXPECT_EQ((*a)->peer_ipv4("node-b"), ::inet_addr("127.0.0.1"));
  EXPECT_EQ((*b)->peer_ipv4("node-a"), ::inet_addr("127.0.0.1"));
  EXPECT_EQ((*a)->peer_ipv4("nobody"), 0u);

  wire::DirectOffer o{};
  o.slid = 0x21;
  o.dlid = 0x42;
  o.port = 40000;
  o.src_qpn = 0x12;
  o.dst_qpn = 0x11;
  o.token[0] = 0x5a;
  ASSERT_TRUE((*b)->send("node-a", wire::Type::kDirectOffer, &o, {}, {}));
  ASSERT_TRUE(run_until([&] { return !ra.offers.empty(); }));
  ASSERT_EQ(ra.offers.size(), 1u);
  EXPECT_EQ(ra.offers[0].node, "node-b");
  EXPECT_EQ(ra.offers[0].offer.port, 40000);
  EXPECT_EQ(ra.offers[0].offer.src_qpn, 0x12u);
  EXPECT_EQ(ra.offers[0].offer.dst_qpn, 0x11u);
  EXPECT_EQ(ra.offers[0].offer.token[0], 0x5a);
  // The connection stays up: the frame was well formed.
  EXPECT_TRUE(connected(**a, "node-b"));
}

}  // namespace
}  // namespace vrdma::transport::tcp
