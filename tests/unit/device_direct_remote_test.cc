// The direct path across backends, backend side: two Devices (backends "A" and "B") joined by a
// fake transport pair that holds frames until the test pumps them through the wire codec.
// Guest a (QP a) lives on A, guest b (QP b) on B, connected RC to each other. b's library offers
// (kDirectOffer), the offer travels to A, a's library asks kDirectRemote; every refusal the
// libraries rely on (EAGAIN: not yet, EOPNOTSUPP: never, EREMOTE from kDirectGrant) is pinned.
#include <arpa/inet.h>
#include <sys/stat.h>

#include <deque>
#include <set>

#include "common/identity.h"
#include "loopback_fixture.h"

namespace vrdma::engine::devtest {
namespace {

namespace wire = proto::wire;

/// One backend's end of a fake connection to one peer backend: frames sent wait in `q` until
/// the test pumps them into the peer's Device; the directory is what the test says it is.
class FakeLink final : public RecordingTransport {
 public:
  FakeLink(std::string self, std::string peer, uint32_t peer_ipv4)
      : self_(std::move(self)), peer_(std::move(peer)), peer_ipv4_(peer_ipv4) {}
  std::set<uint16_t> peer_lids;  ///< guests the peer announced
  std::set<std::string> peer_names;  ///< the same guests' names (their GIDs)

  const std::string& self() const override { return self_; }
  bool forced() const override { return false; }
  std::string locate_lid(uint16_t lid) const override {
    return peer_lids.count(lid) ? peer_ : std::string();
  }
  std::string locate_gid(const uint8_t* gid) const override {
    for (const std::string& n : peer_names) {
      if (std::memcmp(gid_of(n).data(), gid, 16) == 0) return peer_;
    }
    return "";
  }
  void refused_frame(const std::string&, const std::string&) override {}
  uint32_t peer_ipv4(const std::string& node) const override {
    return node == peer_ ? peer_ipv4_ : 0;
  }
  /// One host: we are reached where the peer is.
  uint32_t local_ipv4(const std::string& node) const override { return peer_ipv4(node); }
  void set_peer_ipv4(uint32_t a) { peer_ipv4_ = a; }
  bool can_dial = false;             ///< want_connection's answer
  std::vector<std::string> wanted;   ///< the nodes want_connection was asked for
  bool want_connection(const std::string& node) override {
    wanted.push_back(node);
    return can_dial;
  }
  /// The peer's guests are now on backend `node` (which the same link reaches).
  void set_peer(std::string node) { peer_ = std::move(node); }

 private:
  const std::string& to() const override { return peer_; }
  std::string self_, peer_;
  uint32_t peer_ipv4_;
};

/// Frames of one type among those queued.
size_t count(const FakeLink& l, wire::Type t) {
  size_t n = 0;
  for (const auto& s : l.q) {
    wire::FrameHeader h;
    std::memcpy(&h, s.bytes.data(), sizeof(h));
    n += static_cast<wire::Type>(h.type) == t;
  }
  return n;
}

constexpr uint16_t kPort = 40000;

class DirectRemoteTest : public DeviceTest {
 protected:
  void SetUp() override {
    dev_.set_transport(&ta_);
    devb_.set_transport(&tb_);
    dev_.set_direct_remote(true);
    devb_.set_direct_remote(true);
    a_ = open("a");
    b_ = open("b", &devb_);
    ASSERT_NE(a_.hello.lid, b_.hello.lid);
    ta_.peer_lids = {static_cast<uint16_t>(b_.hello.lid)};
    tb_.peer_lids = {static_cast<uint16_t>(a_.hello.lid)};
    ta_.peer_names = {"b"};
    tb_.peer_names = {"a"};
    acq_ = cq(a_);
    arcq_ = cq(a_);
    bcq_ = cq(b_);
    qa_ = qp(a_, acq_, arcq_);
    qb_ = qp(b_, bcq_, bcq_);
    ma_ = mem(a_);
    mb_ = mem(b_);
    for (uint8_t i = 0; i < kDirectTokenBytes; ++i) token_[i] = static_cast<uint8_t>(0x5a ^ i);
  }
  // The links die before the devices, which still announce the guests that leave.
  void TearDown() override {
    dev_.set_transport(nullptr);
    devb_.set_transport(nullptr);
  }
  /// Delivers what each side queued to the other, through the codec. Returns how many frames.
  int pump() {
    int n = 0;
    for (bool moved = true; moved;) {
      moved = false;
      for (auto [from, to, node] : {std::tuple{&ta_, &devb_, "A"}, std::tuple{&tb_, &dev_, "B"}}) {
        while (!from->q.empty()) {
          FakeLink::Sent s = std::move(from->q.front());
          from->q.pop_front();
          deliver(s, *to, node);
          ++n;
          moved = true;
        }
      }
    }
    return n;
  }
  Result<DirectOfferResp> offer(G& g, const QpV& q, std::vector<UniqueFd>& fds,
                                uint16_t port = kPort) {
    DirectOfferReq req{};
    req.qp = q.handle;
    req.port = port;
    std::memcpy(req.token, token_, kDirectTokenBytes);
    return g.dev->direct_offer(*g.s, req, fds);
  }
  Result<DirectRemoteResp> remote(G& g, const QpV& q, std::vector<UniqueFd>& fds) {
    return g.dev->direct_remote(*g.s, q.handle, fds);
  }
  /// b at RTR offers; the offer reaches A.
  void offer_b() {
    std::vector<UniqueFd> fds;
    auto r = offer(b_, qb_, fds);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    ASSERT_EQ(pump(), 1);
  }
  const std::unordered_map<uint32_t, RemoteOffer>& offers_of_a() {
    return a_.s->guest->direct_offers;
  }
  /// A wire offer as B's backend would send it for b (the test then mutates it).
  wire::DirectOffer wire_offer() {
    wire::DirectOffer o{};
    o.slid = static_cast<uint16_t>(b_.hello.lid);
    o.dlid = static_cast<uint16_t>(a_.hello.lid);
    o.port = kPort;
    o.src_qpn = qb_.qpn;
    o.dst_qpn = qa_.qpn;
    std::memcpy(o.token, token_, kDirectTokenBytes);
    return o;
  }
  void deliver_to_a(const std::string& node, const wire::DirectOffer& o) {
    std::vector<uint8_t> bytes;
    wire::encode(wire::Type::kDirectOffer, &o, 0, bytes);
    wire::FrameHeader h;
    std::memcpy(&h, bytes.data(), sizeof(h));
    wire::Frame f;
    ASSERT_TRUE(wire::decode(h, {bytes.data() + sizeof(h), h.body}, f).is_ok());
    transport::RxSink sink;
    dev_.on_frame(node, f, sink);
    dev_.on_frame_done(node, f, sink);
  }

  const uint32_t ipv4_b_ = ::inet_addr("10.1.2.3");
  FakeLink ta_{"A", "B", ipv4_b_};
  FakeLink tb_{"B", "A", ::inet_addr("10.1.2.1")};
  Device devb_;  ///< backend B (after its link: it announces its guests' departure to it)
  uint8_t token_[kDirectTokenBytes] = {};
};

TEST_F(DirectRemoteTest, ControlPageOffersTheFeature) {
  EXPECT_EQ(a_.s->control_page()->features & kFeatureDirectRemote, kFeatureDirectRemote);
  EXPECT_EQ(a_.s->control_page()->features & kFeatureDirect, 0u);
}

TEST_F(DirectRemoteTest, OfferAtRtrThenRemoteAtRts) {
  connect_rtr(a_, qa_, b_, qb_);
  connect_rtr(b_, qb_, a_, qa_);
  std::vector<UniqueFd> fds;
  auto o = offer(b_, qb_, fds);
  ASSERT_TRUE(o.is_ok()) << o.status().message();
  EXPECT_EQ(o->peer_qpn, qa_.qpn);
  EXPECT_EQ(o->my_lid, b_.hello.lid);
  EXPECT_EQ(o->recv_ring_entries, bcq_.size);
  ASSERT_EQ(fds.size(), 1u);
  struct stat st {};
  ASSERT_EQ(::fstat(fds[0].get(), &st), 0);
  MappedRegion ring = MappedRegion::map_shared(fds[0].get(), static_cast<size_t>(st.st_size));
  ASSERT_TRUE(ring.valid());
  EXPECT_EQ(reinterpret_cast<RingHeader*>(ring.data())->magic, kRingMagic);
  EXPECT_EQ(qb_.rq->armed.load(), 1u);  // receives posted from now on ring no doorbell
  EXPECT_EQ(count(tb_, wire::Type::kDirectOffer), 1u);
  ASSERT_EQ(pump(), 1);
  ASSERT_EQ(offers_of_a().count(qa_.qpn), 1u);

  fds.clear();
  auto early = remote(a_, qa_, fds);
  EXPECT_EQ(early.err(), EAGAIN) << early.status().message();  // a is only RTR
  to_rts(a_, qa_);
  auto r = remote(a_, qa_, fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->peer_qpn, qb_.qpn);
  EXPECT_EQ(r->my_lid, a_.hello.lid);
  EXPECT_EQ(r->peer_ipv4, ipv4_b_);
  EXPECT_EQ(r->peer_port, kPort);
  EXPECT_EQ(std::memcmp(r->token, token_, kDirectTokenBytes), 0);
  EXPECT_EQ(r->send_ring_entries, acq_.size);
  ASSERT_EQ(fds.size(), 1u);
  ASSERT_EQ(::fstat(fds[0].get(), &st), 0);
  EXPECT_GT(st.st_size, 0);
  EXPECT_GT(acq_.hdr->direct_gen.load(), 0u);  // the send CQ's poller fetches the new ring

  // The QP's own send ring is among its CQ's rings now.
  std::vector<UniqueFd> rings;
  auto dr = dev_.direct_rings(*a_.s, acq_.handle, rings);
  ASSERT_TRUE(dr.is_ok());
  ASSERT_EQ(dr->count, 1u);
  EXPECT_EQ(dr->rings[0].qp, qa_.handle);
  EXPECT_EQ(dr->rings[0].recv, 0u);

  // Reported as direct.
  bool seen = false;
  const nlohmann::json rep = dev_.report();
  for (const auto& q : rep["res"]["qp"]) {
    if (q["lqpn"] != qa_.qpn) continue;
    seen = true;
    EXPECT_EQ(q["transport"], "direct");
    EXPECT_NE(q["transport_why"].get<std::string>().find("TCP"), std::string::npos);
  }
  EXPECT_TRUE(seen);

  // The backend still executes what the library leaves on the ring (one that could not reach
  // its peer's library stays mediated; once it sends directly it leaves nothing there).
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  for (int i = 0; i < 5; ++i) dev_.poll(now_);
  EXPECT_EQ(count(ta_, wire::Type::kRequest), 1u);
}

// kDirectOfferWhere: where b's library is to listen (the address the peer's library dials),
// checked as an offer is, and nothing given or sent.
TEST_F(DirectRemoteTest, WhereToListen) {
  connect_rtr(b_, qb_, a_, qa_);
  std::vector<UniqueFd> fds;
  DirectOfferReq req{};
  req.qp = qb_.handle;
  req.flags = kDirectOfferWhere;
  tb_.set_peer_ipv4(::inet_addr("127.0.0.1"));  // a peer backend on this host: loopback
  auto w = devb_.direct_offer(*b_.s, req, fds);
  ASSERT_TRUE(w.is_ok()) << w.status().message();
  EXPECT_EQ(w->listen_ipv4, ::inet_addr("127.0.0.1"));
  EXPECT_TRUE(fds.empty());
  EXPECT_EQ(count(tb_, wire::Type::kDirectOffer), 0u);
  EXPECT_EQ(qb_.rq->armed.load(), 0u);  // no own ring yet
  // No connection to the peer's backend now: the library asks again when the transport can
  // make one (it dials it), and not at all when it cannot.
  tb_.set_peer_ipv4(0);
  tb_.can_dial = true;
  EXPECT_EQ(devb_.direct_offer(*b_.s, req, fds).err(), EAGAIN);
  EXPECT_EQ(tb_.wanted, std::vector<std::string>{"A"}) << "the peer backend was not dialed";
  tb_.can_dial = false;
  EXPECT_EQ(devb_.direct_offer(*b_.s, req, fds).err(), EADDRNOTAVAIL);
  req.port = kPort;  // an offer with an unknown flag
  EXPECT_EQ(devb_.direct_offer(*b_.s, req, fds).err(), EINVAL);
  // The offer itself says the address too.
  tb_.set_peer_ipv4(::inet_addr("127.0.0.1"));
  auto o = offer(b_, qb_, fds);
  ASSERT_TRUE(o.is_ok()) << o.status().message();
  EXPECT_EQ(o->listen_ipv4, ::inet_addr("127.0.0.1"));
}

TEST_F(DirectRemoteTest, OfferRefusals) {
  std::vector<UniqueFd> fds;
  EXPECT_EQ(offer(b_, qb_, fds).err(), EAGAIN);  // RESET
  connect_rtr(b_, qb_, a_, qa_);
  EXPECT_EQ(offer(b_, qb_, fds, 0).err(), EINVAL);  // port 0
  DirectOfferReq bad{};
  bad.qp = 999;
  bad.port = kPort;
  EXPECT_EQ(devb_.direct_offer(*b_.s, bad, fds).err(), EINVAL);
  // A QP whose peer is on its own backend (here: b's own QP) has no use for it.
  QpV qc = qp(b_, bcq_, bcq_);
  connect_rtr(b_, qc, b_, qb_);
  EXPECT_EQ(offer(b_, qc, fds).err(), EOPNOTSUPP);
  // Off: never.
  devb_.set_direct_remote(false);
  EXPECT_EQ(offer(b_, qb_, fds).err(), EOPNOTSUPP);
  EXPECT_TRUE(tb_.q.empty());
}

// A CQ with a completion channel: only a library that fires it itself (kDirectOfferNotify,
// kDirectRemoteNotify; an older one would leave a waiter asleep) takes the pair direct, and it
// gets the channel's descriptors after the ring's: the CQ's ring, and a write end and a read end
// of the very pipe the guest's channel reads.
TEST_F(DirectRemoteTest, ACqWithAChannelGoesDirectOnlyWithALibraryThatFiresIt) {
  struct Chan {
    CqV cq;
    UniqueFd read_end;
  };
  auto channel_cq = [](Device& d, G& g) {
    Chan c;
    auto ch = d.create_channel(*g.s, c.read_end);
    EXPECT_TRUE(ch.is_ok());
    UniqueFd ring;
    auto cq = d.create_cq(*g.s, CreateCqReq{64, ch.is_ok() ? ch.value() : kNone, 0, 0}, ring);
    EXPECT_TRUE(cq.is_ok()) << cq.status().message();
    if (cq.is_ok()) c.cq.handle = cq->handle;
    return c;
  };
  // The channel's own read end hears what is written into the descriptor at `fds[at + 1]`.
  auto same_pipe = [](std::vector<UniqueFd>& fds, size_t at, const UniqueFd& read_end) {
    const uint32_t h = 77;
    uint32_t got = 0;
    return ::write(fds[at + 1].get(), &h, sizeof(h)) == sizeof(h) &&
           ::read(read_end.get(), &got, sizeof(got)) == sizeof(got) && got == h;
  };
  Chan ac = channel_cq(dev_, a_), bc = channel_cq(devb_, b_);
  QpV qc = qp(a_, ac.cq, acq_);  // a's send CQ has the channel
  QpV qd = qp(b_, bcq_, bc.cq);  // b's receive CQ has it
  connect(a_, qc, b_, qd);
  connect(b_, qd, a_, qc);
  std::vector<UniqueFd> fds;
  EXPECT_EQ(offer(b_, qd, fds).err(), EOPNOTSUPP);  // a library that does not say it fires it
  DirectOfferReq req{};
  req.qp = qd.handle;
  req.port = kPort;
  req.flags = kDirectOfferNotify | 8;
  EXPECT_EQ(devb_.direct_offer(*b_.s, req, fds).err(), EINVAL);  // an unknown flag
  req.flags = kDirectOfferNotify | kDirectOfferSrq;
  EXPECT_EQ(devb_.direct_offer(*b_.s, req, fds).err(), EINVAL);  // no SRQ to take from
  req.flags = kDirectOfferWhere | kDirectOfferNotify;
  req.port = 0;
  tb_.set_peer_ipv4(::inet_addr("127.0.0.1"));
  EXPECT_TRUE(devb_.direct_offer(*b_.s, req, fds).is_ok());
  req.flags = kDirectOfferNotify;
  req.port = kPort;
  std::memcpy(req.token, token_, kDirectTokenBytes);
  auto o = devb_.direct_offer(*b_.s, req, fds);
  ASSERT_TRUE(o.is_ok()) << o.status().message();
  ASSERT_EQ(fds.size(), 1 + kDirectNotifyFds);
  EXPECT_TRUE(same_pipe(fds, 1, bc.read_end));
  ASSERT_EQ(pump(), 1);

  EXPECT_EQ(dev_.direct_remote(*a_.s, qc.handle, fds).err(), EOPNOTSUPP);
  EXPECT_EQ(dev_.direct_remote(*a_.s, qc.handle, fds, kDirectRemoteNotify | 2).err(), EINVAL);
  auto r = dev_.direct_remote(*a_.s, qc.handle, fds, kDirectRemoteNotify);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_EQ(fds.size(), 1 + kDirectNotifyFds);
  EXPECT_TRUE(same_pipe(fds, 1, ac.read_end));
  // A QP with no channel on its CQs takes the flag too (nothing more is given).
  connect_both();
  offer_b();
  EXPECT_TRUE(dev_.direct_remote(*a_.s, qa_.handle, fds, kDirectRemoteNotify).is_ok());
  EXPECT_EQ(fds.size(), 1u);
}

TEST_F(DirectRemoteTest, RemoteTakesAQpThatCountsRnrRetries) {
  connect_both(6);  // a: rnr_retry 6, which its library counts on the direct path
  offer_b();
  std::vector<UniqueFd> fds;
  EXPECT_TRUE(remote(a_, qa_, fds).is_ok());
}

TEST_F(DirectRemoteTest, RemoteWaitsForAnOffer) {
  connect_both();
  std::vector<UniqueFd> fds;
  EXPECT_EQ(remote(a_, qa_, fds).err(), EAGAIN);  // b's library never offered
  EXPECT_EQ(remote(b_, qb_, fds).err(), EAGAIN);  // nor did a's
  offer_b();
  EXPECT_TRUE(remote(a_, qa_, fds).is_ok());
  EXPECT_EQ(remote(b_, qb_, fds).err(), EAGAIN);  // one direction at a time
}

TEST_F(DirectRemoteTest, RemoteWaitsForWorkInFlight) {
  connect_both();
  offer_b();
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey);
  std::vector<UniqueFd> fds;
  EXPECT_EQ(remote(a_, qa_, fds).err(), EAGAIN);  // posted, not taken
  dev_.poll(now_);
  EXPECT_EQ(remote(a_, qa_, fds).err(), EAGAIN);  // sent, not acknowledged
  pump();
  ASSERT_EQ(drain(acq_).size(), 1u);
  EXPECT_TRUE(remote(a_, qa_, fds).is_ok());
}

TEST_F(DirectRemoteTest, OfferOfAnotherPairDoesNotMatch) {
  connect_both();
  std::vector<UniqueFd> fds;
  wire::DirectOffer o = wire_offer();
  o.src_qpn = qb_.qpn + 1;  // another QP of b's guest
  deliver_to_a("B", o);
  ASSERT_EQ(offers_of_a().count(qa_.qpn), 1u);
  EXPECT_EQ(remote(a_, qa_, fds).err(), EAGAIN);
  o = wire_offer();
  o.slid = static_cast<uint16_t>(b_.hello.lid + 1);  // another guest's QP of that number
  deliver_to_a("B", o);
  EXPECT_EQ(remote(a_, qa_, fds).err(), EAGAIN);
  deliver_to_a("C", wire_offer());  // from a backend a's peer is not on
  EXPECT_EQ(remote(a_, qa_, fds).err(), EAGAIN);
  // For QPs or guests that are not here: dropped.
  o = wire_offer();
  o.dst_qpn = qa_.qpn + 100;
  deliver_to_a("B", o);
  o = wire_offer();
  o.dlid = static_cast<uint16_t>(a_.hello.lid + 1);
  deliver_to_a("B", o);
  EXPECT_EQ(offers_of_a().size(), 1u);
  // The right one replaces the wrong one.
  deliver_to_a("B", wire_offer());
  EXPECT_EQ(offers_of_a().size(), 1u);
  EXPECT_TRUE(remote(a_, qa_, fds).is_ok());
}

TEST_F(DirectRemoteTest, GrantAnswersEremoteForARemotePeer) {
  connect_both();
  std::vector<UniqueFd> fds;
  EXPECT_EQ(dev_.direct_grant(*a_.s, qa_.handle, fds).err(), EREMOTE);
  dev_.set_direct(true);
  EXPECT_EQ(dev_.direct_grant(*a_.s, qa_.handle, fds).err(), EREMOTE);
  dev_.set_direct(false);
  dev_.set_direct_remote(false);
  EXPECT_EQ(dev_.direct_grant(*a_.s, qa_.handle, fds).err(), EOPNOTSUPP);
  EXPECT_EQ(remote(a_, qa_, fds).err(), EOPNOTSUPP);
}

TEST_F(DirectRemoteTest, OfferGoesWithItsQp) {
  connect_both();
  offer_b();
  ASSERT_EQ(offers_of_a().size(), 1u);
  QpAttr reset{};
  reset.qp_state = IBV_QPS_RESET;
  ASSERT_TRUE(modify(a_, qa_, IBV_QP_STATE, reset));
  EXPECT_TRUE(offers_of_a().empty());
  connect(a_, qa_, b_, qb_);
  std::vector<UniqueFd> fds;
  EXPECT_EQ(remote(a_, qa_, fds).err(), EAGAIN);  // the old offer was for the old connection
  offer_b();
  ASSERT_EQ(offers_of_a().size(), 1u);
  ASSERT_TRUE(remote(a_, qa_, fds).is_ok());
  ASSERT_TRUE(dev_.destroy_qp(*a_.s, qa_.handle).is_ok());
  EXPECT_TRUE(offers_of_a().empty());
}

TEST_F(DirectRemoteTest, ResetEndsTheDirectConnection) {
  connect_both();
  offer_b();
  std::vector<UniqueFd> fds;
  ASSERT_TRUE(remote(a_, qa_, fds).is_ok());
  QpAttr reset{};
  reset.qp_state = IBV_QPS_RESET;
  ASSERT_TRUE(modify(a_, qa_, IBV_QP_STATE, reset));
  connect(a_, qa_, b_, qb_);
  // Mediated again: the backend sends what is posted.
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  EXPECT_EQ(count(ta_, wire::Type::kRequest), 1u);
}

// ---- Back to the backends before a move (RingHeader::direct_revoke) ----

/// A QP's own completion ring, mapped from the descriptor a grant or an offer gave.
CqV own_ring(int fd, uint32_t entries) {
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  CqV c;
  c.size = entries;
  c.map = MappedRegion::map_shared(fd, static_cast<size_t>(st.st_size));
  c.hdr = reinterpret_cast<RingHeader*>(c.map.data());
  c.e = reinterpret_cast<Cqe*>(c.map.data() + sizeof(RingHeader));
  c.cons = c.hdr->consumer.load();
  return c;
}

// The moving guest's backend asks a's library, holds what a posts meanwhile (its library may
// still have requests in flight between the libraries), and takes the send queue back with
// the answer: the held SEND goes out mediated, after everything, with the pair's PSNs (which
// the direct path never moved), and the guest can then be exported.
TEST_F(DirectRemoteTest, LeavingTheDirectPathHoldsTheSendQueueUntilTheLibraryAnswers) {
  connect_both();
  std::vector<UniqueFd> bfds, afds;
  auto o = offer(b_, qb_, bfds);
  ASSERT_TRUE(o.is_ok()) << o.status().message();
  ASSERT_EQ(pump(), 1);
  auto r = remote(a_, qa_, afds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  CqV asend = own_ring(afds[0].get(), r->send_ring_entries);
  CqV brecv = own_ring(bfds[0].get(), o->recv_ring_entries);
  EXPECT_EQ(dev_.export_guest("a", [](const Session&) { return -1; }).err(), EBUSY);

  auto left = dev_.leave_direct_remote("a");
  EXPECT_EQ(left.err(), EINPROGRESS) << left.message();
  EXPECT_EQ(qa_.sq->direct_revoke.load(), kRevokeAsk);
  EXPECT_EQ(dev_.leave_direct_remote("a").err(), EINPROGRESS);  // asked again: still waiting
  std::vector<UniqueFd> again;
  EXPECT_EQ(remote(a_, qa_, again).err(), EAGAIN);  // nor does it go direct meanwhile
  EXPECT_EQ(dev_.export_guest("a", [](const Session&) { return -1; }).err(), EBUSY);
  // What the library posts once it stops sending itself waits in the send queue.
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey);
  for (int i = 0; i < 5; ++i) dev_.poll(now_);
  EXPECT_EQ(count(ta_, wire::Type::kRequest), 0u);
  EXPECT_EQ(qa_.sq->consumer.load(), 0u);

  // The library's answer: nothing in flight between the libraries any more.
  qa_.sq->direct_revoke.store(kRevokeDone);
  dev_.poll(now_);
  EXPECT_EQ(count(ta_, wire::Type::kRequest), 1u);
  EXPECT_EQ(qa_.sq->direct_revoke.load(), 0u);
  EXPECT_TRUE(offers_of_a().empty());
  EXPECT_TRUE(dev_.leave_direct_remote("a").is_ok());
  const nlohmann::json rep = dev_.report();  // held: a temporary's member dies in the range-for
  for (const auto& q : rep["res"]["qp"]) {
    if (q["lqpn"] == qa_.qpn) {
      EXPECT_EQ(q["transport"], "tcp");
    }
  }
  // b's backend takes it (b's receive completion in b's own ring, as its library's were) and
  // acknowledges it: a's completion follows in a's own ring.
  pump();
  devb_.poll(now_);
  pump();
  dev_.poll(now_);
  auto rx = drain(brecv);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  auto tx = drain(asend);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].wr_id, 2u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  auto ex = dev_.export_guest("a", [](const Session&) { return -1; });
  EXPECT_TRUE(ex.is_ok()) << ex.status().message();
}

// The peer's side: b only offered (its library executes a's requests). Asked, it answers too
// (its library stops taking connections); meanwhile what b posts waits as a's did, whoever
// asked (here b's library itself, as it does when a's library's kRevoke comes).
TEST_F(DirectRemoteTest, AnOfferingQpLeavesToo) {
  connect_both();
  offer_b();
  EXPECT_EQ(devb_.leave_direct_remote("b").err(), EINPROGRESS);
  EXPECT_EQ(qb_.sq->direct_revoke.load(), kRevokeAsk);
  post_recv(qa_, 1, ma_.addr, 64, ma_.mr.lkey);
  post_send(qb_, 2, mb_.addr, 8, mb_.mr.lkey);
  for (int i = 0; i < 5; ++i) devb_.poll(now_);
  EXPECT_EQ(count(tb_, wire::Type::kRequest), 0u);
  qb_.sq->direct_revoke.store(kRevokeDone);
  EXPECT_TRUE(devb_.leave_direct_remote("b").is_ok());
  devb_.poll(now_);
  EXPECT_EQ(count(tb_, wire::Type::kRequest), 1u);
  EXPECT_TRUE(devb_.export_guest("b", [](const Session&) { return -1; }).is_ok());
  // A guest with nothing on the direct path is not held at all.
  EXPECT_TRUE(dev_.leave_direct_remote("a").is_ok());
  EXPECT_EQ(qa_.sq->direct_revoke.load(), 0u);
  EXPECT_EQ(dev_.leave_direct_remote("nobody").err(), ENOENT);
}

// A reset ends the direct connection and an ask with it: the next life starts clean.
TEST_F(DirectRemoteTest, ResetClearsAnAsk) {
  connect_both();
  offer_b();
  std::vector<UniqueFd> fds;
  ASSERT_TRUE(remote(a_, qa_, fds).is_ok());
  EXPECT_EQ(dev_.leave_direct_remote("a").err(), EINPROGRESS);
  QpAttr reset{};
  reset.qp_state = IBV_QPS_RESET;
  ASSERT_TRUE(modify(a_, qa_, IBV_QP_STATE, reset));
  EXPECT_EQ(qa_.sq->direct_revoke.load(), 0u);
  EXPECT_TRUE(dev_.leave_direct_remote("a").is_ok());
}

// ---- Direct again after the move ----

// a's library used b's offer; both went back to the backends. b's library, whose answer its
// backend took first, offers again before a's answer is taken: that newer offer stays (only the
// one a used ends with the connection). While a's move still asks, a neither offers nor goes
// direct; once the ask finds it settled (the export follows), it takes the new offer.
TEST_F(DirectRemoteTest, AfterTheAnswerANewerOfferStaysAndIsTakenOnceTheAskEnds) {
  connect_both();
  offer_b();
  std::vector<UniqueFd> fds;
  ASSERT_TRUE(remote(a_, qa_, fds).is_ok());
  EXPECT_EQ(dev_.leave_direct_remote("a").err(), EINPROGRESS);
  // b's library follows (its own word), answers, and offers again with another token.
  qb_.sq->direct_revoke.store(kRevokeDone);
  EXPECT_TRUE(devb_.leave_direct_remote("b").is_ok());
  EXPECT_EQ(qb_.sq->direct_revoke.load(), 0u);
  token_[0] ^= 0xff;
  offer_b();
  // a's answer, taken by the engine (a post made it look) before the ask comes again.
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  qa_.sq->direct_revoke.store(kRevokeDone);
  dev_.poll(now_);
  EXPECT_EQ(qa_.sq->direct_revoke.load(), 0u);
  EXPECT_EQ(count(ta_, wire::Type::kRequest), 1u);  // the held SEND, mediated
  ASSERT_EQ(offers_of_a().count(qa_.qpn), 1u);
  EXPECT_EQ(std::memcmp(offers_of_a().at(qa_.qpn).token, token_, kDirectTokenBytes), 0);
  // Not while the move asks: a QP direct again would only be asked back.
  std::vector<UniqueFd> again;
  EXPECT_EQ(remote(a_, qa_, again).err(), EAGAIN);
  EXPECT_EQ(offer(a_, qa_, again).err(), EAGAIN);
  EXPECT_TRUE(dev_.leave_direct_remote("a").is_ok());
  EXPECT_TRUE(dev_.export_guest("a", [](const Session&) { return -1; }).is_ok());
  // The guest stayed (a snapshot): direct again, with b's new offer, once the SEND completed.
  pump();
  devb_.poll(now_);
  pump();
  dev_.poll(now_);
  auto r = remote(a_, qa_, again);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(std::memcmp(r->token, token_, kDirectTokenBytes), 0);
  std::vector<UniqueFd> afds;
  EXPECT_TRUE(offer(a_, qa_, afds).is_ok());
}

// b's guest moves (out of B and in again, as a restore does): before, its QP is held off the
// direct path; after, its library offers again on the backend that took it in, and a, whose
// answer ended the offer it had used, takes the new one.
TEST_F(DirectRemoteTest, AfterAMoveTheLibraryOffersAgainAndThePeerTakesIt) {
  connect_both();
  offer_b();
  std::vector<UniqueFd> fds, again;
  ASSERT_TRUE(remote(a_, qa_, fds).is_ok());
  EXPECT_EQ(devb_.leave_direct_remote("b").err(), EINPROGRESS);
  EXPECT_EQ(offer(b_, qb_, again).err(), EAGAIN);  // asked: no offer
  qb_.sq->direct_revoke.store(kRevokeDone);
  ASSERT_TRUE(devb_.leave_direct_remote("b").is_ok());
  auto ex = devb_.export_guest("b", [](const Session&) { return -1; });
  ASSERT_TRUE(ex.is_ok()) << ex.status().message();
  std::vector<UniqueFd> efds = dup_all(ex->fds);
  devb_.detach_guest("b");
  auto im = devb_.import_guest(ex->blob, efds);
  ASSERT_TRUE(im.is_ok()) << im.status().message();
  b_.s = im.value()[0].session;
  // a's library went back with b's (its own word): the offer it used ends with the answer.
  qa_.sq->direct_revoke.store(kRevokeDone);
  EXPECT_TRUE(dev_.leave_direct_remote("a").is_ok());
  EXPECT_TRUE(offers_of_a().empty());
  EXPECT_EQ(remote(a_, qa_, again).err(), EAGAIN);  // the peer's library has not offered yet
  token_[0] ^= 0xff;
  offer_b();
  auto r = remote(a_, qa_, again);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(std::memcmp(r->token, token_, kDirectTokenBytes), 0);
  EXPECT_EQ(r->peer_port, kPort);
}

// An offer follows the peer it was made to when that guest moves to another backend (the
// offer that reached the old one went with nothing); one being asked back does not.
TEST_F(DirectRemoteTest, AnOfferFollowsItsPeerToAnotherBackend) {
  connect_both();
  offer_b();
  tb_.set_peer("C");
  transport::GuestInfo gi{"a", static_cast<uint16_t>(a_.hello.lid), {}};
  std::memcpy(gi.gid, gid_of("a").data(), 16);
  devb_.on_guest_located(gi, "C");
  ASSERT_EQ(count(tb_, wire::Type::kDirectOffer), 1u);
  tb_.q.clear();
  EXPECT_EQ(devb_.leave_direct_remote("b").err(), EINPROGRESS);
  tb_.set_peer("D");
  devb_.on_guest_located(gi, "D");
  EXPECT_EQ(count(tb_, wire::Type::kDirectOffer), 0u);
}

// ---- keep_state: the pair stays direct across a SIGKILLed backend ----

/// The transport the report gives QP `qpn` of device `d`.
std::string transport_of(const Device& d, uint32_t qpn) {
  const nlohmann::json rep = d.report();  // held: a temporary's member dies in the range-for
  for (const auto& q : rep["res"]["qp"]) {
    if (q["lqpn"] == qpn) return q["transport"].get<std::string>();
  }
  return "";
}

// A keeper's copy of a guest on the direct path across backends keeps that state (a move's
// export still refuses, and a move's import refuses a blob that has it). Taken in again as a
// restarted backend does (the guest gone with the dead backend, its kept blob imported in
// recover mode), a's QP is still direct, still offered, holds b's offer, and a move asks its
// library back as before the restart. What changes outside a command (b's offer reaching A, a
// revoke's answer taken) is noted for the keeper.
TEST_F(DirectRemoteTest, AKeptStateKeepsThePairDirectAcrossARestart) {
  dev_.track_direct_changes(true);
  connect_both();
  offer_b();
  EXPECT_EQ(dev_.take_direct_changes(), std::vector<std::string>{"a"});  // b's offer came
  EXPECT_TRUE(dev_.take_direct_changes().empty());
  std::vector<UniqueFd> ofds, rfds;
  uint8_t b_token[kDirectTokenBytes];
  std::memcpy(b_token, token_, kDirectTokenBytes);
  token_[0] ^= 0xff;
  ASSERT_TRUE(offer(a_, qa_, ofds).is_ok());  // a's library offers too
  ASSERT_EQ(pump(), 1);
  ASSERT_TRUE(remote(a_, qa_, rfds).is_ok());
  const auto none = [](const Session&) { return -1; };
  EXPECT_EQ(dev_.export_guest("a", none).err(), EBUSY);
  auto ex = dev_.export_guest("a", none, true);
  ASSERT_TRUE(ex.is_ok()) << ex.status().message();

  std::vector<UniqueFd> moved = dup_all(ex->fds), kept = dup_all(ex->fds);
  dev_.detach_guest("a");  // the backend died; the keeper's blob comes back
  EXPECT_EQ(dev_.import_guest(ex->blob, moved, false).err(), EINVAL);
  auto im = dev_.import_guest(ex->blob, kept, true);
  ASSERT_TRUE(im.is_ok()) << im.status().message();
  a_.s = im.value()[0].session;
  EXPECT_EQ(transport_of(dev_, qa_.qpn), "direct");
  ASSERT_EQ(offers_of_a().count(qa_.qpn), 1u);
  const RemoteOffer& held = offers_of_a().at(qa_.qpn);
  EXPECT_EQ(std::memcmp(held.token, b_token, kDirectTokenBytes), 0);
  EXPECT_EQ(held.src_qpn, qb_.qpn);
  EXPECT_EQ(held.port, kPort);
  EXPECT_EQ(held.ipv4, ipv4_b_);
  EXPECT_EQ(held.node, "B");
  // Its peer moves: a's offer (kept) follows it.
  ta_.set_peer("C");
  transport::GuestInfo gi{"b", static_cast<uint16_t>(b_.hello.lid), {}};
  std::memcpy(gi.gid, gid_of("b").data(), 16);
  ta_.q.clear();
  dev_.on_guest_located(gi, "C");
  EXPECT_EQ(count(ta_, wire::Type::kDirectOffer), 1u);
  ta_.set_peer("B");
  dev_.on_guest_located(gi, "B");
  // A move still asks it back, and the answer taken is noted for the keeper.
  EXPECT_EQ(dev_.leave_direct_remote("a").err(), EINPROGRESS);
  EXPECT_EQ(qa_.sq->direct_revoke.load(), kRevokeAsk);
  EXPECT_TRUE(dev_.take_direct_changes().empty());
  qa_.sq->direct_revoke.store(kRevokeDone);
  EXPECT_TRUE(dev_.leave_direct_remote("a").is_ok());
  EXPECT_EQ(dev_.take_direct_changes(), std::vector<std::string>{"a"});
  EXPECT_EQ(transport_of(dev_, qa_.qpn), "tcp");
  EXPECT_TRUE(dev_.export_guest("a", none).is_ok());
}

// A blob that names direct state the guest cannot have is refused.
TEST_F(DirectRemoteTest, AKeptDirectStateWithoutItsRingsIsRefused) {
  connect_both();
  offer_b();
  const auto none = [](const Session&) { return -1; };
  auto ex = dev_.export_guest("a", none, true);  // a has b's offer, no own rings
  ASSERT_TRUE(ex.is_ok()) << ex.status().message();
  auto doc = nlohmann::json::from_cbor(ex->blob);
  ASSERT_EQ(doc["direct_offers"].size(), 1u);
  const std::vector<UniqueFd> held = dup_all(ex->fds);  // the keeper's copies
  std::vector<int> keeper;
  for (const UniqueFd& f : held) keeper.push_back(f.get());
  dev_.detach_guest("a");
  const auto refused = [&](const nlohmann::json& d) {
    std::vector<UniqueFd> fds = dup_all(keeper);
    return dev_.import_guest(nlohmann::json::to_cbor(d), fds, true).err();
  };
  nlohmann::json bad = doc;
  bad["direct_qps"] = {{{"qpn", qa_.qpn},
                        {"remote", 1},
                        {"offered", 0},
                        {"port", 0},
                        {"ipv4", 0},
                        {"token", nlohmann::json::binary(std::vector<uint8_t>(16))},
                        {"used", nlohmann::json::binary(std::vector<uint8_t>(16))}}};
  EXPECT_EQ(refused(bad), EINVAL);  // direct without its own send ring
  bad = doc;
  bad["direct_offers"][0]["qpn"] = qa_.qpn + 1;
  EXPECT_EQ(refused(bad), EINVAL);  // an offer for a QP the guest does not have
  bad = doc;
  bad["direct_offers"].push_back(doc["direct_offers"][0]);
  EXPECT_EQ(refused(bad), EINVAL);  // twice
  std::vector<UniqueFd> fds = dup_all(keeper);
  auto im = dev_.import_guest(ex->blob, fds, true);
  ASSERT_TRUE(im.is_ok()) << im.status().message();
  a_.s = im.value()[0].session;
  EXPECT_EQ(offers_of_a().count(qa_.qpn), 1u);
}

// ---- A guest on this backend cannot pose as a peer backend's guest (issue 21) ----

/// A guest name whose LID (the name's hash) is `lid`: what an attacker searches for.
std::string name_with_lid(uint32_t lid) {
  for (uint32_t i = 0;; ++i) {
    std::string n = "m" + std::to_string(i);
    if (lid_of_name(n) == lid) return n;
  }
}

TEST_F(DirectRemoteTest, ALocalGuestNeverGetsTheLidOfAPeersGuest) {
  const std::string n = name_with_lid(b_.hello.lid);
  G m = open(n.c_str());
  EXPECT_NE(m.hello.lid, b_.hello.lid);
  EXPECT_NE(m.hello.lid, a_.hello.lid);
}

TEST_F(DirectRemoteTest, TheNameOfAPeersGuestIsRefusedAtHello) {
  HelloReq req{};
  std::snprintf(req.guest, sizeof(req.guest), "b");
  HelloResp resp{};
  FdList fds;
  auto r = dev_.open_session(req, cred_, resp, fds);
  EXPECT_EQ(r.err(), EADDRINUSE);
  EXPECT_NE(r.status().message().find("backend B"), std::string::npos) << r.status().message();
  // Refused before anything was made: no guest "b" here.
  const auto js = nlohmann::json::parse(dev_.status_json());
  for (const auto& g : js["guests"])
    EXPECT_NE(g["name"], "b");
}

TEST_F(DirectRemoteTest, ALidHeldHereAndByAPeerConnectsNoOneAndALocalImpostorIsNotHeard) {
  // The impostor took b's LID before the directory heard of b.
  ta_.peer_lids.clear();
  const std::string n = name_with_lid(b_.hello.lid);
  G m = open(n.c_str());
  ASSERT_EQ(m.hello.lid, b_.hello.lid);
  ta_.peer_lids = {static_cast<uint16_t>(b_.hello.lid)};
  // a connects to b by LID: ambiguous, so neither b nor the impostor.
  connect(a_, qa_, b_, qb_);
  auto js = nlohmann::json::parse(dev_.status_json());
  for (const auto& g : js["guests"]) {
    if (g["name"] != "a") continue;
    EXPECT_NE(g["qps"][0]["transport"], "shm");
    EXPECT_NE(g["qps"][0]["transport_why"].get<std::string>().find("not connected"),
              std::string::npos);
  }
  // The impostor's QP (QPN 0x11, what a's QP expects) writes into a's memory: not heard.
  CqV mcq = cq(m);
  QpV qm = qp(m, mcq, mcq);
  ASSERT_EQ(qm.qpn, qb_.qpn);
  connect(m, qm, a_, qa_);
  MemV mm = mem(m);
  std::memset(mm.p(), 0xee, 64);
  std::memset(ma_.p(), 0x11, 64);
  post_rdma(qm, 9, IBV_WR_RDMA_WRITE, mm.addr, 64, mm.mr.lkey, ma_.addr, ma_.mr.rkey);
  for (int i = 0; i < 10; ++i) dev_.poll(now_);
  for (int i = 0; i < 64; ++i) ASSERT_EQ(ma_.p()[i], 0x11) << "byte " << i;
  for (const Cqe& c : drain(mcq)) EXPECT_NE(c.status, IBV_WC_SUCCESS);
}

TEST_F(DirectRemoteTest, ARequestFromAnotherNodeIsNotHeard) {
  connect_both();
  post_recv(qa_, 1, ma_.addr, 64, ma_.mr.lkey);
  post_send(qb_, 2, mb_.addr, 8, mb_.mr.lkey);
  devb_.poll(now_);
  ASSERT_EQ(count(tb_, wire::Type::kRequest), 1u);
  FakeLink::Sent s = tb_.q.front();
  // The same bytes over the connection of a node a's QP is not connected through: dropped.
  deliver(s, dev_, "C");
  dev_.poll(now_);
  EXPECT_TRUE(drain(arcq_).empty());
  // From B, its peer's node, they are heard.
  deliver(s, dev_, "B");
  dev_.poll(now_);
  auto rx = drain(arcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
}

}  // namespace
}  // namespace vrdma::engine::devtest
