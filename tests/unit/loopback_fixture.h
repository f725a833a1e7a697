// DeviceTest with TCP forced through a fake transport that loops back to the same device and
// holds frames until the test pumps them (through the wire codec): the test decides which frames
// are delivered, lost or replayed. Used by device_remote_test.cc and device_migrate_test.cc.
#pragma once

#include <deque>

#include "device_fixture.h"
#include "proto/wire.h"

namespace vrdma::engine::devtest {

namespace wire = proto::wire;

/// A transport whose sends are encoded (through the wire codec) and kept in `q` until the test
/// delivers them.
class RecordingTransport : public transport::Transport {
 public:
  struct Sent {
    std::vector<uint8_t> bytes;  ///< header + body
    std::vector<uint8_t> payload;
    uint64_t flow = 0;
  };
  std::deque<Sent> q;
  bool up = true;  ///< false: sends fail (no connection)
  // The stream as TcpTransport's TxMark sees it. conn 0 (the default): no stream information,
  // every frame counts as at the peer. conn 1: frames up to `delivered` (counted in frames)
  // are at the peer, and `progress` is what tx_progress says.
  uint64_t conn = 0, queued = 0, delivered = 0, progress = 0;
  uint64_t pings = 0;  ///< kPing probes sent (not in `q`; they count in `queued`)
  transport::TxMark tx_mark(const std::string&) const override { return {conn, queued}; }
  bool tx_delivered(const std::string&, const transport::TxMark& m) override {
    return m.conn == 0 || (m.conn == conn && m.end <= delivered);
  }
  uint64_t tx_progress(const std::string&) override { return progress; }
  uint64_t patience_ns = 0;  ///< what tx_patience_ns says (the path's round trip)
  uint64_t tx_patience_ns(const std::string&) override { return patience_ns; }
  uint64_t recovery_ns = 0;  ///< what peer_recovery_ns says
  uint64_t peer_recovery_ns(const std::string&) override { return recovery_ns; }
  bool window_closed = false;  ///< what peer_window_closed says
  bool peer_window_closed(const std::string&) override { return window_closed; }
  bool not_taken = false;  ///< what peer_not_taken says
  bool peer_not_taken(const std::string&) override { return not_taken; }
  bool pending = false;  ///< what rx_pending says
  bool rx_pending(const std::string&) override { return pending; }

  /// What tx_unwritten says of every mark of a connection: how deep in this backend's queue a
  /// frame sits.
  uint64_t backlog = 0;
  uint64_t tx_unwritten(const std::string&, const transport::TxMark& m) const override {
    return m.conn == 0 ? 0 : backlog;  // conn 0: nothing sent yet
  }
  /// drop_flow takes back the recorded frames of that flow not yet delivered.
  std::vector<uint64_t> dropped_flows;
  void drop_flow(const std::string&, uint64_t flow) override {
    dropped_flows.push_back(flow);
    std::erase_if(q, [&](const Sent& s) { return s.flow == flow; });
  }

  bool send(const std::string& node, wire::Type t, const void* body,
            std::span<const transport::Span> payload, std::span<const transport::Hold>,
            uint64_t flow) override {
    EXPECT_EQ(node, to());
    if (!up) return false;
    if (t == wire::Type::kPing) {  // the peer's transport drops it: only its place in the stream
      ++pings;
      ++queued;
      return true;
    }
    Sent s;
    s.flow = flow;
    uint64_t n = 0;
    for (const auto& sp : payload) {
      s.payload.insert(s.payload.end(), sp.p, sp.p + sp.n);
      n += sp.n;
    }
    wire::encode(t, body, static_cast<uint32_t>(n), s.bytes);
    q.push_back(std::move(s));
    ++queued;
    return true;
  }
  void announce(const transport::GuestInfo&, bool) override {}

 protected:
  /// The one node this transport sends to.
  virtual const std::string& to() const = 0;
};

/// A recorded frame whose header was delivered (on_frame) and whose payload was not yet.
struct Begun {
  wire::Frame f;
  transport::RxSink sink;
  RecordingTransport::Sent s;
};

/// Delivers one recorded frame's header to `to` as if it came from `node` (decoded by the codec):
/// on_frame says where its payload goes.
inline Begun begin_delivery(const RecordingTransport::Sent& s, transport::Receiver& to,
                            const std::string& node) {
  Begun b;
  wire::FrameHeader h;
  std::memcpy(&h, s.bytes.data(), sizeof(h));
  EXPECT_TRUE(wire::decode(h, {s.bytes.data() + sizeof(h), h.body}, b.f).is_ok());
  EXPECT_EQ(h.payload, s.payload.size());
  to.on_frame(node, b.f, b.sink);
  b.s = s;
  return b;
}

/// The rest of begin_delivery: the payload copied where the receiver said, then on_frame_done.
inline void finish_delivery(Begun& b, transport::Receiver& to, const std::string& node) {
  uint64_t room = 0;
  for (const auto& sp : b.sink.spans) room += sp.n;
  if (room == b.s.payload.size()) {
    size_t off = 0;
    for (const auto& sp : b.sink.spans) {
      std::memcpy(sp.p, b.s.payload.data() + off, sp.n);
      off += sp.n;
    }
  }
  to.on_frame_done(node, b.f, b.sink);
}

/// Delivers one recorded frame to `to` as if it came from `node`: decoded by the codec, its
/// payload copied where the receiver says it goes.
inline void deliver(RecordingTransport::Sent& s, transport::Receiver& to, const std::string& node) {
  Begun b = begin_delivery(s, to, node);
  finish_delivery(b, to, node);
}

/// A transport that loops back to the same device and holds frames until pumped.
class FakeLoop final : public RecordingTransport {
 public:
  const std::string& self() const override { return self_; }
  bool forced() const override { return true; }
  std::string locate_lid(uint16_t) const override { return ""; }
  std::string locate_gid(const uint8_t*) const override { return ""; }
  uint32_t peer_ipv4(const std::string&) const override { return 0x0100007f; }  // 127.0.0.1
  uint32_t local_ipv4(const std::string&) const override { return 0x0100007f; }
  void refused_frame(const std::string& node, const std::string& why) override {
    refused.push_back(node + ": " + why);
  }
  std::vector<std::string> refused;  ///< what refused_frame was told

 private:
  const std::string& to() const override { return self_; }
  std::string self_ = "me";
};

/// The counters of guest `g`'s QP `qpn` in the device's report.
inline nlohmann::json qp_counters(Device& dev, uint32_t qpn, const char* guest) {
  const nlohmann::json rep = dev.report();
  for (const auto& q : rep["res"]["qp"]) {
    if (q["lqpn"] == qpn && q["guest"] == guest) return q["counters"];
  }
  return {};
}

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
      deliver(s, dev_, "me");
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
  /// Moves the clock one ACK timeout (timeout 14: ~67 ms) at a time until a send of a's
  /// completes (at most 20); returns how many it took, the completions in `tx`.
  int timeouts_until_completion(std::vector<Cqe>& tx) {
    int steps = 0;
    while (tx.empty() && steps < 20) {
      ++steps;
      now_ += 70'000'000;
      dev_.poll(now_);
      tx = drain(acq_);
    }
    return steps;
  }
  /// Posts one 8-byte SEND a -> b on connection 1 that the peer's TCP takes and its backend
  /// never answers (silence, not a NAK).
  void send_one_the_peer_holds() {
    loop_.conn = 1;
    post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);
    dev_.poll(now_);
    ASSERT_EQ(loop_.q.size(), 1u);
    loop_.q.clear();
    loop_.delivered = loop_.queued;
  }
  /// Lets every frame reach the peer and settles: a's one SEND completes successfully and b
  /// receives it.
  void expect_the_send_arrives() {
    loop_.delivered = loop_.queued;
    settle();
    auto tx = drain(acq_);
    ASSERT_EQ(tx.size(), 1u);
    EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(drain(bcq_).size(), 1u);
  }
  /// Moves the clock one ACK timeout (70 ms) at a time while a's QP has spent exactly one
  /// retry, `limit_ns` at most; returns how long that lasted.
  uint64_t while_one_retry(uint64_t limit_ns) {
    const uint64_t start = now_;
    while (qp_counters(dev_, qa_.qpn, "a")["retries"] == 1 && now_ - start < limit_ns) {
      now_ += 70'000'000;
      dev_.poll(now_);
    }
    return now_ - start;
  }
  /// Moves the clock 10 ms at a time (10 s at most) until a send of a's completes, losing
  /// whatever a sends meanwhile; the peer's TCP takes it (a kPing too) when `path_delivers`.
  /// Returns the time it took, the completions in `tx`.
  uint64_t until_unanswered_send_completes(bool path_delivers, std::vector<Cqe>& tx) {
    const uint64_t start = now_;
    while (tx.empty() && now_ - start < 10'000'000'000ull) {
      now_ += 10'000'000;
      dev_.poll(now_);
      loop_.q.clear();
      if (path_delivers) loop_.delivered = loop_.queued;
      tx = drain(acq_);
    }
    return now_ - start;
  }
  /// Connects the pair with atomics allowed on b's QP: a word of b's memory holding `v`.
  MemV connect_with_atomic_word(uint64_t v) {
    MemV word = mem(b_, kAccess | IBV_ACCESS_REMOTE_ATOMIC);
    connect_both();
    QpAttr a{};
    a.qp_access_flags = kAccess | IBV_ACCESS_REMOTE_ATOMIC;
    EXPECT_TRUE(modify(b_, qb_, IBV_QP_ACCESS_FLAGS, a));
    std::memcpy(word.p(), &v, 8);
    return word;
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
