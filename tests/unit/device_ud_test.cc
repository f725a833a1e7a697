// UD in the device model: datagrams reach the QP their address names (by LID or GID), carry the
// 40-byte GRH room, check the qkey, and are lost (never duplicated or misdelivered) when there
// is no receive, a wrong qkey, or no such QP. Multicast: a datagram to a group reaches every
// attached QP of the backend, and goes once to every peer backend, which delivers it to its own
// members only (device_mcast.cc; a stand-in transport plays the peer).
#include <arpa/inet.h>
#include <sys/stat.h>

#include "loopback_fixture.h"

namespace vrdma::engine::devtest {
namespace {

class DeviceUdTest : public DeviceTest {
 protected:
  UdDest to_lid(const G& g) {
    UdDest d{};
    d.dlid = static_cast<uint16_t>(g.hello.lid);
    return d;
  }
};

TEST_F(DeviceUdTest, DatagramByLidLandsAfterTheGrhRoom) {
  QpV ua = ud_qp(a_, acq_, 0x11), ub = ud_qp(b_, bcq_, 0x11);
  std::memset(ma_.p(), 'x', 100);
  std::memset(mb_.p(), 0, 4096);
  post_recv(ub, 1, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, 2, ma_.addr, 100, ma_.mr.lkey, to_lid(b_), ub.qpn, 0x11, IBV_WR_SEND_WITH_IMM);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].byte_len, 140u) << "byte_len counts the 40 GRH bytes";
  EXPECT_EQ(rx[0].src_qp, ua.qpn);
  EXPECT_EQ(rx[0].slid, a_.hello.lid);
  EXPECT_EQ(rx[0].wc_flags & IBV_WC_GRH, 0u);
  EXPECT_TRUE(rx[0].wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(mb_.p()[39], 0) << "no GRH written without one";
  EXPECT_EQ(mb_.p()[40], 'x');
  EXPECT_EQ(mb_.p()[139], 'x');
  EXPECT_EQ(mb_.p()[140], 0);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
}

TEST_F(DeviceUdTest, DatagramByGidCarriesAGrh) {
  QpV ua = ud_qp(a_, acq_, 7), ub = ud_qp(b_, bcq_, 7);
  post_recv(ub, 1, mb_.addr, 1024, mb_.mr.lkey);
  UdDest d{};
  d.is_global = 1;
  std::memcpy(d.dgid, b_.hello.gid, 16);
  post_ud(ua, 2, ma_.addr, 8, ma_.mr.lkey, d, ub.qpn, 7);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_TRUE(rx[0].wc_flags & IBV_WC_GRH);
  EXPECT_EQ(mb_.p()[0] >> 4, 6) << "IP version 6";
  EXPECT_EQ(std::memcmp(mb_.p() + 8, a_.hello.gid, 16), 0) << "source GID";
  EXPECT_EQ(std::memcmp(mb_.p() + 24, b_.hello.gid, 16), 0) << "destination GID";
}

TEST_F(DeviceUdTest, WrongQkeyNoReceiveOrNoQpLosesTheDatagramOnly) {
  QpV ua = ud_qp(a_, acq_, 5), ub = ud_qp(b_, bcq_, 5);
  post_ud(ua, 1, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 5);  // no receive posted
  dev_.poll(now_);
  post_recv(ub, 9, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, 2, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 6);       // wrong qkey
  post_ud(ua, 3, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn + 99, 5);  // no such QP
  dev_.poll(now_);
  EXPECT_TRUE(drain(bcq_).empty());
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 3u);
  for (const Cqe& c : tx) EXPECT_EQ(c.status, IBV_WC_SUCCESS) << "UD senders are not told";
  // The receive is still there for the next good datagram; the qkey's high bit means "mine".
  post_ud(ua, 4, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 0x80000000u);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 9u);
}

TEST_F(DeviceUdTest, ReceiveTooSmallForGrhAndPayloadIsALengthError) {
  QpV ua = ud_qp(a_, acq_, 1), ub = ud_qp(b_, bcq_, 1);
  post_recv(ub, 1, mb_.addr, 60, mb_.mr.lkey);
  post_ud(ua, 2, ma_.addr, 30, ma_.mr.lkey, to_lid(b_), ub.qpn, 1);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_LEN_ERR);
}

TEST_F(DeviceUdTest, MessageLongerThanTheMtuFailsLocally) {
  QpV ua = ud_qp(a_, acq_, 1), ub = ud_qp(b_, bcq_, 1);
  post_recv(ub, 1, mb_.addr, 8192, mb_.mr.lkey);
  post_ud(ua, 2, ma_.addr, 4097, ma_.mr.lkey, to_lid(b_), ub.qpn, 1);
  dev_.poll(now_);
  EXPECT_TRUE(drain(bcq_).empty());
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_LEN_ERR);
}

TEST_F(DeviceUdTest, UdCannotRdmaWrite) {
  QpV ua = ud_qp(a_, acq_, 1), ub = ud_qp(b_, bcq_, 1);
  post_ud(ua, 2, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 1, IBV_WR_RDMA_WRITE);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_QP_OP_ERR);
}

TEST_F(DeviceUdTest, MulticastReachesEveryAttachedQpAndNoOther) {
  QpV ua = ud_qp(a_, acq_, 9), ub = ud_qp(b_, bcq_, 9), ub2 = ud_qp(b_, bcq_, 9);
  McastReq m{ub.handle, 0xc001, 0, {0xff, 0x12, 0x40, 0x1b}};
  m.gid[15] = 3;
  ASSERT_TRUE(dev_.attach_mcast(*b_.s, m).is_ok());
  ASSERT_TRUE(dev_.attach_mcast(*b_.s, m).is_ok());  // again: no second delivery
  // Not UD, not a multicast GID, no QP of the session: refused.
  QpV rc = create_qp(b_, qp_req(b_, bcq_, bcq_, IBV_QPT_RC));
  EXPECT_EQ(dev_.attach_mcast(*b_.s, McastReq{rc.handle, 0xc001, 0, {0xff}}).err(), EINVAL);
  EXPECT_EQ(dev_.attach_mcast(*b_.s, McastReq{ub2.handle, 0xc001, 0, {0xfe}}).err(), EINVAL);
  EXPECT_EQ(dev_.attach_mcast(*a_.s, McastReq{0x7777, 0xc001, 0, {0xff}}).err(), EINVAL);
  post_recv(ub, 1, mb_.addr, 1024, mb_.mr.lkey);
  post_recv(ub2, 2, mb_.addr + 1024, 1024, mb_.mr.lkey);
  UdDest d{};
  d.is_global = 1;
  std::memcpy(d.dgid, m.gid, 16);
  post_ud(ua, 3, ma_.addr, 8, ma_.mr.lkey, d, 0xffffff, 9);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 1u);
  EXPECT_TRUE(rx[0].wc_flags & IBV_WC_GRH);
  EXPECT_EQ(drain(acq_).size(), 1u);
  // By its LID too; after a detach, nobody.
  d = {};
  d.dlid = 0xc001;
  post_recv(ub, 4, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, 5, ma_.addr, 8, ma_.mr.lkey, d, 0xffffff, 9);
  dev_.poll(now_);
  EXPECT_EQ(drain(bcq_).size(), 1u);
  ASSERT_TRUE(dev_.detach_mcast(*b_.s, m).is_ok());
  EXPECT_EQ(dev_.detach_mcast(*b_.s, m).err(), EINVAL);
  post_recv(ub, 7, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, 6, ma_.addr, 8, ma_.mr.lkey, d, 0xffffff, 9);
  dev_.poll(now_);
  EXPECT_TRUE(drain(bcq_).empty());
  EXPECT_EQ(drain(acq_).size(), 2u);  // sent, whatever happens
}

/// Peer backend "h2" as a stand-in transport: what is sent to it is recorded; the guest with
/// kRemoteGid / kRemoteLid is its own. Connected: h2, and this node itself (as when TCP is
/// forced), which a group's datagram must skip.
class PeerH2 final : public RecordingTransport {
 public:
  static constexpr uint8_t kRemoteGid[16] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2};
  static constexpr uint16_t kRemoteLid = 0x77;
  const std::string& self() const override { return self_; }
  bool forced() const override { return false; }
  std::string locate_lid(uint16_t lid) const override { return lid == kRemoteLid ? h2_ : ""; }
  std::string locate_gid(const uint8_t* gid) const override {
    return std::memcmp(gid, kRemoteGid, 16) == 0 ? h2_ : "";
  }
  uint32_t peer_ipv4(const std::string&) const override { return 0; }
  uint32_t local_ipv4(const std::string&) const override { return 0; }
  void refused_frame(const std::string& node, const std::string&) override {
    refused.push_back(node);
  }
  std::vector<std::string> connected() const override { return {self_, h2_}; }
  std::vector<std::string> refused;  ///< the nodes refused_frame was told of

 private:
  const std::string& to() const override { return h2_; }
  std::string self_ = "h1", h2_ = "h2";
};

class DeviceMcastPeerTest : public DeviceUdTest {
 protected:
  void SetUp() override {
    dev_.set_transport(&peer_);
    DeviceUdTest::SetUp();
    m_.lid = 0xc001;
    m_.gid[0] = 0xff;
    m_.gid[1] = 0x12;
    m_.gid[15] = 3;
  }
  void TearDown() override { dev_.set_transport(nullptr); }
  /// A datagram from h2's guest to the group (by GID, or by LID), as h2's backend sends it.
  RecordingTransport::Sent from_h2(uint32_t qkey, const std::string& text, bool by_gid = true,
                                   const uint8_t* sgid = PeerH2::kRemoteGid) {
    wire::Request rq{};
    std::memcpy(rq.sgid, sgid, 16);
    rq.slid = PeerH2::kRemoteLid;
    rq.is_global = by_gid;
    if (by_gid) std::memcpy(rq.dgid, m_.gid, 16);
    rq.dlid = by_gid ? 0 : m_.lid;
    rq.qp_type = IBV_QPT_UD;
    rq.src_qpn = 0x55;
    rq.dst_qpn = 0xffffff;
    rq.opcode = IBV_WR_SEND;
    rq.length = static_cast<uint32_t>(text.size());
    rq.qkey = qkey;
    RecordingTransport::Sent s;
    s.payload.assign(text.begin(), text.end());
    wire::encode(wire::Type::kRequest, &rq, rq.length, s.bytes);
    return s;
  }
  PeerH2 peer_;
  McastReq m_{};
};

TEST_F(DeviceMcastPeerTest, AGroupDatagramGoesOnceToEveryPeerBackend) {
  QpV ua = ud_qp(a_, acq_, 9), ub = ud_qp(b_, bcq_, 9);
  m_.qp = ub.handle;
  ASSERT_TRUE(dev_.attach_mcast(*b_.s, m_).is_ok());
  post_recv(ub, 1, mb_.addr, 1024, mb_.mr.lkey);
  std::memcpy(ma_.p(), "to all!!", 8);
  UdDest d{};
  d.is_global = 1;
  std::memcpy(d.dgid, m_.gid, 16);
  post_ud(ua, 2, ma_.addr, 8, ma_.mr.lkey, d, 0xffffff, 0x80000000u);  // the QP's own qkey
  dev_.poll(now_);
  EXPECT_EQ(drain(bcq_).size(), 1u) << "the member here";
  EXPECT_EQ(drain(acq_).size(), 1u) << "sent at once: remote members are not waited for";
  // One copy to h2 (none to this node itself), with the group, the qkey and the data.
  ASSERT_EQ(peer_.q.size(), 1u);
  wire::FrameHeader h;
  std::memcpy(&h, peer_.q[0].bytes.data(), sizeof(h));
  wire::Frame f;
  ASSERT_TRUE(wire::decode(h, {peer_.q[0].bytes.data() + sizeof(h), h.body}, f).is_ok());
  ASSERT_EQ(f.type(), wire::Type::kRequest);
  EXPECT_EQ(std::memcmp(f.req.dgid, m_.gid, 16), 0);
  EXPECT_EQ(std::memcmp(f.req.sgid, a_.hello.gid, 16), 0);
  EXPECT_EQ(f.req.qkey, 9u);
  EXPECT_EQ(f.req.src_qpn, ua.qpn);
  EXPECT_EQ(std::string(peer_.q[0].payload.begin(), peer_.q[0].payload.end()), "to all!!");
  // No member here: it still goes to the peers (which may have some); none connected: lost.
  ASSERT_TRUE(dev_.detach_mcast(*b_.s, m_).is_ok());
  post_ud(ua, 3, ma_.addr, 8, ma_.mr.lkey, d, 0xffffff, 9);
  dev_.poll(now_);
  EXPECT_EQ(peer_.q.size(), 2u);
  peer_.up = false;
  post_ud(ua, 4, ma_.addr, 8, ma_.mr.lkey, d, 0xffffff, 9);
  dev_.poll(now_);
  EXPECT_EQ(peer_.q.size(), 2u);
  EXPECT_EQ(drain(acq_).size(), 2u);
  EXPECT_TRUE(drain(bcq_).empty());
}

TEST_F(DeviceMcastPeerTest, APeersGroupDatagramReachesMembersHereOnlyAndGoesNoFurther) {
  QpV ua = ud_qp(a_, acq_, 9), ub = ud_qp(b_, bcq_, 9), ub2 = ud_qp(b_, bcq_, 10);
  m_.qp = ub.handle;
  ASSERT_TRUE(dev_.attach_mcast(*b_.s, m_).is_ok());
  m_.qp = ub2.handle;  // another qkey: not for it
  ASSERT_TRUE(dev_.attach_mcast(*b_.s, m_).is_ok());
  post_recv(ua, 1, ma_.addr, 1024, ma_.mr.lkey);  // not a member
  post_recv(ub, 2, mb_.addr, 1024, mb_.mr.lkey);
  post_recv(ub2, 3, mb_.addr + 1024, 1024, mb_.mr.lkey);
  std::memset(mb_.p(), 0, 2048);
  auto s = from_h2(9, "hello from h2");
  deliver(s, dev_, "h2");
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 2u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].byte_len, 40u + 13u);
  EXPECT_EQ(rx[0].src_qp, 0x55u);
  EXPECT_TRUE(rx[0].wc_flags & IBV_WC_GRH);
  EXPECT_EQ(std::memcmp(mb_.p() + 8, PeerH2::kRemoteGid, 16), 0) << "the GRH's source GID";
  EXPECT_EQ(std::memcmp(mb_.p() + 40, "hello from h2", 13), 0);
  EXPECT_TRUE(drain(acq_).empty()) << "not a member";
  EXPECT_TRUE(peer_.q.empty()) << "never sent on";
  // By the group's LID too.
  post_recv(ub, 4, mb_.addr, 1024, mb_.mr.lkey);
  s = from_h2(9, "by lid", false);
  deliver(s, dev_, "h2");
  EXPECT_EQ(drain(bcq_).size(), 1u);
  EXPECT_TRUE(peer_.refused.empty());
  // Not from h2's own guest (one of ours, or its claim made by another node), or from this
  // node itself: refused, delivered to nobody.
  post_recv(ub, 5, mb_.addr, 1024, mb_.mr.lkey);
  s = from_h2(9, "spoofed", true, a_.hello.gid);
  deliver(s, dev_, "h2");
  s = from_h2(9, "not h3's guest");
  deliver(s, dev_, "h3");
  s = from_h2(9, "looped");
  deliver(s, dev_, "h1");
  EXPECT_EQ(peer_.refused, (std::vector<std::string>{"h2", "h3", "h1"}));
  // A group nobody here is in: dropped quietly (every peer gets every group's datagrams).
  m_.gid[15] = 4;
  s = from_h2(9, "other group");
  deliver(s, dev_, "h2");
  EXPECT_EQ(peer_.refused.size(), 3u);
  EXPECT_TRUE(drain(bcq_).empty());
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_TRUE(peer_.q.empty());
}

// The direct path for UD (kDirectGrantUd): a grant per destination, with the same checks as
// RC's and the qkeys the library checks a WR against.
TEST_F(DeviceUdTest, DirectGrantIsPerDestinationWithTheQkeys) {
  dev_.set_direct(true);
  dev_.set_direct_trust(true, {});  // one uid is enough here; the proofs have their own tests
  a_.s->uid = b_.s->uid = ::getuid();
  QpV ua = ud_qp(a_, acq_, 5), ub = ud_qp(b_, bcq_, 7);
  std::vector<UniqueFd> fds;
  std::string peer;
  DirectUdReq req{ua.handle, ub.qpn, to_lid(b_)};
  auto g = dev_.direct_grant_ud(*a_.s, req, fds, peer);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  EXPECT_EQ(g.value().peer_qkey, 7u);
  EXPECT_EQ(g.value().my_qkey, 5u);
  EXPECT_NE(g.value().lock_tag, 0u);
  EXPECT_NE(g.value().lock_tag, kRxLockBackend);
  EXPECT_EQ(g.value().grant.peer_qpn, ub.qpn);
  EXPECT_EQ(peer, "b");
  EXPECT_GE(fds.size(), kDirectFixedFds);
  // By GID too; not to a QP that is not there, not to a group, not for another type.
  req.dest.is_global = 1;
  std::memcpy(req.dest.dgid, b_.hello.gid, 16);
  EXPECT_TRUE(dev_.direct_grant_ud(*a_.s, req, fds, peer).is_ok());
  req.remote_qpn = ub.qpn + 100;
  EXPECT_EQ(dev_.direct_grant_ud(*a_.s, req, fds, peer).status().err(), EAGAIN);
  req.remote_qpn = ub.qpn;
  req.dest.dgid[0] = 0xff;  // multicast
  EXPECT_EQ(dev_.direct_grant_ud(*a_.s, req, fds, peer).status().err(), EOPNOTSUPP);
  QpV rc = create_qp(a_, qp_req(a_, acq_, acq_, IBV_QPT_RC));
  DirectUdReq from_rc{rc.handle, ub.qpn, to_lid(b_)};
  EXPECT_EQ(dev_.direct_grant_ud(*a_.s, from_rc, fds, peer).status().err(), EOPNOTSUPP);
  // Another tenant (another uid): that destination stays mediated.
  b_.s->uid = ::getuid() + 1;
  req = DirectUdReq{ua.handle, ub.qpn, to_lid(b_)};
  EXPECT_EQ(dev_.direct_grant_ud(*a_.s, req, fds, peer).status().err(), EPERM);
}

// A receive side that direct senders feed: the backend delivers only while no library holds
// its rx_lock, never waits for one (the datagram is lost, as UD may lose it), and takes over a
// lock whose holder's session is gone.
TEST_F(DeviceUdTest, BackendDeliversIntoADirectFedReceiveSideOnlyUnderItsLock) {
  dev_.set_direct(true);
  dev_.set_direct_trust(true, {});
  a_.s->uid = b_.s->uid = ::getuid();
  QpV ua = ud_qp(a_, acq_, 5), ub = ud_qp(b_, bcq_, 5);
  std::vector<UniqueFd> fds;
  std::string peer;
  auto g = dev_.direct_grant_ud(*a_.s, DirectUdReq{ua.handle, ub.qpn, to_lid(b_)}, fds, peer);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  // b's receive completions go to its own ring now (kDirectGrant's descriptor 2).
  CqV own;
  struct stat st {};
  ASSERT_EQ(::fstat(fds[2].get(), &st), 0);
  own.map = MappedRegion::map_shared(fds[2].get(), static_cast<size_t>(st.st_size));
  ASSERT_TRUE(own.map.valid());
  own.hdr = reinterpret_cast<RingHeader*>(own.map.data());
  own.e = ring_entries<Cqe>(own.hdr);
  own.size = g.value().grant.recv_ring_entries;
  post_recv(ub, 1, mb_.addr, 1024, mb_.mr.lkey);
  // A library of a live session holds it: the datagram is lost, the receive stays.
  ub.rq->rx_lock.store(g.value().lock_tag);
  post_ud(ua, 2, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 5);
  dev_.poll(now_);
  EXPECT_TRUE(drain(own).empty()) << "delivered while a library held the receive side";
  EXPECT_EQ(ub.rq->rx_lock.load(), g.value().lock_tag) << "the holder's lock was taken";
  EXPECT_EQ(ub.rq->consumer.load(), 0u);
  // A holder that is gone (a session number nobody has): taken over, delivered, given back.
  ub.rq->rx_lock.store(0x7fff0000u);
  post_ud(ua, 3, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 5);
  dev_.poll(now_);
  auto rx = drain(own);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(ub.rq->rx_lock.load(), 0u);
  EXPECT_EQ(ub.rq->consumer.load(), 1u);
}

}  // namespace
}  // namespace vrdma::engine::devtest
