#include "proto/wire.h"

#include <fmt/format.h>
#include <infiniband/verbs.h>
#include <sys/socket.h>

#include "proto/post_rules.h"

namespace vrdma::proto::wire {

size_t body_size(Type t) {
  switch (t) {
    case Type::kHello:
      return sizeof(Hello);
    case Type::kGuestUp:
    case Type::kGuestDown:
      return sizeof(GuestEntry);
    case Type::kRequest:
      return sizeof(Request);
    case Type::kReply:
      return sizeof(Reply);
    case Type::kDirectOffer:
      return sizeof(DirectOffer);
    case Type::kCm:
      return sizeof(Cm);
    case Type::kPing:
      return sizeof(Ping);
    case Type::kClose:
      return sizeof(Close);
    case Type::kMax:
      break;
  }
  return 0;
}

bool put_name(char (&field)[kNameMax], std::string_view name) {
  std::memset(field, 0, kNameMax);
  if (name.empty() || name.size() >= kNameMax) return false;
  std::memcpy(field, name.data(), name.size());
  return true;
}

std::string_view get_name(const char (&field)[kNameMax]) {
  const size_t n = strnlen(field, kNameMax);
  if (n == 0 || n == kNameMax) return {};
  for (size_t i = 0; i < n; ++i) {
    if (field[i] < 0x21 || field[i] > 0x7e) return {};
  }
  return {field, n};
}

Status check_header(const FrameHeader& h) {
  if (h.magic != kWireMagic) return error(EPROTO, fmt::format("bad frame magic {:#x}", h.magic));
  if (h.version != kWireVersion)
    return error(EPROTONOSUPPORT,
                 fmt::format("wire version {} (this backend speaks {})", h.version, kWireVersion));
  if (h.type == 0 || h.type >= static_cast<uint16_t>(Type::kMax))
    return error(EPROTO, fmt::format("unknown frame type {}", h.type));
  const Type t = static_cast<Type>(h.type);
  if (h.body != body_size(t))
    return error(EPROTO, fmt::format("frame type {} with a body of {} bytes", h.type, h.body));
  // Only requests and READ replies carry data; their bounds are checked against the body.
  if (h.payload != 0 && t != Type::kRequest && t != Type::kReply)
    return error(EPROTO, fmt::format("frame type {} with a payload", h.type));
  if (h.payload > kMaxPayload) return error(EPROTO, "payload larger than a message");
  return Status::ok();
}

namespace {

Status check_request(const FrameHeader& h, const Request& r) {
  if (r.is_global > 1) return error(EPROTO, "request: is_global not 0/1");
  if (r.src_qpn > 0xffffff || r.dst_qpn > 0xffffff || r.psn > 0xffffff)
    return error(EPROTO, "request: QPN or PSN wider than 24 bits");
  const uint32_t op = r.opcode;
  if (r.qp_type != IBV_QPT_RC && r.qp_type != IBV_QPT_UC && r.qp_type != IBV_QPT_UD &&
      r.qp_type != IBV_QPT_XRC_SEND)
    return error(EPROTO, fmt::format("request: QP type {}", r.qp_type));
  // What the QP type may post (post_rules.h), less what never leaves the requester (binds,
  // local invalidation). SEND_WITH_INV came with memory windows: an older peer refuses it here.
  if (!opcode_allowed(r.qp_type, op) || is_local_mw_op(op))
    return error(EPROTO, fmt::format("request: opcode {} on QP type {}", op, r.qp_type));
  if (r.qp_type == IBV_QPT_UD && r.length > kMaxUdPayload)
    return error(EPROTO, "request: UD datagram above the MTU");
  // SEND and WRITE carry their data; READ and atomics carry none.
  const uint32_t want = is_send(op) || is_rdma_write(op) ? r.length : 0;
  if (h.payload != want)
    return error(EPROTO,
                 fmt::format("request: payload {} for a length of {}", h.payload, r.length));
  if (is_rdma_atomic(op) && r.length != 8) return error(EPROTO, "request: atomic of length != 8");
  return Status::ok();
}

Status check_reply(const FrameHeader& h, const Reply& r) {
  if (r.dst_qpn > 0xffffff || r.src_qpn > 0xffffff || r.psn > 0xffffff)
    return error(EPROTO, "reply: QPN or PSN wider than 24 bits");
  if (r.syndrome >= static_cast<uint8_t>(Syndrome::kMax))
    return error(EPROTO, fmt::format("reply: syndrome {}", r.syndrome));
  const auto s = static_cast<Syndrome>(r.syndrome);
  if (h.payload != 0 && s != Syndrome::kReadData) return error(EPROTO, "reply: unexpected data");
  if (s == Syndrome::kRnrNak && (r.rnr_timer > 31 || (r.status != 0 && r.status != kRnrNotReady)))
    return error(EPROTO, "reply: rnr_timer > 31 or an RNR status not known");
  if (s == Syndrome::kErrNak && r.status != IBV_WC_REM_ACCESS_ERR &&
      r.status != IBV_WC_REM_INV_REQ_ERR && r.status != IBV_WC_REM_OP_ERR)
    return error(EPROTO, fmt::format("reply: NAK status {}", r.status));
  return Status::ok();
}

bool ip_family(const CmAddr& a) { return a.family == AF_INET || a.family == AF_INET6; }

}  // namespace

Status check_cm(const Cm& m) {
  if (m.kind == 0 || m.kind >= static_cast<uint8_t>(CmKind::kMax))
    return error(EPROTO, fmt::format("cm: kind {}", m.kind));
  const auto k = static_cast<CmKind>(m.kind);
  // A REQ names no id of the receiver; a GONE may not know it yet (the requester's own id then
  // names its request); every other message answers one.
  const bool names_none = k == CmKind::kReq || k == CmKind::kAddrQuery;
  if (m.src_id == 0 || (names_none && m.dst_id != 0) ||
      (!names_none && k != CmKind::kGone && m.dst_id == 0))
    return error(EPROTO, "cm: id 0, or a REQ naming an id");
  if (m.qp.qpn > 0xffffff || m.qp.psn > 0xffffff)
    return error(EPROTO, "cm: QPN or PSN wider than 24 bits");
  size_t limit = 0;
  switch (k) {
    case CmKind::kReq:
      if (m.ps != kCmPsTcp && m.ps != kCmPsUdp && m.ps != kCmPsIb && m.ps != kCmPsIpoib)
        return error(EPROTO, fmt::format("cm: port space {:#x}", m.ps));
      if (m.qp_type != IBV_QPT_RC && m.qp_type != IBV_QPT_UC && m.qp_type != IBV_QPT_UD)
        return error(EPROTO, fmt::format("cm: QP type {}", m.qp_type));
      if (!ip_family(m.src) || !ip_family(m.dst) || m.dst.port == 0)
        return error(EPROTO, "cm: REQ without IP addresses");
      limit = cm_private_limit(m.ps, m.qp_type, Op::kCmConnect);
      break;
    case CmKind::kRep:
    case CmKind::kSidrRep:
      limit = cm_private_limit(kCmPsTcp, k == CmKind::kSidrRep ? IBV_QPT_UD : IBV_QPT_RC,
                               Op::kCmAccept);
      break;
    case CmKind::kRej:
      if (m.status != kCmRejTimeout && m.status != kCmRejInvalidService &&
          m.status != kCmRejConsumer)
        return error(EPROTO, fmt::format("cm: reject reason {}", m.status));
      limit = cm_private_limit(kCmPsTcp, IBV_QPT_RC, Op::kCmReject);
      break;
    case CmKind::kAddrQuery:
    case CmKind::kAddrReply:
      if (!ip_family(m.dst)) return error(EPROTO, "cm: address query without an IP address");
      break;
    case CmKind::kMoved:  // the node the id left, by name
      if (m.private_len == 0) return error(EPROTO, "cm: a move without the node it left");
      limit = kNameMax - 1;
      break;
    default:  // RTU, DREQ, GONE: nothing to say
      break;
  }
  if (k != CmKind::kRej && m.status != 0) return error(EPROTO, "cm: status outside a REJ");
  if (m.private_len > limit)
    return error(EPROTO,
                 fmt::format("cm: {} bytes of private data (limit {})", m.private_len, limit));
  return Status::ok();
}

Status decode(const FrameHeader& h, std::span<const uint8_t> body, Frame& out) {
  RETURN_IF_ERROR(check_header(h));
  if (body.size() != h.body) return error(EPROTO, "frame body length mismatch");
  out.h = h;
  switch (static_cast<Type>(h.type)) {
    case Type::kHello:
      std::memcpy(&out.hello, body.data(), sizeof(Hello));
      if (get_name(out.hello.node).empty()) return error(EPROTO, "hello: bad node name");
      if (out.hello.wire_version != kWireVersion)
        return error(EPROTONOSUPPORT,
                     fmt::format("peer speaks wire version {}", out.hello.wire_version));
      return Status::ok();
    case Type::kGuestUp:
    case Type::kGuestDown:
      std::memcpy(&out.guest, body.data(), sizeof(GuestEntry));
      if (get_name(out.guest.name).empty()) return error(EPROTO, "guest entry: bad name");
      if (out.guest.lid == 0 || out.guest.lid >= 0xc000)
        return error(EPROTO, fmt::format("guest entry: LID {:#x} not unicast", out.guest.lid));
      return Status::ok();
    case Type::kRequest:
      std::memcpy(&out.req, body.data(), sizeof(Request));
      return check_request(h, out.req);
    case Type::kReply:
      std::memcpy(&out.reply, body.data(), sizeof(Reply));
      return check_reply(h, out.reply);
    case Type::kDirectOffer:
      std::memcpy(&out.offer, body.data(), sizeof(DirectOffer));
      if (out.offer.is_global > 1) return error(EPROTO, "direct offer: is_global not 0/1");
      if (out.offer.src_qpn > 0xffffff || out.offer.dst_qpn > 0xffffff)
        return error(EPROTO, "direct offer: QPN wider than 24 bits");
      if (out.offer.port == 0) return error(EPROTO, "direct offer: port 0");
      return Status::ok();
    case Type::kCm:
      std::memcpy(&out.cm, body.data(), sizeof(Cm));
      return check_cm(out.cm);
    case Type::kPing:
      std::memcpy(&out.ping, body.data(), sizeof(Ping));
      return Status::ok();
    case Type::kClose:
      std::memcpy(&out.close, body.data(), sizeof(Close));
      if (out.close.kind > static_cast<uint8_t>(CloseKind::kRefuse))
        return error(EPROTO, fmt::format("close: kind {}", out.close.kind));
      return Status::ok();
    case Type::kMax:
      break;
  }
  return error(EPROTO, "unknown frame type");
}

void encode(Type t, const void* body, uint32_t payload, std::vector<uint8_t>& out) {
  const FrameHeader h{kWireMagic, kWireVersion, static_cast<uint16_t>(t),
                      static_cast<uint32_t>(body_size(t)), payload};
  const size_t at = out.size();
  out.resize(at + sizeof(h) + h.body);
  std::memcpy(out.data() + at, &h, sizeof(h));
  std::memcpy(out.data() + at + sizeof(h), body, h.body);
}

}  // namespace vrdma::proto::wire
