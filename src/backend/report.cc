#include "backend/report.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "common/log.h"
#include "engine/omitted_rows.h"
#include "proto/ring.h"

#ifndef VRDMA_VERSION
#define VRDMA_VERSION "unknown"
#endif

namespace vrdma::backend {

namespace {

using proto::clock_ns;

double pct(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
}

/// The value of `--config FILE` (or `--config=FILE`) on the backend's command line; "" for none.
std::string config_file_of(const std::vector<std::string>& argv) {
  for (size_t i = 1; i < argv.size(); ++i) {
    if (argv[i] == "--config" && i + 1 < argv.size()) return argv[i + 1];
    if (argv[i].starts_with("--config=")) return argv[i].substr(9);
  }
  return "";
}

/// Where this process's stderr, and so its log, goes: a file's path, or what /proc says of a
/// pipe or socket (journald's stream under systemd).
std::string log_target() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/fd/2", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("-");
}

/// The first line of `path`, as a number; 0 when missing or not one.
uint64_t number_in(const std::string& path) {
  std::ifstream in(path);
  uint64_t v = 0;
  return in >> v ? v : 0;
}

}  // namespace

Reporter::Reporter(const Config& cfg)
    : cfg_(cfg),
      start_wall_s_(static_cast<uint64_t>(::time(nullptr))),
      start_mono_ns_(clock_ns(CLOCK_MONOTONIC)),
      last_mono_ns_(start_mono_ns_),
      last_cpu_ns_(0) {}

nlohmann::json Reporter::backend_info() {
  // The engine is one thread and this runs on it, so the thread's CPU clock is the data path's.
  const uint64_t mono = clock_ns(CLOCK_MONOTONIC);
  const uint64_t cpu = clock_ns(CLOCK_THREAD_CPUTIME_ID);
  const double busy_recent = pct(cpu - last_cpu_ns_, mono - last_mono_ns_);
  last_mono_ns_ = mono;
  last_cpu_ns_ = cpu;
  const engine::Quotas& q = cfg_.quotas;
  nlohmann::json transports = nlohmann::json::array();
  // `state`: "up" (the TCP transport runs: listening, dialing its peers) or "off".
  transports.push_back({{"name", "shm"}, {"state", "up"}, {"why", "same-host pairs"}});
  nlohmann::json tcp = {{"name", "tcp"}, {"state", connected_peers_ ? "up" : "off"},
                        {"listen", cfg_.listen}};
  if (connected_peers_) {
    tcp["connected"] = connected_peers_();
    tcp["why"] = cfg_.force == "tcp" ? "forced for every pair" : "cross-host pairs";
    if (transport_details_) tcp.update(transport_details_());
  } else {
    tcp["why"] = "no [transport] listen";
  }
  transports.push_back(tcp);
  // Each configured peer: connected (as which node, since when), connecting or not, and why its
  // last attempt failed or its last connection ended (the transport's dial, TcpTransport::dials).
  nlohmann::json peer_states = nlohmann::json::array();
  const nlohmann::json live = tcp.value("peers", nlohmann::json::array());
  const nlohmann::json dials = peer_dials_ ? peer_dials_() : nlohmann::json::array();
  for (const std::string& p : cfg_.peers) {
    const size_t at = p.find('@');
    const std::string node = at == std::string::npos ? "" : p.substr(0, at);
    const std::string addr = at == std::string::npos ? p : p.substr(at + 1);
    nlohmann::json ps = {{"peer", p}, {"state", "not connected"}};
    for (const auto& l : live) {
      if (!l.is_object()) continue;
      if (node.empty() ? l.value("address", "") != addr : l.value("node", "") != node) continue;
      ps["state"] = "connected";
      ps["node"] = l.value("node", "");
      ps["since_unix"] = l.value("since_unix", uint64_t{0});
    }
    for (const auto& d : dials) {
      if (d.value("address", "") != addr || d.value("node", "") != node) continue;
      if (ps["state"] != "connected") ps["state"] = d.value("state", "not connected");
      ps["failures"] = d.value("failures", uint64_t{0});
      if (!d.value("last_error", "").empty()) {
        ps["last_error"] = d["last_error"];
        ps["last_error_unix"] = d.value("last_error_unix", uint64_t{0});
      }
    }
    if (!connected_peers_) ps["last_error"] = "the TCP transport is off (no [transport] listen)";
    peer_states.push_back(std::move(ps));
  }
  // keep_state: the keeper writes its pid beside its socket (backend/keeper.h); it passes how
  // many times it started a backend again to the one it starts. Under systemd, systemd
  // restarts the backend and counts (NRestarts), so there is no count here.
  nlohmann::json keep = {{"enabled", cfg_.keep_state}};
  if (cfg_.keep_state) {
    const char* restarts = std::getenv("VRDMA_KEEPER_RESTARTS");
    keep["grace_s"] = cfg_.keep_state_grace_s;
    keep["keeper_pid"] = number_in(cfg_.socket_path + ".keeper.pid");
    keep["restarted_by"] = activated_ ? "systemd" : "keeper";
    if (!activated_) keep["restarts"] = restarts ? std::strtoull(restarts, nullptr, 10) : 0;
  }
  const std::string config_file = config_file_of(cfg_.self_argv);
  return {
      {"version", VRDMA_VERSION},
      {"pid", ::getpid()},
      {"node", cfg_.node},
      {"socket", cfg_.socket_path},
      {"started_unix", start_wall_s_},
      {"uptime_s", (mono - start_mono_ns_) / 1000000000ull},
      {"on_demand", on_demand_},  // started by `vrdma run` or the library, not by an operator
      {"idle_exit_s", cfg_.idle_exit_s},
      // The effective configuration: built-in defaults < the file < flags.
      {"config_file", config_file.empty() ? nlohmann::json(nullptr) : nlohmann::json(config_file)},
      {"log", log_target()},
      {"log_level", cfg_.log_level},
      {"keep_state", keep},
      {"direct_path", cfg_.direct_path},
      {"direct_remote", cfg_.direct_remote},
      {"peer_states", peer_states},
      {"quotas",
       {{"pd", q.max_pds},
        {"qp", q.max_qps},
        {"cq", q.max_cqs},
        {"srq", q.max_srqs},
        {"mr", q.max_mrs},
        {"mr_bytes", q.max_mr_bytes},
        {"queue_depth", q.max_queue_depth},
        {"segment", q.max_segments},
        {"segment_bytes", q.max_segment_bytes},
        // Not per guest: all guests' segment bytes together (totals.segment_bytes).
        {"mapped_bytes", q.max_mapped_bytes}}},
      {"transports", transports},
      {"force", cfg_.force},
      {"peers", cfg_.peers},
      {"metrics", {{"enabled", cfg_.metrics_enabled}, {"listen", cfg_.metrics_listen}}},
      {"datapath",
       {{"threads", 1},
        {"spin_us", cfg_.spin_us},
        {"cpu_s", static_cast<double>(cpu) / 1e9},
        {"busy_pct", pct(cpu, mono - start_mono_ns_)},
        {"busy_pct_recent", busy_recent},
        // Times the loop went over 100 ms without looking at its work (not scheduled).
        {"stalls", stalls_},
        {"stall_max_ms", stall_max_ns_ / 1000000}}},
  };
}

void use_operator_names(nlohmann::json& doc) {
  // (engine name, operator name) for the rows of each part of the document.
  using Renames = std::vector<std::pair<const char*, const char*>>;
  auto rename = [](nlohmann::json& rows, const Renames& names) {
    if (!rows.is_array()) return;
    for (auto& r : rows) {
      if (!r.is_object()) continue;
      for (const auto& [from, to] : names) {
        auto it = r.find(from);
        if (it == r.end()) continue;
        nlohmann::json v = std::move(*it);
        r.erase(from);
        r[to] = std::move(v);
      }
    }
  };
  if (auto g = doc.find("guests"); g != doc.end()) rename(*g, {{"name", "guest"}});
  if (auto g = doc.find("guest_counters"); g != doc.end()) rename(*g, {{"qps", "qp_count"}});
  if (auto res = doc.find("res"); res != doc.end() && res->is_object()) {
    if (auto qp = res->find("qp"); qp != res->end())
      rename(*qp, {{"lqpn", "qpn"},
                   {"rqpn", "dest_qpn"},
                   {"sq-psn", "sq_psn"},
                   {"rq-psn", "rq_psn"},
                   {"sq-cqn", "sq_cqn"},
                   {"rq-cqn", "rq_cqn"}});
  }
}

nlohmann::json Reporter::status(const engine::Device& dev, bool lists) {
  nlohmann::json j = nlohmann::json::parse(dev.status_json(lists));
  j.update(dev.report(lists));
  use_operator_names(j);
  j["backend"] = backend_info();
  return j;
}

namespace {

/// Above this many QPs the status document has no lists of objects (their rows would not fit
/// one response, and rendering them would hold the engine thread for a second).
constexpr size_t kStatusListQps = 1000;

bool status_lists(const engine::Device& dev) { return dev.qp_total() <= kStatusListQps; }

/// A status document too large for one response (many objects other than QPs): everything but the
/// lists of objects (`res`, each guest's `qps`), counted as above kStatusListQps QPs (per guest
/// in `res_omitted`, each guest's `qps_omitted`), so that `vrdma status` keeps working.
std::string summarised(nlohmann::json doc, std::string whole) {
  constexpr size_t kMaxBytes = proto::kMaxResponse - sizeof(proto::MsgHeader) - sizeof(uint32_t);
  if (whole.size() <= kMaxBytes) return whole;
  if (auto res = doc.find("res"); res != doc.end() && res->is_object()) {
    engine::OmittedRows omitted;
    for (auto& [type, rows] : res->items()) {
      if (!rows.is_array()) continue;
      for (const auto& r : rows) omitted.add(r.value("guest", std::string()), type, 1);
      rows = nlohmann::json::array();
    }
    doc["res_omitted"] = omitted.rows();
  }
  if (auto guests = doc.find("guests"); guests != doc.end() && guests->is_array()) {
    for (auto& g : *guests) {
      auto qps = g.find("qps");
      if (qps == g.end() || !qps->is_array()) continue;
      g["qps_omitted"] = qps->size();
      *qps = nlohmann::json::array();
    }
  }
  return doc.dump();
}

}  // namespace

const Reporter::View& Reporter::status_for(const engine::Device& dev, const Viewer& v,
                                           uint64_t now_ns) {
  auto view_of = [&v](const nlohmann::json& whole) {
    nlohmann::json doc = visible_status(whole, v);
    const auto g = doc.find("guests");
    const size_t guests = g != doc.end() && g->is_array() ? g->size() : 0;
    std::string text = doc.dump();
    return View{summarised(std::move(doc), std::move(text)), guests};
  };
  if (v.admin) {
    ++status_renders_;
    admin_status_ = view_of(status(dev, status_lists(dev)));
    return admin_status_;
  }
  const uint64_t interval_ns = uint64_t(cfg_.status_min_interval_ms) * 1000000ull;
  if (!have_status_snapshot_ || now_ns - status_at_ns_ >= interval_ns ||
      changed_uids_.count(v.uid) != 0) {
    status_snapshot_ = status(dev, status_lists(dev));
    status_at_ns_ = now_ns;
    have_status_snapshot_ = true;
    ++status_renders_;
    status_views_.clear();
    changed_uids_.clear();  // the snapshot has every change so far
  }
  auto it = status_views_.find(v.uid);
  if (it == status_views_.end()) it = status_views_.emplace(v.uid, view_of(status_snapshot_)).first;
  return it->second;
}

std::string Reporter::metrics(const engine::Device& dev, uint64_t now_ns, const Viewer& v) {
  const uint64_t interval_ns = uint64_t(cfg_.metrics_min_interval_ms) * 1000000ull;
  if (metrics_renders_ == 0 || now_ns - metrics_at_ns_ >= interval_ns) {
    // The lists only for the series per QP (the rest are sums), and those only up to
    // kStatusListQps QPs, as in status: tens of thousands of series would hold the engine
    // thread for seconds per scrape.
    metrics_snapshot_ = status(dev, cfg_.metrics_per_qp && status_lists(dev));
    process_text_ = process_metrics();
    metrics_text_ =
        prometheus_text(metrics_snapshot_, cfg_.metrics_guest_names, cfg_.metrics_per_qp) +
        process_text_;
    metrics_views_.clear();
    metrics_at_ns_ = now_ns;
    ++metrics_renders_;
    VLOG_DEBUG("metrics: new snapshot of {} bytes", metrics_text_.size());
  }
  if (v.admin) return metrics_text_;
  auto it = metrics_views_.find(v.uid);
  if (it == metrics_views_.end()) {
    it = metrics_views_
             .emplace(v.uid, prometheus_text(visible_status(metrics_snapshot_, v),
                                             cfg_.metrics_guest_names, cfg_.metrics_per_qp) +
                                 process_text_)
             .first;
    VLOG_DEBUG("metrics: uid {} sees its own guests only ({} bytes)", v.uid, it->second.size());
  }
  return it->second;
}

nlohmann::json visible_status(nlohmann::json j, const Viewer& v) {
  using nlohmann::json;
  if (v.admin) {
    j["view"] = {{"uid", v.uid}, {"admin", true}};
    return j;
  }
  // Members by reference (a missing or mistyped one reads as empty): no temporaries to iterate.
  static const json kNoArray = json::array(), kNoObject = json::object();
  auto arr = [](const json& o, const char* k) -> const json& {
    auto it = o.find(k);
    return it != o.end() && it->is_array() ? *it : kNoArray;
  };
  auto obj = [](const json& o, const char* k) -> const json& {
    auto it = o.find(k);
    return it != o.end() && it->is_object() ? *it : kNoObject;
  };
  // Totals count what this viewer sees, so they agree with the rows it gets.
  json totals = json::object();
  for (const auto& [k, n] : obj(j, "totals").items()) totals[k] = 0;
  totals["guests"] = 0;
  totals["sessions"] = 0;
  std::set<std::string> mine;
  json guests = json::array();
  for (const json& g : arr(j, "guests")) {
    if (!g.is_object() || v.uid == engine::kNoUid || g.value("uid", engine::kNoUid) != v.uid)
      continue;
    mine.insert(g.value("guest", std::string()));
    totals["guests"] = totals["guests"].get<uint64_t>() + 1;
    totals["sessions"] = totals["sessions"].get<uint64_t>() + arr(g, "sessions").size();
    for (const auto& [kind, n] : obj(g, "resources").items()) {
      if (n.is_number_unsigned())
        totals[kind] = totals.value(kind, uint64_t{0}) + n.get<uint64_t>();
    }
    guests.push_back(g);
  }
  auto own = [&](const json& row) {
    return row.is_object() && mine.count(row.value("guest", std::string())) != 0;
  };
  // Keys open memory; addresses tell where it is. The owner's process knows both already.
  static constexpr const char* kSecret[] = {"lkey", "rkey", "iova"};
  json res = json::object();
  for (const auto& [type, rows] : obj(j, "res").items()) {
    json kept = json::array();
    if (rows.is_array()) {
      for (const json& r : rows) {
        if (!own(r)) continue;
        json row = r;
        for (const char* k : kSecret) row.erase(k);
        kept.push_back(std::move(row));
      }
    }
    res[type] = std::move(kept);
  }
  // Above kStatusListQps QPs: how many rows each of its guests has, not the others'.
  if (j.contains("res_omitted")) {
    json omitted = json::array();
    for (const json& r : arr(j, "res_omitted"))
      if (own(r)) omitted.push_back(r);
    j["res_omitted"] = std::move(omitted);
  }
  json counters = json::array();
  for (const json& g : arr(j, "guest_counters")) {
    const bool left_own = g.is_object() && g.contains("left_unix") && v.uid != engine::kNoUid &&
                          g.value("uid", engine::kNoUid) == v.uid;
    if (g.contains("left_unix") ? left_own : own(g)) counters.push_back(g);
  }
  j.erase("backend_counters");  // all guests' together: the admin's
  j["guests"] = std::move(guests);
  j["totals"] = std::move(totals);
  j["res"] = std::move(res);
  j["guest_counters"] = std::move(counters);
  j["view"] = {
      {"uid", v.uid}, {"admin", false}, {"hidden", "other users' guests; MR keys and addresses"}};
  return j;
}

namespace {

/// A label value as the text format wants it: backslash, quote and newline escaped.
std::string escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string str(const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

/// A LID or QPN in 0x hex, as the CLI's text and the log lines print them.
std::string id(const nlohmann::json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 ? fmt::format("{:#x}", v.get<uint64_t>())
                                                        : str(v);
}

/// Collects samples per metric family, so each family's HELP/TYPE comes once, before its samples.
class Exposition {
 public:
  void family(const std::string& name, const char* type, const char* help) {
    out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  void sample(const std::string& name,
              const std::vector<std::pair<std::string, std::string>>& labels,
              const nlohmann::json& value) {
    out_ += name;
    if (!labels.empty()) {
      out_ += '{';
      for (size_t i = 0; i < labels.size(); ++i) {
        out_ += fmt::format("{}{}=\"{}\"", i ? "," : "", labels[i].first, escape(labels[i].second));
      }
      out_ += '}';
    }
    out_ += ' ';
    out_ += value.is_number() ? value.dump() : "0";
    out_ += '\n';
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

using Labels = std::vector<std::pair<std::string, std::string>>;

/// The counters of counters_json(), one family each, for a list of (labels, counters) rows.
void counter_families(Exposition& e, const std::string& prefix,
                      const std::vector<std::pair<Labels, nlohmann::json>>& rows) {
  // (key in counters_json(), metric name after the prefix and before _total, help): what is
  // counted, then its unit (Prometheus' naming), so each metric has one unit.
  static const std::tuple<const char*, const char*, const char*> kCounters[] = {
      {"msgs_sent", "sent_messages", "messages sent"},
      {"bytes_sent", "sent_bytes", "payload bytes sent"},
      {"msgs_received", "received_messages", "messages received"},
      {"bytes_received", "received_bytes", "payload bytes received"},
      {"retries", "retries", "transport retries after an ACK timeout"},
      {"rnr_naks", "received_rnr_naks", "RNR NAKs received"},
      {"ud_dropped", "dropped_ud_datagrams",
       "UD datagrams dropped (no receive, wrong qkey or no QP)"},
      {"replays", "replayed_messages",
       "messages sent again across backends (reconnect, ACK timeout, NAK)"},
      {"replayed_bytes", "replayed_bytes", "payload bytes sent again across backends"},
      {"seq_naks", "received_seq_naks", "sequence-error NAKs received across backends"},
      {"naks_sent", "sent_naks", "NAKs sent across backends as responder (RNR, sequence, fault)"},
      {"held", "held_waits", "times new work waited for the QP's queued frames to go out"},
  };
  for (auto [key, metric, help] : kCounters) {
    const std::string name = prefix + metric + "_total";
    e.family(name, "counter", help);
    for (const auto& [labels, c] : rows) e.sample(name, labels, c.value(key, nlohmann::json(0)));
  }
  const std::string name = prefix + "wc_errors_total";
  e.family(name, "counter", "error completions by ibv_wc_status");
  for (const auto& [labels, c] : rows) {
    const nlohmann::json errs = c.value("wc_errors", nlohmann::json::object());
    for (const auto& [status, n] : errs.items()) {
      Labels l = labels;
      l.emplace_back("status", status);
      e.sample(name, l, n);
    }
  }
}

/// Splits a row of counts and byte sizes (`{"mr": 2, "mr_bytes": 8192}`) into the two metrics
/// (`NAME{...,LABEL="mr"} 2`, `BYTES_NAME{...,LABEL="mr"} 8192`): one unit per metric.
void counts_and_bytes(Exposition& e, const std::string& name, const char* help,
                      const std::string& bytes_name, const char* bytes_help,
                      const std::string& label,
                      const std::vector<std::pair<Labels, nlohmann::json>>& rows) {
  e.family(name, "gauge", help);
  for (const auto& [labels, row] : rows) {
    for (const auto& [k, v] : row.items()) {
      if (k.ends_with("_bytes")) continue;
      Labels l = labels;
      l.emplace_back(label, k);
      e.sample(name, l, v);
    }
  }
  e.family(bytes_name, "gauge", bytes_help);
  for (const auto& [labels, row] : rows) {
    for (const auto& [k, v] : row.items()) {
      if (!k.ends_with("_bytes")) continue;
      Labels l = labels;
      l.emplace_back(label, k.substr(0, k.size() - 6));
      e.sample(bytes_name, l, v);
    }
  }
}

/// The directory on etcd (EtcdDirectory::status_json): its operations, how far behind its
/// watch runs, its lease, and what it knows of the cluster.
void directory_metrics(Exposition& e, const nlohmann::json& d) {
  const nlohmann::json& cnt = d.at("counters");
  static const std::pair<const char*, const char*> kCounters[] = {
      {"requests", "requests to etcd (kv, txn, lease, watch)"},
      {"failures", "requests to etcd that no member answered"},
      {"registrations", "times this backend registered (a new lease)"},
      {"watch_events", "changes the watch delivered"},
      {"lid_conflicts", "guests whose LID another node held (not published)"},
      {"moves_here", "guests taken over from another node by compare-and-swap"},
  };
  for (const auto& [key, help] : kCounters) {
    const std::string name = fmt::format("vrdma_directory_{}_total", key);
    e.family(name, "counter", help);
    e.sample(name, {}, cnt.value(key, nlohmann::json(0)));
  }
  e.family("vrdma_directory_reachable", "gauge", "1 while the last exchange with etcd worked");
  e.sample("vrdma_directory_reachable", {}, d.value("reachable", false) ? 1 : 0);
  e.family("vrdma_directory_registered", "gauge", "1 while registered under a live lease");
  e.sample("vrdma_directory_registered", {}, d.value("registered", false) ? 1 : 0);
  e.family("vrdma_directory_lease_age_seconds", "gauge",
           "how long this backend's current lease has been kept (0: not registered)");
  e.sample("vrdma_directory_lease_age_seconds", {}, d.value("lease_age_s", nlohmann::json(0)));
  if (d.contains("watch_lag_ms")) {
    e.family("vrdma_directory_watch_lag_seconds", "gauge",
             "from this backend's last write of its node entry until its watch saw it");
    e.sample("vrdma_directory_watch_lag_seconds", {}, d.at("watch_lag_ms").get<double>() / 1000.0);
  }
  const nlohmann::json& nodes = d.at("nodes");
  e.family("vrdma_directory_nodes", "gauge",
           "nodes registered in the directory, this one included");
  e.sample("vrdma_directory_nodes", {}, nodes.size());
  e.family("vrdma_directory_node_qps", "gauge", "QPs of each node, as it last wrote them");
  for (const auto& n : nodes)
    e.sample("vrdma_directory_node_qps", {{"node", str(n.at("node"))}},
             n.value("qps", nlohmann::json(0)));
  e.family("vrdma_directory_node_guests", "gauge", "guests each node holds in the directory");
  for (const auto& n : nodes)
    e.sample("vrdma_directory_node_guests", {{"node", str(n.at("node"))}},
             n.value("guests", nlohmann::json::array()).size());
}

}  // namespace

std::string process_metrics() {
  Exposition e;
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  const double cpu = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                     static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
  e.family("process_cpu_seconds_total", "counter", "user and system CPU time of the backend");
  e.sample("process_cpu_seconds_total", {}, cpu);
  // statm: size, then resident, in pages.
  std::ifstream statm("/proc/self/statm");
  uint64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  e.family("process_resident_memory_bytes", "gauge", "resident memory of the backend");
  e.sample("process_resident_memory_bytes", {},
           resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)));
  std::error_code ec;
  uint64_t fds = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end;
       it.increment(ec))
    ++fds;
  e.family("process_open_fds", "gauge", "open file descriptors of the backend");
  e.sample("process_open_fds", {}, fds);
  e.family("process_max_fds", "gauge", "the backend's limit of open file descriptors");
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  e.sample("process_max_fds", {}, static_cast<uint64_t>(rl.rlim_cur));
  // /proc/self/stat field 22: start time in clock ticks after boot (btime in /proc/stat). The
  // command (field 2) is in parentheses and may hold spaces: count from its closing one.
  std::ifstream stat_in("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_in)), std::istreambuf_iterator<char>());
  std::istringstream fields(stat.substr(stat.rfind(')') + 1));
  std::string f;
  uint64_t start_ticks = 0;
  for (int i = 3; fields >> f; ++i) {
    if (i == 22) {
      start_ticks = std::strtoull(f.c_str(), nullptr, 10);
      break;
    }
  }
  std::ifstream proc_stat("/proc/stat");
  uint64_t btime = 0;
  for (std::string key; proc_stat >> key;) {
    if (key == "btime") {
      proc_stat >> btime;
      break;
    }
  }
  e.family("process_start_time_seconds", "gauge", "when the backend started, in Unix time");
  e.sample("process_start_time_seconds", {},
           static_cast<double>(btime) +
               static_cast<double>(start_ticks) / static_cast<double>(::sysconf(_SC_CLK_TCK)));
  return e.take();
}

std::string prometheus_text(const nlohmann::json& j, bool guest_names, bool per_qp) {
  static const nlohmann::json kNoRows = nlohmann::json::array();
  // A guest's label: its name only when the operator asked for names (a name is whatever its
  // user chose, and says who runs what); else its LID, unique on this backend.
  std::map<std::string, std::string> lid_label;
  for (const auto& g : j.at("guests")) {
    if (g.contains("lid")) lid_label[str(g.at("guest"))] = "lid-" + id(g.at("lid"));
  }
  auto guest = [&](const nlohmann::json& name) {
    if (guest_names) return str(name);
    auto it = lid_label.find(str(name));
    return it == lid_label.end() ? std::string("-") : it->second;
  };
  Exposition e;
  const nlohmann::json& b = j.at("backend");
  e.family("vrdma_build_info", "gauge", "backend version and node (value is always 1)");
  e.sample("vrdma_build_info", {{"version", str(b.at("version"))}, {"node", str(b.at("node"))}}, 1);
  e.family("vrdma_start_time_seconds", "gauge", "when the backend started, in Unix time");
  e.sample("vrdma_start_time_seconds", {}, b.at("started_unix"));
  e.family("vrdma_datapath_cpu_seconds_total", "counter", "CPU time of the data-path thread");
  e.sample("vrdma_datapath_cpu_seconds_total", {{"thread", "0"}}, b.at("datapath").at("cpu_s"));
  e.family("vrdma_datapath_stalls_total", "counter",
           "times the data path went over 100 ms without looking at its work (not scheduled)");
  e.sample("vrdma_datapath_stalls_total", {{"thread", "0"}},
           b.at("datapath").value("stalls", uint64_t{0}));
  for (const auto& tr : b.value("transports", nlohmann::json::array())) {
    if (!tr.contains("refused")) continue;
    e.family("vrdma_transport_refused_total", "counter",
             "what the TCP transport turned away, by reason (handshake: no or a wrong credential; "
             "name: a Hello under a name not its certificate's or not allowed; pending: over the "
             "cap of unauthenticated connections or too slow; directory: a claim on another "
             "node's LID/GID; frames: from a node that is not the QP's peer)");
    for (const auto& [k, v] : tr.at("refused").items())
      e.sample("vrdma_transport_refused_total", {{"reason", k}}, v);
    e.family("vrdma_transport_peers", "gauge", "connected peer backends, by how they are secured");
    e.sample("vrdma_transport_peers", {{"security", str(tr.at("security"))}},
             tr.at("peers").size());
    e.family("vrdma_transport_known_peers", "gauge",
             "peer backends this one may talk to (directory nodes, named static peers)");
    e.sample("vrdma_transport_known_peers", {}, tr.value("known", nlohmann::json::array()).size());
    const nlohmann::json conns = tr.value("connections", nlohmann::json::object());
    e.family("vrdma_transport_dials_total", "counter",
             "connections to peer backends started (on demand: by the first frame for a peer)");
    e.sample("vrdma_transport_dials_total", {}, conns.value("dials", uint64_t{0}));
    e.family("vrdma_transport_idle_closes_total", "counter",
             "peer connections closed by agreement for being idle ([transport] idle_close_s)");
    e.sample("vrdma_transport_idle_closes_total", {}, conns.value("idle_closes", uint64_t{0}));
    // Per peer backend: what waits here, what its TCP has not acknowledged, what was taken back.
    static const std::tuple<const char*, const char*, const char*, const char*> kPeer[] = {
        {"vrdma_transport_peer_queued_bytes", "gauge", "queued_bytes",
         "bytes queued for the peer here, not yet written to its connection"},
        {"vrdma_transport_peer_unacked_bytes", "gauge", "unacked_bytes",
         "bytes written to the peer's connection that its TCP has not acknowledged"},
        {"vrdma_transport_peer_received_bytes_total", "counter", "rx_bytes",
         "bytes received from the peer on its current connection"},
        {"vrdma_transport_peer_dropped_bytes_total", "counter", "dropped_bytes",
         "queued bytes taken back because their QP failed or went away (current connection)"},
    };
    for (const auto& [name, type, key, help] : kPeer) {
      e.family(name, type, help);
      for (const auto& p : tr.at("peers"))
        e.sample(name, {{"node", str(p.at("node"))}}, p.value(key, nlohmann::json(0)));
    }
    if (auto d = tr.find("directory"); d != tr.end() && d->value("kind", "") == "etcd")
      directory_metrics(e, *d);
  }
  counts_and_bytes(e, "vrdma_quota", "per-guest limit of each kind of resource",
                   "vrdma_quota_bytes",
                   "per-guest limit of each kind of memory (mapped: all guests' segments together)",
                   "resource", {{Labels{}, b.at("quotas")}});

  const nlohmann::json& t = j.at("totals");
  e.family("vrdma_guests", "gauge", "guests with at least one session");
  e.sample("vrdma_guests", {}, t.at("guests"));
  e.family("vrdma_sessions", "gauge", "open device contexts");
  e.sample("vrdma_sessions", {}, t.at("sessions"));
  e.family("vrdma_mapped_bytes", "gauge",
           "segment bytes the backend maps for all guests (limit: vrdma_quota mapped_bytes)");
  e.sample("vrdma_mapped_bytes", {}, t.value("segment_bytes", nlohmann::json(0)));
  std::vector<std::pair<Labels, nlohmann::json>> held;
  for (const auto& g : j.at("guests"))
    held.emplace_back(Labels{{"guest", guest(g.at("guest"))}}, g.at("resources"));
  counts_and_bytes(e, "vrdma_resources", "resources held, per guest and kind",
                   "vrdma_resource_bytes", "memory held, per guest and kind", "kind", held);

  std::vector<std::pair<Labels, nlohmann::json>> guests, qps;
  for (const auto& g : j.at("guest_counters")) {
    if (g.contains("left_unix")) continue;  // counted in the backend's totals below
    guests.emplace_back(Labels{{"guest", guest(g.at("guest"))}}, g.at("counters"));
  }
  // Every guest's, those that left included: they never go down while the backend runs.
  if (j.contains("backend_counters"))
    counter_families(e, "vrdma_backend_", {{Labels{}, j.at("backend_counters")}});
  // Series per QP: as many as QPs, and each QP's go when it does ([metrics] per_qp = false).
  for (const auto& q : per_qp ? j.at("res").at("qp") : kNoRows) {
    qps.emplace_back(Labels{{"guest", guest(q.at("guest"))},
                            {"qpn", id(q.at("qpn"))},
                            {"type", str(q.at("type"))},
                            {"transport", str(q.at("transport"))}},
                     q.at("counters"));
  }
  counter_families(e, "vrdma_guest_", guests);
  if (per_qp) counter_families(e, "vrdma_qp_", qps);
  return e.take();
}

}  // namespace vrdma::backend
