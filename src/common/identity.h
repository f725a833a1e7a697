// A guest's fabric identity, derived from its name alone so that the library (before it talks
// to any backend) and every backend agree on it: a 64-bit id, the port GUID, and GID 0
// (link-local prefix fe80::/64 + port GUID), as an IB port derives GID 0 from its GUID.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace vrdma {

constexpr uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

/// Port GUID in host order: top byte 0x02 marks a locally administered identifier.
constexpr uint64_t port_guid_of(std::string_view guest) {
  return (fnv1a64(guest) & 0x00ffffffffffffffull) | (0x02ull << 56);
}

/// The LID a guest's name hashes to, in the unicast range 1..0xbfff. A backend gives it unless
/// it is taken (Device::new_guest_lid then probes to the next free one).
constexpr uint16_t lid_of_name(std::string_view guest) {
  return static_cast<uint16_t>(1 + fnv1a64(guest) % 0xbfff);
}

/// GID 0 in wire (big-endian) byte order.
constexpr std::array<uint8_t, 16> gid_of(std::string_view guest) {
  std::array<uint8_t, 16> g{};
  g[0] = 0xfe;
  g[1] = 0x80;
  uint64_t guid = port_guid_of(guest);
  for (int i = 0; i < 8; ++i) g[8 + i] = static_cast<uint8_t>(guid >> (56 - 8 * i));
  return g;
}

}  // namespace vrdma
