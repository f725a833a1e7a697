// keep_state and the RDMA CM (docs/ARCHITECTURE.md, "RDMA CM", keep_state): the sessions whose
// CM state changed are noted only when tracked; a kept state imported in recover mode by a new
// service goes on where it was (local peers stay local, nobody is told of a move, a TIMEWAIT_EXIT
// that came already does not come again); an id whose local peer was not restored hears it
// went; and the keeper's record of a guest (KeptGuests) takes CM-only updates beside its device
// state and hands both back.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "backend/keeper.h"
#include "cm_test_end.h"
#include "common/socket.h"

namespace vrdma::backend {
namespace {

/// Copies of the descriptors export_sessions lent (the keeper's own, as it would hold them).
std::vector<UniqueFd> dup_all(const std::vector<int>& fds) {
  std::vector<UniqueFd> v;
  for (int f : fds) v.emplace_back(::fcntl(f, F_DUPFD_CLOEXEC, 0));
  return v;
}

struct CmKeepTest : CmServiceTest {
  CmService to;  ///< the restarted backend's service
  /// End `e`'s CM state, kept and imported into `to` in recover mode (as the keeper hands it).
  Status restore(End& e) {
    std::vector<int> fds;
    const std::string state = cm.export_sessions({{e.s.id, 1000 + e.s.id}}, fds);
    std::vector<UniqueFd> kept = dup_all(fds);
    return to.import_sessions(state, kept, {{1000 + e.s.id, e.s.id}}, true);
  }
  /// The same session served by `to`: its channel and the guest's end of it.
  End moved(End& e) { return End(to, e.s.id, e.channel, std::move(e.events)); }
};

TEST_F(CmKeepTest, ChangedSessionsAreNotedOnlyWhenTracked) {
  uint32_t c;
  request(&c);
  EXPECT_FALSE(cm.has_changes());
  cm.track_changes(true);
  const uint32_t other = cli.create_id();
  EXPECT_EQ(cm.take_changes(), std::unordered_set<uint32_t>{cli.s.id});
  // A connect changes the listener's session too (a new id, its CONNECT_REQUEST).
  const uint32_t c2 = cli.resolved(v4("127.0.0.1", 7000));
  (void)cm.take_changes();
  ASSERT_EQ(cli.conn(Op::kCmConnect, c2, 0x13), 0);
  EXPECT_EQ(cm.take_changes(), (std::unordered_set<uint32_t>{cli.s.id, srv.s.id}));
  EXPECT_FALSE(cm.has_changes());
  (void)other;
}

TEST_F(CmKeepTest, ARestoredPairGoesOnAndDisconnectsLocally) {
  const auto [c, s] = established();
  ASSERT_TRUE(restore(srv).is_ok());  // one guest at a time: its peer is not there yet
  ASSERT_TRUE(restore(cli).is_ok());
  to.settle_restored();
  End srv2 = moved(srv), cli2 = moved(cli);
  EXPECT_TRUE(srv2.quiet());
  EXPECT_TRUE(cli2.quiet());
  EXPECT_EQ(to.ports(), 2u);  // the listener's and the connected id's
  // The listener still takes requests, and the connection ends as it would have here.
  ASSERT_EQ(cli2.handle_cmd(Op::kCmDisconnect, c), 0);
  EXPECT_EQ(cli2.next().event, ev(CmEventType::kDisconnected));
  EXPECT_EQ(srv2.next().event, ev(CmEventType::kDisconnected));
  ASSERT_EQ(srv2.handle_cmd(Op::kCmDisconnect, s), 0);
  const uint32_t c2 = cli2.resolved(v4("127.0.0.1", 7000));
  ASSERT_EQ(cli2.conn(Op::kCmConnect, c2, 0x15), 0);
  EXPECT_EQ(srv2.next().event, ev(CmEventType::kConnectRequest));
}

TEST_F(CmKeepTest, AnIdWhosePeerWasNotRestoredHearsItWent) {
  const auto [c, s] = established();
  uint32_t pending;
  request(&pending);  // a REQ the listener's side never answered
  ASSERT_TRUE(restore(cli).is_ok());
  to.settle_restored();
  End cli2 = moved(cli);
  std::vector<std::pair<uint32_t, int32_t>> got;
  for (int i = 0; i < 2; ++i) {
    const CmEvent e = cli2.next();
    got.emplace_back(e.id, static_cast<int32_t>(e.event));
  }
  std::sort(got.begin(), got.end());
  auto want = std::vector<std::pair<uint32_t, int32_t>>{
      {c, static_cast<int32_t>(CmEventType::kDisconnected)},
      {pending, static_cast<int32_t>(CmEventType::kRejected)}};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
  EXPECT_TRUE(cli2.quiet());
  (void)s;
}

TEST_F(CmKeepTest, ATimewaitExitComesOnceAcrossARestore) {
  const auto [c, s] = established();
  cli_disconnects(c);
  ASSERT_EQ(srv.handle_cmd(Op::kCmDisconnect, s), 0);  // srv's DREP: its timewait runs now
  ASSERT_TRUE(restore(cli).is_ok());
  ASSERT_TRUE(restore(srv).is_ok());
  End cli2 = moved(cli), srv2 = moved(srv);
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  to.on_timer();
  EXPECT_EQ(srv2.next().event, ev(CmEventType::kTimewaitExit));
  EXPECT_TRUE(srv2.quiet());
  EXPECT_TRUE(cli2.quiet());
}

/// Every message `sock` holds now: (op, body bytes, descriptors).
struct Msg {
  Op op;
  std::string body;
  size_t fds;
};
std::vector<Msg> drain(int sock) {
  std::vector<Msg> out;
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    if (::poll(&p, 1, 0) != 1) return out;
    std::vector<uint8_t> m;
    std::vector<UniqueFd> fds;
    if (!recv_msg(sock, m, kMaxImportMessage, fds).is_ok()) return out;
    MsgHeader h;
    std::memcpy(&h, m.data(), sizeof(h));
    out.push_back(
        {static_cast<Op>(h.op), std::string(m.begin() + sizeof(MsgHeader), m.end()), fds.size()});
  }
}

/// How many messages `sock` holds now (read and dropped): what one send is.
size_t drain_count(int sock) { return drain(sock).size(); }

TEST(KeptGuestsTest, ACmOnlyRecordReplacesTheCmStateBesideTheDevicesAndBothComeBack) {
  int sv[2], back[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, back), 0);
  UniqueFd a(sv[0]), b(sv[1]), ka(back[0]), kb(back[1]);
  KeptGuests kept;
  auto feed = [&] {
    const int fd = b.get();
    for (;;) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 0) != 1) return;
      std::vector<uint8_t> m;
      std::vector<UniqueFd> fds;
      ASSERT_TRUE(recv_msg(fd, m, kMaxImportMessage, fds).is_ok());
      MsgHeader h;
      std::memcpy(&h, m.data(), sizeof(h));
      kept.take(static_cast<Op>(h.op), m, fds);
    }
  };
  const std::vector<uint8_t> blob = {1, 2, 3};
  const int dev_fd = ka.get(), ch1 = kb.get(), ch2 = a.get();
  const CmPart first{"{\"cm\":1}", {&ch1, 1}};
  ASSERT_TRUE(send_state(a.get(), "g", blob, {&dev_fd, 1}, 0, &first).is_ok());
  feed();
  const int both[2] = {ch1, ch2};
  const CmPart second{"{\"cm\":2}", both};
  ASSERT_TRUE(send_state(a.get(), "g", {}, {}, kKeepCmOnly, &second).is_ok());
  // CM state alone for a guest with no device state kept: nothing to put it beside.
  ASSERT_TRUE(send_state(a.get(), "h", {}, {}, kKeepCmOnly, &second).is_ok());
  feed();
  EXPECT_EQ(kept.size(), 1u);
  kept.hand_back(ka.get());
  std::vector<Msg> got = drain(kb.get());
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got[2].body, "{\"cm\":2}");
  EXPECT_EQ(got[2].fds, 2u);
  // The same in one message (what the server sends after a CM command).
  const CmPart third{"{\"cm\":3}", {&ch2, 1}};
  ASSERT_TRUE(send_cm_state(a.get(), "g", third).is_ok());
  ASSERT_TRUE(send_cm_state(a.get(), "h", third).is_ok());
  ASSERT_EQ(drain_count(b.get()), 2u);
  ASSERT_TRUE(send_cm_state(a.get(), "g", third).is_ok());
  ASSERT_TRUE(send_cm_state(a.get(), "h", third).is_ok());
  feed();
  EXPECT_EQ(kept.size(), 1u);

  kept.hand_back(ka.get());
  got = drain(kb.get());
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got[0].op, Op::kImportBegin);
  ImportBeginReq begin;
  ASSERT_EQ(got[0].body.size(), sizeof(begin));
  std::memcpy(&begin, got[0].body.data(), sizeof(begin));
  EXPECT_STREQ(begin.guest, "g");
  EXPECT_EQ(begin.bytes, 3u);
  EXPECT_EQ(begin.fds, 1u);
  EXPECT_EQ(begin.flags, kImportRecover);
  EXPECT_EQ(got[1].op, Op::kImportData);
  EXPECT_EQ(got[1].body, std::string("\x01\x02\x03", 3));
  EXPECT_EQ(got[1].fds, 1u);
  EXPECT_EQ(got[2].op, Op::kImportCm);
  EXPECT_EQ(got[2].body, "{\"cm\":3}");
  EXPECT_EQ(got[2].fds, 1u);
  EXPECT_EQ(got[3].op, Op::kImportCommit);
  EXPECT_EQ(got[4].op, Op::kKeepEnd);

  // A whole record again (the device changed) carries its own CM state, none here.
  ASSERT_TRUE(send_state(a.get(), "g", blob, {&dev_fd, 1}).is_ok());
  feed();
  kept.hand_back(ka.get());
  const std::vector<Msg> again = drain(kb.get());
  ASSERT_EQ(again.size(), 4u);
  EXPECT_EQ(again[2].op, Op::kImportCommit);
}

}  // namespace
}  // namespace vrdma::backend
