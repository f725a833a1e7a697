// The direct path across backends in a keeper's blob (version 9; the rest of the exporter is
// device_state_export.cc, of the importer device_state_import.cc). A backend that was SIGKILLed
// under keep_state leaves its guests' libraries talking to their peers' libraries: their TLS
// connections, the WRs in flight on them and the own rings are the libraries' and shared
// memory's, never the backend's. What the backend knows of them (which QPs went direct or
// offered, their offers, the peers' offers it holds) comes back with the guest, so the pair
// stays direct across the restart and a later move still asks it back (docs/ARCHITECTURE.md,
// "Moving a guest's device", keep_state). A move or a snapshot carries none of it: their QPs
// left the direct path before the export (Device::leave_direct_remote).
#include <fmt/format.h>

#include <array>
#include <cstring>
#include <set>

#include "engine/device_state_reader.h"
#include "proto/device_state.h"
#include "proto/post_rules.h"

namespace vrdma::engine::state {

using namespace vrdma::proto;

namespace {

using Token = std::array<uint8_t, kDirectTokenBytes>;

json token_of(const uint8_t* t) {
  return json::binary(std::vector<uint8_t>(t, t + kDirectTokenBytes));
}

/// A guest's RC or UC QP named by QPN in a direct entry, or nullptr (and the import fails).
Qp* rc_qp(Reader& rd, Guest& g, uint32_t qpn, const char* what) {
  auto it = g.qps.find(qpn);
  if (it == g.qps.end() || !direct_remote_type(it->second->type)) {
    rd.fail(fmt::format("{} for QP {:#x}, not an RC or UC QP of the guest", what, qpn));
    return nullptr;
  }
  return it->second;
}

void import_direct_qps(Importer& im, const json& list, Guest& g) {
  Reader& rd = im.rd;
  std::set<uint32_t> seen;
  for (const json& j : list) {
    if (!rd.st.is_ok()) return;
    const uint32_t qpn = rd.num<uint32_t>(j, "qpn");
    const uint32_t remote = rd.num<uint32_t>(j, "remote"), offered = rd.num<uint32_t>(j, "offered");
    const uint16_t port = rd.num<uint16_t>(j, "port");
    const uint32_t ipv4 = rd.num<uint32_t>(j, "ipv4");
    const Token token = rd.pod<Token>(j, "token"), used = rd.pod<Token>(j, "used");
    if (!rd.st.is_ok()) return;
    Qp* qp = rc_qp(rd, g, qpn, "direct path state");
    if (!qp) return;
    if (!seen.insert(qpn).second) return rd.fail(fmt::format("direct QP {:#x} twice", qpn));
    if (remote > 1 || offered > 1 || !(remote || offered))
      return rd.fail(fmt::format("direct QP {:#x}: flags", qpn));
    // Each needs what its grant gave it: the own ring its library writes, and a peer across.
    if (!qp->remote || (remote && !qp->own_send) || (offered && (!qp->own_recv || port == 0)))
      return rd.fail(
          fmt::format("direct QP {:#x}: not across backends, or without its rings", qpn));
    qp->direct_remote = remote != 0;
    qp->direct = qp->direct_remote;
    qp->offered = offered != 0;
    qp->offer_port = port;
    qp->offer_ipv4 = ipv4;
    std::memcpy(qp->offer_token, token.data(), kDirectTokenBytes);
    std::memcpy(qp->used_offer_token, used.data(), kDirectTokenBytes);
  }
}

void import_direct_offers(Importer& im, const json& list, Guest& g) {
  Reader& rd = im.rd;
  for (const json& j : list) {
    if (!rd.st.is_ok()) return;
    const uint32_t qpn = rd.num<uint32_t>(j, "qpn");
    RemoteOffer r;
    r.node = rd.str(j, "node");
    r.slid = rd.num<uint16_t>(j, "slid");
    const auto sgid = rd.pod<std::array<uint8_t, 16>>(j, "sgid");
    r.src_qpn = rd.num<uint32_t>(j, "src_qpn");
    r.port = rd.num<uint16_t>(j, "port");
    r.ipv4 = rd.num<uint32_t>(j, "ipv4");
    const Token token = rd.pod<Token>(j, "token");
    if (!rd.st.is_ok() || !rc_qp(rd, g, qpn, "a peer's direct offer")) return;
    if (r.node.empty() || r.node.size() > 255 || r.src_qpn > 0xffffff)
      return rd.fail(fmt::format("the peer's direct offer for QP {:#x}", qpn));
    std::memcpy(r.sgid, sgid.data(), 16);
    std::memcpy(r.token, token.data(), kDirectTokenBytes);
    if (!g.direct_offers.emplace(qpn, std::move(r)).second)
      return rd.fail(fmt::format("two direct offers for QP {:#x}", qpn));
  }
}

}  // namespace

void import_rx_tags(Reader& rd, const json& js, Session& s) {
  auto it = js.find("rx_tags");
  if (it == js.end()) return;
  if (!it->is_array()) return rd.fail("session's rx_tags");
  size_t n = 0;
  for (const json& t : *it) {
    if (!t.is_number_unsigned()) return rd.fail("session's rx_tags");
    const uint64_t v = t.get<uint64_t>();
    // Not a session's (0: free, kRxLockBackend: a backend's own hold): never a live holder.
    if (v == 0 || v >= kRxLockBackend) continue;
    if (n == s.kept_rx_tags.size()) break;
    s.kept_rx_tags[n++] = static_cast<uint32_t>(v);
  }
}

void export_direct(const Guest& g, json& doc) {
  json qps = json::array();
  for (const Qp* qp : g.active) {
    if (!qp->direct_remote && !qp->offered) continue;
    qps.push_back({{"qpn", qp->qpn},
                   {"remote", qp->direct_remote ? 1 : 0},
                   {"offered", qp->offered ? 1 : 0},
                   {"port", qp->offer_port},
                   {"ipv4", qp->offer_ipv4},
                   {"token", token_of(qp->offer_token)},
                   {"used", token_of(qp->used_offer_token)}});
  }
  json offers = json::array();
  for (const auto& [qpn, r] : g.direct_offers) {
    offers.push_back({{"qpn", qpn},
                      {"node", r.node},
                      {"slid", r.slid},
                      {"sgid", json::binary(std::vector<uint8_t>(r.sgid, r.sgid + 16))},
                      {"src_qpn", r.src_qpn},
                      {"port", r.port},
                      {"ipv4", r.ipv4},
                      {"token", token_of(r.token)}});
  }
  doc["direct_qps"] = std::move(qps);
  doc["direct_offers"] = std::move(offers);
}

void import_direct(Importer& im, const json& doc, Guest& g, uint32_t version, bool recover) {
  if (version < 9 || !im.rd.st.is_ok()) return;
  const auto qps = doc.find("direct_qps");
  const auto offers = doc.find("direct_offers");
  if (qps == doc.end() && offers == doc.end()) return;  // a move's or a snapshot's blob
  if (!recover) return im.rd.fail("direct path state in a guest that moves (it leaves first)");
  import_direct_qps(im, im.rd.arr(doc, "direct_qps"), g);
  import_direct_offers(im, im.rd.arr(doc, "direct_offers"), g);
}

}  // namespace vrdma::engine::state
