// The engine's requester and responder over a transport, driven in-process: the device runs
// with TCP forced (every pair goes through the transport) and a fake transport that queues the
// frames, so the test decides which are delivered, lost or replayed. Every frame goes through
// the wire codec on the way. Checks: data and completions as on the shm path, each message
// executed once across a lost connection and a replay, atomics answered from the responder's
// cache, RNR NAK and retry, remote access errors, and IBV_WC_RETRY_EXC_ERR when the peer is gone.
#include <deque>

#include "loopback_fixture.h"

namespace vrdma::engine::devtest {
namespace {

TEST_F(DeviceRemoteTest, SendGoesThroughTheTransportAndCompletes) {
  connect_both();
  auto js = nlohmann::json::parse(dev_.status_json());
  for (const auto& g : js["guests"]) {
    ASSERT_EQ(g["qps"].size(), 1u);
    EXPECT_EQ(g["qps"][0]["transport"], "tcp");
    EXPECT_EQ(g["qps"][0]["peer_node"], "me");
    EXPECT_NE(g["qps"][0]["transport_why"].get<std::string>().find("forced"), std::string::npos);
  }
  for (int i = 0; i < 100; ++i) ma_.p()[i] = static_cast<uint8_t>(i * 3 + 1);
  post_recv(qb_, 0xb0b, mb_.addr + 512, 1024, mb_.mr.lkey);
  post_send(qa_, 0xa11ce, ma_.addr, 100, ma_.mr.lkey);
  EXPECT_TRUE(dev_.poll(now_));
  EXPECT_TRUE(drain(bcq_).empty());  // nothing happens before the frame is delivered
  EXPECT_EQ(loop_.q.size(), 1u);
  EXPECT_EQ(pump(1), 1);  // the request: receive completes, ACK queued
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].byte_len, 100u);
  EXPECT_EQ(rx[0].src_qp, qa_.qpn);
  EXPECT_EQ(rx[0].slid, a_.hello.lid);
  EXPECT_EQ(std::memcmp(mb_.p() + 512, ma_.p(), 100), 0);
  EXPECT_TRUE(drain(acq_).empty());  // the requester completes on the ACK, not before
  EXPECT_EQ(pump(), 1);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(tx[0].wr_id, 0xa11ceu);
  EXPECT_EQ(qa_.sq->consumer.load(), 1u);
}

// With a transport a destination not known yet may be announced later: nothing is said at RTR.
TEST_F(DeviceRemoteTest, AnUnknownDestinationIsNotSaidWhileATransportMayFindIt) {
  G nobody;
  nobody.hello.lid = 0x6faa;
  connect_rtr(a_, qa_, nobody, qb_);
  EXPECT_FALSE(dev_.destination_unknown(*a_.s, qa_.handle));
}

TEST_F(DeviceRemoteTest, LostFramesAreReplayedAndExecutedOnce) {
  connect_both();
  post_numbered(3);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 3u);
  EXPECT_EQ(pump(1), 1);  // the first arrives ...
  loop_.q.clear();        // ... then the connection breaks: its ACK and the rest are lost
  ASSERT_EQ(drain(bcq_).size(), 1u);
  EXPECT_TRUE(drain(acq_).empty());
  dev_.on_peer_up("me");  // reconnected: all three unacknowledged are sent again
  EXPECT_EQ(loop_.q.size(), 3u);
  settle();
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 2u);  // the duplicate of the first was dropped
  EXPECT_EQ(rx[0].wr_id, 101u);
  EXPECT_EQ(rx[1].wr_id, 102u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(mb_.p()[i * 64], 0x10 + i);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(tx[i].wr_id, 200u + i);  // in order
    EXPECT_EQ(tx[i].status, IBV_WC_SUCCESS);
  }
}

TEST_F(DeviceRemoteTest, ReplayedAtomicIsAnsweredFromTheCacheNotExecutedTwice) {
  MemV word = connect_with_atomic_word(40);
  uint64_t v = 0;
  SendWqe w{};
  w.wr_id = 7;
  w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
  w.send_flags = IBV_SEND_SIGNALED;
  w.num_sge = 1;
  w.sge[0] = Sge{ma_.addr, 8, ma_.mr.lkey};
  w.remote_addr = word.addr;
  w.rkey = word.mr.rkey;
  w.compare_add = 2;
  qa_.sqe[qa_.sq_prod & (qa_.sq_size - 1)] = w;
  qa_.sq->producer.store(++qa_.sq_prod, std::memory_order_release);
  dev_.poll(now_);
  EXPECT_EQ(pump(1), 1);  // executed; the answer is lost
  loop_.q.clear();
  dev_.on_peer_up("me");
  settle();
  std::memcpy(&v, word.p(), 8);
  EXPECT_EQ(v, 42u);  // added once
  uint64_t got;
  std::memcpy(&got, ma_.p(), 8);
  EXPECT_EQ(got, 40u);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(tx[0].opcode, IBV_WC_FETCH_ADD);
}

TEST_F(DeviceRemoteTest, RnrNakWaitsAndRetries) {
  connect_both();
  post_send(qa_, 1, ma_.addr, 16, ma_.mr.lkey);
  settle();  // no receive posted: RNR NAK, the requester waits min_rnr_timer
  EXPECT_TRUE(drain(acq_).empty());
  post_recv(qb_, 2, mb_.addr, 64, mb_.mr.lkey);
  settle();
  EXPECT_TRUE(drain(bcq_).empty());  // still waiting for the timer
  now_ += 1'000'000'000;
  settle();
  ASSERT_EQ(drain(bcq_).size(), 1u);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
}

TEST_F(DeviceRemoteTest, AWindowIsReachedAndInvalidatedOverTheTransportAsOnOneHost) {
  qp_access_ = kAccess | IBV_ACCESS_MW_BIND;
  connect_both();
  MemV m = mem(b_, kAccess | IBV_ACCESS_MW_BIND);
  // b binds (a local operation: no frame), then a writes through the window over the wire.
  const uint32_t rkey = type2_window(b_, qb_, m, 0, 4096, IBV_ACCESS_REMOTE_WRITE).second;
  ASSERT_NE(rkey, 0u);
  const Cqe b = poll_one(bcq_);
  EXPECT_EQ(b.status, IBV_WC_SUCCESS);
  EXPECT_EQ(b.opcode, IBV_WC_BIND_MW);
  std::memset(ma_.p(), 0x2b, 64);
  post_rdma(qa_, 2, IBV_WR_RDMA_WRITE, ma_.addr, 64, ma_.mr.lkey, m.addr + 128, rkey);
  settle();
  auto w = drain(acq_);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(m.p()[128], 0x2b);
  // SEND_WITH_INV over the wire: the receive says which rkey went, and the window is dead.
  post_recv(qb_, 3, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 4, ma_.addr, 16, ma_.mr.lkey, IBV_SEND_SIGNALED, IBV_WR_SEND_WITH_INV, rkey);
  settle();
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_NE(rx[0].wc_flags & IBV_WC_WITH_INV, 0u);
  EXPECT_EQ(rx[0].imm_data, rkey);
  ASSERT_EQ(drain(acq_).size(), 1u);
  post_rdma(qa_, 5, IBV_WR_RDMA_WRITE, ma_.addr, 64, ma_.mr.lkey, m.addr + 128, rkey);
  settle();
  w = drain(acq_);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].status, IBV_WC_REM_ACCESS_ERR);
}

TEST_F(DeviceRemoteTest, BadRkeyIsARemoteAccessErrorAsOnOneHost) {
  connect_both();
  post_send(qa_, 9, ma_.addr, 8, ma_.mr.lkey, IBV_SEND_SIGNALED, IBV_WR_RDMA_WRITE);
  qa_.sqe[(qa_.sq_prod - 1) & (qa_.sq_size - 1)].rkey = mb_.mr.rkey ^ 0x100;
  qa_.sqe[(qa_.sq_prod - 1) & (qa_.sq_size - 1)].remote_addr = mb_.addr;
  settle();
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
}

// A zero-length WRITE and READ with rkey 0 and address 0 through the transport: the responder
// holds no memory for them and both complete with success, as on one host.
TEST_F(DeviceRemoteTest, ZeroLengthWriteAndReadNeedNoKeyAcrossTheTransport) {
  connect_both();
  QpAttr a{};
  a.qp_access_flags = kAccess | IBV_ACCESS_REMOTE_READ;
  ASSERT_TRUE(modify(b_, qb_, IBV_QP_ACCESS_FLAGS, a));
  post_rdma(qa_, 1, IBV_WR_RDMA_WRITE, 0, 0, 0, 0, 0);
  post_rdma(qa_, 2, IBV_WR_RDMA_READ, 0, 0, 0, 0, 0);
  settle();
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 2u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(tx[0].opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(tx[1].status, IBV_WC_SUCCESS);
  EXPECT_EQ(tx[1].opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_RTS);
}

TEST_F(DeviceRemoteTest, PeerGoneEndsInRetryExceededAfterTheBudget) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7
  loop_.up = false;
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  std::vector<Cqe> tx;
  const int steps = timeouts_until_completion(tx);
  EXPECT_EQ(steps, 8);  // 7 retries, each after an ACK timeout, then the error
  dev_.poll(now_);      // the QP in ERR flushes the rest
  for (const Cqe& e : drain(acq_)) tx.push_back(e);
  ASSERT_EQ(tx.size(), 2u);
  EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_EQ(tx[0].wr_id, 1u);
  EXPECT_EQ(tx[1].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(tx[1].wr_id, 2u);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
}

// A QP routed to a peer keeps that peer's connection from closing for being idle
// (Receiver::uses_peer); one in RESET or ERR does not.
TEST_F(DeviceRemoteTest, AQpFacingAPeerKeepsItsConnectionInUse) {
  EXPECT_FALSE(dev_.uses_peer("me"));  // the QPs exist, in RESET, routed nowhere
  connect_both();
  EXPECT_TRUE(dev_.uses_peer("me"));
  EXPECT_FALSE(dev_.uses_peer("elsewhere"));
}

TEST_F(DeviceRemoteTest, NoRetryIsSpentWhileTheConnectionMovesAndNothingIsReplayed) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7
  loop_.conn = 1;  // frames are in a stream: queued here until the test says delivered
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  post_recv(qb_, 2, mb_.addr, 64, mb_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 1u);
  // Ten ACK timeouts' worth (more than retry_cnt + 1) behind other bytes that keep moving.
  for (int i = 0; i < 10; ++i) {
    now_ += 70'000'000;
    ++loop_.progress;
    dev_.poll(now_);
  }
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_EQ(loop_.q.size(), 1u);  // not replayed: the one copy is still on its way
  // It arrives; the answer completes it.
  expect_the_send_arrives();
}

TEST_F(DeviceRemoteTest, AConnectionThatMovesNothingSpendsTheBudgetWithoutReplaying) {
  connect_both();
  loop_.conn = 1;
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  std::vector<Cqe> tx;
  const int steps = timeouts_until_completion(tx);
  EXPECT_EQ(steps, 8);  // 7 retries, each after an ACK timeout, then the error
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR);
  // Never queued twice, and taken back from the queue when the QP failed: nothing of a dead
  // QP holds up the connection.
  EXPECT_EQ(loop_.q.size(), 0u);
  EXPECT_EQ(loop_.dropped_flows.size(), 1u);
}

// A peer backend starved of CPU under a bulk stream stops reading: its TCP takes everything we
// sent and closes its window, and our request waits in our own socket (ib_write_bw in
// hosts.impaired_mix, 1.6 s). The path delivers: the peer backend is waited for as a slow one,
// from when the connection stopped, and no retry is spent meanwhile; after that, the budget is
// spent as in an outage (a backend stopped for good).
TEST_F(DeviceRemoteTest, APeerWhoseWindowIsClosedIsWaitedForAsASlowBackend) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7: 0.54 s of budget
  loop_.conn = 1;
  loop_.window_closed = true;
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  post_recv(qb_, 2, mb_.addr, 64, mb_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 1u);
  now_ += 70'000'000;
  dev_.poll(now_);  // the first timeout notes where the connection stands, and counts
  ASSERT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 1);
  const uint64_t waited = while_one_retry(5'000'000'000ull);
  EXPECT_GE(waited, Device::kSlowPeerNs);
  EXPECT_LT(waited, Device::kSlowPeerNs + 150'000'000);
  EXPECT_TRUE(drain(acq_).empty());
  // The peer reads again: the request is delivered and answered, nothing lost or doubled.
  loop_.window_closed = false;
  expect_the_send_arrives();
  EXPECT_EQ(loop_.q.size(), 0u);
}

// The same closed window for ever (a peer backend stopped, SIGSTOP): the QP fails, after the wait
// for a slow backend and its retry budget.
TEST_F(DeviceRemoteTest, APeerWhoseWindowStaysClosedEndsInRetryExceeded) {
  connect_both();
  loop_.conn = 1;
  loop_.window_closed = true;
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  std::vector<Cqe> tx;
  const uint64_t took = until_unanswered_send_completes(false, tx);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_GE(took, Device::kSlowPeerNs);
  EXPECT_LT(took, Device::kSlowPeerNs + 1'000'000'000);
}

// A peer backend restarting under keep_state: its host accepted the connection our request went
// on (its keeper holds the listener) and no backend has taken it yet. Waited for as a slow
// backend, longer than the retry budget and kSlowPeerNs, without spending a retry (the transport
// bounds the wait: it closes a connection that gets no Hello in time); then it is answered.
TEST_F(DeviceRemoteTest, AConnectionNoBackendTookYetIsWaitedFor) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7: 0.54 s of budget
  loop_.conn = 1;
  loop_.not_taken = true;
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  post_recv(qb_, 2, mb_.addr, 64, mb_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 1u);
  for (int i = 0; i < 40; ++i) {  // 2.8 s
    now_ += 70'000'000;
    dev_.poll(now_);
  }
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 0);
  EXPECT_EQ(loop_.q.size(), 1u);  // not replayed
  loop_.not_taken = false;
  expect_the_send_arrives();
}

TEST_F(DeviceRemoteTest, AQpDeepInTheConnectionsQueueHoldsItsNewWork) {
  connect_both();
  loop_.conn = 1;
  for (int i = 0; i < 4; ++i) post_recv(qb_, 100 + i, mb_.addr + i * 64, 64, mb_.mr.lkey);
  loop_.backlog = Device::kQpQueuedMax + 1;  // its frames sit behind a megabyte
  for (int i = 0; i < 4; ++i) post_send(qa_, 200 + i, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  dev_.poll(now_);
  EXPECT_EQ(loop_.q.size(), 1u);  // the first went; the rest wait in the send queue
  // Time passes while the connection moves: still held, and nothing failed.
  for (int i = 0; i < 10; ++i) {
    now_ += 70'000'000;
    ++loop_.progress;
    dev_.poll(now_);
  }
  EXPECT_EQ(loop_.q.size(), 1u);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_RTS);
  loop_.backlog = 0;  // the connection drained
  loop_.delivered = 1 << 20;
  settle();
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 4u);
  for (const Cqe& e : tx) EXPECT_EQ(e.status, IBV_WC_SUCCESS);
  EXPECT_EQ(qp_counters(dev_, qa_.qpn, "a")["held"], 1);
}

TEST_F(DeviceRemoteTest, AGapIsNakedOnceAndTheRequesterGoesBackAtOnce) {
  connect_both();
  post_numbered(3);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 3u);
  loop_.q.pop_front();  // PSN 0 lost (a connection that broke under it)
  settle();             // 1 and 2 are a gap: one sequence NAK, and all three go again
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 3u);  // no ACK timeout was needed: the clock never moved
  for (const Cqe& e : tx) EXPECT_EQ(e.status, IBV_WC_SUCCESS);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(rx[i].wr_id, 100u + i);
    EXPECT_EQ(mb_.p()[i * 64], 0x10 + i);  // in order, each once
  }
  const auto a = qp_counters(dev_, qa_.qpn, "a"), b = qp_counters(dev_, qb_.qpn, "b");
  EXPECT_EQ(a["seq_naks"], 1);
  EXPECT_EQ(a["replays"], 3);
  EXPECT_EQ(a["retries"], 0);
  EXPECT_EQ(b["naks_sent"], 1);
}

TEST_F(DeviceRemoteTest, AfterAnRnrWaitTheHeadGoesAloneAndTheRestFollowItsAck) {
  connect_both();  // b's min_rnr_timer: 0.01 ms; a's rnr_retry 7 (for ever)
  for (int i = 0; i < 4; ++i) post_send(qa_, 200 + i, ma_.addr + i * 8, 8, ma_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 4u);
  settle();  // no receive at b: RNR NAK for the head, the rest dropped as a gap
  for (int round = 0; round < 3; ++round) {
    now_ += 1'000'000;
    dev_.poll(now_);
    EXPECT_EQ(loop_.q.size(), 1u) << round;  // the head alone, not the whole window
    settle();                                // RNR again
  }
  for (int i = 0; i < 4; ++i) post_recv(qb_, 100 + i, mb_.addr + i * 64, 64, mb_.mr.lkey);
  now_ += 1'000'000;
  settle();
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 4u);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(tx[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(rx[i].wr_id, 100u + i);  // in order, each once
  }
  EXPECT_EQ(qp_counters(dev_, qa_.qpn, "a")["replays"], 4 + 3);  // 4 probes, then the 3 after it
}

TEST_F(DeviceRemoteTest, APeerQpNotYetAtRtrIsWaitedForNotFailed) {
  connect(a_, qa_, b_, qb_);  // b is still in RESET: its side connects later
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  settle();
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_EQ(qp_counters(dev_, qb_.qpn, "b")["naks_sent"], 1);  // "not ready", not silence
  connect(b_, qb_, a_, qa_);
  post_recv(qb_, 100, mb_.addr, 64, mb_.mr.lkey);
  now_ += 2'000'000;  // the NAK's 1.28 ms, far below an ACK timeout (67 ms)
  settle();
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(drain(bcq_).size(), 1u);
  EXPECT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 0);
}

// Each request of the window gets its own "not ready" NAK. Such a NAK acknowledges nothing:
// when the second one retired the first message as a success, that message was lost and the
// responder waited for it for ever (hosts.xrc, a server whose sends beat its client's RTR).
TEST_F(DeviceRemoteTest, NotReadyNaksOfAWindowRetireNothingAndAllArriveInOrder) {
  connect(a_, qa_, b_, qb_);  // b still in RESET
  for (int i = 0; i < 3; ++i) {
    ma_.p()[i * 8] = static_cast<uint8_t>(0x30 + i);
    post_send(qa_, 10 + i, ma_.addr + i * 8, 8, ma_.mr.lkey);
  }
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 3u);
  settle();
  EXPECT_TRUE(drain(acq_).empty());  // nothing executed: nothing completes
  EXPECT_EQ(qp_counters(dev_, qb_.qpn, "b")["naks_sent"], 3);
  connect(b_, qb_, a_, qa_);
  for (int i = 0; i < 3; ++i) post_recv(qb_, 100 + i, mb_.addr + i * 64, 64, mb_.mr.lkey);
  for (int round = 0; round < 4; ++round) {
    now_ += 2'000'000;
    settle();
  }
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 3u);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(tx[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(tx[i].wr_id, 10u + i);
    EXPECT_EQ(rx[i].wr_id, 100u + i);      // in order, each once
    EXPECT_EQ(mb_.p()[i * 64], 0x30 + i);  // the data of its own message
  }
}

TEST_F(DeviceRemoteTest, APeerQpThatNeverGetsReadyFailsAfterTheTransportBudget) {
  connect(a_, qa_, b_, qb_);  // timeout 14 (~67 ms), retry_cnt 7: 0.54 s
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  std::vector<Cqe> tx;
  uint64_t waited = 0;
  for (; tx.empty() && waited < 2'000'000'000; waited += 2'000'000) {
    now_ += 2'000'000;
    settle();
    tx = drain(acq_);
  }
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR);  // what silence would give, on time
  EXPECT_GT(waited, 500'000'000u);
  EXPECT_LT(waited, 700'000'000u);
}

TEST_F(DeviceRemoteTest, UnreadInputIsReadBeforeATimeoutIsJudged) {
  connect_both();  // timeout 14 (~67 ms)
  loop_.conn = 1;
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  loop_.pending = true;  // the backend slept: bytes from the peer wait in the socket
  now_ += 70'000'000;
  dev_.poll(now_);
  EXPECT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 0);  // read first
  now_ += 1'000'000;
  dev_.poll(now_);  // still nothing for it: judged now (once per timeout, not for ever)
  EXPECT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 1);
}

TEST_F(DeviceRemoteTest, ALongPathIsNotAPeerThatDoesNotAnswer) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7: 0.54 s of budget
  loop_.conn = 1;
  loop_.patience_ns = 1'000'000'000;  // a path whose round trip (as TCP measures it) is ~1 s
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
  post_recv(qb_, 2, mb_.addr, 64, mb_.mr.lkey);
  dev_.poll(now_);
  for (int i = 0; i < 12; ++i) {  // 0.84 s: nothing moves, and nothing could have yet
    now_ += 70'000'000;
    dev_.poll(now_);
  }
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_EQ(loop_.q.size(), 1u);
  loop_.delivered = loop_.queued;
  settle();
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
}

TEST_F(DeviceRemoteTest, ARequestThePeerHasIsNotSentAgainOnALiveConnection) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7
  // The peer's TCP acknowledged it, on this very connection, and says nothing.
  ASSERT_NO_FATAL_FAILURE(send_one_the_peer_holds());
  post_recv(qb_, 2, mb_.addr, 64, mb_.mr.lkey);
  // TCP loses nothing and a responder NAKs what it drops: an answer is on its way (its backend
  // is slow, or TCP recovers it), the path went down after the request crossed it, or the peer
  // QP is gone. The first timeout probes the path (a kPing) and counts, as on a fabric.
  now_ += 70'000'000;
  dev_.poll(now_);
  EXPECT_TRUE(loop_.q.empty());
  EXPECT_EQ(loop_.pings, 1u);
  EXPECT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 1);
  // The peer's TCP takes the probe: the path delivers, so a slow peer backend is waited for
  // (Device::kSlowPeerNs from the first timeout): nothing sent, no retry spent.
  loop_.delivered = loop_.queued;
  for (uint64_t waited = 70'000'000; waited < Device::kSlowPeerNs; waited += 70'000'000) {
    now_ += 70'000'000;
    dev_.poll(now_);
    ASSERT_TRUE(loop_.q.empty());
    ASSERT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 1);
  }
  EXPECT_EQ(loop_.pings, 1u);
  // Then each timeout is a retry; nothing is sent again but as the last try.
  for (int i = 0; i < 5; ++i) {
    now_ += 70'000'000;
    dev_.poll(now_);
    EXPECT_TRUE(loop_.q.empty()) << i;
  }
  now_ += 70'000'000;
  dev_.poll(now_);
  EXPECT_EQ(loop_.q.size(), 1u);  // the last try
  EXPECT_EQ(qp_counters(dev_, qa_.qpn, "a")["replays"], 1);
  loop_.delivered = loop_.queued;
  settle();
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
}

// An answer lost on the way back is in the peer's TCP recovery, which backs off (seconds on a
// lossy path, longer than kSlowPeerNs): while it may be, the peer backend is waited for
// (hosts.impaired_loss's 10 % loss once ended a pingpong in IBV_WC_RETRY_EXC_ERR after 2 s).
TEST_F(DeviceRemoteTest, AnAnswerInThePeersTcpRecoveryIsWaitedFor) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7
  loop_.recovery_ns = 3'000'000'000;
  ASSERT_NO_FATAL_FAILURE(send_one_the_peer_holds());
  post_recv(qb_, 2, mb_.addr, 64, mb_.mr.lkey);
  now_ += 70'000'000;
  dev_.poll(now_);  // the first timeout probes the path and counts, as on a fabric
  ASSERT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 1);
  loop_.delivered = loop_.queued;
  const uint64_t waited = while_one_retry(5'000'000'000ull);
  EXPECT_GE(waited, loop_.recovery_ns - 70'000'000);
  EXPECT_LT(waited, loop_.recovery_ns + 150'000'000);
  EXPECT_TRUE(drain(acq_).empty());
}

// Many QPs share the connection (ib_write_bw -q 256): the peer's TCP has the request, but the
// probe queues behind this backend's own backlog, which takes longer than the whole retry budget
// to write. While the connection moves that is queueing, not an outage: no retry is spent, and
// the wait for the peer backend starts once the probe is through.
TEST_F(DeviceRemoteTest, AProbeBehindOurOwnBacklogSpendsNoRetryWhileTheConnectionMoves) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7: 0.54 s of budget
  ASSERT_NO_FATAL_FAILURE(send_one_the_peer_holds());
  post_recv(qb_, 2, mb_.addr, 64, mb_.mr.lkey);
  now_ += 70'000'000;
  dev_.poll(now_);  // the first timeout probes the path and counts, as on a fabric
  ASSERT_EQ(loop_.pings, 1u);
  ASSERT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 1);
  for (int i = 0; i < 30; ++i) {  // 2.1 s: the probe is still queued, the connection moves
    now_ += 70'000'000;
    ++loop_.progress;
    dev_.poll(now_);
  }
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_EQ(qp_counters(dev_, qa_.qpn, "a")["retries"], 1);
  EXPECT_EQ(loop_.pings, 1u);
  // The probe is through: a slow peer backend is waited for from now on, not from the first
  // timeout (more than kSlowPeerNs ago).
  loop_.delivered = loop_.queued;
  const uint64_t waited = while_one_retry(3'000'000'000ull);
  EXPECT_GE(waited, Device::kSlowPeerNs);
  EXPECT_LT(waited, Device::kSlowPeerNs + 150'000'000);
  EXPECT_TRUE(drain(acq_).empty());
  EXPECT_TRUE(loop_.q.empty());  // nothing sent again but as the last try
}

// The path goes down after the request crossed it: the probe is never taken, and the QP fails
// within its budget, timeout x (retry_cnt + 1), as in any outage (no wait for a slow peer).
TEST_F(DeviceRemoteTest, AnOutageAfterTheRequestCrossedFailsWithinTheBudget) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7
  ASSERT_NO_FATAL_FAILURE(send_one_the_peer_holds());  // the request crossed; nothing after it will
  std::vector<Cqe> tx;
  const uint64_t took = until_unanswered_send_completes(false, tx);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_GE(loop_.pings, 1u);
  EXPECT_LT(took, 700'000'000u);  // 8 x 67 ms, and the 10 ms steps
}

// A peer QP that is gone answers nothing, as on a fabric: after the wait for a slow peer
// backend, the retries run out and the requester gets RETRY_EXC; nothing waits for ever.
TEST_F(DeviceRemoteTest, APeerThatHasTheRequestButNeverAnswersEndsInRetryExceeded) {
  connect_both();  // timeout 14 (~67 ms), retry_cnt 7
  ASSERT_NO_FATAL_FAILURE(send_one_the_peer_holds());
  std::vector<Cqe> tx;
  const uint64_t took = until_unanswered_send_completes(true, tx);  // last try's replay lost too
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR);
  // The slow-peer wait, then timeout x (retry_cnt + 1).
  EXPECT_GE(took, Device::kSlowPeerNs);
  EXPECT_LT(took, Device::kSlowPeerNs + 1'000'000'000);
}

}  // namespace
}  // namespace vrdma::engine::devtest
