// Per-guest limits the backend enforces (DESIGN.md §4: every guest owns an identifier space;
// a guest that exhausts its own must not slow or starve another). Configured in the backend's
// config file ([quotas]); 0 means "no limit beyond the device's caps".
#pragma once

#include <cstdint>

namespace vrdma::engine {

struct Quotas {
  uint32_t max_pds = 1024;
  uint32_t max_qps = 1024;
  uint32_t max_cqs = 1024;
  uint32_t max_srqs = 256;
  uint32_t max_mrs = 4096;
  uint64_t max_mr_bytes = 64ull << 30;  ///< registered bytes, summed over the guest's MRs
  uint32_t max_queue_depth = 8192;      ///< entries in one SQ, RQ, SRQ or CQ
};

}  // namespace vrdma::engine
