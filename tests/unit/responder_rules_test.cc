// The responder's rules (src/proto/responder_rules.h), which every executor applies: each fault
// gives the status the IB spec gives it, and in the order the rules are written.
#include "proto/responder_rules.h"

#include <gtest/gtest.h>

namespace vrdma::proto {
namespace {

constexpr uint32_t kAll = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
constexpr RemoteMrView kMr{true, kAll | IBV_ACCESS_LOCAL_WRITE, 0x10000, 0x1000};

TEST(ResponderRules, WhatEachOperationNeeds) {
  EXPECT_EQ(remote_access_needed(IBV_WR_RDMA_WRITE), uint32_t{IBV_ACCESS_REMOTE_WRITE});
  EXPECT_EQ(remote_access_needed(IBV_WR_RDMA_WRITE_WITH_IMM), uint32_t{IBV_ACCESS_REMOTE_WRITE});
  EXPECT_EQ(remote_access_needed(IBV_WR_RDMA_READ), uint32_t{IBV_ACCESS_REMOTE_READ});
  EXPECT_EQ(remote_access_needed(IBV_WR_ATOMIC_FETCH_AND_ADD), uint32_t{IBV_ACCESS_REMOTE_ATOMIC});
  EXPECT_EQ(remote_access_needed(IBV_WR_ATOMIC_CMP_AND_SWP), uint32_t{IBV_ACCESS_REMOTE_ATOMIC});
  EXPECT_EQ(remote_access_needed(IBV_WR_SEND), 0u);
}

TEST(ResponderRules, EachFaultGivesItsStatus) {
  const char* why = nullptr;
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_WRITE, kAll, 0x10000, 0x1000, kMr), IBV_WC_SUCCESS);
  // The QP's access comes first, even at length 0.
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_WRITE, IBV_ACCESS_REMOTE_READ, 0, 0, {}, &why),
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_STREQ(why, "the responder QP does not allow that access");
  // Length 0: any key and address.
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_READ, kAll, 0, 0, {}), IBV_WC_SUCCESS);
  // A key that names nothing, an MR without the access, bounds (both ends, and overflow).
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_READ, kAll, 0x10000, 1, {}), IBV_WC_REM_ACCESS_ERR);
  const RemoteMrView read_only{true, IBV_ACCESS_REMOTE_READ, 0x10000, 0x1000};
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_WRITE, kAll, 0x10000, 1, read_only, &why),
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_STREQ(why, "the MR does not allow that access");
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_WRITE, kAll, 0xffff, 1, kMr), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_WRITE, kAll, 0x10001, 0x1000, kMr),
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_WRITE, kAll, ~0ull, 2, kMr), IBV_WC_REM_ACCESS_ERR);
  // Atomics: 8 bytes whatever the length says, at an aligned address.
  EXPECT_EQ(check_remote_request(IBV_WR_ATOMIC_FETCH_AND_ADD, kAll, 0x10ff8, 0, kMr),
            IBV_WC_SUCCESS);
  EXPECT_EQ(check_remote_request(IBV_WR_ATOMIC_FETCH_AND_ADD, kAll, 0x10ffc, 8, kMr),
            IBV_WC_REM_ACCESS_ERR);  // runs past the end: bounds before alignment
  EXPECT_EQ(check_remote_request(IBV_WR_ATOMIC_CMP_AND_SWP, kAll, 0x10004, 8, kMr, &why),
            IBV_WC_REM_INV_REQ_ERR);
  EXPECT_STREQ(why, "atomic on a misaligned address");
  EXPECT_EQ(check_remote_request(IBV_WR_ATOMIC_CMP_AND_SWP, kAll, 0x10000, 8, {}),
            IBV_WC_REM_ACCESS_ERR);
}

TEST(ResponderRules, RnrRetryCountsThenGivesUpAndSevenIsForever) {
  uint32_t left = 0;
  // rnr_retry 2: two waits, and the third NAK of the message gives up.
  EXPECT_TRUE(rnr_may_retry(2, true, left));
  EXPECT_TRUE(rnr_may_retry(2, false, left));
  EXPECT_FALSE(rnr_may_retry(2, false, left));
  // A new message starts again from rnr_retry.
  EXPECT_TRUE(rnr_may_retry(2, true, left));
  EXPECT_FALSE(rnr_may_retry(0, true, left));
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(rnr_may_retry(kRnrRetryForever, i == 0, left));
  EXPECT_EQ(rnr_delay_ns(18), 5120000u);  // the timers of IB spec table 45
  EXPECT_EQ(rnr_delay_ns(1), 10000u);
  EXPECT_EQ(rnr_delay_ns(0), 655360000u);
}

}  // namespace
}  // namespace vrdma::proto
