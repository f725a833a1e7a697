// The TCP transport between backends in one process, over loopback: a direct offer frame
// reaches the other side's Receiver, and peer_ipv4 names the address the connection comes from;
// with a cluster credential the peers authenticate each other (TLS 1.3), a peer without one is
// refused, and a node cannot take over a directory entry another node holds; endpoints parse in
// both forms ("ADDR:PORT", "[IPV6]:PORT") and peers connect over IPv6.
#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "cli/cluster.h"
#include "common/guest_fault.h"
#include "common/unique_fd.h"
#include "free_port.h"

namespace vrdma::transport::tcp {
namespace {

namespace wire = proto::wire;

uint64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

using testing_util::free_port;

struct Recorder final : Receiver {
  struct Got {
    std::string node;
    wire::DirectOffer offer;
  };
  std::vector<Got> offers;
  std::vector<std::string> up;
  std::vector<uint32_t> requests;  ///< src_qpn of each request (payload discarded)
  void on_frame(const std::string& node, const wire::Frame& f, RxSink&) override {
    if (f.type() == wire::Type::kDirectOffer) offers.push_back({node, f.offer});
    if (f.type() == wire::Type::kRequest) requests.push_back(f.req.src_qpn);
  }
  void on_frame_done(const std::string&, const wire::Frame&, RxSink&) override {}
  void on_peer_up(const std::string& node) override { up.push_back(node); }
  std::vector<std::pair<std::string, uint16_t>> located;  ///< (node, lid)
  void on_guest_located(const GuestInfo& g, const std::string& node) override {
    located.emplace_back(node, g.lid);
  }
};

bool connected(const TcpTransport& t, const std::string& node) {
  auto c = t.connected();
  return std::find(c.begin(), c.end(), node) != c.end();
}

/// Polls every transport until done() or 5 s.
template <typename Done>
bool run_until(std::initializer_list<TcpTransport*> ts, Done done) {
  for (uint64_t end = now_ns() + 5000000000ull; now_ns() < end;) {
    for (TcpTransport* t : ts) t->poll(now_ns());
    if (done()) return true;
  }
  return false;
}

/// A cluster (CA and one credential per node) in a temporary directory.
class Cluster {
 public:
  explicit Cluster(std::initializer_list<const char*> nodes) {
    char tmpl[] = "/tmp/vrdma-tls-test.XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    dir_ += "/cluster";
    EXPECT_TRUE(cli::cluster_init(dir_).is_ok());
    for (const char* n : nodes) EXPECT_TRUE(cli::cluster_add_node(dir_, n).is_ok());
  }
  ~Cluster() { std::system(("rm -rf " + dir_.substr(0, dir_.rfind('/'))).c_str()); }
  std::shared_ptr<const TlsContext> ctx(const std::string& node) const {
    auto c = TlsContext::load(TlsFiles::in_dir(dir_, node), node);
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    return c.is_ok() ? std::shared_ptr<const TlsContext>(std::move(c).value()) : nullptr;
  }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

TEST(TcpTransport, DirectOfferArrivesWithThePeersAddress) {
  const uint16_t port = free_port();
  ASSERT_NE(port, 0);
  Recorder ra, rb;
  const std::string addr_a = "127.0.0.1:" + std::to_string(port);
  auto a = TcpTransport::create({"node-a", addr_a, {}, false, nullptr}, ra);
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  auto b = TcpTransport::create({"node-b", "127.0.0.1:0", {addr_a}, false, nullptr}, rb);
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  auto both = {a->get(), b->get()};
  ASSERT_TRUE(
      run_until(both, [&] { return connected(**a, "node-b") && connected(**b, "node-a"); }));
  EXPECT_EQ((*a)->peer_ipv4("node-b"), ::inet_addr("127.0.0.1"));
  EXPECT_EQ((*b)->peer_ipv4("node-a"), ::inet_addr("127.0.0.1"));
  EXPECT_EQ((*a)->peer_ipv4("nobody"), 0u);
  EXPECT_EQ((*a)->local_ipv4("node-b"), ::inet_addr("127.0.0.1"));
  EXPECT_EQ((*a)->local_ipv4("nobody"), 0u);

  wire::DirectOffer o{};
  o.slid = 0x21;
  o.dlid = 0x42;
  o.port = 40000;
  o.src_qpn = 0x12;
  o.dst_qpn = 0x11;
  o.token[0] = 0x5a;
  ASSERT_TRUE((*b)->send("node-a", wire::Type::kDirectOffer, &o, {}, {}, 0));
  ASSERT_TRUE(run_until(both, [&] { return !ra.offers.empty(); }));
  ASSERT_EQ(ra.offers.size(), 1u);
  EXPECT_EQ(ra.offers[0].node, "node-b");
  EXPECT_EQ(ra.offers[0].offer.port, 40000);
  EXPECT_EQ(ra.offers[0].offer.src_qpn, 0x12u);
  EXPECT_EQ(ra.offers[0].offer.dst_qpn, 0x11u);
  EXPECT_EQ(ra.offers[0].offer.token[0], 0x5a);
  // The connection stays up: the frame was well formed.
  EXPECT_TRUE(connected(**a, "node-b"));
}

TEST(Endpoint, ParsesIpv4AndBracketedIpv6) {
  struct Case {
    const char* text;
    int family;
    uint16_t port;
    const char* formatted;
    bool loopback, unspecified;
  };
  for (const Case& k : std::initializer_list<Case>{
           {"10.1.2.3:7000", AF_INET, 7000, "10.1.2.3:7000", false, false},
           {"localhost:0", AF_INET, 0, "127.0.0.1:0", true, false},
           {"0.0.0.0:1", AF_INET, 1, "0.0.0.0:1", false, true},
           {"[fd00::1]:7000", AF_INET6, 7000, "[fd00::1]:7000", false, false},
           {"[::1]:1", AF_INET6, 1, "[::1]:1", true, false},
           {"[::ffff:127.0.0.2]:1", AF_INET6, 1, "[::ffff:127.0.0.2]:1", true, false},
           {"[::ffff:10.0.0.1]:1", AF_INET6, 1, "[::ffff:10.0.0.1]:1", false, false},
           {"[::]:7000", AF_INET6, 7000, "[::]:7000", false, true}}) {
    auto e = parse_endpoint(k.text);
    ASSERT_TRUE(e.is_ok()) << k.text << ": " << e.status().message();
    EXPECT_EQ(e->family(), k.family) << k.text;
    EXPECT_EQ(e->len, k.family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
    EXPECT_EQ(e->port(), k.port) << k.text;
    EXPECT_EQ(format_endpoint(e->sa()), k.formatted);
    EXPECT_EQ(e->loopback(), k.loopback) << k.text;
    EXPECT_EQ(e->unspecified(), k.unspecified) << k.text;
  }
  // What format_endpoint writes, parse_endpoint reads back.
  EXPECT_EQ(format_endpoint(parse_endpoint("[FD00:0::A]:9")->sa()), "[fd00::a]:9");

  for (const char* bad : {"fd00::1:7000", "[fd00::1]", "[fd00::1:7000", "fd00::1]:7000",
                          "[10.0.0.1]:7000", "[zz::1]:1", "[]:1", "1.2.3.4:65536", "1.2.3.4:-1",
                          "1.2.3.4:80x", "1.2.3.4", "host.example:1", ":7000"})
    EXPECT_FALSE(parse_endpoint(bad).is_ok()) << bad;

  auto peer = parse_peer("node-b@[fd00::2]:7000");
  ASSERT_TRUE(peer.is_ok()) << peer.status().message();
  EXPECT_EQ(peer->node, "node-b");
  EXPECT_EQ(peer->addr, "[fd00::2]:7000");
  EXPECT_EQ(peer->sa.family(), AF_INET6);
  EXPECT_EQ(parse_peer("[::1]:1")->node, "");
}

/// Whether this host has IPv6 on loopback (a container may not).
bool have_ipv6_loopback() {
  UniqueFd s(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in6 sa{};
  sa.sin6_family = AF_INET6;
  sa.sin6_addr = in6addr_loopback;
  return s.valid() && ::bind(s.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
}

/// Over IPv4 and IPv6 loopback ("[::1]": bracketed, as parse_endpoint wants it).
class TcpTransportTls : public ::testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(Families, TcpTransportTls, ::testing::Values("127.0.0.1", "[::1]"),
                         [](const auto& i) {
                           return std::string(i.param[0] == '[' ? "Ipv6" : "Ipv4");
                         });

TEST_P(TcpTransportTls, PeersAuthenticateEachOtherAndCarryFrames) {
  const std::string host = GetParam();
  if (host == "[::1]" && !have_ipv6_loopback()) GTEST_SKIP() << "no IPv6 on loopback";
  Cluster cl({"node-a", "node-b"});
  Recorder ra, rb;
  auto a = TcpTransport::create({"node-a", host + ":0", {}, false, cl.ctx("node-a")}, ra);
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  const std::string addr_a = (*a)->listen_address();  // the port filled in
  EXPECT_TRUE(addr_a.starts_with(host + ":")) << addr_a;
  auto b = TcpTransport::create(
      {"node-b", host + ":0", {"node-a@" + addr_a}, false, cl.ctx("node-b")}, rb);
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  auto both = {a->get(), b->get()};
  ASSERT_TRUE(
      run_until(both, [&] { return connected(**a, "node-b") && connected(**b, "node-a"); }));
  const auto peers = (*a)->peers();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers[0].identity, "node-b");
  EXPECT_TRUE(peers[0].address.starts_with(host + ":")) << peers[0].address;
  // The address an IPv4 connection comes from; 0 on an IPv6 one.
  EXPECT_EQ((*a)->peer_ipv4("node-b"), host == "[::1]" ? 0u : ::inet_addr("127.0.0.1"));
  EXPECT_EQ(peers[0].cipher, "TLS_AES_128_GCM_SHA256");
  EXPECT_GT(peers[0].since_unix, 0u);
  // Many frames, more than one TLS record and more than the session's buffer, in order.
  for (uint32_t i = 0; i < 20000; ++i) {
    wire::DirectOffer o{};
    o.port = static_cast<uint16_t>(i + 1);
    o.src_qpn = i;
    ASSERT_TRUE((*b)->send("node-a", wire::Type::kDirectOffer, &o, {}, {}, 0));
  }
  ASSERT_TRUE(run_until(both, [&] { return ra.offers.size() == 20000; })) << ra.offers.size();
  for (uint32_t i = 0; i < 20000; ++i) ASSERT_EQ(ra.offers[i].offer.src_qpn, i);
  EXPECT_EQ((*a)->refused().handshake, 0u);
}

/// A connected pair, plain or TLS (b dials a).
struct Pair {
  Recorder ra, rb;
  std::unique_ptr<Cluster> cl;
  std::unique_ptr<TcpTransport> a, b;
  explicit Pair(bool tls) {
    if (tls) cl = std::make_unique<Cluster>(std::initializer_list<const char*>{"node-a", "node-b"});
    const std::string addr_a = "127.0.0.1:" + std::to_string(free_port());
    auto ta =
        TcpTransport::create({"node-a", addr_a, {}, false, tls ? cl->ctx("node-a") : nullptr}, ra);
    auto tb = TcpTransport::create(
        {"node-b", "127.0.0.1:0", {addr_a}, false, tls ? cl->ctx("node-b") : nullptr}, rb);
    EXPECT_TRUE(ta.is_ok() && tb.is_ok());
    if (!ta.is_ok() || !tb.is_ok()) return;
    a = std::move(ta).value();
    b = std::move(tb).value();
    EXPECT_TRUE(run_until({a.get(), b.get()},
                          [&] { return connected(*a, "node-b") && connected(*b, "node-a"); }));
  }
};

class TcpTransportFlows : public ::testing::TestWithParam<bool> {};

// A QP that fails takes back its frames not yet on the socket: the peer never sees them, what
// other flows queued behind them still arrives, and their marks still say when the peer's TCP
// has them (the skipped bytes do not shift the stream's accounting).
TEST_P(TcpTransportFlows, ADroppedFlowNeverReachesThePeerAndMarksStayTrue) {
  Pair p(GetParam());
  ASSERT_TRUE(p.a && p.b);
  std::vector<uint8_t> data(64 * 1024, 0x5a);  // above the copy limit: sent from "guest memory"
  const Span payload{data.data(), data.size()};
  auto request = [&](uint32_t qpn, uint64_t flow) {
    wire::Request rq{};
    rq.qp_type = IBV_QPT_RC;
    rq.opcode = IBV_WR_RDMA_WRITE;
    rq.src_qpn = qpn;
    rq.length = static_cast<uint32_t>(data.size());
    EXPECT_TRUE(p.b->send("node-a", wire::Type::kRequest, &rq, {&payload, 1}, {}, flow));
    return p.b->tx_mark("node-a");
  };
  std::vector<TxMark> kept;
  for (uint32_t i = 0; i < 8; ++i) {
    request(0x100 + i, 7);                  // the flow that fails
    kept.push_back(request(0x200 + i, 9));  // another QP's
  }
  EXPECT_GT(p.b->tx_unwritten("node-a", kept.back()), 16 * data.size());
  p.b->drop_flow("node-a", 7);
  EXPECT_LE(p.b->tx_unwritten("node-a", kept.back()), 8 * (data.size() + 200));
  ASSERT_TRUE(run_until({p.a.get(), p.b.get()}, [&] {
    return p.ra.requests.size() == 8 && p.b->tx_delivered("node-a", kept.back());
  })) << p.ra.requests.size();
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(p.ra.requests[i], 0x200 + i);
  for (const TxMark& m : kept) EXPECT_TRUE(p.b->tx_delivered("node-a", m));
  EXPECT_EQ(p.b->tx_unwritten("node-a", kept.back()), 0u);
  const auto peers = p.b->peers();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_GE(peers[0].dropped_bytes, 8 * data.size());
  // The stream goes on: a frame after the drop arrives too, and is known delivered.
  const TxMark after = request(0x300, 9);
  ASSERT_TRUE(run_until({p.a.get(), p.b.get()}, [&] {
    return p.ra.requests.size() == 9 && p.b->tx_delivered("node-a", after);
  }));
}

// A peer that does not read (its backend starved of CPU, or stopped) closes its TCP window once
// its socket is full: everything we sent is acknowledged, and the rest waits in our socket. That
// is what peer_window_closed says (an ACK timer then waits for a slow backend); it opens again
// once the peer reads, and every frame arrives.
TEST_P(TcpTransportFlows, APeerThatDoesNotReadClosesItsWindow) {
  Pair p(GetParam());
  ASSERT_TRUE(p.a && p.b);
  EXPECT_FALSE(p.b->peer_window_closed("node-a"));
  std::vector<uint8_t> data(64 * 1024, 0x5a);
  const Span payload{data.data(), data.size()};
  uint32_t sent = 0;
  // Only b runs: a's socket fills (tens of MB at most with the kernel's autotuning).
  const bool closed = run_until({p.b.get()}, [&] {
    if (p.b->peer_window_closed("node-a")) return true;
    if (sent < 2000 && p.b->tx_unwritten("node-a", p.b->tx_mark("node-a")) < 4 * data.size()) {
      wire::Request rq{};
      rq.qp_type = IBV_QPT_RC;
      rq.opcode = IBV_WR_RDMA_WRITE;
      rq.src_qpn = 0x100;
      rq.length = static_cast<uint32_t>(data.size());
      EXPECT_TRUE(p.b->send("node-a", wire::Type::kRequest, &rq, {&payload, 1}, {}, 1));
      ++sent;
    }
    return false;
  });
  ASSERT_TRUE(closed) << sent << " frames sent";
  // What a QP that gives up logs of the path: nothing in flight, bytes waiting here.
  const std::string st = p.b->path_state("node-a");
  EXPECT_TRUE(st.starts_with("tcp: 0 segments unacknowledged, ")) << st;
  EXPECT_EQ(st.find(", 0 bytes not sent"), std::string::npos) << st;
  ASSERT_TRUE(run_until({p.a.get(), p.b.get()}, [&] {
    return p.ra.requests.size() == sent && !p.b->peer_window_closed("node-a");
  })) << p.ra.requests.size() << " of " << sent;
}

// A peer whose host accepts our connection while no backend takes it (one restarting under
// keep_state, whose keeper holds its listener): all we sent (our Hello; TLS: the ClientHello)
// is acknowledged and nothing answers, which is what peer_not_taken says (an ACK timer then
// waits as for a slow backend). The next backend takes that listener (Options::listener): it
// answers the connection, and a frame queued meanwhile arrives.
TEST_P(TcpTransportFlows, AConnectionNoBackendTookWaitsForTheNextOne) {
  std::unique_ptr<Cluster> cl;
  if (GetParam())
    cl = std::make_unique<Cluster>(std::initializer_list<const char*>{"node-a", "node-b"});
  UniqueFd held(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(::bind(held.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(::listen(held.get(), 64), 0);
  ASSERT_EQ(::getsockname(held.get(), reinterpret_cast<sockaddr*>(&sa), &len), 0);
  const std::string addr_a = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  Recorder ra, rb;
  auto b = TcpTransport::create(
      {"node-b", "127.0.0.1:0", {"node-a@" + addr_a}, false, cl ? cl->ctx("node-b") : nullptr}, rb);
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  TcpTransport& tb = **b;
  EXPECT_FALSE(tb.peer_not_taken("node-a"));  // not dialed yet
  ASSERT_TRUE(run_until({&tb}, [&] { return tb.peer_not_taken("node-a"); }));
  wire::Request rq{};
  rq.qp_type = IBV_QPT_RC;
  rq.opcode = IBV_WR_SEND;
  rq.src_qpn = 0x77;
  ASSERT_TRUE(tb.send("node-a", wire::Type::kRequest, &rq, {}, {}, 1));
  ASSERT_TRUE(run_until({&tb}, [&] { return tb.peer_not_taken("node-a"); }));
  EXPECT_FALSE(connected(tb, "node-a"));
  auto a = TcpTransport::create(
      {"node-a", addr_a, {}, false, cl ? cl->ctx("node-a") : nullptr, 0, std::move(held)}, ra);
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  EXPECT_EQ((*a)->listen_address(), addr_a);
  ASSERT_TRUE(run_until({a->get(), &tb}, [&] {
    return connected(tb, "node-a") && connected(**a, "node-b") && ra.requests.size() == 1;
  })) << ra.requests.size();
  EXPECT_EQ(ra.requests[0], 0x77u);
  EXPECT_FALSE(tb.peer_not_taken("node-a"));
}

INSTANTIATE_TEST_SUITE_P(PlainAndTls, TcpTransportFlows, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Tls" : "Plain"; });

TEST(TcpTransport, APeerWithoutTheCredentialIsRefused) {
  Cluster cl({"node-a", "node-b"});
  Cluster other({"node-b"});  // the right name, signed by another CA
  const std::string addr_a = "127.0.0.1:" + std::to_string(free_port());
  Recorder ra, rb, rc;
  auto a = TcpTransport::create({"node-a", addr_a, {}, false, cl.ctx("node-a")}, ra);
  ASSERT_TRUE(a.is_ok());
  auto plain = TcpTransport::create({"node-b", "127.0.0.1:0", {addr_a}, false, nullptr}, rb);
  ASSERT_TRUE(plain.is_ok());
  auto forged =
      TcpTransport::create({"node-b", "127.0.0.1:0", {addr_a}, false, other.ctx("node-b")}, rc);
  ASSERT_TRUE(forged.is_ok());
  auto all = {a->get(), plain->get(), forged->get()};
  ASSERT_TRUE(run_until(all, [&] { return (*a)->refused().handshake >= 4; }));
  EXPECT_TRUE((*a)->connected().empty());
  EXPECT_TRUE(ra.up.empty());
  EXPECT_TRUE(rb.up.empty());
  EXPECT_TRUE(rc.up.empty());
}

// `vrdma status` says why a configured peer is not connected: each dial keeps its last error and
// the attempts that failed since the last Hello.
TEST(TcpTransport, AnUnreachablePeerSaysWhyInItsDial) {
  const uint16_t port = free_port();  // nobody listens there yet
  ASSERT_NE(port, 0);
  const std::string addr = "127.0.0.1:" + std::to_string(port);
  Recorder ra, rb;
  auto b = TcpTransport::create({"node-b", "127.0.0.1:0", {addr}, false, nullptr}, rb);
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  ASSERT_TRUE(run_until({b->get()}, [&] { return (*b)->dials().at(0).failures >= 2; }));
  auto d = (*b)->dials().at(0);
  EXPECT_EQ(d.address, addr);
  EXPECT_NE(d.state, "connected");
  EXPECT_EQ(d.last_error, "Connection refused");
  EXPECT_GT(d.last_error_unix, 0u);
  auto a = TcpTransport::create({"node-a", addr, {}, false, nullptr}, ra);
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  ASSERT_TRUE(run_until({a->get(), b->get()}, [&] { return connected(**b, "node-a"); }));
  d = (*b)->dials().at(0);
  EXPECT_EQ(d.state, "connected");
  EXPECT_EQ(d.failures, 0u);
  EXPECT_EQ(d.last_error, "Connection refused");  // still there: what went wrong before
  a->reset();  // node-a goes away: the connection's end is the error now
  ASSERT_TRUE(run_until({b->get()}, [&] { return (*b)->dials().at(0).state != "connected"; }));
  const std::string end = (*b)->dials().at(0).last_error;
  EXPECT_TRUE(end == "closed by the peer" || end == "Connection reset by peer") << end;
}

/// A directory that knows nodes' certificate fingerprints only (the etcd one pins them so).
struct PinningDirectory final : transport::Directory {
  std::map<std::string, std::string> pins;
  void announce(const GuestInfo&, bool) override {}
  std::string locate_lid(uint16_t) const override { return {}; }
  std::string locate_gid(const uint8_t*) const override { return {}; }
  std::string fingerprint_of(const std::string& node) const override {
    auto it = pins.find(node);
    return it == pins.end() ? std::string() : it->second;
  }
  std::string unavailable() const override { return {}; }
};

// A node that registered one certificate in the directory and presents another (re-keyed with
// the CA's blessing, or a second credential of a stolen name) is refused; its registered one
// is taken.
TEST(TcpTransport, APeerMustPresentTheCertificateItRegistered) {
  Cluster cl({"node-a", "node-b"});
  const std::string registered = cert_file_fingerprint(cl.dir() + "/node-b.pem");
  ASSERT_FALSE(registered.empty());
  auto first = cl.ctx("node-b");
  ASSERT_TRUE(cli::cluster_add_node(cl.dir(), "node-b", 30, true).is_ok());  // a second one
  auto second = cl.ctx("node-b");
  EXPECT_NE(cert_file_fingerprint(cl.dir() + "/node-b.pem"), registered);
  PinningDirectory dir;
  dir.pins["node-b"] = registered;
  const std::string addr_a = "127.0.0.1:" + std::to_string(free_port());
  Recorder ra, rb, rc;
  auto a = TcpTransport::create({"node-a", addr_a, {}, false, cl.ctx("node-a")}, ra);
  ASSERT_TRUE(a.is_ok());
  (*a)->set_directory(&dir);
  auto other = TcpTransport::create({"node-b", "127.0.0.1:0", {addr_a}, false, second}, rc);
  ASSERT_TRUE(other.is_ok());
  auto refused = {a->get(), other->get()};
  ASSERT_TRUE(run_until(refused, [&] { return (*a)->refused().name >= 1; }));
  EXPECT_TRUE((*a)->connected().empty());
  other->reset();
  auto right = TcpTransport::create({"node-b", "127.0.0.1:0", {addr_a}, false, first}, rb);
  ASSERT_TRUE(right.is_ok());
  auto taken = {a->get(), right->get()};
  EXPECT_TRUE(run_until(taken, [&] { return connected(**a, "node-b"); }));
}

TEST(TcpTransport, ANodeCannotTakeOverWhatAnotherNodeHolds) {
  Cluster cl({"node-a", "node-b", "node-c"});
  const std::string addr_a = "127.0.0.1:" + std::to_string(free_port());
  Recorder ra, rb, rc;
  auto a = TcpTransport::create({"node-a", addr_a, {}, false, cl.ctx("node-a")}, ra);
  auto b = TcpTransport::create({"node-b", "127.0.0.1:0", {addr_a}, false, cl.ctx("node-b")}, rb);
  auto c = TcpTransport::create({"node-c", "127.0.0.1:0", {addr_a}, false, cl.ctx("node-c")}, rc);
  ASSERT_TRUE(a.is_ok() && b.is_ok() && c.is_ok());
  auto all = {a->get(), b->get(), c->get()};
  ASSERT_TRUE(run_until(all, [&] { return (*a)->connected().size() == 2; }));
  GuestInfo g{"vm1", 0x21, {}};
  g.gid[15] = 0x21;
  (*b)->announce(g, true);
  ASSERT_TRUE(run_until(all, [&] { return (*a)->locate_lid(0x21) == "node-b"; }));
  // node-c claims the same guest (LID and GID): refused while node-b holds it.
  (*c)->announce(g, true);
  ASSERT_TRUE(run_until(all, [&] { return (*a)->refused().directory == 1; }));
  EXPECT_EQ((*a)->locate_lid(0x21), "node-b");
  EXPECT_EQ((*a)->locate_gid(g.gid), "node-b");
  // node-b lets it go (the guest migrated): node-c's claim applies.
  ra.located.clear();
  (*b)->announce(g, false);
  ASSERT_TRUE(run_until(all, [&] { return (*a)->locate_lid(0x21) == "node-c"; }));
  ASSERT_EQ(ra.located.size(), 1u);
  EXPECT_EQ(ra.located[0].first, "node-c");
  // And node-b cannot take it back by announcing it.
  (*b)->announce(g, true);
  ASSERT_TRUE(run_until(all, [&] { return (*a)->refused().directory == 2; }));
  EXPECT_EQ((*a)->locate_lid(0x21), "node-c");
}

/// Copies what is readable on `from` to `to`, flipping byte `flip` of it when >= 0.
void relay(int from, int to, long flip = -1) {
  uint8_t buf[65536];
  const ssize_t n = ::recv(from, buf, sizeof(buf), MSG_DONTWAIT);
  if (n <= 0) return;
  if (flip >= 0 && flip < n) buf[flip] ^= 0x40;
  ASSERT_EQ(::send(to, buf, static_cast<size_t>(n), 0), n);
}

TEST(TlsStream, AnAlteredRecordIsRefusedAndNothingOfItIsReturned) {
  Cluster cl({"node-a", "node-b"});
  auto ca = cl.ctx("node-a"), cb = cl.ctx("node-b");
  ASSERT_TRUE(ca && cb);
  // a writes a_sock[0], the test relays a_sock[1] -> b_sock[1], b reads b_sock[0]; and back:
  // the test is the network.
  int a_sock[2], b_sock[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, a_sock), 0);
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, b_sock), 0);
  UniqueFd guard[4] = {UniqueFd(a_sock[0]), UniqueFd(a_sock[1]), UniqueFd(b_sock[0]),
                       UniqueFd(b_sock[1])};
  TlsStream a(*ca, false), b(*cb, true);
  std::string why;
  for (int i = 0; i < 20 && !(a.established() && b.established()); ++i) {
    ASSERT_GE(a.handshake(why), 0) << why;
    a.push(a_sock[0]);
    relay(a_sock[1], b_sock[1]);
    b.pull(b_sock[0]);
    ASSERT_GE(b.handshake(why), 0) << why;
    b.push(b_sock[0]);
    relay(b_sock[1], a_sock[1]);
    a.pull(a_sock[0]);
  }
  ASSERT_TRUE(a.established() && b.established());
  EXPECT_EQ(a.peer_name(), "node-b");
  EXPECT_EQ(b.peer_name(), "node-a");
  // An intact record arrives as sent.
  const char msg[] = "a frame of the wire protocol";
  ASSERT_EQ(a.write(msg, sizeof(msg), why), static_cast<ssize_t>(sizeof(msg)));
  a.push(a_sock[0]);
  relay(a_sock[1], b_sock[1]);
  b.pull(b_sock[0]);
  char got[64] = {};
  ASSERT_EQ(b.read(got, sizeof(got), why), static_cast<ssize_t>(sizeof(msg))) << why;
  EXPECT_STREQ(got, msg);
  // One bit changed on the way (inside the encrypted body): refused, nothing returned.
  ASSERT_EQ(a.write(msg, sizeof(msg), why), static_cast<ssize_t>(sizeof(msg)));
  a.push(a_sock[0]);
  relay(a_sock[1], b_sock[1], 10);
  b.pull(b_sock[0]);
  std::memset(got, 0, sizeof(got));
  EXPECT_EQ(b.read(got, sizeof(got), why), -1);
  EXPECT_NE(why.find("forged or altered"), std::string::npos) << why;
  EXPECT_EQ(got[0], 0);
}

/// A TlsStream (node-a, the client) and a plain OpenSSL session (node-b) on a socket pair,
/// past their handshake: what the stream writes after it must be TLS 1.3's records.
struct OpenSslPeer {
  Cluster cl{"node-a", "node-b"};
  std::shared_ptr<const TlsContext> ca = cl.ctx("node-a"), cb = cl.ctx("node-b");
  int sv[2] = {-1, -1};
  std::unique_ptr<TlsStream> a;
  std::unique_ptr<SSL, void (*)(SSL*)> b{nullptr, SSL_free};
  std::string why;

  /// `suites`: what OpenSSL's side takes (SSL_set_ciphersuites), else what its context offers.
  explicit OpenSslPeer(const char* suites = nullptr) {
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
    a = std::make_unique<TlsStream>(*ca, false);
    b.reset(SSL_new(cb->get()));
    if (suites) {
      EXPECT_EQ(SSL_set_ciphersuites(b.get(), suites), 1);
    }
    SSL_set_fd(b.get(), sv[1]);
    SSL_set_accept_state(b.get());
    for (int i = 0; i < 50 && !(a->established() && SSL_is_init_finished(b.get())); ++i) {
      EXPECT_GE(a->handshake(why), 0) << why;
      a->push(sv[0]);
      SSL_do_handshake(b.get());
      a->pull(sv[0]);
    }
  }
  ~OpenSslPeer() {
    b.reset();
    ::close(sv[0]);
    ::close(sv[1]);
  }
  bool up() const { return a->established() && SSL_is_init_finished(b.get()); }
  /// Moves n bytes of p through the pair, a to b (to_b) or b to a: what arrived. `fault`:
  /// p is guest memory (TlsStream::write's), the address that faulted is put there.
  std::vector<uint8_t> move(const uint8_t* p, size_t n, bool to_b, uintptr_t* fault = nullptr) {
    std::vector<uint8_t> got(n);
    size_t put = 0, have = 0;
    for (int i = 0; i < 10000 && have < n; ++i) {
      if (to_b) {
        const ssize_t w = a->write(p + put, n - put, why, fault);
        EXPECT_GE(w, 0) << why;
        put += static_cast<size_t>(std::max<ssize_t>(w, 0));
        EXPECT_GE(a->push(sv[0]), 0);
        const int r = SSL_read(b.get(), got.data() + have, static_cast<int>(n - have));
        if (r > 0) have += static_cast<size_t>(r);
      } else {
        if (put < n) {
          const int w = SSL_write(b.get(), p + put, static_cast<int>(n - put));
          if (w > 0) put += static_cast<size_t>(w);
        }
        EXPECT_GE(a->pull(sv[0]), 0);
        const ssize_t r = a->read(got.data() + have, n - have, why);
        EXPECT_GE(r, 0) << why;
        have += static_cast<size_t>(std::max<ssize_t>(r, 0));
      }
    }
    got.resize(have);
    return got;
  }
};

// The stream seals and opens the records itself after the handshake (tls_record.h): they must
// be TLS 1.3's, so a plain OpenSSL session reads and writes them, KeyUpdates both ways included.
TEST(TlsStream, ItsRecordsAreStandardTls13) {
  OpenSslPeer x;
  ASSERT_TRUE(x.up());
  EXPECT_EQ(x.a->peer_name(), "node-b");
  std::vector<uint8_t> big(200 * 1024);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7 + i / 4096);
  EXPECT_TRUE(x.move(big.data(), big.size(), true) == big);
  EXPECT_TRUE(x.move(big.data(), big.size(), false) == big);
  // OpenSSL updates its keys and asks for ours: a takes the new keys, answers with its own
  // KeyUpdate, and what each writes after it is read by the other.
  ASSERT_EQ(SSL_key_update(x.b.get(), SSL_KEY_UPDATE_REQUESTED), 1);
  EXPECT_TRUE(x.move(big.data(), big.size(), false) == big);
  EXPECT_TRUE(x.move(big.data(), big.size(), true) == big);
  EXPECT_TRUE(x.move(big.data(), big.size(), false) == big);
}

// Records of every size around the block and batch boundaries of the AES-GCM code (ipsec-mb's
// 16-byte blocks and 16- and 48-block batches) and the largest, in each of TLS 1.3's suites
// (ipsec-mb's AES-GCM-128 and -256, OpenSSL's ChaCha20-Poly1305), both ways: OpenSSL's TLS
// reads ours and we read its.
TEST(TlsStream, RecordsOfEverySizeAreStandardTls13BothWaysInEverySuite) {
  for (const char* suite :
       {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}) {
    OpenSslPeer x(suite);
    ASSERT_TRUE(x.up()) << suite;
    EXPECT_STREQ(SSL_CIPHER_get_name(SSL_get_current_cipher(x.b.get())), suite);
    for (const size_t n : {1, 15, 16, 17, 100, 255, 256, 257, 511, 512, 513, 767, 768, 769, 4095,
                           4096, 4097, 16383, 16384, 16385, 40000}) {
      std::vector<uint8_t> msg(n);
      for (size_t i = 0; i < n; ++i) msg[i] = static_cast<uint8_t>(i * 13 + n);
      EXPECT_TRUE(x.move(msg.data(), n, true) == msg) << suite << ": " << n << " bytes to OpenSSL";
      EXPECT_TRUE(x.move(msg.data(), n, false) == msg) << suite << ": " << n << " bytes from it";
    }
  }
}

// Guest memory is sealed where it is, under a fault guard: a record whose bytes fault goes out
// as zeros (the stream stays whole), the others as they are.
TEST(TlsStream, AGuestFaultWhileSealingSendsZeros) {
  install_guest_fault_handler();
  OpenSslPeer x;
  ASSERT_TRUE(x.up());
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t good = 16384, len = 3 * 16384;
  void* m = ::mmap(nullptr, len + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  auto* p = static_cast<uint8_t*>(m);
  std::memset(p, 0x5a, len);
  // The second record's last page cannot be read.
  ASSERT_EQ(::mprotect(p + 2 * good - page, page, PROT_NONE), 0);
  uintptr_t fault = 0;
  const std::vector<uint8_t> got = x.move(p, len, true, &fault);
  ASSERT_EQ(got.size(), len);
  EXPECT_EQ(fault, reinterpret_cast<uintptr_t>(p + 2 * good - page));
  EXPECT_TRUE(std::all_of(got.begin(), got.begin() + good, [](uint8_t v) { return v == 0x5a; }));
  EXPECT_TRUE(
      std::all_of(got.begin() + good, got.begin() + 2 * good, [](uint8_t v) { return !v; }));
  EXPECT_TRUE(std::all_of(got.begin() + 2 * good, got.end(), [](uint8_t v) { return v == 0x5a; }));
  ::munmap(m, len + page);
}

TEST(TcpTransport, CredentialErrorsSayWhatToDo) {
  Cluster cl({"node-a"});
  auto wrong = TlsContext::load(TlsFiles::in_dir(cl.dir(), "node-a"), "node-b");
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_NE(wrong.status().message().find("names node \"node-a\""), std::string::npos)
      << wrong.status().message();
  ASSERT_EQ(::chmod((cl.dir() + "/node-a.key").c_str(), 0644), 0);
  auto open = TlsContext::load(TlsFiles::in_dir(cl.dir(), "node-a"), "node-a");
  ASSERT_FALSE(open.is_ok());
  EXPECT_NE(open.status().message().find("chmod 600"), std::string::npos)
      << open.status().message();
}

// ---- Connections on demand and idle close, plain and TLS.

/// A Recorder whose QPs use (or not) every peer: what the idle close asks the engine.
struct User final : Receiver {
  Recorder r;
  bool in_use = false;
  void on_frame(const std::string& n, const wire::Frame& f, RxSink& s) override {
    r.on_frame(n, f, s);
  }
  void on_frame_done(const std::string& n, const wire::Frame& f, RxSink& s) override {
    r.on_frame_done(n, f, s);
  }
  void on_peer_up(const std::string& n) override { r.on_peer_up(n); }
  void on_guest_located(const GuestInfo& g, const std::string& n) override {
    r.on_guest_located(g, n);
  }
  bool uses_peer(const std::string&) const override { return in_use; }
};

/// Two backends that know each other as a directory tells them (add_peer), no static peers.
struct Known {
  User ua, ub;
  std::unique_ptr<Cluster> cl;
  std::unique_ptr<TcpTransport> a, b;
  Known(bool tls, uint64_t idle_a_ms, uint64_t idle_b_ms) {
    if (tls) cl = std::make_unique<Cluster>(std::initializer_list<const char*>{"node-a", "node-b"});
    auto ta = TcpTransport::create(
        {"node-a", "127.0.0.1:0", {}, false, tls ? cl->ctx("node-a") : nullptr, idle_a_ms}, ua);
    auto tb = TcpTransport::create(
        {"node-b", "127.0.0.1:0", {}, false, tls ? cl->ctx("node-b") : nullptr, idle_b_ms}, ub);
    EXPECT_TRUE(ta.is_ok() && tb.is_ok());
    if (!ta.is_ok() || !tb.is_ok()) return;
    a = std::move(ta).value();
    b = std::move(tb).value();
    EXPECT_TRUE(a->add_peer("node-b", b->listen_address()).is_ok());
    EXPECT_TRUE(b->add_peer("node-a", a->listen_address()).is_ok());
  }
  bool run(auto done) { return run_until({a.get(), b.get()}, done); }
  /// Polls both for `ms` whatever happens.
  void idle(uint64_t ms) {
    for (uint64_t end = now_ns() + ms * 1000000; now_ns() < end;) {
      a->poll(now_ns());
      b->poll(now_ns());
    }
  }
};

bool offer(TcpTransport& t, const std::string& to, uint32_t n) {
  wire::DirectOffer o{};
  o.port = 1;
  o.src_qpn = n;
  return t.send(to, wire::Type::kDirectOffer, &o, {}, {}, 0);
}

/// src_qpn of every offer `r` received, sorted (frames on two connections may interleave).
std::vector<uint32_t> got(const Recorder& r) {
  std::vector<uint32_t> v;
  for (const auto& o : r.offers) v.push_back(o.offer.src_qpn);
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<uint32_t> upto(uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

class OnDemand : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(Security, OnDemand, ::testing::Values(false, true),
                         [](const auto& i) { return std::string(i.param ? "Tls" : "Plain"); });

// A directory's peer is not dialed until a frame is for it; that frame (and those after it)
// waits for the handshake and arrives. The other side dials nothing: it answers on the same
// connection. A node nobody knows is refused at once.
TEST_P(OnDemand, FirstFrameDialsAndWaitsForTheHandshake) {
  Known k(GetParam(), 0, 0);
  ASSERT_TRUE(k.a && k.b);
  k.idle(100);
  EXPECT_TRUE(k.a->connected().empty());
  EXPECT_EQ(k.a->counters().dials, 0u);
  EXPECT_EQ(k.a->known(), std::vector<std::string>{"node-b"});
  EXPECT_EQ(k.a->dials()[0].state, "idle");
  EXPECT_FALSE(offer(*k.a, "node-c", 0));
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE(offer(*k.a, "node-b", i));
  EXPECT_EQ(k.a->counters().dials, 1u);
  ASSERT_TRUE(k.run([&] { return k.ub.r.offers.size() == 3; }));
  EXPECT_EQ(got(k.ub.r), upto(3));
  ASSERT_TRUE(offer(*k.b, "node-a", 7));
  ASSERT_TRUE(k.run([&] { return k.ua.r.offers.size() == 1; }));
  EXPECT_EQ(k.b->counters().dials, 0u);
  EXPECT_EQ(k.a->connected(), std::vector<std::string>{"node-b"});
  EXPECT_EQ(k.b->connected(), std::vector<std::string>{"node-a"});
}

// A multicast group's datagram goes to every peer, not only those connected now: a known peer
// is among group_peers() before any connection, and after the first frame dialed it.
TEST_P(OnDemand, GroupPeersAreTheKnownOnesConnectedOrNot) {
  Known k(GetParam(), 0, 0);
  ASSERT_TRUE(k.a && k.b);
  k.idle(100);
  EXPECT_TRUE(k.a->connected().empty());
  EXPECT_EQ(k.a->group_peers(), std::vector<std::string>{"node-b"});
  ASSERT_TRUE(offer(*k.a, "node-b", 0));
  ASSERT_TRUE(k.run([&] { return k.ub.r.offers.size() == 1; }));
  EXPECT_EQ(k.a->group_peers(), std::vector<std::string>{"node-b"});
}

// A peer that does not answer: the frame is queued on the dial, the dial fails as a peer that
// is down does (not connected, the failure kept for status), and nothing is delivered.
TEST_P(OnDemand, DialToNobodyFailsAsAPeerThatIsDown) {
  Known k(GetParam(), 0, 0);
  ASSERT_TRUE(k.a);
  const std::string nobody = "127.0.0.1:" + std::to_string(free_port());
  ASSERT_TRUE(k.a->add_peer("node-c", nobody).is_ok());
  offer(*k.a, "node-c", 1);
  ASSERT_TRUE(k.run([&] { return k.a->dials().back().failures > 0; }));
  EXPECT_TRUE(k.a->connected().empty());
  EXPECT_NE(k.a->dials().back().state, "connected");
}

// Idle on both sides: one asks, the other accepts, both close (each counts it); nothing is
// connected; the next frame dials again and arrives.
TEST_P(OnDemand, IdleConnectionClosesByAgreementAndRedials) {
  Known k(GetParam(), 200, 0);
  ASSERT_TRUE(k.a && k.b);
  ASSERT_TRUE(offer(*k.a, "node-b", 0));
  ASSERT_TRUE(k.run([&] { return k.ub.r.offers.size() == 1; }));
  ASSERT_TRUE(k.run([&] { return k.a->connected().empty() && k.b->connected().empty(); }));
  EXPECT_EQ(k.a->counters().idle_closes, 1u);
  EXPECT_EQ(k.b->counters().idle_closes, 1u);
  k.idle(100);  // both ends' sockets are closed: nothing left open (no redial either)
  EXPECT_EQ(k.a->counters().dials, 1u);
  ASSERT_TRUE(offer(*k.b, "node-a", 1));  // now b dials
  ASSERT_TRUE(k.run([&] { return k.ua.r.offers.size() == 1; }));
  EXPECT_EQ(k.b->counters().dials, 1u);
  EXPECT_EQ(k.a->refused().frames + k.b->refused().frames, 0u);
}

// A QP on the other side uses the peer: it refuses, the connection stays; once it no longer
// does, the next ask is accepted.
TEST_P(OnDemand, PeerInUseRefusesTheClose) {
  Known k(GetParam(), 150, 0);
  ASSERT_TRUE(k.a && k.b);
  k.ub.in_use = true;
  ASSERT_TRUE(offer(*k.a, "node-b", 0));
  k.idle(700);  // several idle periods: each ask refused
  EXPECT_EQ(k.a->connected(), std::vector<std::string>{"node-b"});
  EXPECT_EQ(k.a->counters().idle_closes, 0u);
  // ... and this side's own QPs keep it too: nothing is asked at all.
  k.ub.in_use = false;
  k.ua.in_use = true;
  k.idle(400);
  EXPECT_EQ(k.a->connected(), std::vector<std::string>{"node-b"});
  k.ua.in_use = false;
  ASSERT_TRUE(k.run([&] { return k.a->connected().empty() && k.b->connected().empty(); }));
}

// The race: a frames after its ask (before the accept comes back), b frames it queued before
// reading the ask and frames it sends after accepting (on a new connection). Nothing is lost.
TEST_P(OnDemand, FramesAroundTheCloseAreNotLost) {
  Known k(GetParam(), 150, 0);
  ASSERT_TRUE(k.a && k.b);
  ASSERT_TRUE(offer(*k.a, "node-b", 1000));
  ASSERT_TRUE(k.run([&] { return k.ub.r.offers.size() == 1; }));
  ASSERT_TRUE(offer(*k.b, "node-a", 1000));
  ASSERT_TRUE(k.run([&] { return k.ua.r.offers.size() == 1; }));
  k.ua.r.offers.clear();
  k.ub.r.offers.clear();
  // Only a polls, past its idle time: its ask is on the wire, b has not read it.
  for (const uint64_t t0 = now_ns(); now_ns() - t0 < 400000000;) k.a->poll(now_ns());
  ASSERT_EQ(k.a->connected(), std::vector<std::string>{"node-b"});
  for (uint32_t i = 0; i < 50; ++i) ASSERT_TRUE(offer(*k.a, "node-b", i));  // after the ask
  for (uint32_t i = 0; i < 50; ++i) ASSERT_TRUE(offer(*k.b, "node-a", i));  // before reading it
  // b reads the ask and accepts; what it queued before goes first, on the old connection.
  k.b->poll(now_ns());
  for (uint32_t i = 50; i < 100; ++i) ASSERT_TRUE(offer(*k.b, "node-a", i));  // after the accept
  ASSERT_TRUE(k.run([&] {
    return k.ua.r.offers.size() == 100 && k.ub.r.offers.size() == 50 &&
           k.a->counters().idle_closes == 1;
  })) << k.ua.r.offers.size()
      << " " << k.ub.r.offers.size();
  EXPECT_EQ(got(k.ua.r), upto(100));
  EXPECT_EQ(got(k.ub.r), upto(50));
  EXPECT_EQ(k.b->counters().idle_closes, 1u);
  EXPECT_EQ(k.b->counters().dials, 1u);  // the frames after its accept went on a new connection
}

// Both sides dial at once (each one's first frame is for the other): two connections, and both
// keep the one the smaller node name dialed. Frames queued or in flight on the other one are
// not lost: it closes as an agreed close does (each side writes out what it queued there, shuts
// its side and reads until the other's), before and after the choice.
TEST_P(OnDemand, FramesOnTheDuplicateOfASimultaneousDialAreNotLost) {
  Known k(GetParam(), 0, 0);
  ASSERT_TRUE(k.a && k.b);
  for (uint32_t i = 0; i < 50; ++i) {
    ASSERT_TRUE(offer(*k.a, "node-b", i));
    ASSERT_TRUE(offer(*k.b, "node-a", i));
  }
  uint32_t n = 50;
  ASSERT_TRUE(k.run([&] {
    if (n < 100) {  // more frames while the two connections come up and one goes
      EXPECT_TRUE(offer(*k.a, "node-b", n));
      EXPECT_TRUE(offer(*k.b, "node-a", n));
      ++n;
    }
    return k.ua.r.offers.size() >= 100 && k.ub.r.offers.size() >= 100;
  })) << k.ua.r.offers.size()
      << " " << k.ub.r.offers.size();
  k.idle(100);
  EXPECT_EQ(got(k.ua.r), upto(100));
  EXPECT_EQ(got(k.ub.r), upto(100));
  EXPECT_EQ(k.a->counters().dials + k.b->counters().dials, 2u) << "both dialed";
  EXPECT_EQ(k.a->connected(), std::vector<std::string>{"node-b"});
  EXPECT_EQ(k.b->connected(), std::vector<std::string>{"node-a"});
}

// The embedded directory with static peers: they are dialed at start (their announcements are
// the directory) and close when idle like any connection; what they announced stays. A lookup
// that finds nothing dials the configured peers again, and their Hello brings what changed.
TEST_P(OnDemand, StaticPeersAreAskedAgainWhenALookupMisses) {
  std::unique_ptr<Cluster> cl;
  if (GetParam())
    cl = std::make_unique<Cluster>(std::initializer_list<const char*>{"node-a", "node-b"});
  User ua, ub;
  auto b = TcpTransport::create(
      {"node-b", "127.0.0.1:0", {}, false, cl ? cl->ctx("node-b") : nullptr, 0}, ub);
  ASSERT_TRUE(b.is_ok());
  auto a = TcpTransport::create({"node-a",
                                 "127.0.0.1:0",
                                 {"node-b@" + (*b)->listen_address()},
                                 false,
                                 cl ? cl->ctx("node-a") : nullptr,
                                 150},
                                ua);
  ASSERT_TRUE(a.is_ok());
  auto both = {a->get(), b->get()};
  GuestInfo g1{"g1", 0x11, {1}}, g2{"g2", 0x12, {2}};
  (*b)->announce(g1, true);
  ASSERT_TRUE(run_until(both, [&] { return (*a)->locate_lid(0x11) == "node-b"; }));
  ASSERT_TRUE(run_until(both, [&] { return (*a)->connected().empty(); }));
  EXPECT_EQ((*a)->dials()[0].state, "idle");
  EXPECT_EQ((*a)->locate_lid(0x11), "node-b");  // kept across the idle close
  (*b)->announce(g2, true);                     // no connection: not told
  ASSERT_TRUE(run_until(both, [&] { return (*a)->locate_lid(0x12) == "node-b"; }));
  EXPECT_EQ((*a)->counters().dials, 2u);
}

}  // namespace
}  // namespace vrdma::transport::tcp
