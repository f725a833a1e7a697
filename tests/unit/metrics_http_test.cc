// The metrics endpoint driven in-process: the test owns the epoll set and plays the server's
// loop, so every client behaviour (complete, slow, oversized, garbage, too many) is exact. Over
// TCP and over a unix socket in a temporary directory (its checks, mode, stale file, peer uid).
#include "backend/metrics_http.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace vrdma::backend {
namespace {

constexpr uint64_t kTag = 1ull << 59;

/// The test's side of the server loop: the epoll set, the endpoint and a client's view of it.
class MetricsLoop : public ::testing::Test {
 protected:
  /// One turn of the server's loop: dispatch whatever is ready. Returns the number of events.
  int turn(int timeout_ms = 50) {
    epoll_event evs[32];
    int n = ::epoll_wait(epoll_.get(), evs, 32, timeout_ms);
    for (int i = 0; i < n; ++i)
      http_.on_event(static_cast<int>(evs[i].data.u64 & 0xffffffff), evs[i].events, now_);
    return n < 0 ? 0 : n;
  }
  /// Reads until EOF while turning the loop; "" on time-out.
  std::string response(int fd) {
    std::string out;
    for (int i = 0; i < 200; ++i) {
      turn(5);
      pollfd p{fd, POLLIN, 0};
      while (::poll(&p, 1, 0) > 0) {
        char buf[4096];
        ssize_t n = ::read(fd, buf, sizeof(buf));
        if (n <= 0) return out;
        out.append(buf, static_cast<size_t>(n));
      }
    }
    return "";
  }
  static void send_all(int fd, const std::string& s) {
    ASSERT_EQ(::send(fd, s.data(), s.size(), MSG_NOSIGNAL), static_cast<ssize_t>(s.size()));
  }

  UniqueFd epoll_{::epoll_create1(EPOLL_CLOEXEC)};
  int renders_ = 0;
  std::optional<uint32_t> uid_;  ///< whom the last rendering was for
  MetricsHttp http_{epoll_.get(), kTag, [this](std::optional<uint32_t> uid) {
                      ++renders_;
                      uid_ = uid;
                      return std::string("# TYPE up gauge\nup 1\n");
                    }};
  uint64_t now_ = 1'000'000'000;
};

class MetricsHttpTest : public MetricsLoop {
 protected:
  void SetUp() override {
    ASSERT_TRUE(epoll_.valid());
    Status st = http_.listen("127.0.0.1:0");
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_GT(http_.port(), 0);
  }
  UniqueFd connect_client() {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(http_.port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    turn();  // accept
    return fd;
  }
};

TEST_F(MetricsHttpTest, ServesMetricsAndClosesTheConnection) {
  UniqueFd c = connect_client();
  send_all(c.get(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string r = response(c.get());
  EXPECT_TRUE(r.starts_with("HTTP/1.1 200 OK\r\n")) << r;
  EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << r;
  EXPECT_NE(r.find("Content-Length: 21\r\n"), std::string::npos) << r;
  EXPECT_TRUE(r.ends_with("\r\n\r\n# TYPE up gauge\nup 1\n")) << r;
  EXPECT_EQ(renders_, 1);
  EXPECT_FALSE(uid_.has_value()) << "TCP carries no credentials";
}

TEST_F(MetricsHttpTest, ARequestInPiecesIsAnsweredWhenComplete) {
  UniqueFd c = connect_client();
  send_all(c.get(), "GET /metr");
  turn();
  EXPECT_EQ(renders_, 0);
  send_all(c.get(), "ics HTTP/1.0\r\n\r\n");
  EXPECT_TRUE(response(c.get()).starts_with("HTTP/1.1 200 OK"));
}

TEST_F(MetricsHttpTest, BadRequestsGetErrors) {
  struct Case {
    std::string req, status;
  } cases[] = {
      {"POST /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 405 "},
      {"HEAD /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 405 "},
      {"GET /other HTTP/1.1\r\n\r\n", "HTTP/1.1 404 "},
      {"garbage\r\n\r\n", "HTTP/1.1 400 "},
      {"GET /metrics SMTP\r\n\r\n", "HTTP/1.1 400 "},
      {"GET /metrics HTTP/1.1\r\nX: " + std::string(MetricsHttp::kMaxRequest, 'a') + "\r\n\r\n",
       "HTTP/1.1 431 "},
  };
  for (const auto& c : cases) {
    UniqueFd fd = connect_client();
    send_all(fd.get(), c.req);
    std::string r = response(fd.get());
    EXPECT_TRUE(r.starts_with(c.status)) << c.req.substr(0, 40) << " got: " << r;
  }
  EXPECT_EQ(renders_, 0);
}

TEST_F(MetricsHttpTest, SlowClientsAreEvictedAndExpireWithoutBlockingOthers) {
  std::vector<UniqueFd> idle;
  for (size_t i = 0; i < MetricsHttp::kMaxClients + 4; ++i) {
    idle.push_back(connect_client());
    now_ += 1000;  // accepted in order
  }
  // A complete request still gets its answer while the idle ones hold their sockets.
  UniqueFd c = connect_client();
  send_all(c.get(), "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_TRUE(response(c.get()).starts_with("HTTP/1.1 200 OK"));
  // The oldest were dropped to stay within kMaxClients: they read EOF.
  size_t closed = 0;
  for (auto& fd : idle) {
    pollfd p{fd.get(), POLLIN, 0};
    char b;
    closed += ::poll(&p, 1, 0) == 1 && ::read(fd.get(), &b, 1) == 0;
  }
  EXPECT_GE(closed, 5u);
  EXPECT_LT(closed, idle.size());
  // After the time-out every remaining one is closed too.
  http_.expire(now_ + MetricsHttp::kClientTimeoutNs + 1);
  for (auto& fd : idle) {
    pollfd p{fd.get(), POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 1000), 1);
    char b;
    EXPECT_EQ(::read(fd.get(), &b, 1), 0);
  }
}

// A full descriptor table: accept fails with EMFILE and the scrape stays queued, so the
// level-triggered listener stays readable. The listener must rest (leave the epoll set) instead
// of waking the loop on every turn, and take the scrape once its rest is over.
// With the descriptor table full, a sanitizer's own checks fail (UBSan's vptr check tests memory
// through a pipe and reports a false error): these two run in the release build.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitizerNeedsDescriptors = true;
#else
constexpr bool kSanitizerNeedsDescriptors = false;
#endif

TEST_F(MetricsHttpTest, AListenerOutOfDescriptorsRestsInsteadOfSpinning) {
  if (kSanitizerNeedsDescriptors) GTEST_SKIP() << "the sanitizer needs descriptors of its own";
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  // A client connected first (its socket is the test's), then the table filled up to a lowered
  // soft limit: the backend side of the connection has no descriptor to take.
  UniqueFd client(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(http_.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(client.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  int highest = ::dup(epoll_.get());
  ASSERT_GE(highest, 0);
  ::close(highest);
  rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(highest) + 64;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<UniqueFd> filler;
  for (;;) {
    int fd = ::dup(epoll_.get());
    if (fd < 0) break;
    filler.emplace_back(fd);
  }
  const int fill_err = errno;
  const uint64_t accepts_before = http_.accepts();
  int wakeups = 0;
  for (int i = 0; i < 200; ++i) wakeups += turn(0);
  const uint64_t accepts_full = http_.accepts() - accepts_before, rests_full = http_.rests();
  // The time of the rest passes (the loop's clock, not the wall's): it looks once more, and
  // rests again while the table is still full.
  now_ += ListenerRest::kRestNs;
  http_.poll(now_);
  EXPECT_EQ(http_.rest_until_ns(), 0u);
  for (int i = 0; i < 200; ++i) wakeups += turn(0);
  const uint64_t rests_after = http_.rests();
  // A descriptor comes free: after the rest the scrape is accepted and answered.
  filler.clear();
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_EQ(fill_err, EMFILE);
  EXPECT_EQ(wakeups, 2) << "the listener woke the loop on every turn";
  EXPECT_EQ(accepts_full, 1u);
  EXPECT_EQ(rests_full, 1u);
  EXPECT_EQ(rests_after, 2u);
  EXPECT_NE(http_.rest_until_ns(), 0u);
  now_ += ListenerRest::kRestNs;
  http_.poll(now_);
  send_all(client.get(), "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_TRUE(response(client.get()).starts_with("HTTP/1.1 200 OK"));
  EXPECT_EQ(http_.rest_until_ns(), 0u);
}

// A client that closes frees a descriptor: a resting listener is watched again at once.
TEST_F(MetricsHttpTest, AClosedClientEndsTheRest) {
  if (kSanitizerNeedsDescriptors) GTEST_SKIP() << "the sanitizer needs descriptors of its own";
  UniqueFd c = connect_client();
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  UniqueFd waiting(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(http_.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(waiting.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  int highest = ::dup(epoll_.get());
  ASSERT_GE(highest, 0);
  ::close(highest);
  rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(highest) + 16;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<UniqueFd> filler;
  for (int fd; (fd = ::dup(epoll_.get())) >= 0;) filler.emplace_back(fd);
  for (int i = 0; i < 50; ++i) turn(0);
  const bool rested = http_.rest_until_ns() != 0;
  // The first client's request is answered and its connection closed: one descriptor free.
  send_all(c.get(), "GET /metrics HTTP/1.1\r\n\r\n");
  const bool answered = response(c.get()).starts_with("HTTP/1.1 200 OK");
  const bool awake = http_.rest_until_ns() == 0;
  filler.clear();
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_TRUE(rested);
  EXPECT_TRUE(answered);
  EXPECT_TRUE(awake);
  send_all(waiting.get(), "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_TRUE(response(waiting.get()).starts_with("HTTP/1.1 200 OK"));
}

TEST(MetricsHttpListen, BadOrTakenAddressesAreErrors) {
  UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
  MetricsHttp a(ep.get(), kTag, [](auto) { return std::string(); });
  ASSERT_TRUE(a.listen("127.0.0.1:0").is_ok());
  MetricsHttp b(ep.get(), kTag, [](auto) { return std::string(); });
  Status st = b.listen("127.0.0.1:" + std::to_string(a.port()));
  EXPECT_EQ(st.err(), EADDRINUSE) << st.message();
  EXPECT_NE(st.message().find("Address already in use"), std::string::npos);
  EXPECT_FALSE(b.listen("300.1.2.3:9464").is_ok());
  EXPECT_FALSE(b.listen("no-port").is_ok());
}

/// The endpoint on unix:DIR/m.sock, DIR a fresh 0700 directory of the test's.
class MetricsUnixTest : public MetricsLoop {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/vrdma-metrics-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/m.sock";
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  static UniqueFd connect_to(const std::string& path) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0) fd.reset();
    return fd;
  }
  static mode_t mode_of(const std::string& path) {
    struct stat st {};
    return ::lstat(path.c_str(), &st) == 0 ? st.st_mode : 0;
  }
  /// A socket file at `path` that nothing listens on: what a backend that died leaves.
  static void stale_socket(const std::string& path) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
    ASSERT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  }
  Status listen_at(const std::string& path, mode_t mode = 0600) {
    MetricsHttp m(epoll_.get(), kTag, [](auto) { return std::string(); });
    return m.listen("unix:" + path, mode);
  }

  std::string dir_, path_;
};

TEST_F(MetricsUnixTest, ServesMetricsWithThePeersUidAndRemovesItsSocket) {
  stale_socket(path_);  // left by a backend that died: replaced
  Status st = http_.listen("unix:" + path_);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(http_.where(), "unix:" + path_);
  EXPECT_EQ(http_.port(), 0);
  EXPECT_TRUE(S_ISSOCK(mode_of(path_)));
  EXPECT_EQ(mode_of(path_) & 07777, 0600u);
  UniqueFd c = connect_to(path_);
  ASSERT_TRUE(c.valid());
  turn();  // accept
  send_all(c.get(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string r = response(c.get());
  EXPECT_TRUE(r.starts_with("HTTP/1.1 200 OK\r\n")) << r;
  EXPECT_TRUE(r.ends_with("\r\n\r\n# TYPE up gauge\nup 1\n")) << r;
  ASSERT_TRUE(uid_.has_value());
  EXPECT_EQ(*uid_, ::geteuid());
  // A second endpoint on the same path: the first one listens there, so it is refused.
  st = listen_at(path_);
  EXPECT_EQ(st.err(), EADDRINUSE) << st.message();
  EXPECT_NE(st.message().find(path_), std::string::npos) << st.message();
  EXPECT_TRUE(S_ISSOCK(mode_of(path_))) << "the refused endpoint removed the live socket";
}

TEST_F(MetricsUnixTest, TheSocketGetsItsModeAndGoesWithTheEndpoint) {
  {
    MetricsHttp m(epoll_.get(), kTag, [](auto) { return std::string(); });
    ASSERT_TRUE(m.listen("unix:" + path_, 0660).is_ok());
    EXPECT_EQ(mode_of(path_) & 07777, 0660u);
  }
  EXPECT_EQ(mode_of(path_), 0u) << "the socket file is left behind";
  // A file that replaced ours is not ours to remove.
  {
    MetricsHttp m(epoll_.get(), kTag, [](auto) { return std::string(); });
    ASSERT_TRUE(m.listen("unix:" + path_).is_ok());
    ASSERT_EQ(::unlink(path_.c_str()), 0);
    stale_socket(path_);
  }
  EXPECT_TRUE(S_ISSOCK(mode_of(path_)));
}

TEST_F(MetricsUnixTest, BadPathsAndModesAreRefusedWithThePath) {
  struct Case {
    std::string path;
    int err;
    std::string expect;
  };
  const std::string file = dir_ + "/file";
  std::FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  ASSERT_EQ(::symlink(file.c_str(), (dir_ + "/link").c_str()), 0);
  const Case cases[] = {
      {"relative.sock", EINVAL, "absolute path"},
      {"", EINVAL, "absolute path"},
      {dir_ + "/", EINVAL, "absolute path"},
      {dir_ + "/missing/m.sock", ENOENT, dir_ + "/missing does not exist"},
      {file, EEXIST, file + " exists and is not a socket"},
      {dir_ + "/link", EEXIST, "is not a socket but a symlink"},
      {dir_ + "/" + std::string(120, 'x'), ENAMETOOLONG, "longer than"},
  };
  for (const Case& c : cases) {
    Status st = listen_at(c.path);
    EXPECT_EQ(st.err(), c.err) << c.path << ": " << st.message();
    EXPECT_NE(st.message().find("unix:" + c.path), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << st.message();
  }
  EXPECT_EQ(::access(file.c_str(), F_OK), 0) << "a file in the way was removed";
  for (mode_t bad : {0700u, 0400u, 04600u}) {
    Status st = listen_at(path_, bad);
    EXPECT_EQ(st.err(), EINVAL) << std::oct << bad;
    EXPECT_NE(st.message().find("socket mode"), std::string::npos) << st.message();
  }
  EXPECT_EQ(mode_of(path_), 0u);
}

// The directory is checked as the backend's socket directory is: another user who could write
// it, or who planted it as a symlink, could swap the socket or point chmod and unlink elsewhere.
TEST_F(MetricsUnixTest, ASymlinkedOrWritableDirectoryIsRefused) {
  const std::string real = dir_ + "/real", link = dir_ + "/linked";
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  Status st = listen_at(link + "/m.sock");
  EXPECT_EQ(st.err(), EPERM) << st.message();
  EXPECT_NE(st.message().find("unix:" + link + "/m.sock"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("symlink"), std::string::npos) << st.message();
  EXPECT_EQ(mode_of(real + "/m.sock"), 0u);
  ASSERT_EQ(::chmod(real.c_str(), 0777), 0);
  st = listen_at(real + "/m.sock");
  EXPECT_EQ(st.err(), EPERM) << st.message();
  EXPECT_NE(st.message().find("writable by other users"), std::string::npos) << st.message();
  EXPECT_EQ(mode_of(real + "/m.sock"), 0u);
  // Readable and searchable by a group (for 0660 and a group of scrapers) is fine.
  ASSERT_EQ(::chmod(real.c_str(), 0750), 0);
  EXPECT_TRUE(listen_at(real + "/m.sock").is_ok());
}

}  // namespace
}  // namespace vrdma::backend
