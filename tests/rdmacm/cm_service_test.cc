// The connection service (backend/cm.h) driven in-process: the CM commands' wire bodies, and the
// IB CM exchange between two stand-in sessions, each event read as one message from its
// channel's socket. The service knows a session by its id only (End gives each its own).
// Across hosts: a stand-in transport records what the service sends a peer backend, and the
// tests play that peer (a well-behaved one, then a hostile one).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "backend/cm.h"
#include "cm_test_end.h"
#include "engine/device.h"
#include "transport/transport.h"

namespace vrdma::backend {
namespace {

using namespace vrdma::proto;

TEST(CmWire, EveryCmOpcodeHasItsFixedBody) {
  const std::pair<Op, size_t> sizes[] = {
      {Op::kCmCreateChannel, 0},
      {Op::kCmDestroyChannel, sizeof(HandleReq)},
      {Op::kCmCreateId, sizeof(CmCreateIdReq)},
      {Op::kCmDestroyId, sizeof(HandleReq)},
      {Op::kCmBind, sizeof(CmAddrReq)},
      {Op::kCmListen, sizeof(CmListenReq)},
      {Op::kCmResolveAddr, sizeof(CmResolveReq)},
      {Op::kCmResolveRoute, sizeof(CmResolveReq)},
      {Op::kCmConnect, sizeof(CmConnReq)},
      {Op::kCmAccept, sizeof(CmConnReq)},
      {Op::kCmReject, sizeof(CmConnReq)},
      {Op::kCmEstablish, sizeof(HandleReq)},
      {Op::kCmDisconnect, sizeof(HandleReq)},
      {Op::kCmMigrateId, sizeof(CmMigrateReq)},
      {Op::kCmJoinMcast, sizeof(CmAddrReq)},
      {Op::kCmLeaveMcast, sizeof(CmAddrReq)},
  };
  for (auto [op, size] : sizes) {
    SCOPED_TRACE(op_name(static_cast<uint16_t>(op)));
    EXPECT_TRUE(is_cm(op));
    EXPECT_EQ(request_body_size(op), size);
    std::vector<uint8_t> m(sizeof(MsgHeader) + size, 0x5a);
    const MsgHeader h{
        kMagic, kVersion, static_cast<uint16_t>(op), static_cast<uint32_t>(m.size()), 9, 0, 0};
    std::memcpy(m.data(), &h, sizeof(h));
    EXPECT_TRUE(decode_request(m).is_ok());
    m.push_back(0);
    std::memcpy(m.data() + offsetof(MsgHeader, length), &h.length, 4);
    EXPECT_FALSE(decode_request(m).is_ok());
  }
  EXPECT_FALSE(is_cm(Op::kDeregSegment));
  // Events go one way only: never a request.
  CmEvent e{};
  e.event = static_cast<uint32_t>(CmEventType::kRejected);
  e.status = kCmRejConsumer;
  e.private_len = 3;
  std::memcpy(e.private_data, "abc", 3);
  auto m = encode(Op::kCmEvent, 0, 0, e);
  EXPECT_EQ(decode_request(m).err(), EPROTO);
  ASSERT_TRUE(decode_header(m).is_ok());
  auto back = body_of<CmEvent>(m);
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(std::memcmp(&back.value(), &e, sizeof(e)), 0);
  EXPECT_EQ(op_name(static_cast<uint16_t>(Op::kCmEvent)), "cm_event");
}

TEST_F(CmServiceTest, ConnectAcceptEstablishDisconnect) {
  uint32_t c;
  const uint32_t s = request(&c);
  ASSERT_EQ(srv.conn(Op::kCmAccept, s, 0x34, "rep"), 0);
  CmEvent e = cli.next();
  EXPECT_EQ(e.event, ev(CmEventType::kConnectResponse));
  EXPECT_EQ(e.peer.qpn, 0x34u);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(e.private_data), e.private_len), "rep");
  EXPECT_TRUE(srv.quiet());
  ASSERT_EQ(cli.handle_cmd(Op::kCmEstablish, c), 0);
  EXPECT_EQ(srv.next().event, ev(CmEventType::kEstablished));
  // The one who disconnects hears DISCONNECTED too (its DREP); the other answers, hearing nothing.
  ASSERT_EQ(cli.handle_cmd(Op::kCmDisconnect, c), 0);
  EXPECT_EQ(cli.next().event, ev(CmEventType::kDisconnected));
  EXPECT_EQ(srv.next().event, ev(CmEventType::kDisconnected));
  ASSERT_EQ(srv.handle_cmd(Op::kCmDisconnect, s), 0);
  EXPECT_TRUE(srv.quiet());
  EXPECT_TRUE(cli.quiet());
  EXPECT_EQ(cli.handle_cmd(Op::kCmDestroyId, c), 0);
  EXPECT_EQ(srv.handle_cmd(Op::kCmDestroyId, s), 0);
  EXPECT_EQ(cm.ids(), 1u);  // the listener
}

TEST_F(CmServiceTest, NobodyListeningIsRejectedAtOnce) {
  const uint32_t c = cli.resolved(v4("127.0.0.1", 7001));
  ASSERT_EQ(cli.conn(Op::kCmConnect, c, 0x12), 0);
  CmEvent e = cli.next();
  EXPECT_EQ(e.event, ev(CmEventType::kRejected));
  EXPECT_EQ(e.status, kCmRejInvalidService);
  EXPECT_TRUE(srv.quiet());
}

TEST_F(CmServiceTest, RejectCarriesTheConsumersPrivateData) {
  uint32_t c;
  const uint32_t s = request(&c);
  ASSERT_EQ(srv.conn(Op::kCmReject, s, 0, "go away"), 0);
  CmEvent e = cli.next();
  EXPECT_EQ(e.event, ev(CmEventType::kRejected));
  EXPECT_EQ(e.status, kCmRejConsumer);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(e.private_data), e.private_len), "go away");
  // Nothing to accept any more.
  EXPECT_EQ(srv.conn(Op::kCmAccept, s, 0x34), -EINVAL);
}

TEST_F(CmServiceTest, APortInUseIsRefusedAndFreedWithItsSession) {
  const uint32_t other = cli.create_id();
  EXPECT_EQ(cli.bind(other, v4("127.0.0.1", 7000)), -EADDRINUSE);
  {
    End third{cm};
    const uint32_t id = third.create_id();
    EXPECT_EQ(third.bind(id, v4("127.0.0.1", 7002)), 0);
    EXPECT_EQ(cli.bind(other, v4("127.0.0.1", 7002)), -EADDRINUSE);
    cm.session_closed(&third.s);
  }
  EXPECT_EQ(cli.bind(other, v4("127.0.0.1", 7002)), 0);
  // Another session's id is not there for it.
  EXPECT_EQ(srv.handle_cmd(Op::kCmDestroyId, other), -ENOENT);
  // A port space is a namespace of its own.
  const uint32_t udp = cli.create_id(0x0111);
  EXPECT_EQ(cli.bind(udp, v4("127.0.0.1", 7000)), 0);
}

TEST_F(CmServiceTest, AnAddressNoBackendServesIsAnAddrErrorAfterTheTimeout) {
  const uint32_t c = cli.create_id();
  const int32_t st =
      cli.cmd(Op::kCmResolveAddr, CmResolveReq{c, 100, {}, v4("198.51.100.1", 7000)}).first;
  if (st == -ENETUNREACH) {
    GTEST_SKIP() << "no route to 198.51.100.1 here: refused at once, as the kernel does";
  }
  ASSERT_EQ(st, 0);
  EXPECT_TRUE(cli.quiet());  // a neighbour that may still answer
  // Asked again: one timer per id (the last one), however often.
  for (int i = 0; i < 3; ++i)
    ASSERT_EQ(cli.cmd(Op::kCmResolveAddr, CmResolveReq{c, 100, {}, v4("198.51.100.1", 7000)}).first,
              0);
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  cm.on_timer();
  CmEvent e = cli.next();
  EXPECT_EQ(e.event, ev(CmEventType::kAddrError));
  EXPECT_EQ(e.status, -ETIMEDOUT);
  EXPECT_TRUE(cli.quiet());
  EXPECT_EQ(cli.conn(Op::kCmConnect, c, 0x12), -EINVAL);  // never resolved
}

TEST_F(CmServiceTest, TimewaitExitFollowsEachEndsDisconnect) {
  const auto [c, s] = established();
  cli_disconnects(c);
  EXPECT_TRUE(srv.quiet());  // its timewait starts with its DREP
  ASSERT_EQ(srv.handle_cmd(Op::kCmDisconnect, s), 0);
  ASSERT_EQ(srv.handle_cmd(Op::kCmDisconnect, s), 0);  // once only
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  cm.on_timer();
  EXPECT_EQ(srv.next().event, ev(CmEventType::kTimewaitExit));
  EXPECT_TRUE(srv.quiet());
  EXPECT_TRUE(cli.quiet());
}

TEST_F(CmServiceTest, RequestsBeyondTheBacklogAreRejected) {
  ASSERT_EQ(srv.listen(listener, 2), 0);  // a new backlog
  uint32_t c1, c2;
  const uint32_t s1 = request(&c1);
  request(&c2);
  const uint32_t c3 = cli.resolved(v4("127.0.0.1", 7000));
  ASSERT_EQ(cli.conn(Op::kCmConnect, c3, 0x12), 0);
  CmEvent e = cli.next();
  EXPECT_EQ(e.event, ev(CmEventType::kRejected));
  EXPECT_EQ(e.status, kCmRejConsumer);
  EXPECT_TRUE(srv.quiet());
  // One accepted: room for the next.
  ASSERT_EQ(srv.conn(Op::kCmAccept, s1, 0x34), 0);
  EXPECT_EQ(cli.next().event, ev(CmEventType::kConnectResponse));
  ASSERT_EQ(cli.conn(Op::kCmConnect, c3, 0x12), 0);
  EXPECT_EQ(srv.next().event, ev(CmEventType::kConnectRequest));
}

TEST_F(CmServiceTest, AListenerThatDiesMidHandshakeLeavesNoOneWaiting) {
  uint32_t c1, c2;
  request(&c1);  // not answered yet
  const uint32_t s2 = request(&c2);
  ASSERT_EQ(srv.conn(Op::kCmAccept, s2, 0x34), 0);
  EXPECT_EQ(cli.next().event, ev(CmEventType::kConnectResponse));
  cm.session_closed(&srv.s);
  CmEvent e = cli.next();
  EXPECT_EQ(e.id, c1);
  EXPECT_EQ(e.event, ev(CmEventType::kRejected));
  EXPECT_EQ(e.status, kCmRejTimeout);
  e = cli.next();
  EXPECT_EQ(e.id, c2);
  EXPECT_EQ(e.event, ev(CmEventType::kDisconnected));
  EXPECT_EQ(cm.ports(), 2u);  // the two requesters' own ports; the listener's is free
}

TEST_F(CmServiceTest, ARequesterThatDiesAfterTheReplyMakesItUnreachable) {
  uint32_t c;
  const uint32_t s = request(&c);
  ASSERT_EQ(srv.conn(Op::kCmAccept, s, 0x34), 0);
  cm.session_closed(&cli.s);
  CmEvent e = srv.next();
  EXPECT_EQ(e.id, s);
  EXPECT_EQ(e.event, ev(CmEventType::kUnreachable));
  EXPECT_EQ(e.status, -ETIMEDOUT);
}

TEST_F(CmServiceTest, EventsThatFindTheChannelFullWaitForTheSessionsNextCommand) {
  const uint32_t c = cli.resolved(v4("127.0.0.1", 7001));  // nobody listens there
  constexpr int kEvents = 3000;                            // more than a socket's queue holds
  for (int i = 0; i < kEvents; ++i) ASSERT_EQ(cli.conn(Op::kCmConnect, c, 0x12), 0);
  auto drain = [&] {
    int n = 0;
    std::vector<uint8_t> buf(4096);
    while (::recv(cli.events.get(), buf.data(), buf.size(), MSG_DONTWAIT) > 0) ++n;
    return n;
  };
  int got = drain();
  EXPECT_LT(got, kEvents);
  for (int round = 0; round < 100 && got < kEvents; ++round) {
    EXPECT_EQ(cli.handle_cmd(Op::kCmDisconnect, 0xfffffff0u), -ENOENT);  // any command
    got += drain();
  }
  EXPECT_EQ(got, kEvents);
}

TEST_F(CmServiceTest, ASessionsIdsAreCapped) {
  uint32_t n = 0;
  for (; n < 20000; ++n) {
    auto [st, out] = cli.cmd(Op::kCmCreateId, CmCreateIdReq{cli.channel, 0x0106, 2, 0});
    if (st) {
      EXPECT_EQ(st, -ENOMEM);
      break;
    }
  }
  EXPECT_EQ(n, 16384u);
  // Its connects are its own business; other sessions' are not affected.
  End other{cm};
  EXPECT_EQ(other.cmd(Op::kCmCreateId, CmCreateIdReq{other.channel, 0x0106, 2, 0}).first, 0);
  cm.session_closed(&cli.s);
  EXPECT_EQ(cm.ids(), 2u);  // the listener and other's
}

TEST_F(CmServiceTest, AJoinGivesTheGroupsGidLidAndQkey) {
  const uint32_t id = cli.create_id(kCmPsUdp);
  const CmAddr group = v4("239.1.2.3", 0);
  EXPECT_EQ(cli.cmd(Op::kCmJoinMcast, CmAddrReq{id, 0, group}).first, -EINVAL);  // no address
  ASSERT_EQ(cli.cmd(Op::kCmResolveAddr, CmResolveReq{id, 1000, {}, group}).first, 0);
  EXPECT_EQ(cli.next().event, ev(CmEventType::kAddrResolved));
  EXPECT_EQ(cli.cmd(Op::kCmJoinMcast, CmAddrReq{id, 0, v4("10.1.2.3", 0)}).first, -EINVAL);
  ASSERT_EQ(cli.cmd(Op::kCmJoinMcast, CmAddrReq{id, 0, group}).first, 0);
  CmEvent e = cli.next();
  EXPECT_EQ(e.event, ev(CmEventType::kMulticastJoin));
  EXPECT_EQ(std::memcmp(e.dst.addr, group.addr, 4), 0);  // which join it answers
  const uint8_t mgid[16] = {0xff, 0x12, 0x40, 0x1b, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 239, 1, 2, 3};
  EXPECT_EQ(std::memcmp(e.peer.gid, mgid, 16), 0);
  EXPECT_GE(e.peer.lid, 0xc000);
  EXPECT_LT(e.peer.lid, 0xffff);
  EXPECT_EQ(e.peer.qpn, 0xffffffu);
  EXPECT_EQ(e.peer.qkey, 0x01234567u);
  EXPECT_EQ(cli.cmd(Op::kCmLeaveMcast, CmAddrReq{id, 0, group}).first, 0);
}

/// A stand-in for the backend-to-backend transport: what is sent to peer "b" (whose host is
/// 10.77.0.2) is kept for the test, which plays that backend.
struct FakeTransport : transport::Transport {
  std::string self_ = "a";
  std::vector<std::pair<std::string, wire::Cm>> sent;
  std::vector<std::string> refused;
  bool up = true;
  bool no_conn = false;  ///< send() finds no connection (one being replaced), the peer known
  const std::string& self() const override { return self_; }
  bool forced() const override { return false; }
  std::string locate_lid(uint16_t) const override { return {}; }
  std::string locate_gid(const uint8_t*) const override { return {}; }
  bool send(const std::string& node, wire::Type t, const void* body,
            std::span<const transport::Span>, std::span<const transport::Hold>, uint64_t) override {
    if (!up || no_conn) return false;
    EXPECT_EQ(t, wire::Type::kCm);
    wire::Cm m;
    std::memcpy(&m, body, sizeof(m));
    EXPECT_TRUE(wire::check_cm(m).is_ok());  // never anything a peer would refuse
    sent.emplace_back(node, m);
    return true;
  }
  void drop_flow(const std::string&, uint64_t) override {}
  uint64_t tx_unwritten(const std::string&, const transport::TxMark&) const override { return 0; }
  transport::TxMark tx_mark(const std::string&) const override { return {}; }
  bool tx_delivered(const std::string&, const transport::TxMark&) override { return true; }
  uint64_t tx_progress(const std::string&) override { return 0; }
  uint64_t tx_patience_ns(const std::string&) override { return 0; }
  uint64_t peer_recovery_ns(const std::string&) override { return 0; }
  bool peer_window_closed(const std::string&) override { return false; }
  bool rx_pending(const std::string&) override { return false; }
  void announce(const transport::GuestInfo&, bool) override {}
  uint32_t peer_ipv4(const std::string& node) const override {
    return node == "b" ? htonl(0x0a4d0002) : 0;
  }
  uint32_t local_ipv4(const std::string&) const override { return htonl(0x7f000001); }
  void refused_frame(const std::string& node, const std::string& why) override {
    refused.push_back(node + ": " + why);
  }
  wire::Cm take() {
    EXPECT_FALSE(sent.empty());
    if (sent.empty()) return {};
    wire::Cm m = sent.front().second;
    EXPECT_EQ(sent.front().first, "b");
    sent.erase(sent.begin());
    return m;
  }
};

/// An IPv4 address of this host other than loopback (what a peer's guests reach it by), or
/// family 0 when it has none.
CmAddr non_loopback_address(uint16_t port) {
  CmAddr a{};
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return a;
  for (ifaddrs* i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK))
      continue;
    a.family = AF_INET;
    a.port = port;
    std::memcpy(a.addr, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, 4);
    break;
  }
  ::freeifaddrs(ifs);
  return a;
}

struct CmAcrossHostsTest : CmServiceTest {
  FakeTransport t;
  CmAddr here{};  ///< where srv's second listener is: an address of this host, not loopback
  void SetUp() override {
    CmServiceTest::SetUp();
    here = non_loopback_address(7100);
    if (!here.family) GTEST_SKIP() << "no address here but loopback";
    const uint32_t l = srv.create_id();
    ASSERT_EQ(srv.bind(l, here), 0);
    ASSERT_EQ(srv.listen(l), 0);
    cm.set_transport(
        &t, [this] { return t.up ? std::vector<std::string>{"b"} : std::vector<std::string>{}; });
  }
  /// An id of cli resolved (address, then route) to b's address 10.77.0.2:PORT; 0 when this
  /// host has no route there (the test skips).
  uint32_t routed_to_b(uint16_t port) {
    const uint32_t c = cli.create_id();
    const int32_t st =
        cli.cmd(Op::kCmResolveAddr, CmResolveReq{c, 1000, {}, v4("10.77.0.2", port)}).first;
    if (st == -ENETUNREACH) return 0;
    EXPECT_EQ(st, 0);
    EXPECT_EQ(cli.next().event, ev(CmEventType::kAddrResolved));
    EXPECT_EQ(cli.cmd(Op::kCmResolveRoute, CmResolveReq{c, 1000, {}, {}}).first, 0);
    EXPECT_EQ(cli.next().event, ev(CmEventType::kRouteResolved));
    return c;
  }
  wire::Cm peer_msg(wire::CmKind k, uint32_t src_id, uint32_t dst_id) {
    wire::Cm m{};
    m.kind = static_cast<uint8_t>(k);
    m.qp_type = 2;
    m.ps = kCmPsTcp;
    m.src_id = src_id;
    m.dst_id = dst_id;
    m.src = v4("10.77.0.2", 40000);
    m.dst = here;
    m.qp.qpn = 0x77;
    return m;
  }
  /// Peer "b"'s id `from` connects to srv's listener: the new id here.
  uint32_t remote_request(uint32_t from, const std::string& pdata = "req") {
    wire::Cm m = peer_msg(wire::CmKind::kReq, from, 0);
    m.private_len = static_cast<uint32_t>(pdata.size());
    std::memcpy(m.private_data, pdata.data(), pdata.size());
    cm.on_wire("b", m);
    CmEvent e = srv.next();
    EXPECT_EQ(e.event, ev(CmEventType::kConnectRequest));
    EXPECT_EQ(e.peer.qpn, 0x77u);
    EXPECT_EQ(std::string(reinterpret_cast<char*>(e.private_data), e.private_len), pdata);
    EXPECT_EQ(e.dst.port, 40000);  // the requester's address, as it said
    return e.id;
  }
  /// Peer "b"'s id `from` connected to srv's listener and established: the id here.
  uint32_t remote_established(uint32_t from) {
    const uint32_t s = remote_request(from);
    EXPECT_EQ(srv.conn(Op::kCmAccept, s, 0x34, "rep"), 0);
    EXPECT_EQ(t.take().kind, uint8_t(wire::CmKind::kRep));
    cm.on_wire("b", peer_msg(wire::CmKind::kRtu, from, s));
    EXPECT_EQ(srv.next().event, ev(CmEventType::kEstablished));
    return s;
  }
};

TEST_F(CmAcrossHostsTest, APeersRequestIsAcceptedEstablishedAndDisconnected) {
  const uint32_t s = remote_request(901);
  ASSERT_EQ(srv.conn(Op::kCmAccept, s, 0x34, "rep"), 0);
  wire::Cm rep = t.take();
  EXPECT_EQ(rep.kind, uint8_t(wire::CmKind::kRep));
  EXPECT_EQ(rep.src_id, s);
  EXPECT_EQ(rep.dst_id, 901u);
  EXPECT_EQ(rep.qp.qpn, 0x34u);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(rep.private_data), rep.private_len), "rep");
  cm.on_wire("b", peer_msg(wire::CmKind::kRtu, 901, s));
  EXPECT_EQ(srv.next().event, ev(CmEventType::kEstablished));
  cm.on_wire("b", peer_msg(wire::CmKind::kDreq, 901, s));
  EXPECT_EQ(srv.next().event, ev(CmEventType::kDisconnected));
  EXPECT_TRUE(t.refused.empty());
}

TEST_F(CmAcrossHostsTest, ARequestToAPeerIsAnsweredFromThere) {
  // cli connects to "b"'s host: the REQ goes there; its REP comes back.
  const uint32_t c = routed_to_b(7174);
  if (!c) GTEST_SKIP() << "no route to 10.77.0.2 here";
  ASSERT_EQ(cli.conn(Op::kCmConnect, c, 0x12, "hello"), 0);
  wire::Cm req = t.take();
  EXPECT_EQ(req.kind, uint8_t(wire::CmKind::kReq));
  EXPECT_EQ(req.src_id, c);
  EXPECT_EQ(req.dst.port, 7174);
  EXPECT_EQ(req.private_len, 5u);
  // Only "b" may answer, and only as a REP to that id.
  cm.on_wire("c", peer_msg(wire::CmKind::kRep, 55, c));
  EXPECT_TRUE(cli.quiet());
  cm.on_wire("b", peer_msg(wire::CmKind::kRep, 55, c));
  CmEvent e = cli.next();
  EXPECT_EQ(e.event, ev(CmEventType::kConnectResponse));
  EXPECT_EQ(e.peer.qpn, 0x77u);
  ASSERT_EQ(cli.handle_cmd(Op::kCmEstablish, c), 0);
  EXPECT_EQ(t.take().kind, uint8_t(wire::CmKind::kRtu));
  // A second REP, or one from another of b's ids, changes nothing.
  cm.on_wire("b", peer_msg(wire::CmKind::kRep, 56, c));
  cm.on_wire("b", peer_msg(wire::CmKind::kRep, 55, c));
  EXPECT_TRUE(cli.quiet());
  // The process ends: b hears its id is gone.
  cm.session_closed(&cli.s);
  wire::Cm gone = t.take();
  EXPECT_EQ(gone.kind, uint8_t(wire::CmKind::kGone));
  EXPECT_EQ(gone.dst_id, 55u);
}

TEST_F(CmAcrossHostsTest, AnAddressOnlyAPeerKnowsIsAskedForAndResolvedThere) {
  // Not b's transport address (an IPv6 one, a second address of its host): the peers are
  // asked; b's answer resolves it to b, and the REQ goes there.
  const uint32_t c = cli.create_id();
  const CmAddr far = v4("10.77.0.9", 7174);
  const int32_t st = cli.cmd(Op::kCmResolveAddr, CmResolveReq{c, 1000, {}, far}).first;
  if (st == -ENETUNREACH) GTEST_SKIP() << "no route to 10.77.0.9 here";
  ASSERT_EQ(st, 0);
  EXPECT_TRUE(cli.quiet());
  wire::Cm q = t.take();
  EXPECT_EQ(q.kind, uint8_t(wire::CmKind::kAddrQuery));
  EXPECT_EQ(q.src_id, c);
  wire::Cm a = peer_msg(wire::CmKind::kAddrReply, 1, 0x7fffffff);  // nobody asked that
  a.dst = far;
  cm.on_wire("b", a);
  a.dst_id = c;
  a.dst = v4("10.77.0.8", 7174);  // another address than asked
  cm.on_wire("b", a);
  EXPECT_TRUE(cli.quiet());
  EXPECT_EQ(t.refused.size(), 1u);
  a.dst = far;
  cm.on_wire("b", a);
  ASSERT_EQ(cli.next().event, ev(CmEventType::kAddrResolved));
  cm.on_wire("c", a);  // a second answer (to a question asked again): late, not refused
  EXPECT_EQ(t.refused.size(), 1u);
  EXPECT_TRUE(cli.quiet());
  ASSERT_EQ(cli.cmd(Op::kCmResolveRoute, CmResolveReq{c, 1000, {}, {}}).first, 0);
  ASSERT_EQ(cli.next().event, ev(CmEventType::kRouteResolved));
  ASSERT_EQ(cli.conn(Op::kCmConnect, c, 0x12), 0);
  EXPECT_EQ(t.take().kind, uint8_t(wire::CmKind::kReq));  // to b
  // b asks whose an address is: this host answers for its own (not loopback), else silence.
  wire::Cm bq = peer_msg(wire::CmKind::kAddrQuery, 77, 0);
  cm.on_wire("b", bq);
  wire::Cm ans = t.take();
  EXPECT_EQ(ans.kind, uint8_t(wire::CmKind::kAddrReply));
  EXPECT_EQ(ans.dst_id, 77u);
  for (const char* other : {"192.0.2.1", "127.0.0.1"}) {
    bq.dst = v4(other, 7000);
    cm.on_wire("b", bq);
  }
  EXPECT_TRUE(t.sent.empty());
}

TEST_F(CmAcrossHostsTest, AQuestionNobodyAnsweredIsAskedAgainUntilTheTimeout) {
  const uint32_t c = cli.create_id();
  const CmAddr far = v4("10.77.0.9", 7174);
  const int32_t st = cli.cmd(Op::kCmResolveAddr, CmResolveReq{c, 1000, {}, far}).first;
  if (st == -ENETUNREACH) GTEST_SKIP() << "no route to 10.77.0.9 here";
  ASSERT_EQ(st, 0);
  EXPECT_EQ(t.take().kind, uint8_t(wire::CmKind::kAddrQuery));
  // The answer never came (the peer's connection was being replaced): asked again, no event.
  std::this_thread::sleep_for(std::chrono::milliseconds(CmService::kAddrAskMs + 10));
  cm.on_timer();
  EXPECT_TRUE(cli.quiet());
  wire::Cm again = t.take();
  EXPECT_EQ(again.kind, uint8_t(wire::CmKind::kAddrQuery));
  EXPECT_EQ(again.src_id, c);
  wire::Cm a = peer_msg(wire::CmKind::kAddrReply, 1, c);
  a.dst = far;
  cm.on_wire("b", a);
  ASSERT_EQ(cli.next().event, ev(CmEventType::kAddrResolved));
  cm.on_wire("b", a);  // the answer to the first question, late
  EXPECT_TRUE(cli.quiet());
  EXPECT_TRUE(t.refused.empty());
}

TEST_F(CmAcrossHostsTest, APeersOwnAddressResolvesOnceThePeerIsKnownAgain) {
  // b's transport address while no peer is known by name (its connection being replaced, the
  // dial that replaces it not answered yet): nobody to ask; resolved when b is back.
  t.up = false;
  const uint32_t c = cli.create_id();
  const int32_t st =
      cli.cmd(Op::kCmResolveAddr, CmResolveReq{c, 1000, {}, v4("10.77.0.2", 7174)}).first;
  if (st == -ENETUNREACH) GTEST_SKIP() << "no route to 10.77.0.2 here";
  ASSERT_EQ(st, 0);
  EXPECT_TRUE(cli.quiet());
  t.up = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(CmService::kAddrAskMs + 10));
  cm.on_timer();
  ASSERT_EQ(cli.next().event, ev(CmEventType::kAddrResolved));
  ASSERT_EQ(cli.cmd(Op::kCmResolveRoute, CmResolveReq{c, 1000, {}, {}}).first, 0);
  ASSERT_EQ(cli.next().event, ev(CmEventType::kRouteResolved));
  ASSERT_EQ(cli.conn(Op::kCmConnect, c, 0x12), 0);
  EXPECT_EQ(t.take().kind, uint8_t(wire::CmKind::kReq));  // to b
}

TEST_F(CmAcrossHostsTest, ARequestTheTransportCouldNotTakeIsOfferedAgain) {
  const uint32_t c = routed_to_b(7174);
  if (!c) GTEST_SKIP() << "no route to 10.77.0.2 here";
  // The connection to b is being replaced at this moment: the REQ waits, no event.
  t.no_conn = true;
  ASSERT_EQ(cli.conn(Op::kCmConnect, c, 0x12, "hello"), 0);
  EXPECT_TRUE(t.sent.empty());
  std::this_thread::sleep_for(std::chrono::milliseconds(CmService::kUnsentStepMs + 10));
  cm.on_timer();
  EXPECT_TRUE(cli.quiet());
  t.no_conn = false;
  std::this_thread::sleep_for(std::chrono::milliseconds(CmService::kUnsentStepMs + 10));
  cm.on_timer();
  wire::Cm req = t.take();
  EXPECT_EQ(req.kind, uint8_t(wire::CmKind::kReq));
  EXPECT_EQ(req.src_id, c);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(req.private_data), req.private_len), "hello");
  EXPECT_TRUE(t.sent.empty());  // once
  cm.on_wire("b", peer_msg(wire::CmKind::kRep, 55, c));
  EXPECT_EQ(cli.next().event, ev(CmEventType::kConnectResponse));
  // A backend that stays unreachable: UNREACHABLE after kUnsentTries offers.
  const uint32_t d = routed_to_b(7175);
  t.no_conn = true;
  ASSERT_EQ(cli.conn(Op::kCmConnect, d, 0x13), 0);
  for (uint32_t i = 0; i < CmService::kUnsentTries && cli.quiet(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(CmService::kUnsentStepMs + 5));
    cm.on_timer();
  }
  CmEvent e = cli.next();
  EXPECT_EQ(e.event, ev(CmEventType::kUnreachable));
  EXPECT_EQ(e.status, -ETIMEDOUT);
}

TEST_F(CmAcrossHostsTest, AnAddressNoPeerAnswersForIsAnAddrError) {
  const uint32_t c = cli.create_id();
  const int32_t st =
      cli.cmd(Op::kCmResolveAddr, CmResolveReq{c, 50, {}, v4("10.77.0.9", 7174)}).first;
  if (st == -ENETUNREACH) GTEST_SKIP() << "no route to 10.77.0.9 here";
  ASSERT_EQ(st, 0);
  EXPECT_EQ(t.take().kind, uint8_t(wire::CmKind::kAddrQuery));
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  cm.on_timer();
  CmEvent e = cli.next();
  EXPECT_EQ(e.event, ev(CmEventType::kAddrError));
  EXPECT_EQ(e.status, -ETIMEDOUT);
}

TEST_F(CmAcrossHostsTest, AHandshakeWithABackendThatWentIsUnreachable) {
  const uint32_t s = remote_request(901);
  ASSERT_EQ(srv.conn(Op::kCmAccept, s, 0x34), 0);
  t.take();
  t.up = false;  // no RTU will come
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  cm.on_timer();
  CmEvent e = srv.next();
  EXPECT_EQ(e.event, ev(CmEventType::kUnreachable));
  EXPECT_EQ(e.status, -ETIMEDOUT);
}

TEST_F(CmAcrossHostsTest, GarbageFromAPeerReachesNoId) {
  const uint32_t s = remote_request(901);
  // Ids that are not b's peers, or not there; kinds that do not fit the state.
  cm.on_wire("b", peer_msg(wire::CmKind::kRtu, 902, s));           // another of b's ids
  cm.on_wire("c", peer_msg(wire::CmKind::kRtu, 901, s));           // another backend
  cm.on_wire("b", peer_msg(wire::CmKind::kDreq, 901, listener));   // the listener itself
  cm.on_wire("b", peer_msg(wire::CmKind::kRtu, 901, s));           // RTU before any REP
  cm.on_wire("b", peer_msg(wire::CmKind::kSidrRep, 901, s));       // SIDR to a connected id
  cm.on_wire("b", peer_msg(wire::CmKind::kRep, 901, 0x7fffffff));  // no such id
  EXPECT_TRUE(srv.quiet());
  EXPECT_TRUE(cli.quiet());
  EXPECT_EQ(t.refused.size(), 4u);
  // The REP to an id not here is answered: that id is gone (b checks it is its peer's).
  wire::Cm gone = t.take();
  EXPECT_EQ(gone.kind, uint8_t(wire::CmKind::kGone));
  EXPECT_EQ(gone.src_id, 0x7fffffffu);
  EXPECT_EQ(gone.dst_id, 901u);
  // A request for an address of another host, a port nobody listens on, or loopback (a
  // listener there is this host's own, as a TCP one on 127.0.0.1): REJ, no id.
  const size_t ids = cm.ids();
  wire::Cm m = peer_msg(wire::CmKind::kReq, 903, 0);
  m.dst = v4("192.0.2.1", 7000);
  cm.on_wire("b", m);
  m = peer_msg(wire::CmKind::kReq, 904, 0);
  m.dst.port = 7999;
  cm.on_wire("b", m);
  m = peer_msg(wire::CmKind::kReq, 905, 0);
  m.dst = v4("127.0.0.1", 7000);
  cm.on_wire("b", m);
  for (uint32_t who : {903u, 904u, 905u}) {
    wire::Cm rej = t.take();
    EXPECT_EQ(rej.kind, uint8_t(wire::CmKind::kRej));
    EXPECT_EQ(rej.dst_id, who);
    EXPECT_EQ(rej.status, kCmRejInvalidService);
  }
  // A flood of requests fills the backlog (8), no more; the rest are rejected.
  for (uint32_t i = 0; i < 20; ++i) cm.on_wire("b", peer_msg(wire::CmKind::kReq, 1000 + i, 0));
  EXPECT_EQ(cm.ids(), ids + 7);  // with s, 8 pending
  for (int i = 0; i < 7; ++i) EXPECT_EQ(srv.next().event, ev(CmEventType::kConnectRequest));
  EXPECT_TRUE(srv.quiet());
  ASSERT_EQ(t.sent.size(), 13u);
  for (int i = 0; i < 13; ++i) EXPECT_EQ(t.take().status, kCmRejConsumer);
  // The first request is still b's and still works.
  ASSERT_EQ(srv.conn(Op::kCmAccept, s, 0x34), 0);
  EXPECT_EQ(t.take().kind, uint8_t(wire::CmKind::kRep));
}

}  // namespace
}  // namespace vrdma::backend

namespace vrdma::backend {
namespace {

/// Live migration: srv's session, connected to peer "b", moves from this backend ("a") to
/// another ("c"): its ids keep their handles there, "b" is told (kMoved), and the connection
/// goes on there (b's DREQ gives DISCONNECTED on the channel the guest already reads).
TEST_F(CmAcrossHostsTest, AConnectedIdMovesWithItsGuestAndItsPeerIsTold) {
  const uint32_t s = remote_established(901);

  std::vector<int> fds;
  const std::string state = cm.export_sessions({{srv.s.id, 4242}}, fds);
  ASSERT_EQ(fds.size(), 1u);  // srv's one channel
  std::vector<UniqueFd> moved;
  for (int f : fds) moved.emplace_back(::fcntl(f, F_DUPFD_CLOEXEC, 0));
  const size_t ids_before = cm.ids();

  CmService to;
  FakeTransport tt;
  tt.self_ = "c";
  to.set_transport(&tt, [] { return std::vector<std::string>{"b"}; });
  // Anything but what export gave is refused, and takes nothing in.
  std::vector<UniqueFd> none;
  EXPECT_FALSE(to.import_sessions("{\"version\":2}", none, {{4242, 77}}).is_ok());
  EXPECT_FALSE(to.import_sessions(state, moved, {{4243, 77}}).is_ok());
  EXPECT_EQ(to.ids(), 0u);
  ASSERT_TRUE(to.import_sessions(state, moved, {{4242, 77}}).is_ok());
  cm.session_moved(&srv.s);
  EXPECT_EQ(cm.ids(), ids_before - 3);  // srv's two listeners and its connected id
  EXPECT_EQ(cm.ports(), 0u);
  EXPECT_EQ(to.ids(), 3u);
  EXPECT_EQ(to.ports(), 2u);
  ASSERT_EQ(tt.sent.size(), 1u);
  wire::Cm mv = tt.take();
  EXPECT_EQ(mv.kind, uint8_t(wire::CmKind::kMoved));
  EXPECT_EQ(mv.src_id, s);
  EXPECT_EQ(mv.dst_id, 901u);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(mv.private_data), mv.private_len), "a");
  // Only its peer's backend may go on with the id there; the old one hears nothing here now.
  to.on_wire("a", peer_msg(wire::CmKind::kDreq, 901, s));
  EXPECT_EQ(tt.refused.size(), 1u);
  to.on_wire("b", peer_msg(wire::CmKind::kDreq, 901, s));
  EXPECT_EQ(srv.next().event, ev(CmEventType::kDisconnected));
  // A second import of the same handles is refused.
  std::vector<UniqueFd> again;
  for (int f : fds) again.emplace_back(::fcntl(f, F_DUPFD_CLOEXEC, 0));
  EXPECT_FALSE(to.import_sessions(state, again, {{4242, 78}}).is_ok());
}

/// An id whose address resolution was under way moves with it: the new backend asks again, and
/// the answer gives ADDR_RESOLVED on the channel the guest reads (before, the move dropped the
/// resolution's timer and the guest waited for an event that never came).
TEST_F(CmAcrossHostsTest, AnAddressResolutionUnderWayMovesWithItsGuest) {
  const uint32_t c = cli.create_id();
  const CmAddr far = v4("10.77.0.9", 7174);
  const int32_t st = cli.cmd(Op::kCmResolveAddr, CmResolveReq{c, 5000, {}, far}).first;
  if (st == -ENETUNREACH) GTEST_SKIP() << "no route to 10.77.0.9 here";
  ASSERT_EQ(st, 0);
  EXPECT_EQ(t.take().kind, uint8_t(wire::CmKind::kAddrQuery));

  std::vector<int> fds;
  const std::string state = cm.export_sessions({{cli.s.id, 4343}}, fds);
  ASSERT_EQ(fds.size(), 1u);
  std::vector<UniqueFd> moved;
  for (int f : fds) moved.emplace_back(::fcntl(f, F_DUPFD_CLOEXEC, 0));
  CmService to;
  FakeTransport tt;
  tt.self_ = "c";
  to.set_transport(&tt, [] { return std::vector<std::string>{"b"}; });
  ASSERT_TRUE(to.import_sessions(state, moved, {{4343, 78}}).is_ok());
  cm.session_moved(&cli.s);
  // The source's answer comes too late for it; the new backend asks at once.
  wire::Cm a = peer_msg(wire::CmKind::kAddrReply, 1, c);
  a.dst = far;
  cm.on_wire("b", a);
  to.on_timer();
  wire::Cm q = tt.take();
  EXPECT_EQ(q.kind, uint8_t(wire::CmKind::kAddrQuery));
  EXPECT_EQ(q.src_id, c);
  EXPECT_TRUE(cli.quiet());
  to.on_wire("b", a);
  ASSERT_EQ(cli.next().event, ev(CmEventType::kAddrResolved));
  EXPECT_TRUE(tt.refused.empty());
}

/// The peer's side of a move: kMoved from the new node re-points an id only when it faced the
/// node the message names and its peer is the id named.
TEST_F(CmAcrossHostsTest, AMovedPeerIsFollowedOnlyWhenItIsThePeer) {
  const uint32_t s = remote_established(901);
  auto moved = [&](uint32_t from, const char* left) {
    wire::Cm m = peer_msg(wire::CmKind::kMoved, from, s);
    m.private_len = static_cast<uint32_t>(std::strlen(left));
    std::memcpy(m.private_data, left, m.private_len);
    EXPECT_TRUE(wire::check_cm(m).is_ok());
    cm.on_wire("c", m);
  };
  moved(902, "b");  // not its peer
  moved(901, "x");  // not where its peer was
  EXPECT_EQ(t.refused.size(), 2u);
  moved(901, "b");
  EXPECT_EQ(t.refused.size(), 2u);
  cm.on_wire("b", peer_msg(wire::CmKind::kDreq, 901, s));  // "b" is no longer its peer's node
  EXPECT_EQ(t.refused.size(), 3u);
  EXPECT_TRUE(srv.quiet());
  cm.on_wire("c", peer_msg(wire::CmKind::kDreq, 901, s));
  EXPECT_EQ(srv.next().event, ev(CmEventType::kDisconnected));
}

}  // namespace
}  // namespace vrdma::backend
