#include "engine/qp_state.h"

#include <fmt/format.h>

namespace vrdma::engine {
namespace {

struct Rule {
  bool valid = false;
  uint32_t required = 0;
  uint32_t optional = 0;
};

// Attribute sets per QP type for one transition.
struct PerType {
  Rule rc, uc, ud;
};

constexpr uint32_t kS = IBV_QP_STATE;

PerType rule_for(ibv_qp_state cur, ibv_qp_state next) {
  const uint32_t rcuc_rts_opt = IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH |
                                IBV_QP_PATH_MIG_STATE;
  // Any state may go to RESET or ERR with only the state given; staying there with an empty
  // mask is a no-op.
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
    Rule r{true, next != cur ? kS : 0u, 0};
    return {r, r, r};
  }
  switch (cur) {
    case IBV_QPS_RESET:
      if (next == IBV_QPS_INIT) {
        Rule rcuc{true, kS | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0};
        Rule ud{true, kS | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, 0};
        return {rcuc, rcuc, ud};
      }
      break;
    case IBV_QPS_INIT:
      if (next == IBV_QPS_INIT) {
        Rule rcuc{true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS};
        Rule ud{true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY};
        return {rcuc, rcuc, ud};
      }
      if (next == IBV_QPS_RTR) {
        const uint32_t uc_req =
            kS | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
        const uint32_t opt = IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX;
        return {Rule{true, uc_req | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, opt},
                Rule{true, uc_req, opt},
                Rule{true, kS, IBV_QP_PKEY_INDEX | IBV_QP_QKEY}};
      }
      break;
    case IBV_QPS_RTR:
      if (next == IBV_QPS_RTS) {
        return {Rule{true,
                     kS | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                         IBV_QP_MAX_QP_RD_ATOMIC,
                     rcuc_rts_opt | IBV_QP_MIN_RNR_TIMER},
                Rule{true, kS | IBV_QP_SQ_PSN, rcuc_rts_opt},
                Rule{true, kS | IBV_QP_SQ_PSN, IBV_QP_CUR_STATE | IBV_QP_QKEY}};
      }
      break;
    case IBV_QPS_RTS:
      if (next == IBV_QPS_RTS) {
        return {Rule{true, 0, rcuc_rts_opt | IBV_QP_MIN_RNR_TIMER}, Rule{true, 0, rcuc_rts_opt},
                Rule{true, 0, IBV_QP_CUR_STATE | IBV_QP_QKEY}};
      }
      if (next == IBV_QPS_SQD) {
        Rule r{true, kS, IBV_QP_EN_SQD_ASYNC_NOTIFY};
        return {r, r, r};
      }
      break;
    case IBV_QPS_SQD:
      if (next == IBV_QPS_RTS) {
        return {Rule{true, kS, rcuc_rts_opt | IBV_QP_MIN_RNR_TIMER}, Rule{true, kS, rcuc_rts_opt},
                Rule{true, kS, IBV_QP_CUR_STATE | IBV_QP_QKEY}};
      }
      if (next == IBV_QPS_SQD) {
        const uint32_t uc_opt = IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS | IBV_QP_AV |
                                IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE;
        return {Rule{true, 0,
                     uc_opt | IBV_QP_PORT | IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC |
                         IBV_QP_MIN_RNR_TIMER | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                         IBV_QP_RNR_RETRY},
                Rule{true, 0, uc_opt}, Rule{true, 0, IBV_QP_PKEY_INDEX | IBV_QP_QKEY}};
      }
      break;
    case IBV_QPS_SQE:
      if (next == IBV_QPS_RTS) {
        // SQE exists only for UC and UD; an RC QP never enters it.
        return {Rule{}, Rule{true, kS, IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS},
                Rule{true, kS, IBV_QP_CUR_STATE | IBV_QP_QKEY}};
      }
      break;
    default:
      break;
  }
  return {};
}

}  // namespace

const char* qp_state_name(ibv_qp_state s) {
  switch (s) {
    case IBV_QPS_RESET: return "RESET";
    case IBV_QPS_INIT: return "INIT";
    case IBV_QPS_RTR: return "RTR";
    case IBV_QPS_RTS: return "RTS";
    case IBV_QPS_SQD: return "SQD";
    case IBV_QPS_SQE: return "SQE";
    case IBV_QPS_ERR: return "ERR";
    default: return "UNKNOWN";
  }
}

Status check_modify_qp(ibv_qp_type type, ibv_qp_state cur, ibv_qp_state next, uint32_t mask) {
  if (!(mask & IBV_QP_STATE)) next = cur;
  if (cur > IBV_QPS_ERR || next > IBV_QPS_ERR)
    return error(EINVAL, fmt::format("unknown QP state {} -> {}", int(cur), int(next)));
  PerType t = rule_for(cur, next);
  Rule r;
  const bool to_rtr = cur == IBV_QPS_INIT && next == IBV_QPS_RTR && (mask & IBV_QP_STATE);
  const bool to_rts = cur == IBV_QPS_RTR && next == IBV_QPS_RTS && (mask & IBV_QP_STATE);
  switch (type) {
    case IBV_QPT_RC: r = t.rc; break;
    case IBV_QPT_UC: r = t.uc; break;
    case IBV_QPT_UD: r = t.ud; break;
    case IBV_QPT_XRC_SEND:
      // The initiator: RC's sets, but it answers nothing, so RTR asks what UC's does (no
      // responder resources, no RNR timer), and RTS takes no RNR timer.
      r = to_rtr ? t.uc : t.rc;
      if (to_rts || (cur == next && cur == IBV_QPS_RTS)) r.optional &= ~IBV_QP_MIN_RNR_TIMER;
      break;
    case IBV_QPT_XRC_RECV:
      // The target: RC's sets, but it sends nothing, so RTS needs only the PSN and timeout.
      r = t.rc;
      if (to_rts) {
        r.required = kS | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT;
        r.optional = IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS |
                     IBV_QP_PATH_MIG_STATE | IBV_QP_MIN_RNR_TIMER;
      }
      break;
    default: return error(EINVAL, "unsupported QP type");
  }
  if (!r.valid)
    return error(EINVAL, fmt::format("illegal QP transition {} -> {}", qp_state_name(cur),
                                     qp_state_name(next)));
  if ((mask & r.required) != r.required)
    return error(EINVAL, fmt::format("{} -> {}: missing required attributes {:#x}",
                                     qp_state_name(cur), qp_state_name(next),
                                     r.required & ~mask));
  if (mask & ~(r.required | r.optional | kS))
    return error(EINVAL, fmt::format("{} -> {}: attributes {:#x} not allowed", qp_state_name(cur),
                                     qp_state_name(next), mask & ~(r.required | r.optional | kS)));
  return Status::ok();
}

}  // namespace vrdma::engine
