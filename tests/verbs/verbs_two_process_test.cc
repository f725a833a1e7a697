// Two processes, two guests, one backend: this test and a peer copy of itself (peer.h) connect
// RC QPs through our libibverbs and move data with SEND, RDMA READ, RDMA WRITE and atomics; a
// wrong rkey from the other guest reaches nothing.
#include "peer.h"
#include "verbs_fixture.h"

namespace {

using vrdma::test::Peer;
using vrdma::test::QpPath;

class TwoProcesses : public vrdma::test::VerbsFixture {};

// Regression: fork() after ibv_reg_mr of memory in the brk heap used to corrupt glibc's heap
// (parent and child shared the registered pages, malloc's data next to the MR included); this
// test died in the forked child before its exec in ~5 runs of 6. Peer::start forks after the
// fixture registered buf_.
TEST_F(TwoProcesses, SendReadWriteAndAtomicsAcrossGuests) {
  Peer peer;
  ASSERT_TRUE(peer.start("two-process-child"));
  ASSERT_NE(peer.lid(), lid_) << "two guests, two LIDs";
  ibv_cq* cq = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  cqs_.push_back(cq);
  ibv_qp_init_attr qa{};
  qa.send_cq = cq;
  qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap = {8, 8, 1, 1, 0};
  ibv_qp* qp = ibv_create_qp(pd_, &qa);
  ASSERT_NE(qp, nullptr);
  qps_.push_back(qp);
  const vrdma::test::PeerQp pq = peer.create_qp(IBV_QPT_RC, 8);
  QpPath ours, theirs;
  ours.dlid = peer.lid();
  ours.dest_qpn = pq.qpn;
  ours.mtu = IBV_MTU_4096;
  theirs.dlid = lid_;
  theirs.dest_qpn = qp->qp_num;
  theirs.mtu = IBV_MTU_4096;
  ASSERT_EQ(bring_to_rts(qp, ours), 0);
  ASSERT_EQ(peer.connect(pq, theirs), 0);

  const uint64_t remote = peer.mem().addr;
  const uint32_t rkey = peer.mem().rkey;
  auto run = [&](Wr w) {
    EXPECT_EQ(post(qp, w), 0);
    auto wcs = poll(cq, 1);
    return wcs.empty() ? IBV_WC_GENERAL_ERR : wcs[0].status;
  };
  ASSERT_EQ(peer.post_recv(pq, 7, 4096, 4096), 0);
  std::memset(buf_.data() + 4096, 'P', 4096);
  EXPECT_EQ(run({.op = IBV_WR_SEND, .sges = {sge(4096, 4096)}}), IBV_WC_SUCCESS);
  auto rx = peer.poll(1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].wr_id, 7u);
  EXPECT_EQ(rx[0].byte_len, 4096u);
  auto got = peer.read(4096, 4096);
  EXPECT_EQ(std::count(got.begin(), got.end(), 'P'), 4096);

  const std::vector<uint8_t> c(4096, 'C');
  peer.write(8192, c.data(), 4096);
  EXPECT_EQ(run({.op = IBV_WR_RDMA_READ, .sges = {sge(8192, 4096)}, .raddr = remote + 8192,
                 .rkey = rkey}),
            IBV_WC_SUCCESS);
  EXPECT_EQ(std::count(buf_.begin() + 8192, buf_.begin() + 12288, 'C'), 4096);
  std::memset(buf_.data() + 16384, 'W', 4096);
  EXPECT_EQ(run({.op = IBV_WR_RDMA_WRITE, .sges = {sge(16384, 4096)}, .raddr = remote + 16384,
                 .rkey = rkey}),
            IBV_WC_SUCCESS);
  got = peer.read(16384, 4096);
  EXPECT_EQ(std::count(got.begin(), got.end(), 'W'), 4096);
  for (int i = 0; i < 1000; ++i) {
    ASSERT_EQ(run({.op = IBV_WR_ATOMIC_FETCH_AND_ADD, .sges = {sge(24576, 8)}, .raddr = remote,
                   .rkey = rkey, .compare_add = 1}),
              IBV_WC_SUCCESS);
  }
  got = peer.read(0, 8);
  uint64_t word;
  std::memcpy(&word, got.data(), 8);
  EXPECT_EQ(word, 1000u);
  // Our own key is not the peer's: the same rkey value names nothing in its namespace (and,
  // as a remote access error, ends our QP - so it comes last).
  EXPECT_EQ(run({.op = IBV_WR_RDMA_READ, .sges = {sge(0, 64)}, .raddr = remote, .rkey = mr_->rkey}),
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(peer.finish(), 0) << "the peer's clean-up failed";
}

}  // namespace
