// Both halves of the two-process harness (peer.h): the test side (class Peer) and the peer
// side (Agent), which a static initializer runs instead of the tests when the binary is started
// with VRDMA_TEST_PEER set. Orders and answers are fixed-size headers plus a payload, over pipes.
#include "peer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

extern char** environ;

namespace vrdma::test {
namespace {

enum Op : uint32_t {
  kCreateQp = 1,  ///< a: type, depth, max_sge, max_inline -> PeerQp
  kConnect,       ///< payload: QpPath
  kPostRecv,      ///< a: wr_id; payload: Pieces
  kPoll,          ///< a: n, timeout_ms -> ibv_wc[]
  kRead,          ///< a: off, len -> bytes
  kWrite,         ///< a: off; payload: bytes
  kRegMr,         ///< a: access -> PeerMem
  kDeregMr,
  kQpState,    ///< -> uint32_t state
  kStorm,      ///< a: raddr, rkey, per_qp; payload: QP indices -> uint64_t successes
  kAllocMw,    ///< a: type -> uint32_t index, uint32_t rkey
  kBindMw,     ///< a: mw, off | main << 63, len, access | wr_id << 32 -> uint32_t new rkey
  kLocalInv,   ///< a: rkey, wr_id
  kDeallocMw,  ///< a: mw
  kSetAccess,  ///< a: qp_access_flags (RTS to RTS)
  kXrcOpen,    ///< -> XrcTarget
  kSrqRecv,    ///< a: srq (0, 1), wr_id; payload: Pieces
  kSend,       ///< a: opcode, off, len, wr_id (signaled; immediate data: wr_id)
  kQuit,
};

struct Order {
  uint32_t op;
  uint32_t qp;
  uint64_t a[4];
  uint32_t payload_len;
  uint32_t reserved;
};

struct Answer {
  int32_t err;
  uint32_t payload_len;
};

/// The peer's hello: where its buffer is.
struct Hello {
  uint32_t lid;
  uint32_t rkey;
  uint64_t addr;
};

bool write_all(int fd, const void* p, size_t n) {
  auto* c = static_cast<const uint8_t*>(p);
  while (n) {
    ssize_t w = ::write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= size_t(w);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n) {
  auto* c = static_cast<uint8_t*>(p);
  while (n) {
    ssize_t r = ::read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= size_t(r);
  }
  return true;
}

// ---- The peer side -------------------------------------------------------------------------

/// Everything the peer process owns. Its orders come one at a time; it never asserts, it
/// reports (errnos, completions, bytes) and the test decides.
class Agent {
 public:
  /// Opens the device and registers the buffer; 0 or an exit code.
  int open() {
    int n = 0;
    list_ = ibv_get_device_list(&n);
    if (!list_ || n != 1) return 10;
    ctx_ = ibv_open_device(list_[0]);
    if (!ctx_) return 11;
    ibv_port_attr pa{};
    if (ibv_query_port(ctx_, 1, &pa)) return 12;
    lid_ = pa.lid;
    pd_ = ibv_alloc_pd(ctx_);
    cq_ = ibv_create_cq(ctx_, 1024, nullptr, nullptr, 0);
    buf_.assign(kPeerBufSize, 0);
    mr_ = ibv_reg_mr(pd_, buf_.data(), buf_.size(), static_cast<int>(kAllAccess));
    if (!pd_ || !cq_ || !mr_) return 13;
    return 0;
  }

  Hello hello() const { return Hello{lid_, mr_->rkey, reinterpret_cast<uintptr_t>(buf_.data())}; }

  /// Serves orders until kQuit (returns 0 after cleaning up) or a broken pipe.
  int serve(int in, int out) {
    for (;;) {
      Order o{};
      // Waits in poll, not read: a registration of ODP pages (a peer's first touch, faulted in
      // by the library's hub or pager thread) stops every thread of the process, and under
      // ThreadSanitizer a thread blocked in read never takes the stop signal.
      pollfd pf{in, POLLIN, 0};
      while (::poll(&pf, 1, -1) < 0 && errno == EINTR) {
      }
      if (!read_all(in, &o, sizeof(o))) return 20;
      std::vector<uint8_t> payload(o.payload_len), reply;
      if (o.payload_len && !read_all(in, payload.data(), payload.size())) return 21;
      if (o.op == kQuit) return close();
      Answer a{handle(o, payload, reply), 0};
      a.payload_len = static_cast<uint32_t>(reply.size());
      if (!write_all(out, &a, sizeof(a)) || !write_all(out, reply.data(), reply.size())) return 22;
    }
  }

 private:
  template <typename T>
  static void put(std::vector<uint8_t>& out, const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }

  ibv_qp* qp(uint32_t i) const { return i < qps_.size() ? qps_[i] : nullptr; }
  bool in_buf(uint64_t off, uint64_t len) const { return off <= buf_.size() && len <= buf_.size() - off; }

  int handle(const Order& o, const std::vector<uint8_t>& payload, std::vector<uint8_t>& reply) {
    switch (o.op) {
      case kCreateQp: {
        ibv_qp_init_attr ia{};
        ia.send_cq = cq_;
        ia.recv_cq = cq_;
        ia.qp_type = static_cast<ibv_qp_type>(o.a[0]);
        ia.cap.max_send_wr = ia.cap.max_recv_wr = static_cast<uint32_t>(o.a[1]);
        ia.cap.max_send_sge = ia.cap.max_recv_sge = static_cast<uint32_t>(o.a[2]);
        ia.cap.max_inline_data = static_cast<uint32_t>(o.a[3]);
        ibv_qp* q = ibv_create_qp(pd_, &ia);
        if (!q) return errno;
        qps_.push_back(q);
        put(reply, PeerQp{static_cast<uint32_t>(qps_.size() - 1), q->qp_num});
        return 0;
      }
      case kConnect: {
        QpPath p;
        if (!qp(o.qp) || payload.size() != sizeof(p)) return EINVAL;
        std::memcpy(&p, payload.data(), sizeof(p));
        return bring_to_rts(qp(o.qp), p);
      }
      case kPostRecv:
        if (!qp(o.qp)) return EINVAL;
        return post_pieces(payload, o.a[0], [&](ibv_recv_wr* wr, ibv_recv_wr** bad) {
          return ibv_post_recv(qp(o.qp), wr, bad);
        });
      case kPoll: {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(o.a[1]);
        std::vector<ibv_wc> got;
        // At least one look, even with no time to wait: "nothing there" must be checked.
        do {
          ibv_wc wc[16];
          const int k = ibv_poll_cq(cq_, static_cast<int>(std::min<uint64_t>(16, o.a[0] - got.size())), wc);
          if (k < 0) return EIO;
          got.insert(got.end(), wc, wc + k);
          if (k == 0) ::usleep(50);
        } while (got.size() < o.a[0] && std::chrono::steady_clock::now() < deadline);
        for (const ibv_wc& wc : got) put(reply, wc);
        return 0;
      }
      case kRead:
        if (!in_buf(o.a[0], o.a[1])) return EINVAL;
        reply.assign(buf_.begin() + long(o.a[0]), buf_.begin() + long(o.a[0] + o.a[1]));
        return 0;
      case kWrite:
        if (!in_buf(o.a[0], payload.size())) return EINVAL;
        std::memcpy(buf_.data() + o.a[0], payload.data(), payload.size());
        return 0;
      case kRegMr: {
        if (mr2_) return EBUSY;
        uint8_t* at;
        if (o.a[0] & IBV_ACCESS_ON_DEMAND) {
          // ODP: fresh pages nothing touched yet, the last one not accessible at all.
          void* m =
              ::mmap(nullptr, kMr2Size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
          if (m == MAP_FAILED) return errno;
          odp_ = static_cast<uint8_t*>(m);
          if (::mprotect(odp_ + kMr2Size - 4096, 4096, PROT_NONE)) return errno;
          at = odp_;
        } else {
          buf2_.assign(kMr2Size, 0);
          at = buf2_.data();
        }
        mr2_ = ibv_reg_mr(pd_, at, kMr2Size, static_cast<int>(o.a[0]));
        if (!mr2_) return errno;
        put(reply, PeerMem{reinterpret_cast<uintptr_t>(at), mr2_->rkey, kMr2Size});
        return 0;
      }
      case kDeregMr: {
        if (!mr2_) return EINVAL;
        const int rc = ibv_dereg_mr(mr2_);
        if (rc == 0) mr2_ = nullptr;  // EBUSY (a window bound to it): it stays
        if (rc == 0) unmap_odp();
        return rc;
      }
      case kXrcOpen:
        return xrc_open(reply);
      case kSrqRecv:
        if (o.a[0] >= 2 || !srqs_[o.a[0]]) return EINVAL;
        return post_pieces(payload, o.a[1], [&](ibv_recv_wr* wr, ibv_recv_wr** bad) {
          return ibv_post_srq_recv(srqs_[o.a[0]], wr, bad);
        });
      case kSend: {
        if (!qp(o.qp) || !in_buf(o.a[1], o.a[2])) return EINVAL;
        ibv_sge s{reinterpret_cast<uintptr_t>(buf_.data()) + o.a[1], static_cast<uint32_t>(o.a[2]),
                  mr_->lkey};
        ibv_send_wr wr{};
        ibv_send_wr* bad = nullptr;
        wr.wr_id = o.a[3];
        wr.sg_list = &s;
        wr.num_sge = 1;
        wr.opcode = static_cast<ibv_wr_opcode>(o.a[0]);
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.imm_data = htonl(static_cast<uint32_t>(o.a[3]));
        return ibv_post_send(qp(o.qp), &wr, &bad);
      }
      case kSetAccess: {
        if (!qp(o.qp)) return EINVAL;
        ibv_qp_attr a{};
        a.qp_access_flags = static_cast<unsigned>(o.a[0]);
        return ibv_modify_qp(qp(o.qp), &a, IBV_QP_ACCESS_FLAGS);
      }
      case kQpState: {
        ibv_qp_attr a{};
        ibv_qp_init_attr ia{};
        if (!qp(o.qp)) return EINVAL;
        if (int rc = ibv_query_qp(qp(o.qp), &a, IBV_QP_STATE, &ia)) return rc;
        put(reply, static_cast<uint32_t>(a.qp_state));
        return 0;
      }
      case kStorm:
        return storm(o, payload, reply);
      case kAllocMw: {
        ibv_mw* mw = ibv_alloc_mw(pd_, static_cast<ibv_mw_type>(o.a[0]));
        if (!mw) return errno;
        mws_.push_back(mw);
        put(reply, static_cast<uint32_t>(mws_.size() - 1));
        put(reply, mw->rkey);
        return 0;
      }
      case kBindMw:
        return bind_mw(o, reply);
      case kLocalInv: {
        if (!qp(o.qp)) return EINVAL;
        ibv_send_wr wr{};
        wr.wr_id = o.a[1];
        wr.opcode = IBV_WR_LOCAL_INV;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.invalidate_rkey = static_cast<uint32_t>(o.a[0]);
        ibv_send_wr* bad = nullptr;
        return ibv_post_send(qp(o.qp), &wr, &bad);
      }
      case kDeallocMw: {
        if (o.a[0] >= mws_.size() || !mws_[o.a[0]]) return EINVAL;
        const int rc = ibv_dealloc_mw(mws_[o.a[0]]);
        if (rc == 0) mws_[o.a[0]] = nullptr;
        return rc;
      }
      default:
        return ENOSYS;
    }
  }

  /// A receive WR `wr_id` scattering into the Pieces in `payload` (of the main buffer), handed
  /// to `post`; EINVAL for none or more than 16.
  template <typename Post>
  int post_pieces(const std::vector<uint8_t>& payload, uint64_t wr_id, Post post) {
    const size_t n = payload.size() / sizeof(Piece);
    if (n == 0 || n > 16) return EINVAL;
    ibv_sge sge[16];
    for (size_t i = 0; i < n; ++i) {
      Piece pc;
      std::memcpy(&pc, payload.data() + i * sizeof(Piece), sizeof(pc));
      // Outside the buffer stays outside: the test may want a receive the device refuses.
      sge[i] = ibv_sge{reinterpret_cast<uintptr_t>(buf_.data()) + pc.off, pc.len, mr_->lkey};
    }
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = sge;
    wr.num_sge = static_cast<int>(n);
    ibv_recv_wr* bad = nullptr;
    return post(&wr, &bad);
  }

  /// A new XRC receive QP (it joins qps_; kConnect connects it) in the peer's private XRC
  /// domain, made at the first call with two XRC SRQs that complete on the peer's CQ.
  int xrc_open(std::vector<uint8_t>& reply) {
    XrcTarget t{};
    if (xrcd_) {
      for (int i = 0; i < 2; ++i) {
        if (ibv_get_srq_num(srqs_[i], &t.srqn[i])) return EIO;
      }
      return xrc_recv_qp(t, reply);
    }
    ibv_xrcd_init_attr xa{};
    xa.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
    xa.fd = -1;
    xa.oflags = O_CREAT;
    xrcd_ = ibv_open_xrcd(ctx_, &xa);
    if (!xrcd_) return errno;
    for (int i = 0; i < 2; ++i) {
      ibv_srq_init_attr_ex a{};
      a.attr.max_wr = 16;
      a.attr.max_sge = 2;
      a.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ |
                    IBV_SRQ_INIT_ATTR_PD;
      a.srq_type = IBV_SRQT_XRC;
      a.xrcd = xrcd_;
      a.cq = cq_;
      a.pd = pd_;
      srqs_[i] = ibv_create_srq_ex(ctx_, &a);
      if (!srqs_[i] || ibv_get_srq_num(srqs_[i], &t.srqn[i])) return errno ? errno : EIO;
    }
    return xrc_recv_qp(t, reply);
  }
  int xrc_recv_qp(XrcTarget& t, std::vector<uint8_t>& reply) {
    ibv_qp_init_attr_ex q{};
    q.qp_type = IBV_QPT_XRC_RECV;
    q.comp_mask = IBV_QP_INIT_ATTR_XRCD;
    q.xrcd = xrcd_;
    ibv_qp* r = ibv_create_qp_ex(ctx_, &q);
    if (!r) return errno;
    qps_.push_back(r);
    t.qp = PeerQp{static_cast<uint32_t>(qps_.size() - 1), r->qp_num};
    put(reply, t);
    return 0;
  }

  /// Binds window a[0] over [off, off + len) of the second MR (or the main one: top bit of
  /// a[1]): type 1 through ibv_bind_mw, type 2 with an IBV_WR_BIND_MW of the next key.
  int bind_mw(const Order& o, std::vector<uint8_t>& reply) {
    if (!qp(o.qp) || o.a[0] >= mws_.size() || !mws_[o.a[0]]) return EINVAL;
    ibv_mw* mw = mws_[o.a[0]];
    const bool main = o.a[1] >> 63;
    ibv_mr* mr = main ? mr_ : mr2_;
    if (!mr) return EINVAL;
    ibv_mw_bind_info info{};
    info.mr = o.a[2] || mw->type == IBV_MW_TYPE_2 ? mr : nullptr;
    info.addr = o.a[2] || mw->type == IBV_MW_TYPE_2
                    ? reinterpret_cast<uintptr_t>(mr->addr) + (o.a[1] & ~(1ull << 63))
                    : 0;
    info.length = o.a[2];
    info.mw_access_flags = static_cast<unsigned>(o.a[3] & 0xffffffff);
    const uint64_t wr_id = o.a[3] >> 32;
    if (mw->type == IBV_MW_TYPE_1) {
      ibv_mw_bind b{};
      b.wr_id = wr_id;
      b.send_flags = IBV_SEND_SIGNALED;
      b.bind_info = info;
      if (int rc = ibv_bind_mw(qp(o.qp), mw, &b)) return rc;
    } else {
      ibv_send_wr wr{};
      wr.wr_id = wr_id;
      wr.opcode = IBV_WR_BIND_MW;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.bind_mw.mw = mw;
      wr.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
      wr.bind_mw.bind_info = info;
      ibv_send_wr* bad = nullptr;
      if (int rc = ibv_post_send(qp(o.qp), &wr, &bad)) return rc;
      mw->rkey = wr.bind_mw.rkey;  // a type 2 window's key is the consumer's to track
    }
    put(reply, mw->rkey);
    return 0;
  }

  /// Fetch-and-adds from several QPs at once: each round posts 64 on every QP (the last one
  /// signaled), then waits for one completion per QP, so all QPs have work in flight together.
  int storm(const Order& o, const std::vector<uint8_t>& payload, std::vector<uint8_t>& reply) {
    constexpr uint32_t kBatch = 64;
    std::vector<ibv_qp*> qs;
    for (size_t i = 0; i + 4 <= payload.size(); i += 4) {
      uint32_t idx;
      std::memcpy(&idx, payload.data() + i, 4);
      if (!qp(idx)) return EINVAL;
      qs.push_back(qp(idx));
    }
    uint64_t ok = 0;
    for (uint64_t done = 0; done < o.a[2]; done += kBatch) {
      const uint32_t batch = static_cast<uint32_t>(std::min<uint64_t>(kBatch, o.a[2] - done));
      for (size_t q = 0; q < qs.size(); ++q) {
        for (uint32_t k = 0; k < batch; ++k) {
          ibv_sge s{reinterpret_cast<uintptr_t>(buf_.data()) + 8 * q, 8, mr_->lkey};
          ibv_send_wr wr{};
          wr.wr_id = q;
          wr.sg_list = &s;
          wr.num_sge = 1;
          wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
          wr.send_flags = k == batch - 1 ? IBV_SEND_SIGNALED : 0;
          wr.wr.atomic.remote_addr = o.a[0];
          wr.wr.atomic.rkey = static_cast<uint32_t>(o.a[1]);
          wr.wr.atomic.compare_add = 1;
          ibv_send_wr* bad = nullptr;
          if (int rc = ibv_post_send(qs[q], &wr, &bad)) return rc;
        }
      }
      for (size_t got = 0; got < qs.size();) {
        ibv_wc wc;
        const int k = ibv_poll_cq(cq_, 1, &wc);
        if (k < 0) return EIO;
        if (k == 0) continue;
        if (wc.status != IBV_WC_SUCCESS) {
          put(reply, ok);
          return EIO;
        }
        ok += batch;
        ++got;
      }
    }
    put(reply, ok);
    return 0;
  }

  int close() {
    int bad = 0;
    for (ibv_qp* q : qps_) bad |= ibv_destroy_qp(q);
    for (ibv_srq* q : srqs_)
      if (q) bad |= ibv_destroy_srq(q);
    if (xrcd_) bad |= ibv_close_xrcd(xrcd_);
    for (ibv_mw* mw : mws_)
      if (mw) bad |= ibv_dealloc_mw(mw);
    if (mr2_) bad |= ibv_dereg_mr(mr2_);
    unmap_odp();
    bad |= ibv_dereg_mr(mr_);
    bad |= ibv_destroy_cq(cq_);
    bad |= ibv_dealloc_pd(pd_);
    bad |= ibv_close_device(ctx_);
    ibv_free_device_list(list_);
    return bad ? 30 : 0;
  }

  /// The ODP buffer goes once its MR has (ARCHITECTURE.md, "Unmapping ODP memory").
  void unmap_odp() {
    if (odp_) ::munmap(odp_, kMr2Size);
    odp_ = nullptr;
  }

  static constexpr uint32_t kMr2Size = 1 << 16;
  ibv_device** list_ = nullptr;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_mr* mr_ = nullptr;
  ibv_mr* mr2_ = nullptr;
  uint16_t lid_ = 0;
  std::vector<uint8_t> buf_, buf2_;  // malloc'ed after the fork: must not corrupt the parent
  uint8_t* odp_ = nullptr;           ///< the second buffer, when its MR is ODP (mmap'ed)
  std::vector<ibv_qp*> qps_;
  std::vector<ibv_mw*> mws_;  ///< null where deallocated
  ibv_xrcd* xrcd_ = nullptr;
  ibv_srq* srqs_[2] = {};  ///< XRC SRQs of xrcd_
};

/// In the peer copy of the binary, the agent runs before gtest starts and never returns.
const int kPeerHook = [] {
  const char* fds = std::getenv("VRDMA_TEST_PEER");
  if (!fds) return 0;
  int in = -1, out = -1;
  if (std::sscanf(fds, "%d,%d", &in, &out) != 2) ::_exit(2);
  static Agent agent;
  int rc = agent.open();
  Hello h{};
  if (rc == 0) h = agent.hello();
  if (!write_all(out, &h, sizeof(h))) ::_exit(3);
  ::_exit(rc ? rc : agent.serve(in, out));
}();

}  // namespace

// ---- The test side -------------------------------------------------------------------------

bool Peer::start(const std::string& guest) {
  int down[2], up[2];
  if (::pipe2(down, O_CLOEXEC) || ::pipe2(up, O_CLOEXEC)) {
    ADD_FAILURE() << "pipe: " << std::strerror(errno);
    return false;
  }
  // Everything the child needs is built before fork: after it, only async-signal-safe calls.
  std::vector<std::string> env_s{"VRDMA_TEST_PEER=" + std::to_string(down[0]) + "," +
                                     std::to_string(up[1]),
                                 "VRDMA_GUEST=" + guest};
  // VRDMA_TEST_PEER_SOCKET: the peer's guest lives on another backend (one of another host, as
  // far as the libraries know).
  const char* other = std::getenv("VRDMA_TEST_PEER_SOCKET");
  if (other) env_s.push_back(std::string("VRDMA_SOCKET=") + other);
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, "VRDMA_GUEST=", 12) && std::strncmp(*e, "VRDMA_TEST_PEER=", 16) &&
        (!other || std::strncmp(*e, "VRDMA_SOCKET=", 13)))
      env_s.emplace_back(*e);
  }
  std::vector<char*> envp;
  for (std::string& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);
  char arg0[] = "vrdma-test-peer";
  char* argv[] = {arg0, nullptr};
  pid_ = ::fork();
  if (pid_ == 0) {
    ::fcntl(down[0], F_SETFD, 0);
    ::fcntl(up[1], F_SETFD, 0);
    ::execve("/proc/self/exe", argv, envp.data());
    ::_exit(4);
  }
  ::close(down[0]);
  ::close(up[1]);
  to_peer_ = down[1];
  from_peer_ = up[0];
  if (pid_ < 0) {
    ADD_FAILURE() << "fork: " << std::strerror(errno);
    return false;
  }
  Hello h{};
  if (!read_all(from_peer_, &h, sizeof(h)) || h.lid == 0) {
    ADD_FAILURE() << "the peer did not start (exit status " << finish() << ")";
    return false;
  }
  lid_ = static_cast<uint16_t>(h.lid);
  mem_ = PeerMem{h.addr, h.rkey, static_cast<uint32_t>(kPeerBufSize)};
  return true;
}

int Peer::finish() {
  if (pid_ <= 0) return -1;
  Order o{};
  o.op = kQuit;
  write_all(to_peer_, &o, sizeof(o));
  ::close(to_peer_);
  ::close(from_peer_);
  int st = 0;
  const pid_t r = ::waitpid(pid_, &st, 0);
  pid_ = -1;
  return r > 0 && WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

Peer::~Peer() { finish(); }

int Peer::call(uint32_t op, uint32_t qp, std::initializer_list<uint64_t> args,
               const void* payload, size_t payload_len, std::vector<uint8_t>* out) {
  Order o{};
  o.op = op;
  o.qp = qp;
  size_t i = 0;
  for (uint64_t a : args) o.a[i++] = a;
  o.payload_len = static_cast<uint32_t>(payload_len);
  Answer a{};
  std::vector<uint8_t> reply;
  if (!write_all(to_peer_, &o, sizeof(o)) || !write_all(to_peer_, payload, payload_len) ||
      !read_all(from_peer_, &a, sizeof(a))) {
    ADD_FAILURE() << "the peer is gone (order " << op << ")";
    return -1;
  }
  reply.resize(a.payload_len);
  if (a.payload_len && !read_all(from_peer_, reply.data(), reply.size())) {
    ADD_FAILURE() << "the peer is gone (answer to order " << op << ")";
    return -1;
  }
  if (out) *out = std::move(reply);
  return a.err;
}

namespace {
template <typename T>
T first_as(const std::vector<uint8_t>& v) {
  T t{};
  if (v.size() >= sizeof(T)) std::memcpy(&t, v.data(), sizeof(T));
  return t;
}
}  // namespace

PeerQp Peer::create_qp(ibv_qp_type type, uint32_t depth, uint32_t max_sge, uint32_t max_inline) {
  std::vector<uint8_t> r;
  const int err = call(kCreateQp, 0, {uint64_t(type), depth, max_sge, max_inline}, nullptr, 0, &r);
  EXPECT_EQ(err, 0) << "peer ibv_create_qp: " << std::strerror(err);
  return err ? PeerQp{~0u, 0} : first_as<PeerQp>(r);
}

int Peer::connect(const PeerQp& qp, const QpPath& path) {
  return call(kConnect, qp.index, {}, &path, sizeof(path));
}

int Peer::post_recv(const PeerQp& qp, uint64_t wr_id, const std::vector<Piece>& pieces) {
  return call(kPostRecv, qp.index, {wr_id}, pieces.data(), pieces.size() * sizeof(Piece));
}

std::vector<ibv_wc> Peer::poll(size_t n, int timeout_ms) {
  std::vector<uint8_t> r;
  EXPECT_EQ(call(kPoll, 0, {n, uint64_t(timeout_ms)}, nullptr, 0, &r), 0);
  std::vector<ibv_wc> wcs(r.size() / sizeof(ibv_wc));
  if (!wcs.empty()) std::memcpy(wcs.data(), r.data(), wcs.size() * sizeof(ibv_wc));
  return wcs;
}

std::vector<uint8_t> Peer::read(uint64_t off, uint32_t len) {
  std::vector<uint8_t> r;
  EXPECT_EQ(call(kRead, 0, {off, len}, nullptr, 0, &r), 0);
  return r;
}

void Peer::write(uint64_t off, const void* p, uint32_t len) {
  EXPECT_EQ(call(kWrite, 0, {off}, p, len), 0);
}

PeerMem Peer::reg_mr(unsigned access) {
  std::vector<uint8_t> r;
  EXPECT_EQ(call(kRegMr, 0, {access}, nullptr, 0, &r), 0);
  return first_as<PeerMem>(r);
}

Peer::Window Peer::alloc_mw(ibv_mw_type type) {
  std::vector<uint8_t> r;
  Window w{~0u, 0};
  if (call(kAllocMw, 0, {static_cast<uint64_t>(type)}, nullptr, 0, &r) == 0 && r.size() == 8)
    std::memcpy(&w, r.data(), 8);
  return w;
}

int Peer::bind_mw(const PeerQp& qp, const Window& w, uint64_t off, uint64_t len, unsigned access,
                  uint64_t wr_id, uint32_t* rkey, bool main_mr) {
  std::vector<uint8_t> r;
  const int rc =
      call(kBindMw, qp.index,
           {w.index, off | (main_mr ? 1ull << 63 : 0), len, access | wr_id << 32}, nullptr, 0, &r);
  if (rc == 0 && rkey) *rkey = first_as<uint32_t>(r);
  return rc;
}

int Peer::local_inv(const PeerQp& qp, uint32_t rkey, uint64_t wr_id) {
  return call(kLocalInv, qp.index, {rkey, wr_id}, nullptr, 0);
}

int Peer::dealloc_mw(const Window& w) { return call(kDeallocMw, 0, {w.index}, nullptr, 0); }

int Peer::dereg_mr() { return call(kDeregMr, 0, {}, nullptr, 0); }

XrcTarget Peer::xrc_open() {
  std::vector<uint8_t> r;
  EXPECT_EQ(call(kXrcOpen, 0, {}, nullptr, 0, &r), 0);
  return first_as<XrcTarget>(r);
}

int Peer::post_srq_recv(uint32_t srq, uint64_t wr_id, const std::vector<Piece>& pieces) {
  return call(kSrqRecv, 0, {srq, wr_id}, pieces.data(), pieces.size() * sizeof(Piece));
}

int Peer::send(const PeerQp& qp, ibv_wr_opcode op, uint64_t off, uint32_t len, uint64_t wr_id) {
  return call(kSend, qp.index, {op, off, len, wr_id}, nullptr, 0);
}

int Peer::set_access(const PeerQp& qp, unsigned access) {
  return call(kSetAccess, qp.index, {access}, nullptr, 0);
}

ibv_qp_state Peer::qp_state(const PeerQp& qp) {
  std::vector<uint8_t> r;
  EXPECT_EQ(call(kQpState, qp.index, {}, nullptr, 0, &r), 0);
  return static_cast<ibv_qp_state>(first_as<uint32_t>(r));
}

uint64_t Peer::fetch_add_storm(const std::vector<PeerQp>& qps, uint64_t raddr, uint32_t rkey,
                               uint32_t per_qp) {
  std::vector<uint32_t> idx;
  for (const PeerQp& q : qps) idx.push_back(q.index);
  std::vector<uint8_t> r;
  EXPECT_EQ(call(kStorm, 0, {raddr, rkey, per_qp}, idx.data(), idx.size() * 4, &r), 0);
  return first_as<uint64_t>(r);
}

}  // namespace vrdma::test
