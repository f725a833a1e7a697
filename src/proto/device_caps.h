// The limits vrdma0 advertises and the backend enforces: one table both sides read, so what
// ibv_query_device reports is what the device really accepts.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

#include "proto/responder_rules.h"  // (names_remote_memory, which callers took from here)
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
inline constexpr uint32_t kMaxXrcd = 256;  ///< XRC domains per guest (and opens per session)
inline constexpr uint32_t kMaxSegments = 65536;
/// UD multicast (engine/device_mcast.cc): groups per backend, QPs per group, groups per QP.
inline constexpr uint32_t kMaxMcastGroups = 4096;
inline constexpr uint32_t kMaxMcastQpAttach = 1024;
inline constexpr uint32_t kMaxQpMcastGroups = 16;
/// Memory windows (ibv_alloc_mw) per guest; the guest's quota (max_mws) may make it smaller.
inline constexpr uint32_t kMaxMw = 1u << 20;
/// Device memory (ibv_alloc_dm): the largest one allocation, and allocations per session. The
/// guest's quota (max_dm_bytes) may make max_dm_size smaller.
inline constexpr uint64_t kMaxDmSize = 1ull << 30;
inline constexpr uint32_t kMaxDm = 1024;

/// IBV_ACCESS_* bits ibv_reg_mr accepts. MW_BIND lets windows be bound to the MR; HUGETLB is a
/// promise about the memory, not a request; RELAXED_ORDERING and the rest of the optional range are
/// bits the verbs API lets a device ignore; ON_DEMAND makes an ODP MR (docs/ARCHITECTURE.md,
/// "On-demand paging"). Any other bit is EINVAL.
inline constexpr uint32_t kMrAccessAccepted = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                              IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                                              IBV_ACCESS_MW_BIND | IBV_ACCESS_HUGETLB |
                                              IBV_ACCESS_OPTIONAL_RANGE | IBV_ACCESS_ON_DEMAND;
/// Bits ibv_reg_mr refuses with EOPNOTSUPP: known, but not what this device does
/// (zero-based addressing outside device memory).
inline constexpr uint32_t kMrAccessUnsupported = IBV_ACCESS_ZERO_BASED;
/// IBV_ACCESS_* bits a QP's qp_access_flags accept: the remote ones and MW_BIND (binds through
/// the QP, post_rules.h check_bind_mw) are enforced, the MR-only bits are ignored (as hardware
/// does), anything else is EINVAL.
inline constexpr uint32_t kQpAccessAccepted = kMrAccessAccepted | kMrAccessUnsupported;
/// ibv_reg_dm_mr: the MR is zero-based (IBV_ACCESS_ZERO_BASED required, as rdma-core's man page
/// says); the other bits as for ibv_reg_mr, less ON_DEMAND (device memory is always there).
inline constexpr uint32_t kDmMrAccessAccepted =
    (kMrAccessAccepted & ~uint32_t{IBV_ACCESS_ON_DEMAND}) | IBV_ACCESS_ZERO_BASED;

/// On-demand paging (ibv_query_device_ex's odp_caps): what an ODP MR may be used for, per
/// transport. Implicit ODP (ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND)) too.
inline constexpr uint64_t kOdpGeneralCaps = IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT;
inline constexpr uint32_t kOdpRcCaps = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV |
                                       IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_READ |
                                       IBV_ODP_SUPPORT_ATOMIC | IBV_ODP_SUPPORT_SRQ_RECV;
inline constexpr uint32_t kOdpUcCaps =
    IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_SRQ_RECV;
inline constexpr uint32_t kOdpUdCaps =
    IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_SRQ_RECV;
/// Pieces (chunks) an ODP MR may gather in the backend as its pages are faulted in.
inline constexpr uint32_t kMaxOdpChunks = 4096;

}  // namespace vrdma::proto
