// The device model's data path driven in-process, with the test playing two guests: it maps the
// rings and memory the backend hands out, posts WQEs, calls Device::poll and reads the CQEs.
#include <arpa/inet.h>
#include <sys/socket.h>

#include "device_fixture.h"

namespace vrdma::engine::devtest {
namespace {

TEST_F(DeviceTest, SendDeliversDataAndBothCompletions) {
  connect_both();
  for (int i = 0; i < 100; ++i) ma_.p()[i] = static_cast<uint8_t>(i * 7 + 1);
  post_recv(qb_, 0xb0b, mb_.addr + 512, 1024, mb_.mr.lkey);
  post_send(qa_, 0xa11ce, ma_.addr, 100, ma_.mr.lkey);
  EXPECT_TRUE(dev_.poll(now_));
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].opcode, IBV_WC_RECV);
  EXPECT_EQ(rx[0].wr_id, 0xb0bu);
  EXPECT_EQ(rx[0].byte_len, 100u);
  EXPECT_EQ(rx[0].src_qp, qa_.qpn);
  EXPECT_EQ(rx[0].qp_num, qb_.qpn);
  EXPECT_EQ(rx[0].slid, a_.hello.lid);
  EXPECT_EQ(rx[0].wc_flags & IBV_WC_WITH_IMM, 0u);
  EXPECT_EQ(std::memcmp(mb_.p() + 512, ma_.p(), 100), 0);
  EXPECT_EQ(mb_.p()[612], 0);  // nothing past byte_len
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(tx[0].opcode, IBV_WC_SEND);
  EXPECT_EQ(tx[0].wr_id, 0xa11ceu);
  EXPECT_EQ(tx[0].qp_num, qa_.qpn);
  EXPECT_EQ(qa_.sq->consumer.load(), 1u);
  EXPECT_EQ(qb_.rq->consumer.load(), 1u);
  EXPECT_FALSE(dev_.poll(now_));  // nothing left to do
}

TEST_F(DeviceTest, SendWithImmDeliversImmData) {
  connect_both();
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey, IBV_SEND_SIGNALED, IBV_WR_SEND_WITH_IMM,
            htonl(0xdeadbeef));
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_NE(rx[0].wc_flags & IBV_WC_WITH_IMM, 0u);
  EXPECT_EQ(rx[0].imm_data, htonl(0xdeadbeef));
  EXPECT_EQ(rx[0].byte_len, 8u);
  ASSERT_EQ(drain(acq_).size(), 1u);
}

TEST_F(DeviceTest, CorruptSqProducerPutsQpInError) {
  connect_both();
  qa_.sq->producer.store(qa_.sq_size + 5);  // producer - consumer > ring size
  dev_.poll(now_);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
  auto ev = async_events(a_);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].first, uint32_t{IBV_EVENT_QP_FATAL});
  EXPECT_EQ(ev[0].second, qa_.handle);
  for (int i = 0; i < 5; ++i) dev_.poll(now_ += 1'000'000);  // flushing must not trust it either
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_EQ(state(b_, qb_), IBV_QPS_RTS);  // the peer is unaffected
}

TEST_F(DeviceTest, BadLkeyFailsThenLaterWqesFlushInOrder) {
  connect_both();
  for (int i = 0; i < 3; ++i) post_recv(qb_, 100 + i, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 1, ma_.addr, 16, ma_.mr.lkey ^ 0x5a5a0);
  post_send(qa_, 2, ma_.addr, 16, ma_.mr.lkey);
  post_send(qa_, 3, ma_.addr, 16, ma_.mr.lkey, 0);  // unsignaled: flushed all the same
  dev_.poll(now_);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 3u);
  EXPECT_EQ(tx[0].wr_id, 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_PROT_ERR);
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(tx[i].wr_id, uint64_t(i + 1));
    EXPECT_EQ(tx[i].status, IBV_WC_WR_FLUSH_ERR);
  }
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
  EXPECT_EQ(qa_.sq->consumer.load(), 3u);
  EXPECT_TRUE(drain(bcq_).empty());  // nothing was delivered
}

TEST_F(DeviceTest, ReceiveBufferTooSmall) {
  connect_both();
  post_recv(qb_, 7, mb_.addr, 16, mb_.mr.lkey);
  post_send(qa_, 8, ma_.addr, 64, ma_.mr.lkey);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 7u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_LEN_ERR);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_INV_REQ_ERR);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
  EXPECT_EQ(state(b_, qb_), IBV_QPS_ERR);
}

TEST_F(DeviceTest, BogusCqConsumerIndexIsSurvivedAndReported) {
  connect_both();
  std::memset(acq_.e, 0xab, acq_.size * sizeof(Cqe));
  acq_.hdr->consumer.store(1000);  // ahead of the producer: not a valid position
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  EXPECT_EQ(acq_.hdr->producer.load(), 0u);
  for (size_t i = 0; i < acq_.size * sizeof(Cqe); ++i)
    ASSERT_EQ(reinterpret_cast<uint8_t*>(acq_.e)[i], 0xab) << "CQ ring written at byte " << i;
  auto ev = async_events(a_);
  ASSERT_EQ(ev.size(), 1u);  // reported once
  EXPECT_EQ(ev[0].first, uint32_t{IBV_EVENT_CQ_ERR});
  EXPECT_EQ(ev[0].second, acq_.handle);
  EXPECT_EQ(drain(bcq_).size(), 1u);  // the message itself went through
}

TEST_F(DeviceTest, FullCqIsNotWrittenPastItsRing) {
  CqV tiny = cq(a_, 1);
  ASSERT_EQ(tiny.size, 2u);
  QpV q = qp(a_, tiny, arcq_);
  connect(a_, q, b_, qb_);
  connect(b_, qb_, a_, q);
  const size_t ring_end = sizeof(RingHeader) + tiny.size * sizeof(Cqe);
  for (int i = 0; i < 4; ++i) post_recv(qb_, 10 + i, mb_.addr, 64, mb_.mr.lkey);
  for (int i = 0; i < 4; ++i) post_send(q, 20 + i, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  EXPECT_EQ(tiny.hdr->producer.load(), 2u);
  for (size_t i = ring_end; i < tiny.map.size(); ++i) ASSERT_EQ(tiny.map.data()[i], 0) << i;
  auto tx = drain(tiny);
  ASSERT_EQ(tx.size(), 2u);
  EXPECT_EQ(tx[0].wr_id, 20u);
  EXPECT_EQ(tx[1].wr_id, 21u);
  auto ev = async_events(a_);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].first, uint32_t{IBV_EVENT_CQ_ERR});
  EXPECT_EQ(drain(bcq_).size(), 4u);
}

TEST_F(DeviceTest, UnsignaledSendHasNoCompletionButAdvancesTheSq) {
  connect_both();
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey, 0);
  dev_.poll(now_);
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_EQ(qa_.sq->consumer.load(), 1u);
  EXPECT_EQ(drain(bcq_).size(), 1u);
}

TEST_F(DeviceTest, SgeStraddlingTheMrEndIsAProtectionError) {
  connect_both();
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr + kMemBytes - 8, 16, ma_.mr.lkey);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
  // One byte before the MR is as bad as one past it.
  QpV q2 = qp(a_, acq_, arcq_);
  QpAttr reset{};
  reset.qp_state = IBV_QPS_RESET;
  ASSERT_TRUE(modify(b_, qb_, IBV_QP_STATE, reset));
  connect(a_, q2, b_, qb_);
  connect(b_, qb_, a_, q2);
  post_recv(qb_, 4, mb_.addr, 64, mb_.mr.lkey);
  post_send(q2, 3, ma_.addr - 1, 8, ma_.mr.lkey);
  dev_.poll(now_);
  tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_TRUE(drain(bcq_).empty());
}

TEST_F(DeviceTest, RnrRetryExceededAfterTheRnrTimer) {
  connect_both(/*a_rnr_retry=*/0);  // b's min_rnr_timer 1: 10 µs
  post_send(qa_, 5, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  dev_.poll(now_ + 20'000);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].wr_id, 5u);
  EXPECT_EQ(tx[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
}

TEST_F(DeviceTest, RnrRetryCountIsTheNumberOfRetries) {
  // Regression: rnr_retry = N used to allow N + 1 retries; 0 must fail at the first RNR NAK.
  connect_both(/*a_rnr_retry=*/0);
  post_send(qa_, 5, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
}

TEST_F(DeviceTest, TransportRetriesAfterAnRnrWaitStartFromRetryCnt) {
  // Regression: the RNR and ACK-timeout paths shared one "waiting" flag, so a WQE that first
  // got an RNR NAK and then found no responder failed at once with a stale retry counter.
  connect_both(/*a_rnr_retry=*/7);  // a: retry_cnt 7, timeout 14 (67 ms)
  post_send(qa_, 5, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);  // RNR: b has no receive posted
  ASSERT_TRUE(dev_.destroy_qp(*b_.s, qb_.handle));
  dev_.poll(now_ += 20'000);  // past the RNR timer: now there is no responder at all
  EXPECT_TRUE(drain(acq_).empty()) << "failed before any ACK timeout";
  for (int i = 0; i < 20; ++i) dev_.poll(now_ += 1'000'000'000);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR);
}

TEST_F(DeviceTest, ModifyToErrorEndsAPendingRetryWait) {
  // Regression: a QP moved to ERR during an RNR wait kept its deadline, and the backend's
  // event loop spun at 100% CPU on an epoll timeout of 0.
  connect_both(/*a_rnr_retry=*/7);
  post_send(qa_, 5, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  ASSERT_NE(dev_.next_deadline(), 0u);
  QpAttr err{};
  err.qp_state = IBV_QPS_ERR;
  ASSERT_TRUE(modify(a_, qa_, IBV_QP_STATE, err));
  dev_.poll(now_ += 1'000'000);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(dev_.next_deadline(), 0u);
}

TEST_F(DeviceTest, RnrRetrySevenRetriesForever) {
  connect_both(/*a_rnr_retry=*/7);
  post_send(qa_, 5, ma_.addr, 8, ma_.mr.lkey);
  for (int i = 0; i < 50; ++i) dev_.poll(now_ += 1'000'000);
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_NE(dev_.next_deadline(), 0u);
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  dev_.poll(now_ += 1'000'000);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(drain(bcq_).size(), 1u);
}

TEST_F(DeviceTest, CorruptRqProducerOnlyHurtsTheReceiver) {
  connect_both();
  qb_.rq->producer.store(qb_.rq_size + 1);
  post_send(qa_, 9, ma_.addr, 8, ma_.mr.lkey);
  for (int i = 0; i < 20; ++i) dev_.poll(now_ += 1'000'000'000);
  EXPECT_EQ(state(b_, qb_), IBV_QPS_ERR);
  auto tx = drain(acq_);  // no responder: transport retries run out
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR);
}

TEST_F(DeviceTest, KeysOfOneGuestAreInvalidInAnother) {
  connect_both();
  // b names a's lkey (and a's address) in a receive: protection error at b, remote error at a.
  post_recv(qb_, 1, ma_.addr, 64, ma_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_PROT_ERR);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_OP_ERR);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(ma_.p()[i], 0) << "a's memory was written through b";
}

TEST_F(DeviceTest, AThirdGuestCannotInjectIntoAConnectedQp) {
  connect_both();
  // Guest c knows b's LID and QPN and points its own QP at them; b is connected to a, not c.
  G c = open("c");
  CqV ccq = cq(c);
  QpV qc = qp(c, ccq, ccq);
  MemV mc = mem(c);
  connect(c, qc, b_, qb_);
  post_recv(qb_, 0xb0b, mb_.addr, 1024, mb_.mr.lkey);
  std::memset(mc.p(), 0xee, 64);
  post_send(qc, 0xc, mc.addr, 64, mc.mr.lkey);
  for (int i = 0; i < 10; ++i) dev_.poll(now_ += 2'000'000'000);  // past every ACK timeout
  EXPECT_TRUE(drain(bcq_).empty()) << "b received a message from a QP it is not connected to";
  EXPECT_EQ(qb_.rq->consumer.load(), 0u);
  EXPECT_NE(mb_.p()[0], 0xee);
  auto tx = drain(ccq);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR) << "to c, b looks like nobody";
  // The rightful peer still gets through.
  post_send(qa_, 0xa, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].src_qp, qa_.qpn);
}

TEST_F(DeviceTest, OutOfRangeStateIsRejected) {
  QpAttr a{};
  a.qp_state = 100;
  EXPECT_EQ(modify(a_, qa_, IBV_QP_STATE, a).err(), EINVAL);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_RESET);
}

// A zero-length RDMA WRITE, WRITE_WITH_IMM or READ names no memory: rkey 0, address 0 and a
// 0-byte SGE with lkey 0 are fine (the IB spec; UCX flushes with such a WRITE). Both sides
// complete with success and stay in RTS.
TEST_F(DeviceTest, ZeroLengthRdmaNeedsNoKeyOrAddress) {
  connect_both();
  QpAttr a{};
  a.qp_access_flags = kAccess | IBV_ACCESS_REMOTE_READ;
  ASSERT_TRUE(modify(b_, qb_, IBV_QP_ACCESS_FLAGS, a));
  post_recv(qb_, 0xb, mb_.addr, 64, mb_.mr.lkey);  // WRITE_WITH_IMM consumes one
  post_rdma(qa_, 1, IBV_WR_RDMA_WRITE, 0, 0, 0, 0, 0);
  post_rdma(qa_, 2, IBV_WR_RDMA_WRITE_WITH_IMM, 0, 0, 0, 0, 0);
  post_rdma(qa_, 3, IBV_WR_RDMA_READ, 0, 0, 0, 0, 0);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 3u);
  const uint32_t opcodes[] = {IBV_WC_RDMA_WRITE, IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ};
  for (size_t i = 0; i < tx.size(); ++i) {
    EXPECT_EQ(tx[i].wr_id, i + 1);
    EXPECT_EQ(tx[i].status, IBV_WC_SUCCESS) << "wr " << i + 1;
    EXPECT_EQ(tx[i].opcode, opcodes[i]);
    EXPECT_EQ(tx[i].byte_len, 0u);
  }
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(rx[0].byte_len, 0u);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_RTS);
  EXPECT_EQ(state(b_, qb_), IBV_QPS_RTS);
}

// ... but the responder QP's access flags still count (as rxe checks them): b's QP allows no
// remote read.
TEST_F(DeviceTest, ZeroLengthReadStillNeedsTheQpsRemoteReadAccess) {
  connect_both();
  post_rdma(qa_, 1, IBV_WR_RDMA_READ, 0, 0, 0, 0, 0);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
}

// A queue of 0 work requests is valid (a QP that only sends or only receives: qperf's one-way
// tests); ibv_create_qp reports 0. Over the device's limit, the refusal names the field.
TEST_F(DeviceTest, QueuesOfZeroAreValidAndRefusalsNameTheField) {
  CqV c = cq(a_);
  CreateQpReq req = qp_req(a_, c, c);
  req.caps.max_send_wr = 0;
  UniqueFd fd;
  auto r = dev_.create_qp(*a_.s, req, fd);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->caps.max_send_wr, 0u);
  EXPECT_EQ(r->caps.max_recv_wr, 8u);
  req.caps.max_send_wr = 8;
  req.caps.max_recv_wr = 0;
  r = dev_.create_qp(*a_.s, req, fd);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->caps.max_send_wr, 8u);
  EXPECT_EQ(r->caps.max_recv_wr, 0u);
  req.caps.max_recv_wr = 70000;
  ::testing::internal::CaptureStderr();
  r = dev_.create_qp(*a_.s, req, fd);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.err(), EINVAL);
  EXPECT_NE(log.find("warn: guest a (pid 4242): create_qp refused with EINVAL: max_recv_wr = "
                     "70000 exceeds the device's 16384"),
            std::string::npos)
      << log;
}

// Every IBV_ACCESS_* bit a consumer may pass: MW_BIND (harmless without memory windows),
// HUGETLB and the optional bits (RELAXED_ORDERING) are accepted on MRs and QPs; ZERO_BASED is
// not supported on MRs (EOPNOTSUPP); ON_DEMAND makes an ODP MR, which has no extents (EINVAL
// with some); bits the API does not define are EINVAL.
TEST_F(DeviceTest, AccessBitsAConsumerMayPassAreAccepted) {
  EXPECT_TRUE(dev_.reg_mr(*a_.s, mr_req(a_.pd,
                                        kAccess | IBV_ACCESS_MW_BIND | IBV_ACCESS_HUGETLB |
                                            IBV_ACCESS_RELAXED_ORDERING,
                                        ma_.addr, 4096, ma_.seg))
                  .is_ok());
  EXPECT_EQ(
      dev_.reg_mr(*a_.s, mr_req(a_.pd, kAccess | IBV_ACCESS_ZERO_BASED, ma_.addr, 4096, ma_.seg))
          .err(),
      EOPNOTSUPP);
  EXPECT_EQ(
      dev_.reg_mr(*a_.s, mr_req(a_.pd, kAccess | IBV_ACCESS_ON_DEMAND, ma_.addr, 4096, ma_.seg))
          .err(),
      EINVAL);
  EXPECT_EQ(dev_.reg_mr(*a_.s, mr_req(a_.pd, kAccess | (1u << 12), ma_.addr, 4096, ma_.seg)).err(),
            EINVAL);
  QpAttr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = kAccess | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                      IBV_ACCESS_MW_BIND | IBV_ACCESS_RELAXED_ORDERING;
  ASSERT_TRUE(
      modify(a_, qa_, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, a));
  EXPECT_EQ(dev_.query_qp(*a_.s, qa_.handle)->attr.qp_access_flags, a.qp_access_flags);
  a = {};
  a.qp_access_flags = kAccess | (1u << 12);
  EXPECT_EQ(modify(a_, qa_, IBV_QP_ACCESS_FLAGS, a).err(), EINVAL);
}

TEST_F(DeviceTest, CloseSessionReclaimsEverything) {
  connect_both();
  auto t = totals();
  EXPECT_EQ(t["sessions"], 2);
  EXPECT_EQ(t["qp"], 2);
  EXPECT_EQ(t["mr"], 2);
  // b goes away while a still sends to it: a's QP, connected to b's, goes to ERR (QP_FATAL),
  // and a WQE posted after that is flushed; nothing crashes.
  dev_.close_session(b_.s);
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  for (int i = 0; i < 20; ++i) dev_.poll(now_ += 1'000'000'000);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_WR_FLUSH_ERR);
  dev_.close_session(a_.s);
  t = totals();
  for (const char* k : {"guests", "sessions", "pd", "mr", "cq", "qp", "channel", "segment"})
    EXPECT_EQ(t[k], 0) << k;
  EXPECT_FALSE(dev_.poll(now_));
}

// More names than there are LIDs come and go: a guest that left gives its LID back (issue 21:
// the table of LIDs by name only grew, and after 0xbfff names every new guest was refused).
TEST_F(DeviceTest, GuestsThatLeftGiveTheirLidsBack) {
  for (uint32_t i = 0; i < 0xc000 + 16; ++i) {
    HelloReq req{};
    std::snprintf(req.guest, sizeof(req.guest), "churn-%u", i);
    HelloResp resp{};
    FdList fds;
    auto r = dev_.open_session(req, cred_, resp, fds);
    ASSERT_TRUE(r.is_ok()) << "guest " << i << ": " << r.status().message();
    dev_.close_session(r.value());
  }
}

// ---- Memory windows: b binds a window over its MR through its QP, a reaches it by rkey ----

TEST_F(DeviceTest, AType2WindowIsReachedWhileBoundAndItsMrStays) {
  qp_access_ = kAccess | IBV_ACCESS_MW_BIND;
  connect_both();
  MemV m = mem(b_, kAccess | IBV_ACCESS_MW_BIND);
  const auto [mw, rkey] = type2_window(b_, qb_, m, 1024, 2048, IBV_ACCESS_REMOTE_WRITE);
  ASSERT_NE(rkey, 0u);
  Cqe b = poll_one(bcq_);
  EXPECT_EQ(b.status, IBV_WC_SUCCESS);
  EXPECT_EQ(b.opcode, IBV_WC_BIND_MW);
  // ibv_alloc_mw(3): the MR cannot go while a window is bound to it.
  EXPECT_EQ(dev_.dereg_mr(*b_.s, m.mr.handle).err(), EBUSY);
  std::memset(ma_.p(), 0x5a, 64);
  post_rdma(qa_, 2, IBV_WR_RDMA_WRITE, ma_.addr, 64, ma_.mr.lkey, m.addr + 1024, rkey);
  Cqe w = poll_one(acq_);
  EXPECT_EQ(w.status, IBV_WC_SUCCESS);
  EXPECT_EQ(m.p()[1024], 0x5a);
  // The allocation's rkey (the previous key) reaches nothing.
  post_rdma(qa_, 3, IBV_WR_RDMA_WRITE, ma_.addr, 64, ma_.mr.lkey, m.addr + 1024, mw.rkey);
  w = poll_one(acq_);
  EXPECT_EQ(w.status, IBV_WC_REM_ACCESS_ERR);
  // Its QP goes: the window is invalidated with it, and the MR may go.
  ASSERT_TRUE(dev_.destroy_qp(*b_.s, qb_.handle));
  EXPECT_TRUE(dev_.dereg_mr(*b_.s, m.mr.handle));
  EXPECT_TRUE(dev_.dealloc_mw(*b_.s, mw.handle));
}

TEST_F(DeviceTest, ABindOutsideTheMrIsMwBindErrorAndAnInvalidationOfNothingLocQpOpError) {
  qp_access_ = kAccess | IBV_ACCESS_MW_BIND;
  connect_both();
  MemV m = mem(b_, kAccess | IBV_ACCESS_MW_BIND);
  auto mw = dev_.alloc_mw(*b_.s, AllocMwReq{b_.pd, IBV_MW_TYPE_1});
  ASSERT_TRUE(mw.is_ok());
  post_bind(qb_, 1, mw.value().handle, ibv_inc_rkey(mw.value().rkey), m.mr.lkey, m.addr + 4096,
            kMemBytes, IBV_ACCESS_REMOTE_READ);
  Cqe b = poll_one(bcq_);
  EXPECT_EQ(b.status, IBV_WC_MW_BIND_ERR);
  EXPECT_EQ(b.opcode, IBV_WC_BIND_MW);
  EXPECT_EQ(state(b_, qb_), IBV_QPS_ERR);
  // On a's QP: a LOCAL_INV of an rkey that names no window.
  qp_access_ = kAccess;
  SendWqe inv{};
  inv.wr_id = 9;
  inv.opcode = IBV_WR_LOCAL_INV;
  inv.send_flags = IBV_SEND_SIGNALED;
  inv.rkey = 0x1234;
  qa_.sqe[qa_.sq_prod & (qa_.sq_size - 1)] = inv;
  qa_.sq->producer.store(++qa_.sq_prod, std::memory_order_release);
  Cqe a = poll_one(acq_);
  EXPECT_EQ(a.status, IBV_WC_LOC_QP_OP_ERR);
  EXPECT_EQ(a.opcode, IBV_WC_LOCAL_INV);
}

// kMwView, for a library that answers its QP's peer itself (the direct path across backends):
// a window's rkey as that QP may use it (window_view), an MR's rkey is no window, and the
// invalidation a SEND_WITH_INV asks for (check_invalidate).
TEST_F(DeviceTest, MwViewGivesAWindowAsItsQpMayUseItAndInvalidatesAsSendWithInvalidate) {
  qp_access_ = kAccess | IBV_ACCESS_MW_BIND;
  connect_both();
  MemV m = mem(b_, kAccess | IBV_ACCESS_MW_BIND);
  const auto [mw, rkey] =
      type2_window(b_, qb_, m, 1024, 2048, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_ZERO_BASED);
  ASSERT_EQ(poll_one(bcq_).status, IBV_WC_SUCCESS);
  auto v = dev_.mw_view(*b_.s, MwViewReq{qb_.handle, rkey, 0, 0});
  ASSERT_TRUE(v.is_ok()) << v.status().message();
  EXPECT_EQ(v->status, uint32_t{IBV_WC_SUCCESS});
  EXPECT_EQ(v->found, 1u);
  EXPECT_EQ(v->mr_key, m.mr.lkey);
  EXPECT_EQ(v->access, uint32_t{IBV_ACCESS_REMOTE_READ});
  EXPECT_EQ(v->iova, 0u) << "zero-based";
  EXPECT_EQ(v->length, 2048u);
  EXPECT_EQ(v->base, m.addr + 1024);
  EXPECT_EQ(dev_.mw_view(*b_.s, MwViewReq{qb_.handle, mw.rkey, 0, 0})->found, 0u)
      << "the allocation's key";
  EXPECT_EQ(dev_.mw_view(*b_.s, MwViewReq{qb_.handle, m.mr.lkey, 0, 0})->found, 0u)
      << "an MR's rkey";
  EXPECT_EQ(dev_.mw_view(*b_.s, MwViewReq{0xdead, rkey, 0, 0}).err(), EINVAL) << "no such QP";
  EXPECT_EQ(dev_.mw_view(*b_.s, MwViewReq{qb_.handle, rkey, 2, 0}).err(), EINVAL) << "flags";
  // Invalidated once; then neither usable nor invalidated again.
  auto inv = dev_.mw_view(*b_.s, MwViewReq{qb_.handle, rkey, kMwViewInvalidate, 0});
  ASSERT_TRUE(inv.is_ok());
  EXPECT_EQ(inv->status, uint32_t{IBV_WC_SUCCESS});
  EXPECT_EQ(dev_.mw_view(*b_.s, MwViewReq{qb_.handle, rkey, 0, 0})->found, 0u);
  EXPECT_EQ(dev_.mw_view(*b_.s, MwViewReq{qb_.handle, rkey, kMwViewInvalidate, 0})->status,
            uint32_t{IBV_WC_REM_INV_REQ_ERR});
  EXPECT_TRUE(dev_.dereg_mr(*b_.s, m.mr.handle)) << "no window holds the MR any more";
  EXPECT_TRUE(dev_.dealloc_mw(*b_.s, mw.handle));
}

TEST_F(DeviceTest, AllocMwChecksItsPdAndTypeAndGivesTheQuotaBackWhenFreed) {
  EXPECT_EQ(dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd + 100, IBV_MW_TYPE_1}).err(), EINVAL);
  EXPECT_EQ(dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd, 3}).err(), EINVAL);
  auto mw = dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd, IBV_MW_TYPE_1});
  ASSERT_TRUE(mw.is_ok());
  EXPECT_EQ(dev_.dealloc_pd(*a_.s, a_.pd).err(), EBUSY) << "the window uses the PD";
  EXPECT_TRUE(dev_.dealloc_mw(*a_.s, mw.value().handle));
  EXPECT_EQ(dev_.dealloc_mw(*a_.s, mw.value().handle).err(), EINVAL);
}

class MwQuotaTest : public DeviceTest {
 protected:
  static void SetUpTestSuite() { next_quotas_.max_mws = 2; }
  static void TearDownTestSuite() { next_quotas_ = {}; }
};

TEST_F(MwQuotaTest, MaxMwsIsEnforcedPerGuest) {
  auto one = dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd, IBV_MW_TYPE_1});
  auto two = dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd, IBV_MW_TYPE_2});
  ASSERT_TRUE(one.is_ok());
  ASSERT_TRUE(two.is_ok());
  EXPECT_EQ(dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd, IBV_MW_TYPE_1}).err(), ENOMEM);
  EXPECT_TRUE(dev_.alloc_mw(*b_.s, AllocMwReq{b_.pd, IBV_MW_TYPE_1}).is_ok()) << "per guest";
  ASSERT_TRUE(dev_.dealloc_mw(*a_.s, one.value().handle));
  EXPECT_TRUE(dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd, IBV_MW_TYPE_1}).is_ok());
}

/// kReregMr with kReregOdpMap: pages [off, off + len) of `m` (its segment) into the ODP MR.
ReregMrReq odp_map_req(uint32_t handle, const MemV& m, uint64_t off, uint64_t len) {
  ReregMrReq r{};
  r.handle = handle;
  r.flags = kReregOdpMap;
  r.mr.addr = m.addr + off;
  r.mr.length = len;
  r.mr.num_extents = 1;
  r.mr.extents[0] = MrExtent{0, len, off, m.seg, 0};
  return r;
}

// On-demand paging: an ODP MR is registered with no pages (O(1), none charged); a request that
// touches a page the library has not faulted in fails as an access outside the MR would (the
// local protection error, the remote access error), one that touches faulted pages works, and
// pages mapped twice (two threads faulting) are kept once.
TEST_F(DeviceTest, OdpMrReachesOnlyThePagesFaultedIn) {
  connect_both();
  RegMrReq req{};
  req.pd = b_.pd;
  req.access = kAccess | IBV_ACCESS_ON_DEMAND;
  req.addr = req.iova = mb_.addr;
  req.length = kMemBytes;
  auto odp = dev_.reg_mr(*b_.s, req);
  ASSERT_TRUE(odp.is_ok()) << odp.status().message();
  // Implicit ODP: the whole address space, no extents.
  RegMrReq implicit{};
  implicit.pd = b_.pd;
  implicit.access = kAccess | IBV_ACCESS_ON_DEMAND;
  implicit.length = UINT64_MAX;
  EXPECT_TRUE(dev_.reg_mr(*b_.s, implicit).is_ok());
  // Nothing faulted in: a WRITE into it is a remote access error.
  post_rdma(qa_, 1, IBV_WR_RDMA_WRITE, ma_.addr, 16, ma_.mr.lkey, mb_.addr, odp->rkey);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_ACCESS_ERR);

  // A fresh pair; page 1 faulted in (twice, and page 0-1 once more: kept once).
  QpV a2 = qp(a_, acq_, arcq_), b2 = qp(b_, bcq_, bcq_);
  connect(a_, a2, b_, b2);
  connect(b_, b2, a_, a2);
  ASSERT_TRUE(dev_.rereg_mr(*b_.s, odp_map_req(odp->handle, mb_, 4096, 4096)).is_ok());
  ASSERT_TRUE(dev_.rereg_mr(*b_.s, odp_map_req(odp->handle, mb_, 4096, 4096)).is_ok());
  std::memcpy(ma_.p(), "on demand, paged", 16);
  post_rdma(a2, 2, IBV_WR_RDMA_WRITE, ma_.addr, 16, ma_.mr.lkey, mb_.addr + 4096, odp->rkey);
  dev_.poll(now_);
  tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(mb_.p() + 4096, "on demand, paged", 16), 0);
  // A receive into page 0 (not faulted in): the local protection error.
  post_recv(b2, 3, mb_.addr + 100, 64, odp->lkey);
  post_send(a2, 4, ma_.addr, 16, ma_.mr.lkey);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_PROT_ERR);
  tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_OP_ERR);

  // Both pages in: a WRITE across them works; a range outside the MR is EINVAL.
  ASSERT_TRUE(dev_.rereg_mr(*b_.s, odp_map_req(odp->handle, mb_, 0, kMemBytes)).is_ok());
  EXPECT_EQ(dev_.rereg_mr(*b_.s, odp_map_req(odp->handle, mb_, 0, kMemBytes + 4096)).err(), EINVAL);
  EXPECT_EQ(dev_.rereg_mr(*b_.s, odp_map_req(mb_.mr.handle, mb_, 0, 4096)).err(), EINVAL);
  QpV a3 = qp(a_, acq_, arcq_), b3 = qp(b_, bcq_, bcq_);
  connect(a_, a3, b_, b3);
  connect(b_, b3, a_, a3);
  std::memset(ma_.p() + 1000, 0x5c, 200);
  post_rdma(a3, 5, IBV_WR_RDMA_WRITE, ma_.addr + 1000, 200, ma_.mr.lkey, mb_.addr + 4000,
            odp->rkey);
  dev_.poll(now_);
  tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(mb_.p()[4000], 0x5c);
  EXPECT_EQ(mb_.p()[4199], 0x5c);
  // With a pager (the library's thread), a WRITE into pages not faulted in waits (RNR) while
  // the backend asks for them through the control page; answered, the retry goes through;
  // answered with an error, it is a remote access error.
  ControlPage* cp = b_.s->control_page();
  cp->odp_pager.store(1);
  auto drain_into = [&](CqV& c, std::vector<Cqe>& out) {
    auto got = drain(c);
    out.insert(out.end(), got.begin(), got.end());
    return got.size();
  };
  QpV a4 = qp(a_, acq_, arcq_), b4 = qp(b_, bcq_, bcq_);
  connect(a_, a4, b_, b4);
  connect(b_, b4, a_, a4);
  RegMrReq fresh = req;
  auto odp2 = dev_.reg_mr(*b_.s, fresh);
  ASSERT_TRUE(odp2.is_ok());
  // The pager's wake-up socket (kReregOdpPager): an ODP MR and a descriptor, or EINVAL; then
  // each request sends a byte on it.
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
  UniqueFd wake(sv[0]);
  ReregMrReq pager{};
  pager.handle = odp2->handle;
  pager.flags = kReregOdpPager;
  EXPECT_EQ(dev_.rereg_mr(*b_.s, pager).err(), EINVAL);
  ASSERT_TRUE(dev_.rereg_mr(*b_.s, pager, UniqueFd(sv[1])).is_ok());
  char byte = 0;
  EXPECT_EQ(::recv(wake.get(), &byte, 1, MSG_DONTWAIT), -1);
  post_rdma(a4, 6, IBV_WR_RDMA_WRITE, ma_.addr, 16, ma_.mr.lkey, mb_.addr + 4100, odp2->rkey);
  dev_.poll(now_);
  EXPECT_TRUE(drain(acq_).empty());
  ASSERT_EQ(cp->odp_req.load(), 1u);
  EXPECT_EQ(::recv(wake.get(), &byte, 1, MSG_DONTWAIT), 1);
  EXPECT_EQ(cp->odp_mr, odp2->handle);
  EXPECT_EQ(cp->odp_addr, mb_.addr + 4100);
  EXPECT_EQ(cp->odp_len, 16u);
  ASSERT_TRUE(dev_.rereg_mr(*b_.s, odp_map_req(odp2->handle, mb_, 4096, 4096)).is_ok());
  cp->odp_status = 0;
  cp->odp_done.store(1);
  tx.clear();
  for (int i = 0; i < 10 && drain_into(acq_, tx) == 0; ++i) dev_.poll(now_ += 10'000'000);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  post_rdma(a4, 7, IBV_WR_RDMA_WRITE, ma_.addr, 16, ma_.mr.lkey, mb_.addr + 100, odp2->rkey);
  dev_.poll(now_ += 10'000'000);
  ASSERT_EQ(cp->odp_req.load(), 2u);
  EXPECT_EQ(::recv(wake.get(), &byte, 1, MSG_DONTWAIT), 1);
  cp->odp_status = EFAULT;
  cp->odp_done.store(2);
  tx.clear();
  for (int i = 0; i < 10 && drain_into(acq_, tx) == 0; ++i) dev_.poll(now_ += 10'000'000);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_ACCESS_ERR);

  // A device with ODP MRs does not move (yet): its export is refused before it starts.
  EXPECT_EQ(dev_.odp_movable("b").err(), EOPNOTSUPP);
  EXPECT_TRUE(dev_.odp_movable("a").is_ok());
  // Re-registering an ODP MR is not offered.
  ReregMrReq rr{};
  rr.handle = odp->handle;
  rr.flags = IBV_REREG_MR_CHANGE_ACCESS;
  rr.mr.access = kAccess;
  EXPECT_EQ(dev_.rereg_mr(*b_.s, rr).err(), EOPNOTSUPP);
}

}  // namespace
}  // namespace vrdma::engine::devtest
