// A hostile guest, through the real verbs API. The victim is a peer process (peer.h) in guest
// "victim" with two RC QPs connected to each other; this process is "mallory", which has
// stolen the victim's LID, a QPN, the rkey and the buffer's address (here the harness hands
// them over; in life a leaked file or a guess). Mallory points its own RC QP at the victim's
// QP and tries RDMA WRITE, READ and both atomics with the stolen rkey, then a SEND whose SGE
// names the victim's key and address as its own. Every attempt must end in an error completion
// and move no byte of the victim's; the victim's QPs stay as they were. PD boundaries inside
// one guest too.
#include "peer.h"
#include "verbs_fixture.h"

namespace {

using vrdma::test::Peer;
using vrdma::test::PeerQp;
using vrdma::test::QpPath;

class Hostile : public vrdma::test::VerbsFixture {
 protected:
  static void SetUpTestSuite() {
    VerbsFixture::SetUpTestSuite();
    ::setenv("VRDMA_GUEST", "mallory", 1);
  }

  ibv_qp* rc_qp(ibv_cq* cq) {
    ibv_qp_init_attr qa{};
    qa.send_cq = qa.recv_cq = cq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap = {8, 8, 1, 1, 0};
    ibv_qp* qp = ibv_create_qp(pd_, &qa);
    if (qp) qps_.push_back(qp);
    return qp;
  }
  ibv_cq* new_cq() {
    ibv_cq* cq = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
    if (cq) cqs_.push_back(cq);
    return cq;
  }
  /// Posts one WR and waits for its completion: its status, or GENERAL_ERR when none came.
  ibv_wc_status run(ibv_qp* qp, ibv_cq* cq, const Wr& w) {
    EXPECT_EQ(post(qp, w), 0);
    auto wcs = poll(cq, 1);
    return wcs.empty() ? IBV_WC_GENERAL_ERR : wcs[0].status;
  }
};

TEST_F(Hostile, StolenKeysAndQpnReachNothing) {
  Peer victim;
  ASSERT_TRUE(victim.start("victim"));
  const PeerQp v1 = victim.create_qp(IBV_QPT_RC, 8), v2 = victim.create_qp(IBV_QPT_RC, 8);
  QpPath to_v1, to_v2;
  to_v1.dlid = to_v2.dlid = victim.lid();
  to_v1.dest_qpn = v1.qpn;
  to_v2.dest_qpn = v2.qpn;
  ASSERT_EQ(victim.connect(v1, to_v2), 0);
  ASSERT_EQ(victim.connect(v2, to_v1), 0);
  const std::vector<uint8_t> pattern(65536, 0x5a);  // the part of its buffer the attacks aim at
  victim.write(0, pattern.data(), static_cast<uint32_t>(pattern.size()));
  const uint64_t vaddr = victim.mem().addr;
  const uint32_t vkey = victim.mem().rkey;

  ibv_cq* cq = new_cq();
  ASSERT_NE(cq, nullptr);
  ibv_qp* qp = rc_qp(cq);
  ASSERT_NE(qp, nullptr);
  std::memset(buf_.data(), 0xee, 8192);
  struct Attempt {
    Wr wr;
    ibv_wc_status want;
  };
  const Attempt attempts[] = {
      {{.op = IBV_WR_RDMA_WRITE, .sges = {sge(0, 4096)}, .raddr = vaddr, .rkey = vkey},
       IBV_WC_RETRY_EXC_ERR},
      {{.op = IBV_WR_RDMA_READ, .sges = {sge(0, 4096)}, .raddr = vaddr, .rkey = vkey},
       IBV_WC_RETRY_EXC_ERR},
      {{.op = IBV_WR_ATOMIC_FETCH_AND_ADD, .sges = {sge(0, 8)}, .raddr = vaddr, .rkey = vkey,
        .compare_add = 1},
       IBV_WC_RETRY_EXC_ERR},
      {{.op = IBV_WR_ATOMIC_CMP_AND_SWP, .sges = {sge(0, 8)}, .raddr = vaddr, .rkey = vkey,
        .compare_add = 0x5a5a5a5a5a5a5a5aull, .swap = 0x4141414141414141ull},
       IBV_WC_RETRY_EXC_ERR},
      // A forged SGE: the victim's key and address as the bytes to send.
      {{.op = IBV_WR_SEND, .sges = {ibv_sge{vaddr, 64, vkey}}}, IBV_WC_LOC_PROT_ERR},
  };
  for (const Attempt& a : attempts) {
    SCOPED_TRACE(a.wr.op);
    // Aimed at the victim's v2 (connected to v1, not to us). RESET first: the previous attempt
    // left the QP in ERR.
    ibv_qp_attr reset{};
    reset.qp_state = IBV_QPS_RESET;
    ASSERT_EQ(ibv_modify_qp(qp, &reset, IBV_QP_STATE), 0);
    QpPath p = to_v2;
    p.timeout = 4;  // ~65 µs per try: the retries run out quickly
    ASSERT_EQ(bring_to_rts(qp, p), 0);
    EXPECT_EQ(run(qp, cq, a.wr), a.want);
    EXPECT_EQ(state(qp), IBV_QPS_ERR);
  }

  const auto now = victim.read(0, static_cast<uint32_t>(pattern.size()));
  EXPECT_TRUE(now == pattern) << "the victim's memory changed";
  EXPECT_EQ(std::count(buf_.begin(), buf_.begin() + 8192, 0xee), 8192)
      << "bytes of the victim's came back";
  EXPECT_EQ(victim.qp_state(v1), IBV_QPS_RTS);
  EXPECT_EQ(victim.qp_state(v2), IBV_QPS_RTS);
  EXPECT_TRUE(victim.poll(1, 100).empty()) << "the victim saw a completion it did not ask for";
  EXPECT_EQ(victim.finish(), 0);
}

TEST_F(Hostile, PdBoundariesHoldInsideOneGuest) {
  // A second PD of the same context: its MR is neither a local nor a remote key for QPs of pd_.
  ibv_pd* pd2 = ibv_alloc_pd(ctx_);
  ASSERT_NE(pd2, nullptr);
  std::vector<uint8_t> other(8192, 0x22);
  ibv_mr* mr2 = ibv_reg_mr(pd2, other.data(), other.size(),
                           IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ASSERT_NE(mr2, nullptr);
  ibv_cq* cq = new_cq();
  ASSERT_NE(cq, nullptr);
  ibv_qp* q[4];
  for (ibv_qp*& x : q) ASSERT_NE(x = rc_qp(cq), nullptr);
  for (int i = 0; i < 4; ++i) connect(q[i], q[i ^ 1]->qp_num);  // pairs (0,1) and (2,3)
  const auto other_addr = reinterpret_cast<uintptr_t>(other.data());
  // Local: a SEND from pd2's MR on a QP of pd_.
  ASSERT_EQ(post_recv(q[1], 1, 0, 64), 0);
  EXPECT_EQ(run(q[0], cq, {.sges = {ibv_sge{other_addr, 64, mr2->lkey}}}), IBV_WC_LOC_PROT_ERR);
  // Remote: an RDMA WRITE of pd_'s memory at pd2's rkey, to a responder QP of pd_.
  EXPECT_EQ(run(q[2], cq,
                {.op = IBV_WR_RDMA_WRITE, .sges = {sge(0, 64)}, .raddr = other_addr,
                 .rkey = mr2->rkey}),
            IBV_WC_REM_ACCESS_ERR)
      << "pd2's rkey reached through a QP of pd_";
  EXPECT_EQ(std::count(other.begin(), other.end(), 0x22), 8192);
  EXPECT_EQ(ibv_dereg_mr(mr2), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd2), 0);
}

}  // namespace
