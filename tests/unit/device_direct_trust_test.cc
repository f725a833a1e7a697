// The direct path's trust rule (docs/ARCHITECTURE.md, "Direct path"): a grant needs one uid and
// either the operator's word ([datapath] direct_trust = "uid", direct_tenants) or a proof that
// the requester could already write the peer's memory: a /proc/PID/mem descriptor opened
// O_RDWR through which the backend reads the peer's cookie. Real descriptors, real pids, a real
// pid namespace (as root).
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include <chrono>

#include "device_fixture.h"
#include "engine/direct_trust.h"

namespace vrdma::engine::devtest {
namespace {

class DirectTrustTest : public DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    dev_.set_direct(true);
    // Both guests are this process: the kernel lets it write its own memory.
    a_.s->pid = b_.s->pid = static_cast<uint32_t>(::getpid());
    connect_both();
  }
  Result<DirectGrantResp> grant() {
    std::vector<UniqueFd> fds;
    return dev_.direct_grant(*a_.s, qa_.handle, fds);
  }
  /// b's library's cookie, kept at `cookie_` (this process's memory).
  void send_cookie() {
    DirectCookieReq req{reinterpret_cast<uint64_t>(cookie_), {}};
    for (size_t i = 0; i < sizeof(cookie_); ++i) cookie_[i] = static_cast<uint8_t>(0xa0 + i);
    std::memcpy(req.cookie, cookie_, sizeof(cookie_));
    ASSERT_TRUE(dev_.direct_cookie(*b_.s, req).is_ok());
  }
  Status prove(const char* path, int flags) {
    return dev_.direct_prove(*a_.s, qa_.handle, UniqueFd(::open(path, flags | O_CLOEXEC, 0600)));
  }
  /// The grant's answer once no proof of a's is being read any more (2 s at most): 0 or errno.
  int settled_grant() {
    int rc = EAGAIN;
    for (int i = 0; i < 2000 && rc == EAGAIN; ++i) {
      rc = grant().status().err();
      if (rc == EAGAIN) ::usleep(1000);
    }
    return rc;
  }
  /// A proof through `path`, then the grant: what a's library sees in the end (0: granted). A
  /// proof still being read after the backend's short wait (a busy machine) is settled by the
  /// grants that follow.
  int prove_and_grant(const char* path, int flags) {
    (void)prove(path, flags);
    return settled_grant();
  }
  alignas(16) uint8_t cookie_[kDirectCookieBytes] = {};
};

TEST_F(DirectTrustTest, OneUidIsNotEnoughWithoutAProof) {
  auto r = grant();
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().err(), EACCES);
  // Before the peer's library told where its cookie is, there is nothing to prove against.
  EXPECT_EQ(dev_.direct_peer(*a_.s, qa_.handle).status().err(), EAGAIN);
  EXPECT_EQ(prove("/proc/self/mem", O_RDWR).err(), EAGAIN);
}

TEST_F(DirectTrustTest, AProofOfWriteAccessGrants) {
  send_cookie();
  auto peer = dev_.direct_peer(*a_.s, qa_.handle);
  ASSERT_TRUE(peer.is_ok()) << peer.status().message();
  EXPECT_EQ(peer.value().pid, static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(prove_and_grant(fmt::format("/proc/{}/mem", peer.value().pid).c_str(), O_RDWR), 0);
  // The proof is a's about b, not b's about a.
  std::vector<UniqueFd> fds;
  EXPECT_EQ(dev_.direct_grant(*b_.s, qb_.handle, fds).status().err(), EACCES);
}

TEST_F(DirectTrustTest, ForgedProofsAreRefused) {
  send_cookie();
  // Open for reading only: not what the kernel checks for writing.
  EXPECT_EQ(prove("/proc/self/mem", O_RDONLY).err(), EPERM);
  // A writable file of /proc that is not a process's memory.
  EXPECT_EQ(prove("/proc/self/comm", O_RDWR).err(), EPERM);
  // A file of our own named mem, open for writing (it could hold anything at any offset).
  char dir[] = "/tmp/vrdma-trust-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string fake = std::string(dir) + "/mem";
  EXPECT_EQ(prove(fake.c_str(), O_RDWR | O_CREAT).err(), EPERM);
  ::unlink(fake.c_str());
  ::rmdir(dir);
  // No descriptor at all.
  EXPECT_EQ(dev_.direct_prove(*a_.s, qa_.handle, UniqueFd()).err(), EINVAL);
  // The memory of a process that does not hold the cookie there (a child, its copy changed).
  const pid_t child = ::fork();
  if (child == 0) {
    cookie_[0] ^= 0xff;
    ::pause();
    ::_exit(0);
  }
  ASSERT_GT(child, 0);
  ::usleep(50000);  // the child has flipped its copy (a late flip only makes the refusal sure)
  EXPECT_EQ(prove_and_grant(fmt::format("/proc/{}/mem", child).c_str(), O_RDWR), EACCES);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(grant().status().err(), EACCES);
  // The genuine one still works after all that.
  EXPECT_EQ(prove_and_grant("/proc/self/mem", O_RDWR), 0);
}

// The backend reads the cookie through page tables the peer controls. A userfaultfd cannot hold
// that read (the kernel fails a fault it cannot retry), so a peer that arms one on its cookie
// is refused at once; what could hold it (a FUSE mapping, a long mmap_lock) holds the proof's
// own thread, and the proof settles at a later grant (Session::proving).
TEST_F(DirectTrustTest, APeerThatFaultsTheReadIsRefusedAtOnce) {
  UniqueFd uffd(static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK)));
  if (!uffd.valid()) GTEST_SKIP() << "no userfaultfd here: " << std::strerror(errno);
  uffdio_api api{UFFD_API, 0, 0};
  ASSERT_EQ(::ioctl(uffd.get(), UFFDIO_API, &api), 0);
  void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  MappedRegion page(p, 4096);
  const uint64_t at = reinterpret_cast<uint64_t>(page.data());
  uffdio_register reg{{at, 4096}, UFFDIO_REGISTER_MODE_MISSING, 0};
  ASSERT_EQ(::ioctl(uffd.get(), UFFDIO_REGISTER, &reg), 0);
  DirectCookieReq req{at, {}};
  for (size_t i = 0; i < sizeof(req.cookie); ++i) req.cookie[i] = static_cast<uint8_t>(7 * i + 1);
  ASSERT_TRUE(dev_.direct_cookie(*b_.s, req).is_ok());
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(prove_and_grant("/proc/self/mem", O_RDWR), EACCES);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1000));
  // Nobody waits on the fault: the descriptor has nothing to read.
  uffd_msg msg;
  EXPECT_EQ(::read(uffd.get(), &msg, sizeof(msg)), -1);
}

TEST_F(DirectTrustTest, TheOperatorCanDeclareATenant) {
  dev_.set_direct_trust(false, {{"x", "a"}, {"b", "y"}});
  EXPECT_EQ(grant().status().err(), EACCES);  // a and b are in different tenants
  dev_.set_direct_trust(false, {{"x", "a", "b"}});
  EXPECT_TRUE(grant().is_ok());
  dev_.set_direct_trust(true, {});  // direct_trust = "uid"
  std::vector<UniqueFd> fds;
  EXPECT_TRUE(dev_.direct_grant(*b_.s, qb_.handle, fds).is_ok());
}

TEST_F(DirectTrustTest, NeverAcrossUids) {
  dev_.set_direct_trust(true, {});
  b_.s->uid = a_.s->uid + 1;
  EXPECT_EQ(grant().status().err(), EPERM);
  send_cookie();
  EXPECT_EQ(dev_.direct_peer(*a_.s, qa_.handle).status().err(), EPERM);
  EXPECT_EQ(prove("/proc/self/mem", O_RDWR).err(), EPERM);
}

// A peer in another pid namespace (a container) is not named to the caller; one in a nested
// namespace is named by the caller's own numbering.
TEST(PidAsSeenBy, FollowsPidNamespaces) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    // A new pid namespace for the next child: it is pid 1 there.
    if (::unshare(CLONE_NEWPID) != 0) ::_exit(3);
    const pid_t inner = ::fork();
    if (inner == 0) {
      ::pause();
      ::_exit(0);
    }
    (void)!::write(p[1], &inner, sizeof(inner));
    ::waitpid(inner, nullptr, 0);
    ::_exit(0);
  }
  ::close(p[1]);
  pid_t inner = 0;
  const bool got = ::read(p[0], &inner, sizeof(inner)) == sizeof(inner);
  ::close(p[0]);
  if (!got) {
    ::waitpid(child, nullptr, 0);
    GTEST_SKIP() << "no new pid namespace here (not root?)";
  }
  auto down = pid_as_seen_by(::getpid(), inner);
  ASSERT_TRUE(down.is_ok()) << down.status().message();
  EXPECT_EQ(down.value(), static_cast<uint32_t>(inner));
  auto self = pid_as_seen_by(inner, inner);
  ASSERT_TRUE(self.is_ok()) << self.status().message();
  EXPECT_EQ(self.value(), 1u);
  EXPECT_EQ(pid_as_seen_by(inner, ::getpid()).status().err(), EPERM);
  EXPECT_EQ(pid_as_seen_by(inner, child).status().err(), EPERM);
  ::kill(inner, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(pid_as_seen_by(::getpid(), inner).status().err(), ESRCH);
}

}  // namespace
}  // namespace vrdma::engine::devtest
