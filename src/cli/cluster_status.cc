#include "cli/cluster_status.h"

#include <fmt/format.h>

#include <algorithm>

namespace vrdma::cli {

namespace {
using nlohmann::json;

/// "12 s", "3 min", "2 h".
std::string age(uint64_t s) {
  if (s < 120) return fmt::format("{} s", s);
  if (s < 7200) return fmt::format("{} min", s / 60);
  return fmt::format("{} h", s / 3600);
}
}  // namespace

// The document is the backend's (query_status_json checked it is an object); value() with a
// default keeps a field an older backend lacks from throwing.
json cluster_view(const json& status) {
  const json b = status.value("backend", json::object());
  json tcp = json::object();
  for (const json& t : b.value("transports", json::array())) {
    if (t.is_object() && t.value("name", "") == "tcp") tcp = t;
  }
  json v = {{"node", b.value("node", "")}};
  if (tcp.value("state", "") != "up") {
    v["directory"] = "off";
    v["why"] = "the TCP transport is off (no [transport] listen)";
    return v;
  }
  const json connected = tcp.value("connected", json::array());
  v["connected"] = connected;
  v["known"] = tcp.value("known", json::array());
  v["connections"] = tcp.value("connections", json::object());
  const json dir = tcp.value("directory", json());
  if (!dir.is_object()) {
    v["directory"] = "embedded";
    v["peers"] = tcp.value("peers", json::array());
    return v;
  }
  v["directory"] = "etcd";
  v["node"] = dir.value("node", "");
  json etcd = dir;
  etcd.erase("nodes");
  v["etcd"] = etcd;
  json nodes = json::array();
  for (json n : dir.value("nodes", json::array())) {
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
  for (const json& c : v.value("connected", json::array()))
    conn += (conn.empty() ? "" : ", ") + c.get<std::string>();
  const json cs = v.value("connections", json::object());
  const std::string counts = fmt::format(
      "connections: {} of {} known peers (on demand; dials {}, idle closes {}, idle_close_s {})\n",
      v.value("connected", json::array()).size(), v.value("known", json::array()).size(),
      cs.value("dials", uint64_t{0}), cs.value("idle_closes", uint64_t{0}),
      cs.value("idle_close_s", uint64_t{0}));
  if (kind == "embedded") {
    return fmt::format(
               "directory: embedded (peers from [transport] peers; guests announced over the "
               "connections)\nnode {}; connected to: {}\n",
               v.value("node", ""), conn.empty() ? "none" : conn) +
           counts;
  }
  const json e = v.value("etcd", json::object());
  out += fmt::format("directory: etcd {} ({}, {}; prefix {}, lease {} s, revision {})\n",
                     e.value("endpoint", ""),
                     e.value("reachable", false) ? "reachable" : "UNREACHABLE",
                     e.value("registered", false) ? "registered" : "NOT registered",
                     e.value("prefix", ""), e.value("lease_s", 0), e.value("revision", 0));
  if (e.contains("last_error") && !e.value("reachable", false))
    out += fmt::format("  last error: {}\n", e.value("last_error", ""));
  if (e.contains("watch_lag_ms"))
    out += fmt::format("  watch lag {} ms, lease kept {}\n", e.value("watch_lag_ms", 0),
                       age(e.value("lease_age_s", uint64_t{0})));
  out += fmt::format("{:<16} {:<22} {:>6} {:>8} {:>6} {:>6}  {}\n", "NODE", "ADDRESS", "LEASE",
                     "AGE", "GUESTS", "QPS", "CONNECTED");
  std::string guests;
  for (const json& n : v.value("nodes", json::array())) {
    const bool self = n.value("self", false);
    const std::string ttl =
        n.contains("lease_ttl_s") ? fmt::format("{} s", n.value("lease_ttl_s", 0)) : "-";
    out += fmt::format("{:<16} {:<22} {:>6} {:>8} {:>6} {:>6}  {}\n",
                       n.value("node", "") + (self ? "*" : ""), n.value("address", ""), ttl,
                       age(n.value("age_s", uint64_t{0})), n.value("guests", json::array()).size(),
                       n.contains("qps") ? std::to_string(n.value("qps", uint64_t{0})) : "-",
                       self                          ? "(this backend)"
                       : n.value("connected", false) ? "yes"
                                                     : "no");
    for (const json& g : n.value("guests", json::array())) {
      guests += fmt::format("  {:<24} lid {:#06x}  on {}  generation {}\n", g.value("name", ""),
                            g.value("lid", 0), n.value("node", ""), g.value("generation", 0));
    }
  }
  if (!guests.empty()) out += "guests:\n" + guests;
  out += counts;
  return out;
}

}  // namespace vrdma::cli
