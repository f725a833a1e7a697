// A directory outside the transport (the directory on etcd, src/directory/): when the TCP
// transport has one, it answers where guests are from it and tells it about this backend's
// guests; the announcements between peers (the embedded directory) still flow, and answer only
// for a guest the directory does not list yet while it is reachable (tcp_transport.cc).
// Concurrency: called on the engine thread; implementations answer from their own copy.
#pragma once

#include <cstdint>
#include <string>

#include "transport/transport.h"

namespace vrdma::transport {

class Directory {
 public:
  virtual ~Directory() = default;
  /// A local guest appeared (up) or left.
  virtual void announce(const GuestInfo& g, bool up) = 0;
  /// The peer node hosting the guest with this LID / GID, or "" (also for this backend's own
  /// guests, as Transport::locate_lid).
  virtual std::string locate_lid(uint16_t lid) const = 0;
  virtual std::string locate_gid(const uint8_t gid[16]) const = 0;
  /// The SHA-256 fingerprint of the certificate `node` registered with, or "" (not known, or
  /// registered without one): a peer presenting another certificate under that name is refused.
  virtual std::string fingerprint_of(const std::string& node) const = 0;
  /// Why a lookup that found nothing may be wrong (the directory cannot be reached), or "".
  virtual std::string unavailable() const = 0;
};

}  // namespace vrdma::transport
