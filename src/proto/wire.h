// The backend-to-backend wire format (TCP transport): a stream of frames, each a fixed 16-byte
// header, a fixed-size body per frame type, then `payload` bytes (message data) for the types
// that carry data. Fixed-width little-endian fields, no pointers, sizes static_asserted.
// Versioned: kWireVersion changes when any body or value set changes; type values are never
// reused. History: 1 first; 2 kDirectOffer; 3 Syndrome::kSeqNak and kRnrNak's kRnrNotReady;
// 4 kCm (the RDMA connection service's messages between backends); 5 CmKind::kAddrQuery and
// kAddrReply (address resolution across backends, IPv6); 6 CmKind::kMoved (live migration);
// 7 kClose (an idle connection closed by agreement); 8 XRC requests (qp_type
// IBV_QPT_XRC_SEND, Request::xrc_srqn).
// decode() validates every length and field before anything is used: it faces the network.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "proto/command.h"

namespace vrdma::proto::wire {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

inline constexpr uint32_t kWireMagic = 0x57445256;  // "VRDW"
inline constexpr uint16_t kWireVersion = 8;
inline constexpr uint32_t kMaxPayload = 1u << 31;  ///< the device's max_msg_sz
inline constexpr uint32_t kMaxUdPayload = 4096;    ///< the port MTU
inline constexpr size_t kNameMax = 64;             ///< node and guest names, NUL-padded

enum class Type : uint16_t {
  kHello = 1,        ///< first frame each way: wire version and node name
  kGuestUp = 2,      ///< a guest of the sender's backend exists (directory)
  kGuestDown = 3,    ///< a guest of the sender's backend left
  kRequest = 4,      ///< a requester's message (RC/UC/UD); SEND/WRITE/UD carry the payload
  kReply = 5,        ///< the responder's answer: ACK, NAK, READ data, atomic result
  kDirectOffer = 6,  ///< a library takes a direct connection (kDirectOffer command); version 2
  kCm = 7,           ///< an RDMA CM message between two backends' ids (backend/cm.h); version 4
  /// Nothing for the receiver: the sender learns from its own TCP that the path delivers (the
  /// ACK timer's probe of a peer that has a request and does not answer); version 4
  kPing = 8,
  kClose = 9,  ///< closing an idle connection: asked, then accepted or refused; version 7
  kMax = 10,   ///< one past the last type; never sent
};

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;     ///< Type
  uint32_t body;     ///< bytes of the fixed body that follows (exactly the type's size)
  uint32_t payload;  ///< data bytes after the body
};
static_assert(sizeof(FrameHeader) == 16);

struct Hello {
  char node[kNameMax];
  uint32_t wire_version;
  uint32_t flags;
};
static_assert(sizeof(Hello) == 72);

/// kGuestUp / kGuestDown: a directory entry.
struct GuestEntry {
  char name[kNameMax];
  uint8_t gid[16];
  uint16_t lid;
  uint16_t reserved0;
  uint32_t reserved1;
};
static_assert(sizeof(GuestEntry) == 88);

/// UD to a multicast group (dgid ff00::/8, or dlid 0xc000..0xfffe): for the receiving
/// backend's members of that group, sent on to nobody (every peer gets the sender's own copy).
/// Added within version 6, the body and its checks unchanged: a backend without it refuses
/// such a frame as one for no guest of its, and its members miss the datagram.
struct Request {
  uint8_t sgid[16];  ///< requester's guest GID
  uint8_t dgid[16];  ///< destination guest GID (valid when is_global), or a group's (UD)
  uint16_t slid;     ///< requester's guest LID
  uint16_t dlid;     ///< destination guest LID (when !is_global), or a group's (UD)
  uint8_t is_global;
  uint8_t qp_type;  ///< IBV_QPT_RC, UC, UD or XRC_SEND (version 8)
  uint8_t sl;
  uint8_t reserved0;
  uint32_t src_qpn;
  uint32_t dst_qpn;
  uint32_t psn;         ///< 24 bits; one PSN per message
  uint32_t opcode;      ///< IBV_WR_*
  uint32_t send_flags;  ///< IBV_SEND_SOLICITED is the only one the responder reads
  uint32_t imm_data;    ///< network order
  uint32_t rkey;
  uint32_t xrc_srqn;  ///< XRC_SEND: the SRQ of the target's XRC domain it is for (version 8)
  uint64_t remote_addr;
  uint64_t compare_add;
  uint64_t swap;
  uint32_t length;  ///< message bytes (READ: bytes asked for; atomics: 8)
  uint32_t qkey;    ///< UD
};
static_assert(sizeof(Request) == 104);

enum class Syndrome : uint8_t {
  kAck = 0,         ///< every PSN up to `psn` executed
  kRnrNak = 1,      ///< `psn` found no receive; retry after `rnr_timer`
  kErrNak = 2,      ///< `psn` failed at the responder with `status`; requester QP to ERR
  kReadData = 3,    ///< READ response: payload is the data; acknowledges `psn`
  kAtomicData = 4,  ///< atomic response: `atomic_orig`; acknowledges `psn`
  /// A gap: the responder expects `psn` (everything before it executed) and dropped later ones;
  /// sent once per gap. The requester sends again from `psn`.
  kSeqNak = 5,
  kMax = 6,
};

/// Reply::status of a kRnrNak: the responder QP is not ready yet (RESET/INIT, not RTR), rather
/// than out of receive WQEs.
inline constexpr uint32_t kRnrNotReady = 1;

struct Reply {
  uint8_t dgid[16];  ///< the requester's guest GID
  uint32_t dst_qpn;  ///< the requester's QPN
  uint32_t src_qpn;  ///< the responder's QPN
  uint32_t psn;
  uint8_t syndrome;   ///< Syndrome
  uint8_t rnr_timer;  ///< kRnrNak: the responder's min_rnr_timer encoding
  uint16_t reserved0;
  uint32_t status;  ///< kErrNak: the ibv_wc_status the requester completes with; kRnrNak: 0
                    ///< or kRnrNotReady
  uint32_t reserved1;
  uint64_t atomic_orig;
};
static_assert(sizeof(Reply) == 48);

/// kDirectOffer: the library of QP `src_qpn` (a guest of the sender) takes a direct TCP connection
/// from the library of QP `dst_qpn` (addressed as in a Request) on `port` of the address the
/// receiver knows the sender by, from whoever presents `token`. No payload.
struct DirectOffer {
  uint8_t sgid[16];  ///< the offering guest's GID
  uint8_t dgid[16];  ///< the destination guest's GID (valid when is_global)
  uint16_t slid;
  uint16_t dlid;  ///< when !is_global
  uint8_t is_global;
  uint8_t reserved0;
  uint16_t port;
  uint32_t src_qpn;
  uint32_t dst_qpn;
  uint8_t token[16];
};
static_assert(sizeof(DirectOffer) == 64);

/// kCm: what one backend's connection service tells another's about a connection between
/// their ids (the IB CM's REQ, REP, REJ, RTU, DREQ, SIDR), forwarded from the guests' commands.
enum class CmKind : uint8_t {
  kReq = 1,      ///< a connect to `dst`: src/qp/private data of the requester; dst_id 0
  kRep = 2,      ///< accepted: the acceptor's QP and private data
  kSidrRep = 3,  ///< a UD (SIDR) request accepted: the acceptor's QPN and qkey
  kRej = 4,      ///< rejected: `status` the reject reason, private data the consumer's
  kRtu = 5,      ///< the requester confirms the REP
  kDreq = 6,     ///< the sender disconnects
  kGone = 7,     ///< the sender's id went away (destroyed, its process ended) or timed out
  /// Whose host has address `dst`? (an address resolution, as a neighbour solicitation; sent
  /// to every peer; dst_id 0); version 5
  kAddrQuery = 8,
  kAddrReply = 9,  ///< mine: the answer to the kAddrQuery of id `dst_id`; version 5
  /// Id `src_id` moved here (live migration) from the node named in the private data: the
  /// receiver's id `dst_id`, its peer, now faces the sender; version 6
  kMoved = 10,
  kMax = 11,
};

/// No payload: every field is in the body. The receiver checks `dst_id` names one of its ids
/// whose peer is the sender's `src_id` on the sending node (a REQ names a listener by `dst`).
struct Cm {
  uint8_t kind;  ///< CmKind
  uint8_t qp_type;
  uint16_t ps;  ///< RDMA_PS_* of the requester (kReq)
  uint32_t src_id;
  uint32_t dst_id;
  int32_t status;  ///< kRej: the reject reason (kCmRej*)
  uint32_t private_len;
  uint32_t reserved0;
  CmAddr src;  ///< kReq: the requester's address and the one it connects to
  CmAddr dst;
  CmQpInfo qp;  ///< kReq/kRep/kSidrRep: the sender's QP
  uint8_t private_data[kCmPrivateMax];
};
static_assert(sizeof(Cm) == 24 + 48 + 40 + kCmPrivateMax);

/// kPing: a sequence number, for the sender's logs; the receiver reads and drops it.
struct Ping {
  uint64_t seq;
};
static_assert(sizeof(Ping) == 8);

/// kClose: one side asks to close an idle connection; the other accepts (then neither queues
/// anything more on it, each writes what it has queued, shuts its side down and reads to the
/// end: nothing in flight is lost) or refuses (a QP of its own uses the peer).
enum class CloseKind : uint8_t { kAsk = 0, kAccept = 1, kRefuse = 2 };
struct Close {
  uint8_t kind;  ///< CloseKind
  uint8_t pad[7];
};
static_assert(sizeof(Close) == 8);

/// A decoded frame: the header and a copy of its body (payload still unread).
struct Frame {
  FrameHeader h{};
  union {
    Hello hello;
    GuestEntry guest;
    Request req;
    Reply reply;
    DirectOffer offer;
    Cm cm;
    Ping ping;
    Close close;
  };
  Frame() : req{} {}
  Type type() const { return static_cast<Type>(h.type); }
};

/// The fixed body size of a type, or 0 for an unknown type.
size_t body_size(Type t);

/// Validates a header. EPROTO on anything malformed, EPROTONOSUPPORT on another version.
Status check_header(const FrameHeader& h);
/// Validates a header and its body bytes (exactly h.body of them) and fills `out`.
Status decode(const FrameHeader& h, std::span<const uint8_t> body, Frame& out);
/// Validates a kCm body (decode's check; also a sender's, before it forwards a guest's message).
Status check_cm(const Cm& m);
/// Appends header + body of `f` (with f.h.payload set by the caller) to `out`.
void encode(Type t, const void* body, uint32_t payload, std::vector<uint8_t>& out);

/// 24-bit PSN arithmetic: a - b as a signed distance.
inline int32_t psn_diff(uint32_t a, uint32_t b) { return static_cast<int32_t>((a - b) << 8) >> 8; }
inline uint32_t psn_add(uint32_t a, uint32_t n) { return (a + n) & 0xffffff; }

/// Copies a NUL-terminated name into a fixed field; false when it does not fit.
bool put_name(char (&field)[kNameMax], std::string_view name);
/// The name in a fixed field, or empty when it is not NUL-terminated printable ASCII.
std::string_view get_name(const char (&field)[kNameMax]);

}  // namespace vrdma::proto::wire
