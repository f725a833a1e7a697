// A guest whose QPs used the direct path moves like any other (docs/ARCHITECTURE.md, "Moving a
// guest's device"): its grants and its peers' grants into it end before the freeze, its QPs' own
// completion rings travel in the state (version 7), so what the libraries completed directly
// before the move and what the backend completes after it stay in one order, and a backend
// that takes the guest in (a move, a restore, a keeper's restart) ends the grants it did not make.
#include <fcntl.h>
#include <sys/stat.h>

#include "device_fixture.h"
#include "proto/device_state.h"

namespace vrdma::engine::devtest {
namespace {

/// An own completion ring as the library maps it (kDirectGrant's descriptors 1 and 2).
CqV map_own(int fd, uint32_t entries) {
  CqV c;
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  c.map = MappedRegion::map_shared(fd, static_cast<size_t>(st.st_size));
  EXPECT_TRUE(c.map.valid());
  c.hdr = reinterpret_cast<RingHeader*>(c.map.data());
  c.e = ring_entries<Cqe>(c.hdr);
  c.size = entries;
  c.cons = c.hdr->consumer.load();
  return c;
}

/// What the library writes when it executes a WR itself (verbs/direct.cc push()).
void lib_push(CqV& c, uint64_t wr_id) {
  const uint32_t p = c.hdr->producer.load(std::memory_order_relaxed);
  Cqe e{};
  e.wr_id = wr_id;
  e.status = IBV_WC_SUCCESS;
  c.e[p & (c.size - 1)] = e;
  c.hdr->producer.store(p + 1, std::memory_order_release);
}

std::vector<uint64_t> ids(const std::vector<Cqe>& es) {
  std::vector<uint64_t> out;
  for (const Cqe& e : es) out.push_back(e.wr_id);
  return out;
}

/// An address of guest `g`'s LID, as an address handle names it.
UdDest ud_dest(const G& g) {
  UdDest d{};
  d.dlid = static_cast<uint16_t>(g.hello.lid);
  return d;
}

uint32_t epoch_of(int fd) {
  MappedRegion m = MappedRegion::map_readonly(fd, sizeof(EpochPage));
  return m.valid() ? reinterpret_cast<const EpochPage*>(m.data())->epoch.load() : ~0u;
}

ino_t inode(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? st.st_ino : 0;
}

class DirectMoveTest : public DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    dev_.set_direct(true);
    dev_.set_direct_trust(true, {});  // one uid is enough here; the proofs have their own tests
    a_.s->uid = b_.s->uid = ::getuid();
    connect_both();
  }
  /// a -> b granted; the library's view of both own rings (a's sends, b's receives).
  void grant() {
    auto r = dev_.direct_grant(*a_.s, qa_.handle, grant_fds_);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    own_send_ = map_own(grant_fds_[1].get(), r->send_ring_entries);
    own_recv_ = map_own(grant_fds_[2].get(), r->recv_ring_entries);
  }
  /// One SEND that a's library executes itself: b's receive `rid` taken, both completions in
  /// the own rings.
  void direct_send(uint64_t sid, uint64_t rid) {
    post_recv(qb_, rid, mb_.addr, 64, mb_.mr.lkey);
    qb_.rq->consumer.store(qb_.rq->consumer.load() + 1, std::memory_order_release);
    lib_push(own_recv_, rid);
    lib_push(own_send_, sid);
  }
  /// One SEND through a's send queue, executed by `dev`.
  void mediated_send(Device& dev, uint64_t sid, uint64_t rid) {
    post_recv(qb_, rid, mb_.addr, 64, mb_.mr.lkey);
    post_send(qa_, sid, ma_.addr, 8, ma_.mr.lkey);
    dev.poll(now_);
    dev.poll(now_);
  }
  GuestExport export_of(Device& dev, const char* name) {
    auto ex = dev.export_guest(name, [](const Session&) { return -1; });
    EXPECT_TRUE(ex.is_ok()) << ex.status().message();
    return ex.is_ok() ? std::move(ex.value()) : GuestExport{};
  }

  std::vector<UniqueFd> grant_fds_;
  CqV own_send_, own_recv_;
};

TEST_F(DirectMoveTest, GrantsEndBeforeTheFreezeAndTheOwnRingsMoveWithTheGuest) {
  grant();
  direct_send(11, 10);
  const uint32_t a_epoch = epoch_of(grant_fds_[3].get()), b_epoch = epoch_of(grant_fds_[4].get());
  const uint32_t gen = a_.s->control_page()->grant_gen.load();

  // Before the freeze: a's epoch moves, which ends a's grant and every peer's grant into a.
  dev_.end_direct_grants("a");
  EXPECT_GT(epoch_of(grant_fds_[3].get()), a_epoch);
  EXPECT_EQ(epoch_of(grant_fds_[4].get()), b_epoch);

  DirectCookieReq cookie{0x7000, {}};
  for (uint8_t i = 0; i < kDirectCookieBytes; ++i) cookie.cookie[i] = static_cast<uint8_t>(i + 1);
  ASSERT_TRUE(dev_.direct_cookie(*a_.s, cookie));

  GuestExport ex = export_of(dev_, "a");
  const auto doc = nlohmann::json::from_cbor(ex.blob);
  EXPECT_EQ(doc["version"], kStateVersion);
  const auto& jq = doc["sessions"][0]["qps"][0];
  ASSERT_TRUE(jq.contains("own_send"));
  EXPECT_FALSE(jq.contains("own_recv"));  // a's receives were never granted to anyone
  // Its descriptor comes after every session's, named as such.
  EXPECT_EQ(jq["own_send"]["fd"], ex.fds.size() - 1);
  EXPECT_EQ(doc["fdkeys"].back(), fmt::format("s0.own_send.{}", qa_.handle));

  std::vector<UniqueFd> fds = dup_all(ex.fds);
  dev_.detach_guest("a");
  auto r = dev_.import_guest(ex.blob, fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  a_.s = r.value()[0].session;
  // The grants its library holds were the other backend's: they end here too.
  EXPECT_EQ(a_.s->control_page()->grant_gen.load(), gen + 1);
  // Where its library keeps its cookie moved too: b's library can prove again that it may
  // write a (its trust was by session, which is new here).
  EXPECT_EQ(a_.s->cookie_addr, cookie.addr);
  EXPECT_EQ(std::memcmp(a_.s->cookie.data(), cookie.cookie, kDirectCookieBytes), 0);
  EXPECT_TRUE(a_.s->may_write.empty());

  // The library's next SEND goes through the send queue; its completion follows the one it
  // wrote itself in the same ring, and b's receive follows b's (nothing in the CQs' rings).
  mediated_send(dev_, 13, 12);
  EXPECT_EQ(ids(drain(own_send_)), (std::vector<uint64_t>{11, 13}));
  EXPECT_EQ(ids(drain(own_recv_)), (std::vector<uint64_t>{10, 12}));
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_TRUE(drain(bcq_).empty());

  // Asked again, the grant is made again, with the rings the guest already reads.
  std::vector<UniqueFd> again;
  auto g2 = dev_.direct_grant(*a_.s, qa_.handle, again);
  ASSERT_TRUE(g2.is_ok()) << g2.status().message();
  EXPECT_EQ(inode(again[1].get()), inode(grant_fds_[1].get()));
  EXPECT_EQ(inode(again[2].get()), inode(grant_fds_[2].get()));
}

TEST_F(DirectMoveTest, TheStateOfTheRespondingPeerCarriesItsOwnReceiveRing) {
  grant();
  direct_send(21, 20);
  dev_.end_direct_grants("b");
  GuestExport ex = export_of(dev_, "b");
  const auto doc = nlohmann::json::from_cbor(ex.blob);
  ASSERT_TRUE(doc["sessions"][0]["qps"][0].contains("own_recv"));
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  dev_.detach_guest("b");
  auto r = dev_.import_guest(ex.blob, fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  b_.s = r.value()[0].session;
  // The backend resumes b's receive queue where a's library left it (one receive taken).
  mediated_send(dev_, 23, 22);
  EXPECT_EQ(ids(drain(own_send_)), (std::vector<uint64_t>{21, 23}));
  EXPECT_EQ(ids(drain(own_recv_)), (std::vector<uint64_t>{20, 22}));
}

// UD (issue 25): a destination that direct senders feed moves the same way: the grants into it
// end before the freeze, and its own receive ring travels. A lock on its receive side held with
// its own library's tag from before the move (RingHeader::rx_lock) is a live holder's: its
// session came along, and its library may be inside a delivery; the backend waits for it.
TEST_F(DirectMoveTest, AUdDestinationMovesWithItsOwnReceiveRingAndItsLibrarysLockIsWaitedFor) {
  QpV ua = ud_qp(a_, acq_, 9), ub = ud_qp(b_, bcq_, 9);
  UdDest d = ud_dest(b_);
  std::vector<UniqueFd> fds;
  std::string peer;
  auto g = dev_.direct_grant_ud(*a_.s, DirectUdReq{ua.handle, ub.qpn, d}, fds, peer);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  CqV send = map_own(fds[1].get(), g->grant.send_ring_entries);
  CqV recv = map_own(fds[2].get(), g->grant.recv_ring_entries);
  // One datagram a's library delivered itself; then b's own library (sending to itself) holds
  // b's receive side as the move begins.
  post_recv(ub, 30, mb_.addr, 1024, mb_.mr.lkey);
  ub.rq->consumer.store(1, std::memory_order_release);
  lib_push(recv, 30);
  lib_push(send, 31);
  std::vector<UniqueFd> b_fds;  // b's own tag, from a grant of b's (b -> a)
  auto gb = dev_.direct_grant_ud(*b_.s, DirectUdReq{ub.handle, ua.qpn, ud_dest(a_)}, b_fds, peer);
  ASSERT_TRUE(gb.is_ok()) << gb.status().message();
  ub.rq->rx_lock.store(gb->lock_tag);
  const uint32_t epoch = epoch_of(fds[4].get());
  dev_.end_direct_grants("b");
  EXPECT_GT(epoch_of(fds[4].get()), epoch) << "a's grant into b ends before the freeze";
  GuestExport ex = export_of(dev_, "b");
  std::vector<UniqueFd> moved = dup_all(ex.fds);
  dev_.detach_guest("b");
  auto r = dev_.import_guest(ex.blob, moved);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  b_.s = r.value()[0].session;
  // A datagram through a's send queue while the lock is held: lost (UD), the receive untouched.
  post_recv(ub, 32, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, 33, ma_.addr, 8, ma_.mr.lkey, d, ub.qpn, 9);
  dev_.poll(now_);
  dev_.poll(now_);
  EXPECT_EQ(ids(drain(recv)), (std::vector<uint64_t>{30}))
      << "the lock of b's live library was taken over";
  EXPECT_EQ(ub.rq->rx_lock.load(), gb->lock_tag);
  // Given back: the next datagram takes that receive, after the library's.
  ub.rq->rx_lock.store(0);
  post_ud(ua, 34, ma_.addr, 8, ma_.mr.lkey, d, ub.qpn, 9);
  dev_.poll(now_);
  dev_.poll(now_);
  EXPECT_EQ(ids(drain(recv)), (std::vector<uint64_t>{32}));
  EXPECT_EQ(ids(drain(send)), (std::vector<uint64_t>{31, 33, 34}));
  EXPECT_EQ(ub.rq->rx_lock.load(), 0u);
  // Asked again, the grant is made again, at b's new epoch.
  auto again = dev_.direct_grant_ud(*a_.s, DirectUdReq{ua.handle, ub.qpn, d}, fds, peer);
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(again->grant.peer_epoch, epoch_of(fds[4].get()));
}

// keep_state (e2e.keep_state_ud's duplicated datagram): a's library is inside a delivery into b,
// holding b's receive side with the tag the backend gave it, when that backend dies, and the
// next one too: it outlives both, and the third backend, which took both guests in, must not
// take the lock over while a's session lives (two deliveries would take the same receive: its
// completion twice). Once a's session ends (its library died inside the delivery), the lock is
// an orphan and taken over, though the third backend's own first session has the number a had
// on the first (each backend's tags have a random base of their own).
TEST_F(DirectMoveTest, AUdLockOfALibraryThatOutlivedItsBackendsIsWaitedForUntilItsSessionEnds) {
  QpV ua = ud_qp(a_, acq_, 9), ub = ud_qp(b_, bcq_, 9);
  UdDest d = ud_dest(b_);
  std::vector<UniqueFd> fds;
  std::string peer;
  auto g = dev_.direct_grant_ud(*a_.s, DirectUdReq{ua.handle, ub.qpn, d}, fds, peer);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  CqV recv = map_own(fds[2].get(), g->grant.recv_ring_entries);
  ub.rq->rx_lock.store(g->lock_tag);
  Device second{next_quotas_};
  second.set_direct(true);
  {
    GuestExport ka = export_of(dev_, "a"), kb = export_of(dev_, "b");
    std::vector<UniqueFd> fa = dup_all(ka.fds), fb = dup_all(kb.fds);
    ASSERT_TRUE(second.import_guest(ka.blob, fa, true).is_ok());
    ASSERT_TRUE(second.import_guest(kb.blob, fb, true).is_ok());
  }
  Device third{next_quotas_};
  third.set_direct(true);
  G other = open("other", &third);
  ASSERT_EQ(other.s->id, a_.s->id);
  GuestExport ka = export_of(second, "a"), kb = export_of(second, "b");
  std::vector<UniqueFd> fa = dup_all(ka.fds), fb = dup_all(kb.fds);
  auto ra = third.import_guest(ka.blob, fa, true);
  ASSERT_TRUE(ra.is_ok()) << ra.status().message();
  auto rb = third.import_guest(kb.blob, fb, true);
  ASSERT_TRUE(rb.is_ok()) << rb.status().message();
  // Another guest's datagram while the lock is held: lost (UD), the receive untouched.
  CqV ocq = cq(other);
  QpV uo = ud_qp(other, ocq, 9);
  MemV mo = mem(other);
  post_recv(ub, 50, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(uo, 60, mo.addr, 8, mo.mr.lkey, d, ub.qpn, 9);
  third.poll(now_);
  third.poll(now_);
  EXPECT_TRUE(drain(recv).empty()) << "the lock of a's live library was taken over";
  EXPECT_EQ(ub.rq->rx_lock.load(), g->lock_tag);
  // a's library died inside the delivery: its session ends, and the lock is taken over.
  third.close_session(ra.value()[0].session);
  post_ud(uo, 61, mo.addr, 8, mo.mr.lkey, d, ub.qpn, 9);
  third.poll(now_);
  third.poll(now_);
  EXPECT_EQ(ids(drain(recv)), (std::vector<uint64_t>{50}));
  EXPECT_EQ(ub.rq->rx_lock.load(), 0u);
}

// keep_state: the keeper's copy is from the grant; the library went on executing directly
// until the backend died. A new backend takes both guests in from the kept state: the own rings
// resume at what the library wrote, and the dead backend's grants end (its epoch pages cannot
// be written any more: the control page's grant_gen moves instead).
TEST_F(DirectMoveTest, AKeptStateResumesTheOwnRingsAndEndsTheDeadBackendsGrants) {
  grant();
  GuestExport ka = export_of(dev_, "a"), kb = export_of(dev_, "b");
  direct_send(31, 30);
  direct_send(33, 32);
  const uint32_t gen_a = a_.s->control_page()->grant_gen.load();
  const uint32_t gen_b = b_.s->control_page()->grant_gen.load();

  Device fresh{next_quotas_};
  fresh.set_direct(true);
  std::vector<UniqueFd> fa = dup_all(ka.fds), fb = dup_all(kb.fds);
  auto ra = fresh.import_guest(ka.blob, fa, true);
  ASSERT_TRUE(ra.is_ok()) << ra.status().message();
  auto rb = fresh.import_guest(kb.blob, fb, true);
  ASSERT_TRUE(rb.is_ok()) << rb.status().message();
  EXPECT_EQ(ra.value()[0].session->control_page()->grant_gen.load(), gen_a + 1);
  EXPECT_EQ(rb.value()[0].session->control_page()->grant_gen.load(), gen_b + 1);

  mediated_send(fresh, 35, 34);
  EXPECT_EQ(ids(drain(own_send_)), (std::vector<uint64_t>{31, 33, 35}));
  EXPECT_EQ(ids(drain(own_recv_)), (std::vector<uint64_t>{30, 32, 34}));
}

// A snapshot taken before the first grant, restored after it: the rings the grant made stay
// the guest's (its library reads them), the rest comes from the file.
TEST_F(DirectMoveTest, ASnapshotFromBeforeTheGrantRestoresWithTheGuestsOwnRings) {
  GuestExport file = export_of(dev_, "a");
  grant();
  direct_send(41, 40);
  GuestExport now = export_of(dev_, "a");
  EXPECT_EQ(state_fd_layout(file.blob).value(), state_fd_layout(now.blob).value());
  auto blob = with_own_rings_of(file.blob, now.blob);
  ASSERT_TRUE(blob.is_ok()) << blob.status().message();
  std::vector<UniqueFd> fds = dup_all(now.fds);
  dev_.detach_guest("a");
  auto r = dev_.import_guest(blob.value(), fds, true);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  a_.s = r.value()[0].session;
  mediated_send(dev_, 43, 42);
  EXPECT_EQ(ids(drain(own_send_)), (std::vector<uint64_t>{41, 43}));

  // A file of an older version knows no own rings: not restored onto a guest that has some.
  auto old = nlohmann::json::from_cbor(file.blob);
  old["version"] = 6;
  EXPECT_EQ(with_own_rings_of(nlohmann::json::to_cbor(old), now.blob).status().err(), EINVAL);
  // ... but onto a guest without any, as it is; and a malformed file is refused, not thrown.
  const auto old_blob = nlohmann::json::to_cbor(old);
  auto same = with_own_rings_of(old_blob, file.blob);
  ASSERT_TRUE(same.is_ok()) << same.status().message();
  EXPECT_EQ(same.value(), old_blob);
  auto bad = nlohmann::json::from_cbor(file.blob);
  bad["sessions"][0]["qps"][0]["h"] = "one";
  EXPECT_EQ(with_own_rings_of(nlohmann::json::to_cbor(bad), now.blob).status().err(), EINVAL);
}

TEST_F(DirectMoveTest, AnOwnRingOfABadGeometryOrDescriptorIsRefused) {
  grant();
  GuestExport ex = export_of(dev_, "a");
  // The export's descriptors are the device's: kept open past the detach.
  const std::vector<UniqueFd> kept = dup_all(ex.fds);
  ex.fds.clear();
  for (const UniqueFd& f : kept) ex.fds.push_back(f.get());
  dev_.detach_guest("a");
  for (int bad = 0; bad < 4; ++bad) {
    SCOPED_TRACE(bad);
    auto doc = nlohmann::json::from_cbor(ex.blob);
    auto& own = doc["sessions"][0]["qps"][0]["own_send"];
    if (bad == 0) own["size"] = 3;
    if (bad == 1) own["stamps"] = 1u << 20;
    if (bad == 2) own["fd"] = 0;           // the control page's, already taken
    if (bad == 3) own["size"] = 1u << 20;  // larger than its memfd
    std::vector<UniqueFd> fds = dup_all(ex.fds);
    auto r = dev_.import_guest(nlohmann::json::to_cbor(doc), fds);
    EXPECT_EQ(r.status().err(), EINVAL);
    EXPECT_NE(r.status().message().find(bad == 2 ? "descriptor 'fd' = 0" : "own_send"),
              std::string::npos)
        << r.status().message();
    EXPECT_FALSE(dev_.has_guest("a"));
  }
  // And a version 6 blob has none: it imports, its QPs without own rings.
  auto doc = nlohmann::json::from_cbor(ex.blob);
  doc["version"] = 6;
  in_flight_as_version_9(doc, [](const nlohmann::json&) { return nullptr; });
  doc["fdkeys"].erase(doc["fdkeys"].size() - 1);
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  auto r = dev_.import_guest(nlohmann::json::to_cbor(doc), fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r.value()[0].session->qps.begin()->second->own_send, nullptr);
}

}  // namespace
}  // namespace vrdma::engine::devtest
