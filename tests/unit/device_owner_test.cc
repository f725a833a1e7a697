// A guest belongs to the uid that created it (issue 21, item 2): the session rule of
// Device::open_session, identity from SO_PEERCRED rather than from the hello, and the owner
// surviving what moves guests (the state blob, and a version 1 blob that had no owner).
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "device_fixture.h"
#include "proto/device_state.h"

namespace vrdma::engine::devtest {
namespace {

constexpr uint32_t kBackendUid = 60000;  ///< the backend's own user: an admin
constexpr uint32_t kOwner = 60001, kStranger = 60002;

class OwnerTest : public DeviceTest {
 protected:
  void SetUp() override {
    dev_.set_backend_uid(kBackendUid);
    DeviceTest::SetUp();
  }
  /// A hello for `name` from a process of `uid` (pid 777 by the kernel, 1 by its own word).
  Result<Session*> hello(const char* name, uint32_t uid, Device* dev = nullptr) {
    HelloReq req{};
    std::snprintf(req.guest, sizeof(req.guest), "%s", name);
    req.pid = 1;
    HelloResp resp{};
    FdList fds;
    return (dev ? dev : &dev_)->open_session(req, PeerCred{777, uid, uid}, resp, fds);
  }
  size_t sessions_of(const std::string& guest) {
    size_t n = 0;
    for (const auto& [id, s] : dev_.sessions()) n += s->guest->name == guest;
    return n;
  }
};

TEST_F(OwnerTest, AGuestTakesItsOwnerAndTheAdminsAndRefusesOthersWithEperm) {
  auto first = hello("g", kOwner);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  Session* s = first.value();
  EXPECT_EQ(s->guest->owner_uid, kOwner);
  EXPECT_EQ(s->uid, kOwner);
  EXPECT_EQ(s->pid, 777u);  // the kernel's pid, not the one the hello claims

  // Charge something, so a refused stranger is seen to leave the quotas alone.
  ASSERT_TRUE(dev_.alloc_pd(*s).is_ok());
  const uint64_t pds = s->guest->used[static_cast<size_t>(Res::kPd)];
  for (int i = 0; i < 3; ++i) {  // repeated: refused each time (logged once)
    auto r = hello("g", kStranger);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.err(), EPERM);
  }
  EXPECT_EQ(s->guest->refused_logged, std::vector<uint32_t>{kStranger});
  EXPECT_EQ(sessions_of("g"), 1u);
  EXPECT_EQ(s->guest->sessions, 1u);
  EXPECT_EQ(s->guest->used[static_cast<size_t>(Res::kPd)], pds);

  // The owner opens more sessions; root and the backend's user may join any guest, and
  // joining does not make them its owner.
  for (uint32_t uid : {kOwner, 0u, kBackendUid}) {
    auto r = hello("g", uid);
    ASSERT_TRUE(r.is_ok()) << uid << ": " << r.status().message();
    EXPECT_EQ(r.value()->uid, uid);
  }
  EXPECT_EQ(s->guest->owner_uid, kOwner);
  EXPECT_EQ(sessions_of("g"), 4u);
  EXPECT_EQ(hello("g", kStranger).err(), EPERM);

  // A guest ends with its last session; the name is then free for anyone.
  std::vector<Session*> all;
  for (const auto& [id, x] : dev_.sessions())
    if (x->guest->name == "g") all.push_back(x.get());
  for (Session* x : all) dev_.close_session(x);
  EXPECT_FALSE(dev_.has_guest("g"));
  auto again = hello("g", kStranger);
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(again.value()->guest->owner_uid, kStranger);
  EXPECT_EQ(hello("g", kOwner).err(), EPERM);
}

TEST_F(OwnerTest, AGuestAnAdminCreatedBelongsToThatAdmin) {
  auto r = hello("adm", 0);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r.value()->guest->owner_uid, 0u);
  EXPECT_EQ(hello("adm", kOwner).err(), EPERM);
  EXPECT_TRUE(hello("adm", kBackendUid).is_ok());
}

TEST_F(OwnerTest, StatusNamesEachGuestsOwnerAndEachSessionsUid) {
  ASSERT_TRUE(hello("g", kOwner).is_ok());
  const auto st = nlohmann::json::parse(dev_.status_json());
  bool seen = false;
  for (const auto& g : st["guests"]) {
    if (g["name"] != "g") continue;
    seen = true;
    EXPECT_EQ(g["uid"], kOwner);
    ASSERT_EQ(g["sessions"].size(), 1u);
    EXPECT_EQ(g["sessions"][0]["uid"], kOwner);
    EXPECT_EQ(g["sessions"][0]["pid"], 777);
  }
  EXPECT_TRUE(seen) << st.dump();
}

TEST_F(OwnerTest, AGuestWhoseFirstSessionFailsLeavesNoTraceBehind) {
  // No descriptor left for the session's control page: the hello fails (EMFILE), and the guest
  // it would have created is gone, so the name is not held for that uid with no session to end.
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  const int lowest = ::dup(0);  // every descriptor below it is in use
  ASSERT_GE(lowest, 0);
  ::close(lowest);
  rlimit tight = old;
  tight.rlim_cur = static_cast<rlim_t>(lowest);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  auto r = hello("fails", kOwner);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.err(), EMFILE) << r.status().message();
  EXPECT_FALSE(dev_.has_guest("fails"));
  EXPECT_EQ(nlohmann::json::parse(dev_.status_json())["totals"]["guests"], 2);  // a and b
  auto again = hello("fails", kStranger);
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(again.value()->guest->owner_uid, kStranger);
}

TEST_F(OwnerTest, TheOwnerMovesWithTheGuestsState) {
  auto s = hello("mv", kOwner);
  ASSERT_TRUE(s.is_ok());
  auto ex = dev_.export_guest("mv", [](const Session&) { return -1; });
  ASSERT_TRUE(ex.is_ok()) << ex.status().message();
  std::vector<UniqueFd> fds = dup_all(ex.value().fds);
  Device other;
  other.set_backend_uid(kBackendUid);
  auto r = other.import_guest(ex.value().blob, fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_EQ(r.value().size(), 1u);
  EXPECT_EQ(r.value()[0].session->guest->owner_uid, kOwner);
  EXPECT_EQ(r.value()[0].session->uid, kOwner);
  EXPECT_EQ(hello("mv", kStranger, &other).err(), EPERM);
  EXPECT_TRUE(hello("mv", kOwner, &other).is_ok());
}

TEST_F(OwnerTest, AVersionOneBlobImportsWithNoOwnerWhichOnlyAdminsMayJoin) {
  auto s = hello("old", kOwner);
  ASSERT_TRUE(s.is_ok());
  auto ex = dev_.export_guest("old", [](const Session&) { return -1; });
  ASSERT_TRUE(ex.is_ok());
  // What a backend before owners wrote: version 1, no owner_uid, no session uids.
  auto doc = nlohmann::json::from_cbor(ex.value().blob);
  doc["version"] = 1;
  in_flight_as_version_9(doc, [](const nlohmann::json&) { return nullptr; });
  doc.erase("owner_uid");
  for (auto& js : doc["sessions"]) js.erase("uid");
  // ... and counters without the transport's (version 3 added them at the end).
  doc["retired"].get_binary().resize(offsetof(QpCounters, replays));
  const std::vector<uint8_t> v1 = nlohmann::json::to_cbor(doc);
  std::vector<UniqueFd> fds = dup_all(ex.value().fds);
  Device other;
  other.set_backend_uid(kBackendUid);
  auto r = other.import_guest(v1, fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  // The server takes the owner from the guest's connection (Server::adopt); without one,
  // nobody but an admin may join.
  EXPECT_EQ(r.value()[0].session->guest->owner_uid, kNoUid);
  EXPECT_EQ(hello("old", kOwner, &other).err(), EPERM);
  EXPECT_TRUE(hello("old", 0, &other).is_ok());
  // A version this backend does not know is refused, whole.
  doc["version"] = proto::kStateVersion + 1;
  std::vector<UniqueFd> more = dup_all(ex.value().fds);
  Device third;
  EXPECT_EQ(third.import_guest(nlohmann::json::to_cbor(doc), more).err(), EPROTONOSUPPORT);
  EXPECT_FALSE(third.has_guest("old"));
}

}  // namespace
}  // namespace vrdma::engine::devtest
