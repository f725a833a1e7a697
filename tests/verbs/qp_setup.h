// Bringing a QP from RESET to RTS, the one copy every verbs test uses (in-process fixtures, the
// two-process peer): each QP type with exactly the attribute masks the IB spec requires for it
// (RC: path, PSNs, RNR and retry counts, RDMA read depths; UC: path and PSNs; UD: qkey only;
// XRC_SEND: RC's but UC's RTR; XRC_RECV: RC's but an RTS of PSN and timeout only).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

namespace vrdma::test {

inline constexpr unsigned kAllAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                       IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
inline constexpr uint32_t kTestQkey = 0x11111111;

/// Where a connected QP goes and how it behaves; ignored fields keep their defaults.
struct QpPath {
  uint16_t dlid = 0;      ///< RC/UC: the peer's LID
  uint32_t dest_qpn = 0;  ///< RC/UC: the peer's QP number
  uint8_t rnr_retry = 7;  ///< RC: 7 retries for ever
  uint8_t min_rnr_timer = 1;  ///< RC: what *our* RNR NAKs ask the requester to wait (0.01 ms)
  uint8_t retry_cnt = 2;
  uint8_t timeout = 8;
  ibv_mtu mtu = IBV_MTU_1024;
  unsigned access = kAllAccess;  ///< RC/UC: qp_access_flags
  uint32_t qkey = kTestQkey;     ///< UD
};

/// RESET -> INIT -> RTR -> RTS; returns 0 or the errno of the first transition that failed.
inline int bring_to_rts(ibv_qp* qp, const QpPath& p) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  const bool ud = qp->qp_type == IBV_QPT_UD;
  const bool xrc_send = qp->qp_type == IBV_QPT_XRC_SEND, xrc_recv = qp->qp_type == IBV_QPT_XRC_RECV;
  const bool is_rc = qp->qp_type == IBV_QPT_RC;
  int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
  if (ud) {
    a.qkey = p.qkey;
    mask |= IBV_QP_QKEY;
  } else {
    a.qp_access_flags = p.access;
    mask |= IBV_QP_ACCESS_FLAGS;
  }
  if (int err = ibv_modify_qp(qp, &a, mask)) return err;

  a = {};
  a.qp_state = IBV_QPS_RTR;
  mask = IBV_QP_STATE;
  if (!ud) {
    a.path_mtu = p.mtu;
    a.dest_qp_num = p.dest_qpn;
    a.rq_psn = 0;
    a.ah_attr.dlid = p.dlid;
    a.ah_attr.port_num = 1;
    mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  }
  if (is_rc || xrc_recv) {
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = p.min_rnr_timer;
    mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  }
  if (int err = ibv_modify_qp(qp, &a, mask)) return err;

  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 0;
  mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
  if (xrc_recv) {
    a.timeout = p.timeout;
    mask |= IBV_QP_TIMEOUT;
  }
  if (is_rc || xrc_send) {
    a.timeout = p.timeout;
    a.retry_cnt = p.retry_cnt;
    a.rnr_retry = p.rnr_retry;
    a.max_rd_atomic = 1;
    mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  }
  return ibv_modify_qp(qp, &a, mask);
}

}  // namespace vrdma::test
