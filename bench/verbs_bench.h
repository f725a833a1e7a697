// What a verbs benchmark needs first: the first device's context and a PD, closed at the end,
// and a stopwatch in milliseconds. Header-only; for the programs in bench/ run through
// `vrdma run` (or with VRDMA_SOCKET set).
#pragma once

#include <infiniband/verbs.h>

#include <chrono>
#include <cstdio>

namespace vrdma::bench {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

/// The first device, opened, with a PD; `pd` is null (and the reason printed) on failure.
struct OpenDevice {
  ibv_device** list = nullptr;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;

  OpenDevice() {
    int n = 0;
    list = ibv_get_device_list(&n);
    if (!list || n < 1) {
      std::perror("ibv_get_device_list");
      return;
    }
    ctx = ibv_open_device(list[0]);
    pd = ctx ? ibv_alloc_pd(ctx) : nullptr;
    if (!pd) std::perror("ibv_open_device/ibv_alloc_pd");
  }
  ~OpenDevice() {
    if (pd) ibv_dealloc_pd(pd);
    if (ctx) ibv_close_device(ctx);
    if (list) ibv_free_device_list(list);
  }
  OpenDevice(const OpenDevice&) = delete;
  OpenDevice& operator=(const OpenDevice&) = delete;
};

}  // namespace vrdma::bench
