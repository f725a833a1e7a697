// A guest's device moved in-process: export_guest, detach_guest, import_guest on the same Device
// (what `vrdma migrate` does between two backends, minus the socket). The regressions found by
// tests/hosts/migrate*.sh: a QP that had sent on shm could not be moved at all, and a TCP
// requester lost its unacknowledged messages (they went out again under later PSNs).
#include <fcntl.h>

#include "loopback_fixture.h"

namespace vrdma::engine::devtest {
namespace {

/// Moves guest `g` out of `dev` and back in, as a migration does; returns its new session.
Session* move_guest(Device& dev, const std::string& g) {
  auto ex = dev.export_guest(g, [](const Session&) { return -1; });
  EXPECT_TRUE(ex.is_ok()) << ex.status().message();
  if (!ex.is_ok()) return nullptr;
  std::vector<UniqueFd> fds;
  for (int f : ex->fds) fds.emplace_back(::fcntl(f, F_DUPFD_CLOEXEC, 0));
  dev.detach_guest(g);
  auto im = dev.import_guest(ex->blob, fds);
  EXPECT_TRUE(im.is_ok()) << im.status().message();
  if (!im.is_ok() || im->size() != 1) return nullptr;
  return im->front().session;
}

TEST_F(DeviceTest, QpThatSentOnShmCanMove) {
  connect_both();
  for (int i = 0; i < 3; ++i) {
    post_recv(qb_, 100 + i, mb_.addr + i * 64, 64, mb_.mr.lkey);
    post_send(qa_, 200 + i, ma_.addr + i * 8, 8, ma_.mr.lkey);
  }
  for (int i = 0; i < 10; ++i) dev_.poll(now_);
  ASSERT_EQ(drain(acq_).size(), 3u);
  ASSERT_EQ(drain(bcq_).size(), 3u);
  a_.s = move_guest(dev_, "a");  // refused before: "state: QP send cursors"
  ASSERT_NE(a_.s, nullptr);
  ma_.p()[0] = 0x5a;
  post_recv(qb_, 103, mb_.addr + 256, 64, mb_.mr.lkey);
  post_send(qa_, 203, ma_.addr, 8, ma_.mr.lkey);
  for (int i = 0; i < 10; ++i) dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].wr_id, 203u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 103u);
  EXPECT_EQ(mb_.p()[256], 0x5a);
}

TEST_F(DeviceRemoteTest, RequesterMovedWithMessagesInFlightDeliversEachOnceInOrder) {
  connect_both();
  post_numbered(4);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 4u);
  EXPECT_EQ(pump(2), 2);  // two requests executed; their ACKs wait in the queue
  // The requester moves: the ACKs addressed to where it was are lost, the rest still travel.
  a_.s = move_guest(dev_, "a");
  ASSERT_NE(a_.s, nullptr);
  std::erase_if(loop_.q, [](const FakeLoop::Sent& fr) {
    wire::FrameHeader h;
    std::memcpy(&h, fr.bytes.data(), sizeof(h));
    return static_cast<wire::Type>(h.type) == wire::Type::kReply;
  });
  settle();
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 4u);  // no duplicate, none lost
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(rx[i].wr_id, 100u + i);
    EXPECT_EQ(mb_.p()[i * 64], 0x10 + i);
  }
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(tx[i].wr_id, 200u + i);
    EXPECT_EQ(tx[i].status, IBV_WC_SUCCESS);
  }
  // And it goes on from there.
  post_recv(qb_, 104, mb_.addr + 512, 64, mb_.mr.lkey);
  post_send(qa_, 204, ma_.addr, 8, ma_.mr.lkey);
  settle();
  ASSERT_EQ(drain(bcq_).size(), 1u);
  ASSERT_EQ(drain(acq_).size(), 1u);
}

// XRC over the transport: the guest with the receive QP and its XRC SRQ moves after two of four
// requests ran, their ACKs lost. The requester sends all four again; the receive QP's expected
// PSN moved with it, so the SRQ takes each message once and in order.
TEST_F(DeviceRemoteTest, XrcResponderMovedWithRequestsInFlightTakesEachOnce) {
  auto x = dev_.open_xrcd(*b_.s, OpenXrcdReq{O_CREAT, 0}, UniqueFd());
  ASSERT_TRUE(x.is_ok());
  UniqueFd ring;
  auto srq = dev_.create_xrc_srq(
      *b_.s, CreateXrcSrqReq{b_.pd, x.value(), bcq_.handle, 0, {8, 1, 0, 0}}, ring);
  ASSERT_TRUE(srq.is_ok()) << srq.status().message();
  MappedRegion srq_map = MappedRegion::map_shared(ring.get(), srq->ring_bytes);
  auto* srq_hdr = reinterpret_cast<RingHeader*>(srq_map.data());
  CreateQpReq rq{};
  rq.qp_type = IBV_QPT_XRC_RECV;
  rq.xrcd = x.value();
  QpV tgt = create_qp(b_, rq);
  QpV snd = create_qp(a_, qp_req(a_, acq_, acq_, IBV_QPT_XRC_SEND));
  connect(b_, tgt, a_, snd);
  connect(a_, snd, b_, tgt);
  for (uint32_t i = 0; i < 4; ++i) {
    ring_entries<RecvWqe>(srq_hdr)[i] =
        RecvWqe{100 + i, 1, 0, {Sge{mb_.addr + 64 * i, 64, mb_.mr.lkey}}};
    srq_hdr->producer.store(i + 1, std::memory_order_release);
    ma_.p()[i * 8] = static_cast<uint8_t>(0x10 + i);
    post_send(snd, 200 + i, ma_.addr + i * 8, 8, ma_.mr.lkey);
    snd.sqe[(snd.sq_prod - 1) & (snd.sq_size - 1)].ud_remote_qkey = srq->srq_num;
  }
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 4u);
  EXPECT_EQ(pump(2), 2);
  b_.s = move_guest(dev_, "b");
  ASSERT_NE(b_.s, nullptr);
  std::erase_if(loop_.q, [](const FakeLoop::Sent& fr) {
    wire::FrameHeader h;
    std::memcpy(&h, fr.bytes.data(), sizeof(h));
    return static_cast<wire::Type>(h.type) == wire::Type::kReply;
  });
  std::vector<Cqe> tx;
  for (int t = 0; t < 20 && tx.size() < 4; ++t) {
    settle();
    for (const Cqe& c : drain(acq_)) tx.push_back(c);
    now_ += 70'000'000;  // an ACK timeout (timeout 14), should the replay wait for one
  }
  ASSERT_EQ(tx.size(), 4u);
  for (uint32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(tx[i].wr_id, 200u + i);
    EXPECT_EQ(tx[i].status, IBV_WC_SUCCESS);
  }
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 4u) << "each message once";
  for (uint32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(rx[i].wr_id, 100u + i);
    EXPECT_EQ(rx[i].qp_num, tgt.qpn);
    EXPECT_EQ(mb_.p()[i * 64], 0x10 + i);
  }
}

}  // namespace
}  // namespace vrdma::engine::devtest
