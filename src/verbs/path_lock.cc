// PathLock's slow path and the process-wide barrier it relies on (path_lock.h).
#include "verbs/path_lock.h"

#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>

#include "common/log.h"

namespace vrdma::verbs {

namespace {

long membarrier(int cmd) { return ::syscall(__NR_membarrier, cmd, 0, 0); }

}  // namespace

bool asymmetric_barrier_available() {
#if defined(__SANITIZE_THREAD__)
  return false;  // ThreadSanitizer cannot see the barrier: it would report the biased owner
#else
  // Registered once per process; every later call is this load.
  static const bool ok = membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
  return ok;
#endif
}

bool asymmetric_barrier() {
  if (membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return true;
  // A child of fork() may find the registration its parent made missing: register again. Then
  // the global barrier, which needs no registration (slower, and rare here).
  if (membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0 &&
      membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0)
    return true;
  return membarrier(MEMBARRIER_CMD_GLOBAL) == 0;
}

void PathLock::lock_slow(pthread_t me) {
  if (state_.load(std::memory_order_acquire) == kBiased &&
      owner_.load(std::memory_order_acquire) == 0) {
    if (!asymmetric_barrier_available()) {
      state_.store(kRevoked, std::memory_order_release);  // never biased
      spin_.lock();
      return;
    }
    pthread_t none = 0;
    if (owner_.compare_exchange_strong(none, me, std::memory_order_acq_rel)) {
      // Ours now (the exchange was a full barrier): take it the owner's way.
      if (!enter_biased()) spin_.lock();
      return;
    }
  }
  // Another thread has the bias: end it (several threads may do this at once; each waits).
  uint32_t biased = kBiased;
  state_.compare_exchange_strong(biased, kRevoking, std::memory_order_seq_cst);
  if (state_.load(std::memory_order_acquire) != kRevoked) {
    if (!asymmetric_barrier()) {
      // Refused after registering: nothing can make the owner's store visible in time.
      VLOG_ERROR("membarrier failed after registration; cannot share a queue between threads");
      std::abort();
    }
    while (in_.load(std::memory_order_acquire)) __builtin_ia32_pause();
    state_.store(kRevoked, std::memory_order_release);
  }
  spin_.lock();
}

}  // namespace vrdma::verbs
