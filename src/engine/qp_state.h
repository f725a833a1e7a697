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

const char* qp_state_name(ibv_qp_state s);

}  // namespace vrdma::engine
