#include "cli/show.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <ctime>
#include <map>

namespace vrdma::cli {

namespace {

using nlohmann::json;

const json& member(const json& j, const char* key) {
  static const json null;
  if (!j.is_object()) return null;
  auto it = j.find(key);
  return it == j.end() ? null : *it;
}

std::string text_of(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return "-";
  return v.dump();
}

/// Fields printed as LIDs or QPNs (id_text) and as sizes (size_text).
bool is_id(const std::string& k) {
  return k == "qpn" || k == "dest_qpn" || k == "lid" || k == "dlid";
}
bool is_size(const std::string& k) { return k == "mrlen" || k == "length"; }

/// JSON keeps a number that came in as text unsigned, one built in code perhaps signed.
bool is_count(const json& v) {
  return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0);
}

/// The keys each resource type may be filtered on (and prints, in this order).
const std::vector<std::string>& fields_of(const std::string& type) {
  static const std::map<std::string, std::vector<std::string>> kFields = {
      {"qp",
       {"guest", "qpn", "dest_qpn", "type", "state", "sq_psn", "rq_psn", "pdn", "sq_cqn", "rq_cqn",
        "srqn", "xrcdn", "opens", "transport", "peer_node", "pid", "comm"}},
      {"cq", {"guest", "cqn", "cqe", "users", "channel", "overrun", "pid", "comm"}},
      {"mr", {"guest", "mrn", "pdn", "lkey", "rkey", "mrlen", "iova", "access", "pid", "comm"}},
      {"pd", {"guest", "pdn", "users", "pid", "comm"}},
      {"srq",
       {"guest", "srqn", "pdn", "wqe", "max_sge", "limit", "users", "xrcdn", "srq_num", "cqn",
        "pid", "comm"}},
      {"mw",
       {"guest", "mwn", "pdn", "type", "state", "rkey", "mrn", "iova", "length", "access", "qpn",
        "pid", "comm"}},
      {"xrcd", {"guest", "xrcdn", "file", "opens", "users"}},
      {"dm", {"guest", "dmn", "length", "segment", "pid", "comm"}},
      {"stat-qp", {"guest", "qpn", "type", "transport", "pid", "comm"}},
      {"stat-guest", {"guest"}},
  };
  static const std::vector<std::string> none;
  auto it = kFields.find(type);
  return it == kFields.end() ? none : it->second;
}

/// iproute2's `rdma res show` names, still taken as filter keys: the JSON and the text say the
/// names of backend/report.h (use_operator_names).
const std::map<std::string, std::string>& filter_aliases() {
  static const std::map<std::string, std::string> kAliases = {
      {"lqpn", "qpn"},      {"rqpn", "dest_qpn"}, {"sq-psn", "sq_psn"}, {"rq-psn", "rq_psn"},
      {"sq-cqn", "sq_cqn"}, {"rq-cqn", "rq_cqn"}, {"qps", "qp_count"}};
  return kAliases;
}

bool matches(const json& row, const Filters& filters) {
  for (const auto& [k, want] : filters) {
    const json& v = member(row, k.c_str());
    auto same_word = [](const std::string& a, const std::string& b) {
      return std::ranges::equal(a, b, [](char x, char y) {
        return std::tolower(static_cast<unsigned char>(x)) ==
               std::tolower(static_cast<unsigned char>(y));
      });
    };
    if (v.is_number_integer()) {
      char* end = nullptr;
      const unsigned long long n = std::strtoull(want.c_str(), &end, 0);
      const bool number = !want.empty() && *end == '\0' && is_count(v) && v.get<uint64_t>() == n;
      // A size as the text prints it selects too: `mrlen 8KiB` (any case).
      if (!number && !(is_size(k) && same_word(size_text(v), want))) return false;
    } else if (!same_word(text_of(v), want)) {
      return false;  // words match in any case: `state rts`, `type rc`
    }
  }
  return true;
}

Status check_keys(const std::string& type, const Filters& filters) {
  const auto& keys = fields_of(type);
  for (const auto& [k, v] : filters) {
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) {
      return error(EINVAL,
                   fmt::format("unknown filter \"{}\"; valid: {}", k, fmt::join(keys, ", ")));
    }
  }
  return Status::ok();
}

json filtered(const json& rows, const Filters& filters) {
  json out = json::array();
  if (!rows.is_array()) return out;
  for (const auto& r : rows)
    if (matches(r, filters)) out.push_back(r);
  return out;
}

/// An MR's access bits as ibv_access_flags names without the prefix, comma-separated (no spaces:
/// a text line stays KEY VALUE pairs); bits without a name in hex.
std::string access_text(uint64_t bits) {
  static constexpr std::pair<uint64_t, const char*> kNames[] = {
      {1u << 0, "LOCAL_WRITE"},   {1u << 1, "REMOTE_WRITE"}, {1u << 2, "REMOTE_READ"},
      {1u << 3, "REMOTE_ATOMIC"}, {1u << 4, "MW_BIND"},      {1u << 5, "ZERO_BASED"},
      {1u << 6, "ON_DEMAND"},     {1u << 7, "HUGETLB"},      {1u << 20, "RELAXED_ORDERING"},
  };
  std::string out;
  for (auto [bit, name] : kNames) {
    if ((bits & bit) == 0) continue;
    out += fmt::format("{}{}", out.empty() ? "" : ",", name);
    bits &= ~bit;
  }
  if (bits != 0) out += fmt::format("{}0x{:x}", out.empty() ? "" : ",", bits);
  return out.empty() ? "LOCAL_READ" : out;  // every MR may be read locally
}

std::string errors_text(const json& counters) {
  std::string s;
  for (const auto& [status, n] : member(counters, "wc_errors").items())
    s += fmt::format("{}{}={}", s.empty() ? "" : ",", status, text_of(n));
  return s.empty() ? "-" : s;
}

std::string duration(uint64_t s) {
  if (s >= 86400) return fmt::format("{}d{}h{}m", s / 86400, s / 3600 % 24, s / 60 % 60);
  if (s >= 3600) return fmt::format("{}h{}m{}s", s / 3600, s / 60 % 60, s % 60);
  if (s >= 60) return fmt::format("{}m{}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

}  // namespace

std::string id_text(const json& v) {
  return is_count(v) ? fmt::format("{:#x}", v.get<uint64_t>()) : text_of(v);
}

std::string size_text(const json& v) {
  if (!is_count(v)) return text_of(v);
  const uint64_t n = v.get<uint64_t>();
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  size_t u = 0;
  while (u + 1 < std::size(kUnits) && n >= (uint64_t{1} << (10 * (u + 1)))) ++u;
  if (u == 0) return fmt::format("{}B", n);
  const uint64_t unit = uint64_t{1} << (10 * u);
  if (n % unit == 0) return fmt::format("{}{}", n / unit, kUnits[u]);
  return fmt::format("{:.1f}{}", static_cast<double>(n) / static_cast<double>(unit), kUnits[u]);
}

Result<Filters> parse_filters(const std::vector<std::string>& words) {
  if (words.size() % 2 != 0)
    return error(EINVAL, fmt::format("filter \"{}\" has no value (filters are KEY VALUE pairs, "
                                     "e.g. guest NAME lqpn N)",
                                     words.back()));
  Filters f;
  for (size_t i = 0; i < words.size(); i += 2) {
    auto alias = filter_aliases().find(words[i]);
    f.emplace_back(alias == filter_aliases().end() ? words[i] : alias->second, words[i + 1]);
  }
  return f;
}

Result<json> res_rows(const json& status, const std::string& type, const Filters& filters) {
  if (fields_of(type).empty() || type.starts_with("stat"))
    return error(
        EINVAL,
        fmt::format("unknown resource \"{}\"; one of: qp, cq, mr, pd, srq, dm, mw, xrcd", type));
  RETURN_IF_ERROR(check_keys(type, filters));
  return filtered(member(member(status, "res"), type.c_str()), filters);
}

std::string res_text(const std::string& type, const json& rows, bool details) {
  std::string out;
  for (const auto& r : rows) {
    std::string line = "vrdma0";
    for (const auto& k : fields_of(type)) {
      const json& v = member(r, k.c_str());
      if (v.is_null() || (v.is_string() && v.get<std::string>().empty())) continue;
      if ((k == "lkey" || k == "rkey" || k == "iova") && v.is_number_integer()) {
        line += fmt::format(" {} 0x{:x}", k, v.get<uint64_t>());
      } else if (is_id(k)) {
        line += fmt::format(" {} {}", k, id_text(v));
      } else if (is_size(k)) {
        line += fmt::format(" {} {}", k, size_text(v));
      } else if (k == "access" && v.is_number_unsigned()) {
        line += fmt::format(" {} {}", k, access_text(v.get<uint64_t>()));
      } else {
        line += fmt::format(" {} {}", k, text_of(v));
      }
      if (k == "transport" && details) {
        if (auto why = text_of(member(r, "transport_why")); why != "-" && !why.empty())
          line += fmt::format(" ({})", why);
      }
    }
    out += line + "\n";
  }
  return out;
}

std::string res_summary(const json& status) {
  std::string out;
  for (const auto& g : member(status, "guests")) {
    const json& res = member(g, "resources");
    out += fmt::format(
        "vrdma0 guest {} lid {}: pd {} mr {} cq {} srq {} qp {}\n", text_of(member(g, "guest")),
        id_text(member(g, "lid")), text_of(member(res, "pd")), text_of(member(res, "mr")),
        text_of(member(res, "cq")), text_of(member(res, "srq")), text_of(member(res, "qp")));
  }
  return out;
}

Result<json> stat_rows(const json& status, const std::string& what, const Filters& filters) {
  if (what != "qp" && what != "guest")
    return error(EINVAL, fmt::format("unknown counter set \"{}\"; one of: qp, guest", what));
  RETURN_IF_ERROR(check_keys("stat-" + what, filters));
  json rows = json::array();
  if (what == "qp") {
    for (const auto& q : member(member(status, "res"), "qp")) {
      json r = json::object();
      for (const auto& k : fields_of("stat-qp")) r[k] = member(q, k.c_str());
      r.update(member(q, "counters"));
      rows.push_back(std::move(r));
    }
  } else {
    for (const auto& g : member(status, "guest_counters")) {
      json r = {{"guest", member(g, "guest")}, {"qp_count", member(g, "qp_count")}};
      if (g.contains("left_unix")) r["left_unix"] = g["left_unix"];  // a guest that left
      r.update(member(g, "counters"));
      rows.push_back(std::move(r));
    }
  }
  return filtered(rows, filters);
}

std::string stat_text(const std::string& what, const json& rows) {
  const bool qp = what == "qp";
  constexpr const char* kRow =
      "{:<16} {:>6} {:<4} {:<9} {:>10} {:>14} {:>10} {:>14} {:>7} {:>7} {:>8} {:>7}  {}\n";
  std::string out = fmt::format(kRow, "GUEST", qp ? "QPN" : "QPS", qp ? "TYPE" : "",
                                qp ? "TRANSPORT" : "", "MSGS_TX", "BYTES_TX", "MSGS_RX", "BYTES_RX",
                                "RETRIES", "REPLAYS", "RNR_NAKS", "UD_DROP", "ERRORS");
  for (const auto& r : rows) {
    const std::string who =
        text_of(member(r, "guest")) + (r.contains("left_unix") ? " (left)" : "");
    out += fmt::format(kRow, who, qp ? id_text(member(r, "qpn")) : text_of(member(r, "qp_count")),
                       qp ? text_of(member(r, "type")) : "",
                       qp ? text_of(member(r, "transport")) : "", text_of(member(r, "msgs_sent")),
                       size_text(member(r, "bytes_sent")), text_of(member(r, "msgs_received")),
                       size_text(member(r, "bytes_received")), text_of(member(r, "retries")),
                       text_of(member(r, "replays")), text_of(member(r, "rnr_naks")),
                       text_of(member(r, "ud_dropped")), errors_text(r));
  }
  return out;
}

namespace {

/// The TCP transport's entry of a status document, or null when it is not up.
const json& tcp_up(const json& status) {
  static const json none;
  for (const auto& t : member(member(status, "backend"), "transports"))
    if (member(t, "name") == "tcp" && member(t, "state") == "up") return t;
  return none;
}

/// Whether the backend of `status` has TCP up and `node` among its connected or known peers
/// (any node, with a directory: it looks the node up on the first frame).
bool tcp_knows(const json& status, const std::string& node) {
  const json& t = tcp_up(status);
  if (t.is_null()) return false;
  if (t.contains("directory")) return true;
  for (const auto& p : member(t, "peers"))
    if (member(p, "node") == node) return true;
  for (const auto& n : member(t, "known"))
    if (n == node) return true;
  return false;
}

std::string backend_name(const json& status) {
  const json& b = member(status, "backend");
  return fmt::format("{} (node {})", text_of(member(b, "socket")), text_of(member(b, "node")));
}

}  // namespace

std::string stranded_by_move(const json& from, const json& to, const std::string& guest) {
  std::map<uint64_t, std::string> here, there;  // LID -> guest
  for (const auto& g : member(from, "guests"))
    if (is_count(member(g, "lid")))
      here[member(g, "lid").get<uint64_t>()] = text_of(member(g, "guest"));
  for (const auto& g : member(to, "guests"))
    if (is_count(member(g, "lid")))
      there[member(g, "lid").get<uint64_t>()] = text_of(member(g, "guest"));
  const std::string from_node = text_of(member(member(from, "backend"), "node"));
  const std::string to_node = text_of(member(member(to, "backend"), "node"));
  const std::string src = text_of(member(member(from, "backend"), "socket"));
  const std::string dst = text_of(member(member(to, "backend"), "socket"));
  for (const auto& q : member(member(from, "res"), "qp")) {
    const json& state = member(q, "state");
    if (member(q, "guest") != guest || !is_count(member(q, "dlid")) ||
        !(state == "RTR" || state == "RTS" || state == "SQD" || state == "SQE"))
      continue;
    const uint64_t dlid = member(q, "dlid").get<uint64_t>();
    if (there.contains(dlid)) continue;  // its peer is on the target: same host from then on
    auto local = here.find(dlid);
    if (local != here.end() && local->second == guest) continue;  // within the guest
    const std::string qp = fmt::format("QP {}", id_text(member(q, "qpn")));
    std::string why;
    if (local != here.end()) {
      const std::string peer = fmt::format("guest {}, which stays on {}", local->second, src);
      const char* no_tcp = "{} is connected to {}; {} has no TCP transport (no [transport] listen)";
      if (tcp_up(from).is_null())
        why = fmt::format(fmt::runtime(no_tcp), qp, peer, src);
      else if (tcp_up(to).is_null())
        why = fmt::format(fmt::runtime(no_tcp), qp, peer, dst);
      else if (!tcp_knows(to, from_node) && !tcp_knows(from, to_node))
        why = fmt::format(
            "{} is connected to {}, and neither backend knows the other's node "
            "({}, {}) as a TCP peer",
            qp, peer, from_node, to_node);
    } else if (const std::string node = text_of(member(q, "peer_node"));
               node != "-" && !node.empty()) {
      const std::string peer = fmt::format("a guest on node {}", node);
      if (tcp_up(to).is_null())
        why = fmt::format("{} is connected to {}; {} has no TCP transport (no [transport] listen)",
                          qp, peer, dst);
      else if (node != to_node && !tcp_knows(to, node))
        why = fmt::format("{} is connected to {}, which {} does not know as a TCP peer", qp, peer,
                          dst);
    }
    if (!why.empty())
      return fmt::format("moving guest {} from {} to {} would strand its connections: {}", guest,
                         backend_name(from), backend_name(to), why);
  }
  return "";
}

// long-function: one line of the status page per setting, in the order the page shows them.
std::string status_header(const json& status) {
  const json& b = member(status, "backend");
  std::string out = fmt::format(
      "backend: {} (vrdmad {}, pid {}, node {}, up {})\n", text_of(member(b, "socket")),
      text_of(member(b, "version")), text_of(member(b, "pid")), text_of(member(b, "node")),
      duration(member(b, "uptime_s").is_number_unsigned() ? member(b, "uptime_s").get<uint64_t>()
                                                          : 0));
  const json& idle = member(b, "idle_exit_s");
  out += fmt::format(
      "config: {}; log {} (level {}); idle exit {}{}\n",
      member(b, "config_file").is_string() ? text_of(member(b, "config_file"))
                                           : std::string("no file (defaults and flags)"),
      text_of(member(b, "log")), text_of(member(b, "log_level")),
      idle.is_number() && idle != 0 ? text_of(idle) + " s without guests" : std::string("never"),
      member(b, "on_demand") == true ? "; started on demand" : "");
  if (const json& k = member(b, "keep_state"); member(k, "enabled") == true) {
    // Under systemd, systemd restarts the backend and counts the restarts itself.
    out += fmt::format("keep_state: on, keeper pid {}, {}, grace {} s\n",
                       text_of(member(k, "keeper_pid")),
                       member(k, "restarted_by") == "systemd"
                           ? std::string("restarted by systemd (systemctl show -p NRestarts "
                                         "vrdmad)")
                           : text_of(member(k, "restarts")) + " restart(s) so far",
                       text_of(member(k, "grace_s")));
  } else {
    out += "keep_state: off\n";
  }
  out += fmt::format("direct paths: same host {}, across backends {}\n",
                     member(b, "direct_path") == true ? "on" : "off",
                     member(b, "direct_remote") == true ? "on" : "off");
  std::string transports;
  for (const auto& t : member(b, "transports")) {
    std::string why = text_of(member(t, "why"));
    if (const json& c = member(t, "connected"); c.is_array()) {
      std::string names;
      for (const auto& n : c) {
        if (!names.empty()) names += ' ';
        names += text_of(n);
      }
      why += fmt::format(", connected: {}", names.empty() ? "none" : names);
    }
    // Connections on demand: how many peers it knows, and how many connections it made and
    // closed for being idle.
    if (const json& k = member(t, "known"); k.is_array()) {
      const json& c = member(t, "connections");
      why += fmt::format(" of {} known (dials {}, idle closes {})", k.size(),
                         text_of(member(c, "dials")), text_of(member(c, "idle_closes")));
    }
    transports += fmt::format("{}{} {} ({})", transports.empty() ? "" : "; ",
                              text_of(member(t, "name")), text_of(member(t, "state")), why);
  }
  out += fmt::format("transports: {}\n", transports.empty() ? "-" : transports);
  std::string peers;
  const uint64_t now_s = static_cast<uint64_t>(::time(nullptr));
  auto ago = [&](const json& t) {
    const uint64_t at = t.is_number_unsigned() ? t.get<uint64_t>() : now_s;
    return duration(now_s > at ? now_s - at : 0);
  };
  for (const auto& p : member(b, "peer_states")) {
    if (!peers.empty()) peers += ", ";
    // Why it failed last (a refused or timed-out dial, a TLS handshake, a connection that ended).
    const json& err = member(p, "last_error");
    const json& failures = member(p, "failures");
    std::string last;
    if (err.is_string() && member(p, "last_error_unix").is_number())
      last = fmt::format("last error {} ago: {}", ago(member(p, "last_error_unix")), text_of(err));
    else if (err.is_string())
      last = text_of(err);
    if (member(p, "state") == "connected") {
      peers += fmt::format("{} (connected to {} for {}{})", text_of(member(p, "peer")),
                           text_of(member(p, "node")), ago(member(p, "since_unix")),
                           last.empty() ? "" : "; " + last);
    } else {
      peers += fmt::format("{} ({}{}{})", text_of(member(p, "peer")), text_of(member(p, "state")),
                           is_count(failures) && failures != 0
                               ? fmt::format(", {} failed attempt(s)", text_of(failures))
                               : std::string(),
                           last.empty() ? "" : "; " + last);
    }
  }
  out += fmt::format("peers: {}\n", peers.empty() ? "none" : peers);
  for (const auto& t : member(b, "transports")) {
    if (!t.contains("security")) continue;
    // Who each connected peer proved to be, and what the transport turned away.
    for (const auto& p : member(t, "peers")) {
      const json& since = member(p, "since_unix");
      const uint64_t at = since.is_number_unsigned() ? since.get<uint64_t>() : 0;
      const uint64_t now = static_cast<uint64_t>(::time(nullptr));
      out +=
          fmt::format("  peer {} at {}: {}, {}, for {}\n", text_of(member(p, "node")),
                      text_of(member(p, "address")),
                      member(p, "identity") == "" ? std::string("NOT authenticated")
                                                  : "certificate " + text_of(member(p, "identity")),
                      text_of(member(p, "cipher")), duration(now > at ? now - at : 0));
    }
    std::string refused;
    for (const auto& [k, v] : member(t, "refused").items()) {
      if (v != 0) refused += fmt::format("{}{} {}", refused.empty() ? "" : ", ", k, text_of(v));
    }
    out += fmt::format("  security: {}; refused: {}\n", text_of(member(t, "security")),
                       refused.empty() ? "nothing" : refused);
  }
  const json& d = member(b, "datapath");
  auto num = [](const json& v) { return v.is_number() ? v.get<double>() : 0.0; };
  out += fmt::format(
      "datapath: {} thread, busy {:.1f}% since start, {:.1f}% since the last "
      "query; polls idle rings {} us before sleeping\n",
      text_of(member(d, "threads")), num(member(d, "busy_pct")), num(member(d, "busy_pct_recent")),
      text_of(member(d, "spin_us")));
  const json& m = member(b, "metrics");
  const std::string listen = text_of(member(m, "listen"));
  out += fmt::format("metrics: {}\n", member(m, "enabled") != true ? std::string("off")
                                      : listen.starts_with("unix:")
                                          ? listen
                                          : fmt::format("http://{}/metrics", listen));
  // Quotas are per guest: show each next to the most any guest holds.
  const json& q = member(b, "quotas");
  std::map<std::string, uint64_t> most;
  for (const auto& g : member(status, "guests")) {
    for (const auto& [k, v] : member(g, "resources").items())
      if (v.is_number_unsigned()) most[k] = std::max(most[k], v.get<uint64_t>());
  }
  std::string quotas;
  for (const char* k : {"pd", "mr", "cq", "srq", "qp"}) {
    quotas +=
        fmt::format("{}{} {}/{}", quotas.empty() ? "" : ", ", k, most[k], text_of(member(q, k)));
  }
  for (const std::string k : {"mr_bytes", "segment", "segment_bytes"}) {
    std::string name = k;
    std::replace(name.begin(), name.end(), '_', ' ');
    const bool bytes = k.ends_with("_bytes");
    quotas += fmt::format(", {} {}/{}", name, bytes ? size_text(most[k]) : std::to_string(most[k]),
                          bytes ? size_text(member(q, k.c_str())) : text_of(member(q, k.c_str())));
  }
  out += fmt::format("quotas per guest (most used/limit): {}; queue depth {}\n", quotas,
                     text_of(member(q, "queue_depth")));
  // Not per guest: the segment bytes of the guests shown, against the cap for all guests.
  out += fmt::format("mapped bytes (guests shown/limit for all guests): {}/{}\n",
                     size_text(member(member(status, "totals"), "segment_bytes")),
                     size_text(member(q, "mapped_bytes")));
  // A caller that is not an admin gets a cut-down document (backend/report.h, visible_status).
  if (const json& v = member(status, "view"); member(v, "admin") == false) {
    out += fmt::format("view: uid {}: its own guests only, without {}\n", text_of(member(v, "uid")),
                       "MR keys and addresses (root and the backend's user see everything)");
  }
  return out;
}

}  // namespace vrdma::cli
