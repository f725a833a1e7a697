// A guest's device moved in-process: export_guest, detach_guest, import_guest on the same Device
// (what `vrdma migrate` does between two backends, minus the socket). The regressions found by
// tests/hosts/migrate*.sh: a QP that had sent on shm could not be moved at all, and a TCP
// requester lost its unacknowledged messages (they went out again under later PSNs).
#include <fcntl.h>

#include <deque>

#include "device_fixture.h"
#include "proto/wire.h"

namespace vrdma::engine::devtest {
namespace {

namespace wire = proto::wire;

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

/// Every pair through a fake transport that loops back to the same device (as in
/// device_remote_test.cc): frames wait until pumped.
class FakeLoop final : public transport::Transport {
 public:
  std::deque<std::pair<std::vector<uint8_t>, std::vector<uint8_t>>> q;  ///< frame, payload

  const std::string& self() const override { return self_; }
  bool forced() const override { return true; }
  std::string locate_lid(uint16_t) const override { return ""; }
  std::string locate_gid(const uint8_t*) const override { return ""; }
  bool send(const std::string&, wire::Type t, const void* body,
            std::span<const transport::Span> payload, std::span<const transport::Hold>) override {
    std::vector<uint8_t> frame, data;
    for (const auto& sp : payload) data.insert(data.end(), sp.p, sp.p + sp.n);
    wire::encode(t, body, static_cast<uint32_t>(data.size()), frame);
    q.emplace_back(std::move(frame), std::move(data));
    return true;
  }
  void announce(const transport::GuestInfo&, bool) override {}

 private:
  std::string self_ = "me";
};

class DeviceMigrateRemoteTest : public DeviceTest {
 protected:
  void SetUp() override {
    dev_.set_transport(&loop_);
    DeviceTest::SetUp();
  }
  void TearDown() override { dev_.set_transport(nullptr); }
  int pump(int max = 1 << 30) {
    int n = 0;
    for (; n < max && !loop_.q.empty(); ++n) {
      auto [bytes, payload] = std::move(loop_.q.front());
      loop_.q.pop_front();
      wire::FrameHeader h;
      std::memcpy(&h, bytes.data(), sizeof(h));
      wire::Frame f;
      EXPECT_TRUE(wire::decode(h, {bytes.data() + sizeof(h), h.body}, f).is_ok());
      transport::RxSink sink;
      dev_.on_frame("me", f, sink);
      uint64_t room = 0, off = 0;
      for (const auto& sp : sink.spans) room += sp.n;
      if (room == payload.size()) {
        for (const auto& sp : sink.spans) {
          std::memcpy(sp.p, payload.data() + off, sp.n);
          off += sp.n;
        }
      }
      dev_.on_frame_done("me", f, sink);
    }
    return n;
  }
  void settle() {
    for (int i = 0; i < 100; ++i) {
      const bool did = dev_.poll(now_);
      if (pump() == 0 && !did) return;
    }
  }
  FakeLoop loop_;
};

TEST_F(DeviceMigrateRemoteTest, RequesterMovedWithMessagesInFlightDeliversEachOnceInOrder) {
  connect_both();
  for (int i = 0; i < 4; ++i) {
    ma_.p()[i * 8] = static_cast<uint8_t>(0x10 + i);
    post_recv(qb_, 100 + i, mb_.addr + i * 64, 64, mb_.mr.lkey);
    post_send(qa_, 200 + i, ma_.addr + i * 8, 8, ma_.mr.lkey);
  }
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 4u);
  EXPECT_EQ(pump(2), 2);  // two requests executed; their ACKs wait in the queue
  // The requester moves: the ACKs addressed to where it was are lost, the rest still travel.
  a_.s = move_guest(dev_, "a");
  ASSERT_NE(a_.s, nullptr);
  std::erase_if(loop_.q, [](const auto& fr) {
    wire::FrameHeader h;
    std::memcpy(&h, fr.first.data(), sizeof(h));
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

}  // namespace
}  // namespace vrdma::engine::devtest
