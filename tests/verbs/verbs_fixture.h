// The fixture the verbs tests share: one backend per test process (started by our library on
// first use, on a socket of its own, stopped at the end), a context, a PD, a 1 MiB buffer
// registered with every access, RC connection set-up, receives and polling.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace vrdma::test {

class VerbsFixture : public ::testing::Test {
 protected:
  static constexpr unsigned kRemote =
      IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

  static void SetUpTestSuite() {
    // ctest may run test processes in parallel: each gets its own socket, so its own backend.
    std::string base = std::getenv("VRDMA_SOCKET") ? std::getenv("VRDMA_SOCKET") : "/tmp/vrdma-t";
    ::setenv("VRDMA_SOCKET", (base + "." + std::to_string(::getpid())).c_str(), 1);
  }

  static void TearDownTestSuite() {
    std::ifstream pidf(std::string(std::getenv("VRDMA_SOCKET")) + ".pid");
    pid_t pid = 0;
    if (pidf >> pid && pid > 0) ::kill(pid, SIGTERM);
  }

  void SetUp() override {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    ASSERT_NE(list, nullptr);
    ASSERT_EQ(n, 1);
    ASSERT_STREQ(ibv_get_device_name(list[0]), "vrdma0");
    ctx_ = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    ASSERT_NE(ctx_, nullptr) << std::strerror(errno);
    pd_ = ibv_alloc_pd(ctx_);
    ASSERT_NE(pd_, nullptr);
    ibv_port_attr pa{};
    ASSERT_EQ(ibv_query_port(ctx_, 1, &pa), 0);
    lid_ = pa.lid;
    buf_.assign(1 << 20, 0);
    mr_ = ibv_reg_mr(pd_, buf_.data(), buf_.size(), IBV_ACCESS_LOCAL_WRITE | kRemote);
    ASSERT_NE(mr_, nullptr) << std::strerror(errno);
  }

  void TearDown() override {
    for (ibv_qp* q : qps_) EXPECT_EQ(ibv_destroy_qp(q), 0);
    for (ibv_cq* c : cqs_) EXPECT_EQ(ibv_destroy_cq(c), 0);
    if (channel_) {
      EXPECT_EQ(ibv_destroy_comp_channel(channel_), 0);
    }
    for (ibv_mr* m : {mr_, rmr_}) {
      if (m) {
        EXPECT_EQ(ibv_dereg_mr(m), 0);
      }
    }
    if (pd_) {
      EXPECT_EQ(ibv_dealloc_pd(pd_), 0);
    }
    if (ctx_) {
      EXPECT_EQ(ibv_close_device(ctx_), 0);
    }
  }

  uint64_t addr(size_t off) const { return reinterpret_cast<uintptr_t>(buf_.data() + off); }

  int to_init(ibv_qp* qp) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | kRemote;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  }

  /// RESET -> INIT -> RTR -> RTS, connected to `remote_qpn` on our own LID.
  void connect(ibv_qp* qp, uint32_t remote_qpn, uint8_t rnr_retry = 7) {
    ASSERT_EQ(to_init(qp), 0);
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = remote_qpn;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 1;
    a.ah_attr.dlid = lid_;
    a.ah_attr.port_num = 1;
    ASSERT_EQ(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                        IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                        IBV_QP_MIN_RNR_TIMER),
              0);
    a = {};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 8;
    a.retry_cnt = 2;
    a.rnr_retry = rnr_retry;
    a.sq_psn = 0;
    a.max_rd_atomic = 1;
    ASSERT_EQ(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                        IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC),
              0);
  }

  int post_recv(ibv_qp* qp, uint64_t id, size_t off, uint32_t len) {
    ibv_sge s{addr(off), len, mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = id;
    wr.sg_list = &s;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    return ibv_post_recv(qp, &wr, &bad);
  }

  /// Polls with ibv_poll_cq until `n` completions arrived or 5 s passed.
  std::vector<ibv_wc> poll(ibv_cq* cq, size_t n) {
    std::vector<ibv_wc> out;
    for (int spins = 0; out.size() < n && spins < 5'000'000; ++spins) {
      ibv_wc wc[16];
      int got = ibv_poll_cq(cq, 16, wc);
      EXPECT_GE(got, 0);
      out.insert(out.end(), wc, wc + std::max(got, 0));
      if (got == 0) ::usleep(1);
    }
    return out;
  }

  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_mr* mr_ = nullptr;
  ibv_mr* rmr_ = nullptr;  ///< a second MR some tests register (deregistered in TearDown)
  ibv_comp_channel* channel_ = nullptr;
  std::vector<ibv_cq*> cqs_;
  std::vector<ibv_qp*> qps_;
  std::vector<uint8_t> buf_;
  uint16_t lid_ = 0;
};

}  // namespace vrdma::test
