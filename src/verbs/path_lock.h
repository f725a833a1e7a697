// The locks of the data path: a spinlock, and PathLock, which one thread takes without any
// atomic read-modify-write.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>

namespace vrdma::verbs {

/// A spinlock: uncontended it costs one atomic exchange, and it never sleeps.
class SpinLock {
 public:
  void lock() {
    while (flag_.exchange(true, std::memory_order_acquire)) {
      while (flag_.load(std::memory_order_relaxed)) __builtin_ia32_pause();
    }
  }
  void unlock() { flag_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> flag_{false};
};

/// Makes every running thread of this process execute a full memory barrier
/// (membarrier(2), MEMBARRIER_CMD_PRIVATE_EXPEDITED). False where the kernel or a seccomp
/// filter does not allow it; `asymmetric_barrier_available()` says so before any bias is given.
/// The latter registers the process (once): ibv_open_device calls it before the library starts
/// a thread of its own, because in a process of several threads the kernel waits for an RCU
/// grace period to register (6-18 ms here), which the first post would pay inside the
/// application's timing.
bool asymmetric_barrier();
bool asymmetric_barrier_available();

/// The lock of a send queue, a receive queue or a CQ, taken on every post and poll.
///
/// Most programs use a queue from one thread. An atomic read-modify-write (a spinlock's
/// exchange) makes the core wait until all its earlier stores have left the store buffer; on the
/// direct path those are stores into lines the peer's core holds (its receive buffer, its
/// completion ring), and that wait measured a quarter of the 8-byte message rate. So the first
/// thread to take a PathLock gets a *bias*: it takes and releases it with plain stores to `in_`.
/// The first other thread that wants it revokes the bias, once and for good: it marks the lock
/// revoking, makes the owner's core run a full barrier (asymmetric_barrier), waits for the owner
/// to leave, and marks it revoked; from then on every thread, the owner too, takes the spinlock.
/// Why that is safe: the owner stores `in_` and then loads `state_`; the barrier the revoker
/// forces falls between its own store of `state_` and its load of `in_`, so either it sees the
/// owner inside or the owner sees the revocation. Without membarrier, or under ThreadSanitizer
/// (which cannot see that barrier), there is no bias: every lock() is the spinlock's.
class PathLock {
 public:
  void lock() {
    const pthread_t me = ::pthread_self();
    if (owner_.load(std::memory_order_relaxed) == me) {
      if (enter_biased()) return;
    } else if (state_.load(std::memory_order_relaxed) != kRevoked) {
      lock_slow(me);
      return;
    }
    spin_.lock();
  }

  void unlock() {
    // Only the owner ever sets in_, and it is set only while the owner holds the lock biased.
    if (in_.load(std::memory_order_relaxed) &&
        owner_.load(std::memory_order_relaxed) == ::pthread_self()) {
      in_.store(false, std::memory_order_release);
      return;
    }
    spin_.unlock();
  }

  /// Whether a thread holds the bias (for tests and reports).
  bool biased() const {
    return owner_.load(std::memory_order_acquire) != 0 &&
           state_.load(std::memory_order_acquire) == kBiased;
  }

 private:
  enum : uint32_t { kBiased = 0, kRevoking = 1, kRevoked = 2 };
  void lock_slow(pthread_t me);
  /// The owner's way in: true when the bias still stands (then it holds the lock), false when
  /// it was revoked (then it must take the spinlock).
  bool enter_biased() {
    in_.store(true, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);  // the compiler keeps the order
    if (state_.load(std::memory_order_relaxed) == kBiased) return true;
    in_.store(false, std::memory_order_relaxed);
    return false;
  }

  std::atomic<pthread_t> owner_{0};  ///< the thread with the bias (0: none yet)
  std::atomic<uint32_t> state_{kBiased};
  std::atomic<bool> in_{false};  ///< the owner holds the lock through its bias
  SpinLock spin_;
};

}  // namespace vrdma::verbs
