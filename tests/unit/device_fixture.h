// Test fixture for the device model: plays two guests ("a" and "b") against an in-process
// engine::Device, mapping the rings and memory it hands out, posting WQEs and reading CQEs.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "common/memfd.h"
#include "engine/device.h"
#include "proto/device_state.h"

namespace vrdma::engine::devtest {

using namespace vrdma::proto;

struct G {  ///< one guest session, as its library sees it
  Session* s = nullptr;
  Device* dev = nullptr;  ///< the backend serving it (the fixture's dev_ unless told otherwise)
  HelloResp hello{};
  int async_fd = -1;
  uint32_t pd = 0;
};
struct CqV {
  uint32_t handle = 0, size = 0, cons = 0;
  MappedRegion map;
  RingHeader* hdr = nullptr;
  Cqe* e = nullptr;
  const CqeStamp* st = nullptr;  ///< a stamped CQ's (proto/ring.h)
};
struct QpV {
  uint32_t handle = 0, qpn = 0, sq_size = 0, rq_size = 0, sq_prod = 0, rq_prod = 0;
  MappedRegion map;
  RingHeader *sq = nullptr, *rq = nullptr;
  SendWqe* sqe = nullptr;
  RecvWqe* rqe = nullptr;
};
struct MemV {
  MappedRegion map;
  RegMrResp mr{};
  uint64_t addr = 0;  ///< guest address of byte 0 (our mapping's address)
  uint32_t seg = 0;   ///< the segment it lies in
  uint8_t* p() const { return map.data(); }
};

/// Duplicates of an export's descriptors, as the target of a move (or a keeper) receives them.
inline std::vector<UniqueFd> dup_all(const std::vector<int>& fds) {
  std::vector<UniqueFd> out;
  for (int f : fds) out.emplace_back(::fcntl(f, F_DUPFD_CLOEXEC, 0));
  return out;
}

/// Each QP of blob `doc` (CBOR decoded) as a version 9 blob had it: what is in flight as copies
/// of its WQEs ("unacked"), taken from the send queue `sq(qp entry)` returns (nullptr: the QP
/// must have nothing in flight).
template <typename SqOf>
void in_flight_as_version_9(nlohmann::json& doc, SqOf sq) {
  for (auto& js : doc["sessions"]) {
    for (auto& jq : js["qps"]) {
      const auto& b = jq["in_flight"].get_binary();
      nlohmann::json unacked = nlohmann::json::array();
      const size_t n = b.size() / sizeof(proto::InFlight);
      const SendWqe* ring = n ? sq(jq) : nullptr;
      EXPECT_TRUE(n == 0 || ring) << "QP " << jq["qpn"] << " has WQEs in flight";
      for (size_t i = 0; i < n && ring; ++i) {
        proto::InFlight f;
        std::memcpy(&f, b.data() + i * sizeof(f), sizeof(f));
        const uint32_t slot = (jq["sq_cons"].get<uint32_t>() + i) & (jq["sq_size"].get<uint32_t>() - 1);
        const auto* w = reinterpret_cast<const uint8_t*>(&ring[slot]);
        unacked.push_back({nlohmann::json::binary(std::vector<uint8_t>(w, w + sizeof(SendWqe))),
                           f.psn, f.len, f.has_result != 0});
      }
      jq.erase("in_flight");
      jq["unacked"] = std::move(unacked);
    }
  }
}

constexpr uint64_t kMemBytes = 8192;
constexpr uint32_t kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

class DeviceTest : public ::testing::Test {
 protected:
  G open(const char* name, Device* dev = nullptr) {
    HelloReq req{};
    std::snprintf(req.guest, sizeof(req.guest), "%s", name);
    req.pid = 4242;
    G g;
    g.dev = dev ? dev : &dev_;
    FdList fds;
    auto r = g.dev->open_session(req, cred_, g.hello, fds);
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    g.s = r.value();
    EXPECT_EQ(fds.size(), 3u);
    g.async_fd = fds.at(2);
    // Every session starts with the port-active event.
    auto ev = async_events(g);
    EXPECT_EQ(ev.size(), 1u);
    if (!ev.empty()) {
      EXPECT_EQ(ev[0], std::make_pair(uint32_t{IBV_EVENT_PORT_ACTIVE}, 1u));
    }
    g.pd = g.dev->alloc_pd(*g.s).value();
    return g;
  }
  CqV cq(G& g, uint32_t cqe = 64, uint32_t stamps = 0, uint32_t channel = kNone) {
    UniqueFd fd;
    auto r = g.dev->create_cq(*g.s, CreateCqReq{cqe, channel, 0, stamps}, fd);
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    CqV c;
    c.handle = r->handle;
    c.size = r->cqe + 1;
    c.map = MappedRegion::map_shared(fd.get(), r->ring_bytes);
    c.hdr = reinterpret_cast<RingHeader*>(c.map.data());
    c.e = ring_entries<Cqe>(c.hdr);
    if (stamps) c.st = cq_stamps(c.hdr, c.size);
    return c;
  }
  /// Creates a QP and maps its rings as the guest library would.
  QpV create_qp(G& g, const CreateQpReq& req) {
    UniqueFd fd;
    auto r = g.dev->create_qp(*g.s, req, fd);
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    QpV q;
    q.handle = r->handle;
    q.qpn = r->qpn;
    q.sq_size = r->caps.max_send_wr;
    q.rq_size = r->caps.max_recv_wr;
    q.map = MappedRegion::map_shared(fd.get(), r->ring_bytes);
    q.sq = reinterpret_cast<RingHeader*>(q.map.data());
    q.rq = reinterpret_cast<RingHeader*>(q.map.data() + r->rq_offset);
    q.sqe = ring_entries<SendWqe>(q.sq);
    q.rqe = ring_entries<RecvWqe>(q.rq);
    return q;
  }
  /// A QP request on g's PD: RC unless told otherwise, 8 WRs, 2 SGEs, 64 B inline.
  static CreateQpReq qp_req(const G& g, const CqV& scq, const CqV& rcq,
                            ibv_qp_type type = IBV_QPT_RC, uint32_t srq = kNone) {
    CreateQpReq req{};
    req.pd = g.pd;
    req.send_cq = scq.handle;
    req.recv_cq = rcq.handle;
    req.srq = srq;
    req.qp_type = static_cast<uint8_t>(type);
    req.caps = QpCaps{8, 8, 2, 2, 64, 0};
    return req;
  }
  QpV qp(G& g, const CqV& scq, const CqV& rcq) { return create_qp(g, qp_req(g, scq, rcq)); }
  /// A UD QP on `cq` (both queues) with `qkey`, in RTS.
  QpV ud_qp(G& g, const CqV& cq, uint32_t qkey) {
    QpV q = create_qp(g, qp_req(g, cq, cq, IBV_QPT_UD));
    QpAttr a{};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qkey = qkey;
    EXPECT_TRUE(modify(g, q, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, a));
    a = {};
    a.qp_state = IBV_QPS_RTR;
    EXPECT_TRUE(modify(g, q, IBV_QP_STATE, a));
    a.qp_state = IBV_QPS_RTS;
    EXPECT_TRUE(modify(g, q, IBV_QP_STATE | IBV_QP_SQ_PSN, a));
    return q;
  }
  /// An MR of `len` bytes at `addr` (iova == addr), all in segment `seg` from its start.
  static RegMrReq mr_req(uint32_t pd, uint32_t access, uint64_t addr, uint64_t len, uint32_t seg) {
    RegMrReq req{};
    req.pd = pd;
    req.access = access;
    req.addr = req.iova = addr;
    req.length = len;
    req.num_extents = 1;
    req.extents[0] = MrExtent{0, len, 0, seg, 0};
    return req;
  }
  MemV mem(G& g, uint32_t access = kAccess) {
    MemV m;
    UniqueFd fd = make_sealed_memfd("test-mem", kMemBytes).value();
    m.map = MappedRegion::map_shared(fd.get(), kMemBytes);
    auto seg = g.dev->reg_segment(*g.s, RegSegmentReq{kMemBytes}, std::move(fd));
    EXPECT_TRUE(seg.is_ok()) << seg.status().message();
    m.addr = reinterpret_cast<uint64_t>(m.map.data());
    m.seg = seg.value();
    auto mr = g.dev->reg_mr(*g.s, mr_req(g.pd, access, m.addr, kMemBytes, seg.value()));
    EXPECT_TRUE(mr.is_ok()) << mr.status().message();
    m.mr = mr.value();
    return m;
  }
  Status modify(G& g, QpV& q, uint32_t mask, QpAttr a) {
    return g.dev->modify_qp(*g.s, ModifyQpReq{q.handle, mask, a});
  }
  // RESET -> INIT -> RTR -> RTS, pointing `q` at the peer (lid, qpn).
  void connect(G& g, QpV& q, const G& peer, const QpV& pq, uint8_t rnr_retry = 7,
               uint8_t min_rnr_timer = 1) {
    connect_rtr(g, q, peer, pq, min_rnr_timer);
    to_rts(g, q, rnr_retry);
  }
  // RESET -> INIT -> RTR only.
  void connect_rtr(G& g, QpV& q, const G& peer, const QpV& pq, uint8_t min_rnr_timer = 1) {
    QpAttr a{};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = qp_access_;
    ASSERT_TRUE(modify(g, q, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, a));
    a = {};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dlid = static_cast<uint16_t>(peer.hello.lid);
    a.ah_port_num = 1;
    a.dest_qp_num = pq.qpn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = min_rnr_timer;
    ASSERT_TRUE(modify(g, q, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                 IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, a));
  }
  // RTR -> RTS.
  void to_rts(G& g, QpV& q, uint8_t rnr_retry = 7) {
    QpAttr a{};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = rnr_retry;
    a.max_rd_atomic = 1;
    ASSERT_TRUE(modify(g, q, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                 IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC, a));
  }
  /// An SRQ of `g` as its library maps it, its QPs, and its receives.
  struct SrqV {
    uint32_t handle = 0;
    uint32_t size = 0;
    uint32_t prod = 0;
    MappedRegion map;
    RingHeader* hdr = nullptr;
    RecvWqe* e = nullptr;
  };
  SrqV srq(G& g, uint32_t max_wr, uint32_t limit) {
    UniqueFd fd;
    auto r = dev_.create_srq(*g.s, CreateSrqReq{g.pd, 0, SrqAttr{max_wr, 2, limit, 0}}, fd);
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    SrqV q;
    q.handle = r->handle;
    q.size = r->attr.max_wr;
    q.map = MappedRegion::map_shared(fd.get(), r->ring_bytes);
    q.hdr = reinterpret_cast<RingHeader*>(q.map.data());
    q.e = ring_entries<RecvWqe>(q.hdr);
    return q;
  }
  QpV srq_qp(G& g, const CqV& cq, const SrqV& s) {
    CreateQpReq req = qp_req(g, cq, cq, IBV_QPT_RC, s.handle);
    req.caps.max_recv_wr = 0;  // receive caps are ignored with an SRQ
    req.caps.max_recv_sge = 0;
    return create_qp(g, req);
  }
  void post_srq(SrqV& s, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey) {
    post_one_recv(s.e, s.size, s.prod, *s.hdr, wr_id, Sge{addr, len, lkey});
  }
  void post_recv(QpV& q, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey) {
    post_one_recv(q.rqe, q.rq_size, q.rq_prod, *q.rq, wr_id, Sge{addr, len, lkey});
  }
  /// One receive of one SGE into a ring of `size` WQEs, as a library posts it.
  static void post_one_recv(RecvWqe* ring, uint32_t size, uint32_t& prod, RingHeader& h,
                            uint64_t wr_id, Sge sge) {
    RecvWqe w{};
    w.wr_id = wr_id;
    w.num_sge = 1;
    w.sge[0] = sge;
    ring[prod & (size - 1)] = w;
    h.producer.store(++prod, std::memory_order_release);
  }
  /// Posts one RDMA WRITE/READ/atomic naming a remote address and key (atomics: add 1, or
  /// compare with 1 and swap in 0x4141...).
  static void post_rdma(QpV& q, uint64_t wr_id, uint32_t opcode, uint64_t laddr, uint32_t len,
                        uint32_t lkey, uint64_t raddr, uint32_t rkey) {
    SendWqe w{};
    w.wr_id = wr_id;
    w.opcode = opcode;
    w.send_flags = IBV_SEND_SIGNALED;
    w.num_sge = 1;
    w.sge[0] = Sge{laddr, len, lkey};
    w.remote_addr = raddr;
    w.rkey = rkey;
    w.compare_add = 1;
    w.swap = 0x4141414141414141ull;
    q.sqe[q.sq_prod & (q.sq_size - 1)] = w;
    q.sq->producer.store(++q.sq_prod, std::memory_order_release);
  }
  /// A bind WQE (proto/ring.h's layout) of window `mw` to [addr, addr + len) of the MR `lkey`.
  static void post_bind(QpV& q, uint64_t wr_id, uint32_t mw, uint32_t rkey, uint32_t lkey,
                        uint64_t addr, uint64_t len, uint32_t access) {
    SendWqe w{};
    w.wr_id = wr_id;
    w.opcode = IBV_WR_BIND_MW;
    w.send_flags = IBV_SEND_SIGNALED;
    w.rkey = rkey;
    w.ud_remote_qpn = mw;
    w.remote_addr = addr;
    w.compare_add = len;
    w.swap = pack_bind(lkey, access);
    q.sqe[q.sq_prod & (q.sq_size - 1)] = w;
    q.sq->producer.store(++q.sq_prod, std::memory_order_release);
  }
  /// A UD SEND (or `op`) of [addr, addr + len) to QP `qpn` of the guest `d` names.
  void post_ud(QpV& q, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey, const UdDest& d,
               uint32_t qpn, uint32_t qkey, uint32_t op = IBV_WR_SEND) {
    SendWqe w{};
    w.wr_id = wr_id;
    w.opcode = op;
    w.send_flags = IBV_SEND_SIGNALED;
    w.imm_data = htonl(0x1234);
    w.num_sge = 1;
    w.sge[0] = Sge{addr, len, lkey};
    pack_ud_dest(w, d);
    w.ud_remote_qpn = qpn;
    w.ud_remote_qkey = qkey;
    q.sqe[q.sq_prod & (q.sq_size - 1)] = w;
    q.sq->producer.store(++q.sq_prod, std::memory_order_release);
  }
  void post_send(QpV& q, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey,
                 uint32_t flags = IBV_SEND_SIGNALED, uint32_t opcode = IBV_WR_SEND,
                 uint32_t imm = 0) {
    SendWqe w{};
    w.wr_id = wr_id;
    w.opcode = opcode;
    w.send_flags = flags;
    w.imm_data = imm;
    w.num_sge = 1;
    w.sge[0] = Sge{addr, len, lkey};
    q.sqe[q.sq_prod & (q.sq_size - 1)] = w;
    q.sq->producer.store(++q.sq_prod, std::memory_order_release);
  }
  static std::vector<Cqe> drain(CqV& c) {
    std::vector<Cqe> out;
    const uint32_t p = c.hdr->producer.load(std::memory_order_acquire);
    for (; c.cons != p; ++c.cons) out.push_back(c.e[c.cons & (c.size - 1)]);
    c.hdr->consumer.store(c.cons, std::memory_order_release);
    return out;
  }
  /// A type 2 window of `g` over [off, off + len) of `m`, bound (with the next key) through
  /// `q`, whose completions go to `cq`: the allocation and the bound rkey (0, with a failure,
  /// when the allocation failed). The bind's completion is left on `cq`.
  std::pair<AllocMwResp, uint32_t> type2_window(G& g, QpV& q, const MemV& m, uint64_t off,
                                                uint64_t len, uint32_t access) {
    auto mw = g.dev->alloc_mw(*g.s, AllocMwReq{g.pd, IBV_MW_TYPE_2});
    EXPECT_TRUE(mw.is_ok()) << mw.status().message();
    if (!mw.is_ok()) return {};
    const uint32_t rkey = ibv_inc_rkey(mw->rkey);
    post_bind(q, 1, mw->handle, rkey, m.mr.lkey, m.addr + off, len, access);
    return {mw.value(), rkey};
  }
  /// One poll of the device, then the one completion `c` should hold (GENERAL_ERR, and a
  /// failure, when it holds another number).
  Cqe poll_one(CqV& c) {
    dev_.poll(now_);
    auto got = drain(c);
    EXPECT_EQ(got.size(), 1u);
    if (got.size() == 1) return got[0];
    Cqe none{};
    none.status = IBV_WC_GENERAL_ERR;
    return none;
  }
  static std::vector<std::pair<uint32_t, uint32_t>> async_events(const G& g) {
    std::vector<std::pair<uint32_t, uint32_t>> out;
    uint32_t ev[2];
    while (::read(g.async_fd, ev, sizeof(ev)) == sizeof(ev)) out.emplace_back(ev[0], ev[1]);
    return out;
  }
  ibv_qp_state state(G& g, const QpV& q) {
    return static_cast<ibv_qp_state>(g.dev->query_qp(*g.s, q.handle).value().attr.qp_state);
  }
  nlohmann::json totals() { return nlohmann::json::parse(dev_.status_json())["totals"]; }

  // The common set-up: guests a and b, one connected RC QP each, memory registered on both.
  void SetUp() override { make_pair(cred_.uid, cred_.uid); }
  /// The common set-up's guests, a opened by uid `uid_a` and b by `uid_b`.
  void make_pair(uint32_t uid_a, uint32_t uid_b) {
    cred_.uid = uid_a;
    a_ = open("a");
    cred_.uid = uid_b;
    b_ = open("b");
    acq_ = cq(a_);
    arcq_ = cq(a_);
    bcq_ = cq(b_);
    qa_ = qp(a_, acq_, arcq_);
    qb_ = qp(b_, bcq_, bcq_);
    ma_ = mem(a_);
    mb_ = mem(b_);
  }
  void connect_both(uint8_t a_rnr_retry = 7) {
    connect(a_, qa_, b_, qb_, a_rnr_retry);
    connect(b_, qb_, a_, qa_);
  }

  /// The quotas the next fixture's Device gets (a suite sets it in SetUpTestSuite).
  static inline Quotas next_quotas_{};
  Device dev_{next_quotas_};
  /// Who open() says is at the other end of the socket (SO_PEERCRED, as the server passes it).
  PeerCred cred_{4242, static_cast<uint32_t>(::geteuid()), static_cast<uint32_t>(::getegid())};
  G a_, b_;
  CqV acq_, arcq_, bcq_;
  QpV qa_, qb_;
  MemV ma_, mb_;
  uint64_t now_ = 1'000'000'000;
  uint32_t qp_access_ = kAccess;  ///< qp_access_flags connect_rtr gives
};

}  // namespace vrdma::engine::devtest
