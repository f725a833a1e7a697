#include "cli/cluster_status.h"

#include <fmt/format.h>

#include <algorithm>

namespace vrdma::cli {

namespace {
using nlohmann::json;

const json& at_or_null(const json& j, const char* k) {
  static const json null;
  if (!j.is_object()) return null;
  auto it = j.find(k);
  return it == j.end() ? null : *it;
}

/// "12 s", "3 min", "2 h".
std::string age(uint64_t s) {
  if (s < 120) return fmt::format("{} s", s);
  if (s < 7200) return fmt::format("{} min", s / 60);
  return fmt::format("{} h", s / 3600);
}
}  // namespace

json cluster_view(const json& status) {
  const json& b = at_or_null(status, "backend");
  json tcp;
  for (const json& t : at_or_null(b, "transports")) {
    if (at_or_null(t, "name") == "tcp") tcp = t;
  }
  json v = {{"node", at_or_null(b, "node").is_string() ? at_or_null(b, "node") : json("")}};
  if (at_or_null(tcp, "state") != "up") {
    v["directory"] = "off";
    v["why"] = "the TCP transport is off (no [transport] listen)";
    return v;
  }
  json connected =
      at_or_null(tcp, "connected").is_array() ? at_or_null(tcp, "connected") : json::array();
  v["connected"] = connected;
  const json& dir = at_or_null(tcp, "directory");
  if (!dir.is_object()) {
    v["directory"] = "embedded";
    v["peers"] = at_or_null(tcp, "peers").is_array() ? at_or_null(tcp, "peers") : json::array();
    return v;
  }
  v["directory"] = "etcd";
  v["node"] = at_or_null(dir, "node");
  json etcd = dir;
  etcd.erase("nodes");
  v["etcd"] = etcd;
  json nodes = json::array();
  for (json n : at_or_null(dir, "nodes")) {
    const std::string name = n.value("node", "");
    n["connected"] = std::find(connected.begin(), connected.end(), name) != connected.end();
    nodes.push_back(std::move(n));
  }
  v["nodes"] = nodes;
  return v;
}

std::string cluster_text(const json& v) {
  std::string out;
  const std::string kind = v.value("directory", "off");
  if (kind == "off") return fmt::format("cluster: {}\n", v.value("why", "off"));
  std::string conn;
  for (const json& c : at_or_null(v, "connected"))
    conn += (conn.empty() ? "" : ", ") + c.get<std::string>();
  if (kind == "embedded") {
    return fmt::format(
        "directory: embedded (peers from [transport] peers; guests announced over the "
        "connections)\nnode {}; connected to: {}\n",
        v.value("node", ""), conn.empty() ? "none" : conn);
  }
  const json& e = at_or_null(v, "etcd");
  out += fmt::format("directory: etcd {} ({}, {}; prefix {}, lease {} s, revision {})\n",
                     e.value("endpoint", ""),
                     e.value("reachable", false) ? "reachable" : "UNREACHABLE",
                     e.value("registered", false) ? "registered" : "NOT registered",
                     e.value("prefix", ""), e.value("lease_s", 0), e.value("revision", 0));
  if (e.contains("last_error") && !e.value("reachable", false))
    out += fmt::format("  last error: {}\n", e.value("last_error", ""));
  out += fmt::format("{:<16} {:<22} {:>6} {:>8} {:>6}  {}\n", "NODE", "ADDRESS", "LEASE", "AGE",
                     "GUESTS", "CONNECTED");
  std::string guests;
  for (const json& n : at_or_null(v, "nodes")) {
    const bool self = n.value("self", false);
    const std::string ttl =
        n.contains("lease_ttl_s") ? fmt::format("{} s", n.value("lease_ttl_s", 0)) : "-";
    out += fmt::format("{:<16} {:<22} {:>6} {:>8} {:>6}  {}\n",
                       n.value("node", "") + (self ? "*" : ""), n.value("address", ""), ttl,
                       age(n.value("age_s", uint64_t{0})), at_or_null(n, "guests").size(),
                       self                          ? "(this backend)"
                       : n.value("connected", false) ? "yes"
                                                     : "no");
    for (const json& g : at_or_null(n, "guests")) {
      guests += fmt::format("  {:<24} lid {:#06x}  on {}  generation {}\n", g.value("name", ""),
                            g.value("lid", 0), n.value("node", ""), g.value("generation", 0));
    }
  }
  if (!guests.empty()) out += "guests:\n" + guests;
  return out;
}

}  // namespace vrdma::cli
