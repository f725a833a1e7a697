// What a connection may cost the backend before and after it says who it is: connections that
// have not said Hello are capped per uid and timed out, and a request whose descriptors found
// no room fails with EMFILE without ending its session. (The full descriptor table and the
// listener's rest are tests/security/fd_exhaustion.sh: they need the process's limits.)
#include <gtest/gtest.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "backend/server.h"
#include "common/socket.h"
#include "proto/command.h"

namespace vrdma::backend {
namespace {

using namespace vrdma::proto;
using Bytes = std::vector<uint8_t>;

enum class Got { kMsg, kClosed, kNothing };

/// What arrives on `fd` within `timeout_ms`; the message's status in `status`.
Got next(int fd, int timeout_ms, int32_t* status = nullptr) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return Got::kNothing;
  Bytes b;
  std::vector<UniqueFd> fds;
  if (!recv_msg(fd, b, kMaxResponse, fds).is_ok()) return Got::kClosed;
  if (status && b.size() >= sizeof(MsgHeader)) {
    MsgHeader h;
    std::memcpy(&h, b.data(), sizeof(h));
    *status = h.status;
  }
  return Got::kMsg;
}

class ServerLimitsTest : public ::testing::Test {
 protected:
  void start(int max_pending, int hello_timeout_ms) {
    char tmpl[] = "/tmp/vrdma-server-limits-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/vrdmad.sock";
    Config c;
    c.socket_path = path_;
    c.max_pending_connections = max_pending;
    c.hello_timeout_ms = hello_timeout_ms;
    server_ = std::make_unique<Server>(c);
    thread_ = std::thread([this] { run_status_ = server_->run(); });
    for (int i = 0; i < 2000 && !std::filesystem::exists(path_ + ".pid"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(std::filesystem::exists(path_ + ".pid")) << "the server did not start";
  }
  void TearDown() override {
    if (!server_) return;
    server_->stop();
    thread_.join();
    EXPECT_TRUE(run_status_.is_ok()) << run_status_.message();
    std::filesystem::remove_all(dir_);
  }
  UniqueFd conn() {
    auto r = connect_unix(path_, 5000);
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    return r.is_ok() ? std::move(r.value()) : UniqueFd();
  }
  /// A connection that said Hello (the answer came: every event before it was handled).
  UniqueFd session(const char* guest) {
    UniqueFd fd = conn();
    HelloReq h{};
    std::snprintf(h.guest, sizeof(h.guest), "%s", guest);
    h.pid = static_cast<uint32_t>(::getpid());
    EXPECT_TRUE(send_msg(fd.get(), encode(Op::kHello, 1, 0, h)).is_ok());
    int32_t st = -1;
    EXPECT_EQ(next(fd.get(), 5000, &st), Got::kMsg);
    EXPECT_EQ(st, 0);
    return fd;
  }
  static void expect_serves(int fd, uint32_t seq) {
    ASSERT_TRUE(send_msg(fd, encode(Op::kAllocPd, seq, 0, Empty{})).is_ok());
    int32_t st = -1;
    ASSERT_EQ(next(fd, 5000, &st), Got::kMsg);
    EXPECT_EQ(st, 0);
  }

  std::string dir_, path_;
  std::unique_ptr<Server> server_;
  std::thread thread_;
  Status run_status_;
};

TEST_F(ServerLimitsTest, ConnectionsWithoutHelloAreCappedPerUid) {
  start(/*max_pending=*/3, /*hello_timeout_ms=*/60000);
  UniqueFd a = session("a");  // not pending any more
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(conn());
  // One more than the cap: closed at once (long before any timeout).
  UniqueFd extra = conn();
  EXPECT_EQ(next(extra.get(), 10000), Got::kClosed);
  for (const UniqueFd& fd : idle) EXPECT_EQ(next(fd.get(), 0), Got::kNothing) << "within the cap";
  expect_serves(a.get(), 2);
  // One of them says Hello: it is served, and its place is free for a new one.
  HelloReq h{};
  std::snprintf(h.guest, sizeof(h.guest), "late");
  ASSERT_TRUE(send_msg(idle[0].get(), encode(Op::kHello, 1, 0, h)).is_ok());
  int32_t st = -1;
  ASSERT_EQ(next(idle[0].get(), 5000, &st), Got::kMsg);
  EXPECT_EQ(st, 0);
  UniqueFd another = conn();
  ASSERT_TRUE(send_msg(another.get(), encode(Op::kHello, 1, 0, h)).is_ok());
  st = -1;
  ASSERT_EQ(next(another.get(), 5000, &st), Got::kMsg) << "closed: the place was not given back";
  EXPECT_EQ(st, 0);
  expect_serves(a.get(), 3);
}

TEST_F(ServerLimitsTest, AConnectionWithoutHelloIsClosedAfterTheTimeout) {
  start(/*max_pending=*/64, /*hello_timeout_ms=*/300);
  UniqueFd a = session("a");
  UniqueFd idle = conn();
  EXPECT_EQ(next(idle.get(), 10000), Got::kClosed);
  // The session is not: it said Hello within the time.
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  expect_serves(a.get(), 2);
}

// More descriptors than the backend takes in one message: the kernel drops them (MSG_CTRUNC), as
// it does when the backend's table is full. The command fails with EMFILE; the session goes on.
TEST_F(ServerLimitsTest, DescriptorsThatFoundNoRoomFailTheCommandNotTheSession) {
  start(64, 60000);
  UniqueFd a = session("a");
  std::vector<UniqueFd> fds;
  for (size_t i = 0; i < kMaxFdsPerMessage + 8; ++i) fds.emplace_back(::eventfd(0, EFD_CLOEXEC));
  Bytes m = encode(Op::kRegSegment, 2, 0, RegSegmentReq{4096});
  iovec iov{m.data(), m.size()};
  std::vector<char> ctl(CMSG_SPACE(sizeof(int) * fds.size()));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl.data();
  msg.msg_controllen = ctl.size();
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  for (size_t i = 0; i < fds.size(); ++i) {
    const int fd = fds[i].get();
    std::memcpy(CMSG_DATA(c) + i * sizeof(int), &fd, sizeof(int));
  }
  ASSERT_EQ(::sendmsg(a.get(), &msg, 0), static_cast<ssize_t>(m.size()));
  int32_t st = 0;
  ASSERT_EQ(next(a.get(), 5000, &st), Got::kMsg);
  EXPECT_EQ(st, -EMFILE);
  expect_serves(a.get(), 3);
}

}  // namespace
}  // namespace vrdma::backend
