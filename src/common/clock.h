// The monotonic clock in nanoseconds: what every deadline, spin budget and idle count of the
// backend and the library is measured on.
#pragma once

#include <time.h>

#include <cstdint>

namespace vrdma {

inline uint64_t mono_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

}  // namespace vrdma
