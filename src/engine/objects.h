// The resources the device model holds: segments, PDs, MRs, windows, device memory, channels,
// CQs, SRQs, QPs, guests and sessions, and the records the engine passes around (exports,
// responses). engine::Device (device.h) owns them; its engine thread alone touches them.
#pragma once


#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/log.h"
#include "common/socket.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "engine/direct_trust.h"
#include "engine/quotas.h"
#include "proto/command.h"
#include "proto/responder_rules.h"
#include "proto/ring.h"
#include "transport/transport.h"

namespace vrdma::engine {

struct Session;
struct Guest;

/// A guest memfd mapped into the backend.
struct Segment {
  MappedRegion map;
  UniqueFd fd;  ///< kept so the device's state can move to another backend (device_state_*.cc)
};

struct Pd {
  uint32_t handle = 0;
  uint32_t users = 0;  ///< MRs and QPs that name this PD
};

struct MrChunk {
  uint64_t mr_offset;
  uint64_t length;
  uint8_t* base;  ///< backend address of mr_offset
};

struct Mr {
  uint32_t handle = 0;
  uint32_t key = 0;  ///< lkey == rkey
  uint32_t pd = 0;
  const Session* owner = nullptr;  ///< PD handles are per session: (owner, pd) names the PD
  uint32_t access = 0;
  uint64_t addr = 0;
  uint64_t iova = 0;
  uint64_t length = 0;
  std::vector<MrChunk> chunks;  ///< by mr_offset; an ODP MR's may leave gaps (not yet faulted in)
  std::vector<std::shared_ptr<Segment>> segments;  ///< keeps the mappings alive (one per chunk)
  bool odp = false;  ///< IBV_ACCESS_ON_DEMAND: chunks grow as the library faults pages in
};

/// A memory window (ibv_alloc_mw): an rkey that reaches part of an MR while bound. Binds and
/// invalidations come through a QP's send queue (execute_mw_op); the responder finds windows by
/// the index in an rkey's upper 24 bits (Guest::mws) and checks them with proto::window_view.
struct Mw {
  uint32_t handle = 0;
  uint32_t pd = 0;
  uint32_t type = IBV_MW_TYPE_1;
  uint32_t rkey = 0;  ///< index << 8 | the key of the latest bind
  const Session* owner = nullptr;
  bool bound = false;
  uint32_t mr = 0;                ///< the MR's handle, while bound (dereg_mr is EBUSY meanwhile)
  uint32_t qpn = 0;               ///< type 2: the QP it was bound through
  uint32_t access = 0;            ///< IBV_ACCESS_REMOTE_* of the bind
  uint64_t addr = 0, length = 0;  ///< in the MR's iova space
};

/// Device memory (ibv_alloc_dm): a segment of the session that the backend made (a memfd both
/// sides map), which only free_dm releases; MRs over it are zero-based (reg_dm_mr).
struct Dm {
  uint32_t handle = 0;
  uint32_t segment = 0;  ///< its handle in Session::segments
  uint64_t length = 0;   ///< what the guest asked for (the segment is whole pages)
};

struct Channel {
  uint32_t handle = 0;
  UniqueFd write_end;  ///< non-blocking; receives 4-byte CQ handles
  uint32_t users = 0;
};

struct Cq {
  uint32_t handle = 0;
  Session* owner = nullptr;
  MappedRegion ring;
  UniqueFd ring_fd;
  proto::RingHeader* hdr = nullptr;
  proto::Cqe* entries = nullptr;
  uint32_t size = 0;  ///< entries in the ring (power of two), backend's private copy
  uint32_t prod = 0;  ///< backend's private producer cursor
  uint32_t stamps = 0;               ///< proto::kStamp* it was created with (private copy)
  proto::CqeStamp* stamp = nullptr;  ///< one per entry, after them; null without stamps
  uint32_t channel = proto::kNone;
  uint32_t users = 0;
  bool overrun = false;
  /// A QP's own completion ring (direct path): the peer's library produces into it too, so
  /// `prod` is re-read from the header before each completion (never trusted: see push_cqe).
  bool shared_producer = false;

  /// Points hdr, entries and stamp into `ring` (mapped, `size` entries, `stamps` set).
  void attach() {
    hdr = reinterpret_cast<proto::RingHeader*>(ring.data());
    entries = proto::ring_entries<proto::Cqe>(hdr);
    stamp = stamps ? proto::cq_stamps(hdr, size) : nullptr;
  }
};

/// An XRC domain (ibv_open_xrcd): the guest's, named by the inode of the file its sessions
/// opened it with (none: private to the one open). Its XRC SRQs and receive QPs name it by `id`.
/// Lives while a session holds it open or anything is in it (device_xrc.cc).
struct Xrcd {
  uint32_t id = 0;
  bool has_inode = false;
  uint64_t dev = 0, ino = 0;
  uint32_t opens = 0;  ///< handles open on it, over the guest's sessions
  uint32_t users = 0;  ///< XRC SRQs and receive QPs in it
};

/// A shared receive queue: one ring of receive WQEs that several QPs of a session draw from.
/// An XRC SRQ (`xrcd` set) is drawn from by the domain's receive QPs, whichever session made
/// them, for the requests that name its `srqn`; it completes on its own `cq`.
struct Srq {
  uint32_t handle = 0;
  Session* owner = nullptr;
  uint32_t pd = 0;
  MappedRegion ring;
  UniqueFd ring_fd;
  proto::RingHeader* hdr = nullptr;
  proto::RecvWqe* entries = nullptr;
  uint32_t size = 0;   ///< private geometry
  uint32_t cons = 0;   ///< private cursor
  uint32_t max_sge = 0;
  uint32_t limit = 0;  ///< armed SRQ limit; 0: not armed
  uint32_t users = 0;  ///< QPs attached
  uint32_t xrcd = 0;   ///< XRC: the domain's id (0: a basic SRQ)
  uint32_t srqn = 0;   ///< XRC: its number in the guest (Guest::xrc_srqs)
  struct Cq* cq = nullptr;  ///< XRC: where its receives complete
  /// Direct path: a library may take receives from it (a grant into a QP on it); from then on
  /// every consumer holds its header's rx_lock and resumes at the shared consumer index. For
  /// the SRQ's life (a backend that takes the guest in reads it from the header's `armed`).
  bool direct = false;
  /// The backend's last try for its rx_lock found it held by a live session (Qp::rx_busy).
  bool rx_busy = false;
};

/// A run of bytes in backend memory that one SGE (or inline data) resolved to.
using Span = transport::Span;

/// Why a WQE could not finish yet.
enum class Step { kDone, kWait };

/// What the WQE at the head of a send queue is waiting for.
enum class Wait : uint8_t {
  kNone,
  kRnr,  ///< receiver had no receive posted (RNR NAK); counts down rnr_left
  kAck,  ///< no responder answered (ACK timeout); counts down retry_left
};

/// What a QP did: read by `vrdma stat`, `vrdma res show` and the metrics endpoint.
struct QpCounters {
  uint64_t msgs_sent = 0, bytes_sent = 0, msgs_received = 0, bytes_received = 0;
  uint64_t retries = 0;     ///< requester: transport retries after an ACK timeout
  uint64_t rnr_naks = 0;    ///< requester: RNR NAKs received (each one a retry after the timer)
  uint64_t ud_dropped = 0;  ///< UD datagrams that found no receive, a wrong qkey or no QP
  uint64_t wc_errors[IBV_WC_TM_RNDV_INCOMPLETE + 1] = {};  ///< error completions, by ibv_wc_status
  // Across backends (device state version 3; zero in a version 2 blob).
  uint64_t replays = 0;         ///< requester: messages sent again (reconnect, timeout, NAK)
  uint64_t replayed_bytes = 0;  ///< ... and their bytes
  uint64_t seq_naks = 0;        ///< requester: sequence-error NAKs received
  uint64_t naks_sent = 0;       ///< responder: NAKs sent (RNR, sequence error, fault)
  uint64_t held = 0;  ///< requester: times new work waited for its queued frames to go out

  QpCounters& operator+=(const QpCounters& o);
};

/// Counters as JSON: totals, and `wc_errors` by status name ("LOC_LEN_ERR"; non-zero ones only).
nlohmann::json counters_json(const QpCounters& c);
/// "RC", "UC", "UD", "XRC_SEND", "XRC_RECV" (reports).
const char* qp_type_name(ibv_qp_type t);
/// /proc/PID/comm of a guest process; "" when it cannot be read.
std::string read_comm(uint32_t pid);

struct Qp {
  uint32_t handle = 0;
  uint32_t qpn = 0;
  Session* owner = nullptr;
  Guest* guest = nullptr;
  ibv_qp_type type = IBV_QPT_RC;
  ibv_qp_state state = IBV_QPS_RESET;
  uint32_t pd = 0;
  Cq* send_cq = nullptr;
  Cq* recv_cq = nullptr;
  Srq* srq = nullptr;  ///< receives come from here instead of the QP's RQ
  /// XRC_RECV: its domain's id, and how many handles (sessions' creations and ibv_open_qp)
  /// hold it. `srq` and `recv_cq` are then those of the SRQ the request being answered named
  /// (bind_xrc_srq); it has no PD, no send CQ and is never polled (Guest::xrc_qps owns it).
  uint32_t xrcd = 0;
  uint32_t opens = 0;
  bool sq_sig_all = false;
  proto::QpCaps caps{};
  proto::QpAttr attr{};
  MappedRegion ring;
  UniqueFd ring_fd;
  proto::RingHeader* sq_hdr = nullptr;
  proto::RingHeader* rq_hdr = nullptr;
  proto::SendWqe* sq = nullptr;
  proto::RecvWqe* rq = nullptr;
  uint32_t sq_size = 0, rq_size = 0;  ///< private geometry
  uint32_t sq_cons = 0, rq_cons = 0;  ///< private cursors
  // Retry state of the WQE at the head of the SQ. A counter is (re)loaded from the QP's
  // attributes whenever the reason for waiting changes.
  Wait wait = Wait::kNone;
  uint32_t rnr_left = 0;
  uint32_t retry_left = 0;
  uint64_t wait_until_ns = 0;
  QpCounters cnt;
  // How the QP's messages travel, chosen when it is connected (RTR): "shm" (the peer QP is on
  // this backend) or "tcp" (on a peer backend, `peer_node`), and why.
  std::string transport = "shm";
  std::string transport_why = "not connected yet";
  std::string peer_node;
  bool remote = false;         ///< transport == "tcp"
  bool ready = false;          ///< in its guest's `ready` list (Device::mark_ready)
  bool route_pending = false;  ///< the destination was unknown at RTR; looked up again on send
  // Requester over tcp (RC): WQEs sent and not yet acknowledged, oldest first, as private copies.
  // SQ slots [sq_cons, sq_sent) are in flight; complete_send retires them strictly in order.
  struct Outstanding {
    proto::SendWqe w;
    uint32_t psn;
    uint32_t len;
    bool has_result = false;  ///< READ data / atomic result arrived
    transport::TxMark mark;   ///< where its last send ends in the connection's stream
  };
  std::deque<Outstanding> unacked;
  uint32_t sq_sent = 0;
  uint32_t next_psn = 0;  ///< requester: PSN of the next new message
  uint64_t ack_deadline_ns = 0;
  /// The connection's progress (Transport::tx_progress) when the ACK timer last looked.
  uint64_t ack_progress = 0;
  uint64_t ack_moved_ns = 0;  ///< when the ACK timer last saw the connection move
  bool ack_looked = false;    ///< ack_progress and ack_moved_ns are set (this wait)
  bool ack_deferred = false;  ///< this timeout waited once for input not yet read
  /// When the ACK timer first found the head delivered to the peer's TCP on the live connection
  /// and unanswered (0: not so this wait): from then a slow peer backend is waited for
  /// kSlowPeerNs before the timeouts spend retries. Also set while the head waits on a
  /// connection no peer backend has taken yet (Transport::peer_not_taken), for the log.
  uint64_t peer_has_since_ns = 0;
  transport::TxMark path_probe;  ///< where that wait's kPing ends in the stream (conn 0: none)
  /// Names its frames in the transport's queue (Transport::send's flow), so that they can be
  /// taken back when it fails or goes; unique in this backend's life.
  uint64_t flow = 0;
  transport::TxMark tx_last;  ///< where its last frame ends in the connection's stream
  /// After an RNR wait only the head message went again; its ACK sends the rest, and nothing
  /// new goes before it.
  bool probe = false;
  bool held = false;          ///< new work waits for its queued frames (counted once a wait)
  /// The responder QP was not ready (RESET/INIT) for the head message since then: that waits
  /// at most the transport retry budget, and spends no RNR retry.
  uint64_t not_ready_since_ns = 0;
  /// Its peer moved: what is in flight goes to the new node on the next poll (not inside the
  /// import, which would hold every migrating guest frozen for it).
  bool replay_now = false;
  // Responder over tcp (RC): the next PSN it executes; earlier ones are duplicates.
  uint32_t expected_psn = 0;
  bool seq_nak_sent = false;  ///< a gap was NAKed: once, until expected_psn arrives
  /// keep_state: a restart found that the dead backend delivered the same-host message at
  /// this SQ index of the requester and died before retiring it (RingHeader::commit_sq): when
  /// the requester sends it again it completes, undelivered. Until the requester's next message.
  bool replay_known = false;
  uint32_t replay_sq = 0;
  /// UD (kCommitUd): the record names its sender too, one of many.
  bool replay_ud = false;
  uint32_t replay_qpn = 0;
  /// Recent atomic results by PSN, so a replayed atomic is answered, not executed twice.
  /// A used slot's PSN carries kAtomicCacheValid (PSNs are 24-bit).
  static constexpr uint32_t kAtomicCacheValid = 1u << 31;
  std::array<std::pair<uint32_t, uint64_t>, 16> atomic_cache{};
  uint32_t atomic_cache_next = 0;
  // Direct path (device_direct.cc): once granted, the QP's send completions (own_send) and
  // receive completions (own_recv) go to rings of its own, which its CQs' pollers also read,
  // whoever executes the work; `direct` says a grant is in force (for reports).
  std::unique_ptr<Cq> own_send, own_recv;
  bool direct = false;
  /// Across backends (kDirectRemote): its library sends over TCP straight to its peer's library,
  /// and the backend executes nothing of its send queue any more (until RESET).
  bool direct_remote = false;
  /// Its library offered a direct connection across backends (kDirectOffer), until RESET or
  /// until it went back to the backends.
  bool offered = false;
  /// That offer, as sent (the peer backend's copy is resent when the peer moves: reroute): the
  /// port and token, and the address the library listens on (this host's toward the peer).
  uint16_t offer_port = 0;
  uint32_t offer_ipv4 = 0;  ///< network order
  uint8_t offer_token[proto::kDirectTokenBytes] = {};
  /// The token of the peer's offer its last kDirectRemote handed out: that offer ends when the
  /// QP goes back to the backends; a newer one (the peer's library offered again) stays.
  uint8_t used_offer_token[proto::kDirectTokenBytes] = {};
  /// UD: the last try for its receive side's rx_lock found it held by a live session; the next
  /// tries once only (a guest that holds its own lock must not cost the engine a spin per
  /// datagram sent to it).
  bool rx_busy = false;
  /// Requester: since when the responder's SRQ has been held by a library at each try (0: it
  /// was not at the last): a moment costs no RNR retry, a long hold counts as an RNR NAK
  /// (Device::srq_busy). While set, the head WQE waits for `wait_until_ns` as in a `wait`.
  uint64_t rx_busy_since_ns = 0;
};

/// Where a QP's completions go: its own ring once it has one (direct path), else its CQ.
inline Cq& send_ring(Qp& qp) { return qp.own_send ? *qp.own_send : *qp.send_cq; }
inline Cq& recv_ring(Qp& qp) { return qp.own_recv ? *qp.own_recv : *qp.recv_cq; }
/// The QP's counters: what the backend moved, plus what libraries moved on the direct path
/// (counted in the headers of its own rings).
QpCounters counters_of(const Qp& qp);

/// A peer backend's library offered QP `src_qpn` of its guest (`slid`/`sgid`) a direct TCP
/// connection for a QP of ours (the wire's DirectOffer, kept until that QP is reset or goes).
struct RemoteOffer {
  std::string node;  ///< the peer backend it came from
  uint16_t slid = 0;
  uint8_t sgid[16] = {};
  uint32_t src_qpn = 0;
  uint16_t port = 0;   ///< host order
  uint32_t ipv4 = 0;   ///< network order: the peer backend's address on that connection
  uint8_t token[proto::kDirectTokenBytes] = {};
};

/// An unknown uid (a session or guest whose owner is not known: only admins may join it).
inline constexpr uint32_t kNoUid = UINT32_MAX;
/// Distinct uids per guest whose refused hello is logged at warn level; later ones at debug.
inline constexpr size_t kMaxRefusalsLogged = 16;

/// What a guest holds, counted against its Quotas (one counter per quota).
enum class Res : uint8_t {
  kPd,
  kQp,
  kCq,
  kSrq,
  kMr,
  kMrBytes,
  kSegment,
  kSegmentBytes,
  kDmBytes,
  kMw,
  kCount
};

struct Guest {
  std::string name;
  /// The uid whose process created it (SO_PEERCRED). Only that uid and the admins may open
  /// sessions in it, and only they see it in status (backend/report.h, visible_status).
  uint32_t owner_uid = kNoUid;
  /// Uids already refused a session here and logged once (bounded: kMaxRefusalsLogged).
  std::vector<uint32_t> refused_logged;
  uint64_t id = 0;
  uint64_t port_guid = 0;
  uint8_t gid[16] = {};
  uint16_t lid = 0;
  uint32_t sessions = 0;
  uint32_t next_qpn = 0x11;
  uint32_t next_key_index = 1;
  std::unordered_map<uint32_t, Qp*> qps;  ///< by QPN
  std::unordered_map<uint32_t, Mr*> mrs;  ///< by key
  std::unordered_map<uint32_t, Mw*> mws;  ///< by index (rkey >> 8)
  // XRC (device_xrc.cc): domains by id, XRC SRQs by number, receive QPs (owned here: any
  // session of the domain may hold them) by QPN.
  std::map<uint32_t, std::unique_ptr<Xrcd>> xrcds;
  std::unordered_map<uint32_t, Srq*> xrc_srqs;
  std::map<uint32_t, std::unique_ptr<Qp>> xrc_qps;
  uint32_t next_xrcd = 1;
  uint32_t next_srqn = 1;
  QpCounters retired;  ///< counters of its destroyed QPs, so per-guest sums never go down
  uint64_t used[static_cast<size_t>(Res::kCount)] = {};  ///< summed over its sessions
  uint32_t quota_logged = 0;  ///< bit per Res (+ kCount: depth): the hit was logged already
  bool refused_fs_logged = false;  ///< a segment on another filesystem (hugetlbfs) was logged
  /// Refused verbs (Device::refused): a burst of lines, then one a second.
  log::Burst refusals{1'000'000'000, 20};
  std::vector<Qp*> active;  ///< its QPs, in creation order (the state export's order)
  /// Its QPs that may have work: what poll() visits (Device::mark_ready, has_work).
  std::vector<Qp*> ready;
  size_t turn = 0;  ///< the QP of `ready` poll() visits first next time
  /// proto::EpochPage, made at its first direct grant (device_direct.cc).
  MappedRegion epoch;
  UniqueFd epoch_fd;
  /// Direct offers from peer backends, by the QPN of ours they are for (device_direct.cc).
  std::unordered_map<uint32_t, RemoteOffer> direct_offers;
  /// Leaving the direct path across backends before a move (leave_direct_remote answered
  /// EINPROGRESS): no offer and no kDirectRemote until then (CLOCK_MONOTONIC ns; 0: none), so
  /// that a QP that went back does not go direct again before the export. Each ask renews it;
  /// the ask that finds every QP settled ends it (the export follows in the same turn).
  uint64_t direct_held_until_ns = 0;
};

struct Session {
  uint32_t id = 0;
  uint32_t pid = 0;       ///< SO_PEERCRED at hello (the pid a guest claims is ignored)
  uint32_t uid = kNoUid;  ///< SO_PEERCRED at hello; direct grants need equal ones
  std::string comm;  ///< process name at hello, for `vrdma res show`
  Guest* guest = nullptr;
  MappedRegion control;  ///< proto::ControlPage
  /// ODP faults asked of the library's pager (proto::ControlPage's mailbox): the last request's
  /// number (our own copy: the guest can write the page's) and what it named.
  uint32_t odp_req = 0;
  uint32_t odp_mr = 0;
  uint64_t odp_addr = 0, odp_len = 0;
  UniqueFd odp_wake;  ///< kReregOdpPager: a byte sent here after each request wakes the pager
  UniqueFd control_fd, doorbell, async_write, async_read;
  uint32_t next_handle = 1;
  std::map<uint32_t, Pd> pds;
  std::map<uint32_t, std::shared_ptr<Segment>> segments;
  std::map<uint32_t, std::unique_ptr<Mr>> mrs;
  std::map<uint32_t, Channel> channels;
  std::map<uint32_t, std::unique_ptr<Cq>> cqs;
  std::map<uint32_t, std::unique_ptr<Qp>> qps;
  /// Its QPs by ready-bit slot (handle % proto::kReadySlots): whom a bit names (harvest_ready).
  std::unordered_multimap<uint32_t, Qp*> qp_slots;
  std::map<uint32_t, std::unique_ptr<Srq>> srqs;
  std::map<uint32_t, Dm> dms;
  std::map<uint32_t, std::unique_ptr<Mw>> mws;
  std::map<uint32_t, uint32_t> xrcds;    ///< XRC: handle -> the guest's domain id (one per open)
  std::map<uint32_t, uint32_t> xrc_qps;  ///< XRC: handle -> QPN of a receive QP it holds
  /// The direct path's trust (device_direct.cc): where this process keeps its proof cookie
  /// (kDirectCookie), and the sessions whose memory it proved it may write (kDirectProve).
  uint64_t cookie_addr = 0;
  std::array<uint8_t, proto::kDirectCookieBytes> cookie{};
  std::vector<uint32_t> may_write;
  struct Proving {    ///< a proof still being read
    uint32_t peer;    ///< the session it is about
    std::string who;  ///< "pid P (guest G)", for the log
    MemProof proof;
  };
  std::vector<Proving> proving;
  /// The rx_lock tags (Device::rx_lock_tag) its library was given by the backends it came from
  /// (keep_state, a move): until it asks for a grant again it takes locks with one of those, and
  /// a lock held with one is a live holder's, not an orphan (Device::rx_lock_try). 0: none.
  std::array<uint32_t, 2> kept_rx_tags{};

  proto::ControlPage* control_page() const {
    return reinterpret_cast<proto::ControlPage*>(control.data());
  }
};

/// Fds a command's response carries back to the guest (the backend keeps its own copies).
using FdList = std::vector<int>;

/// A guest's whole device state as a versioned blob (device_state_export.cc) and the descriptors it
/// names by index (borrowed from the device: valid until the device changes).
struct GuestExport {
  std::vector<uint8_t> blob;
  std::vector<int> fds;
  size_t qps = 0;
};

/// The guest a state blob is of, and what its descriptors are ("NAME\n[keys]"): two blobs with
/// the same layout name the same resources, so one's descriptors serve the other.
Result<std::string> state_fd_layout(std::span<const uint8_t> blob);
/// A snapshot (`file`) restored onto the guest whose state is `now` (same layout): the file's
/// state with the QPs' own completion rings of `now` (direct path). Those rings are memory the
/// guest's library reads as it does its CQs' rings, and a grant made after the snapshot made
/// them: they stay the guest's, their cursors their own.
Result<std::vector<uint8_t>> with_own_rings_of(std::span<const uint8_t> file,
                                               std::span<const uint8_t> now);

/// A session an import created, with the guest connection's socket (index given at export).
struct ImportedSession {
  Session* session;
  UniqueFd sock;
};

/// What a responder is asked to do: a message from a requester QP, local or from the wire.
struct Inbound {
  uint32_t op = 0, send_flags = 0, imm_data = 0, rkey = 0;
  uint64_t remote_addr = 0, compare_add = 0, swap = 0, len = 0;
  uint32_t src_qpn = 0;
  uint16_t slid = 0;
  ibv_qp_type type = IBV_QPT_RC;
  uint32_t xrc_srqn = 0;  ///< XRC_SEND: the SRQ of the target's domain it is for
};

/// The session and PD whose MRs a QP's responder reaches: an XRC receive QP has none of its
/// own and uses those of the SRQ the request named (IB spec: the XRC SRQ's PD).
inline const Session* mem_session(const Qp& q) {
  return q.type == IBV_QPT_XRC_RECV && q.srq ? q.srq->owner : q.owner;
}
inline uint32_t mem_pd(const Qp& q) {
  return q.type == IBV_QPT_XRC_RECV && q.srq ? q.srq->pd : q.pd;
}

/// The responder's verdict on an Inbound before any byte moves.
struct Response {
  enum Kind : uint8_t {
    kOk,     ///< accepted: data goes to dst_ (SEND/WRITE) or comes from src_ (READ)
    kRnr,    ///< no receive posted: RNR NAK
    kError,  ///< NAK with `status` for the requester (the responder side is already handled)
    kDrop,   ///< no answer at all (the responder's ring is corrupt): the requester times out
  } kind = kOk;
  ibv_wc_status status = IBV_WC_SUCCESS;
  const char* why = "";
  const Mr* mr = nullptr;   ///< WRITE/READ/atomic: the responder's MR (a window's MR)
  proto::RecvWqe recv{};    ///< the receive WQE it lands in (SEND, WRITE_WITH_IMM)
  uint64_t atomic_old = 0;  ///< atomics: the value before
};

}  // namespace vrdma::engine
