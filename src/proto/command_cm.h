// The control-path protocol's bodies for the RDMA connection manager (librdmacm, the backend's
// connection service): part of proto/command.h, which includes it; kVersion and the opcodes are
// there. Fixed-width, sizes asserted, as every body.
#pragma once

#include <cstddef>
#include <cstdint>

#include "proto/command.h"

namespace vrdma::proto {

// ---- The RDMA connection manager. What the two ends of a connection tell each other (CmQpInfo
// and the private data, in CmConnReq and CmEvent) is fixed-width, so a backend can forward it
// to another backend unchanged once connections cross hosts.
/// The largest private data of any IB CM message (DREP and RTU: 224 bytes); what each message
/// and port space may carry is the library's check (rdmacm/cma.cc, private_data_limit).
inline constexpr size_t kCmPrivateMax = 224;
/// RDMA_CM_EVENT_* values (rdma_cma.h's enum, which is ABI).
enum class CmEventType : uint32_t {
  kAddrResolved = 0,
  kAddrError = 1,
  kRouteResolved = 2,
  kRouteError = 3,
  kConnectRequest = 4,
  kConnectResponse = 5,
  kConnectError = 6,
  kUnreachable = 7,
  kRejected = 8,
  kEstablished = 9,
  kDisconnected = 10,
  kDeviceRemoval = 11,
  kMulticastJoin = 12,
  kMulticastError = 13,
  kTimewaitExit = 15,
};
/// REJECTED's status: the IB CM reject reasons rdma_cm reports.
inline constexpr int32_t kCmRejTimeout = 1;         ///< the peer went away mid-handshake
inline constexpr int32_t kCmRejInvalidService = 8;  ///< nobody listens on that port
inline constexpr int32_t kCmRejConsumer = 28;       ///< rdma_reject
/// RDMA_PS_* (rdma_cma.h's enum, which is ABI).
inline constexpr uint16_t kCmPsIpoib = 0x0002, kCmPsTcp = 0x0106, kCmPsUdp = 0x0111,
                          kCmPsIb = 0x013F;
/// The IB CM's private data sizes: what a REQ (`op` kCmConnect), REP (kCmAccept) or REJ
/// (kCmReject) of port space `ps` and QP type `qp_type` may carry. An IP port space's REQ gives
/// 36 bytes to rdma_cm's header; UD takes the SIDR shapes. The library's check and the one on
/// what a peer backend forwards.
inline size_t cm_private_limit(uint16_t ps, uint8_t qp_type, Op op) {
  const bool ip = ps != kCmPsIb;
  if (qp_type == 4 /* IBV_QPT_UD */) return op == Op::kCmConnect ? (ip ? 180 : 216) : 136;
  if (op == Op::kCmConnect) return ip ? 56 : 92;
  if (op == Op::kCmAccept) return 196;
  return 148;  // REJ
}
/// An IP address and port (sockaddr_in or sockaddr_in6, fixed width).
struct CmAddr {
  uint16_t family;  ///< AF_INET or AF_INET6; 0: none
  uint16_t port;    ///< host order
  uint32_t scope_id;
  uint8_t addr[16];  ///< network order; AF_INET uses the first 4 bytes
};
static_assert(sizeof(CmAddr) == 24);
/// What one end tells the other of its QP: the IB CM REQ's and REP's fields.
struct CmQpInfo {
  uint32_t qpn;
  uint32_t psn;     ///< its starting send PSN (the other end's rq_psn)
  uint8_t gid[16];  ///< GID 0 of its guest (name-derived, docs/ARCHITECTURE.md)
  uint16_t lid;
  uint8_t qp_type;  ///< IBV_QPT_*
  uint8_t responder_resources;
  uint8_t initiator_depth;
  uint8_t flow_control;
  uint8_t retry_count;
  uint8_t rnr_retry_count;
  uint8_t srq;
  uint8_t mtu;  ///< IBV_MTU_* of its port
  uint16_t reserved;
  uint32_t qkey;  ///< UD
};
static_assert(sizeof(CmQpInfo) == 40);
struct CmCreateIdReq {
  uint32_t channel;
  uint16_t port_space;  ///< RDMA_PS_*
  uint8_t qp_type;
  uint8_t reserved;
};
static_assert(sizeof(CmCreateIdReq) == 8);
struct CmAddrReq {
  uint32_t id;
  uint32_t reserved;
  CmAddr addr;
};
static_assert(sizeof(CmAddrReq) == 32);
struct CmAddrResp {
  CmAddr addr;
};
static_assert(sizeof(CmAddrResp) == 24);
struct CmListenReq {
  uint32_t id;
  uint32_t backlog;
};
static_assert(sizeof(CmListenReq) == 8);
struct CmResolveReq {
  uint32_t id;
  uint32_t timeout_ms;
  CmAddr src;  ///< family 0: the backend picks
  CmAddr dst;
};
static_assert(sizeof(CmResolveReq) == 56);
struct CmConnReq {
  uint32_t id;
  uint32_t private_len;
  CmQpInfo qp;
  uint8_t private_data[kCmPrivateMax];
};
static_assert(sizeof(CmConnReq) == 272);
struct CmMigrateReq {
  uint32_t id;
  uint32_t channel;
};
static_assert(sizeof(CmMigrateReq) == 8);
/// One event, one message on the channel's socket (header op kCmEvent, seq 0).
struct CmEvent {
  uint32_t event;  ///< CmEventType
  int32_t status;  ///< 0, -errno, or REJECTED's reject reason
  uint32_t id;
  uint32_t listen_id;  ///< CONNECT_REQUEST: the listener (`id` is the new one); else kNone
  CmAddr src;          ///< the id's own address, then its peer's
  CmAddr dst;
  CmQpInfo peer;  ///< CONNECT_REQUEST and CONNECT_RESPONSE: the other end's QP
  uint32_t private_len;
  uint32_t reserved;
  uint8_t private_data[kCmPrivateMax];
};
static_assert(sizeof(CmEvent) == 16 + 48 + 40 + 8 + kCmPrivateMax);

}  // namespace vrdma::proto
