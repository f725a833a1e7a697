// Touching guest memory without trusting it: a guest's pages can fail under the backend (a
// hole in its memfd that cannot be filled when memory is committed strictly, a swap I/O error, a
// hardware memory error), and the access is then a SIGBUS (or, for a mapping gone wrong, a
// SIGSEGV). run_guarded() turns such a fault inside the code it runs into a `false` return, so
// the engine fails the WQE instead of the whole backend dying. The engine's copies and atomics
// on guest memory run under it (engine/datapath_util.h); docs/ARCHITECTURE.md, "Isolation and
// robustness".
// Concurrency: any thread; one guarded call at a time per thread (not reentrant).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace vrdma {

/// Installs the process's SIGBUS and SIGSEGV handler (once; any thread, idempotent). A fault
/// outside a guarded call goes to the handler that was there before (a sanitizer's), or gets
/// the default action: the process dies as it would have.
void install_guest_fault_handler();

/// Runs fn(arg); a SIGBUS or SIGSEGV on this thread while it runs ends it there: returns false
/// with the faulting address in `fault_addr`. `fn` must hold no lock and own no allocation
/// when it touches guest memory: it may be left at any instruction. Costs a sigsetjmp (no
/// system call) when nothing faults.
bool run_guarded(void (*fn)(void*), void* arg, uintptr_t& fault_addr);

/// memcpy under run_guarded.
[[nodiscard]] inline bool guarded_memcpy(void* dst, const void* src, size_t n,
                                         uintptr_t& fault_addr) {
  struct Job {
    void* dst;
    const void* src;
    size_t n;
  } job{dst, src, n};
  return run_guarded(
      [](void* p) {
        const auto* j = static_cast<const Job*>(p);
        std::memcpy(j->dst, j->src, j->n);
      },
      &job, fault_addr);
}

}  // namespace vrdma
