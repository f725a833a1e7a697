// The library-to-library wire format: the direct path across backends (src/verbs/remote*.cc,
// docs/ARCHITECTURE.md "Across hosts"). The requester's library dials the responder's, both
// run TLS 1.3 with an external PSK derived from the offer's token (the token never travels),
// then a Hello/HelloAck, then a stream of fixed 64-byte frames, each followed by the data of the
// types that carry some. Fixed-width little-endian fields, sizes static_asserted.
// Versioned: kVersion changes when any struct or value set changes; frame type values are never
// reused. History: 3 = 64-byte frames (48 before); 4 = inside TLS 1.3 (external PSK), the Hello
// without the token. Within 4: kRnr's `status` carries the responder's min_rnr_timer (it was 0,
// which a requester reads as the longest wait, 655 ms), so a requester can count rnr_retry.
// 5 = kSendInv (SEND_WITH_INV) and kRevoke (the pair goes back to the backends, before a move of
// either guest): a library of 4 would take either for a broken peer, so the two do not connect.
// check_*() validate every field before anything is used: the other end is another tenant's
// process (what it may touch of ours is then checked against our MRs by the responder).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace vrdma::proto::dwire {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

inline constexpr uint32_t kDirectMagic = 0x44524456;  // "VDRD"
inline constexpr uint32_t kDirectVersion = 5;

/// The PSK identity the dialer names in its TLS ClientHello: which QP pair, of which version.
/// The key is HKDF-SHA256 of the offer's token, salted with kPskSalt, with these bytes as info.
struct PskIdentity {
  uint32_t magic, version;
  uint32_t from_qpn, to_qpn;  ///< the dialer's QP, the acceptor's
};
static_assert(sizeof(PskIdentity) == 16);
inline constexpr char kPskSalt[] = "vrdma direct path";
/// The only cipher suite offered or taken: TLS_AES_128_GCM_SHA256 (its two code bytes).
inline constexpr unsigned char kTlsCipher[2] = {0x13, 0x01};
inline constexpr size_t kPskBytes = 32;  ///< the key: the suite's hash length

inline constexpr uint32_t kTakesRequests = 1;  ///< Hello::flags: the dialer executes requests too

/// The dialer's first message inside TLS; the acceptor answers with a HelloAck.
struct Hello {
  uint32_t magic, version;
  uint32_t from_qpn, to_qpn;  ///< as in its PSK identity
  uint32_t from_lid, flags;
};
static_assert(sizeof(Hello) == 24);
struct HelloAck {
  uint32_t magic;
  int32_t err;   ///< 0, or the errno of the refusal
  uint32_t lid;  ///< the acceptor's (the slid of receive completions on the dialer's side)
  uint32_t reserved;
};
static_assert(sizeof(HelloAck) == 16);

/// Frame::type. Requests travel to the responder; the rest answer them.
enum FType : uint8_t {
  kSend = 1,
  kSendImm = 2,
  kWrite = 3,
  kWriteImm = 4,
  kRead = 5,
  kCas = 6,
  kFaa = 7,
  kRewind =
      8,  ///< requester, after kResume or its RNR wait: its requests from the dropped one on follow
  kSendInv = 9,  ///< SEND_WITH_INV: `rkey` is the window to invalidate (version 5)
  kAck = 16,
  kNak = 17,
  kReadResp = 18,
  kAtomicResp = 19,
  kRnr = 20,     ///< request arg0 found no receive: it and what follows are dropped (status:
                 ///< min_rnr_timer)
  kResume = 21,  ///< a receive is posted: send them again
  /// Either way, on the connection the sender's requests go on (else its only one): the QP pair
  /// goes back to the backends. The sender sends no request after it; arg0: how many it sent in
  /// all (the receiver is done once it has executed that many). No data.
  kRevoke = 24,
};

/// One frame between two libraries; SEND/WRITE data or READ data follows it. 64 bytes, not the
/// 48 its fields take: behind a header of 1..63 bytes, the kernel's copy of a page-aligned
/// payload into the socket runs ~3x slower (likely 4K aliasing in its rep movsb): +14 µs a
/// 64 KiB round trip (BENCHMARKS.md, "64-byte frames").
struct Frame {
  uint8_t type;    ///< FType
  uint8_t status;  ///< kNak: the ibv_wc_status the requester completes with; kRnr: min_rnr_timer
  uint16_t flags;  ///< requests: IBV_SEND_SOLICITED
  uint32_t imm;    ///< as the WR gave it (network order)
  uint32_t len;    ///< requests: message bytes (READ: asked for); kReadResp: its data
  uint32_t rkey;
  uint64_t raddr;
  uint64_t arg0;  ///< atomics: compare/add; responses: requests executed so far
  uint64_t arg1;  ///< kCas: swap; kAtomicResp: the value before
  /// Requests: how many of the receiver's requests the sender has executed (an ACK riding on
  /// the other direction's traffic, cumulative).
  uint64_t ack;
  uint8_t pad[16];  ///< zero
};
static_assert(sizeof(Frame) == 64);

/// Frames that travel with requests (to the responder), and those that answer them.
constexpr bool request_dir(uint8_t t) { return t >= kSend && t <= kSendInv; }
constexpr bool response_dir(uint8_t t) { return t >= kAck && t <= kResume; }
/// Frames followed by `len` bytes of data (requests; kReadResp is the responder's).
constexpr bool send_frame_type(uint8_t t) { return t == kSend || t == kSendImm || t == kSendInv; }
constexpr bool carries_data(uint8_t t) {
  return send_frame_type(t) || t == kWrite || t == kWriteImm;
}
constexpr bool consumes_recv(uint8_t t) { return send_frame_type(t) || t == kWriteImm; }

/// A frame as it arrived: a known type (kRevoke: no length), fields its type does not use zero
/// where the format says so (pad), a length within max_msg_sz (atomics: 8), a NAK's status one a
/// responder gives, an RNR NAK's timer one of the 32 encodings. EPROTO, with what was wrong,
/// otherwise.
Status check_frame(const Frame& f);
/// The dialer's Hello as the acceptor reads it: magic, version, 24-bit QPNs, known flags.
Status check_hello(const Hello& h);
/// The acceptor's answer as the dialer reads it.
Status check_hello_ack(const HelloAck& a);

}  // namespace vrdma::proto::dwire
