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
  /// Registered-memory segments (memfds the backend holds and maps, one descriptor each), and
  /// their bytes: the address space the guest's memory takes in the backend. Segments hold whole
  /// pages, and one stays while any MR uses part of it, so the bytes can exceed max_mr_bytes.
  uint32_t max_segments = 4096;
  uint64_t max_segment_bytes = 128ull << 30;
  /// Device memory (ibv_alloc_dm), bytes summed over the guest's allocations. Each is also a
  /// segment (whole pages) and counts against the two quotas above.
  uint64_t max_dm_bytes = 256ull << 20;
  /// Memory windows (ibv_alloc_mw) of the guest.
  uint32_t max_mws = 4096;
  /// Not per guest: the segment bytes the backend maps for all guests together (x86-64 user
  /// space is 128 TiB; guests' names are free, so per-guest quotas alone do not bound it).
  uint64_t max_mapped_bytes = 32ull << 40;
};

}  // namespace vrdma::engine
