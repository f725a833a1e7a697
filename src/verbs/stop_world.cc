// Stopping the other threads (stop_world.h). The handler and the registrar share only atomics
// and futexes: the handler is async-signal-safe, and stop() allocates nothing and takes no lock
// but its own between stopping the threads and releasing them.
#include "verbs/stop_world.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <mutex>
#include <vector>

#include "common/log.h"

namespace vrdma::verbs {
namespace {

constexpr int kMaxStopped = 4096;                  ///< threads one stop can hold; more: EAGAIN
constexpr int64_t kStopTimeoutNs = 5'000'000'000;  ///< for every thread to acknowledge

/// One acknowledgement: `tag` is (generation << 32 | tid), written last; the registrar accepts
/// only its own generation's, so a late handler of an earlier stop is not taken for a stop.
struct Ack {
  std::atomic<uint64_t> tag;
  std::atomic<uintptr_t> sp;
};

std::mutex g_stop_mu;  ///< one stop at a time; never taken by the handler
/// Odd while the threads must stay stopped: the handler sleeps on it (a futex).
std::atomic<uint32_t> g_stop_gen{0};
std::atomic<uint32_t> g_ack_count{0};  ///< slots of g_acks taken (a futex the registrar waits on)
/// Threads inside the stopping part of the handler, where every signal is blocked (its
/// sa_mask): the next stop waits for them to leave, or it would take such a thread, released a
/// moment ago, for one that blocks the signal and leave it running.
std::atomic<int> g_in_handler{0};
Ack g_acks[kMaxStopped];

// The registrar's state, under g_stop_mu: static, so stop() needs no allocation.
pid_t g_targets[kMaxStopped];
bool g_target_done[kMaxStopped];
int g_ntargets;
uint32_t g_ack_seen;  ///< g_acks before this index are read
uintptr_t g_sps[kMaxStopped + 1];
size_t g_nsps;
constexpr int kMaxSkipped = 64;
pid_t g_skipped[kMaxSkipped];
int g_nskipped;
bool g_installed;
alignas(8) char g_dents[16384];
char g_status[4096];
std::vector<pid_t> g_warned;  ///< threads already logged as not stoppable
const char* g_what = "reg_mr";  ///< the current stop's verb, for release()'s log line

long stop_futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

pid_t this_tid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

int64_t stop_clock_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

uintptr_t interrupted_sp(void* ucv) {
  auto* uc = static_cast<ucontext_t*>(ucv);
#if defined(__x86_64__)
  return static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RSP]);
#elif defined(__aarch64__)
  return static_cast<uintptr_t>(uc->uc_mcontext.sp);
#else
  (void)uc;
  return reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
#endif
}

// Async-signal-safe: atomics, gettid and futex only; errno is kept.
void on_stop_signal(int, siginfo_t*, void* uc) {
  const int saved = errno;
  const uint32_t gen = g_stop_gen.load(std::memory_order_acquire);
  if (gen & 1) {  // otherwise a late signal of a stop that gave up on this thread: nothing to do
    g_in_handler.fetch_add(1, std::memory_order_acq_rel);
    const uint32_t i = g_ack_count.fetch_add(1, std::memory_order_acq_rel);
    if (i < kMaxStopped) {
      g_acks[i].sp.store(interrupted_sp(uc), std::memory_order_relaxed);
      g_acks[i].tag.store(uint64_t{gen} << 32 | static_cast<uint32_t>(this_tid()),
                          std::memory_order_release);
    }
    stop_futex(&g_ack_count, FUTEX_WAKE_PRIVATE, 1, nullptr);
    while (g_stop_gen.load(std::memory_order_acquire) == gen)
      stop_futex(&g_stop_gen, FUTEX_WAIT_PRIVATE, gen, nullptr);
    g_in_handler.fetch_sub(1, std::memory_order_acq_rel);
  }
  errno = saved;
}

/// Whether thread `tid` blocks `sig` (its SigBlk in /proc/self/task/TID/status). Such a thread
/// is not signalled: the signal would stay pending, to be taken later by its sigwait().
bool blocks_signal(pid_t tid, int sig) {
  char path[64] = "/proc/self/task/";
  char digits[16];
  int n = 0;
  for (unsigned t = static_cast<unsigned>(tid); t; t /= 10)
    digits[n++] = static_cast<char>('0' + t % 10);
  size_t at = std::strlen(path);
  while (n) path[at++] = digits[--n];
  std::memcpy(path + at, "/status", 8);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;  // gone: tgkill will say so
  const ssize_t len = ::read(fd, g_status, sizeof(g_status) - 1);
  ::close(fd);
  if (len <= 0) return false;
  g_status[len] = 0;
  const char* p = std::strstr(g_status, "\nSigBlk:");
  if (!p) return false;
  p += 8;
  while (*p == ' ' || *p == '\t') ++p;
  uint64_t mask = 0;
  for (; *p && *p != '\n'; ++p) {
    const char c = *p;
    const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (v < 0) break;
    mask = mask << 4 | static_cast<uint64_t>(v);
  }
  return (mask >> (sig - 1)) & 1;
}

/// blocks_signal, asked again for up to ~0.2 ms: a thread released by the previous stop blocks
/// every signal until it has returned from the handler (g_in_handler and its sigreturn).
bool blocks_signal_still(pid_t tid, int sig) {
  for (int i = 0; i < 10; ++i) {
    if (!blocks_signal(tid, sig)) return false;
    const timespec pause{0, 20'000};
    ::nanosleep(&pause, nullptr);
  }
  return true;
}

bool known(pid_t tid) {
  for (int i = 0; i < g_ntargets; ++i)
    if (g_targets[i] == tid) return true;
  for (int i = 0; i < g_nskipped; ++i)
    if (g_skipped[i] == tid) return true;
  return false;
}

/// Signals the threads of /proc/self/task not signalled yet. The number it signalled, or -1
/// when there are more than kMaxStopped or the directory cannot be read.
int signal_new_threads(pid_t self) {
  const int sig = stop_signal();
  const pid_t pid = ::getpid();
  const int dir = ::open("/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return -1;
  int added = 0;
  for (;;) {
    const long n = ::syscall(SYS_getdents64, dir, g_dents, sizeof(g_dents));
    if (n < 0) {
      ::close(dir);
      return -1;
    }
    if (n == 0) break;
    for (long off = 0; off < n;) {
      // struct linux_dirent64: d_ino (8), d_off (8), d_reclen (2), d_type (1), d_name
      unsigned short reclen;
      std::memcpy(&reclen, g_dents + off + 16, sizeof(reclen));
      const char* name = g_dents + off + 19;
      off += reclen;
      pid_t tid = 0;
      for (const char* c = name; *c; ++c) tid = *c >= '0' && *c <= '9' ? tid * 10 + (*c - '0') : -1;
      if (tid <= 0 || tid == self || known(tid)) continue;
      if (blocks_signal_still(tid, sig)) {
        if (g_nskipped < kMaxSkipped) g_skipped[g_nskipped++] = tid;
        continue;
      }
      if (g_ntargets == kMaxStopped) {
        ::close(dir);
        return -1;
      }
      g_targets[g_ntargets] = tid;
      g_target_done[g_ntargets] = ::syscall(SYS_tgkill, pid, tid, sig) != 0 && errno == ESRCH;
      ++g_ntargets;
      ++added;
    }
  }
  ::close(dir);
  return added;
}

/// Waits until every signalled thread acknowledged (or exited); false at `deadline`.
bool wait_for_acks(uint32_t gen, int64_t deadline) {
  const pid_t pid = ::getpid();
  for (;;) {
    const uint32_t n = g_ack_count.load(std::memory_order_acquire);
    while (g_ack_seen < n && g_ack_seen < kMaxStopped) {
      const uint64_t tag = g_acks[g_ack_seen].tag.load(std::memory_order_acquire);
      if (tag == 0) break;  // taken, not written yet
      if (tag >> 32 == gen) {
        const auto tid = static_cast<pid_t>(tag & 0xffffffffu);
        for (int i = 0; i < g_ntargets; ++i) {
          if (g_targets[i] == tid && !g_target_done[i]) {
            g_target_done[i] = true;
            g_sps[g_nsps++] = g_acks[g_ack_seen].sp.load(std::memory_order_relaxed);
          }
        }
      }
      ++g_ack_seen;
    }
    bool all = true;
    for (int i = 0; i < g_ntargets; ++i) {
      if (g_target_done[i]) continue;
      // A thread that exited before it took the signal never acknowledges.
      if (::syscall(SYS_tgkill, pid, g_targets[i], 0) != 0 && errno == ESRCH)
        g_target_done[i] = true;
      else
        all = false;
    }
    if (all) return true;
    if (stop_clock_ns() > deadline) return false;
    const timespec ms{0, 1'000'000};
    stop_futex(&g_ack_count, FUTEX_WAIT_PRIVATE, n, &ms);
  }
}

}  // namespace

int stop_signal() { return SIGRTMIN + 7; }

int WorldStop::stop(const char* what) {
  g_stop_mu.lock();
  held_ = true;
  g_what = what;
  const int sig = stop_signal();
  struct sigaction cur {};
  ::sigaction(sig, nullptr, &cur);
  const bool ours = (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_stop_signal;
  if (!ours) {
    if (g_installed || cur.sa_handler != SIG_DFL) {
      release();
      VLOG_ERROR(
          "{}: signal {} (SIGRTMIN+7, which vrdma uses to stop threads while it "
          "moves registered memory) has another handler; the pages cannot move",
          what, sig);
      return EAGAIN;
    }
    struct sigaction sa {};
    sa.sa_sigaction = on_stop_signal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    ::sigfillset(&sa.sa_mask);  // nothing else runs on top of a stopped thread's handler
    ::sigaction(sig, &sa, nullptr);
    g_installed = true;
  }
  // The threads of the previous stop leave the handler first (they were woken at its release).
  for (int i = 0; g_in_handler.load(std::memory_order_acquire) > 0 && i < 100'000; ++i) {
    const timespec pause{0, 1'000};
    ::nanosleep(&pause, nullptr);
  }
  g_ntargets = 0;
  g_nskipped = 0;
  g_nsps = 0;
  g_sps[g_nsps++] = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  for (Ack& a : g_acks) a.tag.store(0, std::memory_order_relaxed);
  g_ack_seen = 0;
  g_ack_count.store(0, std::memory_order_relaxed);
  const uint32_t gen = g_stop_gen.fetch_add(1, std::memory_order_acq_rel) + 1;  // odd: stop
  const pid_t self = this_tid();
  const int64_t deadline = stop_clock_ns() + kStopTimeoutNs;
  // Until a scan finds no thread it has not stopped: a thread may start another before it stops.
  for (;;) {
    const int added = signal_new_threads(self);
    const bool all = added >= 0 && wait_for_acks(gen, deadline);
    if (!all) {
      const int stopped = g_ntargets;
      release();
      if (added < 0)
        VLOG_ERROR(
            "{}: cannot stop the process's threads (/proc/self/task unreadable or more "
            "than {})",
            what, kMaxStopped);
      else
        VLOG_ERROR("{}: a thread did not stop within {} ms (of {}); the pages cannot move", what,
                   kStopTimeoutNs / 1'000'000, stopped);
      return EAGAIN;
    }
    if (added == 0) return 0;
  }
}

void WorldStop::release() {
  if (!held_) return;
  held_ = false;
  g_stop_gen.fetch_add(1, std::memory_order_acq_rel);  // even: go
  stop_futex(&g_stop_gen, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr);
  // The threads run again: allocating and logging are allowed.
  for (int i = 0; i < g_nskipped; ++i) {
    const pid_t tid = g_skipped[i];
    if (std::find(g_warned.begin(), g_warned.end(), tid) != g_warned.end()) continue;
    g_warned.push_back(tid);
    VLOG_WARN(
        "{}: thread {} blocks signal {} (SIGRTMIN+7) and is not stopped while registered "
        "memory moves: its writes to the pages that move may be lost",
        g_what, tid, stop_signal());
  }
  g_stop_mu.unlock();
}

std::span<const uintptr_t> WorldStop::stack_pointers() const { return {g_sps, g_nsps}; }

}  // namespace vrdma::verbs
