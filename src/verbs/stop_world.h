// Stopping the process's other threads while the library rewrites memory they may be using
// (registration copies anonymous pages into a segment and maps it over them): as garbage
// collectors do, each thread gets a real-time signal whose handler acknowledges and waits.
// Any thread; one stop at a time in the process. See docs/ARCHITECTURE.md, "Registered memory".
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace vrdma::verbs {

/// The signal that stops threads: SIGRTMIN+7 (glibc keeps the real-time signals below SIGRTMIN;
/// neither it nor the sanitizers use SIGRTMIN+7). A thread that blocks it is not stopped.
int stop_signal();

/// Stops every other thread of the process for its lifetime (RAII; move-only use is not needed).
/// Between stop() and release() the caller must not allocate, log, or take any lock another
/// thread might hold (a stopped thread may hold malloc's): system calls and memory it prepared
/// only. Threads that block stop_signal() are left running (logged once each at release).
class WorldStop {
 public:
  WorldStop() = default;
  WorldStop(const WorldStop&) = delete;
  WorldStop& operator=(const WorldStop&) = delete;
  ~WorldStop() { release(); }

  /// 0 with every other thread stopped; otherwise an errno (EAGAIN: a thread did not stop in
  /// time, or the signal's handler was replaced), with nothing stopped and a log line that
  /// begins with `what` (the verb that stops: "reg_mr", "dereg_mr").
  int stop(const char* what = "reg_mr");
  /// Lets the threads go (idempotent); logs what stop() could not do silently.
  void release();
  /// The stack pointers of the stopped threads when they stopped, and the caller's (valid
  /// between stop() and release()).
  std::span<const uintptr_t> stack_pointers() const;

 private:
  bool held_ = false;
};

}  // namespace vrdma::verbs
