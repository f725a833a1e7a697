// The backend server over a real SOCK_SEQPACKET socket: malformed messages get an error reply or
// a closed connection, never a crash, and a fresh connection still works afterwards.
#include "backend/server.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "common/socket.h"
#include "proto/command.h"
#include "proto/ring.h"

namespace vrdma::backend {
namespace {

using namespace vrdma::proto;
using Bytes = std::vector<uint8_t>;

struct Reply {
  enum Kind { kMsg, kClosed, kTimeout } kind = kTimeout;
  Bytes bytes;
  std::vector<UniqueFd> fds;
  MsgHeader hdr() const {
    MsgHeader h{};
    std::memcpy(&h, bytes.data(), std::min(bytes.size(), sizeof(h)));
    return h;
  }
};

Reply recv_reply(int fd, int timeout_ms = 5000) {
  Reply r;
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return r;
  Status st = recv_msg(fd, r.bytes, kMaxResponse, r.fds);
  r.kind = st.is_ok() ? Reply::kMsg : Reply::kClosed;
  return r;
}

Bytes hello_msg(const char* guest, uint32_t seq = 1) {
  HelloReq h{};
  std::snprintf(h.guest, sizeof(h.guest), "%s", guest);
  h.pid = static_cast<uint32_t>(::getpid());
  return encode(Op::kHello, seq, 0, h);
}

Config test_config(const std::string& socket) {
  Config c;
  c.socket_path = socket;
  return c;
}

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/vrdma-server-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/vrdmad.sock";
    server_ = std::make_unique<Server>(test_config(path_));
    thread_ = std::thread([this] { run_status_ = server_->run(); });
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      if (connect_unix(path_).is_ok()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    FAIL() << "server did not start listening on " << path_;
  }
  void TearDown() override {
    server_->stop();
    // run() may sleep in epoll_wait with no timeout: a connection wakes it up to see stop_.
    (void)connect_unix(path_);
    thread_.join();
    EXPECT_TRUE(run_status_.is_ok()) << run_status_.message();
    std::filesystem::remove_all(dir_);
  }
  UniqueFd conn() {
    auto r = connect_unix(path_);
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    return r.is_ok() ? std::move(r.value()) : UniqueFd();
  }
  static void send(int fd, const Bytes& b) { ASSERT_TRUE(send_msg(fd, b).is_ok()); }

  // A malformed message: either an error reply with a negative status, or the connection closes.
  static void expect_rejected(int fd) {
    Reply r = recv_reply(fd);
    ASSERT_NE(r.kind, Reply::kTimeout) << "no answer to a malformed message";
    if (r.kind == Reply::kMsg) {
      ASSERT_GE(r.bytes.size(), sizeof(MsgHeader));
      EXPECT_LT(r.hdr().status, 0);
      EXPECT_EQ(r.hdr().magic, kMagic);
    }
  }
  // The backend survived: a fresh session says hello and allocates a PD.
  void expect_healthy(const char* guest = "fresh") {
    UniqueFd fd = conn();
    send(fd.get(), hello_msg(guest));
    Reply h = recv_reply(fd.get());
    ASSERT_EQ(h.kind, Reply::kMsg);
    ASSERT_TRUE(decode_header(h.bytes).is_ok());
    ASSERT_EQ(h.hdr().status, 0);
    auto resp = body_of<HelloResp>(h.bytes);
    ASSERT_TRUE(resp.is_ok());
    EXPECT_NE(resp->lid, 0u);
    EXPECT_EQ(h.fds.size(), 3u);  // control page, doorbell, async events
    send(fd.get(), encode(Op::kAllocPd, 2, 0, Empty{}));
    Reply pd = recv_reply(fd.get());
    ASSERT_EQ(pd.kind, Reply::kMsg);
    EXPECT_EQ(pd.hdr().status, 0);
    EXPECT_EQ(pd.hdr().seq, 2u);
    auto handle = body_of<HandleResp>(pd.bytes);
    ASSERT_TRUE(handle.is_ok());
    EXPECT_NE(handle->handle, 0u);
  }
  nlohmann::json status_totals() {
    UniqueFd fd = conn();
    send(fd.get(), encode(Op::kStatus, 9, 0, StatusReq{}));
    Reply r = recv_reply(fd.get());
    EXPECT_EQ(r.kind, Reply::kMsg);
    EXPECT_EQ(r.hdr().status, 0);
    if (r.bytes.size() < sizeof(MsgHeader) + 4) return {};
    uint32_t n;
    std::memcpy(&n, r.bytes.data() + sizeof(MsgHeader), 4);
    EXPECT_EQ(sizeof(MsgHeader) + 4 + n, r.bytes.size());
    return nlohmann::json::parse(r.bytes.begin() + sizeof(MsgHeader) + 4, r.bytes.end())["totals"];
  }

  std::string dir_, path_;
  std::unique_ptr<Server> server_;
  std::thread thread_;
  Status run_status_;
};

TEST_F(ServerTest, HelloAndAllocPd) { expect_healthy(); }

TEST_F(ServerTest, GarbageBytes) {
  std::mt19937 rng(5);
  for (size_t len : {1u, 23u, 24u, 100u, 4096u}) {
    UniqueFd fd = conn();
    Bytes b(len);
    for (auto& c : b) c = static_cast<uint8_t>(rng());
    send(fd.get(), b);
    expect_rejected(fd.get());
  }
  expect_healthy();
}

TEST_F(ServerTest, EmptyMessage) {
  UniqueFd fd = conn();
  send(fd.get(), Bytes{});
  expect_rejected(fd.get());
  expect_healthy();
}

TEST_F(ServerTest, TruncatedHeader) {
  UniqueFd fd = conn();
  Bytes m = hello_msg("t");
  m.resize(10);
  send(fd.get(), m);
  expect_rejected(fd.get());
  expect_healthy();
}

TEST_F(ServerTest, BadMagicVersionAndOpcode) {
  for (int which = 0; which < 3; ++which) {
    UniqueFd fd = conn();
    Bytes m = hello_msg("v");
    MsgHeader h;
    std::memcpy(&h, m.data(), sizeof(h));
    if (which == 0) h.magic = 0x12345678;
    if (which == 1) h.version = kVersion + 1;
    if (which == 2) h.op = static_cast<uint16_t>(Op::kMax);
    std::memcpy(m.data(), &h, sizeof(h));
    send(fd.get(), m);
    Reply r = recv_reply(fd.get());
    ASSERT_NE(r.kind, Reply::kTimeout);
    if (r.kind == Reply::kMsg) {
      const int want[] = {-EPROTO, -EPROTONOSUPPORT, -EOPNOTSUPP};
      EXPECT_EQ(r.hdr().status, want[which]) << which;
      EXPECT_EQ(recv_reply(fd.get()).kind, Reply::kClosed);
    }
  }
  expect_healthy();
}

TEST_F(ServerTest, BodySizeMismatch) {
  for (int delta : {-1, +1}) {
    UniqueFd fd = conn();
    Bytes m = hello_msg("s");
    m.resize(m.size() + delta);
    MsgHeader h;
    std::memcpy(&h, m.data(), sizeof(h));
    h.length = static_cast<uint32_t>(m.size());
    std::memcpy(m.data(), &h, sizeof(h));
    send(fd.get(), m);
    expect_rejected(fd.get());
  }
  UniqueFd fd = conn();  // declared length disagrees with what arrived
  Bytes m = hello_msg("s");
  m[8] ^= 0x10;
  send(fd.get(), m);
  expect_rejected(fd.get());
  expect_healthy();
}

TEST_F(ServerTest, CommandBeforeHello) {
  UniqueFd fd = conn();
  send(fd.get(), encode(Op::kAllocPd, 1, 0, Empty{}));
  expect_rejected(fd.get());
  expect_healthy();
}

TEST_F(ServerTest, SecondHello) {
  UniqueFd fd = conn();
  send(fd.get(), hello_msg("twice"));
  Reply first = recv_reply(fd.get());
  ASSERT_EQ(first.kind, Reply::kMsg);
  ASSERT_EQ(first.hdr().status, 0);
  send(fd.get(), hello_msg("twice", 2));
  expect_rejected(fd.get());
  expect_healthy();
}

TEST_F(ServerTest, RequestOneByteOverTheLimit) {
  UniqueFd fd = conn();
  Bytes m(kMaxRequest + 1, 0);
  MsgHeader h{kMagic, kVersion, static_cast<uint16_t>(Op::kHello),
              static_cast<uint32_t>(m.size()), 1, 0, 0};
  std::memcpy(m.data(), &h, sizeof(h));
  send(fd.get(), m);
  expect_rejected(fd.get());
  expect_healthy();
}

TEST_F(ServerTest, FailingCommandKeepsTheSession) {
  UniqueFd fd = conn();
  send(fd.get(), hello_msg("keep"));
  ASSERT_EQ(recv_reply(fd.get()).hdr().status, 0);
  send(fd.get(), encode(Op::kDeallocPd, 2, 0, HandleReq{12345, 0}));
  Reply r = recv_reply(fd.get());
  ASSERT_EQ(r.kind, Reply::kMsg);
  EXPECT_EQ(r.hdr().status, -EINVAL);
  send(fd.get(), encode(Op::kAllocPd, 3, 0, Empty{}));
  r = recv_reply(fd.get());
  ASSERT_EQ(r.kind, Reply::kMsg);
  EXPECT_EQ(r.hdr().status, 0);
}

// A posted command (kRequestNoAnswer) takes effect and gets no answer, not even a failing one;
// the next call's answer is the first thing the session reads. The control page offers it.
TEST_F(ServerTest, PostedCommandGetsNoAnswer) {
  UniqueFd fd = conn();
  send(fd.get(), hello_msg("posted"));
  Reply h = recv_reply(fd.get());
  ASSERT_EQ(h.hdr().status, 0);
  ASSERT_EQ(h.fds.size(), 3u);
  void* cp = ::mmap(nullptr, sizeof(ControlPage), PROT_READ, MAP_SHARED, h.fds[0].get(), 0);
  ASSERT_NE(cp, MAP_FAILED);
  EXPECT_NE(static_cast<const ControlPage*>(cp)->features & kFeatureNoAnswer, 0u);
  ::munmap(cp, sizeof(ControlPage));
  auto posted = [](Bytes b) {
    const uint32_t flags = kRequestNoAnswer;
    std::memcpy(b.data() + offsetof(MsgHeader, flags), &flags, sizeof(flags));
    return b;
  };
  send(fd.get(), posted(encode(Op::kAllocPd, 2, 0, Empty{})));
  send(fd.get(), posted(encode(Op::kDeallocPd, 3, 0, HandleReq{12345, 0})));  // fails: EINVAL
  send(fd.get(), encode(Op::kAllocPd, 4, 0, Empty{}));
  Reply r = recv_reply(fd.get());
  ASSERT_EQ(r.kind, Reply::kMsg);
  EXPECT_EQ(r.hdr().seq, 4u);
  EXPECT_EQ(r.hdr().status, 0);
  EXPECT_EQ(recv_reply(fd.get(), 100).kind, Reply::kTimeout);  // nothing else came
  EXPECT_EQ(status_totals()["pd"], 2);                         // the posted one was made
}

TEST_F(ServerTest, DisconnectReclaimsTheSession) {
  {
    UniqueFd fd = conn();
    send(fd.get(), hello_msg("gone"));
    ASSERT_EQ(recv_reply(fd.get()).hdr().status, 0);
    send(fd.get(), encode(Op::kAllocPd, 2, 0, Empty{}));
    ASSERT_EQ(recv_reply(fd.get()).hdr().status, 0);
    auto t = status_totals();
    EXPECT_EQ(t["sessions"], 1);
    EXPECT_EQ(t["pd"], 1);
  }
  nlohmann::json t;
  for (int i = 0; i < 500; ++i) {
    t = status_totals();
    if (t["sessions"] == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(t["sessions"], 0);
  EXPECT_EQ(t["pd"], 0);
  EXPECT_EQ(t["guests"], 0);
}

}  // namespace
}  // namespace vrdma::backend
