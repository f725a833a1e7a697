// Ready bits (proto::ReadyBits): a session whose library marks its posts has only the QPs it
// marked looked at by poll(); the engine marks QPs itself when their state changes, and a
// session that does not mark (the fixture's own, by default) has all its QPs looked at.
#include "device_fixture.h"

namespace vrdma::engine::devtest {
namespace {

class ReadyTest : public DeviceTest {
 protected:
  /// Makes guest g's session one whose library marks its posts.
  static ReadyBits& marking(G& g) {
    ReadyBits& r = *ready_bits(g.s->control_page());
    r.marks.store(1);
    return r;
  }
};

TEST_F(ReadyTest, OnlyMarkedQpsAreLookedAt) {
  ASSERT_NE(a_.s->control_page()->features & kFeatureReadyBits, 0u);
  ReadyBits& bits = marking(a_);
  connect_both();
  dev_.poll(now_);  // the state changes marked the QPs; with nothing posted they leave the list
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 64, ma_.mr.lkey);
  // Published, not marked: a library that marks its posts did not post this yet.
  dev_.poll(now_);
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_EQ(qa_.sq->consumer.load(), 0u);
  mark_ready(bits, qa_.handle);
  EXPECT_TRUE(dev_.poll(now_));
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(tx[0].wr_id, 2u);
  ASSERT_EQ(drain(bcq_).size(), 1u);  // b does not mark: looked at on every turn
  // The bits were consumed; the QP left the list once idle.
  EXPECT_EQ(bits.summary.load(), 0u);
  EXPECT_EQ(bits.words[qa_.handle % kReadySlots / 64].load(), 0u);
  EXPECT_FALSE(dev_.poll(now_));
}

TEST_F(ReadyTest, WqesPostedBeforeRtsRunWhenTheQpGetsThere) {
  ReadyBits& bits = marking(a_);
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 64, ma_.mr.lkey);
  mark_ready(bits, qa_.handle);
  dev_.poll(now_);  // RESET: nothing to execute; the mark is spent
  EXPECT_TRUE(drain(acq_).empty());
  connect_both();  // RTS marks it again
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
}

TEST_F(ReadyTest, ErrorFlushesWithoutAMarkAndLaterReceivesWithOne) {
  ReadyBits& bits = marking(a_);
  connect_both();
  post_send(qa_, 1, ma_.addr, 64, ma_.mr.lkey);  // no receive at b: RNR waits, then retries
  mark_ready(bits, qa_.handle);
  dev_.poll(now_);
  QpAttr err{};
  err.qp_state = IBV_QPS_ERR;
  ASSERT_TRUE(modify(a_, qa_, IBV_QP_STATE, err));
  dev_.poll(now_);  // marked by the state change: the send flushes
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_WR_FLUSH_ERR);
  post_recv(qa_, 7, ma_.addr, 64, ma_.mr.lkey);
  mark_ready(bits, qa_.handle);
  dev_.poll(now_);
  auto rx = drain(arcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(rx[0].wr_id, 7u);
}

TEST_F(ReadyTest, ManyIdleQpsAndOneBusyOne) {
  ReadyBits& bits = marking(a_);
  std::vector<QpV> idle;
  for (int i = 0; i < 200; ++i) idle.push_back(qp(a_, acq_, arcq_));
  connect_both();
  dev_.poll(now_);
  for (int i = 0; i < 20; ++i) {
    post_recv(qb_, 100 + i, mb_.addr, 64, mb_.mr.lkey);
    post_send(qa_, i, ma_.addr, 64, ma_.mr.lkey);
    mark_ready(bits, qa_.handle);
    dev_.poll(now_);
    auto tx = drain(acq_);
    ASSERT_EQ(tx.size(), 1u) << "round " << i;
    EXPECT_EQ(tx[0].wr_id, static_cast<uint64_t>(i));
    drain(bcq_);
  }
  // A destroyed QP leaves its slot: a bit that names it finds nobody.
  ASSERT_TRUE(a_.dev->destroy_qp(*a_.s, idle[0].handle).is_ok());
  mark_ready(bits, idle[0].handle);
  EXPECT_FALSE(dev_.poll(now_));
}

}  // namespace
}  // namespace vrdma::engine::devtest
