// PathLock (src/verbs/path_lock.h): the lock of the library's post and poll paths, which the
// first thread takes with plain stores until another thread revokes that bias.
#include "verbs/path_lock.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

namespace vrdma::verbs {
namespace {

// Threads add to a plain counter under the lock, reading it, pausing, then writing it back, so
// that a thread is inside nearly all the time; an increment lost to two threads inside at once
// shows as a total short of the increments made. The first thread starts alone (and, with
// `owner_first`, takes the bias); the others start once it is under way, so each revocation
// meets an owner inside. Returns {counter, increments made}.
// Each round makes a new lock, so each is one more revocation (there is no bias under
// ThreadSanitizer, where the rounds only test the spinlock, and slowly).
#if defined(__SANITIZE_THREAD__)
constexpr int kRounds = 20;
#else
constexpr int kRounds = 200;
#endif

std::pair<uint64_t, uint64_t> hammer(PathLock& lock, int threads, int per_thread,
                                     bool owner_first) {
  uint64_t counter = 0;
  std::atomic<uint64_t> made{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      if (t > 0) {
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      }
      for (int i = 0; i < per_thread; ++i) {
        lock.lock();
        const uint64_t v = counter;
        for (int k = 0; k < 20; ++k) __builtin_ia32_pause();
        counter = v + 1;
        lock.unlock();
        if (t == 0 && i == per_thread / 10) go.store(true, std::memory_order_release);
      }
      made.fetch_add(per_thread);
    });
    if (t == 0 && !owner_first) go.store(true, std::memory_order_release);
  }
  for (auto& th : ts) th.join();
  return {counter, made.load()};
}

TEST(PathLock, OneThreadHoldsTheBiasUntilASecondThreadTakesTheLock) {
  if (!asymmetric_barrier_available())
    GTEST_SKIP() << "no membarrier here: the lock is never biased";
  PathLock lock;
  EXPECT_FALSE(lock.biased());
  for (int i = 0; i < 1000; ++i) {
    lock.lock();
    lock.unlock();
  }
  EXPECT_TRUE(lock.biased());
  std::thread([&] {
    lock.lock();
    lock.unlock();
  }).join();
  EXPECT_FALSE(lock.biased());
  // The first owner still gets the lock, now the spinlock's way.
  lock.lock();
  lock.unlock();
  EXPECT_FALSE(lock.biased());
}

TEST(PathLock, NoIncrementIsLostWhenOtherThreadsRevokeABusyOwner) {
  for (int round = 0; round < kRounds; ++round) {
    for (int threads : {2, 4}) {
      PathLock lock;
      const auto [counter, made] = hammer(lock, threads, 2000, true);
      ASSERT_EQ(counter, made) << "round " << round << ", " << threads << " threads";
    }
  }
}

TEST(PathLock, NoIncrementIsLostWhenThreadsRaceForTheBias) {
  for (int round = 0; round < kRounds; ++round) {
    PathLock lock;
    const auto [counter, made] = hammer(lock, 3, 2000, false);
    ASSERT_EQ(counter, made) << "round " << round;
  }
}

TEST(PathLock, AChildOfForkRevokesItsParentsBias) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "no bias under ThreadSanitizer, which also stops a forked child's threads";
#endif
  PathLock lock;
  lock.lock();  // this thread takes the bias
  lock.unlock();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The child's own second thread must get the lock (membarrier in a forked process).
    std::thread([&] {
      lock.lock();
      lock.unlock();
    }).join();
    lock.lock();
    lock.unlock();
    ::_exit(lock.biased() ? 2 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died: status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace vrdma::verbs
