// ListenerRest: what a level-triggered listener does when accept fails for want of descriptors.
// The connection stays queued and the listener readable, so a loop that keeps watching it would
// wake on every turn and spin; instead it stops watching the listener for a while (or until its
// owner frees a descriptor) and logs one line per period. Shared by the backend's unix listener,
// the metrics endpoint and the TCP transport. Not thread-safe: one per owner thread (the loop).
#pragma once

#include <sys/epoll.h>

#include <cerrno>
#include <cstdint>

#include "common/log.h"

namespace vrdma {

class ListenerRest {
 public:
  static constexpr uint64_t kRestNs = 100'000'000;  ///< 100 ms
  static constexpr uint64_t kLogEveryNs = 1'000'000'000;

  explicit ListenerRest(uint64_t log_every_ns = kLogEveryNs) : log_(log_every_ns) {}

  /// accept's errno that means "no descriptor (or kernel memory) for the new connection".
  static bool out_of_descriptors(int err) {
    return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
  }

  /// The listener `fd` in `epoll`, watched for EPOLLIN with `data` (call after it is added).
  void bind(int epoll, int fd, uint64_t data) {
    epoll_ = epoll;
    fd_ = fd;
    data_ = data;
  }
  /// accept failed for want of descriptors at `now_ns`: the listener leaves the epoll set until
  /// until_ns(). True when a log line may be written now (`held`: how many were held back).
  bool start(uint64_t now_ns, uint64_t& held) {
    if (!until_ns_) ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd_, nullptr);
    until_ns_ = now_ns + kRestNs;
    ++rests_;
    return log_.ready(now_ns, held);
  }
  /// Watches the listener again (a descriptor was freed, or the rest is over). No-op if awake.
  void end() {
    if (!until_ns_) return;
    until_ns_ = 0;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = data_;
    ::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd_, &ev);
  }
  /// Ends the rest when its time is up.
  void poll(uint64_t now_ns) {
    if (until_ns_ && now_ns >= until_ns_) end();
  }
  /// Nonzero while resting: when the listener is watched again (for the loop's epoll timeout).
  uint64_t until_ns() const { return until_ns_; }
  /// How many times it has rested (for tests and logs).
  uint64_t rests() const { return rests_; }

 private:
  int epoll_ = -1, fd_ = -1;
  uint64_t data_ = 0;
  uint64_t until_ns_ = 0;
  uint64_t rests_ = 0;
  log::Every log_;
};

}  // namespace vrdma
