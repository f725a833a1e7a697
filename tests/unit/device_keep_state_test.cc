// keep_state's exactly-once (docs/ARCHITECTURE.md, "Moving a guest's device", keep_state): a
// backend SIGKILLed between two steps of a message (the receive taken, its completion pushed,
// the send retired or the PSN published) and restarted from the kept state delivers that
// message once, on one host and across backends. The device stops dead at a kill point
// (Device::kill_at), leaving the shared memory as the signal would; a second Device then takes
// the guests in from the state kept before the traffic, as the keeper's restart does.
#include "loopback_fixture.h"

namespace vrdma::engine::devtest {
namespace {

using KillPoint = Device::KillPoint;

/// A guest's state as the keeper holds it: the blob and duplicates of its descriptors.
struct Kept {
  GuestExport ex;
  std::vector<UniqueFd> fds;
};

Kept keep(Device& d, const char* name) {
  auto ex = d.export_guest(name, [](const Session&) { return -1; });
  EXPECT_TRUE(ex.is_ok()) << ex.status().message();
  if (!ex.is_ok()) return {};
  std::vector<UniqueFd> fds = dup_all(ex->fds);
  return {std::move(ex.value()), std::move(fds)};
}

/// Both guests taken in by a restarted backend from what the keeper held.
void restart(Device& into, Kept& a, Kept& b) {
  for (Kept* k : {&a, &b}) {
    auto r = into.import_guest(k->ex.blob, k->fds, true);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
  }
}

const char* point_name(KillPoint p) {
  return p == KillPoint::kReceiveTaken ? "ReceiveTaken" : "ReceiveCompleted";
}

class KeepStateLocalTest : public DeviceTest, public ::testing::WithParamInterface<KillPoint> {};

// a sends b one message on one host; the backend dies with b's receive taken (and, at the
// second point, completed) and a's send not retired. The restarted backend sends a's WQE
// again: b's record says it was delivered, so it completes at a, and b has it once.
TEST_P(KeepStateLocalTest, ASendDeliveredBeforeTheKillIsNotDeliveredAgain) {
  connect_both();
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_recv(qb_, 2, mb_.addr + 64, 64, mb_.mr.lkey);
  Kept ka = keep(dev_, "a"), kb = keep(dev_, "b");
  std::memset(ma_.p(), 0x5a, 8);
  post_send(qa_, 7, ma_.addr, 8, ma_.mr.lkey);
  dev_.kill_at(GetParam());
  dev_.poll(now_);
  ASSERT_EQ(qb_.rq->consumer.load(), 1u);  // what the kill left: the receive taken ...
  ASSERT_EQ(qa_.sq->consumer.load(), 0u);  // ... the send not retired
  ASSERT_EQ(bcq_.hdr->producer.load(), GetParam() == KillPoint::kReceiveTaken ? 0u : 1u);

  Device restarted{next_quotas_};
  restart(restarted, ka, kb);
  for (int i = 0; i < 4; ++i) restarted.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u) << "delivered twice, or lost";
  EXPECT_EQ(rx[0].wr_id, 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].byte_len, 8u);
  EXPECT_EQ(mb_.p()[0], 0x5a);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].wr_id, 7u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(qb_.rq->consumer.load(), 1u);  // the second receive is still posted

  // And the pair goes on: the next message takes the next receive.
  post_send(qa_, 8, ma_.addr, 8, ma_.mr.lkey);
  restarted.poll(now_);
  rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 2u);
  EXPECT_EQ(drain(acq_).size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(KillPoints, KeepStateLocalTest,
                         ::testing::Values(KillPoint::kReceiveTaken, KillPoint::kReceiveCompleted),
                         [](const auto& i) { return point_name(i.param); });

class KeepStateUdTest : public DeviceTest, public ::testing::WithParamInterface<KillPoint> {};

// The same for a datagram (UD): a's datagram taken by b's receive (and, at the second point,
// completed) when the backend dies, a's WQE not retired. UD loses datagrams, never duplicates
// one: the restarted backend retires a's WQE as sent and b has the datagram once. A datagram of
// another sender c to the same receive side, first after the restart, is not taken for the
// replay (b's record names a), and lands.
TEST_P(KeepStateUdTest, ADatagramDeliveredBeforeTheKillIsNotDeliveredAgain) {
  // c: another sender, its SQ index the same as a's, and looked at first.
  QpV uc = ud_qp(a_, acq_, 0x11), ua = ud_qp(a_, acq_, 0x11), ub = ud_qp(b_, bcq_, 0x11);
  UdDest to_b{};
  to_b.dlid = static_cast<uint16_t>(b_.hello.lid);
  for (uint64_t i = 1; i <= 3; ++i) post_recv(ub, i, mb_.addr + (i - 1) * 128, 128, mb_.mr.lkey);
  Kept ka = keep(dev_, "a"), kb = keep(dev_, "b");
  std::memset(ma_.p(), 0x5a, 8);
  post_ud(ua, 7, ma_.addr, 8, ma_.mr.lkey, to_b, ub.qpn, 0x11);
  dev_.kill_at(GetParam());
  dev_.poll(now_);
  ASSERT_EQ(ub.rq->consumer.load(), 1u);  // what the kill left: the receive taken ...
  ASSERT_EQ(ua.sq->consumer.load(), 0u);  // ... the send not retired
  ASSERT_EQ(bcq_.hdr->producer.load(), GetParam() == KillPoint::kReceiveTaken ? 0u : 1u);

  Device restarted{next_quotas_};
  restart(restarted, ka, kb);
  std::memset(ma_.p() + 64, 0x6b, 8);
  post_ud(uc, 9, ma_.addr + 64, 8, ma_.mr.lkey, to_b, ub.qpn, 0x11);
  for (int i = 0; i < 4; ++i) restarted.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 2u) << "a's datagram delivered twice, or c's taken for a's replay";
  EXPECT_EQ(rx[0].wr_id, 1u);
  EXPECT_EQ(rx[0].src_qp, ua.qpn);
  EXPECT_EQ(rx[1].wr_id, 2u);
  EXPECT_EQ(rx[1].src_qp, uc.qpn);
  EXPECT_EQ(mb_.p()[kGrhBytes], 0x5a);
  EXPECT_EQ(mb_.p()[128 + kGrhBytes], 0x6b);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 2u);
  for (const auto& c : tx) EXPECT_EQ(c.status, IBV_WC_SUCCESS);
  EXPECT_EQ(ub.rq->consumer.load(), 2u);  // the third receive is still posted
}

INSTANTIATE_TEST_SUITE_P(KillPoints, KeepStateUdTest,
                         ::testing::Values(KillPoint::kReceiveTaken, KillPoint::kReceiveCompleted),
                         [](const auto& i) { return point_name(i.param); });

/// Runs a restarted device and its transport until nothing moves.
void settle_restarted(Device& d, FakeLoop& loop, uint64_t now) {
  for (int i = 0; i < 100; ++i) {
    const bool did = d.poll(now);
    if (loop.q.empty() && !did) return;
    while (!loop.q.empty()) {
      FakeLoop::Sent s = std::move(loop.q.front());
      loop.q.pop_front();
      deliver(s, d, "me");
    }
  }
}

/// Across backends: the same pair with TCP forced; the restarted backend gets a transport of its
/// own (the dead one's connections died with it, and what they held).
class KeepStateRemoteTest : public DeviceRemoteTest,
                            public ::testing::WithParamInterface<std::tuple<KillPoint, uint32_t>> {
};

// a's SEND reaches b's backend over the transport (one small message, or 4 KiB, as a payload
// streamed into the receive); the backend dies between taking or completing b's receive and
// publishing b's expected PSN. a's requester sends it again from its SQ: b's record says it
// was delivered, so it is acknowledged, not delivered again.
TEST_P(KeepStateRemoteTest, ASendDeliveredBeforeTheKillIsAcknowledgedNotDeliveredAgain) {
  const auto [point, len] = GetParam();
  connect_both();
  post_recv(qb_, 1, mb_.addr, 4096, mb_.mr.lkey);
  post_recv(qb_, 2, mb_.addr + 4096, 4096, mb_.mr.lkey);
  Kept ka = keep(dev_, "a"), kb = keep(dev_, "b");
  for (uint32_t i = 0; i < len; ++i) ma_.p()[i] = static_cast<uint8_t>(i * 7 + 1);
  post_send(qa_, 7, ma_.addr, len, ma_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 1u);
  dev_.kill_at(point);
  EXPECT_EQ(pump(1), 1);
  loop_.q.clear();
  ASSERT_EQ(qb_.rq->consumer.load(), 1u);
  ASSERT_EQ(qa_.sq->consumer.load(), 0u);

  FakeLoop loop;
  Device restarted{next_quotas_};
  restarted.set_transport(&loop);
  restart(restarted, ka, kb);
  settle_restarted(restarted, loop, now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u) << "delivered twice, or lost";
  EXPECT_EQ(rx[0].wr_id, 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].byte_len, len);
  EXPECT_EQ(std::memcmp(mb_.p(), ma_.p(), len), 0);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].wr_id, 7u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);

  post_send(qa_, 8, ma_.addr, 8, ma_.mr.lkey);
  settle_restarted(restarted, loop, now_);
  rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 2u);
  EXPECT_EQ(drain(acq_).size(), 1u);
  restarted.set_transport(nullptr);
}

INSTANTIATE_TEST_SUITE_P(KillPoints, KeepStateRemoteTest,
                         ::testing::Combine(::testing::Values(KillPoint::kReceiveTaken,
                                                              KillPoint::kReceiveCompleted),
                                            ::testing::Values(8u, 4096u)),
                         [](const auto& i) {
                           return std::string(point_name(std::get<0>(i.param))) + "_" +
                                  std::to_string(std::get<1>(i.param));
                         });

// a's requester retired the SEND on b's ACK and died between storing the next PSN and moving
// its SQ's consumer: the restart sends that WQE again under its own PSN (psn_at names the index
// it is for), so b acknowledges the duplicate instead of taking it as the next message.
TEST_F(DeviceRemoteTest, KeepStateASendRetiredHalfwayIsSentAgainUnderItsOwnPsn) {
  connect_both();
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_recv(qb_, 2, mb_.addr + 64, 64, mb_.mr.lkey);
  Kept ka = keep(dev_, "a"), kb = keep(dev_, "b");
  post_send(qa_, 7, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  EXPECT_EQ(pump(1), 1);  // the request: b takes it and acknowledges
  dev_.kill_at(KillPoint::kSendPsnPublished);
  EXPECT_EQ(pump(1), 1);  // the ACK: a retires the WQE, and dies halfway
  loop_.q.clear();
  ASSERT_EQ(qa_.sq->consumer.load(), 0u);
  ASSERT_EQ(drain(bcq_).size(), 1u);

  FakeLoop loop;
  Device restarted{next_quotas_};
  restarted.set_transport(&loop);
  restart(restarted, ka, kb);
  settle_restarted(restarted, loop, now_);
  EXPECT_TRUE(drain(bcq_).empty()) << "delivered again";
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].wr_id, 7u);
  post_send(qa_, 8, ma_.addr, 8, ma_.mr.lkey);
  settle_restarted(restarted, loop, now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 2u);
  restarted.set_transport(nullptr);
}

// An atomic from another backend executed, its PSN published, its answer not sent when the
// backend died: the replay is answered with the result from b's ring, not executed again
// (and not refused for a result the restarted backend does not know).
TEST_F(DeviceRemoteTest, KeepStateAnAtomicExecutedBeforeTheKillIsAnsweredNotExecutedAgain) {
  MemV word = connect_with_atomic_word(40);
  Kept ka = keep(dev_, "a"), kb = keep(dev_, "b");
  post_rdma(qa_, 7, IBV_WR_ATOMIC_FETCH_AND_ADD, ma_.addr, 8, ma_.mr.lkey, word.addr, word.mr.rkey);
  dev_.poll(now_);
  dev_.kill_at(KillPoint::kAtomicExecuted);
  EXPECT_EQ(pump(1), 1);
  loop_.q.clear();

  FakeLoop loop;
  Device restarted{next_quotas_};
  restarted.set_transport(&loop);
  restart(restarted, ka, kb);
  settle_restarted(restarted, loop, now_);
  uint64_t v = 0, got = 0;
  std::memcpy(&v, word.p(), 8);
  EXPECT_EQ(v, 41u);  // added once
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  std::memcpy(&got, ma_.p(), 8);
  EXPECT_EQ(got, 40u);
  restarted.set_transport(nullptr);
}

// b's backend died with an SRQ receive held for a message from another backend whose payload had
// not all come: the restarted backend delivers the message, sent again, into that receive, once.
// Then one that died inside a take (the receive copied and flagged, the SRQ's cursor not moved
// past it yet, as such a kill leaves the ring): the restart moves the cursor on, so the next two
// messages take that receive and the one after it, not that one twice.
TEST_F(DeviceRemoteTest, KeepStateAnSrqReceiveHeldAtTheKillTakesTheMessageSentAgain) {
  SrqV s = srq(b_, 16, 0);
  QpV b1 = srq_qp(b_, bcq_, s);
  connect(a_, qa_, b_, b1);
  connect(b_, b1, a_, qa_);
  for (int i = 0; i < 4; ++i) post_srq(s, 100 + i, mb_.addr + 512 * i, 512, mb_.mr.lkey);
  Kept ka = keep(dev_, "a"), kb = keep(dev_, "b");
  std::memset(ma_.p(), 0x77, 32);
  post_send(qa_, 7, ma_.addr, 32, ma_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 1u);
  Begun cut = begin_delivery(loop_.q.front(), dev_, "me");  // then the backend dies
  loop_.q.clear();
  dev_.kill_at(KillPoint::kReceiveTaken);
  ASSERT_EQ(b1.rq->srq_taken.load(), kSrqTaken);
  ASSERT_EQ(s.hdr->consumer.load(), 1u);

  FakeLoop loop;
  Device restarted{next_quotas_};
  restarted.set_transport(&loop);
  restart(restarted, ka, kb);
  settle_restarted(restarted, loop, now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 100u);
  EXPECT_EQ(rx[0].byte_len, 32u);
  EXPECT_EQ(mb_.p()[31], 0x77);
  ASSERT_EQ(drain(acq_).size(), 1u);
  EXPECT_EQ(s.hdr->consumer.load(), 1u);

  // Died inside the next take: receive 101 copied and flagged, the SRQ still at 1.
  Kept ka2 = keep(restarted, "a"), kb2 = keep(restarted, "b");
  restarted.kill_at(KillPoint::kReceiveTaken);
  b1.rqe[0] = s.e[1];
  b1.rq->srq_taken_at.store(1);
  b1.rq->srq_taken.store(kSrqTaken);
  FakeLoop loop2;
  Device again{next_quotas_};
  again.set_transport(&loop2);
  restart(again, ka2, kb2);
  EXPECT_EQ(s.hdr->consumer.load(), 2u) << "the take finished by the restart";
  post_send(qa_, 8, ma_.addr, 8, ma_.mr.lkey);
  post_send(qa_, 9, ma_.addr, 8, ma_.mr.lkey);
  settle_restarted(again, loop2, now_);
  rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 2u);
  EXPECT_EQ(rx[0].wr_id, 101u);
  EXPECT_EQ(rx[1].wr_id, 102u);
  EXPECT_EQ(s.hdr->consumer.load(), 3u);
  restarted.set_transport(nullptr);
  again.set_transport(nullptr);
}

}  // namespace
}  // namespace vrdma::engine::devtest
