#include "proto/command.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <iterator>

namespace vrdma::proto {

size_t request_body_size(Op op) {
  switch (op) {
    case Op::kHello: return sizeof(HelloReq);
    case Op::kAllocPd: return 0;
    case Op::kCreateChannel: return 0;
    case Op::kDeallocPd:
    case Op::kDeregMr:
    case Op::kDeregSegment:
    case Op::kDestroyChannel:
    case Op::kDestroyCq:
    case Op::kDestroyQp:
    case Op::kQueryQp:
    case Op::kQuerySrq:
    case Op::kDestroySrq:
    case Op::kDirectGrant:
    case Op::kDirectRings:
    case Op::kDirectRemote:
    case Op::kDirectPeer:
    case Op::kDirectProve:
    case Op::kCmDestroyChannel:
    case Op::kCmDestroyId:
    case Op::kCmEstablish:
    case Op::kCmDisconnect:
    case Op::kFreeDm:
    case Op::kDeallocMw:
    case Op::kCloseXrcd:
      return sizeof(HandleReq);
    case Op::kOpenXrcd:
      return sizeof(OpenXrcdReq);
    case Op::kCreateXrcSrq:
      return sizeof(CreateXrcSrqReq);
    case Op::kOpenQp:
      return sizeof(OpenQpReq);
    case Op::kAllocMw:
      return sizeof(AllocMwReq);
    case Op::kMwView:
      return sizeof(MwViewReq);
    case Op::kReregMr:
      return sizeof(ReregMrReq);
    case Op::kResizeCq:
      return sizeof(ResizeCqReq);
    case Op::kAllocDm:
      return sizeof(AllocDmReq);
    case Op::kRegDmMr:
      return sizeof(RegDmMrReq);
    case Op::kImportContext:
      return 0;
    case Op::kImportObject:
      return sizeof(ImportObjectReq);
    case Op::kCmCreateChannel: return 0;
    case Op::kCmCreateId: return sizeof(CmCreateIdReq);
    case Op::kCmBind:
    case Op::kCmJoinMcast:
    case Op::kCmLeaveMcast:
      return sizeof(CmAddrReq);
    case Op::kAttachMcast:
    case Op::kDetachMcast:
      return sizeof(McastReq);
    case Op::kCmListen: return sizeof(CmListenReq);
    case Op::kCmResolveAddr:
    case Op::kCmResolveRoute: return sizeof(CmResolveReq);
    case Op::kCmConnect:
    case Op::kCmAccept:
    case Op::kCmReject: return sizeof(CmConnReq);
    case Op::kCmMigrateId: return sizeof(CmMigrateReq);
    case Op::kCmEvent: break;  // never a request
    case Op::kDirectOffer: return sizeof(DirectOfferReq);
    case Op::kDirectGrantUd:
    case Op::kDirectPeerUd:
    case Op::kDirectProveUd:
      return sizeof(DirectUdReq);
    case Op::kDirectCookie:
      return sizeof(DirectCookieReq);
    case Op::kCreateSrq: return sizeof(CreateSrqReq);
    case Op::kModifySrq: return sizeof(ModifySrqReq);
    case Op::kRegSegment: return sizeof(RegSegmentReq);
    case Op::kRegMr: return sizeof(RegMrReq);
    case Op::kCreateCq: return sizeof(CreateCqReq);
    case Op::kCreateQp: return sizeof(CreateQpReq);
    case Op::kModifyQp: return sizeof(ModifyQpReq);
    case Op::kStatus: return sizeof(StatusReq);
    case Op::kMigrate: return sizeof(MigrateReq);
    case Op::kImportBegin: return sizeof(ImportBeginReq);
    case Op::kImportData:
    case Op::kImportCm:
      return kVariableBody;
    case Op::kImportCommit: return 0;
    case Op::kSnapshot: return sizeof(SnapshotReq);
    case Op::kKeepDrop: return sizeof(KeepDropReq);
    case Op::kKeepBye:
    case Op::kKeepRestore:
    case Op::kKeepEnd:
    case Op::kKeepListener:
    case Op::kKeepListenerAsk:
      return 0;
    case Op::kRestore: return sizeof(RestoreReq);
    case Op::kMax: break;
  }
  return SIZE_MAX;
}

std::string op_name(uint16_t op) {
  static constexpr const char* kNames[] = {nullptr,
                                           "hello",
                                           "alloc_pd",
                                           "dealloc_pd",
                                           "reg_segment",
                                           "reg_mr",
                                           "dereg_mr",
                                           "create_channel",
                                           "destroy_channel",
                                           "create_cq",
                                           "destroy_cq",
                                           "create_qp",
                                           "modify_qp",
                                           "query_qp",
                                           "destroy_qp",
                                           "status",
                                           "create_srq",
                                           "modify_srq",
                                           "query_srq",
                                           "destroy_srq",
                                           "migrate",
                                           "import_begin",
                                           "import_data",
                                           "import_commit",
                                           "snapshot",
                                           "keep_drop",
                                           "keep_bye",
                                           "keep_restore",
                                           "keep_end",
                                           "restore",
                                           "direct_grant",
                                           "direct_rings",
                                           "direct_offer",
                                           "direct_remote",
                                           "dereg_segment",
                                           "cm_create_channel",
                                           "cm_destroy_channel",
                                           "cm_create_id",
                                           "cm_destroy_id",
                                           "cm_bind",
                                           "cm_listen",
                                           "cm_resolve_addr",
                                           "cm_resolve_route",
                                           "cm_connect",
                                           "cm_accept",
                                           "cm_reject",
                                           "cm_establish",
                                           "cm_disconnect",
                                           "cm_migrate_id",
                                           "cm_event",
                                           "attach_mcast",
                                           "detach_mcast",
                                           "cm_join_mcast",
                                           "cm_leave_mcast",
                                           "rereg_mr",
                                           "resize_cq",
                                           "alloc_dm",
                                           "free_dm",
                                           "reg_dm_mr",
                                           "alloc_mw",
                                           "dealloc_mw",
                                           "import_cm",
                                           "mw_view",
                                           nullptr,  // 63-64: free
                                           nullptr,
                                           "direct_cookie",
                                           "direct_peer",
                                           "direct_prove",
                                           "open_xrcd",
                                           "close_xrcd",
                                           "create_xrc_srq",
                                           "open_qp",
                                           nullptr,  // 72: free
                                           "import_context",
                                           "import_object",
                                           nullptr,  // 75-77: free
                                           nullptr,
                                           nullptr,
                                           "keep_listener",
                                           "keep_listener_ask",
                                           "direct_grant_ud",
                                           "direct_peer_ud",
                                           "direct_prove_ud"};
  static_assert(std::size(kNames) == static_cast<size_t>(Op::kMax));
  if (op == 0 || op >= std::size(kNames) || !kNames[op]) return fmt::format("op {}", op);
  return kNames[op];
}

Result<MsgHeader> decode_header(std::span<const uint8_t> msg) {
  if (msg.size() < sizeof(MsgHeader))
    return error(EPROTO, fmt::format("message of {} bytes is shorter than a header", msg.size()));
  MsgHeader h;
  std::memcpy(&h, msg.data(), sizeof(h));
  if (h.magic != kMagic) return error(EPROTO, fmt::format("bad magic {:#x}", h.magic));
  if (h.version != kVersion)
    return error(EPROTONOSUPPORT, fmt::format("protocol version {} (expected {})", h.version, kVersion));
  if (h.op == 0 || h.op >= static_cast<uint16_t>(Op::kMax))
    return error(EOPNOTSUPP, fmt::format("unknown opcode {}", h.op));
  if (h.length != msg.size())
    return error(EPROTO, fmt::format("declared length {} but received {}", h.length, msg.size()));
  return h;
}

std::vector<uint8_t> encode_error(Op op, uint32_t seq, int err, std::string_view reason,
                                  uint32_t flags) {
  reason = reason.substr(0, kMaxReason);
  std::vector<uint8_t> out(sizeof(MsgHeader) + reason.size());
  MsgHeader h{kMagic, kVersion, static_cast<uint16_t>(op), 0, seq, -err, flags};
  h.length = static_cast<uint32_t>(out.size());
  std::memcpy(out.data(), &h, sizeof(h));
  if (!reason.empty()) std::memcpy(out.data() + sizeof(h), reason.data(), reason.size());
  return out;
}

std::string reason_of(std::span<const uint8_t> msg) {
  if (msg.size() <= sizeof(MsgHeader)) return "";
  const auto body =
      msg.subspan(sizeof(MsgHeader), std::min(msg.size() - sizeof(MsgHeader), kMaxReason));
  std::string out;
  out.reserve(body.size());
  for (uint8_t c : body) out += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
  return out;
}

Result<MsgHeader> decode_request(std::span<const uint8_t> msg) {
  if (msg.size() > kMaxImportMessage) return error(EMSGSIZE, "request too large");
  ASSIGN_OR_RETURN(MsgHeader h, decode_header(msg));
  size_t want = request_body_size(static_cast<Op>(h.op));
  if (want == kVariableBody) {
    if (msg.size() - sizeof(MsgHeader) > kMaxImportChunk) return error(EMSGSIZE, "chunk too large");
    return h;
  }
  if (msg.size() > kMaxRequest) return error(EMSGSIZE, "request too large");
  if (msg.size() - sizeof(MsgHeader) != want)
    return error(EPROTO, fmt::format("opcode {} body of {} bytes, expected {}", h.op,
                                     msg.size() - sizeof(MsgHeader), want));
  return h;
}

}  // namespace vrdma::proto
