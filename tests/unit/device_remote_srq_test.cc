// SRQs behind the backends' TCP responder (issue 25's "SRQ across backends"): a message whose
// payload comes over several turns holds its SRQ receive from its start (RingHeader::srq_taken),
// so a message to another QP of the SRQ meanwhile takes the next one; a message cut off and sent
// again lands in the receive it held; a QP that fails flushes the receive it held.
#include "loopback_fixture.h"

namespace vrdma::engine::devtest {
namespace {

class DeviceRemoteSrqTest : public DeviceRemoteTest {
 protected:
  /// b's SRQ with b1 and b2 on it, connected to a's qa_ and a2 (through the transport), and
  /// receives 100, 101, 102 of 512 bytes in it.
  void SetUp() override {
    DeviceRemoteTest::SetUp();
    s_ = srq(b_, 16, 0);
    b1_ = srq_qp(b_, bcq_, s_);
    b2_ = srq_qp(b_, bcq_, s_);
    a2_ = qp(a_, acq_, acq_);
    connect(a_, qa_, b_, b1_);
    connect(b_, b1_, a_, qa_);
    connect(a_, a2_, b_, b2_);
    connect(b_, b2_, a_, a2_);
    for (int i = 0; i < 3; ++i) post_srq(s_, 100 + i, mb_.addr + 512 * i, 512, mb_.mr.lkey);
  }
  /// The receive completions of b, by wr_id.
  std::map<uint64_t, Cqe> receives() {
    std::map<uint64_t, Cqe> out;
    for (const Cqe& c : drain(bcq_)) EXPECT_TRUE(out.emplace(c.wr_id, c).second) << c.wr_id;
    return out;
  }
  SrqV s_;
  QpV b1_, b2_, a2_;
};

// Two SENDs to two QPs of one SRQ; the first one's payload comes after the whole second one.
TEST_F(DeviceRemoteSrqTest, AMessageToAnotherQpOfTheSrqMeanwhileTakesTheNextReceive) {
  std::memset(ma_.p(), 0xa1, 16);
  std::memset(ma_.p() + 64, 0xa2, 24);
  post_send(qa_, 1, ma_.addr, 16, ma_.mr.lkey);
  post_send(a2_, 2, ma_.addr + 64, 24, ma_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 2u);
  FakeLoop::Sent first = std::move(loop_.q.front()), second = std::move(loop_.q.back());
  loop_.q.clear();
  Begun b = begin_delivery(first, dev_, "me");  // b1's receive chosen, its payload not in
  EXPECT_EQ(b1_.rq->srq_taken.load(), kSrqTaken) << "held from the message's start";
  deliver(second, dev_, "me");
  finish_delivery(b, dev_, "me");
  auto rx = receives();
  ASSERT_EQ(rx.size(), 2u) << "one receive each";
  ASSERT_EQ(rx.count(100), 1u);
  ASSERT_EQ(rx.count(101), 1u);
  EXPECT_EQ(rx[100].qp_num, b1_.qpn);
  EXPECT_EQ(rx[100].byte_len, 16u);
  EXPECT_EQ(rx[101].qp_num, b2_.qpn);
  EXPECT_EQ(rx[101].byte_len, 24u);
  for (int i = 0; i < 16; ++i) ASSERT_EQ(mb_.p()[i], 0xa1) << i;
  for (int i = 0; i < 24; ++i) ASSERT_EQ(mb_.p()[512 + i], 0xa2) << i;
  EXPECT_EQ(s_.hdr->consumer.load(), 2u) << "receive 102 still posted";
  EXPECT_EQ(b1_.rq->srq_taken.load(), 0u);
  EXPECT_EQ(pump(), 2);  // the ACKs
  EXPECT_EQ(drain(acq_).size(), 2u);
}

// The connection breaks in the middle of a SEND's payload; the requester sends it again after
// its ACK timeout, and it lands in the receive it took the first time, once.
TEST_F(DeviceRemoteSrqTest, AMessageCutOffMidPayloadLandsInTheReceiveItHeldWhenSentAgain) {
  std::memset(ma_.p(), 0x3c, 32);
  post_send(qa_, 1, ma_.addr, 32, ma_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 1u);
  Begun cut = begin_delivery(loop_.q.front(), dev_, "me");  // never finished
  loop_.q.clear();
  EXPECT_EQ(s_.hdr->consumer.load(), 1u);
  dev_.on_peer_up("me");  // reconnected: the SEND goes again
  settle();
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  auto rx = receives();
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx.begin()->first, 100u);
  EXPECT_EQ(rx.begin()->second.byte_len, 32u);
  EXPECT_EQ(mb_.p()[31], 0x3c);
  EXPECT_EQ(s_.hdr->consumer.load(), 1u) << "101 and 102 still posted";
}

// A QP holding a receive for a message that never lands goes to ERR: that receive completes
// with WR_FLUSH_ERR on its CQ; the SRQ's other receives stay for its other QPs.
TEST_F(DeviceRemoteSrqTest, AQpThatFailsFlushesTheReceiveItHeld) {
  post_send(qa_, 1, ma_.addr, 32, ma_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 1u);
  Begun cut = begin_delivery(loop_.q.front(), dev_, "me");
  loop_.q.clear();
  QpAttr err{};
  err.qp_state = IBV_QPS_ERR;
  ASSERT_TRUE(modify(b_, b1_, IBV_QP_STATE, err));
  dev_.poll(now_);
  auto rx = receives();
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx.begin()->first, 100u);
  EXPECT_EQ(rx.begin()->second.status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(rx.begin()->second.qp_num, b1_.qpn);
  EXPECT_EQ(b1_.rq->srq_taken.load(), 0u);
  // b2 takes the next one.
  post_send(a2_, 2, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  EXPECT_EQ(pump(1), 1);
  rx = receives();
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx.begin()->first, 101u);
  EXPECT_EQ(rx.begin()->second.status, IBV_WC_SUCCESS);
}

// A library takes the SRQ's receives too once it offers a QP of it (kDirectOfferSrq, from then
// on under the SRQ's rx_lock): a request that comes while a library holds the lock is answered
// "not ready" (no receive taken, no RNR retry spent) and lands when it comes again.
TEST_F(DeviceRemoteSrqTest, ARequestWhileALibraryHoldsTheSrqsLockIsAskedAgainAndLands) {
  dev_.set_direct_remote(true);
  DirectOfferReq req{};
  req.qp = b1_.handle;
  req.port = 40000;
  std::vector<UniqueFd> fds;
  EXPECT_EQ(dev_.direct_offer(*b_.s, req, fds).err(), EOPNOTSUPP) << "without kDirectOfferSrq";
  req.flags = kDirectOfferSrq;
  uint32_t tag = 0;
  auto o = dev_.direct_offer(*b_.s, req, fds, &tag);
  ASSERT_TRUE(o.is_ok()) << o.status().message();
  EXPECT_NE(tag, 0u);
  EXPECT_NE(tag, kRxLockBackend);
  EXPECT_EQ(s_.hdr->armed.load(), 1u) << "fed by a library from now on";
  loop_.q.clear();  // the offer frame (to "me": nobody listens)
  s_.hdr->rx_lock.store(tag);  // b's library is taking a receive
  post_send(a2_, 1, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(pump(1), 1);  // the request: answered "not ready"
  EXPECT_EQ(s_.hdr->consumer.load(), 0u) << "no receive taken";
  EXPECT_EQ(b2_.rq->srq_taken.load(), 0u);
  ASSERT_EQ(pump(1), 1);  // the NAK
  EXPECT_TRUE(drain(acq_).empty());
  s_.hdr->rx_lock.store(0);
  now_ += 2'000'000;  // the NAK's timer (0.01 ms), and then some
  settle();
  auto rx = receives();
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx.begin()->first, 100u);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(qp_counters(dev_, a2_.qpn, "a")["rnr_naks"], 1) << "one wait, no RNR retry spent";
}

}  // namespace
}  // namespace vrdma::engine::devtest
