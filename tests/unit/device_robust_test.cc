// Isolation and robustness of the device model (issue 6): per-guest quotas, a hostile guest
// with another guest's keys and QPN, peers of a guest that dies, and fairness of the data path
// across guests.
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>

#include <fmt/format.h>

#include "device_fixture.h"

namespace vrdma::engine::devtest {
namespace {


QpAttr reset_attr() {
  QpAttr a{};
  a.qp_state = IBV_QPS_RESET;
  return a;
}

bool all_bytes(const uint8_t* p, size_t n, uint8_t v) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != v) return false;
  }
  return true;
}

// ---- quotas ----

class QuotaTest : public DeviceTest {
 protected:
  // The common set-up holds, per guest: 1 PD, 1 MR of kMemBytes; a: 2 CQs, b: 1 CQ; 1 QP each.
  static void SetUpTestSuite() {
    Quotas q;
    q.max_pds = 2;
    q.max_qps = 2;
    q.max_cqs = 3;
    q.max_srqs = 1;
    q.max_mrs = 3;
    q.max_mr_bytes = 2 * kMemBytes;
    q.max_queue_depth = 64;
    next_quotas_ = q;
  }
  static void TearDownTestSuite() { next_quotas_ = {}; }
  Result<CreateQpResp> try_qp(G& g, const CqV& c, uint32_t depth = 8) {
    CreateQpReq req = qp_req(g, c, c);
    req.caps.max_send_wr = depth;
    UniqueFd fd;
    return dev_.create_qp(*g.s, req, fd);
  }
  Result<CreateCqResp> try_cq(G& g, uint32_t cqe = 8) {
    UniqueFd fd;
    return dev_.create_cq(*g.s, CreateCqReq{cqe, kNone, 0, 0}, fd);
  }
  Result<RegMrResp> try_mr(G& g, const MemV& m, uint64_t len) {
    // The segment of m is the session's only one in the fixture.
    return dev_.reg_mr(*g.s, mr_req(g.pd, kAccess, m.addr, len, g.s->segments.begin()->first));
  }
};

TEST_F(QuotaTest, EachKindFailsWithEnomemAtItsLimitAndOnlyForThatGuest) {
  // QPs: a has 1 of 2.
  ASSERT_TRUE(try_qp(a_, acq_).is_ok());
  auto r = try_qp(a_, acq_);
  EXPECT_EQ(r.status().err(), ENOMEM);
  EXPECT_NE(r.status().message().find("max_qps"), std::string::npos) << r.status().message();
  // Flagged as a quota's (the server's kAnswerQuota), unlike the device's own limits.
  EXPECT_TRUE(r.status().quota());
  EXPECT_FALSE(dev_.destroy_qp(*a_.s, 999).quota());
  EXPECT_TRUE(try_qp(b_, bcq_).is_ok()) << "b's quota is its own";
  // CQs: a has 2 of 3.
  ASSERT_TRUE(try_cq(a_).is_ok());
  EXPECT_EQ(try_cq(a_).status().err(), ENOMEM);
  EXPECT_TRUE(try_cq(b_).is_ok());
  // PDs: 1 of 2.
  ASSERT_TRUE(dev_.alloc_pd(*a_.s).is_ok());
  EXPECT_EQ(dev_.alloc_pd(*a_.s).status().err(), ENOMEM);
  // Registered bytes: kMemBytes of 2 * kMemBytes; MRs: 1 of 3.
  ASSERT_TRUE(try_mr(a_, ma_, kMemBytes).is_ok());
  EXPECT_EQ(try_mr(a_, ma_, 4096).status().err(), ENOMEM) << "bytes over quota";
  // SRQs: 0 of 1.
  UniqueFd fd;
  CreateSrqReq sreq{a_.pd, 0, SrqAttr{8, 1, 0, 0}};
  ASSERT_TRUE(dev_.create_srq(*a_.s, sreq, fd).is_ok());
  EXPECT_EQ(dev_.create_srq(*a_.s, sreq, fd).status().err(), ENOMEM);
  // Queue depth: 64 entries per queue.
  for (const Status& st : {try_cq(b_, 65).status(), try_qp(b_, bcq_, 128).status(),
                           dev_.create_srq(*b_.s, CreateSrqReq{b_.pd, 0, SrqAttr{65, 1, 0, 0}}, fd)
                               .status()}) {
    EXPECT_EQ(st.err(), ENOMEM);
    EXPECT_TRUE(st.quota());
    EXPECT_NE(st.message().find("max_queue_depth"), std::string::npos) << st.message();
  }
}

TEST_F(QuotaTest, FreeingOrClosingGivesTheQuotaBack) {
  auto q = try_qp(a_, acq_);
  ASSERT_TRUE(q.is_ok());
  EXPECT_EQ(try_qp(a_, acq_).status().err(), ENOMEM);
  ASSERT_TRUE(dev_.destroy_qp(*a_.s, q->handle));
  EXPECT_TRUE(try_qp(a_, acq_).is_ok()) << "a destroyed QP no longer counts";
  auto mr = try_mr(a_, ma_, kMemBytes);
  ASSERT_TRUE(mr.is_ok());
  ASSERT_TRUE(dev_.dereg_mr(*a_.s, mr->handle));
  EXPECT_TRUE(try_mr(a_, ma_, kMemBytes).is_ok()) << "deregistered bytes no longer count";

  // A second session of guest a shares a's quota; closing it gives its share back.
  G a2 = open("a");
  EXPECT_EQ(dev_.alloc_pd(*a2.s).status().err(), ENOMEM) << "a already holds 2 PDs";
  dev_.close_session(a_.s);
  EXPECT_TRUE(dev_.alloc_pd(*a2.s).is_ok());
  CqV c = cq(a2);
  EXPECT_TRUE(try_qp(a2, c).is_ok());
  EXPECT_TRUE(try_qp(a2, c).is_ok());
  EXPECT_EQ(try_qp(a2, c).status().err(), ENOMEM);
}

// ---- segments: what a guest's registered memory costs the backend ----

class SegmentQuotaTest : public DeviceTest {
 protected:
  // The common set-up gives each guest one segment of kMemBytes.
  static void SetUpTestSuite() {
    Quotas q;
    q.max_segments = 3;
    q.max_segment_bytes = 4 * kMemBytes;
    q.max_mapped_bytes = 7 * kMemBytes;  // a and b together
    next_quotas_ = q;
  }
  static void TearDownTestSuite() { next_quotas_ = {}; }
  Result<uint32_t> try_segment(G& g, uint64_t bytes) {
    return dev_.reg_segment(*g.s, RegSegmentReq{bytes}, make_sealed_memfd("seg", bytes).value());
  }
  uint64_t segments_of(const G& g) { return g.s->segments.size(); }
};

TEST_F(SegmentQuotaTest, CountBytesAndTheBackendsTotalFailWithEnomem) {
  // Count: a holds 1 of 3.
  ASSERT_TRUE(try_segment(a_, kMemBytes).is_ok());
  ASSERT_TRUE(try_segment(a_, kMemBytes).is_ok());
  auto r = try_segment(a_, kMemBytes);
  EXPECT_EQ(r.status().err(), ENOMEM);
  EXPECT_NE(r.status().message().find("max_segments"), std::string::npos) << r.status().message();
  // Bytes: one segment larger than the guest's whole allowance (a sparse 1 TiB memfd costs the
  // guest nothing, and would cost the backend 1 TiB of address space).
  r = try_segment(b_, 1ull << 40);
  EXPECT_EQ(r.status().err(), ENOMEM);
  EXPECT_NE(r.status().message().find("max_segment_bytes"), std::string::npos)
      << r.status().message();
  r = try_segment(b_, 4 * kMemBytes);  // b holds kMemBytes of 4 * kMemBytes
  EXPECT_EQ(r.status().err(), ENOMEM);
  // The backend's total: a maps 3, b 1 + 3 = 7 of 7; a third guest gets nothing.
  ASSERT_TRUE(try_segment(b_, 3 * kMemBytes).is_ok());
  G c = open("c");
  r = try_segment(c, kMemBytes);
  EXPECT_EQ(r.status().err(), ENOMEM);
  EXPECT_NE(r.status().message().find("max_mapped_bytes"), std::string::npos)
      << r.status().message();
  // Closing a session gives all of it back.
  dev_.close_session(a_.s);
  EXPECT_TRUE(try_segment(c, kMemBytes).is_ok());
}

TEST_F(SegmentQuotaTest, ASegmentIsReleasedOnlyWhenNoMrUsesIt) {
  const uint32_t seg = b_.s->segments.begin()->first;  // mb_'s MR lies in it
  EXPECT_EQ(dev_.dereg_segment(*b_.s, seg).err(), EBUSY);
  // A second MR in the same segment (two extents of it): still busy after the first goes.
  RegMrReq req = mr_req(b_.pd, kAccess, mb_.addr, kMemBytes, seg);
  req.num_extents = 2;
  req.extents[0] = MrExtent{0, 4096, 0, seg, 0};
  req.extents[1] = MrExtent{4096, kMemBytes - 4096, 4096, seg, 0};
  auto mr2 = dev_.reg_mr(*b_.s, req);
  ASSERT_TRUE(mr2.is_ok()) << mr2.status().message();
  ASSERT_TRUE(dev_.dereg_mr(*b_.s, mb_.mr.handle));
  EXPECT_EQ(dev_.dereg_segment(*b_.s, seg).err(), EBUSY);
  ASSERT_TRUE(dev_.dereg_mr(*b_.s, mr2->handle));
  ASSERT_TRUE(dev_.dereg_segment(*b_.s, seg));
  EXPECT_EQ(segments_of(b_), 0u);
  EXPECT_EQ(dev_.dereg_segment(*b_.s, seg).err(), EINVAL) << "released already";
  EXPECT_EQ(dev_.reg_mr(*b_.s, mr_req(b_.pd, kAccess, mb_.addr, 4096, seg)).status().err(), EINVAL);
  // Its quota is back: b may hold 3 again.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(try_segment(b_, kMemBytes).is_ok()) << i;
  // Another session's handle names nothing here.
  EXPECT_EQ(dev_.dereg_segment(*a_.s, b_.s->segments.begin()->first).err(), EINVAL);
}

// A memfd whose pages a guest can take away from under the backend's mapping (hugetlbfs: punch
// the page out, let another process take the free huge page; the backend's next access is a
// SIGBUS), or a descriptor that is no memfd at all, is no segment.
TEST_F(DeviceTest, OnlyTmpfsMemfdsAreSegments) {
  UniqueFd huge(::memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB));
  if (huge.valid()) {
    // Sizing a hugetlb file reserves nothing: no huge page is needed to be refused.
    ASSERT_EQ(::ftruncate(huge.get(), 2 << 20), 0);
    ASSERT_EQ(::fcntl(huge.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
    auto r = dev_.reg_segment(*a_.s, RegSegmentReq{2 << 20}, std::move(huge));
    EXPECT_EQ(r.status().err(), EINVAL);
    EXPECT_NE(r.status().message().find("hugetlbfs"), std::string::npos) << r.status().message();
  } else {
    ADD_FAILURE() << "memfd_create(MFD_HUGETLB): " << std::strerror(errno) << " (no hugetlbfs?)";
  }
  UniqueFd efd(::eventfd(0, EFD_CLOEXEC));
  auto r = dev_.reg_segment(*a_.s, RegSegmentReq{4096}, std::move(efd));
  EXPECT_EQ(r.status().err(), EINVAL);
  EXPECT_NE(r.status().message().find("not a tmpfs memfd"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(a_.s->segments.size(), 1u) << "only the fixture's";
}

// ---- a hostile guest ----

TEST_F(DeviceTest, StolenRkeyAndQpnReachNothingOfTheVictim) {
  connect_both();
  // Mallory learns b's LID, QPN, rkey and buffer address and aims RDMA at them.
  G m = open("mallory");
  CqV mcq = cq(m, 256);
  QpV qm = qp(m, mcq, mcq);
  MemV mm = mem(m, kAccess);
  connect(m, qm, b_, qb_);
  std::memset(mb_.p(), 0x5a, kMemBytes);
  std::memset(mm.p(), 0xee, kMemBytes);
  const uint32_t ops[] = {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ, IBV_WR_ATOMIC_FETCH_AND_ADD,
                          IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_RDMA_WRITE_WITH_IMM};
  for (uint32_t op : ops) {
    const uint32_t len = (op == IBV_WR_ATOMIC_FETCH_AND_ADD || op == IBV_WR_ATOMIC_CMP_AND_SWP) ? 8 : 64;
    post_rdma(qm, op, op, mm.addr, len, mm.mr.lkey, mb_.addr, mb_.mr.rkey);
    for (int i = 0; i < 10; ++i) dev_.poll(now_ += 2'000'000'000);  // past every ACK timeout
    auto tx = drain(mcq);
    ASSERT_EQ(tx.size(), 1u) << "op " << op;
    EXPECT_EQ(tx[0].status, IBV_WC_RETRY_EXC_ERR) << "op " << op << ": b must look like nobody";
    EXPECT_TRUE(all_bytes(mb_.p(), kMemBytes, 0x5a)) << "op " << op << " touched b's memory";
    EXPECT_TRUE(all_bytes(mm.p(), kMemBytes, 0xee)) << "op " << op << " brought b's bytes back";
    // Start over: RESET, then connect again.
    ASSERT_TRUE(modify(m, qm, IBV_QP_STATE, reset_attr()));
    qm.sq_prod = qm.sq->producer.load();
    connect(m, qm, b_, qb_);
  }
  EXPECT_TRUE(drain(bcq_).empty());
  EXPECT_EQ(state(b_, qb_), IBV_QPS_RTS) << "the victim's QP is untouched";
}

TEST_F(DeviceTest, AConnectedPeerCannotUseKeysOfAnotherSessionOrPd) {
  // b lets mallory connect (b's QP names mallory), but b's memory is registered in another
  // session of b, and a second MR of this session is in another PD than the QP.
  G m = open("mallory");
  CqV mcq = cq(m, 64);
  QpV qm = qp(m, mcq, mcq);
  MemV mm = mem(m, kAccess);
  connect(m, qm, b_, qb_);
  connect(b_, qb_, m, qm);
  G b2 = open("b");  // another session of guest b: same key namespace, other PDs
  MemV other_session = mem(b2, kAccess | IBV_ACCESS_REMOTE_READ);
  const uint32_t pd_b = b_.pd;
  b_.pd = dev_.alloc_pd(*b_.s).value();
  MemV other_pd = mem(b_, kAccess | IBV_ACCESS_REMOTE_READ);
  b_.pd = pd_b;
  std::memset(other_session.p(), 0x11, kMemBytes);
  std::memset(other_pd.p(), 0x22, kMemBytes);
  for (const MemV* target : {&other_session, &other_pd}) {
    post_rdma(qm, 1, IBV_WR_RDMA_WRITE, mm.addr, 64, mm.mr.lkey, target->addr, target->mr.rkey);
    dev_.poll(now_);
    auto tx = drain(mcq);
    ASSERT_EQ(tx.size(), 1u);
    EXPECT_EQ(tx[0].status, IBV_WC_REM_ACCESS_ERR);
    ASSERT_TRUE(modify(m, qm, IBV_QP_STATE, reset_attr()));
    qm.sq_prod = qm.sq->producer.load();
    connect(m, qm, b_, qb_);
  }
  EXPECT_TRUE(all_bytes(other_session.p(), kMemBytes, 0x11));
  EXPECT_TRUE(all_bytes(other_pd.p(), kMemBytes, 0x22));
}

TEST_F(DeviceTest, ForgedWqeWithAnotherGuestsLkeyReadsNothing) {
  connect_both();
  // a writes a WQE straight into its SQ ring naming b's lkey and b's address as its source.
  std::memset(mb_.p(), 0x77, kMemBytes);
  post_recv(qb_, 1, mb_.addr + 4096, 64, mb_.mr.lkey);
  post_send(qa_, 1, mb_.addr, 64, mb_.mr.lkey);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_TRUE(drain(bcq_).empty()) << "nothing was sent";
  EXPECT_TRUE(all_bytes(mb_.p(), kMemBytes, 0x77));
}

TEST_F(DeviceTest, MrOfOnePdIsRefusedToAQpOfAnother) {
  connect_both();
  // Same guest, same session: a's second PD holds an MR; a's QP (first PD) names it.
  const uint32_t pd_a = a_.pd;
  a_.pd = dev_.alloc_pd(*a_.s).value();
  MemV other = mem(a_);
  a_.pd = pd_a;
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 1, other.addr, 64, other.mr.lkey);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_TRUE(drain(bcq_).empty());
}

// ---- a guest that dies ----

TEST_F(DeviceTest, PeersOfADeadGuestGoToErrorWithQpFatal) {
  connect_both();
  // A third guest's QP connected to nobody of b stays as it is.
  G c = open("c");
  CqV ccq = cq(c);
  QpV qc = qp(c, ccq, ccq);
  connect(c, qc, a_, qa_);  // names a, but a's QP is connected to b: not a peer of b
  post_recv(qa_, 7, ma_.addr, 64, ma_.mr.lkey);
  dev_.close_session(b_.s);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
  auto ev = async_events(a_);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0], std::make_pair(uint32_t{IBV_EVENT_QP_FATAL}, qa_.handle));
  dev_.poll(now_);
  auto rx = drain(arcq_);
  ASSERT_EQ(rx.size(), 1u) << "a's posted receive is flushed";
  EXPECT_EQ(rx[0].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(state(c, qc), IBV_QPS_RTS);
  EXPECT_TRUE(async_events(c).empty());
}

// Without TCP a destination that is no guest here is known to no backend this one reaches:
// the modify_qp answer says so (kAnswerDestUnknown) and the library tells the program.
TEST_F(DeviceTest, ADestinationNoReachableBackendKnowsIsSaidAtRtr) {
  connect_rtr(b_, qb_, a_, qa_);
  EXPECT_FALSE(dev_.destination_unknown(*b_.s, qb_.handle)) << "a is a guest here";
  G nobody;
  nobody.hello.lid = 0x6faa;
  connect_rtr(a_, qa_, nobody, qb_);
  EXPECT_TRUE(dev_.destination_unknown(*a_.s, qa_.handle));
  EXPECT_FALSE(dev_.destination_unknown(*a_.s, 999)) << "no such QP";
}

// ---- fairness ----

TEST_F(DeviceTest, EveryGuestGetsTheSameShareOfAPassHoweverManyQpsItHas) {
  // Guest h has 4 QPs with full send queues, guest v one; all write into b's memory.
  G h = open("hungry"), v = open("victim");
  CqV hcq = cq(h, 2048), vcq = cq(v, 2048), sink = cq(b_, 2048);
  MemV mh = mem(h), mv = mem(v);
  auto deep_qp = [&](G& g, CqV& c) {
    CreateQpReq req = qp_req(g, c, c);
    req.caps.max_send_wr = 256;
    return create_qp(g, req);
  };
  std::vector<QpV> hq, bq;
  for (int i = 0; i < 5; ++i) bq.push_back(create_qp(b_, qp_req(b_, sink, sink)));
  for (int i = 0; i < 4; ++i) {
    hq.push_back(deep_qp(h, hcq));
    connect(h, hq.back(), b_, bq[i]);
    connect(b_, bq[i], h, hq.back());
  }
  QpV vq = deep_qp(v, vcq);
  connect(v, vq, b_, bq[4]);
  connect(b_, bq[4], v, vq);
  for (QpV& q : hq) {
    for (int i = 0; i < 256; ++i)
      post_rdma(q, i, IBV_WR_RDMA_WRITE, mh.addr, 8, mh.mr.lkey, mb_.addr, mb_.mr.rkey);
  }
  for (int i = 0; i < 256; ++i)
    post_rdma(vq, i, IBV_WR_RDMA_WRITE, mv.addr, 8, mv.mr.lkey, mb_.addr, mb_.mr.rkey);
  for (int pass = 1; pass <= 4; ++pass) {
    dev_.poll(now_);
    const size_t nh = drain(hcq).size(), nv = drain(vcq).size();
    EXPECT_EQ(nh, nv) << "pass " << pass << ": hungry (4 QPs) did " << nh << ", victim (1 QP) " << nv;
    EXPECT_GT(nv, 0u);
  }
}

// ---- regressions ----

// fuzz_ring: a state far outside ibv_qp_state was cast to the enum before it was checked (UB).
TEST_F(DeviceTest, ModifyToAStateOutsideTheEnumIsEinval) {
  QpAttr a{};
  a.qp_state = 1164928622;
  EXPECT_EQ(modify(a_, qa_, IBV_QP_STATE, a).err(), EINVAL);
  EXPECT_TRUE(modify(a_, qa_, 0, a)) << "without IBV_QP_STATE the field is not looked at";
  EXPECT_EQ(state(a_, qa_), IBV_QPS_RESET);
}

// An MR of two extents that end 4 bytes into a word: an aligned atomic on that word used to run
// one CPU atomic on the second extent's last 4 bytes plus 4 bytes past its segment's mapping.
TEST_F(DeviceTest, AtomicOnAWordSplitAcrossTwoSegmentsIsRefused) {
  connect_both();
  uint32_t seg[2];
  MappedRegion map[2];
  for (int i = 0; i < 2; ++i) {
    UniqueFd fd = make_sealed_memfd("split", 4096).value();
    map[i] = MappedRegion::map_shared(fd.get(), 4096);
    std::memset(map[i].data(), 0x33, 4096);
    seg[i] = dev_.reg_segment(*b_.s, RegSegmentReq{4096}, std::move(fd)).value();
  }
  RegMrReq req{};
  req.pd = b_.pd;
  req.access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
  req.addr = req.iova = 0x100000;
  req.length = 4096;
  req.num_extents = 2;
  req.extents[0] = MrExtent{0, 4092, 0, seg[0], 0};
  req.extents[1] = MrExtent{4092, 4, 4092, seg[1], 0};
  const uint32_t rkey = dev_.reg_mr(*b_.s, req).value().rkey;
  QpAttr a{};
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
  ASSERT_TRUE(dev_.modify_qp(*b_.s, ModifyQpReq{qb_.handle, IBV_QP_ACCESS_FLAGS, a}));
  post_rdma(qa_, 1, IBV_WR_ATOMIC_FETCH_AND_ADD, ma_.addr, 8, ma_.mr.lkey, 0x100000 + 4088, rkey);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_INV_REQ_ERR);
  EXPECT_TRUE(all_bytes(map[0].data(), 4096, 0x33));
  EXPECT_TRUE(all_bytes(map[1].data(), 4096, 0x33));
  // A word inside one extent still works.
  ASSERT_TRUE(modify(a_, qa_, IBV_QP_STATE, reset_attr()));
  qa_.sq_prod = qa_.sq->producer.load();
  connect(a_, qa_, b_, qb_);
  post_rdma(qa_, 2, IBV_WR_ATOMIC_FETCH_AND_ADD, ma_.addr, 8, ma_.mr.lkey, 0x100000 + 8, rkey);
  dev_.poll(now_);
  tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(map[0].data()[8], 0x34);
}

// An aligned iova on a misaligned host word: the MR starts 4 bytes into its segment, so iova
// 0x200008 is the backend's map + 12. A CPU atomic there would be a split lock; it fails as a
// misaligned iova does (IBV_WC_REM_INV_REQ_ERR) and touches nothing.
TEST_F(DeviceTest, AtomicOnAMisalignedHostAddressIsRefusedLikeAMisalignedIova) {
  connect_both();
  UniqueFd fd = make_sealed_memfd("odd", 4096).value();
  MappedRegion map = MappedRegion::map_shared(fd.get(), 4096);
  std::memset(map.data(), 0x33, 4096);
  const uint32_t seg = dev_.reg_segment(*b_.s, RegSegmentReq{4096}, std::move(fd)).value();
  RegMrReq req{};
  req.pd = b_.pd;
  req.access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
  req.addr = req.iova = 0x200000;
  req.length = 64;
  req.num_extents = 1;
  req.extents[0] = MrExtent{0, 64, 4, seg, 0};
  const uint32_t rkey = dev_.reg_mr(*b_.s, req).value().rkey;
  QpAttr a{};
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
  ASSERT_TRUE(dev_.modify_qp(*b_.s, ModifyQpReq{qb_.handle, IBV_QP_ACCESS_FLAGS, a}));
  for (uint64_t raddr : {0x200000ull + 8, 0x200000ull + 4}) {  // aligned iova, then misaligned
    for (uint32_t op : {IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_ATOMIC_CMP_AND_SWP}) {
      SCOPED_TRACE(::testing::Message() << "remote_addr " << std::hex << raddr << " op " << op);
      ASSERT_TRUE(modify(a_, qa_, IBV_QP_STATE, reset_attr()));
      qa_.sq_prod = qa_.sq->producer.load();
      connect(a_, qa_, b_, qb_);
      post_rdma(qa_, 1, op, ma_.addr, 8, ma_.mr.lkey, raddr, rkey);
      dev_.poll(now_);
      auto tx = drain(acq_);
      ASSERT_EQ(tx.size(), 1u);
      EXPECT_EQ(tx[0].status, IBV_WC_REM_INV_REQ_ERR);
      EXPECT_EQ(state(a_, qa_), IBV_QPS_ERR);
      EXPECT_TRUE(all_bytes(map.data(), 4096, 0x33));
    }
  }
}

// The epoch pages a direct grant hands out read-only: reopening one read-write through
// /proc/self/fd (what a guest can do with any descriptor it holds) gives no way to write it, so
// a guest cannot move its epoch back and keep a revoked grant alive.
TEST_F(DeviceTest, EpochDescriptorsStayReadOnlyWhenReopenedReadWrite) {
  dev_.set_direct(true);
  dev_.set_direct_trust(true, {});  // one uid is enough (direct_trust = "uid")
  a_.s->uid = b_.s->uid = ::getuid();
  connect_both();
  std::vector<UniqueFd> fds;
  auto r = dev_.direct_grant(*a_.s, qa_.handle, fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_GE(fds.size(), 5u);
  for (int i : {3, 4}) {  // kDirectGrant's order: my epoch, the peer's epoch
    SCOPED_TRACE(i);
    MappedRegion ro = MappedRegion::map_readonly(fds[i].get(), sizeof(EpochPage));
    ASSERT_TRUE(ro.valid());
    const auto* page = reinterpret_cast<const EpochPage*>(ro.data());
    const uint64_t before = page->epoch.load();
    UniqueFd rw(::open(fmt::format("/proc/self/fd/{}", fds[i].get()).c_str(), O_RDWR));
    if (rw.valid()) {
      EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw.get(), 0), MAP_FAILED);
      EXPECT_EQ(errno, EPERM);
      const uint64_t zero = 0;
      EXPECT_EQ(::pwrite(rw.get(), &zero, sizeof(zero), 0), -1);
      EXPECT_EQ(errno, EPERM);
    }
    EXPECT_NE(::mprotect(ro.data(), 4096, PROT_READ | PROT_WRITE), 0);
    // The backend still moves it: a's on a's QP leaving RTS, b's on b's MR going.
    if (i == 3)
      ASSERT_TRUE(modify(a_, qa_, IBV_QP_STATE, reset_attr()));
    else
      ASSERT_TRUE(dev_.dereg_mr(*b_.s, mb_.mr.handle));
    EXPECT_GT(page->epoch.load(), before);
  }
}

}  // namespace
}  // namespace vrdma::engine::devtest
