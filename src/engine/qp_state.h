// The QP state machine of the InfiniBand spec (o10-2.x, "QP State Transition" tables): which
// transitions are legal for each QP type, and which attribute-mask bits each one requires and
// allows. Pure functions; the engine applies the attributes after this check passes.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

#include "common/status.h"

namespace vrdma::engine {

/// Checks a modify_qp request: `cur` is the QP's state, `mask` the IBV_QP_* bits given and
/// `next` the requested state (ignored unless IBV_QP_STATE is in `mask`). EINVAL when the
/// transition is illegal, a required attribute is missing, or an attribute is not allowed.
Status check_modify_qp(ibv_qp_type type, ibv_qp_state cur, ibv_qp_state next, uint32_t mask);

/// The attributes of a modify_qp that count for a QP of `type`: an XRC send QP ignores the
/// responder's (max_dest_rd_atomic, min_rnr_timer), an XRC receive QP the requester's
/// (max_rd_atomic, retry_cnt, rnr_retry), as the kernel's uverbs does (modify_qp_mask), so
/// callers that set both sides for every QP (perftest) connect.
constexpr uint32_t modify_mask(ibv_qp_type type, uint32_t mask) {
  if (type == IBV_QPT_XRC_SEND)
    return mask & ~uint32_t{IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER};
  if (type == IBV_QPT_XRC_RECV)
    return mask & ~uint32_t{IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY};
  return mask;
}

const char* qp_state_name(ibv_qp_state s);

}  // namespace vrdma::engine
