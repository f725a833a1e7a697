// Small helpers the engine's files share: opcode classes, IB timer encodings, span copies, ring
// set-up, handles. Internal to the engine.
#pragma once

#include <fcntl.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "common/guest_fault.h"
#include "common/memfd.h"
#include "common/rdma_atomic.h"
#include "engine/device.h"
#include "proto/post_rules.h"
#include "proto/responder_rules.h"

namespace vrdma::engine {

inline constexpr uint32_t kPage = 4096;
inline size_t page_round(size_t n) { return (n + kPage - 1) & ~size_t{kPage - 1}; }

/// Writes a fresh ring header: empty, this protocol's magic and version.
inline void init_ring(proto::RingHeader* h, proto::RingKind kind, uint32_t entry_size,
                      uint32_t n) {
  h->magic = proto::kRingMagic;
  h->version = proto::kRingVersion;
  h->kind = static_cast<uint16_t>(kind);
  h->entry_size = entry_size;
  h->num_entries = n;
  h->producer.store(0, std::memory_order_relaxed);
  h->consumer.store(0, std::memory_order_relaxed);
  h->armed.store(0, std::memory_order_relaxed);
  h->direct_msgs.store(0, std::memory_order_relaxed);
  h->direct_bytes.store(0, std::memory_order_relaxed);
}

/// A fresh CQ ring in `cq` for its `size` and `stamps`: a sealed memfd, mapped, its header
/// written (the stamps bits too, for the producers of other processes).
inline Status make_cq_ring(Cq& cq, const char* name) {
  const size_t bytes = page_round(proto::cq_ring_bytes(cq.size, cq.stamps));
  ASSIGN_OR_RETURN(cq.ring_fd, make_sealed_memfd(name, bytes));
  cq.ring = MappedRegion::map_shared(cq.ring_fd.get(), bytes);
  if (!cq.ring.valid()) return error(errno, "mapping a CQ ring");
  cq.attach();
  init_ring(cq.hdr, proto::RingKind::kCq, sizeof(proto::Cqe), cq.size);
  cq.hdr->stamps = cq.stamps;
  return Status::ok();
}

/// The device keeps its own descriptor of every ring it hands out, so its state can move.
inline UniqueFd dup_fd(int fd) { return UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 0)); }

/// The local ACK timeout's encoding, 4.096 µs * 2^t (min_rnr_timer's is proto::rnr_delay_ns).
inline uint64_t ack_timeout_ns(uint8_t t) {
  if (t == 0) return 4096ull * 1000 * 1000;  // 0 means "infinite"; wait long, retry forever
  return (4096ull << std::min<uint8_t>(t, 31));
}

/// A fresh handle in the session's one handle space (every kind of object draws from it).
template <typename Map>
uint32_t new_handle(Session& s, const Map&) {
  return s.next_handle++;
}

/// Calls f on every connected QP whose destination is guest g (its LID or GID): the QPs to
/// reroute when g moves (device_moved.cc, device_state_import.cc).
template <typename F>
void Device::for_qps_facing(const Guest& g, F&& f) {
  for (Qp* qp : std::vector<Qp*>(active_)) {
    if (qp->type == IBV_QPT_UD) continue;
    const bool facing = qp->attr.is_global ? std::memcmp(qp->attr.dgid, g.gid, 16) == 0
                                           : qp->attr.dlid == g.lid;
    if (facing) f(*qp);
  }
}

/// Cuts a span list down to exactly `len` bytes (a receive buffer may be larger).
inline void trim(std::vector<Span>& v, uint64_t len) {
  uint64_t seen = 0;
  size_t i = 0;
  for (; i < v.size() && seen < len; ++i) {
    if (seen + v[i].n > len) v[i].n = len - seen;
    seen += v[i].n;
  }
  v.resize(i);
}

inline bool sq_open(ibv_qp_state s) { return s == IBV_QPS_RTS || s == IBV_QPS_SQD; }
inline bool rq_open(ibv_qp_state s) {
  return s == IBV_QPS_RTR || s == IBV_QPS_RTS || s == IBV_QPS_SQD;
}

/// Copies `len` bytes from the `src` spans to the `dst` spans, span to span (no bounce buffer).
inline void copy_spans(std::span<const Span> src, std::span<const Span> dst, uint64_t len) {
  size_t si = 0, di = 0;
  uint64_t so = 0, doff = 0;
  for (uint64_t left = len; left;) {
    const Span& s = src[si];
    const Span& d = dst[di];
    uint64_t n = std::min({left, s.n - so, d.n - doff});
    std::memcpy(d.p + doff, s.p + so, n);
    left -= n;
    if ((so += n) == s.n) ++si, so = 0;
    if ((doff += n) == d.n) ++di, doff = 0;
  }
}

/// copy_spans under the guest-fault guard (common/guest_fault.h): false when guest memory
/// faulted, with the faulting address in `fault`; what was copied before the fault stays.
[[nodiscard]] inline bool guarded_copy(std::span<const Span> src, std::span<const Span> dst,
                                       uint64_t len, uintptr_t& fault) {
  struct Job {
    std::span<const Span> src, dst;
    uint64_t len;
  } job{src, dst, len};
  return run_guarded(
      [](void* p) {
        const auto* j = static_cast<const Job*>(p);
        copy_spans(j->src, j->dst, j->len);
      },
      &job, fault);
}

/// rdma_atomic under the guest-fault guard: false when the word faulted.
[[nodiscard]] inline bool guarded_atomic(uint64_t* word, bool fetch_add, uint64_t compare_add,
                                         uint64_t swap, uint64_t& old, uintptr_t& fault) {
  struct Job {
    uint64_t* word;
    bool fetch_add;
    uint64_t compare_add, swap, old;
  } job{word, fetch_add, compare_add, swap, 0};
  const bool ok = run_guarded(
      [](void* p) {
        auto* j = static_cast<Job*>(p);
        j->old = rdma_atomic(j->word, j->fetch_add, j->compare_add, j->swap);
      },
      &job, fault);
  old = job.old;
  return ok;
}

/// Whether `addr` lies in one of the spans.
inline bool in_spans(std::span<const Span> spans, uintptr_t addr) {
  for (const Span& s : spans) {
    const auto p = reinterpret_cast<uintptr_t>(s.p);
    if (addr >= p && addr - p < s.n) return true;
  }
  return false;
}

using proto::is_send;
inline bool is_write(uint32_t op) { return proto::is_rdma_write(op); }
inline bool is_atomic(uint32_t op) { return proto::is_rdma_atomic(op); }
inline bool has_imm(uint32_t op) {
  return op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_RDMA_WRITE_WITH_IMM;
}

/// The addressing every frame about connected QP `qp` carries to its peer's backend (a request,
/// a direct offer): our GID and LID, the destination's from the QP's address vector.
template <class Frame>
void fill_route(Frame& f, const Qp& qp) {
  std::memcpy(f.sgid, qp.guest->gid, 16);
  std::memcpy(f.dgid, qp.attr.dgid, 16);
  f.slid = qp.guest->lid;
  f.dlid = static_cast<uint16_t>(qp.attr.dlid);
  f.is_global = qp.attr.is_global ? 1 : 0;
}

}  // namespace vrdma::engine
