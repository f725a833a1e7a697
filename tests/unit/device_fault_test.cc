// Guest memory that faults under the backend (issue 21, item 3): a SIGSEGV or SIGBUS while the
// engine copies to or from a guest's pages fails that message, and that guest's QP where the
// memory was its own, never the process. Here the device's own mapping of a segment is made
// PROT_NONE (the test process is the backend), so every access to it faults.
#include <sys/mman.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "device_fixture.h"

namespace vrdma::engine::devtest {
namespace {

constexpr uint64_t kBadIova = 0x7a0000000000ull;
constexpr uint32_t kAll = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                          IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

class DeviceFaultTest : public DeviceTest {
 protected:
  /// An MR of guest `g` over a segment only the device maps, whose mapping then faults: with
  /// SIGSEGV everywhere (PROT_NONE), or, `bus`, with SIGBUS from its second page on (a file of
  /// one page mapped in its place, as a hugetlbfs page taken away would leave it).
  RegMrResp broken_mr(G& g, const std::string& name, bool bus = false) {
    UniqueFd fd = make_sealed_memfd(name, kMemBytes).value();
    const uint32_t seg = dev_.reg_segment(*g.s, RegSegmentReq{kMemBytes}, std::move(fd)).value();
    auto mr = dev_.reg_mr(*g.s, mr_req(g.pd, kAll, kBadIova, kMemBytes, seg));
    EXPECT_TRUE(mr.is_ok()) << mr.status().message();
    // The device's mapping of it, by the memfd's name.
    std::ifstream maps("/proc/self/maps");
    std::string line;
    bool found = false;
    while (std::getline(maps, line)) {
      if (line.find("/memfd:" + name + " ") == std::string::npos) continue;
      unsigned long lo = 0, hi = 0;
      std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi);
      if (bus) {
        UniqueFd small = make_sealed_memfd("one-page", 4096).value();
        EXPECT_EQ(::mmap(reinterpret_cast<void*>(lo), hi - lo, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_FIXED, small.get(), 0),
                  reinterpret_cast<void*>(lo));
      } else {
        EXPECT_EQ(::mprotect(reinterpret_cast<void*>(lo), hi - lo, PROT_NONE), 0);
      }
      found = true;
    }
    EXPECT_TRUE(found) << "no mapping of memfd " << name;
    return mr.value();
  }
  void allow_all(G& g, QpV& q) {
    QpAttr a{};
    a.qp_access_flags = kAll;
    ASSERT_TRUE(modify(g, q, IBV_QP_ACCESS_FLAGS, a));
  }
  /// The device still serves: a fresh pair of guests moves a message.
  void expect_device_serves() {
    G c = open("c"), d = open("d");
    CqV cc = cq(c), dc = cq(d);
    QpV qc = qp(c, cc, cc), qd = qp(d, dc, dc);
    MemV mc = mem(c), md = mem(d);
    connect(c, qc, d, qd);
    connect(d, qd, c, qc);
    std::memset(mc.p(), 'c', 64);
    post_recv(qd, 1, md.addr, 64, md.mr.lkey);
    post_send(qc, 2, mc.addr, 64, mc.mr.lkey);
    dev_.poll(now_);
    auto rx = drain(dc);
    ASSERT_EQ(rx.size(), 1u);
    EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(md.p()[63], 'c');
  }
};

TEST_F(DeviceFaultTest, WriteIntoFaultingMemoryFailsBothQpsNotTheBackend) {
  connect_both();
  allow_all(b_, qb_);
  const RegMrResp bad = broken_mr(b_, "fault-write");
  async_events(b_);
  post_rdma(qa_, 1, IBV_WR_RDMA_WRITE, ma_.addr, 256, ma_.mr.lkey, kBadIova + 64, bad.rkey);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
  EXPECT_EQ(state(b_, qb_), IBV_QPS_ERR) << "the guest whose memory faulted";
  auto ev = async_events(b_);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0], std::make_pair(uint32_t{IBV_EVENT_QP_FATAL}, qb_.handle));
  expect_device_serves();
}

// SIGBUS, the signal the hugetlbfs attack raised: the same outcome.
TEST_F(DeviceFaultTest, WriteIntoMemoryThatRaisesSigbusFailsTheMessageNotTheBackend) {
  connect_both();
  allow_all(b_, qb_);
  const RegMrResp bad = broken_mr(b_, "fault-bus", /*bus=*/true);
  std::memset(ma_.p(), 'w', 256);
  // The first page is still there: a write into it works.
  post_rdma(qa_, 1, IBV_WR_RDMA_WRITE, ma_.addr, 256, ma_.mr.lkey, kBadIova, bad.rkey);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  post_rdma(qa_, 2, IBV_WR_RDMA_WRITE, ma_.addr, 256, ma_.mr.lkey, kBadIova + 4096 + 64, bad.rkey);
  dev_.poll(now_);
  tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(state(b_, qb_), IBV_QPS_ERR);
  expect_device_serves();
}

TEST_F(DeviceFaultTest, ReadAndAtomicOnFaultingMemoryFailWithARemoteAccessError) {
  const RegMrResp bad = broken_mr(b_, "fault-read");
  for (uint32_t op : {IBV_WR_RDMA_READ, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_ATOMIC_CMP_AND_SWP}) {
    SCOPED_TRACE(op);
    QpAttr reset{};
    reset.qp_state = IBV_QPS_RESET;
    ASSERT_TRUE(modify(a_, qa_, IBV_QP_STATE, reset));
    ASSERT_TRUE(modify(b_, qb_, IBV_QP_STATE, reset));
    qa_.sq_prod = qa_.sq->producer.load();
    connect_both();
    allow_all(b_, qb_);
    post_rdma(qa_, 1, op, ma_.addr, op == IBV_WR_RDMA_READ ? 128 : 8, ma_.mr.lkey, kBadIova + 8,
              bad.rkey);
    dev_.poll(now_);
    auto tx = drain(acq_);
    ASSERT_EQ(tx.size(), 1u);
    EXPECT_EQ(tx[0].status, IBV_WC_REM_ACCESS_ERR);
    EXPECT_EQ(state(b_, qb_), IBV_QPS_ERR);
  }
  expect_device_serves();
}

// The requester's own memory faults: only its message and QP fail; the responder, which did
// nothing wrong, keeps its QP and its receive.
TEST_F(DeviceFaultTest, SendFromFaultingMemoryFailsOnlyTheSender) {
  connect_both();
  const RegMrResp bad = broken_mr(a_, "fault-send");
  post_recv(qb_, 7, mb_.addr, 512, mb_.mr.lkey);
  post_send(qa_, 1, kBadIova, 512, bad.lkey);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
  EXPECT_EQ(state(b_, qb_), IBV_QPS_RTS);
  EXPECT_TRUE(drain(bcq_).empty()) << "the receive was not used";
  expect_device_serves();
}

TEST_F(DeviceFaultTest, DatagramsWithFaultingMemoryFailTheirOwnerOnly) {
  auto post_ud = [&](QpV& q, uint64_t addr, uint32_t lkey, const G& to, uint32_t qpn) {
    SendWqe w{};
    w.wr_id = 9;
    w.opcode = IBV_WR_SEND;
    w.send_flags = IBV_SEND_SIGNALED;
    w.num_sge = 1;
    w.sge[0] = Sge{addr, 100, lkey};
    UdDest d{};
    d.dlid = static_cast<uint16_t>(to.hello.lid);
    pack_ud_dest(w, d);
    w.ud_remote_qpn = qpn;
    w.ud_remote_qkey = 0x11;
    q.sqe[q.sq_prod & (q.sq_size - 1)] = w;
    q.sq->producer.store(++q.sq_prod, std::memory_order_release);
  };
  QpV ua = ud_qp(a_, acq_, 0x11), ub = ud_qp(b_, bcq_, 0x11);
  const RegMrResp bad_a = broken_mr(a_, "fault-ud-a");
  const RegMrResp bad_b = broken_mr(b_, "fault-ud-b");
  // The sender's memory faults: the datagram is lost, b's receive stays posted.
  post_recv(ub, 1, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, kBadIova, bad_a.lkey, b_, ub.qpn);
  dev_.poll(now_);
  EXPECT_TRUE(drain(bcq_).empty());
  EXPECT_EQ(state(b_, ub), IBV_QPS_RTS);
  // ... and takes the next datagram.
  std::memset(ma_.p(), 'u', 100);
  post_ud(ua, ma_.addr, ma_.mr.lkey, b_, ub.qpn);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(mb_.p()[40], 'u');
  // The receiver's memory faults: its receive fails and its QP with it.
  post_recv(ub, 2, kBadIova, 1024, bad_b.lkey);
  post_ud(ua, ma_.addr, ma_.mr.lkey, b_, ub.qpn);
  dev_.poll(now_);
  rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(state(b_, ub), IBV_QPS_ERR);
  EXPECT_EQ(state(a_, ua), IBV_QPS_RTS);
  expect_device_serves();
}

}  // namespace
}  // namespace vrdma::engine::devtest
