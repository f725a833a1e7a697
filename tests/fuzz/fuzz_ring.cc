// Fuzz target: the ring consumer. Two guests with connected RC QPs, a UD pair and a QP on an
// SRQ; the input is a program of operations a hostile guest can do to its own shared memory:
// write arbitrary send/receive WQEs into any slot (num_sge, lengths, keys, opcodes, inline
// lengths all fuzzer-chosen, optionally aimed at real MRs so deep paths are reached), move
// producer and CQ consumer cursors anywhere, scribble over ring headers, modify QPs with
// arbitrary attributes, and die (close its session); interleaved with Device::poll().
// What must hold: no crash, no sanitizer report (the memory the backend touches is exactly the
// mapped MRs and rings).
#include <infiniband/verbs.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "common/memfd.h"
#include "engine/device.h"

namespace vrdma::fuzz {
namespace {

using namespace vrdma::proto;
using engine::Device;
using engine::FdList;
using engine::Session;

/// Reads the input front to back; past its end every read gives zeros.
struct Input {
  const uint8_t* p;
  size_t n;
  bool empty() const { return n == 0; }
  template <typename T>
  T get() {
    T v{};
    const size_t k = n < sizeof(T) ? n : sizeof(T);
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
  void bytes(void* out, size_t len) {
    const size_t k = n < len ? n : len;
    std::memcpy(out, p, k);
    std::memset(static_cast<uint8_t*>(out) + k, 0, len - k);
    p += k;
    n -= k;
  }
};

struct Mem {
  MappedRegion map;
  uint64_t addr = 0;
  uint32_t key = 0;
};
struct Ring {  ///< a guest's view of one ring
  MappedRegion map;  ///< for CQs and SRQs; QPs share the QP's
  RingHeader* hdr = nullptr;
  uint8_t* entries = nullptr;
  uint32_t size = 0, entry = 0;
};
struct Q {
  Session* s = nullptr;
  int guest = 0;
  ibv_qp_type type = IBV_QPT_RC;
  uint32_t handle = 0, qpn = 0;
  MappedRegion map;
  Ring sq, rq;
};

class World {
 public:
  World() {
    for (int g = 0; g < 2; ++g) {
      HelloReq req{};
      std::snprintf(req.guest, sizeof(req.guest), "fuzz-%d", g);
      HelloResp resp{};
      FdList fds;
      s_[g] = dev_.open_session(req, PeerCred{0, 0, 0}, resp, fds).value();
      lid_[g] = static_cast<uint16_t>(resp.lid);
      pd_[g] = dev_.alloc_pd(*s_[g]).value();
      UniqueFd fd;
      auto c = dev_.create_cq(*s_[g], CreateCqReq{15, kNone, 0, 0}, fd).value();
      cq_[g] = ring(fd, c.ring_bytes);
      cqh_[g] = c.handle;
      mem_[g][0] = mem(g, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                    IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
      mem_[g][1] = mem(g, 4096, 0);
    }
    // An MR whose two extents end a page apart in two segments: 8 bytes may straddle them.
    mem_[1][2] = split_mem(1);
    auto srq = dev_.create_srq(*s_[1], CreateSrqReq{pd_[1], 0, SrqAttr{8, 2, 2, 0}}, srq_fd_);
    srq_ = ring(srq_fd_, srq->ring_bytes);
    srqh_ = srq->handle;
    qp_[0] = qp(0, IBV_QPT_RC, kNone);
    qp_[1] = qp(1, IBV_QPT_RC, kNone);
    qp_[2] = qp(0, IBV_QPT_UD, kNone);
    qp_[3] = qp(1, IBV_QPT_UD, kNone);
    qp_[4] = qp(0, IBV_QPT_UC, kNone);
    qp_[5] = qp(1, IBV_QPT_UC, srqh_);
    connect(qp_[0], qp_[1]);
    connect(qp_[1], qp_[0]);
    connect(qp_[2], qp_[3]);
    connect(qp_[3], qp_[2]);
    connect(qp_[4], qp_[5]);
    connect(qp_[5], qp_[4]);
  }

  void run(Input in) {
    uint64_t now = 1'000'000'000;
    for (int steps = 0; !in.empty() && steps < 256; ++steps) {
      const uint8_t op = in.get<uint8_t>();
      Q& q = qp_[in.get<uint8_t>() % kQps];
      const bool alive = s_[q.guest] != nullptr;
      switch (op % 10) {
        case 0: {  // a send WQE into any slot
          SendWqe w;
          const uint32_t slot = in.get<uint8_t>();
          in.bytes(&w, sizeof(w));
          aim_send(w, in.get<uint8_t>(), in);
          std::memcpy(q.sq.entries + (slot & (q.sq.size - 1)) * q.sq.entry, &w, sizeof(w));
          break;
        }
        case 1: {  // a receive WQE into the RQ or the SRQ
          RecvWqe w;
          const uint8_t slot = in.get<uint8_t>();
          in.bytes(&w, sizeof(w));
          aim_recv(w, in.get<uint8_t>(), in);
          // Our own mappings stay valid after the backend let go of them (a dead guest's).
          Ring& r = (slot & 0x80) ? srq_ : q.rq;
          std::memcpy(r.entries + (slot & (r.size - 1)) * r.entry, &w, sizeof(w));
          break;
        }
        case 2:  // the SQ producer: a few past the consumer, or anything
        case 3: {
          Ring& r = op % 10 == 2 ? q.sq : q.rq;
          const uint8_t how = in.get<uint8_t>();
          const uint32_t v = in.get<uint32_t>();
          const uint32_t cons = r.hdr->consumer.load();
          r.hdr->producer.store(how & 1 ? v : cons + (v % (r.size + 2)));
          break;
        }
        case 4: {  // a CQ consumer or the SRQ producer, anywhere
          const uint8_t which = in.get<uint8_t>();
          const uint32_t v = in.get<uint32_t>();
          if (which & 1) {
            srq_.hdr->producer.store(v);
          } else {
            Ring& c = cq_[which >> 1 & 1];
            c.hdr->consumer.store(which & 2 ? v : c.hdr->producer.load());
          }
          break;
        }
        case 5:
          dev_.poll(now += uint64_t{in.get<uint32_t>()} * 1000);
          break;
        case 6: {  // modify with arbitrary attributes
          ModifyQpReq req{};
          req.handle = q.handle;
          req.mask = in.get<uint32_t>();
          in.bytes(&req.attr, sizeof(req.attr));
          if (alive) (void)dev_.modify_qp(*q.s, req);
          break;
        }
        case 7: {  // scribble over a ring header (the backend keeps private copies)
          uint8_t junk[64];
          const uint8_t off = in.get<uint8_t>() % (sizeof(RingHeader) - sizeof(junk) + 1);
          in.bytes(junk, sizeof(junk));
          std::memcpy(reinterpret_cast<uint8_t*>(q.sq.hdr) + off, junk, sizeof(junk));
          break;
        }
        case 8: {  // a guest dies, or destroys a QP or an MR
          const uint8_t what = in.get<uint8_t>();
          if (!alive) break;
          if (what < 16) {
            dev_.close_session(q.s);
            for (Q& o : qp_) {
              if (o.guest == q.guest) o.s = nullptr;
            }
            s_[q.guest] = nullptr;
          } else if (what < 32) {
            (void)dev_.dereg_mr(*q.s, what & 15);
          }
          break;
        }
        default:
          for (int i = 0; i < 4; ++i) dev_.poll(now += 10'000'000);
          break;
      }
    }
    for (int i = 0; i < 8; ++i) dev_.poll(now += 1'000'000'000);
  }

 private:
  static constexpr int kQps = 6;

  Ring ring(UniqueFd& fd, uint64_t bytes) {
    Ring r;
    r.map = MappedRegion::map_shared(fd.get(), bytes);
    attach(r, r.map.data());
    return r;
  }
  static void attach(Ring& r, uint8_t* base) {
    r.hdr = reinterpret_cast<RingHeader*>(base);
    r.entries = base + sizeof(RingHeader);
    r.size = r.hdr->num_entries;
    r.entry = r.hdr->entry_size;
  }
  Mem mem(int g, uint64_t len, uint32_t access) {
    Mem m;
    UniqueFd fd = make_sealed_memfd("fuzz-mem", len).value();
    m.map = MappedRegion::map_shared(fd.get(), len);
    m.addr = reinterpret_cast<uint64_t>(m.map.data());
    const uint32_t seg = dev_.reg_segment(*s_[g], RegSegmentReq{len}, std::move(fd)).value();
    RegMrReq req{};
    req.pd = pd_[g];
    req.access = access;
    req.addr = req.iova = m.addr;
    req.length = len;
    req.num_extents = 1;
    req.extents[0] = MrExtent{0, len, 0, seg, 0};
    m.key = dev_.reg_mr(*s_[g], req).value().lkey;
    return m;
  }
  Mem split_mem(int g) {
    Mem m;
    uint32_t seg[2];
    for (uint32_t& h : seg) {
      UniqueFd fd = make_sealed_memfd("fuzz-split", 4096).value();
      h = dev_.reg_segment(*s_[g], RegSegmentReq{4096}, std::move(fd)).value();
    }
    RegMrReq req{};
    req.pd = pd_[g];
    req.access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                 IBV_ACCESS_REMOTE_ATOMIC;
    req.addr = req.iova = m.addr = 0x100000;
    req.length = 4096;
    req.num_extents = 2;
    req.extents[0] = MrExtent{0, 4092, 0, seg[0], 0};
    req.extents[1] = MrExtent{4092, 4, 4092, seg[1], 0};
    m.key = dev_.reg_mr(*s_[g], req).value().lkey;
    return m;
  }
  Q qp(int g, ibv_qp_type type, uint32_t srq) {
    CreateQpReq req{};
    req.pd = pd_[g];
    req.send_cq = req.recv_cq = cqh_[g];
    req.srq = srq;
    req.qp_type = static_cast<uint8_t>(type);
    req.caps = QpCaps{8, 8, 2, 2, 64, 0};
    UniqueFd fd;
    auto r = dev_.create_qp(*s_[g], req, fd).value();
    Q q;
    q.s = s_[g];
    q.guest = g;
    q.type = type;
    q.handle = r.handle;
    q.qpn = r.qpn;
    q.map = MappedRegion::map_shared(fd.get(), r.ring_bytes);
    attach(q.sq, q.map.data());
    attach(q.rq, q.map.data() + r.rq_offset);
    return q;
  }
  /// RESET -> INIT -> RTR -> RTS with the attributes each QP type requires.
  void connect(Q& q, const Q& peer) {
    const bool ud = q.type == IBV_QPT_UD, rc = q.type == IBV_QPT_RC;
    QpAttr a{};
    a.port_num = 1;
    a.qkey = 0x1234;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                        IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    a.path_mtu = IBV_MTU_4096;
    a.dlid = lid_[peer.guest];
    a.dest_qp_num = peer.qpn;
    a.min_rnr_timer = 1;
    a.timeout = 1;
    a.retry_cnt = 2;
    a.rnr_retry = 2;
    a.max_rd_atomic = a.max_dest_rd_atomic = 1;
    const uint32_t init = IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                          (ud ? IBV_QP_QKEY : IBV_QP_ACCESS_FLAGS);
    const uint32_t rtr =
        ud ? 0
           : IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                 (rc ? IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER : 0);
    const uint32_t rts = IBV_QP_SQ_PSN | (rc ? IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                                   IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC
                                             : 0);
    const std::pair<ibv_qp_state, uint32_t> steps[] = {
        {IBV_QPS_INIT, init}, {IBV_QPS_RTR, rtr}, {IBV_QPS_RTS, rts}};
    for (auto [state, mask] : steps) {
      a.qp_state = state;
      if (!dev_.modify_qp(*q.s, ModifyQpReq{q.handle, IBV_QP_STATE | mask, a})) std::abort();
    }
  }
  /// Points SGEs and the remote address near real MRs (so bounds checks are what decides).
  void aim_sge(Sge& s, uint8_t sel, Input& in) {
    const Mem& m = mem_[sel >> 2 & 1][(sel & 3) % 3];
    s.lkey = m.key;
    s.addr = m.addr + static_cast<int16_t>(in.get<uint16_t>());
    s.length = in.get<uint16_t>();
  }
  void aim_send(SendWqe& w, uint8_t how, Input& in) {
    if (!(how & 0x80)) return;  // the raw bytes as they are
    w.opcode %= 11;
    w.num_sge %= 4;
    w.inline_len %= 300;
    for (uint32_t i = 0; i < 2; ++i) aim_sge(w.sge[i], in.get<uint8_t>(), in);
    // how: bit 0 aim the remote address, 1 its guest, 2-3 which MR; 4 a UD destination,
    // 5 its guest, 6 "the QP's own qkey"; 7 aim at all.
    if (how & 1) {
      const Mem& m = mem_[how >> 1 & 1][(how >> 2 & 3) % 3];
      w.rkey = m.key;
      w.remote_addr = m.addr + static_cast<int16_t>(in.get<uint16_t>());
    }
    if (how & 0x10) {  // a UD destination: a UD QP of either guest
      UdDest d{};
      d.dlid = lid_[(how >> 5) & 1];
      pack_ud_dest(w, d);
      w.ud_remote_qpn = qp_[2 + ((how >> 5) & 1)].qpn;
      w.ud_remote_qkey = how & 0x40 ? 0x80000000u : 0x1234;
    }
  }
  void aim_recv(RecvWqe& w, uint8_t how, Input& in) {
    if (!(how & 0x80)) return;
    w.num_sge %= 4;
    for (uint32_t i = 0; i < 2; ++i) aim_sge(w.sge[i], in.get<uint8_t>(), in);
  }

  Device dev_;
  Session* s_[2] = {};
  uint16_t lid_[2] = {};
  uint32_t pd_[2] = {}, cqh_[2] = {}, srqh_ = 0;
  Ring cq_[2];
  UniqueFd srq_fd_;
  Ring srq_;
  Mem mem_[2][3];
  Q qp_[kQps];
};

}  // namespace

int fuzz_ring(const uint8_t* data, size_t size) {
  World w;
  w.run(Input{data, size});
  return 0;
}

}  // namespace vrdma::fuzz
