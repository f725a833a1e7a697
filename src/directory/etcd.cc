#include "directory/etcd.h"

#include <curl/curl.h>
#include <fmt/format.h>
#include <openssl/evp.h>

#include <mutex>
#include <nlohmann/json.hpp>

namespace vrdma::directory {

namespace {

using nlohmann::json;

std::string b64(const std::string& s) {
  std::string out(4 * ((s.size() + 2) / 3), '\0');
  const int n =
      EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                      reinterpret_cast<const unsigned char*>(s.data()), static_cast<int>(s.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

std::string unb64(const std::string& s) {
  if (s.empty()) return {};
  std::string out(3 * s.size() / 4 + 3, '\0');
  const int n =
      EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                      reinterpret_cast<const unsigned char*>(s.data()), static_cast<int>(s.size()));
  if (n < 0) return {};
  size_t len = static_cast<size_t>(n);
  // EVP_DecodeBlock counts the padding's zero bytes in.
  for (size_t i = s.size(); i > 0 && s[i - 1] == '='; --i) --len;
  out.resize(len);
  return out;
}

/// The gateway writes 64-bit integers as strings, and leaves out the zero ones.
int64_t i64(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_string()) return std::stoll(it->get<std::string>());
  if (it->is_number()) return it->get<int64_t>();
  return 0;
}

KeyValue kv_of(const json& j) {
  KeyValue kv;
  kv.key = unb64(j.value("key", ""));
  kv.value = unb64(j.value("value", ""));
  kv.create_revision = i64(j, "create_revision");
  kv.mod_revision = i64(j, "mod_revision");
  kv.lease = i64(j, "lease");
  return kv;
}

json op_json(const Op& o) {
  switch (o.kind) {
    case Op::Kind::kPut: {
      json p = {{"key", b64(o.key)}, {"value", b64(o.value)}};
      if (o.lease) p["lease"] = std::to_string(o.lease);
      return {{"request_put", p}};
    }
    case Op::Kind::kDelete:
      return {{"request_delete_range", {{"key", b64(o.key)}}}};
    case Op::Kind::kGet:
      return {{"request_range", {{"key", b64(o.key)}}}};
  }
  return {};
}

size_t append(char* p, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(p, size * n);
  return size * n;
}

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

}  // namespace

std::string prefix_end(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(end.back() + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

struct EtcdClient::Curl {
  CURL* h = nullptr;
  curl_slist* headers = nullptr;
  ~Curl() {
    if (headers) curl_slist_free_all(headers);
    if (h) curl_easy_cleanup(h);
  }
};

EtcdClient::EtcdClient(EtcdOptions o) : opt_(std::move(o)), curl_(std::make_unique<Curl>()) {
  global_init();
  curl_->h = curl_easy_init();
  curl_->headers = curl_slist_append(nullptr, "Content-Type: application/json");
}

EtcdClient::~EtcdClient() = default;

void* EtcdClient::prepare(const std::string& path, const std::string& body, Sink sink, void* out) {
  CURL* h = curl_->h;
  curl_easy_reset(h);
  url_ = opt_.endpoints[cur_] + path;
  curl_easy_setopt(h, CURLOPT_URL, url_.c_str());
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, curl_->headers);
  curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(opt_.timeout_ms));
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, sink);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, out);
  if (!opt_.ca.empty()) curl_easy_setopt(h, CURLOPT_CAINFO, opt_.ca.c_str());
  if (!opt_.cert.empty()) curl_easy_setopt(h, CURLOPT_SSLCERT, opt_.cert.c_str());
  if (!opt_.key.empty()) curl_easy_setopt(h, CURLOPT_SSLKEY, opt_.key.c_str());
  return h;
}

Result<std::string> EtcdClient::post(const std::string& path, const std::string& body) {
  requests_.fetch_add(1, std::memory_order_relaxed);
  Result<std::string> r = post_once(path, body);
  if (!r.is_ok()) failed_.fetch_add(1, std::memory_order_relaxed);
  if (r.is_ok() || r.err() == ENOENT || r.err() == EPROTO)
    heard_ = {std::chrono::steady_clock::now(), true, {}};
  else if (r.err() == EHOSTUNREACH)
    heard_ = {std::chrono::steady_clock::now(), false, r.status().message()};
  return r;
}

Result<std::string> EtcdClient::post_once(const std::string& path, const std::string& body) {
  if (opt_.endpoints.empty()) return error(EINVAL, "etcd: no endpoints");
  if (!curl_->h) return error(ENOMEM, "etcd: curl_easy_init failed");
  std::string why;
  for (size_t tries = 0; tries < opt_.endpoints.size(); ++tries) {
    std::string out;
    CURL* h = static_cast<CURL*>(prepare(path, body, append, &out));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(opt_.timeout_ms));
    if (abort_) {
      curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
      curl_easy_setopt(h, CURLOPT_XFERINFODATA, abort_);
      curl_easy_setopt(
          h, CURLOPT_XFERINFOFUNCTION,
          +[](void* f, curl_off_t, curl_off_t, curl_off_t, curl_off_t) -> int {
            return static_cast<const std::atomic<bool>*>(f)->load() ? 1 : 0;
          });
    }
    const CURLcode rc = curl_easy_perform(h);
    if (rc == CURLE_ABORTED_BY_CALLBACK) return error(ECANCELED, "etcd: call abandoned");
    long code = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    if (rc == CURLE_OK && code == 200) return out;
    if (rc == CURLE_OK && code < 500) {
      // The store answered: an error of the request, not of the endpoint (5xx: the member
      // cannot serve now, no leader say: the next one may).
      std::string msg = out;
      try {
        msg = json::parse(out).value("error", out);
      } catch (const json::exception&) {
      }
      return error(code == 404 ? ENOENT : EPROTO,
                   fmt::format("etcd {}{}: HTTP {}: {}", opt_.endpoints[cur_], path, code, msg));
    }
    why += fmt::format("{}{}: {}", why.empty() ? "" : "; ", opt_.endpoints[cur_],
                       rc == CURLE_OK ? fmt::format("HTTP {}", code) : curl_easy_strerror(rc));
    cur_ = (cur_ + 1) % opt_.endpoints.size();
  }
  return error(EHOSTUNREACH, "etcd unreachable (" + why + ")");
}

namespace {
/// Parses a response body; EPROTO when it is not JSON.
Result<json> parse(const std::string& s) {
  try {
    return json::parse(s);
  } catch (const json::exception& e) {
    return error(EPROTO, std::string("etcd: bad response: ") + e.what());
  }
}
}  // namespace

Result<std::vector<KeyValue>> EtcdClient::range(const std::string& key, bool prefix,
                                                int64_t* revision) {
  json req = {{"key", b64(key)}};
  if (prefix) req["range_end"] = b64(prefix_end(key));
  ASSIGN_OR_RETURN(std::string body, post("/v3/kv/range", req.dump()));
  ASSIGN_OR_RETURN(json j, parse(body));
  std::vector<KeyValue> out;
  for (const json& kv : j.value("kvs", json::array())) out.push_back(kv_of(kv));
  if (revision) *revision = i64(j.value("header", json::object()), "revision");
  return out;
}

Result<int64_t> EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  json req = {{"key", b64(key)}, {"value", b64(value)}};
  if (lease) req["lease"] = std::to_string(lease);
  ASSIGN_OR_RETURN(std::string body, post("/v3/kv/put", req.dump()));
  ASSIGN_OR_RETURN(json j, parse(body));
  return i64(j.value("header", json::object()), "revision");
}

Status EtcdClient::del(const std::string& key) {
  auto r = post("/v3/kv/deleterange", json{{"key", b64(key)}}.dump());
  return r.status();
}

Result<TxnResult> EtcdClient::txn(const std::vector<Compare>& cmp, const std::vector<Op>& success,
                                  const std::vector<Op>& failure) {
  json req = {{"compare", json::array()}, {"success", json::array()}, {"failure", json::array()}};
  for (const Compare& c : cmp) {
    json jc = {{"key", b64(c.key)}, {"result", "EQUAL"}};
    switch (c.target) {
      case Compare::Target::kCreate:
        jc["target"] = "CREATE";
        jc["create_revision"] = std::to_string(c.revision);
        break;
      case Compare::Target::kMod:
        jc["target"] = "MOD";
        jc["mod_revision"] = std::to_string(c.revision);
        break;
      case Compare::Target::kValue:
        jc["target"] = "VALUE";
        jc["value"] = b64(c.value);
        break;
    }
    req["compare"].push_back(jc);
  }
  for (const Op& o : success) req["success"].push_back(op_json(o));
  for (const Op& o : failure) req["failure"].push_back(op_json(o));
  ASSIGN_OR_RETURN(std::string body, post("/v3/kv/txn", req.dump()));
  ASSIGN_OR_RETURN(json j, parse(body));
  TxnResult r;
  r.succeeded = j.value("succeeded", false);
  r.revision = i64(j.value("header", json::object()), "revision");
  for (const json& resp : j.value("responses", json::array())) {
    auto it = resp.find("response_range");
    if (it == resp.end()) continue;
    const json kvs = it->value("kvs", json::array());
    r.kvs.push_back(kvs.empty() ? KeyValue{} : kv_of(kvs.front()));
  }
  return r;
}

Result<int64_t> EtcdClient::lease_grant(int64_t ttl_s) {
  ASSIGN_OR_RETURN(std::string body, post("/v3/lease/grant", json{{"TTL", ttl_s}}.dump()));
  ASSIGN_OR_RETURN(json j, parse(body));
  if (j.contains("error") || i64(j, "ID") == 0)
    return error(EPROTO, "etcd: lease grant refused: " + j.value("error", body));
  return i64(j, "ID");
}

Result<int64_t> EtcdClient::lease_keepalive(int64_t id) {
  ASSIGN_OR_RETURN(std::string body,
                   post("/v3/lease/keepalive", json{{"ID", std::to_string(id)}}.dump()));
  // A stream of results: the first is ours.
  ASSIGN_OR_RETURN(json j, parse(body.substr(0, body.find('\n'))));
  const json r = j.value("result", json::object());
  const int64_t ttl = i64(r, "TTL");
  if (ttl <= 0) return error(ENOENT, fmt::format("etcd: lease {:x} has expired", id));
  return ttl;
}

Status EtcdClient::lease_revoke(int64_t id) {
  return post("/v3/lease/revoke", json{{"ID", std::to_string(id)}}.dump()).status();
}

Result<int64_t> EtcdClient::lease_ttl(int64_t id) {
  ASSIGN_OR_RETURN(std::string body,
                   post("/v3/lease/timetolive", json{{"ID", std::to_string(id)}}.dump()));
  ASSIGN_OR_RETURN(json j, parse(body));
  const int64_t ttl = i64(j, "TTL");
  if (ttl < 0) return error(ENOENT, fmt::format("etcd: lease {:x} has expired", id));
  return ttl;
}

Status EtcdClient::watch(const std::string& prefix, int64_t start_revision,
                         const std::function<bool(const std::vector<WatchEvent>&)>& on,
                         const std::atomic<bool>& stop) {
  if (opt_.endpoints.empty()) return error(EINVAL, "etcd: no endpoints");
  requests_.fetch_add(1, std::memory_order_relaxed);
  json create = {{"key", b64(prefix)}, {"range_end", b64(prefix_end(prefix))}};
  if (start_revision) create["start_revision"] = std::to_string(start_revision);
  const std::string body = json{{"create_request", create}}.dump();
  struct Stream {
    std::string buf;
    Status st;
    bool done = false;
    const std::function<bool(const std::vector<WatchEvent>&)>* on;
  } s{{}, Status::ok(), false, &on};
  // Each message of the stream is a JSON object on its own line.
  auto write = +[](char* p, size_t size, size_t n, void* arg) -> size_t {
    auto* s = static_cast<Stream*>(arg);
    s->buf.append(p, size * n);
    for (size_t nl; !s->done && (nl = s->buf.find('\n')) != std::string::npos;) {
      const std::string line = s->buf.substr(0, nl);
      s->buf.erase(0, nl + 1);
      if (line.empty()) continue;
      json j;
      try {
        j = json::parse(line);
      } catch (const json::exception& e) {
        s->st = error(EPROTO, std::string("etcd watch: bad message: ") + e.what());
        s->done = true;
        break;
      }
      const json r = j.value("result", json::object());
      if (j.contains("error") || r.value("canceled", false)) {
        s->st = error(ECANCELED, "etcd watch ended: " +
                                     (j.contains("error")
                                          ? j["error"].dump()
                                          : r.value("cancel_reason", std::string("canceled"))));
        s->done = true;
        break;
      }
      std::vector<WatchEvent> evs;
      for (const json& e : r.value("events", json::array())) {
        WatchEvent we;
        we.deleted = e.value("type", "") == "DELETE";
        we.kv = kv_of(e.value("kv", json::object()));
        evs.push_back(std::move(we));
      }
      if (!evs.empty() && !(*s->on)(evs)) s->done = true;
    }
    return s->done ? 0 : size * n;  // 0 ends the transfer
  };
  CURL* h = static_cast<CURL*>(prepare("/v3/watch", body, write, &s));
  // A member that is gone without a reset (its host is unreachable) ends the stream too.
  curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(h, CURLOPT_TCP_KEEPIDLE, 2L);
  curl_easy_setopt(h, CURLOPT_TCP_KEEPINTVL, 1L);
  CURLM* m = curl_multi_init();
  curl_multi_add_handle(m, h);
  int running = 1;
  CURLcode rc = CURLE_OK;
  while (running && !stop.load(std::memory_order_relaxed)) {
    curl_multi_perform(m, &running);
    int left = 0;
    while (CURLMsg* msg = curl_multi_info_read(m, &left)) {
      if (msg->msg == CURLMSG_DONE) rc = msg->data.result;
    }
    if (running) curl_multi_poll(m, nullptr, 0, 100, nullptr);
  }
  long code = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
  curl_multi_remove_handle(m, h);
  curl_multi_cleanup(m);
  if (stop.load(std::memory_order_relaxed) || (s.done && s.st.is_ok())) return Status::ok();
  failed_.fetch_add(1, std::memory_order_relaxed);
  if (!s.st.is_ok()) return s.st;
  const std::string where = opt_.endpoints[cur_];
  cur_ = (cur_ + 1) % opt_.endpoints.size();  // the next watch tries another member
  if (rc != CURLE_OK)
    return error(EHOSTUNREACH, fmt::format("etcd watch {}: {}", where, curl_easy_strerror(rc)));
  return error(EHOSTUNREACH, fmt::format("etcd watch {}: stream ended (HTTP {})", where, code));
}

}  // namespace vrdma::directory
