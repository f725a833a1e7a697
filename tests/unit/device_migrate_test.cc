// A guest's device moved in-process: export_guest, detach_guest, import_guest on the same Device
// (what `vrdma migrate` does between two backends, minus the socket). The regressions found by
// tests/hosts/migrate*.sh: a QP that had sent on shm could not be moved at all, and a TCP
// requester lost its unacknowledged messages (they went out again under later PSNs).
#include <fcntl.h>

#include <functional>

#include "loopback_fixture.h"

namespace vrdma::engine::devtest {
namespace {

/// Moves guest `g` out of `dev` and back in, as a migration does; returns its new session.
/// `edit`, when given, changes the blob (CBOR decoded) on the way.
Session* move_guest(Device& dev, const std::string& g,
                    const std::function<void(nlohmann::json&)>& edit = {}) {
  auto ex = dev.export_guest(g, [](const Session&) { return -1; });
  EXPECT_TRUE(ex.is_ok()) << ex.status().message();
  if (!ex.is_ok()) return nullptr;
  std::vector<UniqueFd> fds = dup_all(ex->fds);
  std::vector<uint8_t> blob = ex->blob;
  if (edit) {
    auto doc = nlohmann::json::from_cbor(blob);
    edit(doc);
    blob = nlohmann::json::to_cbor(doc);
  }
  dev.detach_guest(g);
  auto im = dev.import_guest(blob, fds);
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

// The blob of this version (10: what is in flight is taken from the send queue) and of version
// 9, as an older backend sends it (each WQE in flight copied into the blob).
class InFlightMoveTest : public DeviceRemoteTest, public ::testing::WithParamInterface<uint32_t> {
 protected:
  /// The blob as version GetParam() has it: for 9, the WQEs in flight copied from a's SQ.
  void as_param_version(nlohmann::json& doc) {
    if (GetParam() == kStateVersion) return;
    doc["version"] = GetParam();
    in_flight_as_version_9(doc, [&](const nlohmann::json& jq) {
      EXPECT_EQ(jq["qpn"], qa_.qpn);
      return qa_.sqe;
    });
  }
};

TEST_P(InFlightMoveTest, RequesterMovedWithMessagesInFlightDeliversEachOnceInOrder) {
  connect_both();
  post_numbered(4);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 4u);
  EXPECT_EQ(pump(2), 2);  // two requests executed; their ACKs wait in the queue
  // The requester moves: the ACKs addressed to where it was are lost, the rest still travel.
  a_.s = move_guest(dev_, "a", [&](nlohmann::json& doc) { as_param_version(doc); });
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

INSTANTIATE_TEST_SUITE_P(StateVersions, InFlightMoveTest, ::testing::Values(9u, kStateVersion));

// What is in flight is checked as any WQE: no more than the send cursors say were sent, and an
// inline payload no longer than the WQE holds (a resend copies that many bytes out of it).
TEST_P(InFlightMoveTest, InFlightWqesBeyondTheCursorsOrTheirInlineBytesAreRefused) {
  connect_both();
  post_numbered(4);
  dev_.poll(now_);
  ASSERT_EQ(loop_.q.size(), 4u);
  auto ex = dev_.export_guest("a", [](const Session&) { return -1; });
  ASSERT_TRUE(ex.is_ok()) << ex.status().message();
  const auto doc = nlohmann::json::from_cbor(ex->blob);
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit, const char* why) {
    auto bad = doc;
    as_param_version(bad);
    edit(bad["sessions"][0]["qps"][0]);
    std::vector<UniqueFd> fds = dup_all(ex->fds);
    Device other;
    auto r = other.import_guest(nlohmann::json::to_cbor(bad), fds);
    ASSERT_FALSE(r.is_ok()) << why;
    EXPECT_EQ(r.status().err(), EINVAL);
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
  };
  ASSERT_EQ(doc["sessions"][0]["qps"][0]["qpn"], qa_.qpn);
  if (GetParam() == kStateVersion) {
    refused([](nlohmann::json& jq) { jq["sq_sent"] = jq["sq_sent"].get<uint32_t>() - 1; },
            "do not match the QP's send cursors");
  } else {
    refused([](nlohmann::json& jq) { jq["unacked"].push_back(jq["unacked"][0]); },
            "do not match the QP's send cursors");
  }
  // The inline flag on the first WQE in flight, its length past the WQE's inline bytes.
  const uint32_t slot = doc["sessions"][0]["qps"][0]["sq_cons"].get<uint32_t>() & (qa_.sq_size - 1);
  qa_.sqe[slot].send_flags |= IBV_SEND_INLINE;
  constexpr uint32_t kLong = sizeof(SendWqe::inline_data) + 1;
  refused(
      [&](nlohmann::json& jq) {
        if (GetParam() == kStateVersion) {
          auto& b = jq["in_flight"].get_binary();
          std::memcpy(b.data() + offsetof(InFlight, len), &kLong, sizeof(kLong));
        } else {
          jq["unacked"][0][2] = kLong;
        }
      },
      "inline length");
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

// The responder moves after executing an atomic whose answer was lost: the requester's replay
// is answered from the atomic cache that moved with the QP (version 11: one byte string; 10: an
// array of [PSN, value] arrays, as an older backend sends it), not executed a second time.
class AtomicCacheMoveTest : public DeviceRemoteTest,
                            public ::testing::WithParamInterface<uint32_t> {};

TEST_P(AtomicCacheMoveTest, AResponderMovedAfterAnAtomicAnswersItsReplayFromTheCache) {
  MemV word = connect_with_atomic_word(40);
  post_rdma(qa_, 7, IBV_WR_ATOMIC_FETCH_AND_ADD, ma_.addr, 8, ma_.mr.lkey, word.addr,
            word.mr.rkey);
  dev_.poll(now_);
  EXPECT_EQ(pump(1), 1);  // executed at b; its answer is lost
  loop_.q.clear();
  b_.s = move_guest(dev_, "b", [&](nlohmann::json& doc) {
    auto& jq = doc["sessions"][0]["qps"][0];
    ASSERT_TRUE(jq["acache"].is_binary());
    if (GetParam() == kStateVersion) return;
    doc["version"] = GetParam();
    const auto& b = jq["acache"].get_binary();
    nlohmann::json arr = nlohmann::json::array();
    for (size_t i = 0; i + sizeof(AtomicCacheEntry) <= b.size(); i += sizeof(AtomicCacheEntry)) {
      AtomicCacheEntry e;
      std::memcpy(&e, b.data() + i, sizeof(e));
      arr.push_back({e.psn, uint64_t{e.value_hi} << 32 | e.value_lo});
    }
    while (arr.size() < 16) arr.push_back({0, 0});  // version 10 wrote all 16
    jq["acache"] = std::move(arr);
  });
  ASSERT_NE(b_.s, nullptr);
  dev_.on_peer_up("me");
  std::vector<Cqe> tx;
  for (int t = 0; t < 20 && tx.empty(); ++t) {
    settle();
    tx = drain(acq_);
    now_ += 70'000'000;  // an ACK timeout (timeout 14): the requester sends it again
  }
  uint64_t v = 0, got = 0;
  std::memcpy(&v, word.p(), 8);
  EXPECT_EQ(v, 41u) << "added once";
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  std::memcpy(&got, ma_.p(), 8);
  EXPECT_EQ(got, 40u);
}

INSTANTIATE_TEST_SUITE_P(StateVersions, AtomicCacheMoveTest,
                         ::testing::Values(10u, kStateVersion));

}  // namespace
}  // namespace vrdma::engine::devtest
