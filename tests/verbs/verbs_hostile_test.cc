// A hostile guest, through the real verbs API: a second process (guest "mallory", a fresh copy
// of this binary) steals the victim's LID, QPN, rkey and buffer address from a file, points its
// own RC QP at the victim's QP and tries RDMA WRITE, READ and both atomics with the stolen rkey,
// then a SEND whose SGE names the victim's lkey. It must get error completions and move no byte
// of the victim's; the victim's QP and data path carry on. PD boundaries inside one guest too.
#include <sys/wait.h>

#include <cstdio>

#include "verbs_fixture.h"

namespace {

struct Secrets {
  uint32_t lid, qpn, key;
  uint64_t addr;
};

/// Posts one WR on `qp` and waits for its completion; returns its status (or -1: none came).
int run_one(ibv_qp* qp, ibv_cq* cq, ibv_send_wr& wr) {
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(qp, &wr, &bad)) return -2;
  ibv_wc wc{};
  for (int spins = 0; spins < 20'000'000; ++spins) {
    int n = ibv_poll_cq(cq, 1, &wc);
    if (n < 0) return -3;
    if (n == 1) return wc.status;
    if (spins > 1000) ::usleep(10);
  }
  return -1;
}

/// Mallory: returns 0 when every attempt failed as it must.
int mallory_main(const char* secrets_path) {
  ::setenv("VRDMA_GUEST", "mallory", 1);
  Secrets s{};
  FILE* f = std::fopen(secrets_path, "r");
  if (!f || std::fscanf(f, "%u %u %u %lu", &s.lid, &s.qpn, &s.key, &s.addr) != 4) return 10;
  std::fclose(f);
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ibv_context* ctx = list && n == 1 ? ibv_open_device(list[0]) : nullptr;
  if (!ctx) return 11;
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
  std::vector<uint8_t> buf(8192, 0xee);
  ibv_mr* mr = ibv_reg_mr(pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap = {4, 4, 1, 1, 0};
  ibv_qp* qp = pd && cq && mr ? ibv_create_qp(pd, &qa) : nullptr;
  if (!qp) return 12;
  int rc = 0;
  const ibv_wr_opcode ops[] = {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ, IBV_WR_ATOMIC_FETCH_AND_ADD,
                               IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_SEND};
  for (ibv_wr_opcode op : ops) {
    // Aimed at the victim's QP; RESET first, as the previous attempt left the QP in ERR.
    const unsigned access = IBV_ACCESS_LOCAL_WRITE;
    const auto lid = static_cast<uint16_t>(s.lid);
    for (ibv_qp_state st : {IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS}) {
      if (vrdma::test::modify_rc(qp, st, lid, s.qpn, access, 2)) return 13;
    }
    const bool atomic = op == IBV_WR_ATOMIC_FETCH_AND_ADD || op == IBV_WR_ATOMIC_CMP_AND_SWP;
    // SEND: a forged SGE naming the victim's lkey and address as the bytes to send.
    ibv_sge sge = op == IBV_WR_SEND ? ibv_sge{s.addr, 64, s.key}
                                    : ibv_sge{reinterpret_cast<uintptr_t>(buf.data()),
                                              atomic ? 8u : 4096u, mr->lkey};
    ibv_send_wr wr = vrdma::test::make_wr(sge, op, s.addr, s.key, IBV_SEND_SIGNALED, 1,
                                          0x4141414141414141ull);
    wr.wr_id = op;
    const int st = run_one(qp, cq, wr);
    std::printf("mallory: opcode %d -> %s (%d)\n", op,
                st >= 0 ? ibv_wc_status_str(static_cast<ibv_wc_status>(st)) : "no completion", st);
    const int want = op == IBV_WR_SEND ? IBV_WC_LOC_PROT_ERR : IBV_WC_RETRY_EXC_ERR;
    if (st != want) rc = 20 + op;
  }
  for (uint8_t b : buf) {
    if (b != 0xee) return 30;  // nothing of the victim's came back
  }
  // No teardown: mallory just exits, and the backend reclaims what it held.
  ibv_free_device_list(list);
  return rc;
}

const int kMalloryHook = [] {
  if (const char* path = std::getenv("VRDMA_TEST_MALLORY")) {
    const int rc = mallory_main(path);
    std::fflush(stdout);
    ::_exit(rc);
  }
  return 0;
}();

class Hostile : public vrdma::test::VerbsFixture {
 protected:
  static void SetUpTestSuite() {
    VerbsFixture::SetUpTestSuite();
    ::setenv("VRDMA_GUEST", "victim", 1);
  }

  ibv_qp* rc_qp(ibv_pd* pd, ibv_cq* cq) {
    ibv_qp_init_attr qa{};
    qa.send_cq = qa.recv_cq = cq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap = {8, 8, 1, 1, 0};
    ibv_qp* qp = ibv_create_qp(pd, &qa);
    if (qp) qps_.push_back(qp);
    return qp;
  }
  ibv_qp_state state(ibv_qp* qp) {
    ibv_qp_attr a{};
    ibv_qp_init_attr ia{};
    EXPECT_EQ(ibv_query_qp(qp, &a, IBV_QP_STATE, &ia), 0);
    return a.qp_state;
  }
  static int post(ibv_qp* qp, ibv_sge s, ibv_wr_opcode op, uint64_t raddr = 0, uint32_t rkey = 0) {
    ibv_send_wr wr = vrdma::test::make_wr(s, op, raddr, rkey);
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(qp, &wr, &bad);
  }
};

TEST_F(Hostile, StolenKeysAndQpnReachNothing) {
  ibv_cq* cq = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  cqs_.push_back(cq);
  ibv_qp* a = rc_qp(pd_, cq);
  ibv_qp* b = rc_qp(pd_, cq);
  ASSERT_TRUE(a && b);
  connect(a, b->qp_num);
  connect(b, a->qp_num);
  std::memset(buf_.data(), 0x5a, buf_.size());
  const uint64_t before = std::count(buf_.begin(), buf_.end(), 0x5a);

  // The secrets mallory steals: b's address, its rkey (== lkey) and where the buffer is.
  const std::string path = std::string(std::getenv("VRDMA_SOCKET")) + ".secrets";
  {
    FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fprintf(f, "%u %u %u %lu\n", lid_, b->qp_num, mr_->rkey,
                 static_cast<unsigned long>(addr(0)));
    std::fclose(f);
  }
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv("VRDMA_TEST_MALLORY", path.c_str(), 1);
    ::execl("/proc/self/exe", "verbs_hostile_test", static_cast<char*>(nullptr));
    ::_exit(3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "mallory got through (or failed oddly); its output says how";
  ::unlink(path.c_str());

  EXPECT_EQ(static_cast<uint64_t>(std::count(buf_.begin(), buf_.end(), 0x5a)), before)
      << "the victim's memory changed";
  EXPECT_EQ(state(a), IBV_QPS_RTS);
  EXPECT_EQ(state(b), IBV_QPS_RTS);
  // The victim's own pair still works.
  ASSERT_EQ(post_recv(b, 1, 65536, 64), 0);
  ASSERT_EQ(post(a, ibv_sge{addr(0), 64, mr_->lkey}, IBV_WR_SEND), 0);
  auto wc = poll(cq, 2);
  ASSERT_EQ(wc.size(), 2u);
  for (const ibv_wc& w : wc) EXPECT_EQ(w.status, IBV_WC_SUCCESS);
}

TEST_F(Hostile, PdBoundariesHoldInsideOneGuest) {
  // A second PD of the same context: its MR is neither a local nor a remote key for QPs of pd_.
  ibv_pd* pd2 = ibv_alloc_pd(ctx_);
  ASSERT_NE(pd2, nullptr);
  std::vector<uint8_t> other(8192, 0x22);
  ibv_mr* mr2 = ibv_reg_mr(pd2, other.data(), other.size(),
                           IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ASSERT_NE(mr2, nullptr);
  ibv_cq* cq = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  cqs_.push_back(cq);
  ibv_qp* q[4];
  for (ibv_qp*& x : q) ASSERT_NE(x = rc_qp(pd_, cq), nullptr);
  for (int i = 0; i < 4; ++i) connect(q[i], q[i ^ 1]->qp_num);  // pairs (0,1) and (2,3)
  // Local: a SEND from pd2's MR on a QP of pd_.
  ASSERT_EQ(post_recv(q[1], 1, 0, 64), 0);
  const auto other_addr = reinterpret_cast<uintptr_t>(other.data());
  ASSERT_EQ(post(q[0], ibv_sge{other_addr, 64, mr2->lkey}, IBV_WR_SEND), 0);
  auto wc = poll(cq, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(wc[0].qp_num, q[0]->qp_num);
  // Remote: an RDMA WRITE of pd_'s memory at pd2's rkey, to a responder QP of pd_.
  ASSERT_EQ(post(q[2], ibv_sge{addr(0), 64, mr_->lkey}, IBV_WR_RDMA_WRITE, other_addr, mr2->rkey), 0);
  wc = poll(cq, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].qp_num, q[2]->qp_num);
  EXPECT_EQ(wc[0].status, IBV_WC_REM_ACCESS_ERR) << "pd2's rkey reached through a QP of pd_";
  EXPECT_EQ(std::count(other.begin(), other.end(), 0x22), 8192);
  EXPECT_EQ(ibv_dereg_mr(mr2), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd2), 0);
}

}  // namespace
