// Fuzz target: the cross-host wire decoder (src/proto/wire.h), fed a byte stream as the TCP
// transport reads one from a peer backend: header, check, body, decode, skip the payload, next.
// Each frame that decodes must re-encode to the same header and body bytes (abort otherwise),
// and a decoded name must stay inside its field.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "proto/wire.h"

namespace vrdma::fuzz {

using namespace vrdma::proto::wire;

int fuzz_wire(const uint8_t* data, size_t size) {
  size_t pos = 0;
  Frame f;
  std::vector<uint8_t> again;
  while (size - pos >= sizeof(FrameHeader)) {
    FrameHeader h;
    std::memcpy(&h, data + pos, sizeof(h));
    if (!check_header(h).is_ok()) break;
    if (size - pos - sizeof(h) < h.body) break;  // the rest of the body has not arrived
    const uint8_t* body = data + pos + sizeof(h);
    if (!decode(h, {body, h.body}, f).is_ok()) break;
    again.clear();
    encode(f.type(), body, h.payload, again);
    if (again.size() != sizeof(h) + h.body || std::memcmp(again.data(), data + pos, again.size()))
      std::abort();  // what was accepted does not round-trip
    if (f.type() == Type::kHello && get_name(f.hello.node).size() >= kNameMax) std::abort();
    pos += sizeof(h) + h.body;
    if (h.payload > size - pos) break;
    pos += h.payload;
  }
  return 0;
}

}  // namespace vrdma::fuzz
