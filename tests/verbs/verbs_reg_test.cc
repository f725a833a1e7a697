// ibv_reg_mr while other threads run (issue 21, item 6): registration moves pages into a segment,
// and no write by another thread to those pages may be lost meanwhile, inside the MR or beside
// it; buffers on a thread's stack are refused with EFAULT.
#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "verbs_fixture.h"

namespace vrdma::test {
namespace {

class VerbsRegTest : public VerbsFixture {};

constexpr size_t kPage = 4096;
constexpr size_t kPages = 16;
constexpr int kWorkers = 3;
constexpr int kRegistrations = 2000;

/// Where worker `t` keeps its counter in page `p` of a region: in the first and the last page
/// outside the MR (which starts 256 bytes into the region and ends 256 bytes before its end),
/// in every other page inside it.
size_t counter_offset(size_t p, int t) {
  if (p == 0) return 8 * static_cast<size_t>(t);
  if (p == kPages - 1) return p * kPage + kPage - 8 * static_cast<size_t>(t + 1);
  return p * kPage + 2048 + 8 * static_cast<size_t>(t);
}

// Workers increment their counters in the current region (each counter has one writer) while
// the test registers and deregisters an MR on it; each worker counts its increments itself.
// After each round the workers stop and the region must hold every increment they counted.
// Every round takes fresh anonymous pages, so every registration copies and remaps them.
TEST_F(VerbsRegTest, NoWriteIsLostWhileRegistering) {
#if defined(__SANITIZE_THREAD__)
  // TSan holds an asynchronous signal back until the thread enters one of its interceptors: the
  // workers below spin in instrumented code only, so none would stop and every registration
  // would time out (EAGAIN). The release and asan-ubsan builds run it.
  GTEST_SKIP() << "ThreadSanitizer defers the stop signal of threads that never leave "
                  "instrumented code";
#endif
  std::atomic<uint8_t*> region{nullptr};
  std::atomic<int> round{0}, stop_round{0}, done_count{0};
  std::atomic<bool> quit{false};
  std::atomic<uint64_t> progress[kWorkers] = {};
  uint64_t counted[kWorkers][kPages] = {};  // a worker's own counts, read after it is done

  std::vector<std::thread> workers;
  for (int t = 0; t < kWorkers; ++t) {
    workers.emplace_back([&, t] {
      int seen = 0;
      while (!quit.load(std::memory_order_acquire)) {
        const int r = round.load(std::memory_order_acquire);
        if (r == seen) {
          std::this_thread::yield();
          continue;
        }
        uint8_t* base = region.load(std::memory_order_acquire);
        uint64_t local[kPages] = {};
        while (stop_round.load(std::memory_order_acquire) != r) {
          for (size_t p = 0; p < kPages; ++p) {
            std::atomic_ref<uint64_t> c(*reinterpret_cast<uint64_t*>(base + counter_offset(p, t)));
            c.store(c.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
            ++local[p];
          }
          progress[t].fetch_add(1, std::memory_order_relaxed);
        }
        std::copy(local, local + kPages, counted[t]);
        seen = r;
        done_count.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  }

  const auto start = std::chrono::steady_clock::now();
  uint64_t lost = 0, increments = 0;
  int rounds = 0;
  for (; rounds < kRegistrations; ++rounds) {
    // A cap, not an assertion: a slow machine runs fewer rounds.
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(10)) break;
    void* m =
        ::mmap(nullptr, kPages * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(m, MAP_FAILED);
    auto* base = static_cast<uint8_t*>(m);
    uint64_t before[kWorkers];
    for (int t = 0; t < kWorkers; ++t) before[t] = progress[t].load(std::memory_order_relaxed);
    region.store(base, std::memory_order_release);
    round.store(rounds + 1, std::memory_order_release);
    // Every worker writes in this region before the registration starts.
    for (int t = 0; t < kWorkers; ++t) {
      while (progress[t].load(std::memory_order_relaxed) == before[t]) std::this_thread::yield();
    }
    ibv_mr* mr = ibv_reg_mr(pd_, base + 256, kPages * kPage - 512, IBV_ACCESS_LOCAL_WRITE);
    ASSERT_NE(mr, nullptr) << std::strerror(errno);
    ASSERT_EQ(ibv_dereg_mr(mr), 0);
    stop_round.store(rounds + 1, std::memory_order_release);
    while (done_count.load(std::memory_order_acquire) != kWorkers * (rounds + 1))
      std::this_thread::yield();
    for (int t = 0; t < kWorkers; ++t) {
      for (size_t p = 0; p < kPages; ++p) {
        const uint64_t got = *reinterpret_cast<uint64_t*>(base + counter_offset(p, t));
        increments += counted[t][p];
        if (got != counted[t][p]) lost += counted[t][p] - got;
      }
    }
    ASSERT_EQ(::munmap(m, kPages * kPage), 0);
  }
  quit.store(true, std::memory_order_release);
  for (auto& w : workers) w.join();
  RecordProperty("registrations", rounds);
  EXPECT_GT(rounds, 0);
  EXPECT_EQ(lost, 0u) << "of " << increments << " increments in " << rounds << " registrations";
}

void expect_refused(ibv_pd* pd, void* buf, size_t len) {
  errno = 0;
  ibv_mr* mr = ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
  EXPECT_EQ(mr, nullptr);
  EXPECT_EQ(errno, EFAULT);
  if (mr) ibv_dereg_mr(mr);
}

// gtest runs tests on the main thread: this buffer is in "[stack]".
TEST_F(VerbsRegTest, MainThreadStackIsRefused) {
  alignas(64) volatile char buf[8192];
  buf[0] = 1;
  expect_refused(pd_, const_cast<char*>(buf), sizeof(buf));
  EXPECT_EQ(buf[0], 1);
}

// A pthread's stack is an anonymous mapping like any other; registering it used to remap the
// registering thread's own stack under it and crash the process.
TEST_F(VerbsRegTest, OwnPthreadStackIsRefused) {
  std::thread([&] {
    alignas(64) volatile char buf[8192];
    buf[100] = 7;
    expect_refused(pd_, const_cast<char*>(buf), sizeof(buf));
    EXPECT_EQ(buf[100], 7);
  }).join();
}

// Another thread's stack, registered while that thread waits (its stack pointer in that mapping).
TEST_F(VerbsRegTest, OtherThreadsStackIsRefused) {
  std::atomic<char*> buf{nullptr};
  std::atomic<bool> leave{false};
  std::thread other([&] {
    alignas(64) char local[8192];
    local[0] = 3;
    buf.store(local, std::memory_order_release);
    while (!leave.load(std::memory_order_acquire)) ::usleep(1000);
    EXPECT_EQ(local[0], 3);
  });
  while (!buf.load(std::memory_order_acquire)) std::this_thread::yield();
  expect_refused(pd_, buf.load(), 8192);
  leave.store(true, std::memory_order_release);
  other.join();
}

// After ibv_fork_init() registered pages are MADV_DONTFORK, as with rdma-core: a child has no
// mapping there (and fork() copies nothing), while the parent keeps its data. Without it a child
// gets a private copy (verbs_two_process_test and the e2e tests fork with registered memory).
TEST_F(VerbsRegTest, ForkInitLeavesRegisteredPagesOutOfTheChild) {
  ASSERT_EQ(ibv_fork_init(), 0);
  EXPECT_EQ(ibv_is_fork_initialized(), IBV_FORK_ENABLED);
  constexpr size_t kLen = 4 * kPage;
  void* m = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  std::memset(m, 0x5a, kLen);
  ibv_mr* mr = ibv_reg_mr(pd_, m, kLen, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // mincore fails with ENOMEM on an address with no mapping.
    unsigned char vec[4];
    const bool mapped = ::mincore(m, kLen, vec) == 0 || errno != ENOMEM;
    ::_exit(mapped ? 1 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(static_cast<unsigned char*>(m)[kLen - 1], 0x5a);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  ::munmap(m, kLen);
}

}  // namespace
}  // namespace vrdma::test
