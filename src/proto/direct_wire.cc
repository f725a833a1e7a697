#include "proto/direct_wire.h"

#include <cstring>

#include <fmt/format.h>
#include <infiniband/verbs.h>

#include "proto/device_caps.h"

namespace vrdma::proto::dwire {

Status check_frame(const Frame& f) {
  if (!request_dir(f.type) && !response_dir(f.type) && f.type != kRevoke)
    return error(EPROTO, fmt::format("direct frame: type {}", f.type));
  uint64_t pad[2];
  static_assert(sizeof(pad) == sizeof(f.pad));
  std::memcpy(pad, f.pad, sizeof(pad));
  if (pad[0] | pad[1]) return error(EPROTO, "direct frame: padding not zero");
  if (f.flags & ~uint16_t{IBV_SEND_SOLICITED})
    return error(EPROTO, fmt::format("direct frame: flags {:#x}", f.flags));
  if (f.len > kMaxMsgSize) return error(EPROTO, fmt::format("direct frame: length {}", f.len));
  if (f.type == kNak && f.status != IBV_WC_REM_ACCESS_ERR && f.status != IBV_WC_REM_INV_REQ_ERR &&
      f.status != IBV_WC_REM_OP_ERR)
    return error(EPROTO, fmt::format("direct frame: NAK status {}", f.status));
  if (f.type == kRevoke && (f.len || f.flags || f.status))
    return error(EPROTO, "direct frame: kRevoke with a length, flags or status");
  if (f.type == kRnr && f.status > 31)
    return error(EPROTO, fmt::format("direct frame: RNR timer {}", f.status));
  return Status::ok();
}

Status check_hello(const Hello& h) {
  if (h.magic != kDirectMagic || h.version != kDirectVersion)
    return error(EPROTONOSUPPORT, fmt::format("direct hello: magic {:#x} version {} (this library "
                                              "speaks {})",
                                              h.magic, h.version, kDirectVersion));
  if (h.from_qpn > 0xffffff || h.to_qpn > 0xffffff || h.from_lid > 0xffff)
    return error(EPROTO, "direct hello: QPN wider than 24 bits or LID wider than 16");
  if (h.flags & ~kTakesRequests) return error(EPROTO, fmt::format("direct hello: flags {:#x}", h.flags));
  return Status::ok();
}

Status check_hello_ack(const HelloAck& a) {
  if (a.magic != kDirectMagic) return error(EPROTO, fmt::format("direct hello answer: magic {:#x}", a.magic));
  if (a.err < 0 || a.err > 4095) return error(EPROTO, fmt::format("direct hello answer: err {}", a.err));
  if (a.lid > 0xffff) return error(EPROTO, "direct hello answer: LID wider than 16 bits");
  return Status::ok();
}

}  // namespace vrdma::proto::dwire
