// The control-path protocol between a guest (our libibverbs) and the backend (vrdmad):
// one SOCK_SEQPACKET message per command, a fixed header then a fixed-width body per opcode.
// Versioned: kVersion changes when any body changes; opcode values are never reused.
// Request and response share the header; `status` in a response is 0 or a negative errno.
// long-file: every opcode and its body in one table, so that no value is ever reused
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/status.h"
#include "proto/ring.h"

namespace vrdma::proto {

inline constexpr uint32_t kMagic = 0x4d445256;  // "VRDM" little-endian
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kMaxRequest = 4096;         ///< largest request the backend accepts
inline constexpr size_t kMaxResponse = 1u << 20;    ///< largest response (status text)
inline constexpr uint32_t kNone = 0xffffffffu;      ///< "no handle" in handle fields
inline constexpr size_t kGuestNameMax = 64;
inline constexpr size_t kMaxMrExtents = 32;

enum class Op : uint16_t {
  kHello = 1,
  kAllocPd = 2,
  kDeallocPd = 3,
  kRegSegment = 4,
  kRegMr = 5,
  kDeregMr = 6,
  kCreateChannel = 7,
  kDestroyChannel = 8,
  kCreateCq = 9,
  kDestroyCq = 10,
  kCreateQp = 11,
  kModifyQp = 12,
  kQueryQp = 13,
  kDestroyQp = 14,
  kStatus = 15,
  kCreateSrq = 16,
  kModifySrq = 17,
  kQuerySrq = 18,
  kDestroySrq = 19,
  // Operator and backend-to-backend commands (no Hello; the caller must be root or the
  // backend's own user): moving a guest's device.
  kMigrate = 20,
  kImportBegin = 21,
  kImportData = 22,  ///< variable body: a piece of the state blob, descriptors attached
  kImportCommit = 23,
  kSnapshot = 24,
  // Backend to its state keeper (backend/keeper.h).
  kKeepDrop = 25,
  kKeepBye = 26,
  kKeepRestore = 27,
  kKeepEnd = 28,
  kRestore = 29,  ///< operator: a snapshot file's state back into the guest's device
  // The direct path between guests of one uid (docs/ARCHITECTURE.md, "Direct path").
  kDirectGrant = 30,
  kDirectRings = 31,
  // The direct path across backends (docs/ARCHITECTURE.md, "Across hosts").
  kDirectOffer = 32,
  kDirectRemote = 33,
  /// Releases a segment (kRegSegment) no MR uses any more: HandleReq, no response body.
  kDeregSegment = 34,
  // The RDMA connection manager (librdmacm; docs/ARCHITECTURE.md, "RDMA CM"). Ids and channels
  // are the session's; events come on the channel's own socket (kCmEvent), never as answers.
  kCmCreateChannel = 35,   ///< Empty; HandleResp; response fd: the channel's event socket
  kCmDestroyChannel = 36,  ///< HandleReq
  kCmCreateId = 37,        ///< CmCreateIdReq; HandleResp
  kCmDestroyId = 38,       ///< HandleReq
  kCmBind = 39,            ///< CmAddrReq; CmAddrResp (the port given)
  kCmListen = 40,          ///< CmListenReq
  kCmResolveAddr = 41,     ///< CmResolveReq; event ADDR_RESOLVED or ADDR_ERROR
  kCmResolveRoute = 42,    ///< CmResolveReq (addresses unused); event ROUTE_RESOLVED or _ERROR
  kCmConnect = 43,         ///< CmConnReq: the IB CM's REQ
  kCmAccept = 44,          ///< CmConnReq: REP
  kCmReject = 45,          ///< CmConnReq (private data only): REJ
  kCmEstablish = 46,       ///< HandleReq: RTU
  kCmDisconnect = 47,      ///< HandleReq: DREQ (or DREP, after the peer's)
  kCmMigrateId = 48,       ///< CmMigrateReq: the id's events go to another channel
  kCmEvent = 49,           ///< backend to library only, on an event socket: CmEvent
  // UD multicast (ibv_attach_mcast/detach): McastReq, no response body.
  kAttachMcast = 50,
  kDetachMcast = 51,
  // rdma_join_multicast/leave: CmAddrReq (the group's address); join's event MULTICAST_JOIN.
  kCmJoinMcast = 52,
  kCmLeaveMcast = 53,
  // More of the verbs surface (issue 24).
  kReregMr = 54,    ///< ReregMrReq; Empty (the MR keeps its handle and keys)
  kResizeCq = 55,   ///< ResizeCqReq; CreateCqResp; response fd: the new ring memfd
  kAllocDm = 56,    ///< AllocDmReq; AllocDmResp; response fd: the device memory's memfd
  kFreeDm = 57,     ///< HandleReq
  kRegDmMr = 58,    ///< RegDmMrReq; RegMrResp
  kAllocMw = 59,    ///< AllocMwReq; AllocMwResp (binds go through the send queue: SendWqe)
  kDeallocMw = 60,  ///< HandleReq
  /// Variable body: a piece of the guest's RDMA CM state (JSON, backend/cm_migrate.cc), its
  /// channels' sockets attached; between kImportData and kImportCommit of a move, optional.
  kImportCm = 61,
  /// MwViewReq; MwViewResp: a window as the library's responder on the direct path across
  /// backends sees it (docs/ARCHITECTURE.md, "Memory windows").
  kMwView = 62,
  // 63-64: free (kept for work in flight).
  // The direct path's trust rule (docs/ARCHITECTURE.md, "Direct path": trust).
  kDirectCookie = 65,  ///< DirectCookieReq; Empty
  kDirectPeer = 66,    ///< HandleReq (the QP); DirectPeerResp
  kDirectProve = 67,   ///< HandleReq (the QP), one fd attached: the proof; Empty
  // XRC (docs/ARCHITECTURE.md, "XRC"). An XRC domain is the guest's, named by the inode of a
  // file the guest opened (attached to kOpenXrcd); SRQs and receive QPs live in it.
  kOpenXrcd = 68,      ///< OpenXrcdReq, the file's fd attached (none: a private domain); HandleResp
  kCloseXrcd = 69,     ///< HandleReq (EBUSY while this session has SRQs or QPs in it)
  kCreateXrcSrq = 70,  ///< CreateXrcSrqReq; CreateSrqResp (srq_num); response fd: the ring memfd
  kOpenQp = 71,        ///< OpenQpReq: an XRC receive QP of the domain; CreateQpResp (no rings)
  // 72: free.
  // Another process shares this session (ibv_import_device: it holds the session's socket, the
  // ibv_context's cmd_fd, passed to it by SCM_RIGHTS). docs/ARCHITECTURE.md, "Imports".
  kImportContext = 73,  ///< Empty; HelloResp; response fds as kHello's (control, doorbell, async)
  kImportObject = 74,   ///< ImportObjectReq; ImportObjectResp; response fd: a DM's memfd
  // 75-77: free.
  kKeepListener = 78,     ///< to/from the keeper: Empty, the TCP transport's listener attached
  kKeepListenerAsk = 79,  ///< to the keeper: Empty; answered kKeepListener (the listener or none)
  // The same-host direct path for UD (docs/ARCHITECTURE.md, "Direct path"): per destination.
  kDirectGrantUd = 80,  ///< DirectUdReq; DirectGrantUdResp; response fds as kDirectGrant's
  kDirectPeerUd = 81,   ///< DirectUdReq; DirectPeerResp (as kDirectPeer, for the destination)
  kDirectProveUd = 82,  ///< DirectUdReq, one fd attached: the proof; Empty (as kDirectProve)
  kMax = 83,            ///< one past the last opcode; never sent
};

/// Whether an opcode is one of the connection manager's (kCmCreateChannel..kCmEvent,
/// kCmJoinMcast, kCmLeaveMcast).
inline bool is_cm(Op op) {
  return (op >= Op::kCmCreateChannel && op <= Op::kCmEvent) || op == Op::kCmJoinMcast ||
         op == Op::kCmLeaveMcast;
}

/// The opcode's name for log lines ("kRegMr" -> "reg_mr"); "op N" for an unknown one.
std::string op_name(uint16_t op);

/// Whether an opcode is sent without a session (Hello) first.
inline bool sessionless(Op op) {
  return op == Op::kStatus || (op >= Op::kMigrate && op <= Op::kRestore) || op == Op::kImportCm;
}

struct MsgHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t op;
  uint32_t length;  ///< header + body, bytes
  uint32_t seq;     ///< echoed in the response
  int32_t status;   ///< response: 0 or -errno; request: 0
  /// request: kRequest* bits; response: kAnswer* bits. Was `reserved`, written 0 and read by
  /// no one: a peer from before the flags ignores them and sends none.
  uint32_t flags;
};
static_assert(sizeof(MsgHeader) == 24);
/// The caller reads no answer to this request (a posted command): a backend that offers
/// kFeatureNoAnswer (proto/ring.h) sends none, even on failure; an older one answers as ever.
inline constexpr uint32_t kRequestNoAnswer = 1;

// ---- Answer flags (MsgHeader::flags of a response): what the library must tell its program
// and neither the errno nor the body says. No version change: the field was `reserved`, written
// 0 and read by no one, so an older library ignores the flags and an older backend sends none
// (the library then says nothing more than before).
/// An error answer: a guest quota of the backend's [quotas] refused it (its reason names it).
inline constexpr uint32_t kAnswerQuota = 1;
/// kModifyQp to RTR, which succeeded: no backend this one can reach knows the destination (not
/// a guest here, and no TCP transport to look elsewhere): its sends will only time out.
inline constexpr uint32_t kAnswerDestUnknown = 2;
/// Adds answer flags to an encoded response.
inline void add_answer_flags(std::vector<uint8_t>& msg, uint32_t flags) {
  uint32_t f;
  std::memcpy(&f, msg.data() + offsetof(MsgHeader, flags), sizeof(f));
  f |= flags;
  std::memcpy(msg.data() + offsetof(MsgHeader, flags), &f, sizeof(f));
}

struct Empty {};

// ---- kHello: first message of a session. Response fds: control page, doorbell, async events.
struct HelloReq {
  char guest[kGuestNameMax];  ///< NUL-terminated guest name
  uint32_t pid;
  uint32_t flags;
};
static_assert(sizeof(HelloReq) == 72);
struct HelloResp {
  uint64_t guest_id;
  uint64_t port_guid;
  uint8_t gid[16];
  uint32_t lid;
  uint32_t session_id;
  uint64_t control_bytes;  ///< size of the control page mapping
};
static_assert(sizeof(HelloResp) == 48);

struct HandleReq {  ///< every destroy/dealloc/dereg
  uint32_t handle;
  uint32_t reserved;
};
static_assert(sizeof(HandleReq) == 8);
struct HandleResp {
  uint32_t handle;
  uint32_t reserved;
};
static_assert(sizeof(HandleResp) == 8);

// ---- kRegSegment: hands the backend a sealed memfd that backs guest memory (one fd attached).
struct RegSegmentReq {
  uint64_t size;
};
static_assert(sizeof(RegSegmentReq) == 8);

// ---- kRegMr: an MR is a virtual range described by extents of registered segments. An ODP MR
// (IBV_ACCESS_ON_DEMAND) has none at first (addr 0 and length UINT64_MAX: implicit ODP).
struct MrExtent {
  uint64_t mr_offset;   ///< offset of this extent within the MR
  uint64_t length;
  uint64_t seg_offset;  ///< offset within the segment
  uint32_t segment;     ///< handle from kRegSegment
  uint32_t reserved;
};
static_assert(sizeof(MrExtent) == 32);
struct RegMrReq {
  uint32_t pd;
  uint32_t access;  ///< IBV_ACCESS_* bits
  uint64_t addr;    ///< guest virtual address of the first byte
  uint64_t length;
  uint64_t iova;    ///< address peers use in rkey accesses
  uint32_t num_extents;
  uint32_t reserved;
  MrExtent extents[kMaxMrExtents];
};
static_assert(sizeof(RegMrReq) == 40 + 32 * kMaxMrExtents);
struct RegMrResp {
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
  uint32_t reserved;
};
static_assert(sizeof(RegMrResp) == 16);

// ---- kReregMr: ibv_rereg_mr. `flags` are IBV_REREG_MR_CHANGE_*; `mr` carries what they
// change: its pd (CHANGE_PD), access (CHANGE_ACCESS), and addr, length, iova and extents
// (CHANGE_TRANSLATION); the other fields are ignored. All or nothing: a refusal changes nothing.
// kReregOdpMap (vrdma's own flag, alone) adds pages to an ODP MR (IBV_ACCESS_ON_DEMAND, made
// with no extents): mr.addr and mr.length are the range the library made reachable (in the MR's
// address space), its extents their pages; the rest of the MR is unchanged.
inline constexpr uint32_t kReregOdpMap = 1u << 31;
// kReregOdpPager (alone, an ODP MR's handle, one descriptor: a socket) names where the backend
// sends a byte after each request in the control page's ODP mailbox, to wake the library's pager
// (MSG_DONTWAIT: a full or closed socket never blocks the engine). An older backend refuses it.
inline constexpr uint32_t kReregOdpPager = 1u << 30;
struct ReregMrReq {
  uint32_t handle;
  uint32_t flags;
  RegMrReq mr;
};
static_assert(sizeof(ReregMrReq) == 8 + sizeof(RegMrReq));

// ---- Device memory (ibv_alloc_dm): a memfd the backend makes and both sides map. kAllocDm's
// response carries it; `bytes` is its mapped size (whole pages, >= length).
struct AllocDmReq {
  uint64_t length;
  uint32_t log_align_req;
  uint32_t reserved;
};
static_assert(sizeof(AllocDmReq) == 16);
struct AllocDmResp {
  uint32_t handle;
  uint32_t reserved;
  uint64_t bytes;
};
static_assert(sizeof(AllocDmResp) == 16);
/// kRegDmMr: a zero-based MR over [offset, offset + length) of device memory `dm`.
struct RegDmMrReq {
  uint32_t pd;
  uint32_t dm;
  uint32_t access;  ///< IBV_ACCESS_*; IBV_ACCESS_ZERO_BASED is required
  uint32_t reserved;
  uint64_t offset;
  uint64_t length;
};
static_assert(sizeof(RegDmMrReq) == 32);

// ---- Memory windows (ibv_alloc_mw): a window of PD `pd`, type IBV_MW_TYPE_1 or _2; its rkey
// is the initial one (index in the upper 24 bits, the 8-bit key that each bind changes below).
struct AllocMwReq {
  uint32_t pd;
  uint32_t type;
};
static_assert(sizeof(AllocMwReq) == 8);
struct AllocMwResp {
  uint32_t handle;
  uint32_t rkey;
};
static_assert(sizeof(AllocMwResp) == 8);
/// kMwView: the window under `rkey` as responder QP `qp` (a handle of the session) may use it,
/// for the library that answers that QP's peer itself (the direct path across backends): the
/// backend's window_view, and with kMwViewInvalidate a SEND_WITH_INV's check_invalidate, the
/// window invalidated when it passes. Windows are never in the library's hands, only this view.
inline constexpr uint32_t kMwViewInvalidate = 1;
struct MwViewReq {
  uint32_t qp;
  uint32_t rkey;
  uint32_t flags;  ///< kMwViewInvalidate
  uint32_t reserved;
};
static_assert(sizeof(MwViewReq) == 16);
struct MwViewResp {
  uint32_t status;  ///< IBV_WC_SUCCESS, or (kMwViewInvalidate) IBV_WC_REM_INV_REQ_ERR
  uint32_t found;   ///< 1: usable for remote access (responder_rules.h window_view), then:
  uint32_t mr_key;  ///< the key of the MR under the window (one of the session's)
  uint32_t access;  ///< the bind's IBV_ACCESS_REMOTE_* bits
  uint64_t iova, length, base;  ///< as RemoteMrView's
};
static_assert(sizeof(MwViewResp) == 40);

/// kImportObject: what ibv_import_pd/mr/dm need of an object of the session, by handle.
enum class ImportKind : uint32_t { kPd = 1, kMr = 2, kDm = 3 };
struct ImportObjectReq {
  uint32_t kind;  ///< ImportKind
  uint32_t handle;
};
static_assert(sizeof(ImportObjectReq) == 8);
struct ImportObjectResp {
  uint32_t pd;      ///< MR: its PD's handle
  uint32_t key;     ///< MR: lkey == rkey
  uint32_t access;  ///< MR: IBV_ACCESS_*
  uint32_t reserved;
  uint64_t addr;    ///< MR: the registering process's address (ibv_mr::addr); 0 zero-based
  uint64_t length;  ///< MR and DM
  uint64_t bytes;   ///< DM: the mapping's size (its memfd comes with the response)
};
static_assert(sizeof(ImportObjectResp) == 40);

// ---- kCreateChannel: response carries the read end of the event pipe (4-byte CQ handles).

// ---- kCreateCq: response carries the ring memfd.
struct CreateCqReq {
  uint32_t cqe;
  uint32_t channel;  ///< kNone: no completion channel
  uint32_t comp_vector;
  /// proto::kStamp* (ring.h): completion timestamps; a backend older than them took this as
  /// reserved, ignored it and made a ring without (RingHeader::stamps 0 says so).
  uint32_t stamps;
};
static_assert(sizeof(CreateCqReq) == 16);
struct CreateCqResp {
  uint32_t handle;
  uint32_t cqe;      ///< usable entries (>= requested)
  uint64_t ring_bytes;
};
static_assert(sizeof(CreateCqResp) == 16);
/// kResizeCq: the CQ gets a new ring of at least `cqe` entries (its completions copied over, in
/// order); the response is CreateCqResp's, with the new ring's memfd.
struct ResizeCqReq {
  uint32_t handle;
  uint32_t cqe;
};
static_assert(sizeof(ResizeCqReq) == 8);

// ---- kDirectGrant: may this RC (or UC) QP's library execute its WQEs itself, straight into the
// peer's memory? Response fds, in order: the peer QP's ring memfd, this QP's send-completion ring,
// the peer QP's receive-completion ring, this guest's epoch page, the peer's epoch page (both
// read-only), then `num_segments` memfds of the peer's segments that its MRs name, then for
// each of this QP's send CQ and the peer's receive CQ that has a completion channel (`notify`
// bits, in that order) the CQ's ring memfd (for its `armed` word), the channel pipe's write end
// (the library fires the event itself) and its read end (held, so that a write never meets a
// pipe without readers: SIGPIPE). HandleReq (the QP); `reserved`: kDirectGrantSrq, this library
// can feed a peer's SRQ (then the ring memfd is the SRQ's, and DirectGrantResp::lock_tag set).
inline constexpr uint32_t kDirectGrantSrq = 1;
inline constexpr uint32_t kMaxDirectChunks = 4;
inline constexpr uint32_t kDirectNotifySend = 1;  ///< DirectGrantResp::notify
inline constexpr uint32_t kDirectNotifyRecv = 2;
inline constexpr uint32_t kDirectNotifyFds = 3;  ///< fds per CQ with a channel
inline constexpr uint32_t kMaxDirectMrs = 64;
inline constexpr uint32_t kDirectFixedFds = 5;
struct DirectChunk {
  uint64_t mr_offset;
  uint64_t length;
  uint64_t seg_offset;
  uint32_t segment;  ///< index among the response's segment fds
  uint32_t reserved;
};
static_assert(sizeof(DirectChunk) == 32);
struct DirectMr {  ///< one MR of the peer, in the peer QP's PD
  uint32_t key;
  uint32_t access;
  uint32_t num_chunks;
  uint32_t reserved;
  uint64_t addr;  ///< where lkeys address it (the peer's virtual address)
  uint64_t iova;  ///< where rkeys do
  uint64_t length;
  uint64_t reserved2;
  DirectChunk chunks[kMaxDirectChunks];
};
static_assert(sizeof(DirectMr) == 48 + 32 * kMaxDirectChunks);
struct DirectGrantResp {
  uint32_t peer_qpn;
  uint32_t peer_access;  ///< the peer QP's qp_access_flags
  uint32_t my_lid;
  uint32_t peer_rq_entries;
  uint64_t peer_ring_bytes;
  uint64_t peer_rq_offset;
  uint32_t send_ring_entries;  ///< this QP's send-completion ring
  uint32_t recv_ring_entries;  ///< the peer QP's receive-completion ring
  uint32_t my_epoch;           ///< the epochs the grant holds for
  uint32_t peer_epoch;
  uint32_t num_segments;
  uint32_t num_mrs;
  uint32_t notify;   ///< kDirectNotifySend | kDirectNotifyRecv: CQs with a channel
  uint32_t send_cq;  ///< CQ handles, the value an event writes into the channel
  uint32_t recv_cq;
  /// Non-zero: `peer_rq_*` are an SRQ's, taken holding its rx_lock with this tag (ring.h).
  uint32_t lock_tag;
  DirectMr mrs[kMaxDirectMrs];
};
static_assert(sizeof(DirectGrantResp) == 72 + sizeof(DirectMr) * kMaxDirectMrs);

// ---- kDirectGrantUd: may this UD QP's library send straight into destination QP
// `remote_qpn` of the guest `dest` names (an address handle's, not multicast), on this backend?
// The same checks and descriptors as kDirectGrant (the destination is the peer), per
// destination; the peer's receive side (its RQ and receive-completion ring) has several
// producers then, which take turns through its RQ header's `rx_lock` (proto/ring.h).
struct DirectUdReq {
  uint32_t qp;  ///< the sending QP's handle
  uint32_t remote_qpn;
  UdDest dest;
};
static_assert(sizeof(DirectUdReq) == 28);
struct DirectGrantUdResp {
  uint32_t peer_qkey;  ///< the destination QP's qkey (a WR's qkey must match it)
  uint32_t lock_tag;   ///< what this session stores into `rx_lock` while it holds it
  uint32_t my_qkey;    ///< the sending QP's own qkey (a WR's qkey with the high bit set)
  uint32_t reserved;
  DirectGrantResp grant;
};
static_assert(sizeof(DirectGrantUdResp) == 16 + sizeof(DirectGrantResp));

// ---- kDirectRings: the QPs' own completion rings that feed a CQ (HandleReq: the CQ, and in
// `reserved` how many of them to skip). One fd per ring, in order. A CQ fed by more rings than
// one answer holds (64 QPs sharing it for sends and receives) is read a page at a time: a full
// page means ask again from past it. (A backend before paging answered E2BIG past one page.)
inline constexpr uint32_t kMaxDirectRings = 64;
struct DirectRing {
  uint32_t qp;       ///< QP handle
  uint32_t recv;     ///< 0: its send completions, 1: its receive completions
  uint32_t entries;  ///< ring entries (power of two)
  uint32_t reserved;
};
static_assert(sizeof(DirectRing) == 16);
struct DirectRingsResp {
  uint32_t gen;  ///< the CQ's direct_gen these rings are of
  uint32_t count;
  DirectRing rings[kMaxDirectRings];
};
static_assert(sizeof(DirectRingsResp) == 8 + 16 * kMaxDirectRings);

// ---- The direct path across backends (docs/ARCHITECTURE.md, "Across hosts"): the libraries
// of an RC QP pair whose QPs live on two backends talk TCP to each other; the backends only
// introduce them.
// kDirectOffer: the library of QP `qp` takes its peer QP's direct connection on TCP `port` of
// this host, from whoever presents `token`. The backend checks the QP (RC or UC, peer on another
// backend, RTR or RTS, no SRQ; a completion channel on its receive CQ only with
// kDirectOfferNotify), gives it its own receive-completion ring (response fd 0; then, for a CQ
// with a channel, its kDirectNotifyFds: the library fires the channel itself) and passes the
// offer to the peer's backend.
// With kDirectOfferWhere (and port 0) it only answers where the library is to listen: the
// address the peer's library will dial (`listen_ipv4`), checked as for an offer, nothing given
// or sent; EADDRNOTAVAIL when it is unknown. (A backend older than the flag answers EINVAL.)
inline constexpr size_t kDirectTokenBytes = 16;
inline constexpr uint16_t kDirectOfferWhere = 1;  ///< DirectOfferReq::flags
/// DirectOfferReq::flags: this library fires its CQs' channels itself. Without it a receive CQ
/// with a channel is EOPNOTSUPP, as before the flag (a backend older than it answers EOPNOTSUPP
/// for such a CQ whatever the flags, so the QP stays on the backends).
inline constexpr uint16_t kDirectOfferNotify = 2;
struct DirectOfferReq {
  uint32_t qp;    ///< QP handle
  uint16_t port;  ///< host order
  uint16_t flags;
  uint8_t token[kDirectTokenBytes];
};
static_assert(sizeof(DirectOfferReq) == 24);
struct DirectOfferResp {
  uint32_t recv_ring_entries;  ///< the QP's own receive-completion ring (fd 0)
  uint32_t peer_qpn;           ///< the QP's destination QPN: the only one that may connect
  uint32_t my_lid;
  uint32_t listen_ipv4;  ///< network order: the address to listen on (0: unknown)
};
static_assert(sizeof(DirectOfferResp) == 16);
/// DirectOfferReq::flags: this library takes the receives of a QP on a (basic) SRQ itself, under
/// the SRQ's rx_lock, holding one for a message whose payload is still coming (RingHeader::
/// srq_taken), and rings the doorbell of the QP when a receive it took crossed the SRQ's armed
/// limit. Without it a QP on an SRQ is EOPNOTSUPP (as from a backend older than the flag,
/// whatever the flags). With it the answer is a DirectOfferSrqResp.
inline constexpr uint16_t kDirectOfferSrq = 4;
struct DirectOfferSrqResp {
  DirectOfferResp offer;
  uint32_t lock_tag;  ///< this session's tag in the SRQ's rx_lock (DirectGrantResp::lock_tag)
  uint32_t reserved;
};
static_assert(sizeof(DirectOfferSrqResp) == 24);
// kDirectRemote (HandleReq: the QP; `reserved`: kDirectRemoteNotify or 0): may this QP's
// library send straight to its peer's library? Needs the peer's offer (matching this QP's
// destination), RTS, nothing in flight, a send CQ with no completion channel unless
// kDirectRemoteNotify (any rnr_retry: the library counts it). Response fd 0: the QP's own
// send-completion ring; then, for a send CQ with a channel, its kDirectNotifyFds. Once its library has connected it puts nothing on the send queue (until
// the QP is in ERR); if it could not connect, it goes on through the queue, which the backend
// still executes. EAGAIN: not yet (no offer, work in flight); EOPNOTSUPP: never for this QP.
/// HandleReq::reserved of kDirectRemote: as kDirectOfferNotify, for the send CQ.
inline constexpr uint32_t kDirectRemoteNotify = 1;
struct DirectRemoteResp {
  uint32_t send_ring_entries;
  uint32_t peer_qpn;
  uint32_t my_lid;
  uint32_t peer_ipv4;  ///< network order: where the peer's library listens ...
  uint16_t peer_port;  ///< ... host order
  uint16_t reserved0;
  uint32_t reserved1;
  uint8_t token[kDirectTokenBytes];
};
static_assert(sizeof(DirectRemoteResp) == 40);

// ---- The direct path's trust rule: a grant needs proof that the requesting process could
// already write the peer's memory by the kernel's own rules (ptrace access mode, Yama, LSMs,
// namespaces), unless the operator declared the two guests one tenant ([datapath] direct_trust).
// kDirectCookie: where this process keeps its session's proof cookie (16 random bytes the
// library chose and wrote there before asking): a proof for this session must read it there.
inline constexpr size_t kDirectCookieBytes = 16;
struct DirectCookieReq {
  uint64_t addr;  ///< in this process's address space
  uint8_t cookie[kDirectCookieBytes];
};
static_assert(sizeof(DirectCookieReq) == 24);
// kDirectPeer (HandleReq: the QP; a kDirectGrant answered EACCES): the pid of the peer QP's
// process as the caller's pid namespace numbers it (same uid only; EPERM when the caller cannot
// see it, EAGAIN when the peer's library has not sent its cookie).
struct DirectPeerResp {
  uint32_t pid;
  uint32_t reserved;
};
static_assert(sizeof(DirectPeerResp) == 8);
// kDirectProve (HandleReq: the QP): the attached descriptor is that pid's /proc/PID/mem, opened
// O_RDWR by the caller. The backend reads the peer's cookie through it; from then on this
// session may get grants into that session's memory. EPERM: not a proof.

struct QpCaps {
  uint32_t max_send_wr;
  uint32_t max_recv_wr;
  uint32_t max_send_sge;
  uint32_t max_recv_sge;
  uint32_t max_inline_data;
  uint32_t reserved;
};
static_assert(sizeof(QpCaps) == 24);

// ---- kCreateQp: response carries the ring memfd (SQ ring, then RQ ring at rq_offset).
struct CreateQpReq {
  uint32_t pd;
  uint32_t send_cq;
  uint32_t recv_cq;
  uint32_t srq;     ///< kNone
  uint8_t qp_type;  ///< IBV_QPT_*
  uint8_t sq_sig_all;
  uint16_t reserved;
  uint32_t xrcd;  ///< IBV_QPT_XRC_RECV: the XRC domain's handle (pd, CQs, srq unused); else 0
  QpCaps caps;
};
static_assert(sizeof(CreateQpReq) == 48);
struct CreateQpResp {
  uint32_t handle;
  uint32_t qpn;
  QpCaps caps;
  uint64_t ring_bytes;
  uint64_t rq_offset;
};
static_assert(sizeof(CreateQpResp) == 48);

/// Fixed-width image of ibv_qp_attr (the fields vrdma uses). Byte fields as in the verbs enums.
struct QpAttr {
  uint32_t qp_state;
  uint32_t cur_qp_state;
  uint32_t path_mtu;
  uint32_t qp_access_flags;
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  uint16_t pkey_index;
  uint8_t port_num;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t sq_draining;
  uint8_t en_sqd_async_notify;
  uint8_t is_global;  ///< ah: GRH present
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t ah_port_num;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
  uint8_t reserved;
  uint32_t flow_label;
  uint8_t dgid[16];
};
static_assert(sizeof(QpAttr) == 76);

struct ModifyQpReq {
  uint32_t handle;
  uint32_t mask;  ///< IBV_QP_* bits
  QpAttr attr;
};
static_assert(sizeof(ModifyQpReq) == 84);

struct QueryQpResp {
  QpAttr attr;
  uint32_t reserved;
  QpCaps caps;
};
static_assert(sizeof(QueryQpResp) == 104);

// ---- SRQs. kCreateSrq's response carries the ring memfd (one RQ ring).
struct SrqAttr {
  uint32_t max_wr;
  uint32_t max_sge;
  uint32_t srq_limit;
  uint32_t reserved;
};
static_assert(sizeof(SrqAttr) == 16);
struct CreateSrqReq {
  uint32_t pd;
  uint32_t reserved;
  SrqAttr attr;
};
static_assert(sizeof(CreateSrqReq) == 24);
struct CreateSrqResp {
  uint32_t handle;
  uint32_t srq_num;  ///< kCreateXrcSrq: the number requests name it by; else 0
  SrqAttr attr;  ///< what the ring really holds
  uint64_t ring_bytes;
};
static_assert(sizeof(CreateSrqResp) == 32);
/// kOpenXrcd: ibv_xrcd_init_attr's oflags (O_CREAT, O_EXCL); the file's fd rides along.
struct OpenXrcdReq {
  uint32_t oflags;
  uint32_t reserved;
};
static_assert(sizeof(OpenXrcdReq) == 8);
/// kCreateXrcSrq: ibv_create_srq_ex with IBV_SRQT_XRC: its PD (the buffers'), domain and CQ.
struct CreateXrcSrqReq {
  uint32_t pd;
  uint32_t xrcd;
  uint32_t cq;
  uint32_t reserved;
  SrqAttr attr;
};
static_assert(sizeof(CreateXrcSrqReq) == 32);
/// kOpenQp: ibv_open_qp of receive QP `qpn` of domain `xrcd` (IBV_QPT_XRC_RECV only).
struct OpenQpReq {
  uint32_t xrcd;
  uint32_t qpn;
  uint32_t qp_type;
  uint32_t reserved;
};
static_assert(sizeof(OpenQpReq) == 16);
struct ModifySrqReq {
  uint32_t handle;
  uint32_t mask;  ///< IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT
  SrqAttr attr;
};
static_assert(sizeof(ModifySrqReq) == 24);

// ---- kMigrate: move guest `guest`'s device to the backend listening on `target` (a socket
// path on this machine). The response says how long its QPs could not make progress.
inline constexpr size_t kSocketPathMax = 108;
struct MigrateReq {
  char guest[kGuestNameMax];
  char target[kSocketPathMax];
  uint32_t flags;
  uint32_t reserved;
};
static_assert(sizeof(MigrateReq) == 180);
struct MigrateResp {
  /// The guest frozen: from here until the target served it (its import done, ImportResp's
  /// served_mono_us; until its answer came here when that time is not on our clock).
  uint64_t downtime_us;
  uint64_t export_us, transfer_us, import_us;
  uint64_t bytes;  ///< state blob
  uint32_t qps, fds;
  uint64_t answered_us;  ///< from the freeze until the target's answer was read here
};
static_assert(sizeof(MigrateResp) == 56);

// ---- kImportBegin / kImportData... / kImportCommit: a backend hands a guest's state to another.
// Data messages carry pieces of the blob (up to kMaxImportChunk bytes) and of its descriptor list
// (up to kMaxFdsPerMessage each), in order.
inline constexpr size_t kMaxImportChunk = 60000;
inline constexpr size_t kMaxImportBytes = 64u << 20;
inline constexpr uint32_t kMaxImportFds = 65536;
inline constexpr uint32_t kImportRecover = 1;  ///< the kept state of a backend that died
/// To the keeper only: the record is the guest's RDMA CM state alone (kImportCm pieces, no blob
/// or descriptors), which replaces the CM part of what it keeps for the guest.
inline constexpr uint32_t kKeepCmOnly = 2;
struct ImportBeginReq {
  char guest[kGuestNameMax];
  uint64_t bytes;
  uint32_t fds;
  uint32_t flags;  ///< kImportRecover, kKeepCmOnly
};
static_assert(sizeof(ImportBeginReq) == 80);
struct ImportResp {
  uint64_t import_us;
  uint32_t qps;
  uint32_t sessions;
  /// The target's CLOCK_MONOTONIC (µs) when it began to serve the guest (a move ends there).
  uint64_t served_mono_us;
};
static_assert(sizeof(ImportResp) == 24);

// ---- kKeepDrop: the keeper forgets a guest (it left, or moved to another backend).
struct KeepDropReq {
  char guest[kGuestNameMax];
};
static_assert(sizeof(KeepDropReq) == 64);

// ---- kSnapshot: the guest's device state written to the file whose descriptor comes with it.
struct SnapshotReq {
  char guest[kGuestNameMax];
};
static_assert(sizeof(SnapshotReq) == 64);
struct SnapshotResp {
  uint64_t bytes;
  uint64_t pause_us;  ///< the guest's QPs were held this long
  uint32_t qps;
  uint32_t reserved;
};
static_assert(sizeof(SnapshotResp) == 24);

// ---- kRestore: the file (its descriptor comes with the request) holds a snapshot of a guest
// this backend serves; its device state is put back (cursors and PSNs stay the rings').
struct RestoreReq {
  uint32_t flags;
  uint32_t reserved;
};
static_assert(sizeof(RestoreReq) == 8);

// ---- The reason of a refused operator command (kMigrate, kSnapshot, kRestore, kImportCommit):
// an error answer (status < 0) may carry it as its body, up to kMaxReason bytes of text, no
// NUL. No version change: an error answer had no body before and every client read none, so an
// older client ignores the text and a newer one, answered by an older backend, finds none and
// falls back to strerror(-status).
inline constexpr size_t kMaxReason = 1024;
/// An error answer to `op` with `reason` as its body (cut to kMaxReason bytes) and answer
/// `flags` (kAnswer*).
std::vector<uint8_t> encode_error(Op op, uint32_t seq, int err, std::string_view reason,
                                  uint32_t flags = 0);
/// The reason an error answer carries (its header validated), with anything but printable
/// ASCII replaced by '?'; "" when it has none.
std::string reason_of(std::span<const uint8_t> msg);

// ---- kStatus: response body is a u32 length followed by that many bytes of JSON.
struct StatusReq {
  uint32_t flags;
  uint32_t reserved;
};
static_assert(sizeof(StatusReq) == 8);

/// kAttachMcast / kDetachMcast: QP `qp` joins or leaves the group of `gid` (a multicast GID,
/// ff00::/8) and `lid`.
struct McastReq {
  uint32_t qp;
  uint16_t lid;
  uint16_t reserved;
  uint8_t gid[16];
};
static_assert(sizeof(McastReq) == 24);

/// Body type per opcode, for the length check; kVariableBody: up to kMaxImportChunk bytes.
inline constexpr size_t kVariableBody = SIZE_MAX - 1;
size_t request_body_size(Op op);
/// Largest message the backend takes on a connection that began an import.
inline constexpr size_t kMaxImportMessage = kMaxImportChunk + 64;

/// Serialises header + body into a byte vector.
template <typename Body>
std::vector<uint8_t> encode(Op op, uint32_t seq, int32_t status, const Body& body) {
  static_assert(std::is_trivially_copyable_v<Body>);
  constexpr size_t body_size = std::is_empty_v<Body> ? 0 : sizeof(Body);
  std::vector<uint8_t> out(sizeof(MsgHeader) + body_size);
  MsgHeader h{kMagic, kVersion, static_cast<uint16_t>(op),
              static_cast<uint32_t>(out.size()), seq, status, 0};
  std::memcpy(out.data(), &h, sizeof(h));
  if constexpr (body_size) { std::memcpy(out.data() + sizeof(h), &body, body_size);
}
  return out;
}

/// Validates a received message's header: magic, version, opcode range, declared length equal to
/// the received length. Does not look at the body.
Result<MsgHeader> decode_header(std::span<const uint8_t> msg);

/// Validates a request: header as above plus the exact body size for its opcode.
Result<MsgHeader> decode_request(std::span<const uint8_t> msg);

/// Copies the body out of a message whose header was validated; EPROTO if the size differs.
template <typename Body>
Result<Body> body_of(std::span<const uint8_t> msg) {
  static_assert(std::is_trivially_copyable_v<Body>);
  if (msg.size() != sizeof(MsgHeader) + sizeof(Body)) {
    return error(EPROTO, "body size mismatch");
}
  Body b;
  std::memcpy(&b, msg.data() + sizeof(MsgHeader), sizeof(Body));
  return b;
}

}  // namespace vrdma::proto

// The RDMA connection manager's bodies, in a header of their own.
#include "proto/command_cm.h"  // IWYU pragma: export
