// The kernel's half of the direct path's trust rule (docs/ARCHITECTURE.md, "Direct path"): a
// process may copy into a peer's memory only if it could already write that memory by the
// kernel's own rules, shown by a /proc/PID/mem descriptor it opened for writing. These helpers
// read /proc; they are cold-path and owned by whoever calls them (the engine thread).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <span>

#include "common/status.h"

namespace vrdma::engine {

/// The pid that `target` has in the pid namespace of `viewer` (both pids as this process's
/// namespace numbers them). ESRCH: one of them is gone; EPERM: `viewer` cannot see `target`
/// (its pid namespace is not `target`'s or an ancestor of it).
Result<uint32_t> pid_as_seen_by(pid_t viewer, pid_t target);

/// A proof being read (start_mem_proof): its thread reads the peer's memory through it.
class MemProof {
 public:
  /// Waits up to `ms` for the read; whether it is done.
  bool wait(int ms) const;
  /// Done, and the cookie was there: the proof holds.
  bool good() const;

 private:
  friend Result<MemProof> start_mem_proof(int, uint64_t, std::span<const uint8_t>);
  struct State;
  std::shared_ptr<State> st_;
};

/// Starts checking that `proof` is a /proc/PID/mem descriptor opened O_RDWR whose process holds
/// `cookie` at `addr`: only a process the kernel let open that file for writing
/// (PTRACE_MODE_ATTACH: uid or CAP_SYS_PTRACE, Yama, LSMs), or one that such a process handed
/// it to, can have it. What the descriptor is is checked at once (EPERM). The read goes through
/// the peer's page tables, which the peer controls (a userfaultfd or FUSE mapping could stall
/// it), so it runs on a thread of its own; at most a few such threads at a time (EBUSY).
Result<MemProof> start_mem_proof(int proof, uint64_t addr, std::span<const uint8_t> cookie);

}  // namespace vrdma::engine
