// The requester's rules (src/proto/post_rules.h), which every post path applies: one table of
// work requests, each with the answer a real device gives (ibv_post_send(3): EINVAL for a bad
// WR; the completion status for what only executing it finds).
#include "proto/post_rules.h"

#include <gtest/gtest.h>

#include <vector>

namespace vrdma::proto {
namespace {

constexpr SendQueueCaps kCaps{2, 64};

struct Case {
  const char* name;
  ibv_qp_type type;
  ibv_wr_opcode op;
  std::vector<uint32_t> lengths;  ///< one SGE each
  unsigned flags = 0;
  bool ah = true;                     ///< UD: an address handle named
  int post = 0;                       ///< check_post_send
  ibv_wc_status wc = IBV_WC_SUCCESS;  ///< check_send_length, when the post is taken
  int num_sge = -2;                   ///< -2: lengths.size()
};

const Case kCases[] = {
    // Opcode per QP type.
    {"RC SEND", IBV_QPT_RC, IBV_WR_SEND, {16}},
    {"RC WRITE_WITH_IMM", IBV_QPT_RC, IBV_WR_RDMA_WRITE_WITH_IMM, {16}},
    {"RC READ", IBV_QPT_RC, IBV_WR_RDMA_READ, {16}},
    {"RC CAS", IBV_QPT_RC, IBV_WR_ATOMIC_CMP_AND_SWP, {8}},
    {"RC FAA", IBV_QPT_RC, IBV_WR_ATOMIC_FETCH_AND_ADD, {8}},
    {"UC WRITE", IBV_QPT_UC, IBV_WR_RDMA_WRITE, {16}},
    {"UC READ", IBV_QPT_UC, IBV_WR_RDMA_READ, {16}, 0, true, EINVAL},
    {"UC FAA", IBV_QPT_UC, IBV_WR_ATOMIC_FETCH_AND_ADD, {8}, 0, true, EINVAL},
    {"UD SEND_WITH_IMM", IBV_QPT_UD, IBV_WR_SEND_WITH_IMM, {16}},
    {"UD WRITE", IBV_QPT_UD, IBV_WR_RDMA_WRITE, {16}, 0, true, EINVAL},
    {"UD READ", IBV_QPT_UD, IBV_WR_RDMA_READ, {16}, 0, true, EINVAL},
    {"RC BIND_MW", IBV_QPT_RC, IBV_WR_BIND_MW, {}},
    {"UC BIND_MW", IBV_QPT_UC, IBV_WR_BIND_MW, {}},
    {"UD BIND_MW", IBV_QPT_UD, IBV_WR_BIND_MW, {}, 0, true, EINVAL},
    {"RC LOCAL_INV", IBV_QPT_RC, IBV_WR_LOCAL_INV, {}},
    {"UD LOCAL_INV", IBV_QPT_UD, IBV_WR_LOCAL_INV, {}, 0, true, EINVAL},
    {"RC SEND_WITH_INV", IBV_QPT_RC, IBV_WR_SEND_WITH_INV, {16}},
    {"UC SEND_WITH_INV", IBV_QPT_UC, IBV_WR_SEND_WITH_INV, {16}, 0, true, EINVAL},
    {"RC TSO", IBV_QPT_RC, IBV_WR_TSO, {16}, 0, true, EINVAL},
    // num_sge against the QP's max_send_sge.
    {"no SGE", IBV_QPT_RC, IBV_WR_SEND, {}},
    {"max_send_sge SGEs", IBV_QPT_RC, IBV_WR_SEND, {1, 2}},
    {"one SGE too many", IBV_QPT_RC, IBV_WR_SEND, {1, 2, 3}, 0, true, EINVAL},
    {"negative num_sge", IBV_QPT_RC, IBV_WR_SEND, {}, 0, true, EINVAL, IBV_WC_SUCCESS, -1},
    // UD needs an address handle.
    {"UD without an AH", IBV_QPT_UD, IBV_WR_SEND, {16}, 0, false, EINVAL},
    // Inline: up to max_inline_data in all, for SEND and WRITE; READ and atomics ignore it.
    {"inline at the limit", IBV_QPT_RC, IBV_WR_SEND, {32, 32}, IBV_SEND_INLINE},
    {"inline one byte over",
     IBV_QPT_RC,
     IBV_WR_RDMA_WRITE,
     {32, 33},
     IBV_SEND_INLINE,
     true,
     EINVAL},
    {"inline flag on a READ", IBV_QPT_RC, IBV_WR_RDMA_READ, {4096}, IBV_SEND_INLINE},
    {"inline flag on an atomic", IBV_QPT_RC, IBV_WR_ATOMIC_FETCH_AND_ADD, {8}, IBV_SEND_INLINE},
    {"long, not inline", IBV_QPT_RC, IBV_WR_SEND, {1u << 20}},
    // Other send flags are taken as they are.
    {"fence, solicited, signaled",
     IBV_QPT_RC,
     IBV_WR_SEND_WITH_IMM,
     {1},
     IBV_SEND_FENCE | IBV_SEND_SOLICITED | IBV_SEND_SIGNALED},
    // Lengths: zero-length operations are fine; max_msg_sz; an atomic's 8 bytes.
    {"zero-length SEND", IBV_QPT_RC, IBV_WR_SEND, {0}},
    {"zero-length WRITE", IBV_QPT_RC, IBV_WR_RDMA_WRITE, {}},
    {"zero-length READ", IBV_QPT_RC, IBV_WR_RDMA_READ, {0, 0}},
    {"max_msg_sz", IBV_QPT_RC, IBV_WR_RDMA_WRITE, {kMaxMsgSize}},
    {"over max_msg_sz",
     IBV_QPT_RC,
     IBV_WR_RDMA_WRITE,
     {kMaxMsgSize, 1},
     0,
     true,
     0,
     IBV_WC_LOC_LEN_ERR},
    {"atomic of 4 bytes",
     IBV_QPT_RC,
     IBV_WR_ATOMIC_CMP_AND_SWP,
     {4},
     0,
     true,
     0,
     IBV_WC_LOC_LEN_ERR},
    {"atomic of 16 bytes",
     IBV_QPT_RC,
     IBV_WR_ATOMIC_FETCH_AND_ADD,
     {16},
     0,
     true,
     0,
     IBV_WC_LOC_LEN_ERR},
    {"atomic without SGE",
     IBV_QPT_RC,
     IBV_WR_ATOMIC_FETCH_AND_ADD,
     {},
     0,
     true,
     0,
     IBV_WC_LOC_LEN_ERR},
    {"atomic's 8 bytes in two SGEs", IBV_QPT_RC, IBV_WR_ATOMIC_FETCH_AND_ADD, {4, 4}},
};

TEST(PostRules, EachWorkRequestGetsTheAnswerOfARealDevice) {
  static uint8_t ah_stand_in;
  for (const Case& c : kCases) {
    std::vector<ibv_sge> sges;
    uint64_t len = 0;
    for (uint32_t n : c.lengths) {
      sges.push_back({0x10000, n, 1});
      len += n;
    }
    ibv_send_wr wr{};
    wr.opcode = c.op;
    wr.sg_list = sges.data();
    wr.num_sge = c.num_sge == -2 ? static_cast<int>(sges.size()) : c.num_sge;
    wr.send_flags = c.flags;
    if (c.type == IBV_QPT_UD && c.ah) wr.wr.ud.ah = reinterpret_cast<ibv_ah*>(&ah_stand_in);
    const char* why = nullptr;
    EXPECT_EQ(check_post_send(c.type, wr, kCaps, &why), c.post) << c.name;
    if (c.post) {
      EXPECT_NE(why, nullptr) << c.name;
      continue;
    }
    EXPECT_EQ(check_send_length(c.op, len), c.wc) << c.name;
  }
}

TEST(PostRules, QueueStatesAndReceives) {
  for (ibv_qp_state s : {IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR}) EXPECT_FALSE(can_post_send(s));
  for (ibv_qp_state s : {IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE, IBV_QPS_ERR})
    EXPECT_TRUE(can_post_send(s));
  EXPECT_FALSE(can_post_recv(IBV_QPS_RESET));
  for (ibv_qp_state s : {IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_ERR})
    EXPECT_TRUE(can_post_recv(s));
  ibv_recv_wr r{};
  r.num_sge = 2;
  EXPECT_EQ(check_post_recv(r, 2), 0);
  r.num_sge = 3;
  EXPECT_EQ(check_post_recv(r, 2), EINVAL);
  r.num_sge = -1;
  EXPECT_EQ(check_post_recv(r, 2), EINVAL);
  EXPECT_FALSE(sge_names_memory(0));
  EXPECT_TRUE(sge_names_memory(1));
}

TEST(PostRules, BindMwFaultsAreMwBindErrors) {
  MwBindView ok;
  ok.mw_found = ok.mw_same_pd = ok.mr_found = ok.mr_same_pd = true;
  ok.mw_type = IBV_MW_TYPE_2;
  ok.mr_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND;
  ok.mr_iova = 0x1000;
  ok.mr_length = 0x2000;
  ok.old_rkey = 0x12345600;
  ok.new_rkey = 0x12345601;
  ok.addr = 0x1000;
  ok.length = 0x2000;
  ok.access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
  const uint32_t qp = IBV_ACCESS_MW_BIND;
  EXPECT_EQ(check_bind_mw(qp, ok), IBV_WC_SUCCESS);
  MwBindView zero_based = ok;
  zero_based.access |= IBV_ACCESS_ZERO_BASED;
  EXPECT_EQ(check_bind_mw(qp, zero_based), IBV_WC_SUCCESS) << "a window addressed from 0";
  struct Case {
    const char* name;
    void (*spoil)(MwBindView&, uint32_t&);
  };
  const Case cases[] = {
      {"no window", [](MwBindView& b, uint32_t&) { b.mw_found = false; }},
      {"QP without MW_BIND", [](MwBindView&, uint32_t& q) { q = 0; }},
      {"type 2 of another PD", [](MwBindView& b, uint32_t&) { b.mw_same_pd = false; }},
      {"type 2 bound", [](MwBindView& b, uint32_t&) { b.mw_bound = true; }},
      {"index changed", [](MwBindView& b, uint32_t&) { b.new_rkey = 0x22345601; }},
      {"no MR", [](MwBindView& b, uint32_t&) { b.mr_found = false; }},
      {"MR of another PD", [](MwBindView& b, uint32_t&) { b.mr_same_pd = false; }},
      {"MR without MW_BIND",
       [](MwBindView& b, uint32_t&) { b.mr_access = IBV_ACCESS_LOCAL_WRITE; }},
      {"local access", [](MwBindView& b, uint32_t&) { b.access |= IBV_ACCESS_LOCAL_WRITE; }},
      {"write without local write",
       [](MwBindView& b, uint32_t&) { b.mr_access = IBV_ACCESS_MW_BIND; }},
      {"before the MR", [](MwBindView& b, uint32_t&) { b.addr = 0xfff; }},
      {"past the MR", [](MwBindView& b, uint32_t&) { b.length = 0x2001; }},
  };
  for (const Case& c : cases) {
    MwBindView b = ok;
    uint32_t q = qp;
    c.spoil(b, q);
    const char* why = nullptr;
    EXPECT_EQ(check_bind_mw(q, b, &why), IBV_WC_MW_BIND_ERR) << c.name;
    EXPECT_NE(why, nullptr) << c.name;
  }
  // A type 1 bind of length 0 unbinds: no MR needed.
  MwBindView unbind;
  unbind.mw_found = true;
  unbind.mw_type = IBV_MW_TYPE_1;
  EXPECT_EQ(check_bind_mw(qp, unbind), IBV_WC_SUCCESS);
}

TEST(ResponderRules, AWindowReachesOnlyWhileBoundUnderItsKeyThroughItsQp) {
  RemoteMwView w;
  w.found = w.bound = w.same_key = w.same_pd = w.same_qp = true;
  w.type = IBV_MW_TYPE_2;
  w.access = IBV_ACCESS_REMOTE_READ;
  w.addr = 0x1000;
  w.length = 0x100;
  EXPECT_TRUE(window_view(w).found);
  EXPECT_EQ(
      check_remote_request(IBV_WR_RDMA_READ, IBV_ACCESS_REMOTE_READ, 0x1000, 0x100, window_view(w)),
      IBV_WC_SUCCESS);
  EXPECT_EQ(
      check_remote_request(IBV_WR_RDMA_READ, IBV_ACCESS_REMOTE_READ, 0x1001, 0x100, window_view(w)),
      IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(
      check_remote_request(IBV_WR_RDMA_WRITE, IBV_ACCESS_REMOTE_WRITE, 0x1000, 8, window_view(w)),
      IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(check_invalidate(w, IBV_WC_LOC_QP_OP_ERR), IBV_WC_SUCCESS);
  for (bool RemoteMwView::*f : {&RemoteMwView::bound, &RemoteMwView::same_key,
                                &RemoteMwView::same_pd, &RemoteMwView::same_qp}) {
    RemoteMwView v = w;
    v.*f = false;
    EXPECT_FALSE(window_view(v).found);
  }
  RemoteMwView t1 = w;
  t1.type = IBV_MW_TYPE_1;
  t1.same_qp = false;
  EXPECT_TRUE(window_view(t1).found) << "type 1: any QP of its PD";
  EXPECT_EQ(check_invalidate(t1, IBV_WC_REM_INV_REQ_ERR), IBV_WC_REM_INV_REQ_ERR);
  RemoteMwView other = w;
  other.same_qp = false;
  EXPECT_EQ(check_invalidate(other, IBV_WC_LOC_QP_OP_ERR), IBV_WC_LOC_QP_OP_ERR);
}

// A zero-based window (IBV_ACCESS_ZERO_BASED in its bind) is addressed from 0: [0, length)
// names [addr, addr + length) of its MR, and the MR's own addresses are outside it.
TEST(ResponderRules, AZeroBasedWindowIsAddressedFromZero) {
  RemoteMwView w;
  w.found = w.bound = w.same_key = w.same_pd = w.same_qp = true;
  w.type = IBV_MW_TYPE_1;
  w.access = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_ZERO_BASED;
  w.addr = 0x1000;
  w.length = 0x100;
  const RemoteMrView v = window_view(w);
  ASSERT_TRUE(v.found);
  EXPECT_EQ(v.access, static_cast<uint32_t>(IBV_ACCESS_REMOTE_READ));
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_READ, IBV_ACCESS_REMOTE_READ, 0, 0x100, v),
            IBV_WC_SUCCESS);
  EXPECT_EQ(mr_iova_of(v, 0x10), 0x1010u);
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_READ, IBV_ACCESS_REMOTE_READ, 0xf8, 16, v),
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_READ, IBV_ACCESS_REMOTE_READ, 0x1000, 8, v),
            IBV_WC_REM_ACCESS_ERR)
      << "an MR address";
  w.access = IBV_ACCESS_REMOTE_READ;  // not zero-based: addressed as its MR
  EXPECT_EQ(mr_iova_of(window_view(w), 0x1010), 0x1010u);
  EXPECT_EQ(check_remote_request(IBV_WR_RDMA_READ, IBV_ACCESS_REMOTE_READ, 0, 8, window_view(w)),
            IBV_WC_REM_ACCESS_ERR);
}

}  // namespace
}  // namespace vrdma::proto
