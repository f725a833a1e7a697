// The direct path in the library (see direct.h). No syscall here but the rare grant and ring
// lookups, and the write of a completion event into an armed CQ's channel (the one wake-up of
// a process blocked in ibv_get_cq_event); the hot path is checks against the grant, memcpy,
// and two release stores.
#include "verbs/direct.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "common/rdma_atomic.h"
#include "proto/device_caps.h"
#include "proto/responder_rules.h"
#include "verbs/internal.h"

namespace vrdma::verbs {

using namespace vrdma::proto;

namespace {

constexpr uint32_t kFirstBackoff = 64;       ///< posts between asks after a "not now"
constexpr uint32_t kMaxBackoff = 1u << 16;   ///< ... growing to this
constexpr uint32_t kMaxSpans = kMaxDirectSpans;
/// take_rx_lock's tries (direct.h).
constexpr uint32_t kRxLockSpins = 1u << 12;

using Span = MemSpan;

}  // namespace

void copy_spans(const Span* src, const Span* dst, uint64_t len) {
  size_t si = 0, di = 0;
  uint64_t so = 0, doff = 0;
  while (len) {
    const uint64_t n = std::min({len, src[si].n - so, dst[di].n - doff});
    std::memcpy(dst[di].p + doff, src[si].p + so, n);
    len -= n;
    if ((so += n) == src[si].n) ++si, so = 0;
    if ((doff += n) == dst[di].n) ++di, doff = 0;
  }
}

namespace {

/// The peer's MR under `key` in the grant, or null.
const DirectMr* grant_mr(const Grant& g, uint32_t key) {
  for (const DirectMr& m : g.mrs) {
    if (m.key == key) return &m;
  }
  return nullptr;
}

/// [at, at + len) of the peer's MR `mr` (by its lkeys' addresses or, `by_iova`, its rkeys'),
/// appended to `out` as spans of our mappings; false when it is not all there.
bool mr_spans(const Grant& g, const DirectMr& mr, uint64_t at, uint64_t len, bool by_iova,
              Span* out, size_t& n) {
  const uint64_t base = by_iova ? mr.iova : mr.addr;
  if (!in_range(base, mr.length, at, len)) return false;
  uint64_t off = at - base;
  for (uint32_t i = 0; i < mr.num_chunks && len; ++i) {
    const DirectChunk& c = mr.chunks[i];
    if (off >= c.mr_offset + c.length || off < c.mr_offset) continue;
    if (n == kMaxSpans) return false;
    const uint64_t in = off - c.mr_offset;
    const uint64_t take = std::min(len, c.length - in);
    out[n++] = Span{g.segs[c.segment].data() + c.seg_offset + in, take};
    off += take;
    len -= take;
  }
  return len == 0;
}

}  // namespace

bool remote_spans(const Grant& g, uint32_t key, uint64_t at, uint64_t len, uint32_t access,
                  bool by_iova, Span* out, size_t& n) {
  const DirectMr* mr = grant_mr(g, key);
  return mr && (mr->access & access) == access && mr_spans(g, *mr, at, len, by_iova, out, n);
}

namespace {
/// posted_receives' wait for a peer that is a little behind.
constexpr uint64_t kRnrSpinNs = 1000000;
}  // namespace

bool take_recv_wqe(const Grant& g, uint32_t cons, RecvWqe& out) {
  // Copied (the peer may rewrite the slot), and only the SGEs it has: a whole RecvWqe is five
  // cache lines that the peer's core wrote.
  const RecvWqe& slot = g.peer_rq[cons & (g.peer_rq_size - 1)];
  out.wr_id = slot.wr_id;
  out.num_sge = slot.num_sge;
  if (out.num_sge > kMaxSge) return false;
  std::memcpy(out.sge, slot.sge, out.num_sge * sizeof(Sge));
  return true;
}

bool recv_spans(const Grant& g, const RecvWqe& r, MemSpan* out, size_t& n, uint64_t& cap) {
  cap = 0;
  for (uint32_t i = 0; i < r.num_sge; ++i) {
    const Sge& s = r.sge[i];
    if (s.length == 0) continue;
    if (!remote_spans(g, s.lkey, s.addr, s.length, IBV_ACCESS_LOCAL_WRITE, false, out, n))
      return false;
    cap += s.length;
  }
  return true;
}

uint32_t posted_receives(Grant& g, uint32_t cons) {
  uint32_t avail = g.peer_rq_seen - cons;
  if (avail && avail <= g.peer_rq_size) return avail;
  avail = (g.peer_rq_seen = g.peer_rq_hdr->producer.load(std::memory_order_acquire)) - cons;
  if (avail) return avail;
  timespec t0;
  ::clock_gettime(CLOCK_MONOTONIC, &t0);
  for (uint32_t i = 1;; ++i) {
    __builtin_ia32_pause();
    avail = (g.peer_rq_seen = g.peer_rq_hdr->producer.load(std::memory_order_acquire)) - cons;
    if (avail || i % 64) {
      if (avail) return avail;
      continue;
    }
    timespec t;
    ::clock_gettime(CLOCK_MONOTONIC, &t);
    if (uint64_t(t.tv_sec - t0.tv_sec) * 1000000000ull + uint64_t(t.tv_nsec) -
            uint64_t(t0.tv_nsec) >
        kRnrSpinNs)
      return 0;
  }
}

void fire(Notify& n, bool solicited) {
  if (!n.hdr) return;
  // As the backend fires (one rule: proto::fire_armed); if this process dies inside it, the
  // end of its session arms the peer's CQ again (Device::fail_peers).
  proto::fire_armed(*n.hdr, solicited, [&] {
    // Non-blocking; full only when the poller is 16384 events behind (the backend drops it too).
    if (::write(n.write_end.get(), &n.cq, sizeof(n.cq)) != sizeof(n.cq))
      VLOG_WARN("direct path: completion channel of CQ {} full", n.cq);
  });
}

namespace {

/// Takes the kDirectNotifyFds descriptors of a CQ with a channel (proto/command.h).
bool take_notify(Notify& n, std::vector<UniqueFd>& fds, size_t at, uint32_t cq) {
  n.ring = MappedRegion::map_shared(fds[at].get(), sizeof(RingHeader));
  if (!n.ring.valid()) return false;
  n.hdr = reinterpret_cast<RingHeader*>(n.ring.data());
  n.write_end = std::move(fds[at + 1]);
  n.read_end = std::move(fds[at + 2]);
  n.cq = cq;
  return n.write_end.valid() && n.read_end.valid();
}

}  // namespace

bool grant_still_good(const ControlPage& ctl, const Grant& g) {
  return ctl.grant_gen.load(std::memory_order_acquire) == g.ctl_gen &&
         g.my_epoch->epoch.load(std::memory_order_acquire) == g.my_epoch_v &&
         g.peer_epoch->epoch.load(std::memory_order_acquire) == g.peer_epoch_v;
}

namespace {

/// Shows the backend that this process may write the memory of the QP's peer: the kernel lets
/// a process open another's /proc/PID/mem for writing only if it may ptrace-attach to it (uid
/// or CAP_SYS_PTRACE, Yama's ptrace_scope, LSMs), and the pid is one our pid namespace shows.
int prove_access(VContext& ctx, VQp& qp, const GrantAsk& ask) {
  DirectPeerResp peer{};
  if (int rc = ctx.call(ask.peer, ask.req, ask.req_len, &peer, sizeof(peer))) {
    VLOG_DEBUG("direct path: QP {:#x}: the backend names no peer process we can see: {}",
               qp.qp.qp_num, std::strerror(rc));
    return rc;
  }
  char path[32];
  std::snprintf(path, sizeof(path), "/proc/%u/mem", peer.pid);
  UniqueFd mem(::open(path, O_RDWR | O_CLOEXEC));
  if (!mem.valid()) {
    VLOG_DEBUG("direct path: QP {:#x} stays on the backend: {}: {}", qp.qp.qp_num, path,
               std::strerror(errno));
    return EPERM;
  }
  const int fd = mem.get();
  Empty none;
  return ctx.call(ask.prove, ask.req, ask.req_len, &none, 0, std::span<const int>(&fd, 1));
}

}  // namespace

std::unique_ptr<Grant> ask_grant(VQp& qp, const GrantAsk& ask, Asking& st, void* resp,
                                 size_t resp_len, const DirectGrantResp& r) {
  VContext& ctx = *to_vctx(qp.qp.context);
  std::vector<UniqueFd> fds;
  // Read before asking: a backend that takes us in after this ends the grant we get now.
  const uint32_t ctl_gen = ctx.control_page()->grant_gen.load(std::memory_order_acquire);
  int rc = ctx.call(ask.grant, ask.req, ask.req_len, resp, resp_len, {}, &fds);
  // No proof yet that we may write the peer's memory: give one and ask again. A refused proof
  // is not given again; one not settled yet (EAGAIN: the peer not ready, a busy backend) is.
  if (rc == EACCES && !st.proof_failed) {
    rc = prove_access(ctx, qp, ask);
    st.proof_failed = rc != 0 && rc != EAGAIN && rc != EBUSY;
    if (rc == 0) rc = ctx.call(ask.grant, ask.req, ask.req_len, resp, resp_len, {}, &fds);
    if (rc == EBUSY) rc = EAGAIN;
  }
  if (rc) {
    // Not now (peer not connected yet, work in flight): soon. Not for this QP: rarely.
    const uint32_t base = rc == EAGAIN ? kFirstBackoff : kMaxBackoff / 4;
    st.backoff = std::min(std::max(st.backoff * 2, base), kMaxBackoff);
    st.wait = st.backoff;
    return nullptr;
  }
  auto g = std::make_unique<Grant>();
  const size_t notify_fds =
      kDirectNotifyFds * std::popcount(r.notify & (kDirectNotifySend | kDirectNotifyRecv));
  bool ok = fds.size() == kDirectFixedFds + r.num_segments + notify_fds &&
            r.num_mrs <= kMaxDirectMrs && r.peer_rq_entries &&
            (r.peer_rq_entries & (r.peer_rq_entries - 1)) == 0;
  if (ok) {
    g->peer_ring = MappedRegion::map_shared(fds[0].get(), r.peer_ring_bytes);
    ok = g->peer_ring.valid() &&
         r.peer_rq_offset + ring_bytes(r.peer_rq_entries, sizeof(RecvWqe)) <= r.peer_ring_bytes;
  }
  if (ok) {
    g->peer_rq_hdr = reinterpret_cast<RingHeader*>(g->peer_ring.data() + r.peer_rq_offset);
    g->peer_rq = ring_entries<RecvWqe>(g->peer_rq_hdr);
    g->peer_rq_size = r.peer_rq_entries;
    ok = map_ring(g->send, fds[1].get(), r.send_ring_entries) &&
         map_ring(g->peer_recv, fds[2].get(), r.recv_ring_entries);
  }
  if (ok) {
    g->my_epoch_map = MappedRegion::map_readonly(fds[3].get(), sizeof(EpochPage));
    g->peer_epoch_map = MappedRegion::map_readonly(fds[4].get(), sizeof(EpochPage));
    ok = g->my_epoch_map.valid() && g->peer_epoch_map.valid();
  }
  for (uint32_t i = 0; ok && i < r.num_segments; ++i) {
    struct stat st{};
    ok = ::fstat(fds[kDirectFixedFds + i].get(), &st) == 0 && st.st_size > 0;
    if (ok) g->segs.push_back(MappedRegion::map_shared(fds[kDirectFixedFds + i].get(),
                                                      static_cast<size_t>(st.st_size)));
    ok = ok && g->segs.back().valid();
  }
  size_t at = kDirectFixedFds + r.num_segments;
  if (ok && (r.notify & kDirectNotifySend)) {
    ok = take_notify(g->send_notify, fds, at, r.send_cq);
    at += kDirectNotifyFds;
  }
  if (ok && (r.notify & kDirectNotifyRecv)) ok = take_notify(g->recv_notify, fds, at, r.recv_cq);
  if (ok) {
    // Only chunks that lie inside the segments we mapped.
    for (uint32_t i = 0; i < r.num_mrs; ++i) {
      const DirectMr& m = r.mrs[i];
      bool good = m.num_chunks <= kMaxDirectChunks;
      for (uint32_t c = 0; good && c < m.num_chunks; ++c) {
        const DirectChunk& ch = m.chunks[c];
        good = ch.segment < g->segs.size() && ch.seg_offset <= g->segs[ch.segment].size() &&
               ch.length <= g->segs[ch.segment].size() - ch.seg_offset;
      }
      if (good) g->mrs.push_back(m);
    }
  }
  if (!ok) {
    VLOG_WARN("direct path: unusable grant for QP {:#x}; staying on the backend", qp.qp.qp_num);
    st.backoff = st.wait = kMaxBackoff;
    return nullptr;
  }
  g->my_epoch = reinterpret_cast<const EpochPage*>(g->my_epoch_map.data());
  g->peer_epoch = reinterpret_cast<const EpochPage*>(g->peer_epoch_map.data());
  g->my_epoch_v = r.my_epoch;
  g->peer_epoch_v = r.peer_epoch;
  g->ctl_gen = ctl_gen;
  g->send.seen = g->send.hdr->consumer.load(std::memory_order_acquire);
  g->peer_recv.seen = g->peer_recv.hdr->consumer.load(std::memory_order_acquire);
  g->peer_rq_seen = g->peer_rq_hdr->producer.load(std::memory_order_acquire);
  g->peer_qpn = r.peer_qpn;
  g->peer_access = r.peer_access;
  g->my_lid = r.my_lid;
  g->srq_tag = r.lock_tag;
  st.backoff = 0;
  return g;
}

bool take_rx_lock(RingHeader& h, uint32_t tag) {
  for (uint32_t i = 0; i < kRxLockSpins; ++i) {
    uint32_t free = 0;
    if (h.rx_lock.load(std::memory_order_relaxed) == 0 &&
        h.rx_lock.compare_exchange_weak(free, tag, std::memory_order_acquire)) {
      tsan_ring_acquire();  // another mapping's holder released it (direct.h)
      return true;
    }
    __builtin_ia32_pause();
  }
  return false;
}

void give_rx_lock(RingHeader& h) {
  tsan_ring_release();
  h.rx_lock.store(0, std::memory_order_release);
}

namespace {

/// Whether the responder would execute a WRITE, READ or atomic (check_remote_request, with the
/// grant's MR under `rkey`, returned in `mr`, and the peer QP's access): false leaves it to the
/// backend, whose responder applies the same rules and completes it with the status of the one
/// that failed.
bool remote_allowed(const Grant& g, uint32_t op, uint32_t rkey, uint64_t raddr, uint64_t len,
                    const DirectMr*& mr) {
  RemoteMrView view;
  if ((mr = grant_mr(g, rkey))) view = RemoteMrView{true, mr->access, mr->iova, mr->length};
  return check_remote_request(op, g.peer_access, raddr, len, view) == IBV_WC_SUCCESS;
}

/// CMP_AND_SWP or FETCH_AND_ADD on the peer's word, its old value into `local` (8 bytes, checked
/// by local_sges). A CPU atomic (rdma_atomic), as the backend's responder executes it, on the
/// same page through another mapping of the same memfd: atomic against the backend's atomics
/// (mediated QPs, other hosts' requests), other libraries' and the peer's own CPU accesses
/// (IBV_ATOMIC_HCA). The word must also lie in one chunk and be 8-aligned in our mapping, as
/// the backend checks at its own address (segments are page-aligned in both: the same answer);
/// false, nothing done, when any rule fails.
bool execute_atomic(const Grant& g, const ibv_send_wr& wr, const Span* local) {
  const uint64_t raddr = wr.wr.atomic.remote_addr;
  const uint32_t rkey = wr.wr.atomic.rkey;
  const DirectMr* mr = nullptr;
  if (!remote_allowed(g, wr.opcode, rkey, raddr, 8, mr)) return false;
  Span at[kMaxSpans];
  size_t n = 0;
  if (!mr_spans(g, *mr, raddr, 8, true, at, n) || n != 1 ||
      (reinterpret_cast<uintptr_t>(at[0].p) & 7))
    return false;
  // Unguarded, as the copies (docs/ARCHITECTURE.md, "Executing"): the segments are sealed
  // against shrinking, so nothing truncates them under us.
  uint64_t old =
      rdma_atomic(reinterpret_cast<uint64_t*>(at[0].p), wr.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD,
                  wr.wr.atomic.compare_add, wr.wr.atomic.swap);
  const Span result{reinterpret_cast<uint8_t*>(&old), 8};
  copy_spans(&result, local, 8);
  return true;
}

/// Takes the next receive of the peer's SRQ for a message of `len` bytes, holding the SRQ's
/// rx_lock (the backend and other libraries take receives from it too): its WQE, and for a
/// SEND its SGEs as spans of the grant's memory (checked against the SRQ's PD, which is the
/// peer QP's: srq_grantable); the consumer index moves before the lock is given back. The copy
/// and the completion come after, outside it: the completion goes to the peer QP's own ring,
/// whose only producers (we, or the backend executing our send queue) never overlap. False:
/// nothing taken, and the WR goes to the backend: none posted any more, the lock held too long,
/// a WQE the backend must fail (a bad lkey, too small), or the SRQ's armed limit would be
/// crossed (the event is the backend's to raise).
bool take_srq_recv(Grant& g, bool send, uint64_t len, RecvWqe& r, MemSpan* out, size_t& n) {
  RingHeader& h = *g.peer_rq_hdr;
  if (!take_rx_lock(h, g.srq_tag)) return false;
  const uint32_t cons = h.consumer.load(std::memory_order_acquire);
  uint32_t avail = g.peer_rq_seen - cons;
  if (avail == 0 || avail > g.peer_rq_size)
    avail = (g.peer_rq_seen = h.producer.load(std::memory_order_acquire)) - cons;
  const uint32_t limit = h.srq_limit.load(std::memory_order_acquire);
  uint64_t cap = 0;
  const bool ok = avail && avail <= g.peer_rq_size && avail - 1 >= limit &&
                  take_recv_wqe(g, cons, r) &&
                  (!send || (recv_spans(g, r, out, n, cap) && cap >= len));
  if (ok) h.consumer.store(cons + 1, std::memory_order_release);
  give_rx_lock(h);
  return ok;
}

/// Executes one WR straight into the peer; false (nothing done) when it must go to the backend.
bool execute(VContext& ctx, VQp& qp, Grant& g, const ibv_send_wr& wr) {
  const uint32_t op = wr.opcode;
  const bool consumes = op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM ||
                        op == IBV_WR_RDMA_WRITE_WITH_IMM;
  const bool atomic = is_rdma_atomic(op);
  if (!consumes && op != IBV_WR_RDMA_WRITE && op != IBV_WR_RDMA_READ && !atomic) return false;
  const bool signaled = qp.sig_all || (wr.send_flags & IBV_SEND_SIGNALED);
  if (signaled && !has_room(g.send)) return false;
  Span local[kMaxSge], remote[kMaxSpans];
  size_t nl = 0, nr = 0;
  uint64_t len = 0;
  // READ and atomics write their local memory (an atomic's 8 bytes: check_send_length).
  const uint32_t local_need = op == IBV_WR_RDMA_READ || atomic ? IBV_ACCESS_LOCAL_WRITE : 0;
  // Any local error: the backend executes it and reports it; a WR the post rules refuse
  // (local_sges checks them) goes on to the ring's loop, which says EINVAL.
  if (local_sges(ctx, qp, wr, local_need, local, nl, len) != IBV_WC_SUCCESS) return false;

  RecvWqe rwqe;
  uint32_t rcons = 0;
  bool lost = false;  ///< UC: no receive posted, so the message is dropped (not an RNR)
  if (consumes) {
    rcons = g.peer_rq_hdr->consumer.load(std::memory_order_acquire);
    const uint32_t avail = posted_receives(g, rcons);
    if (avail > g.peer_rq_size || !has_room(g.peer_recv)) return false;
    lost = avail == 0 && qp.qp.qp_type == IBV_QPT_UC;
    if (avail == 0 && !lost) return false;
  }
  const bool send = op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM;
  const DirectMr* mr = nullptr;
  if (!send && !atomic) {
    // WRITE (with immediate) or READ, by the responder's rules (proto/responder_rules.h), before
    // a receive is taken; at length 0 nothing more. Whatever fails is left to the backend, which
    // applies the same rules and reports the status.
    if (!remote_allowed(g, op, wr.wr.rdma.rkey, wr.wr.rdma.remote_addr, len, mr)) return false;
    if (names_remote_memory(len) &&
        !mr_spans(g, *mr, wr.wr.rdma.remote_addr, len, true, remote, nr))
      return false;
  }
  if (consumes && !lost) {
    if (g.srq_tag) {
      // The peer's SRQ: taken under its lock (its consumer index moves at once).
      if (!take_srq_recv(g, send, len, rwqe, remote, nr)) return false;
    } else {
      uint64_t cap = 0;
      if (!take_recv_wqe(g, rcons, rwqe) ||
          (send && (!recv_spans(g, rwqe, remote, nr, cap) || cap < len)))
        return false;
    }
  }
  if (atomic) {
    if (!execute_atomic(g, wr, local)) return false;  // (consumes no receive)
  } else if (send) {
    if (!lost) copy_spans(local, remote, len);
  } else if (!lost && names_remote_memory(len)) {
    if (op == IBV_WR_RDMA_READ)
      copy_spans(remote, local, len);
    else
      copy_spans(local, remote, len);
  }
  if (consumes && !lost) {
    if (!g.srq_tag) g.peer_rq_hdr->consumer.store(rcons + 1, std::memory_order_release);
    Cqe rc{};
    rc.wr_id = rwqe.wr_id;
    rc.status = IBV_WC_SUCCESS;
    rc.opcode = op == IBV_WR_RDMA_WRITE_WITH_IMM ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
    rc.byte_len = static_cast<uint32_t>(len);
    if (op != IBV_WR_SEND) {
      rc.wc_flags = IBV_WC_WITH_IMM;
      rc.imm_data = wr.imm_data;
    }
    rc.qp_num = g.peer_qpn;
    rc.src_qp = qp.qp.qp_num;
    rc.slid = static_cast<uint16_t>(g.my_lid);
    push(g.peer_recv, rc);
    fire(g.recv_notify, (wr.send_flags & IBV_SEND_SOLICITED) != 0);
  }
  count(g.send, len);
  if (!lost) count(g.peer_recv, len);
  if (signaled) {
    Cqe e{};
    e.wr_id = wr.wr_id;
    e.status = IBV_WC_SUCCESS;
    e.opcode = send_wc_opcode(op);
    e.byte_len = static_cast<uint32_t>(len);
    e.qp_num = qp.qp.qp_num;
    push(g.send, e);
    fire(g.send_notify, false);
  }
  return true;
}

/// Under sq_lock.
void reset_grant(VQp& qp) {
  qp.grant.reset();
  qp.ud_grants.clear();
  qp.granted.store(false, std::memory_order_relaxed);
}

}  // namespace

/// Our own MR for `key` in the QP's PD (cached per QP; the map is read under its lock).
const LocalMr* local_mr(VContext& ctx, VQp& qp, uint32_t key) {
  const uint32_t gen = ctx.mr_gen.load(std::memory_order_acquire);
  if (qp.mr_gen != gen || qp.mr_key != key) {
    std::lock_guard<std::mutex> g(ctx.mr_mu);
    auto it = ctx.local_mrs.find(key);
    if (it == ctx.local_mrs.end()) return nullptr;
    qp.mr = it->second;
    qp.mr_key = key;
    qp.mr_gen = gen;
  }
  return qp.mr.pd == qp.pd ? &qp.mr : nullptr;
}

int local_sges(VContext& ctx, VQp& qp, const ibv_send_wr& wr, uint32_t need, MemSpan* out,
               size_t& n, uint64_t& len) {
  len = 0;
  // check_post_send refused a WR with more SGEs or inline bytes than the QP takes; a caller
  // that runs before it (the remote path, to stay out of its lock) gets the same EINVAL then.
  if (check_post_send(qp.qp.qp_type, wr, send_caps(qp))) return IBV_WC_LOC_LEN_ERR;
  const bool inl = is_inline(wr.opcode, wr.send_flags);
  for (int i = 0; i < wr.num_sge; ++i) {
    const ibv_sge& s = wr.sg_list[i];
    if (!sge_names_memory(s.length)) continue;
    uint8_t* p = reinterpret_cast<uint8_t*>(s.addr);
    if (!inl) {
      const LocalMr* mr = local_mr(ctx, qp, s.lkey);
      if (!mr || (mr->access & need) != need || !in_range(mr->addr, mr->length, s.addr, s.length))
        return IBV_WC_LOC_PROT_ERR;
      p = local_ptr(*mr, s.addr);
    }
    out[n++] = MemSpan{p, s.length};
    len += s.length;
  }
  return check_send_length(wr.opcode, len);
}

bool map_ring(OwnRing& r, int fd, uint32_t entries) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return false;
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes < ring_bytes(entries, sizeof(Cqe))) return false;
  r.map = MappedRegion::map_shared(fd, bytes);
  if (!r.map.valid()) return false;
  r.hdr = reinterpret_cast<RingHeader*>(r.map.data());
  r.entries = ring_entries<Cqe>(r.hdr);
  r.size = entries;
  // The backend wrote `stamps` before it handed the ring out: read once, checked against the
  // memfd's size, so a bad header cannot make us write past the mapping.
  const uint32_t stamps = r.hdr->stamps & kStampAll;
  if (stamps && bytes >= cq_ring_bytes(entries, stamps)) {
    r.stamps = cq_stamps(r.hdr, entries);
    r.stamp_bits = stamps;
  }
  return true;
}

/// Whether an own ring we produce into has a free slot (the consumer's index is read only when
/// the copy in `seen` says full).
bool has_room(OwnRing& r) {
  const uint32_t prod = r.hdr->producer.load(std::memory_order_relaxed);
  if (prod - r.seen < r.size) return true;
  r.seen = r.hdr->consumer.load(std::memory_order_acquire);
  return prod - r.seen < r.size;
}

/// Appends a completion to an own ring (has_room() said yes).
void push(OwnRing& r, const Cqe& e) {
  const uint32_t prod = r.hdr->producer.load(std::memory_order_relaxed);
  r.entries[prod & (r.size - 1)] = e;
  if (r.stamps) stamp_now(r.stamps[prod & (r.size - 1)], r.stamp_bits);
  tsan_ring_release();  // before the index: a poller that sees the index must see the edge
  r.hdr->producer.store(prod + 1, std::memory_order_release);
}

/// One message more in an own ring's counters (this library is their only writer).
void count(OwnRing& r, uint64_t bytes) {
  r.hdr->direct_msgs.store(r.hdr->direct_msgs.load(std::memory_order_relaxed) + 1,
                           std::memory_order_relaxed);
  r.hdr->direct_bytes.store(r.hdr->direct_bytes.load(std::memory_order_relaxed) + bytes,
                            std::memory_order_relaxed);
}

ibv_wc_opcode send_wc_opcode(uint32_t op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
      return IBV_WC_RDMA_READ;
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return IBV_WC_COMP_SWAP;
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return IBV_WC_FETCH_ADD;
    case IBV_WR_BIND_MW:
      return IBV_WC_BIND_MW;
    case IBV_WR_LOCAL_INV:
      return IBV_WC_LOCAL_INV;
    default:
      return IBV_WC_SEND;
  }
}

void drop_grant(VQp& qp) {
  // A post that installs a grant after this check is ended by the epoch the backend moves.
  if (!qp.granted.load(std::memory_order_acquire)) return;
  qp.sq_lock.lock();
  reset_grant(qp);
  qp.sq_lock.unlock();
}

void send_direct_cookie(VContext& ctx) {
  if (!(ctx.control_page()->features & kFeatureDirect)) return;
  DirectCookieReq req{reinterpret_cast<uint64_t>(ctx.direct_cookie), {}};
  if (::getrandom(ctx.direct_cookie, sizeof(ctx.direct_cookie), 0) !=
      static_cast<ssize_t>(sizeof(ctx.direct_cookie)))
    return;  // no cookie: no peer can prove it may write us, and the pair stays mediated
  std::memcpy(req.cookie, ctx.direct_cookie, sizeof(req.cookie));
  Empty none;
  if (ctx.call(Op::kDirectCookie, &req, sizeof(req), &none, 0) != 0)
    VLOG_DEBUG("direct path: the backend took no cookie: {}", std::strerror(errno));
}

void direct_post(VQp& qp, ibv_send_wr*& wr) {
  VContext& ctx = *to_vctx(qp.qp.context);
  const ibv_qp_type type = qp.qp.qp_type;
  if ((type != IBV_QPT_RC && type != IBV_QPT_UC && type != IBV_QPT_UD) ||
      !(ctx.control_page()->features & kFeatureDirect))
    return;
  // Only when everything the backend took from this SQ is completed: nothing can pass it.
  if (qp.sq_hdr->retired.load(std::memory_order_acquire) != qp.sq_prod) return;
  if (type == IBV_QPT_UD) return direct_post_ud(qp, wr);  // a grant per destination
  if (!qp.grant) {
    if (qp.asking.wait) {
      --qp.asking.wait;
      return;
    }
    HandleReq req{qp.handle, kDirectGrantSrq};  // we can feed a peer's SRQ
    DirectGrantUdResp resp{};  // kDirectGrant's answer is its `grant`
    qp.grant = ask_grant(
        qp, GrantAsk{Op::kDirectGrant, Op::kDirectPeer, Op::kDirectProve, &req, sizeof(req)},
        qp.asking, &resp.grant, sizeof(resp.grant), resp.grant);
    if (!qp.grant) return;
    qp.granted.store(true, std::memory_order_release);
  }
  Grant& g = *qp.grant;
  if (!grant_still_good(*ctx.control_page(), g)) {
    reset_grant(qp);  // the next post asks again
    return;
  }
  while (wr && execute(ctx, qp, g, *wr)) wr = wr->next;
}

namespace {
/// Steps past the completion at the CQ ring's cursor (there is one).
const Cqe* take_cqe(VCq& cq) {
  const uint32_t i = cq.cons++ & (cq.size - 1);
  cq.cur_stamp = cq.stamps ? &cq.stamps[i] : nullptr;
  return &cq.entries[i];
}

/// The QPs' own rings that feed `cq` (its header's direct_gen is `gen`), a page at a time: 64
/// QPs that share one CQ for their sends and receives have 128.
void learn_rings(VCq& cq, uint32_t gen) {
  VContext& ctx = *to_vctx(cq.cq.context);
  auto resp = std::make_unique<DirectRingsResp>();
  uint32_t first_gen = 0;
  for (uint32_t skip = 0;; skip += kMaxDirectRings) {
    std::vector<UniqueFd> fds;
    HandleReq req{cq.handle, skip};
    if (ctx.call(Op::kDirectRings, req, *resp, {}, &fds) != 0 || fds.size() != resp->count ||
        resp->count > kMaxDirectRings) {
      cq.direct_gen = gen;  // do not ask on every poll; the rings it missed stay unread
      VLOG_WARN("direct path: could not look up the QP rings of CQ {}", cq.handle);
      return;
    }
    if (skip == 0) first_gen = resp->gen;
    for (uint32_t i = 0; i < resp->count; ++i) {
      const DirectRing& d = resp->rings[i];
      const bool known = std::any_of(cq.own.begin(), cq.own.end(), [&](const auto& r) {
        return r->qp == d.qp && r->recv == (d.recv != 0);
      });
      if (known || d.entries == 0 || (d.entries & (d.entries - 1))) continue;
      auto r = std::make_unique<OwnRing>();
      if (!map_ring(*r, fds[i].get(), d.entries)) continue;
      r->qp = d.qp;
      r->recv = d.recv != 0;
      r->cons = r->seen = r->hdr->consumer.load(std::memory_order_acquire);
      cq.own.push_back(std::move(r));
    }
    // Rings that came or went between two pages moved the generation: the first page's, kept,
    // makes the next poll ask again.
    if (resp->count < kMaxDirectRings || resp->gen != first_gen) break;
  }
  cq.direct_gen = first_gen;
}
}  // namespace

const Cqe* next_cqe(VCq& cq) {
  if (cq.cons == cq.seen) cq.seen = cq.hdr->producer.load(std::memory_order_acquire);
  if (cq.cons != cq.seen) return take_cqe(cq);
  // QPs' own rings: learn of new ones first.
  const uint32_t gen = cq.hdr->direct_gen.load(std::memory_order_acquire);
  if (gen != cq.direct_gen) learn_rings(cq, gen);
  const size_t n = cq.own.size();
  for (size_t k = 0; k < n; ++k) {
    OwnRing& r = *cq.own[(cq.own_turn + k) % n];
    if (r.cons == r.seen) r.seen = r.hdr->producer.load(std::memory_order_acquire);
    if (r.cons == r.seen) continue;
    // A completion the backend put in the CQ's ring before this one was written comes first.
    cq.seen = cq.hdr->producer.load(std::memory_order_acquire);
    if (cq.cons != cq.seen) return take_cqe(cq);
    cq.own_turn = (cq.own_turn + k + 1) % n;
    tsan_ring_acquire();
    const uint32_t i = r.cons++ & (r.size - 1);
    cq.cur_stamp = r.stamps ? &r.stamps[i] : nullptr;
    return &r.entries[i];
  }
  return nullptr;
}

void publish_consumed(VCq& cq) {
  cq.hdr->consumer.store(cq.cons, std::memory_order_release);
  for (auto& r : cq.own) {
    if (r->hdr->consumer.load(std::memory_order_relaxed) != r->cons)
      r->hdr->consumer.store(r->cons, std::memory_order_release);
  }
}

void drop_rings(VCq& cq, uint32_t qp) {
  cq.lock.lock();
  std::erase_if(cq.own, [&](const auto& r) { return r->qp == qp; });
  cq.own_turn = 0;
  cq.lock.unlock();
}

}  // namespace vrdma::verbs
