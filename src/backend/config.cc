#include "backend/config.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

namespace vrdma::backend {

namespace {

std::string where(const std::string& origin, const toml::node& n) {
  return fmt::format("{}:{}", origin, n.source().begin.line);
}

/// One key of a section: how to read it into the config.
using Setter = std::function<Status(const toml::node&, const std::string& at)>;

template <typename T>
Setter integer(T& out, int64_t lo, int64_t hi) {
  return [&out, lo, hi](const toml::node& n, const std::string& at) -> Status {
    auto v = n.value<int64_t>();
    if (!n.is_integer() || !v) return error(EINVAL, at + ": expected an integer");
    if (*v < lo || *v > hi)
      return error(EINVAL, fmt::format("{}: {} is out of range [{}, {}]", at, *v, lo, hi));
    out = static_cast<T>(*v);
    return Status::ok();
  };
}

Setter string(std::string& out, std::vector<std::string> allowed = {}) {
  return [&out, allowed](const toml::node& n, const std::string& at) -> Status {
    if (!n.is_string()) return error(EINVAL, at + ": expected a string");
    std::string v = *n.value<std::string>();
    if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
      return error(EINVAL, fmt::format("{}: \"{}\" is not one of: {}", at, v,
                                       fmt::join(allowed, ", ")));
    }
    out = std::move(v);
    return Status::ok();
  };
}

Setter boolean(bool& out) {
  return [&out](const toml::node& n, const std::string& at) -> Status {
    if (!n.is_boolean()) return error(EINVAL, at + ": expected true or false");
    out = *n.value<bool>();
    return Status::ok();
  };
}

Setter string_list(std::vector<std::string>& out) {
  return [&out](const toml::node& n, const std::string& at) -> Status {
    const toml::array* a = n.as_array();
    if (!a) return error(EINVAL, at + ": expected an array of strings");
    std::vector<std::string> v;
    for (const toml::node& e : *a) {
      if (!e.is_string()) return error(EINVAL, at + ": expected an array of strings");
      v.push_back(*e.value<std::string>());
    }
    out = std::move(v);
    return Status::ok();
  };
}

/// An array of arrays of strings (`[["a", "b"], ["c", "d"]]`).
Setter string_groups(std::vector<std::vector<std::string>>& out) {
  return [&out](const toml::node& n, const std::string& at) -> Status {
    const toml::array* a = n.as_array();
    std::vector<std::vector<std::string>> v;
    for (size_t i = 0; a && i < a->size(); ++i) {
      v.emplace_back();
      if (!string_list(v.back())((*a)[i], at).is_ok()) a = nullptr;
    }
    if (!a) return error(EINVAL, at + ": expected an array of arrays of strings");
    out = std::move(v);
    return Status::ok();
  };
}

/// "ADDR:PORT" with a port in 1..65535 (IPv6 addresses in brackets).
Setter endpoint(std::string& out, bool empty_ok) {
  return [&out, empty_ok](const toml::node& n, const std::string& at) -> Status {
    if (!n.is_string()) return error(EINVAL, at + ": expected \"ADDR:PORT\"");
    std::string v = *n.value<std::string>();
    if (v.empty() && empty_ok) {
      out.clear();
      return Status::ok();
    }
    auto colon = v.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 ||
        std::sscanf(v.c_str() + colon + 1, "%d", &port) != 1 || port < 1 || port > 65535)
      return error(EINVAL, fmt::format("{}: \"{}\" is not ADDR:PORT", at, v));
    out = std::move(v);
    return Status::ok();
  };
}

/// The metrics endpoint: "ADDR:PORT", or "unix:" and an absolute path.
Setter metrics_endpoint(std::string& out) {
  return [&out](const toml::node& n, const std::string& at) -> Status {
    if (!n.is_string()) return error(EINVAL, at + ": expected \"ADDR:PORT\" or \"unix:PATH\"");
    std::string v = *n.value<std::string>();
    if (!v.starts_with("unix:")) return endpoint(out, false)(n, at);
    const std::string path = v.substr(5);
    if (path.empty() || path.front() != '/' || path.back() == '/')
      return error(EINVAL, fmt::format("{}: \"{}\": unix: needs an absolute path to a socket "
                                       "file (\"unix:/run/vrdma/metrics.sock\")",
                                       at, v));
    out = std::move(v);
    return Status::ok();
  };
}

/// A file mode in octal, as a string ("0600"): only read and write bits, and the owner's both.
Setter socket_mode(mode_t& out) {
  return [&out](const toml::node& n, const std::string& at) -> Status {
    const std::string v = n.is_string() ? *n.value<std::string>() : std::string();
    unsigned long m = 0;
    bool ok = n.is_string() && v.size() >= 3 && v.size() <= 4 &&
              v.find_first_not_of("01234567") == std::string::npos;
    if (ok) m = std::stoul(v, nullptr, 8);
    if (!ok || (m & ~0666ul) != 0 || (m & 0600) != 0600)
      return error(EINVAL, fmt::format("{}: expected an octal mode as a string, \"0600\" or "
                                       "\"0660\" (read and write bits only, the owner's both)",
                                       at));
    out = static_cast<mode_t>(m);
    return Status::ok();
  };
}

/// Levenshtein distance, for "did you mean" on a misspelt key.
size_t distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

/// " (did you mean X?)" for the closest of `names` within two edits of `word`, else "".
template <typename Map>
std::string suggestion(std::string_view word, const Map& names, const char* open = "",
                       const char* close = "") {
  std::string best;
  size_t best_d = 3;
  for (const auto& [name, unused] : names) {
    const size_t d = distance(word, name);
    if (d < best_d) {
      best_d = d;
      best = name;
    }
  }
  return best.empty() ? "" : fmt::format(" (did you mean {}{}{}?)", open, best, close);
}

}  // namespace

Status Config::load_string(std::string_view text, const std::string& origin) {
  toml::table root;
  try {
    root = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    return error(EINVAL, fmt::format("{}:{}: {}", origin, e.source().begin.line, e.description()));
  }
  // Everything goes into a copy first: a file with any error changes nothing.
  Config c = *this;
  engine::Quotas& q = c.quotas;
  const std::map<std::string, std::map<std::string, Setter>> schema = {
      {"backend",
       {{"socket", string(c.socket_path)},
        {"idle_exit_s", integer(c.idle_exit_s, 0, 86400 * 365)},
        {"log_level", string(c.log_level, {"debug", "info", "warn", "error"})},
        {"keep_state", boolean(c.keep_state)},
        {"keep_state_grace_s", integer(c.keep_state_grace_s, 1, 3600)},
        {"max_pending_connections", integer(c.max_pending_connections, 1, 1 << 20)},
        {"hello_timeout_ms", integer(c.hello_timeout_ms, 10, 3600 * 1000)},
        {"status_min_interval_ms", integer(c.status_min_interval_ms, 0, 60 * 1000)},
        {"max_mapped_bytes", integer(q.max_mapped_bytes, 1 << 20, int64_t{1} << 47)}}},
      {"datapath",
       {{"spin_us", integer(c.spin_us, 0, 10000000)},
        {"nice", integer(c.nice, -20, 19)},
        {"direct_path", boolean(c.direct_path)},
        {"direct_trust", string(c.direct_trust, {"kernel", "uid"})},
        {"direct_tenants", string_groups(c.direct_tenants)},
        {"direct_remote", boolean(c.direct_remote)}}},
      {"quotas",
       {{"max_pds", integer(q.max_pds, 1, 1 << 20)},
        {"max_qps", integer(q.max_qps, 1, 1 << 20)},
        {"max_cqs", integer(q.max_cqs, 1, 1 << 20)},
        {"max_srqs", integer(q.max_srqs, 1, 1 << 20)},
        {"max_mrs", integer(q.max_mrs, 1, 1 << 20)},
        {"max_mr_bytes", integer(q.max_mr_bytes, 4096, int64_t{1} << 50)},
        {"max_queue_depth", integer(q.max_queue_depth, 1, 1 << 20)},
        {"max_segments", integer(q.max_segments, 1, 1 << 20)},
        {"max_segment_bytes", integer(q.max_segment_bytes, 4096, int64_t{1} << 47)},
        {"max_dm_bytes", integer(q.max_dm_bytes, 0, int64_t{1} << 40)},
        {"max_mws", integer(q.max_mws, 1, 1 << 20)}}},
      {"transport",
       {{"node", string(c.node)},
        {"listen", endpoint(c.listen, true)},
        {"peers", string_list(c.peers)},
        {"force", string(c.force, {"", "tcp"})},
        {"idle_close_s", integer(c.idle_close_s, 0, 86400)},
        {"cluster_dir", string(c.cluster_dir)},
        {"ca", string(c.tls_ca)},
        {"cert", string(c.tls_cert)},
        {"key", string(c.tls_key)},
        {"insecure", boolean(c.insecure)}}},
      {"directory",
       {{"etcd", string_list(c.etcd)},
        {"ca", string(c.etcd_ca)},
        {"cert", string(c.etcd_cert)},
        {"key", string(c.etcd_key)},
        {"prefix", string(c.etcd_prefix)},
        {"lease_s", integer(c.etcd_lease_s, 2, 3600)},
        {"timeout_ms", integer(c.etcd_timeout_ms, 100, 60 * 1000)},
        {"advertise", endpoint(c.advertise, true)}}},
      {"metrics",
       {{"enabled", boolean(c.metrics_enabled)},
        {"listen", metrics_endpoint(c.metrics_listen)},
        {"socket_mode", socket_mode(c.metrics_socket_mode)},
        {"min_interval_ms", integer(c.metrics_min_interval_ms, 0, 3600 * 1000)},
        {"guest_names", boolean(c.metrics_guest_names)},
        {"per_qp", boolean(c.metrics_per_qp)}}},
  };
  for (const auto& [section, node] : root) {
    const std::string at = where(origin, node);
    auto sec = schema.find(std::string(section.str()));
    if (sec == schema.end()) {
      return error(EINVAL, fmt::format("{}: unknown section [{}]{}", at, section.str(),
                                       suggestion(section.str(), schema, "[", "]")));
    }
    const toml::table* t = node.as_table();
    if (!t) return error(EINVAL, fmt::format("{}: [{}] must be a table", at, section.str()));
    for (const auto& [key, value] : *t) {
      const std::string kat = where(origin, value);
      auto k = sec->second.find(std::string(key.str()));
      if (k == sec->second.end()) {
        // A key of another section, or a near miss of one of this section's.
        std::string hint = suggestion(key.str(), sec->second);
        for (const auto& [other, keys] : schema) {
          if (keys.count(std::string(key.str())))
            hint = fmt::format(" (it belongs in [{}])", other);
        }
        return error(EINVAL, fmt::format("{}: unknown key \"{}\" in [{}]{}", kat, key.str(),
                                         section.str(), hint));
      }
      RETURN_IF_ERROR(k->second(value, fmt::format("{}: {}.{}", kat, section.str(), key.str())));
    }
  }
  for (const std::string& p : c.peers) {
    toml::value<std::string> v(p.substr(p.find('@') + 1));  // "NODE@ADDR:PORT" names the node
    std::string tmp;
    RETURN_IF_ERROR(endpoint(tmp, false)(v, origin + ": transport.peers"));
  }
  for (const std::string& e : c.etcd) {
    if (!e.starts_with("http://") && !e.starts_with("https://"))
      return error(EINVAL, fmt::format("{}: directory.etcd: \"{}\" is not http://HOST:PORT or "
                                       "https://HOST:PORT",
                                       origin, e));
  }
  if (c.etcd_prefix.empty() || c.etcd_prefix.front() != '/')
    return error(EINVAL, origin + ": directory.prefix must start with '/'");
  *this = std::move(c);
  return Status::ok();
}

Status Config::load_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return error(ENOENT, "cannot read config file " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return load_string(ss.str(), path);
}

}  // namespace vrdma::backend
