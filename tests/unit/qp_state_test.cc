// QP state machine: engine::check_modify_qp against the IB spec's transition table, taken from
// the kernel's qp_state_table (drivers/infiniband/core/verbs.c), for RC, UC and UD.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <array>
#include <string>

#include "engine/qp_state.h"

namespace vrdma::engine {
namespace {

constexpr uint32_t kS = IBV_QP_STATE;
// Every attribute bit a verbs caller can set (IBV_QP_STATE handled separately).
constexpr std::array<uint32_t, 21> kBits = {
    IBV_QP_CUR_STATE,    IBV_QP_EN_SQD_ASYNC_NOTIFY, IBV_QP_ACCESS_FLAGS, IBV_QP_PKEY_INDEX,
    IBV_QP_PORT,         IBV_QP_QKEY,                IBV_QP_AV,           IBV_QP_PATH_MTU,
    IBV_QP_TIMEOUT,      IBV_QP_RETRY_CNT,           IBV_QP_RNR_RETRY,    IBV_QP_RQ_PSN,
    IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_ALT_PATH,        IBV_QP_MIN_RNR_TIMER, IBV_QP_SQ_PSN,
    IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_PATH_MIG_STATE, IBV_QP_CAP,         IBV_QP_DEST_QPN,
    IBV_QP_RATE_LIMIT};
constexpr ibv_qp_state kStates[] = {IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS,
                                    IBV_QPS_SQD,   IBV_QPS_SQE,  IBV_QPS_ERR};
constexpr ibv_qp_type kTypes[] = {IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD};

struct Ref {
  bool valid = false;
  uint32_t req = 0;  ///< besides IBV_QP_STATE
  uint32_t opt = 0;
};

// The kernel's qp_state_table for RC/UC/UD, written out independently of the product's code.
// One deliberate difference: RESET -> ERR is legal (IB spec: "any state to Error"; the kernel's
// table omits it).
Ref reference(ibv_qp_type t, ibv_qp_state cur, ibv_qp_state next) {
  const bool rc = t == IBV_QPT_RC, uc = t == IBV_QPT_UC;  // else UD
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) return {true, 0, 0};
  auto pick = [&](Ref r_rc, Ref r_uc, Ref r_ud) { return rc ? r_rc : uc ? r_uc : r_ud; };
  if (cur == IBV_QPS_RESET && next == IBV_QPS_INIT) {
    Ref rcuc{true, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0};
    return pick(rcuc, rcuc, {true, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, 0});
  }
  if (cur == IBV_QPS_INIT && next == IBV_QPS_INIT) {
    Ref rcuc{true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS};
    return pick(rcuc, rcuc, {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY});
  }
  if (cur == IBV_QPS_INIT && next == IBV_QPS_RTR) {
    uint32_t uc_req = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
    uint32_t opt = IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX;
    return pick({true, uc_req | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, opt},
                {true, uc_req, opt}, {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_QKEY});
  }
  const uint32_t uc_rts = IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS |
                          IBV_QP_PATH_MIG_STATE;
  const Ref to_rts_ud{true, 0, IBV_QP_CUR_STATE | IBV_QP_QKEY};
  if (cur == IBV_QPS_RTR && next == IBV_QPS_RTS) {
    return pick({true,
                 IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                     IBV_QP_MAX_QP_RD_ATOMIC,
                 uc_rts | IBV_QP_MIN_RNR_TIMER},
                {true, IBV_QP_SQ_PSN, uc_rts}, {true, IBV_QP_SQ_PSN, to_rts_ud.opt});
  }
  if ((cur == IBV_QPS_RTS || cur == IBV_QPS_SQD) && next == IBV_QPS_RTS)
    return pick({true, 0, uc_rts | IBV_QP_MIN_RNR_TIMER}, {true, 0, uc_rts}, to_rts_ud);
  if (cur == IBV_QPS_RTS && next == IBV_QPS_SQD) return {true, 0, IBV_QP_EN_SQD_ASYNC_NOTIFY};
  if (cur == IBV_QPS_SQD && next == IBV_QPS_SQD) {
    uint32_t uc = IBV_QP_AV | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX |
                  IBV_QP_PATH_MIG_STATE;
    uint32_t rcm = uc | IBV_QP_PORT | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                   IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    return pick({true, 0, rcm}, {true, 0, uc}, {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_QKEY});
  }
  if (cur == IBV_QPS_SQE && next == IBV_QPS_RTS)  // an RC QP never enters SQE
    return pick({}, {true, 0, IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS}, to_rts_ud);
  return {};
}

std::string name(ibv_qp_type t, ibv_qp_state c, ibv_qp_state n, uint32_t mask) {
  const char* tn = t == IBV_QPT_RC ? "RC" : t == IBV_QPT_UC ? "UC" : "UD";
  return std::string(tn) + " " + qp_state_name(c) + "->" + qp_state_name(n) + " mask 0x" +
         [&] { char b[16]; snprintf(b, sizeof b, "%x", mask); return std::string(b); }();
}

void expect_ok(ibv_qp_type t, ibv_qp_state c, ibv_qp_state n, uint32_t mask) {
  Status st = check_modify_qp(t, c, n, mask);
  EXPECT_TRUE(st.is_ok()) << name(t, c, n, mask) << ": " << st.message();
}
void expect_einval(ibv_qp_type t, ibv_qp_state c, ibv_qp_state n, uint32_t mask) {
  Status st = check_modify_qp(t, c, n, mask);
  EXPECT_EQ(st.err(), EINVAL) << name(t, c, n, mask) << " should be rejected";
}

TEST(QpState, EveryTransitionMatchesTheSpecTable) {
  int legal = 0;
  for (ibv_qp_type t : kTypes) {
    for (ibv_qp_state cur : kStates) {
      for (ibv_qp_state next : kStates) {
        Ref r = reference(t, cur, next);
        if (!r.valid) {
          expect_einval(t, cur, next, kS);
          uint32_t all = kS;
          for (uint32_t b : kBits) all |= b;
          expect_einval(t, cur, next, all);
          // The required set of the same transition on any other QP type does not help.
          for (ibv_qp_type o : kTypes) expect_einval(t, cur, next, kS | reference(o, cur, next).req);
          continue;
        }
        ++legal;
        const uint32_t base = kS | r.req;
        expect_ok(t, cur, next, base);
        expect_ok(t, cur, next, base | r.opt);
        for (uint32_t b : kBits) {
          if (r.req & b) expect_einval(t, cur, next, base & ~b);   // a required bit missing
          else if (r.opt & b) expect_ok(t, cur, next, base | b);   // one optional bit
          else expect_einval(t, cur, next, base | b);              // a disallowed bit
        }
      }
    }
  }
  // Per type: 7 to RESET + 7 to ERR + 8 others; UC and UD also SQE->RTS.
  EXPECT_EQ(legal, 3 * 14 + 8 + 9 + 9);
}

TEST(QpState, NamedIllegalTransitions) {
  for (ibv_qp_type t : kTypes) {
    expect_einval(t, IBV_QPS_RESET, IBV_QPS_RTR, ~0u & ~IBV_QP_CUR_STATE);
    expect_einval(t, IBV_QPS_RESET, IBV_QPS_RTS, kS | IBV_QP_SQ_PSN);
    expect_einval(t, IBV_QPS_INIT, IBV_QPS_RTS, kS | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                                                    IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                                    IBV_QP_MAX_QP_RD_ATOMIC);
    expect_einval(t, IBV_QPS_RTR, IBV_QPS_INIT, kS);
    expect_einval(t, IBV_QPS_RTS, IBV_QPS_RTR, kS);
    expect_einval(t, IBV_QPS_ERR, IBV_QPS_RTS, kS);
    expect_einval(t, IBV_QPS_ERR, IBV_QPS_INIT, kS | IBV_QP_PKEY_INDEX | IBV_QP_PORT);
    expect_einval(t, IBV_QPS_INIT, IBV_QPS_SQD, kS);
    expect_einval(t, IBV_QPS_RTS, IBV_QPS_SQE, kS);  // SQE is entered by the device only
  }
  expect_einval(IBV_QPT_RC, IBV_QPS_SQE, IBV_QPS_RTS, kS);
  expect_einval(IBV_QPT_RC, IBV_QPS_SQE, IBV_QPS_RTS, kS | IBV_QP_CUR_STATE);
}

TEST(QpState, AnyStateToResetOrErrorWithOnlyTheState) {
  for (ibv_qp_type t : kTypes) {
    for (ibv_qp_state cur : kStates) {
      expect_ok(t, cur, IBV_QPS_RESET, kS);
      expect_ok(t, cur, IBV_QPS_ERR, kS);
      expect_einval(t, cur, IBV_QPS_RESET, kS | IBV_QP_PORT);
      expect_einval(t, cur, IBV_QPS_ERR, kS | IBV_QP_CUR_STATE);
    }
  }
}

TEST(QpState, WithoutTheStateBitTheQpStaysWhereItIs) {
  // next is ignored without IBV_QP_STATE: it is a self-transition of the current state.
  expect_ok(IBV_QPT_RC, IBV_QPS_INIT, IBV_QPS_RTS, IBV_QP_ACCESS_FLAGS);
  expect_ok(IBV_QPT_RC, IBV_QPS_RTS, IBV_QPS_RESET, IBV_QP_MIN_RNR_TIMER);
  expect_ok(IBV_QPT_UD, IBV_QPS_RTS, IBV_QPS_INIT, IBV_QP_QKEY);
  expect_ok(IBV_QPT_RC, IBV_QPS_SQD, IBV_QPS_ERR, IBV_QP_TIMEOUT | IBV_QP_AV);
  expect_einval(IBV_QPT_RC, IBV_QPS_RTR, IBV_QPS_RTR, IBV_QP_ACCESS_FLAGS);  // no RTR->RTR
  expect_einval(IBV_QPT_UC, IBV_QPS_SQE, IBV_QPS_RTS, IBV_QP_ACCESS_FLAGS);
  expect_einval(IBV_QPT_RC, IBV_QPS_INIT, IBV_QPS_INIT, IBV_QP_SQ_PSN);
  expect_einval(IBV_QPT_RC, IBV_QPS_RESET, IBV_QPS_INIT, IBV_QP_PKEY_INDEX);
}

TEST(QpState, EmptyMaskInResetOrErrorIsANoOp) {
  // Regression: an empty mask on a RESET or ERR QP was rejected; the spec makes it a no-op.
  for (ibv_qp_type t : kTypes) {
    expect_ok(t, IBV_QPS_RESET, IBV_QPS_RESET, 0);
    expect_ok(t, IBV_QPS_ERR, IBV_QPS_ERR, 0);
  }
}

TEST(QpState, CurStateOnlyWhereTheSpecAllowsIt) {
  expect_einval(IBV_QPT_RC, IBV_QPS_RESET, IBV_QPS_INIT,
                kS | IBV_QP_CUR_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  expect_einval(IBV_QPT_RC, IBV_QPS_INIT, IBV_QPS_INIT, IBV_QP_CUR_STATE);
  expect_ok(IBV_QPT_RC, IBV_QPS_RTS, IBV_QPS_RTS, IBV_QP_CUR_STATE);
  expect_ok(IBV_QPT_UD, IBV_QPS_SQE, IBV_QPS_RTS, kS | IBV_QP_CUR_STATE);
}

TEST(QpState, UnknownStatesAndTypesAreRejected) {
  expect_einval(IBV_QPT_RC, IBV_QPS_UNKNOWN, IBV_QPS_RESET, kS);
  expect_einval(IBV_QPT_RC, IBV_QPS_RESET, IBV_QPS_UNKNOWN, kS);
  EXPECT_EQ(check_modify_qp(IBV_QPT_RAW_PACKET, IBV_QPS_RESET, IBV_QPS_ERR, kS).err(), EINVAL);
  EXPECT_EQ(check_modify_qp(IBV_QPT_DRIVER, IBV_QPS_RESET, IBV_QPS_RESET, kS).err(), EINVAL);
  EXPECT_STREQ(qp_state_name(IBV_QPS_SQE), "SQE");
  EXPECT_STREQ(qp_state_name(IBV_QPS_UNKNOWN), "UNKNOWN");
}

// XRC (the kernel's table for XRC_INI and XRC_TGT): the initiator connects as UC does (it
// answers nothing: no responder resources, no RNR timer), the target goes to RTS with its PSN
// and timeout only (it sends nothing).
TEST(QpState, XrcSendAndReceiveQpsTakeTheirOwnAttributeSets) {
  constexpr uint32_t kUcRtr = kS | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  constexpr uint32_t kRcRtr = kUcRtr | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  constexpr uint32_t kRcRts = kS | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                              IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  constexpr uint32_t kInit = kS | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  for (ibv_qp_type t : {IBV_QPT_XRC_SEND, IBV_QPT_XRC_RECV})
    EXPECT_TRUE(check_modify_qp(t, IBV_QPS_RESET, IBV_QPS_INIT, kInit).is_ok()) << t;
  EXPECT_TRUE(check_modify_qp(IBV_QPT_XRC_SEND, IBV_QPS_INIT, IBV_QPS_RTR, kUcRtr).is_ok());
  EXPECT_EQ(check_modify_qp(IBV_QPT_XRC_SEND, IBV_QPS_INIT, IBV_QPS_RTR, kRcRtr).err(), EINVAL);
  EXPECT_EQ(check_modify_qp(IBV_QPT_XRC_RECV, IBV_QPS_INIT, IBV_QPS_RTR, kUcRtr).err(), EINVAL);
  EXPECT_TRUE(check_modify_qp(IBV_QPT_XRC_RECV, IBV_QPS_INIT, IBV_QPS_RTR, kRcRtr).is_ok());
  constexpr uint32_t kTgtRts = kS | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT;
  EXPECT_TRUE(check_modify_qp(IBV_QPT_XRC_RECV, IBV_QPS_RTR, IBV_QPS_RTS, kTgtRts).is_ok());
  EXPECT_EQ(check_modify_qp(IBV_QPT_XRC_RECV, IBV_QPS_RTR, IBV_QPS_RTS, kRcRts).err(), EINVAL);
  EXPECT_EQ(check_modify_qp(IBV_QPT_XRC_SEND, IBV_QPS_RTR, IBV_QPS_RTS, kTgtRts).err(), EINVAL);
  EXPECT_TRUE(check_modify_qp(IBV_QPT_XRC_SEND, IBV_QPS_RTR, IBV_QPS_RTS, kRcRts).is_ok());
  EXPECT_EQ(
      check_modify_qp(IBV_QPT_XRC_SEND, IBV_QPS_RTR, IBV_QPS_RTS, kRcRts | IBV_QP_MIN_RNR_TIMER)
          .err(),
      EINVAL);
  EXPECT_TRUE(
      check_modify_qp(IBV_QPT_XRC_RECV, IBV_QPS_RTR, IBV_QPS_RTS, kTgtRts | IBV_QP_MIN_RNR_TIMER)
          .is_ok());
  // The other side's attributes, which the kernel drops before the check, and so do we.
  EXPECT_TRUE(check_modify_qp(IBV_QPT_XRC_SEND, IBV_QPS_INIT, IBV_QPS_RTR,
                              modify_mask(IBV_QPT_XRC_SEND, kRcRtr))
                  .is_ok());
  EXPECT_TRUE(check_modify_qp(IBV_QPT_XRC_RECV, IBV_QPS_RTR, IBV_QPS_RTS,
                              modify_mask(IBV_QPT_XRC_RECV, kRcRts))
                  .is_ok());
  EXPECT_EQ(modify_mask(IBV_QPT_RC, kRcRtr), kRcRtr);
}

}  // namespace
}  // namespace vrdma::engine
