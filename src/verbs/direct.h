// The library's side of the direct path (docs/ARCHITECTURE.md, "Direct path"): an RC QP whose
// peer QP is a guest of the same uid on the same backend, in a process whose memory ours may
// write by the kernel's rules (we prove it: /proc/PID/mem), may, once the backend grants it,
// execute its WQEs itself: copy straight into the peer's memory (mapped from the segments the
// grant names) or run an atomic on it, take the peer's receive WQEs, and write both completions
// into the QPs' own completion rings. Anything it cannot do at once (no receive posted, a key
// it does not know, a misaligned atomic, a full ring) goes to the send queue for the backend,
// which then writes into the same rings, so each queue's completions stay in order whoever
// executed the work.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/unique_fd.h"
#include "proto/command.h"
#include "proto/ring.h"

namespace vrdma::verbs {

struct VQp;
struct VCq;
struct VContext;

/// A run of memory (ours, or a peer's as we map it) that a WR reads or writes.
struct MemSpan {
  uint8_t* p;
  uint64_t n;
};

/// Whether [at, at + len) lies in [base, base + size), without overflow.
inline bool in_range(uint64_t base, uint64_t size, uint64_t at, uint64_t len) {
  return at >= base && len <= size && at - base <= size - len;
}

/// One MR of this process, as the direct path checks local SGEs against it.
struct LocalMr {
  uint64_t addr = 0, length = 0;
  uint64_t iova = 0;  ///< where rkeys address it
  uint32_t access = 0, pd = 0;
  /// A zero-based MR (device memory, ibv_reg_dm_mr): where byte 0 is in this process (its
  /// addresses are offsets, not pointers). Null: its addresses are this process's pointers.
  uint8_t* host = nullptr;
};

/// Where lkey address `addr` of `mr` (checked to lie in it) is in this process.
inline uint8_t* local_ptr(const LocalMr& mr, uint64_t addr) {
  return mr.host ? mr.host + (addr - mr.addr) : reinterpret_cast<uint8_t*>(addr);
}

/// A QP's own completion ring as this process maps it (producer or consumer side).
struct OwnRing {
  MappedRegion map;
  proto::RingHeader* hdr = nullptr;
  proto::Cqe* entries = nullptr;
  proto::CqeStamp* stamps = nullptr;  ///< one per entry when the CQ asked for timestamps
  uint32_t stamp_bits = 0;            ///< proto::kStamp*: which clocks a producer writes
  uint32_t size = 0;
  uint32_t cons = 0;  ///< consumer side: private cursor
  uint32_t seen = 0;  ///< consumer side: producer index last read; producer side: consumer's

  uint32_t qp = 0;    ///< the QP's handle
  bool recv = false;  ///< its receive completions (else its send completions)
};

/// A CQ with a completion channel that a grant's completions go to: the library fires its
/// event itself, as the backend's push_cqe does (docs/ARCHITECTURE.md, "Direct path").
struct Notify {
  MappedRegion ring;                 ///< the CQ's ring memfd, for its header's `armed` word
  proto::RingHeader* hdr = nullptr;  ///< null: the CQ has no channel
  UniqueFd write_end;                ///< the channel's pipe (non-blocking)
  UniqueFd read_end;                 ///< held only: the pipe never loses its last reader
  uint32_t cq = 0;                   ///< the CQ's handle, which an event carries
};

/// What a grant gives one QP: the peer's RQ, both completion rings, the epochs and the peer's
/// memory. Owned by the QP, used under its sq_lock.
struct Grant {
  MappedRegion peer_ring;
  proto::RingHeader* peer_rq_hdr = nullptr;
  proto::RecvWqe* peer_rq = nullptr;
  uint32_t peer_rq_size = 0;
  uint32_t peer_rq_seen = 0;  ///< the peer's RQ producer index last read
  OwnRing send, peer_recv;
  MappedRegion my_epoch_map, peer_epoch_map;
  const proto::EpochPage* my_epoch = nullptr;
  const proto::EpochPage* peer_epoch = nullptr;
  uint32_t my_epoch_v = 0, peer_epoch_v = 0;
  uint32_t ctl_gen =
      0;  ///< ControlPage::grant_gen when granted (a backend that imported us moves it)
  std::vector<MappedRegion> segs;
  std::vector<proto::DirectMr> mrs;
  uint32_t peer_qpn = 0, peer_access = 0, my_lid = 0;
  /// RC, UC: non-zero when the peer receives from an SRQ (`peer_rq*` are the SRQ's), our tag
  /// for its rx_lock (DirectGrantResp::lock_tag). UD keeps its tag in UdGrant.
  uint32_t srq_tag = 0;
  Notify send_notify, recv_notify;  ///< this QP's send CQ, the peer's receive CQ
};

/// When to ask for a grant again: per QP (RC, UC), per destination (UD).
struct Asking {
  uint32_t wait = 0;          ///< posts to let pass before asking again
  uint32_t backoff = 0;       ///< the wait after the next refusal
  bool proof_failed = false;  ///< the kernel would not let us write the peer: do not prove again
};

/// A UD QP's grant into one destination (an address handle's guest and a QPN), or the
/// refusal that keeps it mediated for a while. Owned by the QP, used under its sq_lock.
struct UdGrant {
  proto::UdDest dest{};
  uint32_t qpn = 0;
  Asking asking;
  std::unique_ptr<Grant> grant;  ///< null: none now
  uint32_t peer_qkey = 0;        ///< the destination QP's qkey
  uint32_t my_qkey = 0;          ///< ours (a WR's qkey with the high bit set means it)
  uint32_t lock_tag = 0;         ///< ours, for the destination's RingHeader::rx_lock
};

/// What a grant is asked with: the opcodes and the request (HandleReq for RC and UC, one
/// destination's DirectUdReq for UD).
struct GrantAsk {
  proto::Op grant, peer, prove;
  const void* req;
  size_t req_len;
};

/// Most spans one side of a direct copy is cut into.
inline constexpr uint32_t kMaxDirectSpans = proto::kMaxSge * proto::kMaxDirectChunks;

/// Asks the backend for a grant (proving first when it wants proof), and maps what it gives;
/// null after a refusal, with `st` saying when to ask again. `resp` (of `resp_len` bytes)
/// receives the answer, whose DirectGrantResp is `r`. Under the SQ lock.
std::unique_ptr<Grant> ask_grant(VQp& qp, const GrantAsk& ask, Asking& st, void* resp,
                                 size_t resp_len, const proto::DirectGrantResp& r);
/// Whether the grant still holds (no epoch moved, no backend took us in since).
bool grant_still_good(const proto::ControlPage& ctl, const Grant& g);
/// Copies `len` bytes from `src` to `dst`, span to span.
void copy_spans(const MemSpan* src, const MemSpan* dst, uint64_t len);
/// The peer's memory of [at, at + len) under `key` (an lkey's virtual address or, `by_iova`, an
/// rkey's iova), appended to `out` as spans of our mappings (at most kMaxDirectSpans in all).
bool remote_spans(const Grant& g, uint32_t key, uint64_t at, uint64_t len, uint32_t access,
                  bool by_iova, MemSpan* out, size_t& n);
/// Copies the peer's receive WQE at `cons` out of its ring; false when it is malformed.
bool take_recv_wqe(const Grant& g, uint32_t cons, proto::RecvWqe& out);
/// A receive WQE's SGEs as spans of our mappings of the peer's memory (at most
/// kMaxDirectSpans), with their total length in `cap`; false when one names memory the grant
/// does not hold with LOCAL_WRITE.
bool recv_spans(const Grant& g, const proto::RecvWqe& r, MemSpan* out, size_t& n, uint64_t& cap);
/// Receive WQEs the peer has posted and we have not taken. The peer may simply be a little
/// behind (it reposts as it polls): wait for it up to 1 ms before answering "none", which
/// sends the WQE to the backend (RC: its RNR wait, a timer of usually hundreds of µs).
uint32_t posted_receives(Grant& g, uint32_t cons);
/// After a completion is published into an own ring: fires the CQ's channel when the CQ is
/// armed for it. Pairs with the poller's seq_cst store of `armed` before it polls again (and
/// with the backend's push_cqe, which consumes the same word): one event per arm.
void fire(Notify& n, bool solicited);
/// Takes a receive side's rx_lock (proto/ring.h) with our session's `tag`: false after 4096
/// tries (a holder keeps it for one receive; one that was preempted would hold us for a time
/// slice), and the WR goes to the backend instead.
bool take_rx_lock(proto::RingHeader& h, uint32_t tag);
void give_rx_lock(proto::RingHeader& h);
/// direct_post for a UD QP (direct_ud.cc): a grant per destination.
void direct_post_ud(VQp& qp, ibv_send_wr*& wr);

/// This process's MR for `key` in the QP's PD, or null (cached per QP; under the SQ lock).
const LocalMr* local_mr(VContext& ctx, VQp& qp, uint32_t key);
/// Edges ThreadSanitizer cannot see, given to it through one address (nothing in other builds):
/// - a producer in this process (the hub's thread, remote_datapath.cc) and the CQ's poller reach
///   an own ring through two mappings of one memfd; its producer index orders them (release, then
///   acquire), but ThreadSanitizer sees two addresses, and would report the data a completion
///   stands for as a race;
/// - bytes that arrive on one connection to a peer's library may answer bytes sent on another
///   (a program that sends from the buffer it receives into, as ibv_rc_pingpong does): the order
///   goes through the peer's process.
#if defined(__SANITIZE_THREAD__)
inline std::atomic<uint32_t> g_tsan_ring_edge{0};
inline void tsan_ring_release() { g_tsan_ring_edge.fetch_add(1, std::memory_order_release); }
inline void tsan_ring_acquire() { (void)g_tsan_ring_edge.load(std::memory_order_acquire); }
#else
inline void tsan_ring_release() {}
inline void tsan_ring_acquire() {}
#endif
/// The WR's local memory as spans, checked against this process's MRs (key, PD, `need`,
/// bounds; inline data, for the opcodes that carry data, needs none): IBV_WC_SUCCESS, or the
/// error the WR's completion gets (LOC_PROT_ERR; LOC_LEN_ERR for a message too long). Under the
/// SQ lock (local_mr's cache).
int local_sges(VContext& ctx, VQp& qp, const ibv_send_wr& wr, uint32_t need, MemSpan* out,
               size_t& n, uint64_t& len);
/// Maps an own completion ring of `entries` from its memfd (with its stamps, when the header
/// says it has them and the memfd holds them).
bool map_ring(OwnRing& r, int fd, uint32_t entries);
/// Whether an own ring we produce into has a free slot (the consumer's index is read only when
/// the copy in `seen` says full).
bool has_room(OwnRing& r);
/// Appends a completion to an own ring (has_room() said yes).
void push(OwnRing& r, const proto::Cqe& e);
/// One message more in an own ring's counters (this library is their only writer).
void count(OwnRing& r, uint64_t bytes);
/// The send completion's opcode of a WR of opcode `op` (its executor's: this library on either
/// direct path, as the backend's complete_send gives it).
ibv_wc_opcode send_wc_opcode(uint32_t op);

/// The cursors of another process are read only when the copy we have says "full" or "empty":
/// each such read moves a cache line between the cores.
/// Tells the backend where this process keeps its proof cookie (kDirectCookie), when the
/// backend offers the direct path: a peer's library proves it may write our memory by reading
/// it through our /proc/PID/mem. Once, at ibv_open_device.
void send_direct_cookie(VContext& ctx);
/// Executes WRs of `wr`'s chain directly while it can; leaves `wr` at the first one it did not
/// execute (null: all done). Asks for a grant when the QP has none. Called under the SQ lock.
void direct_post(VQp& qp, ibv_send_wr*& wr);
/// Ends the QP's grant, if any (the next post asks again). Takes sq_lock only when there is one.
void drop_grant(VQp& qp);

/// The next completion of `cq`, from its ring or a QP's own ring (never one that a completion
/// of the same queue written earlier to the CQ's ring would have to precede); steps past it.
/// Null when there is none. CQ lock held; publish_consumed() gives the slots back.
const proto::Cqe* next_cqe(VCq& cq);
void publish_consumed(VCq& cq);
/// Forgets the own rings of QP `qp` (destroyed) that feed `cq`.
void drop_rings(VCq& cq, uint32_t qp);

}  // namespace vrdma::verbs
