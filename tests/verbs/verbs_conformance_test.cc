// The verbs conformance suite (issue 3): what the IB spec says a device does, asserted through
// our libibverbs.so.1 between two processes in two guests (peer.h): every opcode on every QP
// type that allows it with the data and completion fields checked, scatter/gather lists up to
// max_sge, inline data up to max_inline_data, each error of the spec's completion semantics
// (local protection, remote access, RNR retry, receive too small, flush, queue depth, opcode
// vs QP type), fetch-and-adds from four QPs of another process, and the async events; and
// (issue 24) ibv_rereg_mr, ibv_resize_cq, device memory, memory windows, ODP and XRC. Run on
// every path: the ring, the direct path (direct.), the backend's TCP path (tcp.) and, with the
// peer on another backend and the libraries talking to each other, e2e.conformance_remote.
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>

#include <atomic>
#include <thread>

#include "peer.h"
#include "verbs/internal.h"
#include "verbs/remote.h"
#include "verbs/remote_impl.h"
#include "verbs_fixture.h"

namespace {

using vrdma::test::kAllAccess;
using vrdma::test::Peer;
using vrdma::test::PeerQp;
using vrdma::test::Piece;
using vrdma::test::QpPath;
using Clock = std::chrono::steady_clock;

/// Whether QP `qp` talks to its peer's library itself (the direct path across backends), which
/// then answers our requests: e2e.conformance_remote's run.
bool library_path(ibv_qp* qp) {
  const vrdma::verbs::VQp& v = *vrdma::verbs::to_vqp(qp);
  return v.remote && v.remote->active.load();
}

/// Whether the peer's requests to QP `qp` come from its library (across backends) and some
/// were executed by ours.
bool peer_requests_direct(ibv_qp* qp) {
  const vrdma::verbs::VQp& v = *vrdma::verbs::to_vqp(qp);
  const vrdma::verbs::Conn* c = v.remote ? v.remote->in_raw.load() : nullptr;
  return c && c->executed.load() > 0;
}

/// An SRQ of ours and the RC QPs on it (all on `cq`), destroyed QPs first.
struct OurSrq {
  ibv_srq* srq = nullptr;
  std::vector<ibv_qp*> qps;
  OurSrq(ibv_pd* pd, uint32_t max_wr) {
    ibv_srq_init_attr sa{};
    sa.attr.max_wr = max_wr;
    sa.attr.max_sge = 1;
    srq = ibv_create_srq(pd, &sa);
    EXPECT_NE(srq, nullptr) << std::strerror(errno);
  }
  ~OurSrq() {
    for (ibv_qp* q : qps) EXPECT_EQ(ibv_destroy_qp(q), 0);
    if (srq) {
      EXPECT_EQ(ibv_destroy_srq(srq), 0);
    }
  }
  ibv_qp* qp(ibv_pd* pd, ibv_cq* cq) {
    ibv_qp_init_attr ia{};
    ia.send_cq = ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.srq = srq;
    ia.cap = {8, 0, 1, 1, 0};
    ibv_qp* q = ibv_create_qp(pd, &ia);
    EXPECT_NE(q, nullptr) << std::strerror(errno);
    if (q) qps.push_back(q);
    return q;
  }
  int post(uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey) const {
    return vrdma::test::post_srq_recv(srq, wr_id, addr, len, lkey);
  }
};

class Conformance : public vrdma::test::VerbsFixture {
 protected:
  void SetUp() override {
    VerbsFixture::SetUp();
    if (HasFatalFailure()) return;
    // e2e.conformance_remote runs the suite with the peer on another backend, with the direct
    // path between libraries on (then across_), and parts of it again with it off.
    across_ = std::getenv("VRDMA_TEST_PEER_SOCKET") != nullptr &&
              (vrdma::verbs::to_vctx(ctx_)->control_page()->features &
               vrdma::proto::kFeatureDirectRemote);
    ASSERT_TRUE(peer_.start("conformance-peer"));
    cq_ = ibv_create_cq(ctx_, 1024, nullptr, nullptr, 0);
    ASSERT_NE(cq_, nullptr);
    cqs_.push_back(cq_);
  }

  void TearDown() override {
    EXPECT_EQ(peer_.finish(), 0) << "the peer's clean-up failed";
    for (ibv_ah* ah : ahs_) EXPECT_EQ(ibv_destroy_ah(ah), 0);
    VerbsFixture::TearDown();
  }

  ibv_qp* make_qp(ibv_qp_type t, uint32_t depth = 16, uint32_t sge = 1, uint32_t inl = 0,
                  ibv_cq* cq = nullptr) {
    ibv_qp_init_attr a{};
    a.send_cq = cq ? cq : cq_;
    a.recv_cq = cq ? cq : cq_;
    a.qp_type = t;
    a.cap = {depth, depth, sge, sge, inl};
    ibv_qp* qp = ibv_create_qp(pd_, &a);
    EXPECT_NE(qp, nullptr) << std::strerror(errno);
    if (qp) qps_.push_back(qp);
    return qp;
  }

  /// Our QP of type `t` and the peer's, connected to each other (UD: both at RTS).
  struct Pair {
    ibv_qp* qp;
    PeerQp peer;
  };
  Pair pair(ibv_qp_type t, QpPath ours = {}, QpPath theirs = {}, uint32_t depth = 16,
            uint32_t sge = 1, uint32_t inl = 0) {
    Pair p{make_qp(t, depth, sge, inl), {}};
    if (p.qp) p.peer = connect_peer(p.qp, t, ours, theirs, depth, sge);
    return p;
  }

  /// A new QP of the peer's, of type `t`, and our `qp` (of any context of ours) connected to
  /// each other, both to RTS (UD: both at RTS).
  PeerQp connect_peer(ibv_qp* qp, ibv_qp_type t, QpPath ours = {}, QpPath theirs = {},
                      uint32_t depth = 16, uint32_t sge = 1) {
    const PeerQp p = peer_.create_qp(t, depth, sge);
    ours.dlid = peer_.lid();
    ours.dest_qpn = p.qpn;
    theirs.dlid = lid_;
    theirs.dest_qpn = qp->qp_num;
    EXPECT_EQ(bring_to_rts(qp, ours), 0);
    EXPECT_EQ(peer_.connect(p, theirs), 0);
    return p;
  }

  /// Connects two RC or UC QPs of ours to each other, both to RTS.
  void connect_ours(ibv_qp* a, ibv_qp* b) {
    QpPath to_b, to_a;
    to_b.dlid = to_a.dlid = lid_;
    to_b.dest_qpn = b->qp_num;
    to_a.dest_qpn = a->qp_num;
    ASSERT_EQ(bring_to_rts(a, to_b), 0);
    ASSERT_EQ(bring_to_rts(b, to_a), 0);
  }

  /// `n` RC pairs of depth `depth`; the peer's QPs (ours are in qps_).
  std::vector<PeerQp> rc_pairs(int n, uint32_t depth) {
    std::vector<PeerQp> theirs;
    for (int i = 0; i < n; ++i) {
      Pair p = pair(IBV_QPT_RC, {}, {}, depth);
      if (!p.qp) break;
      theirs.push_back(p.peer);
    }
    return theirs;
  }

  ibv_ah* peer_ah() {
    ibv_ah_attr aa{};
    aa.dlid = peer_.lid();
    aa.port_num = 1;
    ibv_ah* ah = ibv_create_ah(pd_, &aa);
    EXPECT_NE(ah, nullptr) << std::strerror(errno);
    ahs_.push_back(ah);
    return ah;
  }

  /// Posts `w` and returns its completion (status GENERAL_ERR if none came in 5 s).
  ibv_wc run(ibv_qp* qp, const Wr& w) {
    EXPECT_EQ(post(qp, w), 0);
    auto wcs = poll(cq_, 1);
    if (wcs.empty()) {
      ibv_wc none{};
      none.status = IBV_WC_GENERAL_ERR;
      return none;
    }
    return wcs[0];
  }

  /// Our own completions that arrive within `ms` (for "nothing arrives" checks).
  std::vector<ibv_wc> drain_for(int ms) {
    std::vector<ibv_wc> out;
    const auto end = Clock::now() + std::chrono::milliseconds(ms);
    while (Clock::now() < end) {
      ibv_wc wc;
      if (ibv_poll_cq(cq_, 1, &wc) == 1) out.push_back(wc);
      else ::usleep(100);
    }
    return out;
  }

  /// The next async event other than PORT_ACTIVE (each session starts with one), acked.
  ibv_async_event next_async_event() {
    ibv_async_event ev{};
    ev.event_type = static_cast<ibv_event_type>(-1);
    for (;;) {
      pollfd p{ctx_->async_fd, POLLIN, 0};
      if (::poll(&p, 1, 5000) != 1) return ev;
      EXPECT_EQ(ibv_get_async_event(ctx_, &ev), 0);
      ibv_ack_async_event(&ev);
      if (ev.event_type != IBV_EVENT_PORT_ACTIVE) return ev;
    }
  }

  uint64_t peer_word(uint64_t off) {
    auto b = peer_.read(off, 8);
    uint64_t v = 0;
    if (b.size() == 8) std::memcpy(&v, b.data(), 8);
    return v;
  }

  /// Posts `n` 8-byte READs of the peer's buffer on `qp` (into our buffer's last bytes); false
  /// at the first that fails.
  bool reads(ibv_qp* qp, int n) {
    for (int i = 0; i < n; ++i) {
      const ibv_wc wc = run(qp, {.op = IBV_WR_RDMA_READ,
                                 .sges = {sge(buf_.size() - 8, 8)},
                                 .raddr = peer_.mem().addr,
                                 .rkey = peer_.mem().rkey});
      if (wc.status != IBV_WC_SUCCESS) {
        ADD_FAILURE() << "READ " << i << " of " << n << ": " << ibv_wc_status_str(wc.status)
                      << " (vendor_err " << wc.vendor_err << ", QP state " << state(qp) << ")";
        return false;
      }
    }
    return true;
  }
  /// Across backends with direct_remote on: brings `qp` onto the library path, posting READs until
  /// its library talks to the peer's (the backends' introduction may come some posts after the pair
  /// is up, and a QP that asked too early asks again 64 posts later, remote_conn.cc back_off).
  /// Elsewhere true at once.
  bool reach_library_path(ibv_qp* qp) {
    for (int i = 0; across_ && i < 4000 && !library_path(qp); ++i) {
      if (!reads(qp, 1)) return false;
    }
    return !across_ || library_path(qp);
  }

  /// A QP on `q` and an RC QP of ours connected to it; returns ours.
  ibv_qp* sender_into(OurSrq& q) {
    ibv_qp* rq = q.qp(pd_, cq_);
    ibv_qp* sq = make_qp(IBV_QPT_RC);
    if (!rq || !sq) return nullptr;
    connect_ours(sq, rq);
    return sq;
  }
  /// sender_into, and one SEND through it into a receive of `q` (wr_ids 10 and 1; on the direct
  /// path the library executes it itself, granted at that post). Null if either failed.
  ibv_qp* sender_after_one(OurSrq& q) {
    ibv_qp* sq = sender_into(q);
    if (!sq || q.post(1, addr(0), 64, mr_->lkey) || send8(sq, 10)) return nullptr;
    const auto wcs = poll(cq_, 2);
    const bool ok =
        wcs.size() == 2 && wcs[0].status == IBV_WC_SUCCESS && wcs[1].status == IBV_WC_SUCCESS;
    return ok ? sq : nullptr;
  }
  /// An 8-byte SEND, signaled.
  int send8(ibv_qp* sq, uint64_t wr_id) {
    return post(sq, {.op = IBV_WR_SEND, .sges = {sge(65536, 8)}, .wr_id = wr_id});
  }

  /// A new completion channel (channel_) and a CQ of 64 on it whose context is this fixture.
  ibv_cq* channel_cq() {
    channel_ = ibv_create_comp_channel(ctx_);
    EXPECT_NE(channel_, nullptr);
    ibv_cq* cq = channel_ ? ibv_create_cq(ctx_, 64, this, channel_, 0) : nullptr;
    if (cq) cqs_.push_back(cq);
    return cq;
  }
  /// The CQ of the next event on channel_ (acknowledged), or null if none came within
  /// `timeout_ms` (or its CQ's context is not this fixture).
  ibv_cq* channel_event(int timeout_ms) {
    pollfd p{channel_->fd, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) != 1) return nullptr;
    ibv_cq* cq = nullptr;
    void* cq_ctx = nullptr;
    if (ibv_get_cq_event(channel_, &cq, &cq_ctx) != 0 || cq_ctx != this) return cq;
    ibv_ack_cq_events(cq, 1);
    return cq;
  }

  bool across_ = false;
  Peer peer_;
  ibv_cq* cq_ = nullptr;
  std::vector<uint8_t> rbuf_;  ///< backs rmr_
  std::vector<ibv_ah*> ahs_;
};

/// Anonymous private pages, as a program's heap would give them.
struct Pages {
  explicit Pages(size_t n) : size(n) {
    void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    p = m == MAP_FAILED ? nullptr : static_cast<uint8_t*>(m);
  }
  ~Pages() {
    if (p) ::munmap(p, size);
  }
  uint64_t at(size_t off) const { return reinterpret_cast<uintptr_t>(p + off); }
  uint8_t* p;
  size_t size;
};

/// A deterministic pattern, different for each `seed`.
void fill(uint8_t* p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(i * 31 + seed * 7 + 1);
}

/// Whether this run's backend grants the direct path (the `direct.` instance of the suite).
bool direct_path_on() {
  const char* env = std::getenv("VRDMA_DIRECT_PATH");
  return env && std::string(env) == "1";
}

/// Messages QP `qp`'s library executed itself (its own send ring's count, whatever grant of it
/// wrote there; 0 without one). Read while no thread posts to it.
uint64_t direct_sent(ibv_qp* qp) {
  const vrdma::verbs::VQp& v = *vrdma::verbs::to_vqp(qp);
  auto of = [](const vrdma::verbs::Grant* g) -> uint64_t {
    return g ? g->send.hdr->direct_msgs.load() : 0;
  };
  uint64_t n = of(v.grant.get());
  for (const auto& u : v.ud_grants) n = std::max(n, of(u->grant.get()));
  return n;
}

/// Requests into QP `qp` that a peer's library executed itself (its own receive ring's count,
/// which the requester's library keeps; 0 without one). Polls `cq` (`qp`'s receive CQ, with
/// nothing to complete) once, to learn of the ring.
uint64_t direct_received(ibv_qp* qp, ibv_cq* cq) {
  ibv_wc wc;
  EXPECT_EQ(ibv_poll_cq(cq, 1, &wc), 0);
  const uint32_t handle = vrdma::verbs::to_vqp(qp)->handle;
  for (const auto& r : vrdma::verbs::to_vcq(cq)->own) {
    if (r->qp == handle && r->recv) return r->hdr->direct_msgs.load();
  }
  return 0;
}

// ---- Opcodes x QP types ----------------------------------------------------------------------

TEST_F(Conformance, EveryOpcodeOnEveryQpTypeThatAllowsIt) {
  struct Case {
    ibv_qp_type type;
    ibv_wr_opcode op;
  };
  const Case cases[] = {
      {IBV_QPT_RC, IBV_WR_SEND},         {IBV_QPT_RC, IBV_WR_SEND_WITH_IMM},
      {IBV_QPT_RC, IBV_WR_RDMA_WRITE},   {IBV_QPT_RC, IBV_WR_RDMA_WRITE_WITH_IMM},
      {IBV_QPT_RC, IBV_WR_RDMA_READ},    {IBV_QPT_RC, IBV_WR_ATOMIC_CMP_AND_SWP},
      {IBV_QPT_RC, IBV_WR_ATOMIC_FETCH_AND_ADD},
      {IBV_QPT_UC, IBV_WR_SEND},         {IBV_QPT_UC, IBV_WR_SEND_WITH_IMM},
      {IBV_QPT_UC, IBV_WR_RDMA_WRITE},   {IBV_QPT_UC, IBV_WR_RDMA_WRITE_WITH_IMM},
      {IBV_QPT_UD, IBV_WR_SEND},         {IBV_QPT_UD, IBV_WR_SEND_WITH_IMM},
  };
  const uint64_t remote = peer_.mem().addr;
  const uint32_t rkey = peer_.mem().rkey;
  // The UC and UD cases must go direct at their first post, so the proof that this process may
  // write the peer's memory (asked at the first grant, read asynchronously: a busy machine can
  // keep it pending past the RC cases, and a grant asked meanwhile is "not yet") is settled
  // first: an RC pair WRITEs until its library executes one itself.
  if (direct_path_on()) {
    Pair w = pair(IBV_QPT_RC);
    ASSERT_NE(w.qp, nullptr);
    const auto until = Clock::now() + std::chrono::seconds(20);
    while (direct_sent(w.qp) == 0 && Clock::now() < until) {
      const ibv_wc wc = run(w.qp, Wr{.op = IBV_WR_RDMA_WRITE,
                                     .sges = {sge(0, 8)},
                                     .wr_id = 1,
                                     .raddr = remote,
                                     .rkey = rkey});
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    }
    ASSERT_GT(direct_sent(w.qp), 0u) << "the direct path was not granted in 20 s";
  }
  unsigned seed = 0;
  for (const Case& c : cases) {
    ++seed;
    const std::string what = std::string(c.type == IBV_QPT_RC   ? "RC "
                                         : c.type == IBV_QPT_UC ? "UC "
                                                                : "UD ") +
                             std::to_string(c.op);
    Pair p = pair(c.type);
    ASSERT_NE(p.qp, nullptr);
    const bool atomic = c.op == IBV_WR_ATOMIC_CMP_AND_SWP || c.op == IBV_WR_ATOMIC_FETCH_AND_ADD;
    const bool imm = c.op == IBV_WR_SEND_WITH_IMM || c.op == IBV_WR_RDMA_WRITE_WITH_IMM;
    const bool consumes_recv = c.op == IBV_WR_SEND || imm;
    const uint32_t len = atomic ? 8 : 1000 + seed;
    const size_t local = 8192 * seed, poff = 65536 + 8192 * seed;  // our and the peer's bytes
    const uint32_t grh = c.type == IBV_QPT_UD ? 40 : 0;
    fill(buf_.data() + local, len, seed);
    std::vector<uint8_t> theirs(len);
    fill(theirs.data(), len, seed + 100);
    const uint64_t word = 0x1000 + seed;
    if (c.op == IBV_WR_RDMA_READ) peer_.write(poff, theirs.data(), len);
    if (atomic) peer_.write(poff, &word, 8);
    if (consumes_recv) {
      ASSERT_EQ(peer_.post_recv(p.peer, 500 + seed, 4096, 4096), 0) << what;
    }

    Wr w{.op = c.op, .sges = {sge(local, len)}, .wr_id = seed, .raddr = remote + poff,
         .rkey = rkey, .compare_add = c.op == IBV_WR_ATOMIC_CMP_AND_SWP ? word : 5,
         .swap = 0xabcdef, .imm = 0x5000 + seed};
    if (c.type == IBV_QPT_UD) {
      w.ah = peer_ah();
      w.remote_qpn = p.peer.qpn;
    }
    const ibv_wc wc = run(p.qp, w);
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << what << ": " << ibv_wc_status_str(wc.status);
    EXPECT_EQ(wc.wr_id, seed) << what;
    EXPECT_EQ(wc.qp_num, p.qp->qp_num) << what;
    const ibv_wc_opcode want_op = c.op == IBV_WR_SEND || c.op == IBV_WR_SEND_WITH_IMM ? IBV_WC_SEND
                                  : c.op == IBV_WR_RDMA_READ                         ? IBV_WC_RDMA_READ
                                  : c.op == IBV_WR_ATOMIC_CMP_AND_SWP               ? IBV_WC_COMP_SWAP
                                  : c.op == IBV_WR_ATOMIC_FETCH_AND_ADD             ? IBV_WC_FETCH_ADD
                                                                                    : IBV_WC_RDMA_WRITE;
    EXPECT_EQ(wc.opcode, want_op) << what;
    if (c.op == IBV_WR_RDMA_READ || atomic) {
      EXPECT_EQ(wc.byte_len, len) << what;
    }

    if (consumes_recv) {
      auto rx = peer_.poll(1);
      ASSERT_EQ(rx.size(), 1u) << what;
      EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS) << what;
      EXPECT_EQ(rx[0].wr_id, 500u + seed) << what;
      EXPECT_EQ(rx[0].opcode, c.op == IBV_WR_RDMA_WRITE_WITH_IMM ? IBV_WC_RECV_RDMA_WITH_IMM
                                                                 : IBV_WC_RECV)
          << what;
      EXPECT_EQ(rx[0].byte_len, grh + len) << what;
      EXPECT_EQ(rx[0].qp_num, p.peer.qpn) << what;
      EXPECT_EQ(rx[0].src_qp, p.qp->qp_num) << what;
      EXPECT_EQ(rx[0].slid, lid_) << what;
      EXPECT_EQ((rx[0].wc_flags & IBV_WC_WITH_IMM) != 0, imm) << what;
      if (imm) {
        EXPECT_EQ(ntohl(rx[0].imm_data), 0x5000u + seed) << what;
      }
    } else {
      EXPECT_TRUE(peer_.poll(1, 0).empty()) << what << ": no receive consumed";
    }
    // The bytes, where they should be.
    if (c.op == IBV_WR_SEND || c.op == IBV_WR_SEND_WITH_IMM) {
      EXPECT_EQ(peer_.read(4096 + grh, len), std::vector<uint8_t>(buf_.data() + local,
                                                                   buf_.data() + local + len))
          << what;
    } else if (c.op == IBV_WR_RDMA_WRITE || c.op == IBV_WR_RDMA_WRITE_WITH_IMM) {
      const std::vector<uint8_t> want(buf_.data() + local, buf_.data() + local + len);
      // UC has no ACK: its send completion says the message left, not that it landed (across
      // backends it is still on its way); an RC completion or a receive says it landed.
      if (c.type == IBV_QPT_UC && !imm) {
        const auto until = Clock::now() + std::chrono::seconds(10);
        while (peer_.read(poff, len) != want && Clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_EQ(peer_.read(poff, len), want) << what;
    } else if (c.op == IBV_WR_RDMA_READ) {
      EXPECT_EQ(std::memcmp(buf_.data() + local, theirs.data(), len), 0) << what;
    } else {
      uint64_t old;
      std::memcpy(&old, buf_.data() + local, 8);
      EXPECT_EQ(old, word) << what << ": the atomic returns the old value";
      EXPECT_EQ(peer_word(poff), c.op == IBV_WR_ATOMIC_CMP_AND_SWP ? 0xabcdefu : word + 5) << what;
    }
    // UC and UD go direct as RC does (issue 25), the proof settled above; so do atomics.
    if (direct_path_on() && (c.type != IBV_QPT_RC || atomic)) {
      EXPECT_EQ(direct_sent(p.qp), 1u) << what << ": not executed by the library";
    }
  }
}

// UD's receive side as the spec and the mediated path give it, on every path: the GRH's 40
// bytes (filled for a global address handle, untouched otherwise), src_qp, slid, sl, the
// flags; a qkey with the high bit set means the sender's own; a wrong qkey drops the datagram.
TEST_F(Conformance, UdGrhQkeyAndSourceFieldsAreTheSameOnEveryPath) {
  // Two UD QPs of ours (one session: on the direct path no proof is needed).
  ibv_qp* a = make_qp(IBV_QPT_UD);
  ibv_qp* b = make_qp(IBV_QPT_UD);
  ASSERT_TRUE(a && b);
  ASSERT_EQ(bring_to_rts(a, QpPath{}), 0);
  ASSERT_EQ(bring_to_rts(b, QpPath{}), 0);
  ibv_gid gid{};
  ASSERT_EQ(ibv_query_gid(ctx_, 1, 0, &gid), 0);
  ibv_ah_attr aa{};
  aa.dlid = lid_;
  aa.sl = 3;
  aa.port_num = 1;
  ibv_ah* plain = ibv_create_ah(pd_, &aa);
  aa.is_global = 1;
  aa.grh.dgid = gid;
  ibv_ah* global = ibv_create_ah(pd_, &aa);
  ASSERT_TRUE(plain && global);
  ahs_.push_back(plain);
  ahs_.push_back(global);
  constexpr size_t kRecv = 65536, kLen = 100;
  // One datagram from a to b; the receive's completion (none: `got` false). One that must
  // arrive is waited for up to 10 s (a loaded machine, or TSan, can take more than 100 ms);
  // one that must not, 100 ms after the send's completion.
  auto send = [&](ibv_ah* ah, uint32_t qkey, unsigned seed, bool& got, bool arrives = true) {
    fill(buf_.data(), kLen, seed);
    EXPECT_EQ(post(a, {.sges = {sge(0, kLen)},
                       .wr_id = seed,
                       .ah = ah,
                       .remote_qpn = b->qp_num,
                       .qkey = qkey}),
              0);
    ibv_wc rx{};
    got = false;
    bool sent = false;
    const auto until = Clock::now() + std::chrono::seconds(10);
    do {
      for (const ibv_wc& wc : drain_for(100)) {
        if (wc.qp_num == a->qp_num) {
          EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << "UD is unreliable: the sender does not learn";
          EXPECT_EQ(wc.wr_id, seed);
          sent = true;
        } else {
          rx = wc;
          got = true;
        }
      }
    } while (!(sent && (got || !arrives)) && Clock::now() < until);
    return rx;
  };
  std::memset(buf_.data() + kRecv, 0xee, 4096);
  ASSERT_EQ(post_recv(b, 7, kRecv, 4096), 0);
  bool got = false;
  ibv_wc rx = send(global, vrdma::test::kTestQkey, 1, got);
  ASSERT_TRUE(got) << "no receive completion";
  EXPECT_EQ(rx.status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx.wr_id, 7u);
  EXPECT_EQ(rx.opcode, IBV_WC_RECV);
  EXPECT_EQ(rx.byte_len, 40 + kLen);
  EXPECT_EQ(rx.qp_num, b->qp_num);
  EXPECT_EQ(rx.src_qp, a->qp_num);
  EXPECT_EQ(rx.slid, lid_);
  EXPECT_EQ(rx.sl, 3);
  EXPECT_EQ(rx.wc_flags & (IBV_WC_GRH | IBV_WC_WITH_IMM), static_cast<unsigned>(IBV_WC_GRH));
  const uint8_t* grh = buf_.data() + kRecv;
  EXPECT_EQ(grh[0], 0x60);
  EXPECT_EQ(grh[4] << 8 | grh[5], static_cast<int>(kLen)) << "payload length";
  EXPECT_EQ(grh[6], 0x1b);
  EXPECT_EQ(grh[7], 64);
  EXPECT_EQ(std::memcmp(grh + 8, gid.raw, 16), 0) << "source GID";
  EXPECT_EQ(std::memcmp(grh + 24, gid.raw, 16), 0) << "destination GID";
  EXPECT_EQ(std::memcmp(grh + 40, buf_.data(), kLen), 0);
  // A wrong qkey: dropped, the receive stays posted for the next datagram.
  std::memset(buf_.data() + kRecv, 0xee, 4096);
  ASSERT_EQ(post_recv(b, 8, kRecv, 4096), 0);
  send(plain, vrdma::test::kTestQkey + 1, 2, got, false);
  EXPECT_FALSE(got) << "a datagram with a wrong qkey was delivered";
  // The high bit: the sender's own qkey (the same as b's here). No GRH: its room untouched.
  rx = send(plain, 0x80000000u, 3, got);
  ASSERT_TRUE(got) << "a datagram with the sender's own qkey was not delivered";
  EXPECT_EQ(rx.wr_id, 8u);
  EXPECT_EQ(rx.byte_len, 40 + kLen);
  EXPECT_EQ(rx.wc_flags & IBV_WC_GRH, 0u);
  EXPECT_EQ(rx.src_qp, a->qp_num);
  EXPECT_EQ(std::vector<uint8_t>(grh, grh + 40), std::vector<uint8_t>(40, 0xee));
  EXPECT_EQ(std::memcmp(grh + 40, buf_.data(), kLen), 0);
  if (direct_path_on()) {
    EXPECT_EQ(direct_sent(a), 2u) << "the delivered datagrams went direct";
  }
}

// UC has no RNR: a SEND that finds no receive is lost, and its sender completes successfully.
TEST_F(Conformance, UcSendWithoutAReceiveIsLostAndTheSenderSucceeds) {
  ibv_qp* a = make_qp(IBV_QPT_UC);
  ibv_qp* b = make_qp(IBV_QPT_UC);
  ASSERT_TRUE(a && b);
  ASSERT_NO_FATAL_FAILURE(connect_ours(a, b));
  fill(buf_.data(), 64, 1);
  ASSERT_EQ(post(a, {.sges = {sge(0, 64)}, .wr_id = 1}), 0);
  auto first = drain_for(100);
  ASSERT_EQ(first.size(), 1u) << "only the send's completion";
  EXPECT_EQ(first[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(first[0].wr_id, 1u);
  // The next one finds a receive: it gets the second message, not the lost one.
  ASSERT_EQ(post_recv(b, 9, 65536, 64), 0);
  fill(buf_.data(), 64, 2);
  ASSERT_EQ(post(a, {.sges = {sge(0, 64)}, .wr_id = 2}), 0);
  auto second = poll(cq_, 2);
  ASSERT_EQ(second.size(), 2u);
  for (const ibv_wc& wc : second) {
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
    EXPECT_EQ(wc.wr_id, wc.qp_num == a->qp_num ? 2u : 9u);
  }
  EXPECT_EQ(std::memcmp(buf_.data() + 65536, buf_.data(), 64), 0);
  if (direct_path_on()) {
    EXPECT_EQ(direct_sent(a), 2u) << "both went direct";
  }
}

// UC with another guest's QP (across backends in e2e.conformance_remote, library to library;
// issue 25): what cannot land is lost, never an RNR or a NAK, and its sender completes
// successfully: a SEND and a WRITE_WITH_IMM that find no receive, a WRITE with a wrong rkey
// (the IB spec's UC responder drops it silently; the backend's did so across backends, and
// now on one host too). The next SEND that finds a receive brings its own bytes.
TEST_F(Conformance, UcToAnotherGuestLosesWhatCannotLandAndItsSenderSucceeds) {
  Pair p = pair(IBV_QPT_UC);
  ASSERT_NE(p.qp, nullptr);
  auto write = [&](uint64_t wr_id, ibv_wr_opcode op, uint32_t rkey, uint32_t off) {
    return run(p.qp, {.op = op,
                      .sges = {sge(0, 64)},
                      .wr_id = wr_id,
                      .raddr = peer_.mem().addr + off,
                      .rkey = rkey});
  };
  // Across backends: WRITEs until our library talks to the peer's.
  for (int i = 0; across_ && i < 4000 && !library_path(p.qp); ++i)
    ASSERT_EQ(write(1, IBV_WR_RDMA_WRITE, peer_.mem().rkey, 0).status, IBV_WC_SUCCESS);
  if (across_) {
    ASSERT_TRUE(library_path(p.qp)) << "our UC QP never talked to the peer's library";
  }
  fill(buf_.data(), 64, 1);
  const std::vector<uint8_t> lost(buf_.data(), buf_.data() + 64);
  for (const auto& [wr_id, op, rkey] :
       {std::tuple{2u, IBV_WR_SEND, 0u}, std::tuple{3u, IBV_WR_RDMA_WRITE_WITH_IMM, peer_.mem().rkey},
        std::tuple{4u, IBV_WR_RDMA_WRITE, peer_.mem().rkey ^ 0x5a5a00}}) {
    const ibv_wc wc = write(wr_id, op, rkey, 2048);
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << "WR " << wr_id << ": " << ibv_wc_status_str(wc.status);
    EXPECT_EQ(wc.wr_id, wr_id);
  }
  // A UC completion says the message left: a WRITE behind them that has landed says they were
  // taken (or lost) before the receive below is posted.
  fill(buf_.data(), 64, 2);
  const std::vector<uint8_t> marker(buf_.data(), buf_.data() + 64);
  ASSERT_EQ(write(5, IBV_WR_RDMA_WRITE, peer_.mem().rkey, 4096).status, IBV_WC_SUCCESS);
  for (const auto until = Clock::now() + std::chrono::seconds(10);
       peer_.read(4096, 64) != marker && Clock::now() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(peer_.read(4096, 64), marker) << "the marker WRITE never landed";
  EXPECT_TRUE(peer_.poll(1, 0).empty()) << "nothing consumed a receive (none was posted)";
  EXPECT_NE(peer_.read(2048, 64), lost) << "a lost WRITE wrote nothing";
  // The next SEND finds a receive: its own bytes, once.
  ASSERT_EQ(peer_.post_recv(p.peer, 9, 8192, 64), 0);
  fill(buf_.data(), 64, 3);
  ASSERT_EQ(write(6, IBV_WR_SEND, 0, 0).status, IBV_WC_SUCCESS);
  auto rx = peer_.poll(1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].wr_id, 9u);
  EXPECT_EQ(rx[0].byte_len, 64u);
  EXPECT_EQ(peer_.read(8192, 64), std::vector<uint8_t>(buf_.data(), buf_.data() + 64));
  EXPECT_TRUE(peer_.poll(1, 50).empty()) << "one receive, one completion";
  EXPECT_EQ(state(p.qp), IBV_QPS_RTS);
  if (across_) {
    EXPECT_TRUE(library_path(p.qp)) << "still library to library";
  }
}

// UC: a receive that fails at the responder (too small for the message) completes in error
// there, and the responder's QP goes to ERR; the requester never hears of it (no NAK in UC: it
// completes successfully), and what it sends next is lost. Across backends (e2e.
// conformance_remote) the peer's SENDs reach our library directly before the failing one.
TEST_F(Conformance, AUcReceiveThatFailsEndsTheResponderNotTheRequester) {
  Pair p = pair(IBV_QPT_UC);
  ASSERT_NE(p.qp, nullptr);
  auto peer_send = [&](uint64_t wr_id) {
    EXPECT_EQ(peer_.send(p.peer, IBV_WR_SEND, 0, 64, wr_id), 0);
    const auto wcs = peer_.poll(1);
    return wcs.size() == 1 ? wcs[0].status : IBV_WC_GENERAL_ERR;
  };
  // SENDs that land, until the peer's come from its library (across backends).
  for (uint64_t i = 1; i < 4000 && (i == 1 || (across_ && !peer_requests_direct(p.qp))); ++i) {
    ASSERT_EQ(post_recv(p.qp, 10 + i, 4096, 64), 0);
    ASSERT_EQ(peer_send(i), IBV_WC_SUCCESS);
    const auto rx = poll(cq_, 1);
    ASSERT_EQ(rx.size(), 1u);
    ASSERT_EQ(rx[0].status, IBV_WC_SUCCESS);
  }
  if (across_) {
    ASSERT_TRUE(peer_requests_direct(p.qp)) << "the peer's SENDs never came from its library";
  }
  // A receive of 16 bytes for a 64-byte SEND.
  ASSERT_EQ(post_recv(p.qp, 7, 4096, 16), 0);
  EXPECT_EQ(peer_send(100), IBV_WC_SUCCESS) << "the UC requester hears nothing";
  const auto rx = poll(cq_, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 7u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_LEN_ERR);
  EXPECT_EQ(state(p.qp), IBV_QPS_ERR);
  // What it sends next is lost, and it still succeeds.
  EXPECT_EQ(peer_send(101), IBV_WC_SUCCESS);
  EXPECT_EQ(peer_.qp_state(p.peer), IBV_QPS_RTS);
  EXPECT_TRUE(drain_for(50).empty()) << "nothing more arrives at the failed QP";
}

TEST_F(Conformance, AnOpcodeTheQpTypeForbidsIsEinvalAndPostsNothing) {
  ibv_device_attr d{};
  ASSERT_EQ(ibv_query_device(ctx_, &d), 0);
  // Memory windows and invalidation: advertised (their opcodes are tested below); TSO is not.
  EXPECT_NE(d.device_cap_flags & IBV_DEVICE_MEM_MGT_EXTENSIONS, 0u);
  EXPECT_NE(d.device_cap_flags & IBV_DEVICE_MEM_WINDOW, 0u);
  struct Case {
    ibv_qp_type type;
    std::vector<ibv_wr_opcode> ops;
  };
  const Case cases[] = {
      {IBV_QPT_RC, {IBV_WR_TSO}},
      {IBV_QPT_UC,
       {IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD,
        IBV_WR_SEND_WITH_INV}},
      {IBV_QPT_UD,
       {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP,
        IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_LOCAL_INV, IBV_WR_BIND_MW, IBV_WR_SEND_WITH_INV}},
  };
  for (const Case& c : cases) {
    Pair p = pair(c.type);
    ASSERT_NE(p.qp, nullptr);
    ibv_ah* ah = c.type == IBV_QPT_UD ? peer_ah() : nullptr;
    for (ibv_wr_opcode op : c.ops) {
      bool bad_is_wr = false;
      EXPECT_EQ(post(p.qp, {.op = op, .sges = {sge(0, 8)}, .rkey = peer_.mem().rkey, .ah = ah,
                            .remote_qpn = p.peer.qpn},
                     &bad_is_wr),
                EINVAL)
          << "QP type " << c.type << ", opcode " << op;
      EXPECT_TRUE(bad_is_wr);
    }
    // A chain stops at the bad WR: the one before it is posted and completes.
    ibv_sge s = sge(0, 8);
    ibv_send_wr second{}, first{};
    first.wr_id = 1;
    first.sg_list = second.sg_list = &s;
    first.num_sge = second.num_sge = 1;
    first.opcode = c.type == IBV_QPT_UD ? IBV_WR_SEND : IBV_WR_RDMA_WRITE;
    first.send_flags = IBV_SEND_SIGNALED;
    first.wr.rdma = {peer_.mem().addr, peer_.mem().rkey};
    if (ah) first.wr.ud = {ah, p.peer.qpn, vrdma::test::kTestQkey};
    first.next = &second;
    second.wr_id = 2;
    second.opcode = c.ops[0];
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(ibv_post_send(p.qp, &first, &bad), EINVAL);
    EXPECT_EQ(bad, &second);
    auto wcs = poll(cq_, 1);
    ASSERT_EQ(wcs.size(), 1u);
    EXPECT_EQ(wcs[0].wr_id, 1u);
    EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
    EXPECT_TRUE(drain_for(20).empty()) << "the refused WR never reaches the device";
    EXPECT_EQ(state(p.qp), IBV_QPS_RTS) << "a refused post leaves the QP alone";
  }
}

// ---- Scatter/gather and inline -----------------------------------------------------------------

TEST_F(Conformance, ScatterGatherListsUpToMaxSge) {
  ibv_device_attr d{};
  ASSERT_EQ(ibv_query_device(ctx_, &d), 0);
  const uint32_t n = static_cast<uint32_t>(d.max_sge);
  ASSERT_GE(n, 2u);
  Pair p = pair(IBV_QPT_RC, {}, {}, 16, n);
  ASSERT_NE(p.qp, nullptr);
  // Gather n pieces of different lengths from scattered places; the total is their sum.
  std::vector<ibv_sge> gather;
  std::vector<uint8_t> expect;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t len = 7 * i + 1;
    fill(buf_.data() + 4096 * i, len, i);
    gather.push_back(sge(4096 * i, len));
    expect.insert(expect.end(), buf_.data() + 4096 * i, buf_.data() + 4096 * i + len);
  }
  const uint32_t total = static_cast<uint32_t>(expect.size());
  // Scatter into n equal pieces of the peer's buffer, 1000 bytes apart.
  std::vector<Piece> scatter;
  const uint32_t piece = (total + n - 1) / n;
  for (uint32_t i = 0; i < n; ++i) scatter.push_back(Piece{200000 + 1000 * i, piece});
  ASSERT_EQ(peer_.post_recv(p.peer, 9, scatter), 0);
  ibv_wc wc = run(p.qp, {.op = IBV_WR_SEND, .sges = gather});
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  auto rx = peer_.poll(1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].byte_len, total);
  std::vector<uint8_t> got;
  for (uint32_t i = 0; i < n && got.size() < total; ++i) {
    auto part = peer_.read(200000 + 1000 * i, std::min(piece, total - uint32_t(got.size())));
    got.insert(got.end(), part.begin(), part.end());
  }
  EXPECT_EQ(got, expect) << "gathered in order, scattered in order";

  // RDMA WRITE gathers the same way; RDMA READ scatters into our n pieces.
  wc = run(p.qp, {.op = IBV_WR_RDMA_WRITE, .sges = gather, .raddr = peer_.mem().addr + 300000,
                  .rkey = peer_.mem().rkey});
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(peer_.read(300000, total), expect);
  std::vector<ibv_sge> into;
  for (uint32_t i = 0; i < n; ++i) into.push_back(sge(500000 + 2000 * i, piece));
  wc = run(p.qp, {.op = IBV_WR_RDMA_READ, .sges = into, .raddr = peer_.mem().addr + 300000,
                  .rkey = peer_.mem().rkey});
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.byte_len, piece * n);
  for (uint32_t i = 0, at = 0; i < n && at < total; ++i, at += piece) {
    const uint32_t k = std::min(piece, total - at);
    EXPECT_EQ(std::memcmp(buf_.data() + 500000 + 2000 * i, expect.data() + at, k), 0) << i;
  }

  // One SGE more than the QP's max_send_sge / max_recv_sge is refused at post time, and a QP
  // asking for more than the device's max_sge is not created.
  gather.push_back(sge(0, 1));
  bool bad_is_wr = false;
  EXPECT_EQ(post(p.qp, {.op = IBV_WR_SEND, .sges = gather}, &bad_is_wr), EINVAL);
  EXPECT_TRUE(bad_is_wr);
  scatter.push_back(Piece{0, 1});
  EXPECT_EQ(peer_.post_recv(p.peer, 10, scatter), EINVAL);
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = cq_;
  a.qp_type = IBV_QPT_RC;
  a.cap = {4, 4, n + 1, 1, 0};
  errno = 0;
  EXPECT_EQ(ibv_create_qp(pd_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

TEST_F(Conformance, InlineDataUpToMaxInlineData) {
  Pair p = pair(IBV_QPT_RC, {}, {}, 16, 3, 256);
  ASSERT_NE(p.qp, nullptr);
  const uint32_t max = caps(p.qp).max_inline_data;
  ASSERT_GE(max, 256u);
  // Inline data needs no MR: the bytes are copied at post time, from memory never registered,
  // in three SGEs whose lkeys mean nothing.
  std::vector<uint8_t> src(max);
  fill(src.data(), max, 42);
  const std::vector<uint8_t> sent = src;
  const uint32_t a = max / 3, b = max / 3, c = max - a - b;
  auto u = [&](size_t off) { return reinterpret_cast<uintptr_t>(src.data() + off); };
  const std::vector<ibv_sge> sges = {{u(0), a, 0}, {u(a), b, 0xdead}, {u(a + b), c, 0}};
  ASSERT_EQ(peer_.post_recv(p.peer, 1, 0, 4096), 0);
  ASSERT_EQ(post(p.qp, {.op = IBV_WR_SEND, .sges = sges, .flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE}), 0);
  std::fill(src.begin(), src.end(), 0);  // after the post: must not matter
  auto wcs = poll(cq_, 1);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
  auto rx = peer_.poll(1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].byte_len, max);
  EXPECT_EQ(peer_.read(0, max), sent);
  // RDMA WRITE inline, likewise.
  fill(src.data(), max, 43);
  const std::vector<uint8_t> written = src;
  ibv_wc wc = run(p.qp, {.op = IBV_WR_RDMA_WRITE, .sges = sges,
                         .flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE,
                         .raddr = peer_.mem().addr + 8192, .rkey = peer_.mem().rkey});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(peer_.read(8192, max), written);
  // One byte more than max_inline_data: refused at post time.
  src.push_back(0);
  bool bad_is_wr = false;
  EXPECT_EQ(post(p.qp, {.op = IBV_WR_SEND, .sges = {{u(0), max + 1, 0}},
                        .flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE},
                 &bad_is_wr),
            EINVAL);
  EXPECT_TRUE(bad_is_wr);
  // A QP asking for more inline data than the device can do is not created.
  ibv_qp_init_attr big{};
  big.send_cq = big.recv_cq = cq_;
  big.qp_type = IBV_QPT_RC;
  big.cap = {4, 4, 1, 1, max + 1};
  EXPECT_EQ(ibv_create_qp(pd_, &big), nullptr);
}

// One table of work requests, each with the answer of the post rules (src/proto/post_rules.h,
// whose unit test covers each rule): the suite runs again with the direct path on, and the
// same bad WR must get the same answer there.
TEST_F(Conformance, EachPostRuleGivesTheSameAnswerOnEveryPath) {
  Pair p = pair(IBV_QPT_RC, {}, {}, 16, 2, 64);
  ASSERT_NE(p.qp, nullptr);
  const uint32_t max_inline = caps(p.qp).max_inline_data;
  const uint64_t remote = peer_.mem().addr;
  const uint32_t rkey = peer_.mem().rkey;
  fill(buf_.data(), 4096, 9);
  const std::vector<uint8_t> peer_before = peer_.read(0, 64);
  struct Case {
    const char* what;
    Wr w;
    int post;                           ///< ibv_post_send's answer
    ibv_wc_status wc = IBV_WC_SUCCESS;  ///< the completion's, when the post is taken
  };
  const Case cases[] = {
      {"three SGEs on a QP of two", {.sges = {sge(0, 1), sge(8, 1), sge(16, 1)}}, EINVAL},
      {"one byte more inline than max_inline_data",
       {.op = IBV_WR_RDMA_WRITE,
        .sges = {sge(0, max_inline + 1)},
        .flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE,
        .raddr = remote + 4096,
        .rkey = rkey},
       EINVAL},
      {"a READ ignores IBV_SEND_INLINE",
       {.op = IBV_WR_RDMA_READ,
        .sges = {sge(8192, 64)},
        .flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE,
        .raddr = remote,
        .rkey = rkey},
       0},
      {"a zero-length WRITE names no memory", {.op = IBV_WR_RDMA_WRITE, .sges = {}}, 0},
      {"an atomic's 8 bytes in two SGEs",
       {.op = IBV_WR_ATOMIC_FETCH_AND_ADD,
        .sges = {sge(16384, 4), sge(20480, 4)},
        .raddr = remote + 8,
        .rkey = rkey,
        .compare_add = 1},
       0},
      {"an atomic of 4 bytes",
       {.op = IBV_WR_ATOMIC_FETCH_AND_ADD,
        .sges = {sge(16384, 4)},
        .raddr = remote + 8,
        .rkey = rkey,
        .compare_add = 1},
       0,
       IBV_WC_LOC_LEN_ERR},  // last: the QP is in ERR after it
  };
  for (const Case& c : cases) {
    bool bad_is_wr = false;
    ASSERT_EQ(post(p.qp, c.w, &bad_is_wr), c.post) << c.what;
    if (c.post) {
      EXPECT_TRUE(bad_is_wr) << c.what;
      EXPECT_TRUE(drain_for(10).empty()) << c.what << ": a refused WR never completes";
      continue;
    }
    auto wcs = poll(cq_, 1);
    ASSERT_EQ(wcs.size(), 1u) << c.what;
    EXPECT_EQ(wcs[0].status, c.wc) << c.what << ": " << ibv_wc_status_str(wcs[0].status);
  }
  EXPECT_EQ(std::vector<uint8_t>(buf_.begin() + 8192, buf_.begin() + 8192 + 64), peer_before)
      << "the READ read the peer's memory";
  uint64_t old = 0;
  std::memcpy(&old, buf_.data() + 16384, 4);
  std::memcpy(reinterpret_cast<uint8_t*>(&old) + 4, buf_.data() + 20480, 4);
  EXPECT_EQ(old, peer_word(8) - 1) << "the atomic's result, in its two SGEs";
}

// ---- Error completions ----------------------------------------------------------------------

TEST_F(Conformance, BadLkeyOrSgeOutsideTheMrIsLocalProtectionError) {
  rbuf_.assign(4096, 0);
  rmr_ = ibv_reg_mr(pd_, rbuf_.data(), rbuf_.size(), 0);  // local read only
  ASSERT_NE(rmr_, nullptr);
  const uint64_t start = addr(0), end = addr(buf_.size());
  struct Case {
    ibv_wr_opcode op;
    ibv_sge s;
    const char* what;
  };
  const Case cases[] = {
      {IBV_WR_SEND, {start, 64, mr_->lkey ^ 0x80000000u}, "bad lkey"},
      {IBV_WR_SEND, {start - 64, 128, mr_->lkey}, "SGE starts before the MR"},
      {IBV_WR_SEND, {end - 64, 128, mr_->lkey}, "SGE ends past the MR"},
      {IBV_WR_RDMA_WRITE, {start, 64, mr_->lkey ^ 0x80000000u}, "WRITE with a bad lkey"},
      {IBV_WR_RDMA_READ, {reinterpret_cast<uintptr_t>(rbuf_.data()), 64, rmr_->lkey},
       "READ into an MR without local write"},
  };
  for (const Case& c : cases) {
    Pair p = pair(IBV_QPT_RC);
    ASSERT_NE(p.qp, nullptr);
    ASSERT_EQ(peer_.post_recv(p.peer, 1, 0, 4096), 0);
    const ibv_wc wc = run(p.qp, {.op = c.op, .sges = {c.s}, .raddr = peer_.mem().addr + 65536,
                                 .rkey = peer_.mem().rkey});
    EXPECT_EQ(wc.status, IBV_WC_LOC_PROT_ERR) << c.what << ": " << ibv_wc_status_str(wc.status);
    EXPECT_EQ(state(p.qp), IBV_QPS_ERR) << c.what;
    EXPECT_TRUE(peer_.poll(1, 0).empty()) << c.what << ": the peer received nothing";
  }
  EXPECT_EQ(peer_.read(65536, 64), std::vector<uint8_t>(64, 0)) << "nothing was written";
}

// Each fault of a WRITE, READ or atomic completes it with the responder's status, whichever path
// would have executed it (proto/responder_rules.h): an unknown rkey, bounds, an MR or a responder
// QP without the access REM_ACCESS_ERR; a misaligned atomic REM_INV_REQ_ERR. On the direct path
// the QP is granted first (a good request executed by the library), and the faulty one goes to
// the backend: the library executes nothing of it.
TEST_F(Conformance, BadRkeyOutOfBoundsMissingAccessOrMisalignedAtomicFailAsTheResponderSays) {
  const auto ro = peer_.reg_mr(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  ASSERT_NE(ro.rkey, 0u);
  const uint64_t remote = peer_.mem().addr, size = peer_.mem().size;
  const uint32_t rkey = peer_.mem().rkey;
  struct Case {
    ibv_wr_opcode op;
    uint64_t raddr;
    uint32_t rkey;
    unsigned peer_qp_access;
    const char* what;
    ibv_wc_status want = IBV_WC_REM_ACCESS_ERR;
  };
  constexpr auto kFaa = IBV_WR_ATOMIC_FETCH_AND_ADD;
  constexpr auto kCas = IBV_WR_ATOMIC_CMP_AND_SWP;
  const Case cases[] = {
      {IBV_WR_RDMA_WRITE, remote, rkey ^ 0x80000000u, kAllAccess, "WRITE, wrong rkey"},
      {IBV_WR_RDMA_READ, remote, rkey ^ 0x80000000u, kAllAccess, "READ, wrong rkey"},
      {kFaa, remote, rkey ^ 0x80000000u, kAllAccess, "atomic, wrong rkey"},
      {IBV_WR_RDMA_READ, remote, mr_->rkey, kAllAccess, "READ with our own guest's rkey"},
      {kCas, remote, mr_->rkey, kAllAccess, "atomic with our own guest's rkey"},
      {IBV_WR_RDMA_WRITE, remote + size - 32, rkey, kAllAccess, "WRITE past the end"},
      {IBV_WR_RDMA_READ, remote - 64, rkey, kAllAccess, "READ before the start"},
      {kFaa, remote + size, rkey, kAllAccess, "atomic past the end"},
      {IBV_WR_RDMA_WRITE, ro.addr, ro.rkey, kAllAccess, "WRITE, MR without remote write"},
      {kCas, ro.addr, ro.rkey, kAllAccess, "atomic, MR without atomic"},
      {IBV_WR_RDMA_WRITE, remote, rkey, IBV_ACCESS_REMOTE_READ, "WRITE, QP without remote write"},
      {IBV_WR_RDMA_READ, remote, rkey, IBV_ACCESS_REMOTE_WRITE, "READ, QP without remote read"},
      {kFaa, remote, rkey, IBV_ACCESS_REMOTE_READ, "atomic, QP without remote atomic"},
      {kFaa, remote + 4, rkey, kAllAccess, "FETCH_AND_ADD, misaligned", IBV_WC_REM_INV_REQ_ERR},
      {kCas, remote + 1, rkey, kAllAccess, "CMP_AND_SWP, misaligned", IBV_WC_REM_INV_REQ_ERR},
  };
  constexpr uint64_t kGood = 32768;  ///< where the granting requests go
  for (const Case& c : cases) {
    if (c.rkey == rkey && c.raddr == remote && c.peer_qp_access == kAllAccess) continue;  // by chance our key is theirs
    QpPath theirs;
    theirs.access = c.peer_qp_access;
    Pair p = pair(IBV_QPT_RC, {}, theirs);
    ASSERT_NE(p.qp, nullptr);
    // Granted first: good requests the peer QP allows until the library executes one itself.
    const auto good_op =
        c.peer_qp_access & IBV_ACCESS_REMOTE_READ ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
    const auto until = Clock::now() + std::chrono::seconds(20);
    do {
      const ibv_wc wc =
          run(p.qp, {.op = good_op, .sges = {sge(512, 8)}, .raddr = remote + kGood, .rkey = rkey});
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << c.what << ": " << ibv_wc_status_str(wc.status);
    } while (direct_path_on() && direct_sent(p.qp) == 0 && Clock::now() < until);
    const uint64_t before = direct_sent(p.qp);
    if (direct_path_on()) {
      ASSERT_GT(before, 0u) << c.what << ": the direct path was not granted in 20 s";
    }
    const bool atomic = c.op == kCas || c.op == kFaa;
    std::memset(buf_.data(), 0x77, 64);
    // Executed, an atomic would change the peer's zeros (compare 0, swap 5; add 1).
    const ibv_wc wc = run(p.qp, {.op = c.op,
                                 .sges = {sge(0, atomic ? 8 : 64)},
                                 .raddr = c.raddr,
                                 .rkey = c.rkey,
                                 .compare_add = c.op == kCas ? 0u : 1u,
                                 .swap = 5});
    EXPECT_EQ(wc.status, c.want) << c.what << ": " << ibv_wc_status_str(wc.status);
    EXPECT_EQ(state(p.qp), IBV_QPS_ERR) << c.what << ": the requester's QP is in ERR";
    EXPECT_EQ(direct_sent(p.qp), before) << c.what << ": the library executed it";
    EXPECT_EQ(std::vector<uint8_t>(buf_.begin(), buf_.begin() + 64), std::vector<uint8_t>(64, 0x77))
        << c.what << ": nothing landed here";
  }
  EXPECT_EQ(peer_.read(0, 64), std::vector<uint8_t>(64, 0)) << "no byte of the peer changed";
  EXPECT_EQ(peer_.read(size - 32, 32), std::vector<uint8_t>(32, 0));
  EXPECT_EQ(peer_.dereg_mr(), 0);
}

// ---- Memory windows (issue 24) ----------------------------------------------------------------
// The peer binds windows over its second MR (registered with MW_BIND) through its QPs, which
// allow binds; we reach them by rkey. Each error moves our QP to ERR: a fresh pair per error.

constexpr unsigned kRemoteAll =
    IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

class Windows : public Conformance {
 protected:
  void SetUp() override {
    Conformance::SetUp();
    if (HasFatalFailure()) return;
    // Across backends (e2e.conformance_remote) a QP that may bind windows stays on the
    // backends, and the others reach windows through their library (ARCHITECTURE.md, "Memory
    // windows").
    mem_ = peer_.reg_mr(kAllAccess | IBV_ACCESS_MW_BIND);
    ASSERT_NE(mem_.rkey, 0u);
  }
  /// An RC pair whose peer QP may bind windows.
  Pair bind_pair() {
    QpPath theirs;
    theirs.access = kAllAccess | IBV_ACCESS_MW_BIND;
    return pair(IBV_QPT_RC, {}, theirs);
  }
  /// The peer's next completion (a bind's or an invalidation's).
  ibv_wc peer_wc() {
    auto wcs = peer_.poll(1);
    ibv_wc none{};
    none.status = IBV_WC_GENERAL_ERR;
    return wcs.empty() ? none : wcs[0];
  }
  ibv_wc_status write(ibv_qp* qp, uint64_t off, uint32_t len, uint32_t rkey) {
    return run(qp, {.op = IBV_WR_RDMA_WRITE,
                    .sges = {sge(0, len)},
                    .raddr = mem_.addr + off,
                    .rkey = rkey})
        .status;
  }
  ibv_wc_status read(ibv_qp* qp, uint64_t off, uint32_t len, uint32_t rkey) {
    return run(qp, {.op = IBV_WR_RDMA_READ,
                    .sges = {sge(4096, len)},
                    .raddr = mem_.addr + off,
                    .rkey = rkey})
        .status;
  }
  vrdma::test::PeerMem mem_{};
};

TEST_F(Windows, AreAdvertisedWithTheirLimit) {
  ibv_device_attr d{};
  ASSERT_EQ(ibv_query_device(ctx_, &d), 0);
  EXPECT_NE(d.device_cap_flags & IBV_DEVICE_MEM_WINDOW, 0u);
  EXPECT_NE(d.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B, 0u);
  EXPECT_NE(d.device_cap_flags & IBV_DEVICE_MEM_MGT_EXTENSIONS, 0u);
  EXPECT_GT(d.max_mw, 0);
  ibv_device_attr_ex x{};
  ASSERT_EQ(ibv_query_device_ex(ctx_, nullptr, &x), 0);
  EXPECT_EQ(x.orig_attr.max_mw, d.max_mw);
  // Windows of our own: allocated and freed; the type is checked.
  ibv_mw* one = ibv_alloc_mw(pd_, IBV_MW_TYPE_1);
  ASSERT_NE(one, nullptr) << std::strerror(errno);
  EXPECT_EQ(one->type, IBV_MW_TYPE_1);
  EXPECT_EQ(one->pd, pd_);
  EXPECT_EQ(ibv_alloc_mw(pd_, static_cast<ibv_mw_type>(7)), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_dealloc_mw(one), 0);
}

TEST_F(Windows, Type1BindReachesOnlyTheWindowUntilUnbound) {
  Pair p = bind_pair();
  ASSERT_NE(p.qp, nullptr);
  const auto w = peer_.alloc_mw(IBV_MW_TYPE_1);
  ASSERT_NE(w.index, ~0u);
  uint32_t rkey = 0;
  ASSERT_EQ(peer_.bind_mw(p.peer, w, 4096, 8192, kRemoteAll, 7, &rkey), 0);
  const ibv_wc b = peer_wc();
  EXPECT_EQ(b.status, IBV_WC_SUCCESS) << ibv_wc_status_str(b.status);
  EXPECT_EQ(b.opcode, IBV_WC_BIND_MW);
  EXPECT_EQ(b.wr_id, 7u);
  EXPECT_EQ(rkey >> 8, w.rkey >> 8) << "the index stays";
  EXPECT_EQ(rkey & 0xff, ibv_inc_rkey(w.rkey) & 0xff) << "the key moves on (ibv_inc_rkey)";
  // WRITE, then READ back, then an atomic, all through the window.
  fill(buf_.data(), 256, 3);
  EXPECT_EQ(write(p.qp, 4096 + 100, 256, rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(read(p.qp, 4096 + 100, 256, rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 4096, 256), 0);
  std::memset(buf_.data(), 0, 8);
  const ibv_wc a = run(p.qp, {.op = IBV_WR_ATOMIC_FETCH_AND_ADD,
                              .sges = {sge(0, 8)},
                              .raddr = mem_.addr + 8192,
                              .rkey = rkey,
                              .compare_add = 5});
  EXPECT_EQ(a.status, IBV_WC_SUCCESS) << ibv_wc_status_str(a.status);
  // The MR under a bound window stays: ibv_dereg_mr(3) fails while one is bound.
  EXPECT_EQ(peer_.dereg_mr(), EBUSY);
  // One byte outside the window, at either end: the requester gets REM_ACCESS_ERR.
  EXPECT_EQ(write(p.qp, 4096 + 8192 - 8, 16, rkey), IBV_WC_REM_ACCESS_ERR);
  Pair q = bind_pair();
  ASSERT_NE(q.qp, nullptr);
  EXPECT_EQ(read(q.qp, 4096 - 1, 8, rkey), IBV_WC_REM_ACCESS_ERR);
  // Rebound read-only: the old rkey is dead, and the new one does not write.
  Pair r = bind_pair();
  ASSERT_NE(r.qp, nullptr);
  uint32_t ro = 0;
  ASSERT_EQ(peer_.bind_mw(r.peer, w, 0, 4096, IBV_ACCESS_REMOTE_READ, 8, &ro), 0);
  EXPECT_EQ(peer_wc().status, IBV_WC_SUCCESS);
  EXPECT_EQ(read(r.qp, 0, 64, ro), IBV_WC_SUCCESS);
  EXPECT_EQ(read(r.qp, 0, 64, rkey), IBV_WC_REM_ACCESS_ERR) << "the rkey of the previous bind";
  Pair s = bind_pair();
  ASSERT_NE(s.qp, nullptr);
  EXPECT_EQ(write(s.qp, 0, 64, ro), IBV_WC_REM_ACCESS_ERR) << "a read-only window";
  // Unbound (a bind of length 0): nothing is reachable through it.
  Pair t = bind_pair();
  ASSERT_NE(t.qp, nullptr);
  uint32_t none = 0;
  ASSERT_EQ(peer_.bind_mw(t.peer, w, 0, 0, 0, 9, &none), 0);
  EXPECT_EQ(peer_wc().status, IBV_WC_SUCCESS);
  EXPECT_EQ(read(t.qp, 0, 64, none), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(peer_.dealloc_mw(w), 0);
}

TEST_F(Windows, Type2IsOwnedByItsQpAndInvalidatedLocallyOrBySendWithInvalidate) {
  Pair p = bind_pair(), other = bind_pair();
  ASSERT_NE(p.qp, nullptr);
  ASSERT_NE(other.qp, nullptr);
  const auto w = peer_.alloc_mw(IBV_MW_TYPE_2);
  ASSERT_NE(w.index, ~0u);
  uint32_t rkey = 0;
  ASSERT_EQ(peer_.bind_mw(p.peer, w, 0, 4096, kRemoteAll, 11, &rkey), 0);
  ibv_wc b = peer_wc();
  EXPECT_EQ(b.status, IBV_WC_SUCCESS) << ibv_wc_status_str(b.status);
  EXPECT_EQ(b.opcode, IBV_WC_BIND_MW);
  EXPECT_EQ(write(p.qp, 0, 64, rkey), IBV_WC_SUCCESS);
  // Type 2B: only through the QP it was bound on.
  EXPECT_EQ(write(other.qp, 0, 64, rkey), IBV_WC_REM_ACCESS_ERR) << "another QP of the peer";
  // A bound type 2 window takes no second bind: MW_BIND_ERR, and the peer's QP fails.
  Pair busy = bind_pair();
  ASSERT_NE(busy.qp, nullptr);
  // Local invalidation, then nothing is reachable.
  ASSERT_EQ(peer_.local_inv(p.peer, rkey, 12), 0);
  const ibv_wc inv = peer_wc();
  EXPECT_EQ(inv.status, IBV_WC_SUCCESS) << ibv_wc_status_str(inv.status);
  EXPECT_EQ(inv.opcode, IBV_WC_LOCAL_INV);
  EXPECT_EQ(read(p.qp, 0, 64, rkey), IBV_WC_REM_ACCESS_ERR) << "after LOCAL_INV";
  // Bound again (through another QP, with the next key), then a SEND_WITH_INV invalidates it:
  // the receive says so.
  uint32_t again = 0;
  ASSERT_EQ(peer_.bind_mw(busy.peer, w, 0, 4096, kRemoteAll, 13, &again), 0);
  EXPECT_EQ(peer_wc().status, IBV_WC_SUCCESS);
  EXPECT_NE(again, rkey);
  EXPECT_EQ(read(busy.qp, 0, 64, again), IBV_WC_SUCCESS);
  ASSERT_EQ(peer_.post_recv(busy.peer, 14, 65536, 4096), 0);
  ibv_sge sg = sge(0, 32);
  ibv_send_wr wr{};
  wr.wr_id = 15;
  wr.sg_list = &sg;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND_WITH_INV;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.invalidate_rkey = again;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(busy.qp, &wr, &bad), 0);
  auto sent = poll(cq_, 1);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(sent[0].status);
  EXPECT_EQ(sent[0].opcode, IBV_WC_SEND);
  const ibv_wc rx = peer_wc();
  EXPECT_EQ(rx.status, IBV_WC_SUCCESS) << ibv_wc_status_str(rx.status);
  EXPECT_EQ(rx.opcode, IBV_WC_RECV);
  EXPECT_EQ(rx.byte_len, 32u);
  EXPECT_NE(rx.wc_flags & IBV_WC_WITH_INV, 0u);
  EXPECT_EQ(rx.invalidated_rkey, again);
  EXPECT_EQ(read(busy.qp, 0, 64, again), IBV_WC_REM_ACCESS_ERR) << "after SEND_WITH_INV";
  // A SEND_WITH_INV of an rkey that is no bound window: REM_INV_REQ_ERR for us, the receive
  // fails at the peer.
  Pair x = bind_pair();
  ASSERT_NE(x.qp, nullptr);
  ASSERT_EQ(peer_.post_recv(x.peer, 16, 65536, 4096), 0);
  wr.invalidate_rkey = again;
  ASSERT_EQ(ibv_post_send(x.qp, &wr, &bad), 0);
  sent = poll(cq_, 1);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(sent[0].status);
  EXPECT_EQ(peer_wc().status, IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(peer_.dealloc_mw(w), 0);
}

// IBV_ACCESS_ZERO_BASED in a bind: the window is addressed from 0, whatever its place in the
// MR; an address as the MR names it is outside such a window.
TEST_F(Windows, ZeroBasedWindowsAreAddressedFromZero) {
  for (ibv_mw_type type : {IBV_MW_TYPE_1, IBV_MW_TYPE_2}) {
    Pair p = bind_pair();
    ASSERT_NE(p.qp, nullptr);
    const auto w = peer_.alloc_mw(type);
    ASSERT_NE(w.index, ~0u);
    uint32_t rkey = 0;
    ASSERT_EQ(peer_.bind_mw(p.peer, w, 4096, 8192, kRemoteAll | IBV_ACCESS_ZERO_BASED, 31, &rkey),
              0);
    const ibv_wc b = peer_wc();
    ASSERT_EQ(b.status, IBV_WC_SUCCESS) << ibv_wc_status_str(b.status) << ", type " << type;
    // Offset 100 of the window is byte 4096 + 100 of the MR: read back through the MR's rkey.
    fill(buf_.data(), 256, 5 + type);
    EXPECT_EQ(
        run(p.qp, {.op = IBV_WR_RDMA_WRITE, .sges = {sge(0, 256)}, .raddr = 100, .rkey = rkey})
            .status,
        IBV_WC_SUCCESS);
    EXPECT_EQ(read(p.qp, 4096 + 100, 256, mem_.rkey), IBV_WC_SUCCESS);
    EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 4096, 256), 0) << "type " << type;
    std::memset(buf_.data() + 4096, 0, 256);
    EXPECT_EQ(
        run(p.qp, {.op = IBV_WR_RDMA_READ, .sges = {sge(4096, 256)}, .raddr = 100, .rkey = rkey})
            .status,
        IBV_WC_SUCCESS);
    EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 4096, 256), 0) << "type " << type;
    const ibv_wc a = run(p.qp, {.op = IBV_WR_ATOMIC_FETCH_AND_ADD,
                                .sges = {sge(0, 8)},
                                .raddr = 8192 - 8,
                                .rkey = rkey,
                                .compare_add = 1});
    EXPECT_EQ(a.status, IBV_WC_SUCCESS) << ibv_wc_status_str(a.status);
    // Past its end, and at the MR's address of its first byte: REM_ACCESS_ERR.
    EXPECT_EQ(
        run(p.qp,
            {.op = IBV_WR_RDMA_READ, .sges = {sge(4096, 16)}, .raddr = 8192 - 8, .rkey = rkey})
            .status,
        IBV_WC_REM_ACCESS_ERR);
    Pair q = bind_pair();
    ASSERT_NE(q.qp, nullptr);
    if (type == IBV_MW_TYPE_1) {  // a type 2 window is reached through p's QP only
      EXPECT_EQ(write(q.qp, 4096, 8, rkey), IBV_WC_REM_ACCESS_ERR) << "an MR address";
    }
    EXPECT_EQ(peer_.dealloc_mw(w), 0);
  }
}

TEST_F(Windows, ABadBindIsMwBindError) {
  struct Case {
    uint64_t off, len;
    bool main_mr;
    const char* what;
  };
  const Case cases[] = {
      {0, 4096, true, "MR without MW_BIND"},
      {65536 - 4096, 8192, false, "window past the MR's end"},
  };
  for (const Case& c : cases) {
    for (ibv_mw_type type : {IBV_MW_TYPE_1, IBV_MW_TYPE_2}) {
      Pair p = bind_pair();
      ASSERT_NE(p.qp, nullptr);
      const auto w = peer_.alloc_mw(type);
      uint32_t rkey = 0;
      ASSERT_EQ(peer_.bind_mw(p.peer, w, c.off, c.len, kRemoteAll, 21, &rkey, c.main_mr), 0);
      const ibv_wc b = peer_wc();
      EXPECT_EQ(b.status, IBV_WC_MW_BIND_ERR) << c.what << ", type " << type;
      EXPECT_EQ(peer_.qp_state(p.peer), IBV_QPS_ERR) << c.what;
      EXPECT_EQ(peer_.dealloc_mw(w), 0);
    }
  }
  // A QP without MW_BIND in its access flags binds nothing.
  Pair p = pair(IBV_QPT_RC);
  ASSERT_NE(p.qp, nullptr);
  const auto w = peer_.alloc_mw(IBV_MW_TYPE_2);
  uint32_t rkey = 0;
  ASSERT_EQ(peer_.bind_mw(p.peer, w, 0, 4096, kRemoteAll, 22, &rkey), 0);
  EXPECT_EQ(peer_wc().status, IBV_WC_MW_BIND_ERR) << "QP without MW_BIND";
  EXPECT_EQ(peer_.dealloc_mw(w), 0);
}

// A window allocated after a QP of the peer connected, bound through another QP of the peer
// (one that may bind: it stays on the backends), reached through the first: across backends
// that QP's library answers us itself and asks its backend what the window is (kMwView) at each
// request, so binds, rebinds and unbinds through any QP are seen as they happen.
TEST_F(Windows, AWindowBoundLaterThroughAnotherQpIsReachedThroughEveryQpOfItsPd) {
  Pair p = pair(IBV_QPT_RC), b = bind_pair();
  ASSERT_NE(p.qp, nullptr);
  ASSERT_NE(b.qp, nullptr);
  ASSERT_TRUE(reach_library_path(p.qp)) << "a QP whose peer binds no window: library to library";
  ASSERT_TRUE(reads(b.qp, 100));
  EXPECT_FALSE(library_path(b.qp)) << "a QP whose peer may bind windows stays on the backends";
  const auto w = peer_.alloc_mw(IBV_MW_TYPE_1);
  ASSERT_NE(w.index, ~0u);
  uint32_t rkey = 0;
  ASSERT_EQ(peer_.bind_mw(b.peer, w, 4096, 8192, kRemoteAll, 1, &rkey), 0);
  EXPECT_EQ(peer_wc().status, IBV_WC_SUCCESS);
  fill(buf_.data(), 256, 11);
  EXPECT_EQ(write(p.qp, 4096 + 100, 256, rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(read(p.qp, 4096 + 100, 256, rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 4096, 256), 0);
  std::memset(buf_.data() + 4096, 0, 256);
  EXPECT_EQ(read(p.qp, 4096 + 100, 256, mem_.rkey), IBV_WC_SUCCESS) << "the MR's bytes";
  EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 4096, 256), 0);
  const ibv_wc a = run(p.qp, {.op = IBV_WR_ATOMIC_FETCH_AND_ADD,
                              .sges = {sge(0, 8)},
                              .raddr = mem_.addr + 8192,
                              .rkey = rkey,
                              .compare_add = 5});
  EXPECT_EQ(a.status, IBV_WC_SUCCESS) << ibv_wc_status_str(a.status);
  EXPECT_EQ(a.opcode, IBV_WC_FETCH_ADD);
  EXPECT_EQ(read(p.qp, 8192, 8, mem_.rkey), IBV_WC_SUCCESS);
  uint64_t v = 0;
  std::memcpy(&v, buf_.data() + 4096, 8);
  EXPECT_EQ(v, 5u) << "the atomic went through the window";
  if (across_) {
    EXPECT_TRUE(library_path(p.qp)) << "still library to library";
  }
  EXPECT_EQ(write(p.qp, 4096 + 8192 - 8, 16, rkey), IBV_WC_REM_ACCESS_ERR) << "past its end";
  // Rebound read-only through b, then unbound: each seen at the next request.
  Pair q = pair(IBV_QPT_RC);
  ASSERT_NE(q.qp, nullptr);
  uint32_t ro = 0;
  ASSERT_EQ(peer_.bind_mw(b.peer, w, 0, 4096, IBV_ACCESS_REMOTE_READ, 2, &ro), 0);
  EXPECT_EQ(peer_wc().status, IBV_WC_SUCCESS);
  ASSERT_TRUE(reach_library_path(q.qp));
  EXPECT_EQ(read(q.qp, 0, 64, ro), IBV_WC_SUCCESS);
  EXPECT_EQ(write(q.qp, 0, 64, ro), IBV_WC_REM_ACCESS_ERR) << "a read-only window";
  Pair t = pair(IBV_QPT_RC);
  ASSERT_NE(t.qp, nullptr);
  ASSERT_TRUE(reach_library_path(t.qp));
  EXPECT_EQ(read(t.qp, 0, 64, rkey), IBV_WC_REM_ACCESS_ERR) << "the rkey of the previous bind";
  uint32_t none = 0;
  ASSERT_EQ(peer_.bind_mw(b.peer, w, 0, 0, 0, 3, &none), 0);
  EXPECT_EQ(peer_wc().status, IBV_WC_SUCCESS);
  Pair u = pair(IBV_QPT_RC);
  ASSERT_NE(u.qp, nullptr);
  ASSERT_TRUE(reach_library_path(u.qp));
  EXPECT_EQ(read(u.qp, 0, 64, none), IBV_WC_REM_ACCESS_ERR) << "unbound";
  EXPECT_EQ(peer_.dealloc_mw(w), 0);
}

// Type 2 across the library path: a window bound through the peer QP that answers us (it gained
// MW_BIND after its library took our connection, so its binds went to its backend) is reached
// through it and invalidated by our SEND_WITH_INV; one bound through another QP is neither; a
// SEND_WITH_INV of it fails both sides.
TEST_F(Windows, Type2WindowsAndSendWithInvalidateThroughTheQpThatAnswers) {
  Pair p = pair(IBV_QPT_RC), b = bind_pair();
  ASSERT_NE(p.qp, nullptr);
  ASSERT_NE(b.qp, nullptr);
  ASSERT_TRUE(reach_library_path(p.qp));
  ASSERT_EQ(peer_.set_access(p.peer, kAllAccess | IBV_ACCESS_MW_BIND), 0);
  const auto w = peer_.alloc_mw(IBV_MW_TYPE_2), other = peer_.alloc_mw(IBV_MW_TYPE_2);
  ASSERT_NE(w.index, ~0u);
  ASSERT_NE(other.index, ~0u);
  uint32_t rkey = 0, orkey = 0;
  ASSERT_EQ(peer_.bind_mw(p.peer, w, 0, 4096, kRemoteAll, 1, &rkey), 0);
  EXPECT_EQ(peer_wc().status, IBV_WC_SUCCESS);
  ASSERT_EQ(peer_.bind_mw(b.peer, other, 0, 4096, kRemoteAll, 2, &orkey), 0);
  EXPECT_EQ(peer_wc().status, IBV_WC_SUCCESS);
  fill(buf_.data(), 64, 12);
  EXPECT_EQ(write(p.qp, 64, 64, rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(read(p.qp, 64, 64, rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 4096, 64), 0);
  if (across_) {
    EXPECT_TRUE(library_path(p.qp));
  }
  auto send_inv = [&](ibv_qp* qp, uint32_t key, uint64_t wr_id) {
    ibv_sge sg = sge(0, 32);
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sg;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND_WITH_INV;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.invalidate_rkey = key;
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(ibv_post_send(qp, &wr, &bad), 0);
    auto wcs = poll(cq_, 1);
    ibv_wc none{};
    none.status = IBV_WC_GENERAL_ERR;
    return wcs.empty() ? none : wcs[0];
  };
  ASSERT_EQ(peer_.post_recv(p.peer, 3, 65536, 4096), 0);
  const ibv_wc s = send_inv(p.qp, rkey, 4);
  EXPECT_EQ(s.status, IBV_WC_SUCCESS) << ibv_wc_status_str(s.status);
  EXPECT_EQ(s.opcode, IBV_WC_SEND);
  EXPECT_EQ(s.wr_id, 4u);
  const ibv_wc rx = peer_wc();
  EXPECT_EQ(rx.status, IBV_WC_SUCCESS) << ibv_wc_status_str(rx.status);
  EXPECT_EQ(rx.opcode, IBV_WC_RECV);
  EXPECT_EQ(rx.byte_len, 32u);
  EXPECT_EQ(rx.wc_flags & (IBV_WC_WITH_INV | IBV_WC_WITH_IMM), unsigned{IBV_WC_WITH_INV});
  EXPECT_EQ(rx.invalidated_rkey, rkey);
  EXPECT_EQ(rx.wr_id, 3u);
  EXPECT_EQ(peer_.read(65536, 32), std::vector<uint8_t>(buf_.begin(), buf_.begin() + 32));
  EXPECT_EQ(read(p.qp, 0, 64, rkey), IBV_WC_REM_ACCESS_ERR) << "after SEND_WITH_INV";
  // Bound through b: not through the QP that answers q, nor invalidated by q's SEND_WITH_INV.
  Pair q = pair(IBV_QPT_RC);
  ASSERT_NE(q.qp, nullptr);
  ASSERT_TRUE(reach_library_path(q.qp));
  EXPECT_EQ(write(q.qp, 0, 64, orkey), IBV_WC_REM_ACCESS_ERR) << "another QP's type 2 window";
  Pair x = pair(IBV_QPT_RC);
  ASSERT_NE(x.qp, nullptr);
  ASSERT_TRUE(reach_library_path(x.qp));
  ASSERT_EQ(peer_.post_recv(x.peer, 5, 65536, 4096), 0);
  EXPECT_EQ(send_inv(x.qp, orkey, 6).status, IBV_WC_REM_INV_REQ_ERR);
  EXPECT_EQ(state(x.qp), IBV_QPS_ERR);
  const ibv_wc failed = peer_wc();
  EXPECT_EQ(failed.status, IBV_WC_LOC_PROT_ERR) << ibv_wc_status_str(failed.status);
  EXPECT_EQ(failed.wr_id, 5u);
  EXPECT_EQ(peer_.qp_state(x.peer), IBV_QPS_ERR);
  EXPECT_EQ(read(b.qp, 0, 64, orkey), IBV_WC_SUCCESS) << "still bound through b";
  EXPECT_EQ(peer_.dealloc_mw(w), 0);
  EXPECT_EQ(peer_.dealloc_mw(other), 0);
}

// Our QP without MW_BIND (across backends: one that talks to the peer's library) binds nothing
// and has no window to invalidate: MW_BIND_ERR and LOC_QP_OP_ERR in their turn, after what was
// posted before them, as the backend completes them.
TEST_F(Windows, ABindOrLocalInvalidateOnAQpWithoutMwBindFailsInItsTurn) {
  ibv_mw* mw = ibv_alloc_mw(pd_, IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr) << std::strerror(errno);
  for (ibv_wr_opcode op : {IBV_WR_BIND_MW, IBV_WR_LOCAL_INV}) {
    Pair p = pair(IBV_QPT_RC);
    ASSERT_NE(p.qp, nullptr);
    ASSERT_TRUE(reach_library_path(p.qp));
    ibv_sge sg = sge(0, 64);
    ibv_send_wr w1{}, w2{};
    w1.wr_id = 1;
    w1.sg_list = &sg;
    w1.num_sge = 1;
    w1.opcode = IBV_WR_RDMA_WRITE;
    w1.send_flags = IBV_SEND_SIGNALED;
    w1.wr.rdma.remote_addr = mem_.addr;
    w1.wr.rdma.rkey = mem_.rkey;
    w1.next = &w2;
    w2.wr_id = 2;
    w2.opcode = op;
    w2.send_flags = IBV_SEND_SIGNALED;
    if (op == IBV_WR_BIND_MW) {
      w2.bind_mw.mw = mw;
      w2.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
      w2.bind_mw.bind_info = ibv_mw_bind_info{mr_, addr(0), 4096, IBV_ACCESS_REMOTE_READ};
    } else {
      w2.invalidate_rkey = mw->rkey;
    }
    ibv_send_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_send(p.qp, &w1, &bad), 0);
    const auto wcs = poll(cq_, 2);
    ASSERT_EQ(wcs.size(), 2u);
    EXPECT_EQ(wcs[0].wr_id, 1u);
    EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(wcs[1].wr_id, 2u);
    EXPECT_EQ(wcs[1].status, op == IBV_WR_BIND_MW ? IBV_WC_MW_BIND_ERR : IBV_WC_LOC_QP_OP_ERR)
        << ibv_wc_status_str(wcs[1].status);
    EXPECT_EQ(state(p.qp), IBV_QPS_ERR);
  }
  EXPECT_EQ(ibv_dealloc_mw(mw), 0);
}

// ---- On-demand paging (issue 24) ------------------------------------------------------------
// The peer's second MR is an ODP one over fresh pages nothing has touched, its last page
// PROT_NONE. Our WRITE, READ and atomics are the first touch of their pages: the peer's backend
// finds them missing and the peer's pager faults them in while we wait an RNR timer (one host,
// and through the backends across hosts), or, library to library across backends, the peer's
// library faults them in before it touches them (odp_reach). The PROT_NONE page cannot be:
// REM_ACCESS_ERR for us, and the peer goes on serving.
TEST_F(Conformance, OdpPagesComeInAtAPeersFirstTouchAndAnInaccessibleOneIsRemoteAccessError) {
  const auto m = peer_.reg_mr(kAllAccess | IBV_ACCESS_ON_DEMAND);
  ASSERT_NE(m.rkey, 0u);
  ASSERT_EQ(m.size, 65536u);
  Pair p = pair(IBV_QPT_RC);
  ASSERT_NE(p.qp, nullptr);
  ASSERT_TRUE(reach_library_path(p.qp));
  auto go = [&](ibv_qp* qp, ibv_wr_opcode op, uint64_t off, uint32_t len, uint64_t raddr) {
    return run(qp, {.op = op,
                    .sges = {sge(off, len)},
                    .wr_id = raddr,
                    .raddr = raddr,
                    .rkey = m.rkey,
                    .compare_add = 7});
  };
  // A WRITE across a page boundary, read back.
  fill(buf_.data(), 512, 21);
  ibv_wc wc = go(p.qp, IBV_WR_RDMA_WRITE, 0, 512, m.addr + 4096 - 256);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(wc.wr_id, m.addr + 4096 - 256);
  EXPECT_EQ(wc.qp_num, p.qp->qp_num);
  wc = go(p.qp, IBV_WR_RDMA_READ, 4096, 512, m.addr + 4096 - 256);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(wc.byte_len, 512u);
  EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 4096, 512), 0);
  // A READ is the first touch of its page: zeros.
  std::memset(buf_.data() + 8192, 0xee, 256);
  wc = go(p.qp, IBV_WR_RDMA_READ, 8192, 256, m.addr + 5 * 4096 + 8);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(std::vector<uint8_t>(buf_.begin() + 8192, buf_.begin() + 8192 + 256),
            std::vector<uint8_t>(256, 0));
  // Atomics on a fresh page: the word was 0, then 7.
  for (uint64_t before : {uint64_t{0}, uint64_t{7}}) {
    std::memset(buf_.data(), 0xff, 8);
    wc = go(p.qp, IBV_WR_ATOMIC_FETCH_AND_ADD, 0, 8, m.addr + 8 * 4096);
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    EXPECT_EQ(wc.opcode, IBV_WC_FETCH_ADD);
    EXPECT_EQ(wc.byte_len, 8u);
    uint64_t old = 0;
    std::memcpy(&old, buf_.data(), 8);
    EXPECT_EQ(old, before);
  }
  if (across_) {
    EXPECT_TRUE(library_path(p.qp)) << "across backends, library to library";
  }
  // The PROT_NONE page: a WRITE, a READ, an atomic. Each fails its QP; the peer serves on.
  const uint64_t none = m.addr + 65536 - 4096;
  for (ibv_wr_opcode op : {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ, IBV_WR_ATOMIC_FETCH_AND_ADD}) {
    Pair q = pair(IBV_QPT_RC);
    ASSERT_NE(q.qp, nullptr);
    ASSERT_TRUE(reach_library_path(q.qp));
    const bool atomic = op == IBV_WR_ATOMIC_FETCH_AND_ADD;
    wc = go(q.qp, op, 0, atomic ? 8 : 64, none + 64);
    EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR) << ibv_wc_status_str(wc.status) << ", op " << op;
    EXPECT_EQ(wc.qp_num, q.qp->qp_num);
    EXPECT_EQ(state(q.qp), IBV_QPS_ERR);
    // A WRITE that starts on a good page and ends on the bad one.
    if (op == IBV_WR_RDMA_WRITE) {
      Pair r = pair(IBV_QPT_RC);
      ASSERT_NE(r.qp, nullptr);
      ASSERT_TRUE(reach_library_path(r.qp));
      EXPECT_EQ(go(r.qp, op, 0, 128, none - 64).status, IBV_WC_REM_ACCESS_ERR);
    }
  }
  Pair r = pair(IBV_QPT_RC);
  ASSERT_NE(r.qp, nullptr);
  std::memset(buf_.data() + 4096, 0, 512);
  EXPECT_EQ(go(r.qp, IBV_WR_RDMA_READ, 4096, 512, m.addr + 4096 - 256).status, IBV_WC_SUCCESS);
  std::vector<uint8_t> first(512);
  fill(first.data(), first.size(), 21);
  EXPECT_EQ(std::vector<uint8_t>(buf_.begin() + 4096, buf_.begin() + 4096 + 512), first)
      << "the first WRITE's bytes";
  EXPECT_EQ(peer_.read(0, 8).size(), 8u) << "the peer is alive";
  EXPECT_EQ(peer_.dereg_mr(), 0);
}

// ---- XRC (issue 24) ---------------------------------------------------------------------------
// The peer's XRC target: a private domain, two XRC SRQs completing on its CQ, a receive QP per
// send QP of ours. The SRQ number of each WR chooses where a SEND lands and completes, and the
// PD an RDMA request is checked against. XRC stays on the backends on every path (the direct
// paths are RC's): across backends it takes their TCP path.

/// Our XRC send QP and the peer's receive QP, connected to each other.
struct XrcPair {
  ibv_qp* qp = nullptr;
  vrdma::test::XrcTarget t{};
};

class XrcConformance : public Conformance {
 protected:
  XrcPair xrc_pair(uint32_t depth = 16, ibv_cq* cq = nullptr, QpPath ours = {}) {
    XrcPair p;
    ibv_qp_init_attr_ex a{};
    a.qp_type = IBV_QPT_XRC_SEND;
    a.send_cq = cq ? cq : cq_;
    a.cap.max_send_wr = depth;
    a.cap.max_send_sge = 1;
    a.comp_mask = IBV_QP_INIT_ATTR_PD;
    a.pd = pd_;
    p.qp = ibv_create_qp_ex(ctx_, &a);
    EXPECT_NE(p.qp, nullptr) << std::strerror(errno);
    if (!p.qp) return p;
    qps_.push_back(p.qp);
    p.t = peer_.xrc_open();
    EXPECT_NE(p.t.qp.qpn, 0u);
    QpPath theirs;
    ours.dlid = peer_.lid();
    ours.dest_qpn = p.t.qp.qpn;
    theirs.dlid = lid_;
    theirs.dest_qpn = p.qp->qp_num;
    EXPECT_EQ(bring_to_rts(p.qp, ours), 0);
    EXPECT_EQ(peer_.connect(p.t.qp, theirs), 0);
    return p;
  }
  ibv_wc peer_wc() {
    auto wcs = peer_.poll(1);
    ibv_wc none{};
    none.status = IBV_WC_GENERAL_ERR;
    return wcs.empty() ? none : wcs[0];
  }
};

TEST_F(XrcConformance, TheSrqNumberChoosesTheReceiveItsCompletionAndThePdOfRdma) {
  const XrcPair x = xrc_pair();
  ASSERT_NE(x.qp, nullptr);
  ASSERT_EQ(peer_.post_srq_recv(0, 100, {Piece{0, 256}}), 0);
  ASSERT_EQ(peer_.post_srq_recv(1, 200, {Piece{4096, 256}}), 0);
  // A SEND to SRQ 1 takes SRQ 1's receive, whatever SRQ 0 holds.
  fill(buf_.data(), 256, 31);
  ibv_wc wc =
      run(x.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 100)}, .wr_id = 1, .remote_srqn = x.t.srqn[1]});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.opcode, IBV_WC_SEND);
  EXPECT_EQ(wc.wr_id, 1u);
  EXPECT_EQ(wc.qp_num, x.qp->qp_num);
  ibv_wc rx = peer_wc();
  EXPECT_EQ(rx.status, IBV_WC_SUCCESS) << ibv_wc_status_str(rx.status);
  EXPECT_EQ(rx.wr_id, 200u);
  EXPECT_EQ(rx.opcode, IBV_WC_RECV);
  EXPECT_EQ(rx.byte_len, 100u);
  EXPECT_EQ(rx.qp_num, x.t.qp.qpn) << "the receive QP's";
  EXPECT_EQ(rx.src_qp, x.qp->qp_num);
  EXPECT_EQ(rx.slid, lid_);
  EXPECT_EQ(rx.wc_flags & IBV_WC_WITH_IMM, 0u);
  EXPECT_EQ(peer_.read(4096, 100), std::vector<uint8_t>(buf_.begin(), buf_.begin() + 100));
  // SEND_WITH_IMM to SRQ 0.
  wc = run(x.qp, {.op = IBV_WR_SEND_WITH_IMM,
                  .sges = {sge(0, 64)},
                  .wr_id = 2,
                  .imm = 0x1234,
                  .remote_srqn = x.t.srqn[0]});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  rx = peer_wc();
  EXPECT_EQ(rx.status, IBV_WC_SUCCESS) << ibv_wc_status_str(rx.status);
  EXPECT_EQ(rx.wr_id, 100u);
  EXPECT_EQ(rx.byte_len, 64u);
  EXPECT_NE(rx.wc_flags & IBV_WC_WITH_IMM, 0u);
  EXPECT_EQ(rx.imm_data, htonl(0x1234));
  // RDMA WRITE, READ and FAA through the send QP reach the SRQ's PD (the peer's buffer).
  const uint64_t at = peer_.mem().addr + 8192;
  fill(buf_.data(), 128, 32);
  wc = run(x.qp, {.op = IBV_WR_RDMA_WRITE,
                  .sges = {sge(0, 128)},
                  .wr_id = 3,
                  .raddr = at,
                  .rkey = peer_.mem().rkey,
                  .remote_srqn = x.t.srqn[0]});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(peer_.read(8192, 128), std::vector<uint8_t>(buf_.begin(), buf_.begin() + 128));
  wc = run(x.qp, {.op = IBV_WR_RDMA_READ,
                  .sges = {sge(4096, 128)},
                  .wr_id = 4,
                  .raddr = at,
                  .rkey = peer_.mem().rkey,
                  .remote_srqn = x.t.srqn[1]});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(wc.byte_len, 128u);
  EXPECT_EQ(std::memcmp(buf_.data(), buf_.data() + 4096, 128), 0);
  uint64_t word = 0;
  std::memcpy(&word, buf_.data() + 8, 8);
  wc = run(x.qp, {.op = IBV_WR_ATOMIC_FETCH_AND_ADD,
                  .sges = {sge(16, 8)},
                  .wr_id = 5,
                  .raddr = at + 8,
                  .rkey = peer_.mem().rkey,
                  .compare_add = 3,
                  .remote_srqn = x.t.srqn[0]});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.opcode, IBV_WC_FETCH_ADD);
  uint64_t old = 0;
  std::memcpy(&old, buf_.data() + 16, 8);
  EXPECT_EQ(old, word);
  EXPECT_EQ(peer_word(8192 + 8), word + 3);
  EXPECT_TRUE(peer_.poll(1, 0).empty()) << "RDMA consumed no receive";
}

// Atomics on one word at once from a QP whose library executes them (RC on the direct path) and
// one whose backend does (XRC stays on the backends on every path): both are CPU atomics on the
// same page (IBV_ATOMIC_HCA), so none is lost, whichever path runs each. On every path (on the
// ring, TCP and across backends both QPs are mediated, or the RC one goes between libraries).
TEST_F(XrcConformance, AtomicsOnOneWordFromADirectRcAndAMediatedXrcQpSumExactly) {
#if defined(__SANITIZE_THREAD__)
  constexpr uint32_t kOps = 4096;
#else
  constexpr uint32_t kOps = 32768;
#endif
  constexpr uint32_t kBatch = 64;
  // Through the backends' TCP path a loaded machine can hold an ACK past the default 1 ms
  // timeout three times (RETRY_EXC_ERR, and the sum says nothing): ~270 ms, 7 retries.
  QpPath patient;
  patient.timeout = 16;
  patient.retry_cnt = 7;
  Pair direct = pair(IBV_QPT_RC, patient, {}, 128);
  ASSERT_NE(direct.qp, nullptr);
  ibv_cq* xcq = ibv_create_cq(ctx_, 256, nullptr, nullptr, 0);
  ASSERT_NE(xcq, nullptr);
  cqs_.push_back(xcq);
  const XrcPair x = xrc_pair(128, xcq, patient);
  ASSERT_NE(x.qp, nullptr);
  constexpr uint64_t kWord = 24576;
  const uint64_t start = 1000;
  peer_.write(kWord, &start, 8);

  // FETCH_AND_ADDs of 1 on `qp` in signaled batches (results at `result`), kOps and then on
  // while `until` (if given) is false: how many completed well, and what stopped it if not
  // that (the status of a batch's completion, or "no completion in 30 s").
  struct Storm {
    uint64_t ok = 0;
    std::string failed;
  };
  auto storm = [&](ibv_qp* qp, ibv_cq* cq, uint32_t srqn, size_t result,
                   const std::atomic<bool>* until) {
    Storm r;
    while (r.ok < kOps || (until && !until->load())) {
      for (uint32_t k = 0; k < kBatch; ++k) {
        ibv_sge s = sge(result, 8);
        ibv_send_wr wr{};
        wr.sg_list = &s;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
        wr.send_flags = k == kBatch - 1 ? IBV_SEND_SIGNALED : 0;
        wr.wr.atomic.remote_addr = peer_.mem().addr + kWord;
        wr.wr.atomic.rkey = peer_.mem().rkey;
        wr.wr.atomic.compare_add = 1;
        wr.qp_type.xrc.remote_srqn = srqn;
        ibv_send_wr* bad = nullptr;
        if (int rc = ibv_post_send(qp, &wr, &bad)) {
          r.failed = std::string("ibv_post_send: ") + std::strerror(rc);
          return r;
        }
      }
      ibv_wc wc;
      const auto deadline = Clock::now() + std::chrono::seconds(30);
      int got = 0;
      while ((got = ibv_poll_cq(cq, 1, &wc)) == 0 && Clock::now() < deadline) {
      }
      if (got != 1 || wc.status != IBV_WC_SUCCESS) {
        r.failed = got == 1 ? ibv_wc_status_str(wc.status) : "no completion in 30 s";
        return r;
      }
      r.ok += kBatch;
    }
    return r;
  };
  // The library's are the faster: its QP goes on until the backend's are all done.
  Storm by_xrc;
  std::atomic<bool> xrc_done{false};
  std::thread other([&] {
    by_xrc = storm(x.qp, xcq, x.t.srqn[0], 65536, nullptr);
    xrc_done = true;
  });
  const Storm by_rc = storm(direct.qp, cq_, 0, 65536 + 64, &xrc_done);
  other.join();
  // A failed batch may have been executed in part or in full (an RC retry exhausted): then the
  // sum says nothing.
  ASSERT_EQ(by_rc.failed, "") << "after " << by_rc.ok << " of the RC QP's";
  ASSERT_EQ(by_xrc.failed, "") << "after " << by_xrc.ok << " of the XRC QP's";
  EXPECT_GE(by_rc.ok, kOps);
  EXPECT_EQ(by_xrc.ok, kOps);
  EXPECT_EQ(peer_word(kWord), start + by_rc.ok + by_xrc.ok) << "an update was lost";
  if (direct_path_on()) {
    EXPECT_GT(direct_sent(direct.qp), kOps / 2) << "the library executed few of them";
    EXPECT_EQ(direct_sent(x.qp), 0u) << "the XRC QP went direct";
  }
}

// Each error on a fresh pair (our send QP goes to ERR): a number that names no SRQ of the
// target's domain is REM_INV_REQ_ERR and consumes nothing; a bad rkey REM_ACCESS_ERR; a SEND
// longer than the SRQ's receive REM_INV_REQ_ERR for us and LOC_LEN_ERR for that receive.
TEST_F(XrcConformance, ANumberOfNoSrqABadRkeyOrAShortReceiveFailAsForRc) {
  XrcPair x = xrc_pair();
  ASSERT_NE(x.qp, nullptr);
  uint32_t none = 0xfffffe;
  while (none == x.t.srqn[0] || none == x.t.srqn[1]) --none;
  ASSERT_EQ(peer_.post_srq_recv(0, 300, {Piece{0, 16}}), 0);
  ibv_wc wc = run(x.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 8)}, .wr_id = 6, .remote_srqn = none});
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.wr_id, 6u);
  EXPECT_EQ(state(x.qp), IBV_QPS_ERR);
  EXPECT_TRUE(peer_.poll(1, 0).empty()) << "nothing consumed";
  x = xrc_pair();
  ASSERT_NE(x.qp, nullptr);
  wc = run(x.qp, {.op = IBV_WR_RDMA_WRITE,
                  .sges = {sge(0, 64)},
                  .wr_id = 7,
                  .raddr = peer_.mem().addr,
                  .rkey = peer_.mem().rkey ^ 0x80000000u,
                  .remote_srqn = x.t.srqn[0]});
  EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(state(x.qp), IBV_QPS_ERR);
  x = xrc_pair();
  ASSERT_NE(x.qp, nullptr);
  wc = run(x.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 64)}, .wr_id = 8, .remote_srqn = x.t.srqn[0]});
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(wc.status);
  const ibv_wc rx = peer_wc();
  EXPECT_EQ(rx.status, IBV_WC_LOC_LEN_ERR) << ibv_wc_status_str(rx.status);
  EXPECT_EQ(rx.wr_id, 300u);
}

TEST_F(Conformance, AnMrDeregisteredByThePeerIsNoLongerReachable) {
  const auto m = peer_.reg_mr(kAllAccess);
  ASSERT_NE(m.rkey, 0u);
  Pair w = pair(IBV_QPT_RC), r = pair(IBV_QPT_RC);
  ASSERT_NE(w.qp, nullptr);
  ASSERT_NE(r.qp, nullptr);
  EXPECT_EQ(run(w.qp, {.op = IBV_WR_RDMA_WRITE, .sges = {sge(0, 64)}, .raddr = m.addr,
                       .rkey = m.rkey}).status,
            IBV_WC_SUCCESS);
  ASSERT_EQ(peer_.dereg_mr(), 0);
  EXPECT_EQ(run(w.qp, {.op = IBV_WR_RDMA_WRITE, .sges = {sge(0, 64)}, .raddr = m.addr,
                       .rkey = m.rkey}).status,
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(run(r.qp, {.op = IBV_WR_RDMA_READ, .sges = {sge(0, 64)}, .raddr = m.addr,
                       .rkey = m.rkey}).status,
            IBV_WC_REM_ACCESS_ERR);
}

TEST_F(Conformance, RnrRetryCountThenRnrRetryExceeded) {
  // The peer's min_rnr_timer 18 asks for 5.12 ms between tries: rnr_retry N means N waits.
  constexpr auto kRnrDelay = std::chrono::microseconds(5120);
  QpPath theirs;
  theirs.min_rnr_timer = 18;
  for (uint8_t n = 0; n <= 6; ++n) {
    QpPath ours;
    ours.rnr_retry = n;
    Pair p = pair(IBV_QPT_RC, ours, theirs);
    ASSERT_NE(p.qp, nullptr);
    const auto t0 = Clock::now();
    const ibv_wc wc = run(p.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 64)}});
    const auto took = Clock::now() - t0;
    EXPECT_EQ(wc.status, IBV_WC_RNR_RETRY_EXC_ERR) << "rnr_retry " << int(n);
    EXPECT_GE(took, n * kRnrDelay) << "rnr_retry " << int(n) << ": the waits were not taken";
    EXPECT_EQ(state(p.qp), IBV_QPS_ERR);
  }
  // 7 retries for ever: the send waits (well past 6 retries' worth) until a receive comes.
  QpPath ours;
  ours.rnr_retry = 7;
  Pair p = pair(IBV_QPT_RC, ours, theirs);
  ASSERT_NE(p.qp, nullptr);
  fill(buf_.data(), 64, 7);
  ASSERT_EQ(post(p.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 64)}, .wr_id = 77}), 0);
  EXPECT_TRUE(drain_for(100).empty()) << "rnr_retry 7 never gives up";
  ASSERT_EQ(peer_.post_recv(p.peer, 8, 1024, 64), 0);
  auto wcs = poll(cq_, 1);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(wcs[0].wr_id, 77u);
  auto rx = peer_.poll(1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(peer_.read(1024, 64), std::vector<uint8_t>(buf_.begin(), buf_.begin() + 64));
}

TEST_F(Conformance, ReceiveTooSmallIsLocalLengthAndRemoteInvalidRequest) {
  Pair p = pair(IBV_QPT_RC);
  ASSERT_NE(p.qp, nullptr);
  ASSERT_EQ(peer_.post_recv(p.peer, 3, 0, 16), 0);
  const ibv_wc wc = run(p.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 64)}});
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(wc.status);
  auto rx = peer_.poll(1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 3u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_LEN_ERR) << ibv_wc_status_str(rx[0].status);
  EXPECT_EQ(state(p.qp), IBV_QPS_ERR);
  EXPECT_EQ(peer_.qp_state(p.peer), IBV_QPS_ERR);
  // UD: a datagram longer than the receive (after its 40 bytes of GRH) fails on the receiver.
  Pair u = pair(IBV_QPT_UD);
  ASSERT_NE(u.qp, nullptr);
  ASSERT_EQ(peer_.post_recv(u.peer, 4, 0, 40 + 16), 0);
  EXPECT_EQ(run(u.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 64)}, .ah = peer_ah(),
                       .remote_qpn = u.peer.qpn}).status,
            IBV_WC_SUCCESS)
      << "UD is unreliable: the sender does not learn";
  rx = peer_.poll(1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_LEN_ERR);
}

TEST_F(Conformance, WorkOutstandingAtErrorIsFlushedInOrder) {
  Pair p = pair(IBV_QPT_RC);
  ASSERT_NE(p.qp, nullptr);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_EQ(post_recv(p.qp, 100 + i, 4096 * i, 64), 0);
  // The first WR fails (bad rkey); the rest, signaled or not, are flushed behind it.
  ibv_send_wr wrs[6]{};
  ibv_sge s = sge(0, 64);
  for (int i = 0; i < 6; ++i) {
    wrs[i].wr_id = i + 1;
    wrs[i].sg_list = &s;
    wrs[i].num_sge = 1;
    wrs[i].opcode = IBV_WR_RDMA_WRITE;
    wrs[i].send_flags = i % 2 ? 0 : IBV_SEND_SIGNALED;
    wrs[i].wr.rdma = {peer_.mem().addr, i == 0 ? peer_.mem().rkey ^ 0x80000000u : peer_.mem().rkey};
    wrs[i].next = i < 5 ? &wrs[i + 1] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(p.qp, wrs, &bad), 0);
  auto wcs = poll(cq_, 9);
  ASSERT_EQ(wcs.size(), 9u);
  std::vector<uint64_t> send_ids, recv_ids;
  for (const ibv_wc& wc : wcs) {
    EXPECT_EQ(wc.qp_num, p.qp->qp_num);
    if (wc.wr_id >= 100) {
      recv_ids.push_back(wc.wr_id);
      EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
    } else {
      send_ids.push_back(wc.wr_id);
      EXPECT_EQ(wc.status, wc.wr_id == 1 ? IBV_WC_REM_ACCESS_ERR : IBV_WC_WR_FLUSH_ERR)
          << "wr " << wc.wr_id;
    }
  }
  EXPECT_EQ(send_ids, (std::vector<uint64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(recv_ids, (std::vector<uint64_t>{100, 101, 102}));
  EXPECT_EQ(state(p.qp), IBV_QPS_ERR);
  // Work posted to a QP in ERR completes at once, flushed.
  ASSERT_EQ(post(p.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 8)}, .flags = 0, .wr_id = 7}), 0);
  ASSERT_EQ(post_recv(p.qp, 103, 0, 64), 0);
  wcs = poll(cq_, 2);
  ASSERT_EQ(wcs.size(), 2u);
  for (const ibv_wc& wc : wcs) EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR) << wc.wr_id;
  EXPECT_EQ(peer_.read(0, 64), std::vector<uint8_t>(64, 0)) << "no flushed WRITE was executed";
}

// A snapshot of our guest while SENDs and READs are in flight, some of them waiting for
// receives the peer posts only once the snapshot has begun (RNR, retried for ever): nothing is
// lost, repeated or reordered, on any path. Across backends between libraries
// (e2e.conformance_remote) the snapshot first takes the pair back to the backends: what went
// through the libraries settles there (the receives let the dropped SENDs through), and the
// second half goes through the backends, or directly again once the pair has settled (its
// libraries start afresh after the snapshot): in order either way.
TEST_F(Conformance, ASnapshotWithWorkInFlightKeepsEveryMessageOnceAndInOrder) {
  char self[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(n, 0);
  const std::string bin = std::string(self, static_cast<size_t>(n));
  const std::string cli = bin.substr(0, bin.rfind('/')) + "/vrdma";
  if (::access(cli.c_str(), X_OK) != 0) GTEST_SKIP() << "no vrdma CLI beside the test";
  constexpr uint32_t kMsgs = 64, kLen = 64, kHalf = kMsgs / 2, kEarly = 4;
  constexpr uint64_t kReadAt = 256 * 1024;  // READs land here in ours, come from there in theirs
  Pair p = pair(IBV_QPT_RC, {}, {}, kMsgs);
  ASSERT_NE(p.qp, nullptr);
  // Across backends: until our library sends to the peer's itself (it asks for the peer's
  // offer at a post, and again after a back-off while that has not reached our backend).
  const bool across = std::getenv("VRDMA_TEST_PEER_SOCKET") != nullptr;
  auto direct = [&] {
    const auto* r = vrdma::verbs::to_vqp(p.qp)->remote.get();
    return r && r->active.load();
  };
  // SENDs one at a time until it does (at most 30 s: the asks back off).
  auto until_direct = [&](uint64_t id) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (; !direct() && std::chrono::steady_clock::now() < end; ++id) {
      ASSERT_EQ(peer_.post_recv(p.peer, id, 512 * 1024, kLen), 0);
      ASSERT_EQ(run(p.qp, {.op = IBV_WR_SEND, .sges = {sge(0, kLen)}, .wr_id = id}).status,
                IBV_WC_SUCCESS);
      ASSERT_EQ(peer_.poll(1).size(), 1u);
    }
  };
  if (across) {
    until_direct(9000);
    ASSERT_TRUE(direct()) << "the pair never took the direct path across backends";
  }
  auto is_read = [](uint32_t i) { return i % 4 == 3; };
  std::vector<uint32_t> send_ids;
  for (uint32_t i = 0; i < kMsgs; ++i) {
    fill(buf_.data() + i * kLen, kLen, i);
    std::vector<uint8_t> theirs(kLen);
    fill(theirs.data(), kLen, 1000 + i);
    peer_.write(kReadAt + i * kLen, theirs.data(), kLen);
    if (!is_read(i)) send_ids.push_back(i);
  }
  auto post_recvs = [&](size_t from, size_t to) {
    for (size_t k = from; k < to; ++k)
      ASSERT_EQ(peer_.post_recv(p.peer, 500 + send_ids[k], k * kLen, kLen), 0);
  };
  post_recvs(0, kEarly);
  auto post_one = [&](uint32_t i) {
    if (is_read(i))
      return post(p.qp, {.op = IBV_WR_RDMA_READ,
                         .sges = {sge(kReadAt + i * kLen, kLen)},
                         .wr_id = i,
                         .raddr = peer_.mem().addr + kReadAt + i * kLen,
                         .rkey = peer_.mem().rkey});
    return post(p.qp, {.op = IBV_WR_SEND, .sges = {sge(i * kLen, kLen)}, .wr_id = i});
  };
  for (uint32_t i = 0; i < kHalf; ++i) ASSERT_EQ(post_one(i), 0) << i;
  char file[] = "/tmp/vrdma-conformance-snapshot.XXXXXX";
  const int fd = ::mkstemp(file);
  ASSERT_GE(fd, 0);
  ::close(fd);
  const std::string guest = vrdma::verbs::to_vctx(ctx_)->guest;
  const char* sock = std::getenv("VRDMA_SOCKET");
  ASSERT_NE(sock, nullptr);
  const pid_t snap = ::fork();
  ASSERT_GE(snap, 0);
  if (snap == 0) {
    ::execl(cli.c_str(), "vrdma", "snapshot", guest.c_str(), file, "--socket", sock,
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // The snapshot waits (across backends: the revoke does) while SENDs find no receive; the
  // receives come a little later (no timing is asserted: any order gives the same outcome).
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  post_recvs(kEarly, send_ids.size());
  int status = 0;
  ASSERT_EQ(::waitpid(snap, &status, 0), snap);
  ::unlink(file);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "vrdma snapshot: " << status;
  if (across) {
    EXPECT_FALSE(direct()) << "still direct after the snapshot";
  }
  for (uint32_t i = kHalf; i < kMsgs; ++i) ASSERT_EQ(post_one(i), 0) << i;
  auto wcs = poll(cq_, kMsgs);
  ASSERT_EQ(wcs.size(), kMsgs);
  for (uint32_t i = 0; i < kMsgs; ++i) {
    EXPECT_EQ(wcs[i].wr_id, i) << "completions out of order";
    EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS) << i;
    EXPECT_EQ(wcs[i].opcode, is_read(i) ? IBV_WC_RDMA_READ : IBV_WC_SEND) << i;
  }
  auto rx = peer_.poll(send_ids.size());
  ASSERT_EQ(rx.size(), send_ids.size());
  std::vector<uint8_t> want(kLen);
  for (size_t k = 0; k < send_ids.size(); ++k) {
    EXPECT_EQ(rx[k].wr_id, 500 + send_ids[k]) << "receives out of order";
    EXPECT_EQ(rx[k].status, IBV_WC_SUCCESS);
    fill(want.data(), kLen, send_ids[k]);
    EXPECT_EQ(peer_.read(k * kLen, kLen), want) << "SEND " << send_ids[k] << " in receive " << k;
  }
  for (uint32_t i = 0; i < kMsgs; ++i) {
    if (!is_read(i)) continue;
    fill(want.data(), kLen, 1000 + i);
    EXPECT_EQ(std::vector<uint8_t>(buf_.begin() + kReadAt + i * kLen,
                                   buf_.begin() + kReadAt + (i + 1) * kLen),
              want)
        << "READ " << i;
  }
  EXPECT_TRUE(drain_for(50).empty()) << "a WR completed twice";
  EXPECT_TRUE(peer_.poll(1, 50).empty()) << "a message arrived twice";
  // Settled on the backends, the pair goes direct again (its libraries start afresh).
  if (across) {
    until_direct(20000);
    EXPECT_TRUE(direct()) << "the pair did not go direct again after the snapshot";
  }
}

TEST_F(Conformance, PostingBeyondTheQueueDepthIsEnomem) {
  // The peer posts no receive and we retry for ever: every send stays queued.
  Pair p = pair(IBV_QPT_RC, {}, {}, 8);
  ASSERT_NE(p.qp, nullptr);
  const uint32_t depth = caps(p.qp).max_send_wr;
  ASSERT_GE(depth, 8u);
  for (uint32_t i = 0; i < depth; ++i)
    ASSERT_EQ(post(p.qp, {.op = IBV_WR_SEND, .sges = {sge(64 * i, 64)}, .wr_id = i}), 0) << i;
  bool bad_is_wr = false;
  EXPECT_EQ(post(p.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 64)}, .wr_id = 99}, &bad_is_wr),
            ENOMEM);
  EXPECT_TRUE(bad_is_wr);
  // The queued sends are intact: once receives come, every one completes, in order.
  for (uint32_t i = 0; i < depth; ++i) ASSERT_EQ(peer_.post_recv(p.peer, i, 4096 * i, 64), 0);
  auto wcs = poll(cq_, depth);
  ASSERT_EQ(wcs.size(), depth);
  for (uint32_t i = 0; i < depth; ++i) {
    EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(wcs[i].wr_id, i);
  }
  EXPECT_EQ(peer_.poll(depth).size(), depth);
  // The receive queue too: the peer's QP of depth 8 takes no more than its max_recv_wr.
  const PeerQp small = peer_.create_qp(IBV_QPT_RC, 8);
  QpPath theirs;
  theirs.dlid = lid_;
  theirs.dest_qpn = p.qp->qp_num;
  ASSERT_EQ(peer_.connect(small, theirs), 0);
  int rc = 0;
  uint32_t posted = 0;
  while ((rc = peer_.post_recv(small, posted, 0, 64)) == 0 && posted < 1024) ++posted;
  EXPECT_EQ(rc, ENOMEM);
  EXPECT_GE(posted, 8u);
}

// ---- Atomics ------------------------------------------------------------------------------------

TEST_F(Conformance, FetchAddFromFourQpsOfAnotherProcessSumsExactly) {
  constexpr int kQps = 4;
#if defined(__SANITIZE_THREAD__)
  constexpr uint32_t kOps =
      10000;  // ThreadSanitizer: the same interleavings, a tenth of the volume
#else
  constexpr uint32_t kOps = 100000;
#endif
  const std::vector<PeerQp> theirs = rc_pairs(kQps, 128);
  ASSERT_EQ(theirs.size(), size_t{kQps});
  std::memset(buf_.data() + 4096, 0, 8);
  EXPECT_EQ(peer_.fetch_add_storm(theirs, addr(4096), mr_->rkey, kOps), uint64_t{kQps} * kOps);
  uint64_t sum;
  std::memcpy(&sum, buf_.data() + 4096, 8);
  EXPECT_EQ(sum, uint64_t{kQps} * kOps);
  // On the direct path the peer's library executed them (into our QPs' own receive rings).
  if (direct_path_on()) {
    for (int i = 0; i < kQps; ++i) {
      EXPECT_GT(direct_received(qps_[i], cq_), 0u) << "QP " << i << ": none executed directly";
    }
  }
}

// Across backends: an application that polls its CQ only now and then (a progress call a
// millisecond between sleeps, as ucx_perftest's passive side) does not keep the connection that
// brings the peer's requests to itself once requests came since its last poll: the hub reads
// them, so the peer's atomics (or READs) do not each wait for the next poll.
TEST_F(Conformance, ASeldomPollerLeavesThePeersRequestsToTheHub) {
  if (!across_) GTEST_SKIP() << "the libraries' connections: across backends only";
  const std::vector<PeerQp> theirs = rc_pairs(1, 128);
  ASSERT_EQ(theirs.size(), 1u);
  for (int i = 0; i < 100 && !peer_requests_direct(qps_[0]); ++i)
    ASSERT_EQ(peer_.fetch_add_storm(theirs, addr(4096), mr_->rkey, 8), 8u);
  ASSERT_TRUE(peer_requests_direct(qps_[0])) << "the peer's atomics never came from its library";
  const vrdma::verbs::Conn* c = vrdma::verbs::to_vqp(qps_[0])->remote->in_raw.load();
  ASSERT_NE(c, nullptr);
  ibv_wc wc;
  for (int i = 0; i < 100; ++i) ASSERT_EQ(ibv_poll_cq(cq_, 1, &wc), 0);
  EXPECT_TRUE(c->claimed.load()) << "a busy poller reads its connections itself";
  std::atomic<bool> done{false};
  std::thread storm([&] {
    EXPECT_EQ(peer_.fetch_add_storm(theirs, addr(4096), mr_->rkey, 64), 64u);
    done = true;
  });
  bool released = false;
  while (!done.load()) {
    ::usleep(1000);
    EXPECT_EQ(ibv_poll_cq(cq_, 1, &wc), 0);
    released |= !c->claimed.load();
  }
  storm.join();
  EXPECT_TRUE(released) << "the peer's atomics waited for our polls a millisecond apart";
}

// Across backends: the poll that executes the peer's request and finds the completion the
// application waits for gives its claim back (it may now wait in its memory) and leaves the ACK
// it owes to ride on its next request (kAckDeferNs): a WRITE ping-pong then needs no hub
// wake-up. An application that makes no further call still has it sent, by its hub: the peer's
// SEND completes.
TEST_F(Conformance, AnAckLeftForTheNextRequestGoesWhenNoneComes) {
  if (!across_) GTEST_SKIP() << "the libraries' connections: across backends only";
  Pair p = pair(IBV_QPT_RC);
  ASSERT_NE(p.qp, nullptr);
  // SENDs that land, until the peer's come from its library.
  for (uint64_t i = 1; i < 4000 && (i == 1 || !peer_requests_direct(p.qp)); ++i) {
    ASSERT_EQ(post_recv(p.qp, 10 + i, 4096, 64), 0);
    ASSERT_EQ(peer_.send(p.peer, IBV_WR_SEND, 0, 64, i), 0);
    const auto wcs = peer_.poll(1);
    ASSERT_EQ(wcs.size(), 1u);
    ASSERT_EQ(wcs[0].status, IBV_WC_SUCCESS);
    ASSERT_EQ(poll(cq_, 1).size(), 1u);
  }
  ASSERT_TRUE(peer_requests_direct(p.qp)) << "the peer's SENDs never came from its library";
  const vrdma::verbs::Conn* c = vrdma::verbs::to_vqp(p.qp)->remote->in_raw.load();
  ASSERT_NE(c, nullptr);
  // One receive; polls that claim the connection, and go on until the peer's SEND has come.
  ASSERT_EQ(post_recv(p.qp, 1, 4096, 64), 0);
  ibv_wc wc;
  for (int i = 0; i < 100; ++i) ASSERT_EQ(ibv_poll_cq(cq_, 1, &wc), 0);
  EXPECT_TRUE(c->claimed.load()) << "a busy poller reads its connections itself";
  ASSERT_EQ(peer_.send(p.peer, IBV_WR_SEND, 0, 64, 77), 0);
  int got = 0;
  for (const auto until = Clock::now() + std::chrono::seconds(10); !got && Clock::now() < until;)
    got = ibv_poll_cq(cq_, 1, &wc);
  ASSERT_EQ(got, 1);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 1u);
  EXPECT_FALSE(c->claimed.load()) << "a poll that found what it waited for kept its claim";
  // No call of ours from here on: the peer's SEND completes all the same.
  const auto wcs = peer_.poll(1);
  ASSERT_EQ(wcs.size(), 1u) << "the ACK we owed never went";
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(wcs[0].wr_id, 77u);
}

// 70 QPs that share one CQ: on the direct path (one host) each has an own send ring feeding it,
// 70, more than one kDirectRings answer holds (64; 64 QPs sharing one CQ for their sends and
// receives have 128). Across backends a process dials at most VRDMA_DIRECT_REMOTE_QPS (8)
// peers' libraries: some QPs go direct, the others stay on the backends, all on one CQ.
// The library learns them a page at a time, and every WRITE completes. (Before, the lookup
// failed with E2BIG, the library read none of the rings, and `ib_write_bw -q 64` across two
// hosts stopped after its first 128 WRITEs per QP.)
TEST_F(Conformance, SeventyQpsSharingOneCqAllCompleteOnEveryPath) {
  constexpr int kQps = 70;
  const std::vector<PeerQp> theirs = rc_pairs(kQps, 16);
  ASSERT_EQ(theirs.size(), size_t{kQps});
  // Rounds of one WRITE per QP, until every QP's library executes them itself (at once on the
  // mediated paths); then one more round on all those rings.
  auto direct = [&](int i) { return across_ ? library_path(qps_[i]) : direct_sent(qps_[i]) > 0; };
  auto how_many_direct = [&] {
    int n = 0;
    for (int i = 0; i < kQps; ++i) n += direct(i) ? 1 : 0;
    return n;
  };
  const char* cap = std::getenv("VRDMA_DIRECT_REMOTE_QPS");
  const int want = across_ ? std::min(kQps, cap ? std::atoi(cap) : 8) : kQps;
  // Across backends, connections of earlier tests in this process may still count.
  auto all_direct = [&] { return across_ ? how_many_direct() >= 1 : how_many_direct() == want; };
  const bool want_direct = direct_path_on() || across_;
  const auto until = Clock::now() + std::chrono::seconds(20);
  unsigned round = 0;
  for (bool last = false; !last; ++round) {
    last = !want_direct || all_direct() || Clock::now() > until;
    fill(buf_.data(), kQps * 64, round);
    for (int i = 0; i < kQps; ++i) {
      ASSERT_EQ(post(qps_[i], {.op = IBV_WR_RDMA_WRITE,
                               .sges = {sge(i * 64, 64)},
                               .wr_id = uint64_t(i),
                               .raddr = peer_.mem().addr + i * 64,
                               .rkey = peer_.mem().rkey}),
                0);
    }
    const auto wcs = poll(cq_, kQps);
    ASSERT_EQ(wcs.size(), size_t{kQps}) << "round " << round << ": completions missing";
    for (const ibv_wc& wc : wcs)
      EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << "QP " << wc.wr_id << ": " << ibv_wc_status_str(wc.status);
    EXPECT_EQ(peer_.read(0, kQps * 64), std::vector<uint8_t>(buf_.begin(), buf_.begin() + kQps * 64));
  }
  if (want_direct) {
    EXPECT_TRUE(all_direct()) << "not every QP went direct in 20 s";
    EXPECT_LE(how_many_direct(), want);
  }
  if (direct_path_on() && !across_) {
    EXPECT_GT(vrdma::verbs::to_vcq(cq_)->own.size(), size_t{64});
  }
}

// An aligned iova on a misaligned address (ibv_reg_mr_iova: the MR's address and iova differ
// mod 8): a CPU atomic there would be a split lock, so it fails as a misaligned iova does,
// REM_INV_REQ_ERR, on every path; on the direct path the library leaves it to the backend.
TEST_F(Conformance, AnAtomicOnAnAlignedIovaOfAMisalignedAddressIsInvalidRequest) {
  constexpr uint64_t kIova = 0x10000000;
  std::memset(buf_.data() + 65536, 0, 64);
  rmr_ = ibv_reg_mr_iova(pd_, buf_.data() + 65536 + 4, 4096, kIova,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC);
  ASSERT_NE(rmr_, nullptr) << std::strerror(errno);
  // Two QPs of ours (one session: no proof), granted with rmr_ in the grant's table.
  ibv_qp* a = make_qp(IBV_QPT_RC);
  ibv_qp* b = make_qp(IBV_QPT_RC);
  ASSERT_TRUE(a && b);
  ASSERT_NO_FATAL_FAILURE(connect_ours(a, b));
  const auto until = Clock::now() + std::chrono::seconds(20);
  do {
    const ibv_wc wc = run(a, {.op = IBV_WR_ATOMIC_FETCH_AND_ADD,
                              .sges = {sge(512, 8)},
                              .raddr = addr(32768),
                              .rkey = mr_->rkey,
                              .compare_add = 1});
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  } while (direct_path_on() && direct_sent(a) == 0 && Clock::now() < until);
  const uint64_t before = direct_sent(a);
  if (direct_path_on()) {
    ASSERT_GT(before, 0u) << "the direct path was not granted in 20 s";
  }
  const ibv_wc wc = run(a, {.op = IBV_WR_ATOMIC_FETCH_AND_ADD,
                            .sges = {sge(0, 8)},
                            .raddr = kIova + 8,
                            .rkey = rmr_->rkey,
                            .compare_add = 1});
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(direct_sent(a), before) << "the library executed it";
  EXPECT_EQ(std::count(buf_.begin() + 65536, buf_.begin() + 65536 + 64, 0), 64)
      << "the word changed";
}

// ---- Async events ---------------------------------------------------------------------------

TEST_F(Conformance, PortActiveIsTheFirstAsyncEvent) {
  pollfd p{ctx_->async_fd, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  ibv_async_event ev{};
  ASSERT_EQ(ibv_get_async_event(ctx_, &ev), 0);
  EXPECT_EQ(ev.event_type, IBV_EVENT_PORT_ACTIVE);
  EXPECT_EQ(ev.element.port_num, 1);
  ibv_ack_async_event(&ev);
}

TEST_F(Conformance, CorruptSendQueueIndexIsQpFatalAndHurtsNobodyElse) {
  Pair p = pair(IBV_QPT_RC);
  ASSERT_NE(p.qp, nullptr);
  // What a buggy or hostile guest could do: a producer index the queue cannot hold.
  vrdma::verbs::VQp* v = vrdma::verbs::to_vqp(p.qp);
  v->sq_hdr->producer.store(v->sq_prod + v->sq_size + 5, std::memory_order_release);
  // Marked as a post marks it (proto::ReadyBits): the backend looks only at marked QPs.
  if (vrdma::proto::ReadyBits* r = vrdma::verbs::to_vctx(ctx_)->ready)
    vrdma::proto::mark_ready(*r, v->handle);
  const uint64_t ring = 1;  // wake the backend if it sleeps, as a post would
  ASSERT_EQ(::write(vrdma::verbs::to_vctx(ctx_)->doorbell.get(), &ring, 8), 8);
  const ibv_async_event ev = next_async_event();
  EXPECT_EQ(ev.event_type, IBV_EVENT_QP_FATAL);
  EXPECT_EQ(ev.element.qp, p.qp);
  EXPECT_EQ(state(p.qp), IBV_QPS_ERR);
  // The backend goes on: another QP pair of the same two guests works.
  Pair q = pair(IBV_QPT_RC);
  ASSERT_NE(q.qp, nullptr);
  ASSERT_EQ(peer_.post_recv(q.peer, 2, 0, 64), 0);
  EXPECT_EQ(run(q.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 64)}, .wr_id = 9}).status,
            IBV_WC_SUCCESS);
  auto rx = peer_.poll(1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 2u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
}

TEST_F(Conformance, CqOverrunIsCqError) {
  ibv_cq* small = ibv_create_cq(ctx_, 4, nullptr, nullptr, 0);
  ASSERT_NE(small, nullptr);
  cqs_.push_back(small);
  ibv_qp* qp = make_qp(IBV_QPT_RC, 64, 1, 0, small);
  ASSERT_NE(qp, nullptr);
  connect_peer(qp, IBV_QPT_RC);
  ASSERT_FALSE(HasFailure()) << "the pair did not connect";
  // More signaled completions than the CQ holds, none polled.
  const int n = small->cqe + 2;
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(post(qp, {.op = IBV_WR_RDMA_WRITE, .sges = {sge(0, 8)}, .wr_id = uint64_t(i),
                        .raddr = peer_.mem().addr, .rkey = peer_.mem().rkey}),
              0);
  }
  const ibv_async_event ev = next_async_event();
  EXPECT_EQ(ev.event_type, IBV_EVENT_CQ_ERR);
  EXPECT_EQ(ev.element.cq, small);
}

TEST_F(Conformance, SrqLimitReachedFiresOnceWhenArmed) {
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = 16;
  sa.attr.max_sge = 1;
  ibv_srq* srq = ibv_create_srq(pd_, &sa);
  ASSERT_NE(srq, nullptr) << std::strerror(errno);
  ibv_qp_init_attr ia{};
  ia.send_cq = ia.recv_cq = cq_;
  ia.qp_type = IBV_QPT_RC;
  ia.srq = srq;
  ia.cap = {8, 0, 1, 1, 0};
  ibv_qp* rq = ibv_create_qp(pd_, &ia);
  ASSERT_NE(rq, nullptr);
  ibv_qp* sq = make_qp(IBV_QPT_RC);
  ASSERT_NE(sq, nullptr);
  connect(rq, sq->qp_num);
  connect(sq, rq->qp_num);
  for (uint64_t i = 0; i < 8; ++i) {
    ibv_sge s = sge(4096 * i, 64);
    ibv_recv_wr wr{};
    wr.wr_id = i;
    wr.sg_list = &s;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_srq_recv(srq, &wr, &bad), 0);
  }
  ibv_srq_attr lim{};
  lim.srq_limit = 6;
  ASSERT_EQ(ibv_modify_srq(srq, &lim, IBV_SRQ_LIMIT), 0);
  // 8 posted, 3 consumed: 5 left < 6.
  for (int i = 0; i < 3; ++i)
    ASSERT_EQ(post(sq, {.op = IBV_WR_SEND, .sges = {sge(65536, 8)}, .wr_id = uint64_t(i)}), 0);
  EXPECT_EQ(poll(cq_, 6).size(), 6u);
  const ibv_async_event ev = next_async_event();
  EXPECT_EQ(ev.event_type, IBV_EVENT_SRQ_LIMIT_REACHED);
  EXPECT_EQ(ev.element.srq, srq);
  ibv_srq_attr now{};
  ASSERT_EQ(ibv_query_srq(srq, &now), 0);
  EXPECT_EQ(now.srq_limit, 0u) << "the event disarms the limit";
  EXPECT_EQ(ibv_destroy_qp(rq), 0);
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
}

// ---- SRQs on every path (issue 25: the direct path feeds them too) ----------------------------

/// Splits completions into receives and the rest.
std::pair<std::vector<ibv_wc>, std::vector<ibv_wc>> receives_first(const std::vector<ibv_wc>& wcs) {
  std::pair<std::vector<ibv_wc>, std::vector<ibv_wc>> out;
  for (const ibv_wc& wc : wcs) (wc.opcode & IBV_WC_RECV ? out.first : out.second).push_back(wc);
  return out;
}

// Three QPs on one SRQ of ours, fed by two QPs of ours and one of the peer process, in turn:
// each message takes the SRQ's next receive in ring order, whichever QP it comes to and
// whoever executes it (on the direct path our libraries do: several producers of one SRQ).
TEST_F(Conformance, AnSrqFedByQpsOfTwoProcessesHandsOutItsReceivesInRingOrder) {
  OurSrq q(pd_, 64);
  ASSERT_NE(q.srq, nullptr);
  ibv_qp* s[3] = {q.qp(pd_, cq_), q.qp(pd_, cq_), q.qp(pd_, cq_)};
  ibv_qp* a[2] = {make_qp(IBV_QPT_RC), make_qp(IBV_QPT_RC)};
  ASSERT_TRUE(s[0] && s[1] && s[2] && a[0] && a[1]);
  connect_ours(a[0], s[0]);
  connect_ours(a[1], s[1]);
  PeerQp p = connect_peer(s[2], IBV_QPT_RC);
  ASSERT_FALSE(HasFailure());
  constexpr int kMsgs = 12;
  constexpr size_t kSlots = 256 * 1024;
  for (int k = 0; k < kMsgs; ++k)
    ASSERT_EQ(q.post(1000 + k, addr(kSlots + 4096 * k), 512, mr_->lkey), 0);
  for (int k = 0; k < kMsgs; ++k) {
    const uint32_t len = 100 + k;
    const int who = k % 3;
    std::vector<uint8_t> bytes(len);
    fill(bytes.data(), len, k);
    if (who < 2) {
      std::memcpy(buf_.data() + 8192 * k, bytes.data(), len);
      ASSERT_EQ(post(a[who], {.op = IBV_WR_SEND_WITH_IMM,
                              .sges = {sge(8192 * k, len)},
                              .wr_id = uint64_t(k),
                              .imm = uint32_t(k)}),
                0);
    } else {
      peer_.write(8192 * k, bytes.data(), len);
      ASSERT_EQ(peer_.send(p, IBV_WR_SEND_WITH_IMM, 8192 * k, len, k), 0);
    }
    auto [rx, tx] = receives_first(poll(cq_, who < 2 ? 2 : 1));
    ASSERT_EQ(rx.size(), 1u) << "message " << k;
    EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS) << k;
    EXPECT_EQ(rx[0].wr_id, 1000u + k) << "the SRQ's receives go in ring order";
    EXPECT_EQ(rx[0].qp_num, s[who]->qp_num) << k;
    EXPECT_EQ(ntohl(rx[0].imm_data), uint32_t(k));
    EXPECT_EQ(rx[0].byte_len, len);
    EXPECT_EQ(std::memcmp(buf_.data() + kSlots + 4096 * k, bytes.data(), len), 0) << k;
    if (who < 2) {
      ASSERT_EQ(tx.size(), 1u) << k;
      EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
    } else {
      auto sent = peer_.poll(1);
      ASSERT_EQ(sent.size(), 1u) << k;
      EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
    }
  }
  // Our QPs' libraries fed the SRQ themselves (one session: no proof to wait for).
  if (direct_path_on()) {
    EXPECT_EQ(direct_sent(a[0]), uint64_t(kMsgs / 3));
    EXPECT_EQ(direct_sent(a[1]), uint64_t(kMsgs / 3));
  }
}

// A large SEND of the peer streams into one QP of our SRQ (across backends its payload comes
// over many turns of the responder) while our QP sends small ones to another QP of the SRQ:
// each message takes a receive of its own, every receive completes once, and each lands whole.
// (The backends' TCP responder once took the SRQ's head at the big message's start and consumed
// it at its end: a small SEND in between got the same receive, and one receive was lost.)
TEST_F(Conformance, AnSrqHandsEachReceiveOutOnceWhileALargeMessageStreamsIn) {
  OurSrq q(pd_, 128);
  ASSERT_NE(q.srq, nullptr);
  ibv_qp* s[2] = {q.qp(pd_, cq_), q.qp(pd_, cq_)};
  ibv_qp* a = make_qp(IBV_QPT_RC);
  ASSERT_TRUE(s[0] && s[1] && a);
  connect_ours(a, s[0]);
  PeerQp p = connect_peer(s[1], IBV_QPT_RC);
  ASSERT_FALSE(HasFailure());
  // Small SENDs one after the other until the big one's receive completes, so that some run
  // while its payload streams in.
  constexpr uint32_t kBig = vrdma::test::kPeerBufSize, kSmallLen = 64;
  constexpr int kMaxSmall = 15, kRounds = 3, kRecvs = (kMaxSmall + 1) * kRounds;
  std::vector<uint8_t> big(kBig);
  fill(big.data(), kBig, 99);
  peer_.write(0, big.data(), kBig);
  rbuf_.assign(size_t{kBig} * kRecvs, 0);
  rmr_ = ibv_reg_mr(pd_, rbuf_.data(), rbuf_.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(rmr_, nullptr);
  for (int i = 0; i < kRecvs; ++i) {
    ASSERT_EQ(q.post(i, reinterpret_cast<uintptr_t>(&rbuf_[size_t{kBig} * i]), kBig, rmr_->lkey), 0);
  }
  std::vector<ibv_wc> rx;
  int m = 0;
  for (int r = 0; r < kRounds; ++r) {
    ASSERT_EQ(peer_.send(p, IBV_WR_SEND_WITH_IMM, 0, kBig, 1000 + r), 0);
    bool big_in = false;
    for (int k = 0; k < kMaxSmall && !big_in; ++k, ++m) {
      fill(buf_.data() + 64 * m, kSmallLen, m);
      ASSERT_EQ(post(a, {.op = IBV_WR_SEND_WITH_IMM,
                         .sges = {sge(64 * m, kSmallLen)},
                         .wr_id = uint64_t(m),
                         .imm = uint32_t(m)}),
                0);
      size_t small_in = 0, sent = 0;
      for (long spin = 0; small_in + sent < 2; ++spin) {  // no sleep: the window is short
        ASSERT_LT(spin, 2'000'000'000L) << "round " << r << ", small SEND " << m;
        ibv_wc wc[4];
        const int n = ibv_poll_cq(cq_, 4, wc);
        ASSERT_GE(n, 0);
        auto [got, tx] = receives_first(std::vector<ibv_wc>(wc, wc + n));
        for (const ibv_wc& wc : tx) EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << m;
        for (const ibv_wc& wc : got) {
          if (wc.qp_num == s[1]->qp_num)
            big_in = true;
          else
            ++small_in;
        }
        sent += tx.size();
        rx.insert(rx.end(), got.begin(), got.end());
      }
    }
    if (!big_in) {
      auto got = poll(cq_, 1);
      ASSERT_EQ(got.size(), 1u) << "round " << r << ": the big message";
      rx.push_back(got[0]);
    }
    auto sent = peer_.poll(1);
    ASSERT_EQ(sent.size(), 1u) << r;
    EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS) << r;
  }
  ASSERT_LE(rx.size(), size_t{kRecvs});
  EXPECT_TRUE(drain_for(20).empty()) << "one completion per receive";
  // Across backends the peer's library delivered into our SRQ itself (ours took the receives).
  if (across_) {
    EXPECT_TRUE(peer_requests_direct(s[1])) << "the big SENDs came through the backends";
  }
  std::vector<bool> seen(kRecvs);
  for (const ibv_wc& wc : rx) {
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    ASSERT_LT(wc.wr_id, uint64_t{kRecvs});
    EXPECT_FALSE(seen[wc.wr_id]) << "receive " << wc.wr_id << " completed twice";
    seen[wc.wr_id] = true;
    const uint8_t* at = &rbuf_[size_t{kBig} * wc.wr_id];
    const uint32_t imm = ntohl(wc.imm_data);
    if (wc.qp_num == s[1]->qp_num) {
      EXPECT_EQ(wc.byte_len, kBig);
      EXPECT_LT(imm - 1000, uint32_t{kRounds}) << imm;
      EXPECT_EQ(std::memcmp(at, big.data(), kBig), 0) << "the big message in receive " << wc.wr_id;
    } else {
      ASSERT_EQ(wc.qp_num, s[0]->qp_num);
      ASSERT_EQ(wc.byte_len, kSmallLen);
      std::vector<uint8_t> want(kSmallLen);
      fill(want.data(), kSmallLen, imm);
      EXPECT_EQ(std::memcmp(at, want.data(), kSmallLen), 0) << "small message " << imm;
    }
  }
}

// The peer's SENDs into a QP of our SRQ (across backends from the peer's library to ours, which
// takes the SRQ's receives itself): an empty SRQ holds them as an RNR until a receive is posted;
// the armed limit fires once when a receive taken leaves fewer posted; a receive whose lkey names
// no MR completes with LOC_PROT_ERR and the peer's SEND with REM_OP_ERR.
TEST_F(Conformance, ThePeersSendsIntoOurSrqWaitWhenItIsEmptyAndRaiseItsLimitOnce) {
  OurSrq q(pd_, 16);
  ASSERT_NE(q.srq, nullptr);
  ibv_qp* s = q.qp(pd_, cq_);
  ASSERT_NE(s, nullptr);
  PeerQp p = connect_peer(s, IBV_QPT_RC);
  ASSERT_FALSE(HasFailure());
  auto peer_send = [&](uint64_t wr_id) { return peer_.send(p, IBV_WR_SEND_WITH_IMM, 0, 64, wr_id); };
  auto peer_done = [&] {
    const auto wcs = peer_.poll(1);
    return wcs.size() == 1 ? wcs[0].status : IBV_WC_GENERAL_ERR;
  };
  uint64_t id = 0;
  // SENDs that land, until the peer's come from its library (across backends).
  for (int i = 0; i < 4000 && (i == 0 || (across_ && !peer_requests_direct(s))); ++i, ++id) {
    ASSERT_EQ(q.post(id, addr(4096), 64, mr_->lkey), 0);
    ASSERT_EQ(peer_send(id), 0);
    ASSERT_EQ(peer_done(), IBV_WC_SUCCESS);
    const auto rx = poll(cq_, 1);
    ASSERT_EQ(rx.size(), 1u);
    ASSERT_EQ(rx[0].wr_id, id);
  }
  if (across_) {
    ASSERT_TRUE(peer_requests_direct(s)) << "the peer's SENDs never came from its library";
  }
  // Empty: the SEND waits (rnr_retry 7) until a receive comes.
  ASSERT_EQ(peer_send(500), 0);
  EXPECT_TRUE(drain_for(50).empty()) << "no receive: nothing lands";
  ASSERT_EQ(q.post(501, addr(4096), 64, mr_->lkey), 0);
  auto rx = poll(cq_, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 501u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(ntohl(rx[0].imm_data), 500u);
  EXPECT_EQ(peer_done(), IBV_WC_SUCCESS);
  // The limit: 6 posted, armed at 4; the third SEND leaves 3.
  for (uint64_t k = 0; k < 6; ++k) ASSERT_EQ(q.post(600 + k, addr(4096 + 64 * k), 64, mr_->lkey), 0);
  ibv_srq_attr lim{};
  lim.srq_limit = 4;
  ASSERT_EQ(ibv_modify_srq(q.srq, &lim, IBV_SRQ_LIMIT), 0);
  for (uint64_t k = 0; k < 3; ++k) {
    ASSERT_EQ(peer_send(700 + k), 0);
    ASSERT_EQ(peer_done(), IBV_WC_SUCCESS);
  }
  rx = poll(cq_, 3);
  ASSERT_EQ(rx.size(), 3u);
  for (uint64_t k = 0; k < 3; ++k) EXPECT_EQ(rx[k].wr_id, 600 + k) << "ring order";
  const ibv_async_event ev = next_async_event();
  EXPECT_EQ(ev.event_type, IBV_EVENT_SRQ_LIMIT_REACHED);
  EXPECT_EQ(ev.element.srq, q.srq);
  pollfd pf{ctx_->async_fd, POLLIN, 0};
  EXPECT_EQ(::poll(&pf, 1, 100), 0) << "one event only";
  ibv_srq_attr now{};
  ASSERT_EQ(ibv_query_srq(q.srq, &now), 0);
  EXPECT_EQ(now.srq_limit, 0u) << "the event disarms the limit";
  // Drain the three left, then a receive with a bad lkey.
  for (uint64_t k = 3; k < 6; ++k) {
    ASSERT_EQ(peer_send(700 + k), 0);
    ASSERT_EQ(peer_done(), IBV_WC_SUCCESS);
  }
  ASSERT_EQ(poll(cq_, 3).size(), 3u);
  ASSERT_EQ(q.post(800, addr(4096), 64, mr_->lkey ^ 0x5a5a00), 0);
  ASSERT_EQ(peer_send(801), 0);
  EXPECT_EQ(peer_done(), IBV_WC_REM_OP_ERR);
  rx = poll(cq_, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 800u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(state(s), IBV_QPS_ERR);
  if (across_) {
    EXPECT_TRUE(peer_requests_direct(s)) << "still library to library";
  }
}

// The limit armed after the grant: libraries take receives while the limit is not crossed, the
// backend takes the one that crosses it and raises the event, once; then libraries go on.
TEST_F(Conformance, AnSrqLimitArmedAfterTheGrantFiresOnceWithDirectSenders) {
  OurSrq q(pd_, 16);
  ASSERT_NE(q.srq, nullptr);
  ibv_qp* sq = sender_into(q);
  ASSERT_NE(sq, nullptr);
  for (uint64_t i = 0; i < 12; ++i) ASSERT_EQ(q.post(i, addr(4096 * i), 64, mr_->lkey), 0);
  auto send = [&](int n) {
    for (int i = 0; i < n; ++i) ASSERT_EQ(send8(sq, 50), 0);
  };
  send(2);
  auto [rx, tx] = receives_first(poll(cq_, 4));
  ibv_srq_attr lim{};
  lim.srq_limit = 8;  // 10 posted
  ASSERT_EQ(ibv_modify_srq(q.srq, &lim, IBV_SRQ_LIMIT), 0);
  send(3);  // 9, 8 left, then 7 < 8
  auto [rx2, tx2] = receives_first(poll(cq_, 6));
  rx.insert(rx.end(), rx2.begin(), rx2.end());
  // (The backend has completed the third: the library goes direct again.)
  send(2);
  auto [rx3, tx3] = receives_first(poll(cq_, 4));
  rx.insert(rx.end(), rx3.begin(), rx3.end());
  ASSERT_EQ(rx.size(), 7u);
  for (size_t i = 0; i < rx.size(); ++i) {
    EXPECT_EQ(rx[i].wr_id, i) << "ring order";
    EXPECT_EQ(rx[i].status, IBV_WC_SUCCESS);
  }
  const ibv_async_event ev = next_async_event();
  EXPECT_EQ(ev.event_type, IBV_EVENT_SRQ_LIMIT_REACHED);
  EXPECT_EQ(ev.element.srq, q.srq);
  ibv_srq_attr now{};
  ASSERT_EQ(ibv_query_srq(q.srq, &now), 0);
  EXPECT_EQ(now.srq_limit, 0u) << "the event disarms the limit";
  pollfd pf{ctx_->async_fd, POLLIN, 0};
  EXPECT_EQ(::poll(&pf, 1, 200), 0) << "one event only";
  // All but the receive that crossed the limit were taken by the library.
  if (direct_path_on()) {
    EXPECT_EQ(direct_sent(sq), 6u);
  }
}

// No receive in the SRQ: an RC SEND waits as for an RNR NAK (rnr_retry 7: until a receive
// comes), and fails with RNR_RETRY_EXC_ERR when its retries run out (rnr_retry 0).
TEST_F(Conformance, AnEmptySrqIsAnRnrForRc) {
  OurSrq q(pd_, 16);
  ASSERT_NE(q.srq, nullptr);
  ibv_qp* sq = sender_after_one(q);
  ASSERT_NE(sq, nullptr);
  const uint64_t direct_before = direct_sent(sq);
  ASSERT_EQ(send8(sq, 11), 0);
  EXPECT_TRUE(drain_for(50).empty()) << "no receive: the SEND waits";
  ASSERT_EQ(q.post(2, addr(4096), 64, mr_->lkey), 0);
  auto [rx, tx] = receives_first(poll(cq_, 2));
  ASSERT_EQ(rx.size(), 1u);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 2u);
  EXPECT_EQ(tx[0].wr_id, 11u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  if (direct_path_on()) {
    EXPECT_EQ(direct_before, 1u) << "the first SEND went direct";
    EXPECT_EQ(direct_sent(sq), direct_before) << "the one that waited went through the backend";
  }
  // rnr_retry 0: the first RNR NAK fails it.
  ibv_qp* rq0 = q.qp(pd_, cq_);
  ibv_qp* sq0 = make_qp(IBV_QPT_RC);
  ASSERT_TRUE(rq0 && sq0);
  connect(sq0, rq0->qp_num, /*rnr_retry=*/0);  // (sender_into's connect_ours: rnr_retry 7)
  connect(rq0, sq0->qp_num);
  const ibv_wc wc = run(sq0, {.op = IBV_WR_SEND, .sges = {sge(65536, 8)}, .wr_id = 12});
  EXPECT_EQ(wc.status, IBV_WC_RNR_RETRY_EXC_ERR) << ibv_wc_status_str(wc.status);
}

// A receive of the SRQ whose lkey names no MR: the receive completes with LOC_PROT_ERR and the
// sender with REM_OP_ERR, as the mediated responder gives it, whoever executes the SEND.
TEST_F(Conformance, AnSrqReceiveWithABadLkeyIsALocalProtectionError) {
  OurSrq q(pd_, 16);
  ASSERT_NE(q.srq, nullptr);
  ibv_qp* sq = sender_after_one(q);
  ASSERT_NE(sq, nullptr);
  ASSERT_EQ(q.post(2, addr(4096), 64, mr_->lkey ^ 0x5a5a00), 0);
  ASSERT_EQ(send8(sq, 11), 0);
  auto [rx, tx] = receives_first(poll(cq_, 2));
  ASSERT_EQ(rx.size() + tx.size(), 2u);
  // An error completion's opcode is undefined: told apart by wr_id.
  std::vector<ibv_wc> all = rx;
  all.insert(all.end(), tx.begin(), tx.end());
  for (const ibv_wc& wc : all) {
    if (wc.wr_id == 2) {
      EXPECT_EQ(wc.status, IBV_WC_LOC_PROT_ERR) << ibv_wc_status_str(wc.status);
    } else {
      EXPECT_EQ(wc.wr_id, 11u);
      EXPECT_EQ(wc.status, IBV_WC_REM_OP_ERR) << ibv_wc_status_str(wc.status);
    }
  }  // The library took the good receive itself and left the bad one to the backend.
  if (direct_path_on()) {
    EXPECT_EQ(direct_sent(sq), 1u);
  }
}

// ---- ibv_rereg_mr (issue 24) -------------------------------------------------------------------

TEST_F(Conformance, ReregMrTranslationKeepsTheKeysAndThePeerWritesTheNewPages) {
  constexpr int kQps = 2;
  constexpr uint32_t kOps = 2000;
  const std::vector<PeerQp> theirs = rc_pairs(kQps, 128);
  ASSERT_EQ(theirs.size(), size_t{kQps});
  // Before: the peer adds into the old pages.
  std::memset(buf_.data() + 4096, 0, 8);
  ASSERT_EQ(peer_.fetch_add_storm(theirs, addr(4096), mr_->rkey, 100), uint64_t{kQps} * 100);
  const uint32_t lkey = mr_->lkey, rkey = mr_->rkey;
  Pages fresh(64 << 10);
  ASSERT_NE(fresh.p, nullptr);
  std::memset(fresh.p, 0, fresh.size);
  ASSERT_EQ(ibv_rereg_mr(mr_, IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, fresh.p, fresh.size, 0), 0)
      << std::strerror(errno);
  EXPECT_EQ(mr_->lkey, lkey);
  EXPECT_EQ(mr_->rkey, rkey);
  EXPECT_EQ(mr_->addr, fresh.p);
  EXPECT_EQ(mr_->length, fresh.size);
  EXPECT_EQ(mr_->pd, pd_);
  // After: the same rkey reaches the new pages, and only them.
  EXPECT_EQ(peer_.fetch_add_storm(theirs, fresh.at(512), rkey, kOps), uint64_t{kQps} * kOps);
  uint64_t sum = 0;
  std::memcpy(&sum, fresh.p + 512, 8);
  EXPECT_EQ(sum, uint64_t{kQps} * kOps);
  uint64_t old = 0;
  std::memcpy(&old, buf_.data() + 4096, 8);
  EXPECT_EQ(old, uint64_t{kQps} * 100) << "the old pages are no longer the MR's";
  // The lkey addresses the new pages too: send from them to the peer.
  Pair p = pair(IBV_QPT_RC);
  ASSERT_NE(p.qp, nullptr);
  fill(fresh.p + 8192, 256, 9);
  ASSERT_EQ(peer_.post_recv(p.peer, 1, 0, 4096), 0);
  EXPECT_EQ(run(p.qp, {.op = IBV_WR_SEND, .sges = {ibv_sge{fresh.at(8192), 256, lkey}}, .wr_id = 3})
                .status,
            IBV_WC_SUCCESS);
  ASSERT_EQ(peer_.poll(1).size(), 1u);
  EXPECT_EQ(peer_.read(0, 256), std::vector<uint8_t>(fresh.p + 8192, fresh.p + 8448));
  // An SGE in the old range is outside the MR now.
  EXPECT_EQ(run(p.qp, {.op = IBV_WR_SEND, .sges = {sge(0, 64)}, .wr_id = 4}).status,
            IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(ibv_dereg_mr(mr_), 0);  // before its pages go
  mr_ = nullptr;
}

TEST_F(Conformance, ReregMrAccessAndPdChangesAndTheErrorsOfItsManPage) {
  auto [a, b] = connected_pair([&] { return make_qp(IBV_QPT_RC); });
  ASSERT_NE(a, nullptr);
  auto fetch_add = [&](ibv_qp* qp, uint64_t id) {
    return run(qp, {.op = IBV_WR_ATOMIC_FETCH_AND_ADD,
                    .sges = {sge(0, 8)},
                    .wr_id = id,
                    .raddr = addr(4096),
                    .rkey = mr_->rkey,
                    .compare_add = 1})
        .status;
  };
  ASSERT_EQ(fetch_add(a, 1), IBV_WC_SUCCESS);
  // Input errors: the old MR is valid, errno EINVAL.
  errno = 0;
  EXPECT_EQ(ibv_rereg_mr(mr_, 1 << 3, nullptr, nullptr, 0, 0), IBV_REREG_MR_ERR_INPUT);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_rereg_mr(mr_, IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, nullptr, 4096, 0),
            IBV_REREG_MR_ERR_INPUT);
  EXPECT_EQ(ibv_rereg_mr(mr_, IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, buf_.data(), 0, 0),
            IBV_REREG_MR_ERR_INPUT);
  EXPECT_EQ(ibv_rereg_mr(mr_, IBV_REREG_MR_CHANGE_PD, nullptr, nullptr, 0, IBV_ACCESS_LOCAL_WRITE),
            IBV_REREG_MR_ERR_INPUT)
      << "access without IBV_REREG_MR_CHANGE_ACCESS";
  EXPECT_EQ(ibv_rereg_mr(mr_, IBV_REREG_MR_CHANGE_PD, nullptr, nullptr, 0, 0),
            IBV_REREG_MR_ERR_INPUT);
  // The device refuses: no flag, remote write without local write.
  errno = 0;
  EXPECT_EQ(ibv_rereg_mr(mr_, 0, nullptr, nullptr, 0, 0), IBV_REREG_MR_ERR_CMD);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(
      ibv_rereg_mr(mr_, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, IBV_ACCESS_REMOTE_WRITE),
      IBV_REREG_MR_ERR_CMD);
  EXPECT_EQ(errno, EINVAL);
  ASSERT_EQ(fetch_add(a, 2), IBV_WC_SUCCESS) << "a refused rereg changes nothing";
  // Access: without REMOTE_ATOMIC the responder refuses the same rkey.
  ASSERT_EQ(ibv_rereg_mr(mr_, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ),
            0);
  EXPECT_EQ(fetch_add(a, 3), IBV_WC_REM_ACCESS_ERR);
  // PD: the MR back with every access but in another PD than the QPs: no longer theirs.
  ibv_pd* other = ibv_alloc_pd(ctx_);
  ASSERT_NE(other, nullptr);
  auto [c, d] = connected_pair([&] { return make_qp(IBV_QPT_RC); });
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(ibv_rereg_mr(mr_, IBV_REREG_MR_CHANGE_PD | IBV_REREG_MR_CHANGE_ACCESS, other, nullptr,
                         0, IBV_ACCESS_LOCAL_WRITE | kRemote),
            0);
  EXPECT_EQ(mr_->pd, other);
  EXPECT_EQ(ibv_dealloc_pd(other), EBUSY) << "the MR is in it now";
  EXPECT_EQ(run(c, {.op = IBV_WR_SEND, .sges = {sge(0, 8)}, .wr_id = 5}).status,
            IBV_WC_LOC_PROT_ERR);
  ASSERT_EQ(ibv_rereg_mr(mr_, IBV_REREG_MR_CHANGE_PD, pd_, nullptr, 0, 0), 0);
  EXPECT_EQ(ibv_dealloc_pd(other), 0);
  auto [e, f] = connected_pair([&] { return make_qp(IBV_QPT_RC); });
  ASSERT_NE(e, nullptr);
  uint64_t before = 0;
  std::memcpy(&before, buf_.data() + 4096, 8);
  EXPECT_EQ(fetch_add(e, 6), IBV_WC_SUCCESS);
  uint64_t after = 0;
  std::memcpy(&after, buf_.data() + 4096, 8);
  EXPECT_EQ(after, before + 1);
  (void)b;
  (void)d;
  (void)f;
}

// ---- ibv_resize_cq (issue 24) ------------------------------------------------------------------

TEST_F(Conformance, ResizeCqKeepsItsCompletionsInOrderAndRefusesToDropAny) {
  ibv_cq* cq = ibv_create_cq(ctx_, 16, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  cqs_.push_back(cq);
  ibv_qp* qp = make_qp(IBV_QPT_RC, 16, 1, 0, cq);
  ASSERT_NE(qp, nullptr);
  const PeerQp theirs = peer_.create_qp(IBV_QPT_RC, 32);
  QpPath ours, path;
  ours.dlid = peer_.lid();
  ours.dest_qpn = theirs.qpn;
  path.dlid = lid_;
  path.dest_qpn = qp->qp_num;
  ASSERT_EQ(bring_to_rts(qp, ours), 0);
  ASSERT_EQ(peer_.connect(theirs, path), 0);
  constexpr uint32_t kHeld = 10;
  for (uint32_t i = 0; i < kHeld; ++i) ASSERT_EQ(peer_.post_recv(theirs, i, 64 * i, 64), 0);
  for (uint32_t i = 0; i < kHeld; ++i)
    ASSERT_EQ(post(qp, {.op = IBV_WR_SEND, .sges = {sge(64 * i, 64)}, .wr_id = i}), 0);
  ASSERT_EQ(peer_.poll(kHeld).size(), kHeld);
  // RC: the peer's receives complete once ours were acknowledged; give the last one time.
  ::usleep(20000);
  EXPECT_EQ(ibv_resize_cq(cq, kHeld - 1), EINVAL) << "below the completions it holds";
  EXPECT_EQ(ibv_resize_cq(cq, 0), EINVAL);
  ASSERT_EQ(ibv_resize_cq(cq, 200), 0);
  EXPECT_GE(cq->cqe, 200);
  // Half now, then shrink with the rest held, then the rest: all in order.
  std::vector<ibv_wc> first(kHeld / 2);
  for (size_t got = 0, spins = 0; got < first.size() && spins < 5'000'000; ++spins) {
    const int n = ibv_poll_cq(cq, static_cast<int>(first.size() - got), first.data() + got);
    ASSERT_GE(n, 0);
    got += static_cast<size_t>(n);
    if (spins == 4'999'999) FAIL() << "only " << got << " completions";
  }
  ASSERT_EQ(ibv_resize_cq(cq, kHeld / 2), 0);
  EXPECT_GE(cq->cqe, static_cast<int>(kHeld / 2));
  EXPECT_LT(cq->cqe, 200);
  auto rest = poll(cq, kHeld / 2);
  ASSERT_EQ(rest.size(), kHeld / 2);
  first.insert(first.end(), rest.begin(), rest.end());
  for (uint32_t i = 0; i < kHeld; ++i) {
    EXPECT_EQ(first[i].wr_id, i);
    EXPECT_EQ(first[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(first[i].opcode, IBV_WC_SEND);
  }
  // And it keeps working at its new size.
  ASSERT_EQ(peer_.post_recv(theirs, 99, 0, 64), 0);
  ASSERT_EQ(post(qp, {.op = IBV_WR_SEND, .sges = {sge(0, 64)}, .wr_id = 99}), 0);
  auto last = poll(cq, 1);
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0].wr_id, 99u);
  EXPECT_EQ(peer_.poll(1).size(), 1u);
}

// ---- Device memory (issue 24) ------------------------------------------------------------------

TEST_F(Conformance, DeviceMemoryCopiesRegistersZeroBasedAndIsReachedBothWays) {
  ibv_device_attr_ex dx{};
  ASSERT_EQ(ibv_query_device_ex(ctx_, nullptr, &dx), 0);
  ASSERT_GE(dx.max_dm_size, 65536u);
  ibv_alloc_dm_attr big{dx.max_dm_size + 1, 0, 0};
  EXPECT_EQ(ibv_alloc_dm(ctx_, &big), nullptr);
  ibv_alloc_dm_attr attr{8192, 3, 0};
  ibv_dm* dm = ibv_alloc_dm(ctx_, &attr);
  ASSERT_NE(dm, nullptr) << std::strerror(errno);
  std::vector<uint8_t> pattern(1024);
  fill(pattern.data(), pattern.size(), 5);
  ASSERT_EQ(ibv_memcpy_to_dm(dm, 0, pattern.data(), pattern.size()), 0);
  EXPECT_EQ(ibv_memcpy_to_dm(dm, 8000, pattern.data(), 200), EINVAL);
  std::vector<uint8_t> back(1024);
  ASSERT_EQ(ibv_memcpy_from_dm(back.data(), dm, 0, back.size()), 0);
  EXPECT_EQ(back, pattern);
  EXPECT_EQ(ibv_reg_dm_mr(pd_, dm, 0, 8192, IBV_ACCESS_LOCAL_WRITE), nullptr);
  EXPECT_EQ(errno, EINVAL) << "IBV_ACCESS_ZERO_BASED is required";
  EXPECT_EQ(ibv_reg_dm_mr(pd_, dm, 4096, 8192, IBV_ACCESS_ZERO_BASED), nullptr);
  ibv_mr* dmr =
      ibv_reg_dm_mr(pd_, dm, 0, 8192, IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE | kRemote);
  ASSERT_NE(dmr, nullptr) << std::strerror(errno);
  EXPECT_EQ(dmr->addr, nullptr);
  EXPECT_EQ(ibv_free_dm(dm), EBUSY) << "an MR lies on it";
  EXPECT_EQ(
      ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, IBV_ACCESS_LOCAL_WRITE),
      IBV_REREG_MR_ERR_INPUT);

  Pair p = pair(IBV_QPT_RC, {}, {}, 128);
  ASSERT_NE(p.qp, nullptr);
  // WRITE from device memory (zero-based lkey addresses) into the peer's buffer.
  EXPECT_EQ(run(p.qp, {.op = IBV_WR_RDMA_WRITE,
                       .sges = {ibv_sge{0, 1024, dmr->lkey}},
                       .wr_id = 1,
                       .raddr = peer_.mem().addr + 8192,
                       .rkey = peer_.mem().rkey})
                .status,
            IBV_WC_SUCCESS);
  EXPECT_EQ(peer_.read(8192, 1024), pattern);
  // READ from the peer into device memory.
  std::vector<uint8_t> theirs(512);
  fill(theirs.data(), theirs.size(), 6);
  peer_.write(16384, theirs.data(), 512);
  EXPECT_EQ(run(p.qp, {.op = IBV_WR_RDMA_READ,
                       .sges = {ibv_sge{2048, 512, dmr->lkey}},
                       .wr_id = 2,
                       .raddr = peer_.mem().addr + 16384,
                       .rkey = peer_.mem().rkey})
                .status,
            IBV_WC_SUCCESS);
  std::vector<uint8_t> got(512);
  ASSERT_EQ(ibv_memcpy_from_dm(got.data(), dm, 2048, 512), 0);
  EXPECT_EQ(got, theirs);
  // The peer adds into device memory through the rkey, at zero-based addresses.
  uint64_t zero = 0;
  ASSERT_EQ(ibv_memcpy_to_dm(dm, 4096, &zero, 8), 0);
  EXPECT_EQ(peer_.fetch_add_storm({p.peer}, 4096, dmr->rkey, 1000), 1000u);
  uint64_t sum = 0;
  ASSERT_EQ(ibv_memcpy_from_dm(&sum, dm, 4096, 8), 0);
  EXPECT_EQ(sum, 1000u);
  // Beyond the MR: a local protection error.
  EXPECT_EQ(run(p.qp, {.op = IBV_WR_RDMA_WRITE,
                       .sges = {ibv_sge{8000, 1024, dmr->lkey}},
                       .wr_id = 3,
                       .raddr = peer_.mem().addr,
                       .rkey = peer_.mem().rkey})
                .status,
            IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(ibv_dereg_mr(dmr), 0);
  EXPECT_EQ(ibv_free_dm(dm), 0);
}

// Completion channels on every path (issue 25). On the direct path the libraries fire them
// (docs/ARCHITECTURE.md, "Direct path"): the peer's library for our receive, ours for our send.
// A thread blocked in ibv_get_cq_event is woken; one event per arm; a solicited-only arm lets an
// unsolicited receive pass without one.
TEST_F(Conformance, ChannelEventsWakeABlockedWaiterOncePerArmOnEveryPath) {
  ibv_cq* ecq = channel_cq();
  ASSERT_NE(ecq, nullptr);
  ibv_qp* a = make_qp(IBV_QPT_RC);                 // send and receive CQ: cq_ (no channel)
  ibv_qp* b = make_qp(IBV_QPT_RC, 16, 1, 0, ecq);  // both on ecq
  ASSERT_TRUE(a && b);
  ASSERT_NO_FATAL_FAILURE(connect_ours(a, b));
  for (uint64_t i = 0; i < 4; ++i) ASSERT_EQ(post_recv(b, 100 + i, 4096 * (i + 1), 64), 0);
  ASSERT_EQ(post_recv(a, 200, 65536, 64), 0);
  auto event = [&](int timeout_ms) { return channel_event(timeout_ms); };
  // One SEND of `from` to the other QP; both its completions taken.
  auto send = [&](ibv_qp* from, uint64_t wr_id, unsigned flags = 0) {
    EXPECT_EQ(post(from, {.sges = {sge(0, 8)}, .flags = IBV_SEND_SIGNALED | flags, .wr_id = wr_id}),
              0);
  };
  auto take_both = [&] {
    EXPECT_EQ(poll(cq_, 1).size(), 1u);
    EXPECT_EQ(poll(ecq, 1).size(), 1u);
  };
  const bool direct = direct_path_on();

  // b's receive of a's SEND, woken in a thread that waits for it.
  ASSERT_EQ(ibv_req_notify_cq(ecq, 0), 0);
  ibv_cq* woken = nullptr;
  std::thread waiter([&] { woken = event(5000); });
  send(a, 1);
  waiter.join();
  EXPECT_EQ(woken, ecq) << "the receive's event wakes the waiter";
  take_both();
  // Not re-armed: the next receive raises none.
  ASSERT_EQ(::fcntl(channel_->fd, F_SETFL, ::fcntl(channel_->fd, F_GETFL) | O_NONBLOCK), 0);
  send(a, 2);
  take_both();
  EXPECT_EQ(event(0), nullptr) << "one event per arm";
  // Solicited only: an unsolicited receive passes, a solicited one fires.
  ASSERT_EQ(ibv_req_notify_cq(ecq, 1), 0);
  send(a, 3);
  take_both();
  EXPECT_EQ(event(0), nullptr) << "an unsolicited receive under a solicited-only arm";
  send(a, 4, IBV_SEND_SOLICITED);
  EXPECT_EQ(event(5000), ecq) << "a solicited receive";
  take_both();
  // b's own send completion.
  ASSERT_EQ(ibv_req_notify_cq(ecq, 0), 0);
  send(b, 5);
  EXPECT_EQ(event(5000), ecq) << "the send's event";
  take_both();
  if (direct) {
    EXPECT_TRUE(vrdma::verbs::to_vqp(a)->granted.load()) << "a's SENDs went direct";
    EXPECT_TRUE(vrdma::verbs::to_vqp(b)->granted.load()) << "b's SEND went direct";
  }
  // A resized CQ: its `armed` word moves to the new ring; the grants that fire it are made again.
  // (The first post after it finds its grant ended and goes through the backend.)
  ASSERT_EQ(ibv_resize_cq(ecq, 128), 0);
  for (uint64_t i = 104; i < 107; ++i) ASSERT_EQ(post_recv(b, i, 4096, 64), 0);
  send(a, 6);
  take_both();
  for (uint64_t i = 7; i < 9; ++i) {
    ASSERT_EQ(ibv_req_notify_cq(ecq, 0), 0);
    send(a, i);
    EXPECT_EQ(event(5000), ecq) << "receive " << i << " after the resize";
    take_both();
  }
  if (direct) {
    EXPECT_TRUE(vrdma::verbs::to_vqp(a)->granted.load()) << "granted again";
  }
  // A QP put in ERR: the backend's flush completion (into b's own receive ring on the direct
  // path) fires the CQ's channel too, even armed for solicited completions only: a completion
  // in error counts as solicited (ibv_req_notify_cq(3)).
  ASSERT_EQ(post_recv(b, 300, 8192, 64), 0);
  ASSERT_EQ(ibv_req_notify_cq(ecq, 1), 0);
  ibv_qp_attr err{};
  err.qp_state = IBV_QPS_ERR;
  ASSERT_EQ(ibv_modify_qp(b, &err, IBV_QP_STATE), 0);
  EXPECT_EQ(event(5000), ecq) << "the flush's event";
  auto flushed = poll(ecq, 1);
  ASSERT_EQ(flushed.size(), 1u);
  EXPECT_EQ(flushed[0].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(flushed[0].wr_id, 300u);
}

// Completion channels of a QP whose peer is another guest's: across backends
// (e2e.conformance_remote) the two libraries' connection, where our library fires the channel for
// what it completes (issue 25; before, a CQ with a channel kept the QP on the backends). A waiter
// blocked on the channel is woken by our receive of the peer's SEND and by our SEND's
// completion, once per arm; a solicited-only arm lets the peer's unsolicited SEND pass and is
// fired by a completion in error.
TEST_F(Conformance, ChannelEventsOfAQpTalkingToAnotherGuestWakeABlockedWaiter) {
  ibv_cq* ecq = channel_cq();
  ASSERT_NE(ecq, nullptr);
  ibv_qp* q = make_qp(IBV_QPT_RC, 16, 1, 0, ecq);
  ASSERT_NE(q, nullptr);
  const PeerQp p = connect_peer(q, IBV_QPT_RC);
  // Across backends: READs, polled with no arm, until our library talks to the peer's.
  for (int i = 0; across_ && i < 4000 && !library_path(q); ++i) {
    ASSERT_EQ(post(q, {.op = IBV_WR_RDMA_READ,
                       .sges = {sge(buf_.size() - 8, 8)},
                       .raddr = peer_.mem().addr,
                       .rkey = peer_.mem().rkey}),
              0);
    const auto wcs = poll(ecq, 1);
    ASSERT_EQ(wcs.size(), 1u);
    ASSERT_EQ(wcs[0].status, IBV_WC_SUCCESS);
  }
  if (across_) {
    ASSERT_TRUE(library_path(q)) << "our QP never talked to the peer's library";
  }
  // One completion of ours, of `opcode`.
  auto take = [&](ibv_wc_opcode opcode, uint64_t wr_id) {
    const auto wcs = poll(ecq, 1);
    ASSERT_EQ(wcs.size(), 1u);
    EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(wcs[0].opcode, opcode);
    EXPECT_EQ(wcs[0].wr_id, wr_id);
  };
  // A thread blocked on the channel while `act` runs: the CQ it was woken for.
  auto woken_by = [&](auto act) {
    ibv_cq* woken = nullptr;
    std::thread waiter([&] { woken = channel_event(5000); });
    act();
    waiter.join();
    return woken;
  };

  // The peer's SEND into our receive.
  ASSERT_EQ(post_recv(q, 100, 4096, 64), 0);
  ASSERT_EQ(ibv_req_notify_cq(ecq, 0), 0);
  EXPECT_EQ(woken_by([&] { EXPECT_EQ(peer_.send(p, IBV_WR_SEND, 0, 8, 1), 0); }), ecq)
      << "our receive's event";
  ASSERT_NO_FATAL_FAILURE(take(IBV_WC_RECV, 100));
  EXPECT_EQ(peer_.poll(1).size(), 1u);
  // Our SEND's completion.
  ASSERT_EQ(peer_.post_recv(p, 7, 0, 64), 0);
  ASSERT_EQ(ibv_req_notify_cq(ecq, 0), 0);
  EXPECT_EQ(woken_by([&] { EXPECT_EQ(post(q, {.sges = {sge(0, 8)}, .wr_id = 2}), 0); }), ecq)
      << "our send's event";
  ASSERT_NO_FATAL_FAILURE(take(IBV_WC_SEND, 2));
  EXPECT_EQ(peer_.poll(1).size(), 1u);
  // Not armed again: the next receive raises none.
  ASSERT_EQ(::fcntl(channel_->fd, F_SETFL, ::fcntl(channel_->fd, F_GETFL) | O_NONBLOCK), 0);
  ASSERT_EQ(post_recv(q, 101, 4096, 64), 0);
  ASSERT_EQ(peer_.send(p, IBV_WR_SEND, 0, 8, 3), 0);
  ASSERT_NO_FATAL_FAILURE(take(IBV_WC_RECV, 101));
  EXPECT_EQ(peer_.poll(1).size(), 1u);
  EXPECT_EQ(channel_event(0), nullptr) << "one event per arm";
  // Solicited only: the peer's unsolicited SEND passes.
  ASSERT_EQ(post_recv(q, 102, 4096, 64), 0);
  ASSERT_EQ(ibv_req_notify_cq(ecq, 1), 0);
  ASSERT_EQ(peer_.send(p, IBV_WR_SEND, 0, 8, 4), 0);
  ASSERT_NO_FATAL_FAILURE(take(IBV_WC_RECV, 102));
  EXPECT_EQ(peer_.poll(1).size(), 1u);
  EXPECT_EQ(channel_event(0), nullptr) << "an unsolicited receive under a solicited-only arm";
  if (across_) {
    EXPECT_TRUE(library_path(q)) << "the events came from the library path";
  }
  // ... and a WRITE the peer refuses (a wrong rkey) completes in error, which fires it.
  ASSERT_EQ(::fcntl(channel_->fd, F_SETFL, ::fcntl(channel_->fd, F_GETFL) & ~O_NONBLOCK), 0);
  EXPECT_EQ(woken_by([&] {
              EXPECT_EQ(post(q, {.op = IBV_WR_RDMA_WRITE,
                                 .sges = {sge(0, 8)},
                                 .wr_id = 5,
                                 .raddr = peer_.mem().addr,
                                 .rkey = peer_.mem().rkey ^ 0x5a5a00}),
                        0);
            }),
            ecq)
      << "the error's event under a solicited-only arm";
  const auto err = poll(ecq, 1);
  ASSERT_EQ(err.size(), 1u);
  EXPECT_EQ(err[0].wr_id, 5u);
  EXPECT_EQ(err[0].status, IBV_WC_REM_ACCESS_ERR);
}

}  // namespace

// An MR imported from another context of the session (ibv_import_mr) is memory the importing
// library may not reach (in general another process's): a QP of the importing context stays on
// the backends, which reach every MR of the session, so its WRs on that MR succeed on every path.
// Across backends its QP would otherwise go direct, and the library would refuse the imported
// key (IBV_WC_LOC_PROT_ERR).
TEST_F(Conformance, AWriteFromAnImportedMrSucceedsOnEveryPath) {
  ibv_context* ctx2 = ibv_import_device(::dup(ctx_->cmd_fd));
  ASSERT_NE(ctx2, nullptr) << std::strerror(errno);
  ibv_pd* pd2 = ibv_import_pd(ctx2, pd_->handle);
  ibv_mr* mr2 = pd2 ? ibv_import_mr(pd2, mr_->handle) : nullptr;
  ibv_cq* cq2 = ibv_create_cq(ctx2, 16, nullptr, nullptr, 0);
  ibv_qp* qp = nullptr;
  if (pd2 && mr2 && cq2) {
    ibv_qp_init_attr a{};
    a.send_cq = a.recv_cq = cq2;
    a.qp_type = IBV_QPT_RC;
    a.cap = {16, 16, 1, 1, 0};
    qp = ibv_create_qp(pd2, &a);
  }
  EXPECT_NE(qp, nullptr) << std::strerror(errno);
  if (qp) {
    connect_peer(qp, IBV_QPT_RC);
    fill(buf_.data(), 256, 7);
    EXPECT_EQ(post(qp, {.op = IBV_WR_RDMA_WRITE,
                        .sges = {ibv_sge{addr(0), 256, mr2->lkey}},
                        .wr_id = 5,
                        .raddr = peer_.mem().addr,
                        .rkey = peer_.mem().rkey}),
              0);
    const auto wcs = poll(cq2, 1);
    ASSERT_EQ(wcs.size(), 1u);
    EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(wcs[0].status);
    EXPECT_EQ(peer_.read(0, 256), std::vector<uint8_t>(buf_.begin(), buf_.begin() + 256));
    EXPECT_EQ(ibv_destroy_qp(qp), 0);
  }
  if (cq2) {
    EXPECT_EQ(ibv_destroy_cq(cq2), 0);
  }
  if (mr2) ibv_unimport_mr(mr2);
  if (pd2) ibv_unimport_pd(pd2);
  EXPECT_EQ(ibv_close_device(ctx2), 0);
}
