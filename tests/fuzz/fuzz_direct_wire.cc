// Fuzz target: the library-to-library wire checks (src/proto/direct_wire.h), fed what a peer
// library sends: a Hello (what the acceptor reads), then 64-byte frames (what either side reads)
// until one is refused. A frame that passes must be one the receiver can dispatch (a request, a
// response or kRevoke, data only where its type carries some); a refused one ends the stream, as it
// ends the connection.
#include <cstdlib>
#include <cstring>

#include "proto/direct_wire.h"

namespace vrdma::fuzz {

namespace dw = vrdma::proto::dwire;  // (unity builds: proto::wire has a Hello too)

int fuzz_direct_wire(const uint8_t* data, size_t size) {
  if (size < sizeof(dw::Hello)) return 0;
  dw::Hello h;
  std::memcpy(&h, data, sizeof(h));
  dw::HelloAck a;
  static_assert(sizeof(a) <= sizeof(h));
  std::memcpy(&a, data, sizeof(a));
  (void)dw::check_hello_ack(a);
  if (!dw::check_hello(h).is_ok()) return 0;
  if (h.from_qpn > 0xffffff || h.to_qpn > 0xffffff) std::abort();
  size_t pos = sizeof(h);
  while (size - pos >= sizeof(dw::Frame)) {
    dw::Frame f;
    std::memcpy(&f, data + pos, sizeof(f));
    pos += sizeof(f);
    if (!dw::check_frame(f).is_ok()) break;
    // Exactly one direction, but kRevoke, which goes either way and carries nothing.
    if (f.type == dw::kRevoke ? dw::request_dir(f.type) || dw::response_dir(f.type) || f.len
                              : dw::request_dir(f.type) == dw::response_dir(f.type))
      std::abort();
    if (dw::carries_data(f.type) && !dw::request_dir(f.type)) std::abort();
    // The data that follows (up to what is there): skipped, as a discarded request's is.
    const uint64_t follows = dw::carries_data(f.type) || f.type == dw::kReadResp ? f.len : 0;
    if (follows > size - pos) break;
    pos += follows;
  }
  return 0;
}

}  // namespace vrdma::fuzz
