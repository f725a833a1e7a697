// Waiting in poll() before a blocking read or recv of an event descriptor (a CM event channel,
// a completion channel). The verbs library stops threads with a signal while it registers
// memory (verbs/stop_world.h), and GCC's libtsan runs a signal handler during poll but holds it
// while a thread sits in read or recv: a thread waiting there could not be stopped under TSan.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>

#include <cerrno>

namespace vrdma {

/// Whether a blocking read or recv interrupted by a signal now would have been restarted: every
/// handler that an asynchronous signal can run has SA_RESTART. The fault signals are left out:
/// they are delivered at the faulting instruction, never to a thread waiting in a call (and
/// the sanitizers' own handlers for them have no SA_RESTART).
inline bool interrupted_call_restarts() {
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig == SIGSEGV || sig == SIGBUS || sig == SIGFPE || sig == SIGILL || sig == SIGTRAP ||
        sig == SIGSYS)
      continue;
    struct sigaction sa {};
    if (::sigaction(sig, nullptr, &sa) != 0) continue;  // glibc's own (32, 33): not ours
    const bool handled = sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN;
    if (handled && !(sa.sa_flags & SA_RESTART)) return false;
  }
  return true;
}

/// Returns once a read of `fd` will not block: something to read, end of stream, an error, or
/// `fd` is non-blocking (the read then gives EAGAIN itself). A blocking descriptor is waited for
/// in poll(). 0, or -1 with errno: EINTR where a blocking read would have failed with it (the
/// signal's handler may lack SA_RESTART; poll is never restarted, so the wait goes on only when
/// every handler restarts). Another thread may take what was readable first; the read then
/// blocks as it did before.
inline int wait_readable(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_NONBLOCK)) return 0;  // the read says EAGAIN (or EBADF)
  pollfd p{fd, POLLIN, 0};
  for (;;) {
    if (::poll(&p, 1, -1) >= 0 || errno != EINTR) return 0;  // (poll's own failure: read)
    if (!interrupted_call_restarts()) return -1;
  }
}

}  // namespace vrdma
