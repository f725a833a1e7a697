#include "common/guest_fault.h"

#include <setjmp.h>
#include <signal.h>

#include <mutex>

namespace vrdma {
namespace {

struct Guard {
  sigjmp_buf env;
  volatile sig_atomic_t active = 0;
  volatile uintptr_t addr = 0;
};
// The handler reads it: linked into an executable (vrdmad, the tests), its access is the static
// TLS model, which is signal-safe (a dynamic model's first access may allocate). The drop-in
// library carries this file in vrdma_core but never calls it.
thread_local Guard t_guard;

struct sigaction g_old_bus, g_old_segv;

void on_fault(int sig, siginfo_t* si, void* uc) {
  Guard& g = t_guard;
  if (g.active) {
    g.active = 0;
    g.addr = reinterpret_cast<uintptr_t>(si->si_addr);
    // The signal is not blocked (SA_NODEFER), so leaving without restoring the mask is fine.
    siglongjmp(g.env, 1);
  }
  // Not a guarded access: whatever would have happened without us.
  const struct sigaction& old = sig == SIGBUS ? g_old_bus : g_old_segv;
  if ((old.sa_flags & SA_SIGINFO) && old.sa_sigaction) {
    old.sa_sigaction(sig, si, uc);
    return;
  }
  if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN && old.sa_handler) {
    old.sa_handler(sig);
    return;
  }
  // The default action: put it back; a fault re-executes the instruction and dies of it, a
  // signal someone sent is raised again.
  ::sigaction(sig, &old, nullptr);
  if (si->si_code <= 0) ::raise(sig);
}

}  // namespace

void install_guest_fault_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa{};
    sa.sa_sigaction = on_fault;
    // SA_NODEFER: the handler leaves by siglongjmp without restoring the signal mask (that would
    // be a system call per guarded call), so the signal must not be blocked while it runs.
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_old_bus);
    ::sigaction(SIGSEGV, &sa, &g_old_segv);
  });
}

// No local variable lives across sigsetjmp (they could be clobbered by the siglongjmp).
bool run_guarded(void (*fn)(void*), void* arg, uintptr_t& fault_addr) {
  if (sigsetjmp(t_guard.env, 0) != 0) {
    fault_addr = t_guard.addr;
    return false;
  }
  t_guard.active = 1;
  fn(arg);
  t_guard.active = 0;
  return true;
}

}  // namespace vrdma
