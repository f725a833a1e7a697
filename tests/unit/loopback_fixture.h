// DeviceTest with TCP forced through a fake transport that loops back to the same device and
// holds frames until the test pumps them (through the wire codec): the test decides which frames
// are delivered, lost or replayed. Used by device_remote_test.cc and device_migrate_test.cc.
#pragma once

#include <deque>

#include "device_fixture.h"
#include "proto/wire.h"

namespace vrdma::engine::devtest {

namespace wire = proto::wire;

/// A transport that loops back to the same device and holds frames until pumped.
class FakeLoop final : public transport::Transport {
 public:
  struct Sent {
    std::vector<uint8_t> bytes;  ///< header + body
    std::vector<uint8_t> payload;
  };
  std::deque<Sent> q;
  bool up = true;  ///< false: sends fail (no connection)

  const std::string& self() const override { return self_; }
  bool forced() const override { return true; }
  std::string locate_lid(uint16_t) const override { return ""; }
  std::string locate_gid(const uint8_t*) const override { return ""; }
  bool send(const std::string& node, wire::Type t, const void* body,
            std::span<const transport::Span> payload, std::span<const transport::Hold>) override {
    EXPECT_EQ(node, self_);
    if (!up) return false;
    Sent s;
    uint64_t n = 0;
    for (const auto& sp : payload) {
      s.payload.insert(s.payload.end(), sp.p, sp.p + sp.n);
      n += sp.n;
    }
    wire::encode(t, body, static_cast<uint32_t>(n), s.bytes);
    q.push_back(std::move(s));
    return true;
  }
  void announce(const transport::GuestInfo&, bool) override {}
  uint32_t peer_ipv4(const std::string&) const override { return 0x0100007f; }  // 127.0.0.1

 private:
  std::string self_ = "me";
};

class DeviceRemoteTest : public DeviceTest {
 protected:
  void SetUp() override {
    dev_.set_transport(&loop_);
    DeviceTest::SetUp();
  }
  // loop_ dies before the base's dev_, which still announces the guests that leave.
  void TearDown() override { dev_.set_transport(nullptr); }
  /// Delivers queued frames (those queued meanwhile too) through the codec. Returns how many.
  int pump(int max = 1 << 30) {
    int n = 0;
    for (; n < max && !loop_.q.empty(); ++n) {
      FakeLoop::Sent s = std::move(loop_.q.front());
      loop_.q.pop_front();
      wire::FrameHeader h;
      std::memcpy(&h, s.bytes.data(), sizeof(h));
      wire::Frame f;
      EXPECT_TRUE(wire::decode(h, {s.bytes.data() + sizeof(h), h.body}, f).is_ok());
      EXPECT_EQ(h.payload, s.payload.size());
      transport::RxSink sink;
      dev_.on_frame("me", f, sink);
      uint64_t room = 0;
      for (const auto& sp : sink.spans) room += sp.n;
      if (room == s.payload.size()) {
        size_t off = 0;
        for (const auto& sp : sink.spans) {
          std::memcpy(sp.p, s.payload.data() + off, sp.n);
          off += sp.n;
        }
      }
      dev_.on_frame_done("me", f, sink);
    }
    return n;
  }
  /// Posts `n` 8-byte SENDs a -> b (message i carries 0x10 + i in its first byte, wr_id 200 + i)
  /// and the receives they land in (64 bytes apart in b's MR, wr_id 100 + i).
  void post_numbered(int n) {
    for (int i = 0; i < n; ++i) {
      ma_.p()[i * 8] = static_cast<uint8_t>(0x10 + i);
      post_recv(qb_, 100 + i, mb_.addr + i * 64, 64, mb_.mr.lkey);
      post_send(qa_, 200 + i, ma_.addr + i * 8, 8, ma_.mr.lkey);
    }
  }
  /// Runs the device and the transport until nothing moves.
  void settle() {
    for (int i = 0; i < 100; ++i) {
      const bool did = dev_.poll(now_);
      if (pump() == 0 && !did) return;
    }
  }
  FakeLoop loop_;
};

}  // namespace vrdma::engine::devtest
