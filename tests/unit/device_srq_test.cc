// Shared receive queues in the device model: several QPs draw receives from one SRQ, a QP
// entering ERR leaves the SRQ's receives alone, and the SRQ limit event fires once when armed.
#include <fcntl.h>
#include <unistd.h>

#include "device_fixture.h"

namespace vrdma::engine::devtest {
namespace {

class DeviceSrqTest : public DeviceTest {
 protected:
  /// The direct path on (one uid is enough here), SRQ `s` of b with QP b1 on it connected to
  /// a's QP (a's rnr_retry `rnr_retry`); the grant of a into b1 is the caller's.
  void fed_srq(SrqV& s, QpV& b1, uint8_t rnr_retry = 7) {
    dev_.set_direct(true);
    dev_.set_direct_trust(true, {});
    a_.s->uid = b_.s->uid = ::getuid();
    s = srq(b_, 16, 0);
    b1 = srq_qp(b_, bcq_, s);
    connect(a_, qa_, b_, b1, rnr_retry);
    connect(b_, b1, a_, qa_);
  }
  /// An own completion ring of a grant (kDirectGrant's descriptor 1 or 2), as a library maps it.
  static CqV own_ring(int fd, uint32_t entries) {
    CqV c;
    c.map = MappedRegion::map_shared(fd, ring_bytes(entries, sizeof(Cqe)));
    EXPECT_TRUE(c.map.valid());
    c.hdr = reinterpret_cast<RingHeader*>(c.map.data());
    c.e = ring_entries<Cqe>(c.hdr);
    c.size = entries;
    return c;
  }
};

TEST_F(DeviceSrqTest, TwoQpsShareOneSrqAndTheLimitEventFiresOnce) {
  SrqV s = srq(b_, 16, 3);
  QpV b1 = srq_qp(b_, bcq_, s), b2 = srq_qp(b_, bcq_, s);
  QpV a2 = qp(a_, acq_, acq_);
  connect(a_, qa_, b_, b1);
  connect(b_, b1, a_, qa_);
  connect(a_, a2, b_, b2);
  connect(b_, b2, a_, a2);
  for (int i = 0; i < 5; ++i) post_srq(s, 100 + i, mb_.addr + 512 * i, 512, mb_.mr.lkey);
  post_send(qa_, 1, ma_.addr, 16, ma_.mr.lkey);
  post_send(a2, 2, ma_.addr, 16, ma_.mr.lkey);
  post_send(qa_, 3, ma_.addr, 16, ma_.mr.lkey);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 3u);
  int on_b1 = 0, on_b2 = 0;
  for (size_t i = 0; i < rx.size(); ++i) {
    EXPECT_EQ(rx[i].wr_id, 100u + i) << "the SRQ hands out receives in order, whichever QP";
    EXPECT_EQ(rx[i].status, IBV_WC_SUCCESS);
    on_b1 += rx[i].qp_num == b1.qpn;
    on_b2 += rx[i].qp_num == b2.qpn;
  }
  EXPECT_EQ(on_b1, 2);
  EXPECT_EQ(on_b2, 1);
  // 5 posted, 3 used: 2 left < limit 3 -> one SRQ_LIMIT_REACHED, and the limit disarms.
  auto ev = async_events(b_);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].first, uint32_t{IBV_EVENT_SRQ_LIMIT_REACHED});
  EXPECT_EQ(ev[0].second, s.handle);
  EXPECT_EQ(dev_.query_srq(*b_.s, s.handle)->srq_limit, 0u);
  post_send(qa_, 4, ma_.addr, 16, ma_.mr.lkey);
  dev_.poll(now_);
  EXPECT_EQ(drain(bcq_).size(), 1u);
  EXPECT_TRUE(async_events(b_).empty());
  // A QP in ERR does not flush the SRQ's receives: the other QP still gets the last one.
  QpAttr err{};
  err.qp_state = IBV_QPS_ERR;
  ASSERT_TRUE(modify(b_, b1, IBV_QP_STATE, err));
  dev_.poll(now_);
  for (const Cqe& c : drain(bcq_)) EXPECT_NE(c.wr_id, 104u) << "the SRQ's WQE was flushed";
  post_send(a2, 5, ma_.addr, 16, ma_.mr.lkey);
  dev_.poll(now_);
  rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 104u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  // In use: the SRQ cannot go away.
  EXPECT_EQ(dev_.destroy_srq(*b_.s, s.handle).err(), EBUSY);
}

TEST_F(DeviceSrqTest, ModifyArmsTheLimitAndRefusesResize) {
  SrqV s = srq(b_, 8, 0);
  EXPECT_EQ(dev_.modify_srq(*b_.s, ModifySrqReq{s.handle, IBV_SRQ_MAX_WR, SrqAttr{16, 0, 0, 0}})
                .err(),
            EINVAL);
  EXPECT_EQ(dev_.modify_srq(*b_.s, ModifySrqReq{s.handle, IBV_SRQ_LIMIT, SrqAttr{0, 0, 99, 0}})
                .err(),
            EINVAL);
  EXPECT_TRUE(dev_.modify_srq(*b_.s, ModifySrqReq{s.handle, IBV_SRQ_LIMIT, SrqAttr{0, 0, 4, 0}}));
  EXPECT_EQ(dev_.query_srq(*b_.s, s.handle)->srq_limit, 4u);
  EXPECT_TRUE(dev_.destroy_srq(*b_.s, s.handle));
  EXPECT_EQ(totals()["srq"], 0);
}

// The direct path into an SRQ (issue 25): a grant for a QP on one carries the SRQ's ring and a
// lock tag, only to a library that asks for it (kDirectGrantSrq). From then on the backend takes
// the SRQ's rx_lock for each receive: a library that holds it a moment costs the requester no
// RNR retry (rnr_retry 0 here: one would fail it), a hold that lasts is an RNR NAK, a holder
// whose session is gone is taken over; an armed limit is in the SRQ's header for the libraries.
TEST_F(DeviceSrqTest, ASrqThatLibrariesFeedIsTakenUnderItsLockWithoutCostingAnRnr) {
  SrqV s;
  QpV b1;
  fed_srq(s, b1, /*rnr_retry=*/0);
  std::vector<UniqueFd> fds;
  EXPECT_EQ(dev_.direct_grant(*a_.s, qa_.handle, fds).err(), EOPNOTSUPP)
      << "a library that cannot feed an SRQ gets no grant into one";
  auto g = dev_.direct_grant(*a_.s, qa_.handle, fds, kDirectGrantSrq);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  EXPECT_NE(g->lock_tag, 0u);
  EXPECT_EQ(g->peer_rq_entries, s.size);
  EXPECT_EQ(g->peer_rq_offset, 0u);
  EXPECT_EQ(s.hdr->armed.load(), 1u);
  CqV own = own_ring(fds[1].get(), g->send_ring_entries);  // a's send completions from now on
  MappedRegion ring = MappedRegion::map_shared(fds[0].get(), g->peer_ring_bytes);
  ASSERT_TRUE(ring.valid());
  auto* seen = reinterpret_cast<RingHeader*>(ring.data());
  post_srq(s, 100, mb_.addr, 64, mb_.mr.lkey);
  EXPECT_EQ(seen->producer.load(), 1u) << "the grant's ring is the SRQ's";

  // A library holds the lock: the SEND through a's send queue waits, then goes through.
  s.hdr->rx_lock.store(g->lock_tag);
  post_send(qa_, 1, ma_.addr, 16, ma_.mr.lkey);
  dev_.poll(now_);
  EXPECT_TRUE(drain(own).empty()) << "no RNR NAK (rnr_retry 0 would have failed it)";
  EXPECT_EQ(s.hdr->consumer.load(), 0u);
  s.hdr->rx_lock.store(0);
  now_ += 1'000'000;
  dev_.poll(now_);
  auto done = drain(own);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(s.hdr->consumer.load(), 1u);
  EXPECT_EQ(s.hdr->rx_lock.load(), 0u) << "given back";

  // A library took a receive itself (the consumer index moved): the backend resumes after it.
  post_srq(s, 101, mb_.addr, 64, mb_.mr.lkey);
  post_srq(s, 102, mb_.addr + 64, 64, mb_.mr.lkey);
  s.hdr->consumer.store(2, std::memory_order_release);
  // A holder whose session is gone (a process killed inside a delivery): taken over at once.
  s.hdr->rx_lock.store(0x7fff0000u);
  post_send(qa_, 2, ma_.addr, 16, ma_.mr.lkey);
  dev_.poll(now_);
  done = drain(own);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(s.hdr->consumer.load(), 3u);

  // The limit, armed after the grant, is where libraries look; the event clears it.
  ASSERT_TRUE(dev_.modify_srq(*b_.s, ModifySrqReq{s.handle, IBV_SRQ_LIMIT, SrqAttr{0, 0, 2, 0}}));
  EXPECT_EQ(s.hdr->srq_limit.load(), 2u);
  for (int i = 0; i < 2; ++i) post_srq(s, 103 + i, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 3, ma_.addr, 16, ma_.mr.lkey);
  dev_.poll(now_);
  EXPECT_EQ(drain(own).size(), 1u);
  auto ev = async_events(b_);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].first, uint32_t{IBV_EVENT_SRQ_LIMIT_REACHED});
  EXPECT_EQ(s.hdr->srq_limit.load(), 0u);

  // Held for long (a guest that never gives it back): an RNR NAK after all.
  s.hdr->rx_lock.store(g->lock_tag);
  post_send(qa_, 4, ma_.addr, 16, ma_.mr.lkey);
  dev_.poll(now_);
  EXPECT_TRUE(drain(own).empty());
  now_ += 200'000'000;
  dev_.poll(now_);
  done = drain(own);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
  s.hdr->rx_lock.store(0);
  std::vector<Cqe> rx = drain(bcq_);
  for (const Cqe& c : rx) EXPECT_EQ(c.status, IBV_WC_SUCCESS);
}

// A fed SRQ taken in by the next backend (keep_state's restart here; a move reads the same
// header): it is still locked for its consumers (the header's `armed`), its armed limit is in
// the header again, the cursor is the shared one (a library took a receive the backend never
// saw), and the lock a library left whose session ended before the restart (its process died
// inside a delivery) is taken over. (A session that was kept is a live holder's: see
// DirectMoveTest.AUdLockOfALibraryThatOutlivedItsBackendsIsWaitedForUntilItsSessionEnds.)
TEST_F(DeviceSrqTest, AFedSrqTakenInByTheNextBackendKeepsItsCursorLimitAndLosesAnOrphanLock) {
  SrqV s;
  QpV b1;
  fed_srq(s, b1);
  std::vector<UniqueFd> fds;
  auto g = dev_.direct_grant(*a_.s, qa_.handle, fds, kDirectGrantSrq);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  CqV recv = own_ring(fds[2].get(), g->recv_ring_entries);
  ASSERT_TRUE(dev_.modify_srq(*b_.s, ModifySrqReq{s.handle, IBV_SRQ_LIMIT, SrqAttr{0, 0, 1, 0}}));
  for (int i = 0; i < 3; ++i) post_srq(s, 200 + i, mb_.addr + 64 * i, 64, mb_.mr.lkey);
  s.hdr->consumer.store(1, std::memory_order_release);  // a's library took 200
  // c's library died inside the next one (a tag is the session's id plus the backend's base).
  G c = open("c");
  const uint32_t c_tag = g->lock_tag - a_.s->id + c.s->id;
  dev_.close_session(c.s);
  s.hdr->rx_lock.store(c_tag);
  s.hdr->srq_limit.store(0);                            // (a guest's write: the backend's is kept)
  auto ka = dev_.export_guest("a", [](const Session&) { return -1; });
  auto kb = dev_.export_guest("b", [](const Session&) { return -1; });
  ASSERT_TRUE(ka.is_ok() && kb.is_ok());

  Device fresh{next_quotas_};
  fresh.set_direct(true);
  std::vector<UniqueFd> fa = dup_all(ka->fds), fb = dup_all(kb->fds);
  auto ra = fresh.import_guest(ka->blob, fa, true);
  ASSERT_TRUE(ra.is_ok()) << ra.status().message();
  auto rb = fresh.import_guest(kb->blob, fb, true);
  ASSERT_TRUE(rb.is_ok()) << rb.status().message();
  EXPECT_EQ(s.hdr->srq_limit.load(), 1u);
  post_send(qa_, 5, ma_.addr, 16, ma_.mr.lkey);
  fresh.poll(now_);
  fresh.poll(now_);
  auto rx = drain(recv);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 201u) << "the shared cursor, past the library's receive";
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(s.hdr->consumer.load(), 2u);
  EXPECT_EQ(s.hdr->rx_lock.load(), 0u) << "taken over and given back";
  // One posted left, the limit (1) not crossed; the next receive crosses it: the event fires
  // (the limit disarms, in the header too).
  Session& b = *rb.value()[0].session;
  EXPECT_EQ(fresh.query_srq(b, s.handle)->srq_limit, 1u);
  post_send(qa_, 6, ma_.addr, 16, ma_.mr.lkey);
  fresh.poll(now_);
  EXPECT_EQ(drain(recv).size(), 1u);
  EXPECT_EQ(fresh.query_srq(b, s.handle)->srq_limit, 0u);
  EXPECT_EQ(s.hdr->srq_limit.load(), 0u);
}

// XRC: a receive QP outlives the session that created it while another session of the guest
// holds it (ibv_open_qp), and its domain lives while anything is in it; a domain is the guest's,
// found again by the file's inode, and another guest's domain of the same file is another.
TEST_F(DeviceSrqTest, AnXrcReceiveQpLivesWhileASessionHoldsIt) {
  char path[] = "/tmp/vrdma-xrc-unit-XXXXXX";
  UniqueFd file(::mkstemp(path));
  ASSERT_TRUE(file.valid());
  ::unlink(path);
  auto dup = [&] { return UniqueFd(::dup(file.get())); };
  G a2 = open("a");
  auto xa = dev_.open_xrcd(*a_.s, OpenXrcdReq{O_CREAT, 0}, dup());
  ASSERT_TRUE(xa.is_ok());
  EXPECT_EQ(dev_.open_xrcd(*b_.s, OpenXrcdReq{0, 0}, dup()).err(), ENOENT);  // another guest
  auto x2 = dev_.open_xrcd(*a2.s, OpenXrcdReq{0, 0}, dup());
  ASSERT_TRUE(x2.is_ok()) << x2.status().message();
  CreateQpReq req{};
  req.qp_type = IBV_QPT_XRC_RECV;
  req.xrcd = xa.value();
  UniqueFd none;
  auto tgt = dev_.create_qp(*a_.s, req, none);
  ASSERT_TRUE(tgt.is_ok()) << tgt.status().message();
  EXPECT_FALSE(none.valid());  // no rings
  auto opened = dev_.open_qp(*a2.s, OpenQpReq{x2.value(), tgt->qpn, IBV_QPT_XRC_RECV, 0});
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  EXPECT_EQ(dev_.open_qp(*a2.s, OpenQpReq{x2.value(), tgt->qpn + 1, IBV_QPT_XRC_RECV, 0}).err(),
            EINVAL);
  EXPECT_EQ(dev_.close_xrcd(*a2.s, x2.value()).err(), EBUSY);  // its QP handle is in it
  dev_.close_session(a_.s);
  a_.s = nullptr;
  // Still there for the other session, whose handle its async events now carry: it queries and
  // modifies it.
  const Qp& held = *a2.s->guest->xrc_qps.at(tgt->qpn);
  EXPECT_EQ(held.owner, a2.s);
  EXPECT_EQ(held.handle, opened->handle);
  auto q = dev_.query_qp(*a2.s, opened->handle);
  ASSERT_TRUE(q.is_ok()) << q.status().message();
  ModifyQpReq m{
      opened->handle, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, {}};
  m.attr.qp_state = IBV_QPS_INIT;
  m.attr.port_num = 1;
  EXPECT_TRUE(dev_.modify_qp(*a2.s, m).is_ok());
  EXPECT_EQ(a2.s->guest->used[static_cast<size_t>(Res::kQp)], 1u);
  ASSERT_TRUE(dev_.destroy_qp(*a2.s, opened->handle).is_ok());
  EXPECT_EQ(a2.s->guest->used[static_cast<size_t>(Res::kQp)], 0u);
  EXPECT_TRUE(a2.s->guest->xrc_qps.empty());
  ASSERT_TRUE(dev_.close_xrcd(*a2.s, x2.value()).is_ok());
  EXPECT_TRUE(a2.s->guest->xrcds.empty());
}

}  // namespace
}  // namespace vrdma::engine::devtest
