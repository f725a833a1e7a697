// The limits vrdma0 advertises and the backend enforces: one table both sides read, so what
// ibv_query_device reports is what the device really accepts.
#pragma once

#include <cstdint>

#include "proto/ring.h"

namespace vrdma::proto {

inline constexpr uint32_t kVendorId = 0x0ff0;  ///< not a PCI vendor; keeps tools off vendor paths
inline constexpr uint32_t kVendorPartId = 0x7664;  // "vd"
inline constexpr uint32_t kHwVer = 1;
inline constexpr uint32_t kMaxQp = 16384;
inline constexpr uint32_t kMaxQpWr = 16384;
inline constexpr uint32_t kMaxCq = 16384;
inline constexpr uint32_t kMaxCqe = kMaxRingEntries - 1;
inline constexpr uint32_t kMaxMr = 1u << 20;
inline constexpr uint64_t kMaxMrSize = 1ull << 40;
inline constexpr uint32_t kMaxPd = 65536;
inline constexpr uint32_t kMaxMsgSize = 1u << 31;
inline constexpr uint32_t kMaxRdAtomic = 16;  ///< outstanding READ/atomic per QP
inline constexpr uint32_t kPortMaxMtu = 5;  ///< IBV_MTU_4096
inline constexpr uint32_t kMaxChannels = 1024;
inline constexpr uint32_t kMaxSrq = 4096;
inline constexpr uint32_t kMaxSegments = 65536;

}  // namespace vrdma::proto
