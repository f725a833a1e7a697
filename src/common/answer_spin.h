// Waiting for a command's answer on a control socket (the verbs library's and the RDMA CM's
// calls to the backend): a short spin before the blocking wait, sized from the answers before.
// A command is a few µs of the backend's work, but a caller blocked in poll gives its CPU away,
// and an idle vCPU halts: each answer then waits for a wake-up that costs more than the command
// (BENCHMARKS.md, "Command round trip"). The spin is bounded (kMaxNs per call) and stops when
// answers stop coming within it, so a slow or busy backend costs the caller little CPU.
// Not thread-safe: one per connection, used under that connection's call lock.
#pragma once

#include <sys/socket.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/clock.h"
#include "common/socket.h"

namespace vrdma {

class AnswerSpin {
 public:
  static constexpr uint64_t kMaxNs = 50'000;  ///< the longest spin of one call
  static constexpr uint64_t kMinNs = 2'000;   ///< shorter is not worth starting
  /// While answers come too late for the spin, one call in kProbeEvery spins kMaxNs, to notice
  /// when they come quickly again.
  static constexpr uint32_t kProbeEvery = 32;

  /// How long the next call spins for its answer before it blocks (0: it blocks at once).
  uint64_t budget_ns() {
    if (budget_ns_) return budget_ns_;
    return ++calls_since_probe_ % kProbeEvery == 0 ? kMaxNs : 0;
  }
  /// A call spun `spun_ns` (its budget_ns) and had its answer `waited_ns` after the send.
  void note(uint64_t spun_ns, uint64_t waited_ns) {
    if (spun_ns == 0) return;
    if (waited_ns <= spun_ns) {  // caught: spin a few times the usual answer's time
      avg_ns_ = avg_ns_ ? (avg_ns_ * 7 + waited_ns) / 8 : waited_ns;
      budget_ns_ = std::clamp(avg_ns_ * 4, kMinNs, kMaxNs);
    } else {  // missed: spin less, down to none
      budget_ns_ = budget_ns_ / 2 < kMinNs ? 0 : budget_ns_ / 2;
    }
  }

 private:
  uint64_t budget_ns_ = kMaxNs;
  uint64_t avg_ns_ = 0;
  uint32_t calls_since_probe_ = 0;
};

/// Tries to receive one message on `sock` for up to `spin_ns` (recv_msg with MSG_DONTWAIT, one
/// system call a try, no poll): what recv_msg returns, or EAGAIN when nothing came in that time.
/// No sched_yield between tries: beside a CPU-bound task a yield gives it the rest of a time
/// slice (milliseconds) per command, and a thread that never sleeps is not woken (and so not
/// scheduled) early when its answer comes. Where the backend shares this CPU, its wake-up by
/// the command usually preempts the spin; where it does not, the spin misses and stops.
inline Status spin_recv(int sock, std::vector<uint8_t>& buf, size_t cap, std::vector<UniqueFd>& fds,
                        uint64_t spin_ns) {
  const uint64_t until = mono_ns() + spin_ns;
  for (;;) {
    Status st = recv_msg(sock, buf, cap, fds, MSG_DONTWAIT);
    if (st.err() != EAGAIN || mono_ns() >= until) return st;
  }
}

}  // namespace vrdma
