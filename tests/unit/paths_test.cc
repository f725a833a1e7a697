// What the CLI, the library and the backend share about reaching a backend: the guest-name rule,
// a call that gives up on a backend that does not answer, and starting one on demand that fails
// at once when what it started exits.
#include "common/paths.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include <string>

#include "common/socket.h"

namespace vrdma {
namespace {

uint64_t mono_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000 + uint64_t(ts.tv_nsec) / 1000000;
}

/// A private directory (0700), removed with what is in it.
struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/vrdma-paths-test.XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() { [[maybe_unused]] int rc = std::system(("rm -rf " + path).c_str()); }
};

TEST(PathsTest, GuestNameRule) {
  for (const char* ok : {"g", "pgrp-123", "tenant_a.b:c@d+e", "A9-"})
    EXPECT_TRUE(check_guest_name(ok).is_ok()) << ok;
  EXPECT_TRUE(check_guest_name(std::string(63, 'a')).is_ok());
  const struct {
    std::string name;
    const char* says;
  } bad[] = {
      {"", "guest name '' is empty"},
      {std::string(64, 'a'), "is 64 bytes long"},
      {std::string(100, 'a'), "is 100 bytes long"},
      {"-x", "starts with -"},
      {"a b", "has a space"},
      {"a/b", "has '/'"},
      {std::string("a\x01", 2), "has the byte 0x01"},
      {"caf\xc3\xa9", "has the byte 0xc3"},
  };
  for (const auto& b : bad) {
    Status st = check_guest_name(b.name);
    ASSERT_FALSE(st.is_ok()) << b.name;
    EXPECT_EQ(st.err(), EINVAL);
    EXPECT_NE(st.message().find(b.says), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("a guest name is 1 to 63 bytes"), std::string::npos);
  }
}

TEST(PathsTest, GuestNameFromTheEnvironment) {
  ::unsetenv("VRDMA_GUEST");
  auto d = guest_name();
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d.value(), "pgrp-" + std::to_string(::getpgrp()));
  ::setenv("VRDMA_GUEST", "", 1);  // set, but empty: not the default
  auto e = guest_name();
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("VRDMA_GUEST: guest name '' is empty"), std::string::npos);
  ::setenv("VRDMA_GUEST", "g1", 1);
  EXPECT_EQ(guest_name().value(), "g1");
  ::unsetenv("VRDMA_GUEST");
}

// A backend that accepts nothing (stopped): the connect succeeds (the backlog), the answer never
// comes, and the status call says which pid does not answer.
TEST(PathsTest, StatusOfABackendThatDoesNotAnswer) {
  TempDir dir;
  const std::string sock = dir.path + "/s.sock";
  auto l = listen_unix(sock);
  ASSERT_TRUE(l.is_ok()) << l.status().message();
  const uint64_t t0 = mono_ms();
  auto st = backend_status(sock, 200);
  const uint64_t took = mono_ms() - t0;
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.err(), ETIMEDOUT);
  EXPECT_NE(st.status().message().find("backend pid " + std::to_string(::getpid()) +
                                       " does not answer on " + sock + " within 200 ms"),
            std::string::npos)
      << st.status().message();
  EXPECT_GE(took, 190u);
  EXPECT_LT(took, 2000u);
}

TEST(PathsTest, StartingWhatIsNoBackendFailsAtOnce) {
  TempDir dir;
  const std::string sock = dir.path + "/s.sock";
  auto none = start_backend(dir.path + "/no/vrdmad", sock, 60);
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().message(), dir.path + "/no/vrdmad is not executable");
  // /bin/false exits at once: the wait ends with it, well before its 10 s.
  auto started = start_backend("/bin/false", sock, 60);
  ASSERT_TRUE(started.is_ok()) << started.status().message();
  EXPECT_GT(started.value().pid, 0);
  EXPECT_EQ(started.value().log, dir.path + "/vrdmad.log");
  const uint64_t t0 = mono_ms();
  auto fd = await_backend(sock, started.value(), 10000);
  ASSERT_FALSE(fd.is_ok());
  EXPECT_EQ(fd.err(), ECHILD);
  EXPECT_NE(fd.status().message().find("the backend it started (pid " +
                                       std::to_string(started.value().pid) + ") exited"),
            std::string::npos)
      << fd.status().message();
  EXPECT_LT(mono_ms() - t0, 3000u);
}

}  // namespace
}  // namespace vrdma
