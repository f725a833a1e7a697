// Shared-memory layouts of the data path: the per-session control page and the SQ, RQ and CQ
// rings, each shared between one guest and the backend only. Versioned, fixed-width, no pointers.
// Who writes what: a ring's producer index is written only by its producer (guest for SQ/RQ,
// backend for CQ), its consumer index only by its consumer. The backend keeps its own copy of
// every ring's geometry and cursors and never trusts a value read from shared memory.
#pragma once

#include <time.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace vrdma::proto {

inline constexpr uint32_t kRingMagic = 0x474e4952;  // "RING"
// 2: UD destinations in SendWqe; 3: direct path; 4: CQ rings may carry completion timestamps
// (RingHeader::stamps, CqeStamp), a CQ without them is laid out as in 3.
inline constexpr uint16_t kRingVersion = 4;
inline constexpr uint32_t kMaxSge = 16;
inline constexpr uint32_t kMaxInline = 256;  ///< inline bytes share the SGE area of a WQE
/// A CQ ring may hold up to 2^20 entries (max_cqe 1048575, the most the max_queue_depth quota
/// allows); SQs and RQs are bounded lower, by kMaxQpWr (device_caps.h).
inline constexpr uint32_t kMaxRingEntries = 1u << 20;

enum class RingKind : uint16_t { kSq = 1, kRq = 2, kCq = 3 };

using AtomicU32 = std::atomic<uint32_t>;
static_assert(AtomicU32::is_always_lock_free);
static_assert(sizeof(AtomicU32) == 4);
using AtomicU64 = std::atomic<uint64_t>;
static_assert(AtomicU64::is_always_lock_free);
static_assert(sizeof(AtomicU64) == 8);

/// A successful receive completion, in what it does not share with every other (RingHeader's
/// commit record; on the consumer's line, which the backend writes with each receive anyway).
struct RecvDone {
  uint64_t wr_id;
  uint32_t byte_len;
  uint32_t imm_data;  ///< or the invalidated rkey
  uint32_t src_qp;
  uint16_t slid;
  uint8_t opcode;    ///< IBV_WC_RECV or IBV_WC_RECV_RDMA_WITH_IMM
  uint8_t wc_flags;  ///< IBV_WC_WITH_IMM, IBV_WC_WITH_INV (both below 256)
};
static_assert(sizeof(RecvDone) == 24);

struct alignas(64) RingHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t kind;  ///< RingKind
  uint32_t entry_size;
  uint32_t num_entries;  ///< power of two; informational for the guest
  /// CQ only: bumped by the backend when a QP's own completion ring (direct path) starts to
  /// feed this CQ; the guest then asks for the rings (kDirectRings).
  AtomicU32 direct_gen;
  /// CQ rings: the kStamp* bits the CQ was created with (a CqeStamp per entry follows the
  /// entries when non-zero), written by the backend before the ring is handed out. Producers
  /// in another process check it against the ring's size before they write a stamp.
  uint32_t stamps;
  /// A QP's own completion ring only (direct path), written by the library that executes: on
  /// a send ring the messages and bytes this QP sent directly, on a receive ring those its
  /// peer delivered to it directly. The backend adds them to the QP's counters (a guest can
  /// only misreport its own traffic). On this line, which no poller reads, so counting moves
  /// no cache line between the cores.
  AtomicU64 direct_msgs;
  AtomicU64 direct_bytes;
  /// RQ of a UD QP that a direct peer feeds (kDirectGrantUd), or an SRQ that libraries feed
  /// (kDirectGrant into a QP on it): 0 free, else the holder's tag (a session's
  /// DirectGrantUdResp::lock_tag or DirectGrantResp::lock_tag, kRxLockBackend). Every consumer
  /// of the receive side holds it while it takes a receive (UD: the RQ's consumer index and the
  /// own receive-completion ring; SRQ: its consumer index): there may be several at once, in
  /// several processes and the backend.
  AtomicU32 rx_lock;
  /// RQ only: the responder's last atomic from another backend (keep_state): its PSN with
  /// kAtomicPsnValid, then the word's original value, stored before the PSN moves, so a
  /// restarted backend answers its replay and does not execute it twice. Former padding.
  AtomicU32 atomic_psn;
  AtomicU64 atomic_value;
  uint8_t pad0[8];
  AtomicU32 producer;  ///< free-running count of entries produced
  uint8_t pad1[60];
  AtomicU32 consumer;  ///< free-running count of entries consumed
  /// Backend's, for a restarted backend to continue RC over tcp: SQ: the PSN of the WQE at
  /// `consumer`; RQ: the PSN the responder expects next. (In the guest's memory: a guest that
  /// writes it only breaks its own connection's exactly-once.)
  AtomicU32 backend_psn;
  /// SQ only: WQEs the backend has retired *and* completed (stored after the completion is
  /// written). The direct path starts only when this equals the guest's producer, so that no
  /// completion it writes can pass one of the backend's.
  AtomicU32 retired;
  /// RQ only: the responder's record of the message whose receive it is taking (keep_state's
  /// exactly-once), written whole, `commit_flags` last, before the receive is consumed and its
  /// completion pushed, and cleared once the message is retired on both sides. Taking the
  /// receive (the consumer reaching `commit_rq`) is the commit: a restarted backend that finds
  /// a record whose receive was taken counts the message delivered (pushing `commit_recv` if
  /// the receive ring's producer had not reached `commit_cq`), one whose receive was not taken
  /// as never begun (Device::recover_receive). In the former padding: an older ring holds
  /// zeros, no record.
  AtomicU32 commit_flags;  ///< kCommit* bits; 0: no message in progress
  AtomicU32 commit_cq;     ///< the receive ring's producer once the completion is published
  AtomicU32 commit_rq;     ///< the RQ's (or SRQ's) consumer once the receive is taken
  AtomicU32 commit_psn;    ///< kCommitPsn: the PSN expected after the message
  AtomicU32 commit_sq;     ///< kCommitLocal: the same-host requester's SQ index of the message
  RecvDone commit_recv;    ///< the receive's completion, pushed when taken and unpublished
  /// SQ only: the SQ index (high word) whose PSN `backend_psn` names, with that PSN and
  /// kPsnAtValid (low word), in one store made before the consumer moves (`backend_psn` after
  /// it): a restart whose `consumer` is this index takes this PSN, else `backend_psn`, so a
  /// SIGKILL between the two stores cannot pair a retired WQE with its successor's PSN. Former
  /// padding (an older ring: zero, not valid).
  AtomicU64 psn_at;
  /// CQ: 0 idle, 1 next completion, 2 next solicited completion. RQ: 1 when a direct peer
  /// feeds it, so a receive needs no doorbell (a backend RNR wait ends by its timer anyway);
  /// SRQ: 1 once a library may feed it (a backend that takes the guest in learns it here).
  AtomicU32 armed;
  /// SQ of an RC QP on the direct path across backends: 0, kRevokeAsk (its QP goes back to the
  /// backends: the library sends nothing more itself, and the backend takes nothing from this
  /// send queue until the answer), kRevokeDone (the library's answer: nothing of the pair is in
  /// flight between the libraries any more). The backend asks before a move; a library asks
  /// itself when its peer's does. Former padding: an older ring holds 0.
  AtomicU32 direct_revoke;
  /// SRQ only: its armed limit (0: none), written by the backend when armed and cleared when
  /// the limit event fires. A library that feeds the SRQ (direct path) reads it under
  /// `rx_lock` and takes a receive only when at least this many stay posted after it: the
  /// receive that crosses the limit is the backend's, which raises IBV_EVENT_SRQ_LIMIT_REACHED.
  /// Former padding: an older ring holds 0.
  AtomicU32 srq_limit;
  /// RQ of a QP on an SRQ only: the SRQ receive the QP's responder took for the message in
  /// progress (kSrqTaken; 0: none), and the SRQ index it was taken at. Its WQE is copied into
  /// this QP's own RQ slot 0 (a QP on an SRQ never posts there) before the flag is set and the
  /// SRQ's consumer moves past it: a message whose payload comes over several turns (across
  /// backends) holds its receive from its start, so nothing else takes that receive meanwhile,
  /// and the message (replayed after a lost connection, or after a move or a restart: the
  /// ring goes with the QP) takes the same one again. Delivering the message clears the flag
  /// (the commit of keep_state's record); the QP's flush completes a receive still held.
  /// Former padding: an older ring holds 0.
  AtomicU32 srq_taken;
  AtomicU32 srq_taken_at;
  /// CQ only: the arm (1 or 2) a producer took back while it writes the channel's event, 0 once
  /// written (fire_armed). One killed in between leaves it set: a backend under keep_state,
  /// whose successor arms the CQ again with it and fires what it holds (fire_owed_events), or a
  /// direct peer's library, whose session's end does the same for its peers' CQs (fail_peers):
  /// a spurious event rather than a lost one. Former padding.
  AtomicU32 firing;
  uint8_t pad3[40];
};
static_assert(sizeof(RingHeader) == 256);
static_assert(offsetof(RingHeader, commit_flags) == 140 &&
              offsetof(RingHeader, atomic_value) == 48 &&
              offsetof(RingHeader, commit_recv) == 160 && offsetof(RingHeader, psn_at) == 184 &&
              offsetof(RingHeader, direct_revoke) == 196 && offsetof(RingHeader, srq_limit) == 200 &&
              offsetof(RingHeader, srq_taken) == 204 && offsetof(RingHeader, firing) == 212);

/// A completion was published into the CQ whose ring header is `cq` (`solicited`: a solicited
/// one, or one in error): if the CQ is armed for it, takes the arm back and calls
/// `write_event()` to write the channel's event, the arm noted in `firing` meanwhile. The
/// full fence pairs with the guest's seq_cst store of `armed` before it polls once more:
/// either the guest sees the completion, or the producer sees its arm. The backend
/// (Device::notify) and a direct peer's library (fire) both.
template <class WriteEvent>
void fire_armed(RingHeader& cq, bool solicited, WriteEvent&& write_event) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const uint32_t armed = cq.armed.load(std::memory_order_acquire);
  if (!(armed == 1 || (armed == 2 && solicited))) return;
  cq.firing.store(armed, std::memory_order_seq_cst);
  if (cq.armed.exchange(0, std::memory_order_acq_rel) != 0) write_event();
  cq.firing.store(0, std::memory_order_release);
}
/// A producer that died inside fire_armed may have taken the arm without writing its event:
/// arms the CQ again with it (unless the guest armed it since). Then whoever fires what the
/// CQ holds gives the event (at worst twice).
inline void rearm_unfired(RingHeader& cq) {
  const uint32_t f = cq.firing.exchange(0, std::memory_order_acq_rel);
  uint32_t expect = 0;
  if (f == 1 || f == 2) cq.armed.compare_exchange_strong(expect, f, std::memory_order_acq_rel);
}
/// RingHeader::srq_taken: slot 0 of the QP's own RQ holds a receive taken from its SRQ.
inline constexpr uint32_t kSrqTaken = 1;
inline constexpr uint32_t kCommitValid = 1;  ///< RingHeader::commit_flags: a message in progress
inline constexpr uint32_t kCommitPsn = 2;    ///< ... from another backend: commit_psn holds
inline constexpr uint32_t kCommitLocal = 4;  ///< ... from this backend: commit_sq holds
/// ... with kCommitLocal: a datagram (UD, whose receive side has many senders): commit_psn holds
/// the sender's QPN
inline constexpr uint32_t kCommitUd = 8;
/// ... its receive was one the QP held (RingHeader::srq_taken): commit_rq is that receive's SRQ
/// index + 1, and clearing srq_taken is taking it
inline constexpr uint32_t kCommitHeld = 16;
inline constexpr uint32_t kAtomicPsnValid = 1u << 31;  ///< RingHeader::atomic_psn holds one
inline constexpr uint64_t kPsnAtValid = 1u << 31;      ///< RingHeader::psn_at holds one
inline constexpr uint32_t kRxLockBackend = ~0u;  ///< RingHeader::rx_lock held by the backend
inline constexpr uint32_t kRevokeAsk = 1;   ///< RingHeader::direct_revoke: back to the backends
inline constexpr uint32_t kRevokeDone = 2;  ///< ... and the library's answer: it is

struct Sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};
static_assert(sizeof(Sge) == 16);

/// Where a UD send goes (from its address handle), packed into a SendWqe's RDMA/atomic fields,
/// which a UD send does not use: see pack_ud_dest() and unpack_ud_dest().
struct UdDest {
  uint16_t dlid;
  uint8_t is_global;
  uint8_t sl;
  uint8_t dgid[16];
};

/// One send work request. For IBV_SEND_INLINE the payload sits in `inline_data` instead of SGEs.
/// Memory windows (same layout, new opcodes: a backend without them completes these with
/// LOC_QP_OP_ERR): IBV_WR_BIND_MW carries the new rkey in `rkey`, the window's handle in
/// `ud_remote_qpn`, the range in `remote_addr` and `compare_add` (its length), the MR's lkey
/// and the window's access in `swap` (pack_bind); IBV_WR_LOCAL_INV its rkey in `rkey`;
/// IBV_WR_SEND_WITH_INV its invalidate_rkey in `imm_data` (as ibv_send_wr's union has it).
/// XRC: a WQE of an IBV_QPT_XRC_SEND QP carries the target's SRQ number (xrc_remote_srq_num) in
/// `ud_remote_qkey`, which only UD uses otherwise.
struct SendWqe {
  uint64_t wr_id;
  uint32_t opcode;      ///< IBV_WR_*
  uint32_t send_flags;  ///< IBV_SEND_*
  uint32_t imm_data;    ///< network order, as the verbs caller gave it
  uint32_t num_sge;
  uint64_t remote_addr;  ///< RDMA/atomics; UD: dlid | is_global << 16 | sl << 24
  uint32_t rkey;
  uint32_t inline_len;
  uint64_t compare_add;  ///< atomics; UD: dgid bytes 0..7
  uint64_t swap;         ///< atomics; UD: dgid bytes 8..15
  uint32_t ud_remote_qpn;
  uint32_t ud_remote_qkey;
  union {
    Sge sge[kMaxSge];
    uint8_t inline_data[kMaxInline];
  };
};
static_assert(sizeof(SendWqe) == 64 + 256);

inline void pack_ud_dest(SendWqe& w, const UdDest& d) {
  w.remote_addr = uint64_t{d.dlid} | uint64_t{d.is_global} << 16 | uint64_t{d.sl} << 24;
  std::memcpy(&w.compare_add, d.dgid, 8);
  std::memcpy(&w.swap, d.dgid + 8, 8);
}

inline UdDest unpack_ud_dest(const SendWqe& w) {
  UdDest d{};
  d.dlid = static_cast<uint16_t>(w.remote_addr);
  d.is_global = static_cast<uint8_t>(w.remote_addr >> 16) & 1;
  d.sl = static_cast<uint8_t>(w.remote_addr >> 24) & 0xf;
  std::memcpy(d.dgid, &w.compare_add, 8);
  std::memcpy(d.dgid + 8, &w.swap, 8);
  return d;
}

/// A bind's MR lkey and window access, in SendWqe::swap.
inline uint64_t pack_bind(uint32_t lkey, uint32_t access) {
  return uint64_t{lkey} | uint64_t{access} << 32;
}
inline uint32_t bind_lkey(const SendWqe& w) { return static_cast<uint32_t>(w.swap); }
inline uint32_t bind_access(const SendWqe& w) { return static_cast<uint32_t>(w.swap >> 32); }

inline constexpr uint32_t kGrhBytes = 40;  ///< a UD receive buffer starts with room for a GRH
inline constexpr uint32_t kUdMaxMessage = 4096;  ///< a datagram fits one packet: the port's MTU

/// The GRH a UD receive gets when the sender used one (an IPv6 header: version 6, payload
/// length, next header 0x1b, hop limit 64, source and destination GIDs). Every executor of a
/// datagram (the backend, a direct sender's library) writes it with this.
inline void fill_grh(uint8_t out[kGrhBytes], uint64_t len, const uint8_t sgid[16],
                     const uint8_t dgid[16]) {
  std::memset(out, 0, kGrhBytes);
  out[0] = 0x60;
  const uint16_t paylen = static_cast<uint16_t>(len);
  out[4] = static_cast<uint8_t>(paylen >> 8);
  out[5] = static_cast<uint8_t>(paylen);
  out[6] = 0x1b;
  out[7] = 64;
  std::memcpy(out + 8, sgid, 16);
  std::memcpy(out + 24, dgid, 16);
}

struct RecvWqe {
  uint64_t wr_id;
  uint32_t num_sge;
  uint32_t reserved;
  Sge sge[kMaxSge];
};
static_assert(sizeof(RecvWqe) == 16 + 256);

/// Whether the QP whose RQ header is `rq` holds a receive of its SRQ (in its RQ's slot 0).
inline bool srq_recv_held(const RingHeader& rq) {
  return rq.srq_taken.load(std::memory_order_acquire) == kSrqTaken;
}
/// The SRQ's receive `w`, at its index `at`, becomes the QP's (RingHeader::srq_taken), before
/// the taker moves the SRQ's cursor past it: the copy, then the index, then the flag, so that a
/// restart in between finds the flag with the cursor still at `at` (Device::recover_receive).
/// The backend (Device::take_recv) and a library on the direct path (hold_srq_recv) both.
inline void hold_srq_wqe(RingHeader& rq, RecvWqe& slot0, const RecvWqe& w, uint32_t at) {
  slot0 = w;
  rq.srq_taken_at.store(at, std::memory_order_relaxed);
  rq.srq_taken.store(kSrqTaken, std::memory_order_release);
}

/// One completion, a fixed-width image of ibv_wc.
struct Cqe {
  uint64_t wr_id;
  uint32_t status;  ///< IBV_WC_*
  uint32_t opcode;  ///< IBV_WC_* opcode
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm_data;  ///< network order
  uint32_t qp_num;
  uint32_t src_qp;
  uint32_t wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
  uint16_t reserved;
};
static_assert(sizeof(Cqe) == 48);

/// Completion timestamps (ibv_create_cq_ex's IBV_WC_EX_WITH_COMPLETION_TIMESTAMP and _WALLCLOCK):
/// a CQ ring created with either has one CqeStamp per entry after the entries, at the same
/// index. One clock for every producer of a host (backend, direct path, a library across hosts):
/// CLOCK_MONOTONIC_RAW in ns, so hca_core_clock is 1 GHz (1'000'000 kHz); the wallclock is
/// CLOCK_REALTIME in ns. Across hosts each side stamps with its own host's clocks.
inline constexpr uint32_t kStampRaw = 1;        ///< CqeStamp::ns
inline constexpr uint32_t kStampWallclock = 2;  ///< CqeStamp::wallclock_ns
inline constexpr uint32_t kStampAll = kStampRaw | kStampWallclock;
inline constexpr uint64_t kStampClockKhz = 1'000'000;  ///< ns ticks

struct CqeStamp {
  uint64_t ns;            ///< CLOCK_MONOTONIC_RAW when the completion was written
  uint64_t wallclock_ns;  ///< CLOCK_REALTIME likewise
};
static_assert(sizeof(CqeStamp) == 16);

inline uint64_t clock_ns(clockid_t id) {
  timespec t{};
  ::clock_gettime(id, &t);
  return static_cast<uint64_t>(t.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(t.tv_nsec);
}

/// Stamps a completion with the clocks `stamps` asks for (vDSO reads, no syscall).
inline void stamp_now(CqeStamp& s, uint32_t stamps) {
  if (stamps & kStampRaw) s.ns = clock_ns(CLOCK_MONOTONIC_RAW);
  if (stamps & kStampWallclock) s.wallclock_ns = clock_ns(CLOCK_REALTIME);
}

/// Per-session page the backend shares with the guest: tells the guest when to ring the doorbell.
inline constexpr uint32_t kFeatureDirect = 1;  ///< the backend grants the direct path (kDirectGrant)
/// ... and across backends (kDirectOffer, kDirectRemote)
inline constexpr uint32_t kFeatureDirectRemote = 2;
/// ControlPage::limits holds the guest's quotas (a backend without it leaves them zero).
inline constexpr uint32_t kFeatureLimits = 4;
/// The backend reads the ready bits (ReadyBits, after the ControlPage in its page).
inline constexpr uint32_t kFeatureReadyBits = 8;
/// The backend sends no answer to a request flagged proto::kRequestNoAnswer.
inline constexpr uint32_t kFeatureNoAnswer = 16;

/// The guest's quotas (the backend's [quotas]), so that ibv_query_device reports what the
/// device really accepts from this guest: 0 means no limit beyond the device's caps.
struct GuestLimits {
  uint32_t max_queue_depth;
  uint32_t max_qps, max_cqs, max_srqs, max_mrs, max_pds;
  uint32_t max_mr_bytes_lo, max_mr_bytes_hi;  ///< registered bytes, over all its MRs
};
static_assert(sizeof(GuestLimits) == 32);

struct alignas(64) ControlPage {
  uint32_t magic;
  uint16_t version;
  uint16_t reserved;
  uint32_t features;   ///< kFeature* bits the backend offers this session
  GuestLimits limits;  ///< kFeatureLimits (added in the former padding: same version)
  /// kFeatureLimits: the guest's device-memory quota (max_dm_bytes; 0: none beyond the device's
  /// cap). Also in the former padding: a backend without it leaves it zero.
  uint32_t max_dm_bytes_lo, max_dm_bytes_hi;
  uint32_t max_mws;  ///< kFeatureLimits: the guest's window quota (likewise; 0 from an older one)
  /// Direct path: a grant the library took while this word had another value is over. A backend
  /// that imports the session (a restore, one started again by its keeper) moves it: epoch pages
  /// of a backend that died cannot be written any more. In the former padding (an older backend
  /// leaves it zero). The guest can write it: it can keep only its own grants alive, whose peers
  /// it could write anyway (the trust rule).
  AtomicU32 grant_gen;
  uint8_t pad0[4];
  AtomicU32 backend_sleeping;  ///< 1: the backend waits on the doorbell; write it after posting
  /// On-demand paging (docs/ARCHITECTURE.md, "On-demand paging"), in the former padding: a
  /// one-slot mailbox for the pages of an ODP MR that a peer's request reached before they were
  /// faulted in. The library's pager sets odp_pager while it runs; the backend writes odp_mr,
  /// odp_addr (an iova of the MR) and odp_len, then bumps odp_req; the pager faults them in and
  /// answers with odp_status (0 or an errno) and odp_done = odp_req. Guest-writable: a wrong
  /// answer only refuses (or retries) accesses to the guest's own MR.
  AtomicU32 odp_pager;
  AtomicU32 odp_req, odp_done;
  uint32_t odp_mr;
  uint32_t odp_status;
  uint64_t odp_addr, odp_len;
  uint8_t pad1[24];
};
static_assert(sizeof(ControlPage) == 128);
static_assert(offsetof(ControlPage, odp_addr) == 88);
static_assert(offsetof(ControlPage, backend_sleeping) == 64);
static_assert(offsetof(ControlPage, grant_gen) == 56);

/// Ready bits (kFeatureReadyBits), at kReadyBitsOffset in the control page's mapping: which of
/// the session's QPs have new work, so that the backend looks at those QPs only, not at every
/// QP of the host on each turn. A post publishes its WQEs (the ring's producer index), then,
/// after a full fence, marks its QP (mark_ready), then reads ControlPage::backend_sleeping; the
/// backend clears a word (a seq_cst exchange) before it reads the rings of the QPs the word
/// names, so a post it misses has marked again. A QP's slot is its handle modulo kReadySlots
/// (QPs that share a slot are all looked at). The library stores `marks` = 1 once it marks
/// every post of this session; until then the backend looks at every QP of the session on
/// each turn, as a library from before these bits needs. Guest-written: a guest that sets
/// `marks` and does not mark only stalls its own QPs. Added in the control page's unused
/// space: the page's layout is otherwise that of version 4.
inline constexpr uint32_t kReadyWords = 64;
inline constexpr uint32_t kReadySlots = kReadyWords * 64;
inline constexpr size_t kReadyBitsOffset = 128;

struct alignas(64) ReadyBits {
  AtomicU32 marks;  ///< 1: the library marks every post (written by the guest at open)
  uint8_t pad0[60];
  AtomicU64 summary;  ///< bit w: words[w] may have bits set
  uint8_t pad1[56];
  AtomicU64 words[kReadyWords];  ///< bit s % 64 of word s / 64: slot s has new work
};
static_assert(sizeof(ReadyBits) == 128 + 8 * kReadyWords);
static_assert(kReadyBitsOffset >= sizeof(ControlPage) && kReadyBitsOffset % 64 == 0);
static_assert(kReadyBitsOffset + sizeof(ReadyBits) <= 4096);  // in the control page

inline ReadyBits* ready_bits(ControlPage* cp) {
  return reinterpret_cast<ReadyBits*>(reinterpret_cast<uint8_t*>(cp) + kReadyBitsOffset);
}

/// Marks QP `handle` as having new work (the library, after publishing it and a seq_cst
/// fence). A bit already set costs only a load: the backend has not cleared it yet, so it
/// still reads this QP's ring after the index just published.
inline void mark_ready(ReadyBits& r, uint32_t handle) {
  const uint32_t slot = handle % kReadySlots;
  const uint64_t bit = uint64_t{1} << (slot % 64), word = uint64_t{1} << (slot / 64);
  AtomicU64& w = r.words[slot / 64];
  if (!(w.load(std::memory_order_seq_cst) & bit)) w.fetch_or(bit, std::memory_order_seq_cst);
  if (!(r.summary.load(std::memory_order_seq_cst) & word))
    r.summary.fetch_or(word, std::memory_order_seq_cst);
}

/// A guest's epoch (direct path): the backend bumps it whenever something of the guest that a
/// direct grant relies on changes (a QP is modified or destroyed or fails, an MR goes, a session
/// ends, the guest moves). A peer's library uses its grant only while both epochs are unchanged.
/// Mapped read-only by the guests.
struct alignas(64) EpochPage {
  uint32_t magic;
  AtomicU32 epoch;
  uint8_t pad[56];
};
static_assert(sizeof(EpochPage) == 64);

inline constexpr size_t ring_bytes(uint32_t entries, size_t entry_size) {
  return sizeof(RingHeader) + size_t{entries} * entry_size;
}

/// A CQ ring: header, entries, then (with stamps) a CqeStamp per entry.
inline constexpr size_t cq_ring_bytes(uint32_t entries, uint32_t stamps) {
  return ring_bytes(entries, sizeof(Cqe)) + (stamps ? size_t{entries} * sizeof(CqeStamp) : 0);
}

/// Entries of a ring start right after the header.
template <typename Entry>
inline Entry* ring_entries(RingHeader* h) {
  return reinterpret_cast<Entry*>(reinterpret_cast<uint8_t*>(h) + sizeof(RingHeader));
}

/// The stamps of a CQ ring of `entries` (created with stamps).
inline CqeStamp* cq_stamps(RingHeader* h, uint32_t entries) {
  return reinterpret_cast<CqeStamp*>(reinterpret_cast<uint8_t*>(h) +
                                     ring_bytes(entries, sizeof(Cqe)));
}

}  // namespace vrdma::proto
