// The fixture the verbs tests share: one backend per test process (started by our library on
// first use, on a socket of its own, stopped at the end), a context, a PD, a 1 MiB buffer
// registered with every access, RC connection set-up (qp_setup.h), receives and polling.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <infiniband/verbs.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "qp_setup.h"

namespace vrdma::test {

/// One receive of `len` bytes at `addr` (key `lkey`) posted to SRQ `srq`; ibv_post_srq_recv's
/// result.
inline int post_srq_recv(ibv_srq* srq, uint64_t id, uint64_t addr, uint32_t len, uint32_t lkey) {
  ibv_sge s{addr, len, lkey};
  ibv_recv_wr wr{};
  wr.wr_id = id;
  wr.sg_list = &s;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_srq_recv(srq, &wr, &bad);
}

class VerbsFixture : public ::testing::Test {
 protected:
  static constexpr unsigned kRemote =
      IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

  static void SetUpTestSuite() {
    // Backends a script started (tests/e2e/conformance_remote.sh: ours, and the peer's at
    // VRDMA_TEST_PEER_SOCKET) are used as they are, and left to it.
    if (std::getenv("VRDMA_TEST_PEER_SOCKET")) return;
    // ctest may run test processes in parallel: each gets its own socket, so its own backend.
    std::string base = std::getenv("VRDMA_SOCKET") ? std::getenv("VRDMA_SOCKET") : "/tmp/vrdma-t";
    ::setenv("VRDMA_SOCKET", (base + "." + std::to_string(::getpid())).c_str(), 1);
  }

  static void TearDownTestSuite() {
    if (std::getenv("VRDMA_TEST_PEER_SOCKET")) return;
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
    QpPath p;
    p.dlid = lid_;
    p.dest_qpn = remote_qpn;
    p.rnr_retry = rnr_retry;
    ASSERT_EQ(bring_to_rts(qp, p), 0);
  }

  /// Two QPs made by `make` (the test's own QP factory), connected to each other.
  template <typename Make>
  std::pair<ibv_qp*, ibv_qp*> connected_pair(Make make) {
    ibv_qp* a = make();
    ibv_qp* b = make();
    connect(a, b->qp_num);
    connect(b, a->qp_num);
    return {a, b};
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

  ibv_sge sge(size_t off, uint32_t len) const { return ibv_sge{addr(off), len, mr_->lkey}; }

  /// One send work request, as post() builds it into an ibv_send_wr.
  struct Wr {
    ibv_wr_opcode op = IBV_WR_SEND;
    std::vector<ibv_sge> sges;
    unsigned flags = IBV_SEND_SIGNALED;
    uint64_t wr_id = 0;
    uint64_t raddr = 0;  ///< RDMA and atomics
    uint32_t rkey = 0;
    uint64_t compare_add = 0, swap = 0;
    uint32_t imm = 0;  ///< host order
    ibv_ah* ah = nullptr;  ///< UD
    uint32_t remote_qpn = 0;
    uint32_t qkey = kTestQkey;
    uint32_t remote_srqn = 0;  ///< XRC_SEND: the target's SRQ
  };

  /// ibv_post_send of one WR; `bad_is_wr`, if given, says whether bad_wr named it.
  static int post(ibv_qp* qp, Wr w, bool* bad_is_wr = nullptr) {
    ibv_send_wr wr{};
    wr.wr_id = w.wr_id;
    wr.sg_list = w.sges.data();
    wr.num_sge = static_cast<int>(w.sges.size());
    wr.opcode = w.op;
    wr.send_flags = w.flags;
    wr.imm_data = htonl(w.imm);
    if (w.ah) {
      wr.wr.ud.ah = w.ah;
      wr.wr.ud.remote_qpn = w.remote_qpn;
      wr.wr.ud.remote_qkey = w.qkey;
    } else if (w.op == IBV_WR_ATOMIC_CMP_AND_SWP || w.op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
      wr.wr.atomic.remote_addr = w.raddr;
      wr.wr.atomic.rkey = w.rkey;
      wr.wr.atomic.compare_add = w.compare_add;
      wr.wr.atomic.swap = w.swap;
    } else {
      wr.wr.rdma.remote_addr = w.raddr;
      wr.wr.rdma.rkey = w.rkey;
    }
    wr.qp_type.xrc.remote_srqn = w.remote_srqn;
    ibv_send_wr* bad = nullptr;
    const int rc = ibv_post_send(qp, &wr, &bad);
    if (bad_is_wr) *bad_is_wr = bad == &wr;
    return rc;
  }

  /// The QP's capabilities as the device granted them (ibv_query_qp).
  static ibv_qp_cap caps(ibv_qp* qp) {
    ibv_qp_attr a{};
    ibv_qp_init_attr ia{};
    EXPECT_EQ(ibv_query_qp(qp, &a, IBV_QP_CAP, &ia), 0);
    return ia.cap;
  }

  static ibv_qp_state state(ibv_qp* qp) {
    ibv_qp_attr a{};
    ibv_qp_init_attr ia{};
    EXPECT_EQ(ibv_query_qp(qp, &a, IBV_QP_STATE, &ia), 0);
    return a.qp_state;
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
