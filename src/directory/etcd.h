// A small etcd v3 client over etcd's JSON gateway (/v3/kv/*, /v3/lease/*, /v3/watch; etcd 3.4
// serves it on the client port), with libcurl: what the directory on etcd needs and no more.
// Keys and values are bytes (the gateway's base64 is handled here). Every call is blocking and
// bounded by the client's timeout; a failed endpoint makes the next call try the next one.
// Concurrency: one EtcdClient per thread (it owns a curl handle); watch() blocks its thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace vrdma::directory {

struct EtcdOptions {
  std::vector<std::string> endpoints;  ///< "http://host:port" or "https://host:port"
  std::string ca, cert, key;           ///< TLS: CA bundle, client certificate and key (files)
  int timeout_ms = 2000;               ///< per request, connect included
};

struct KeyValue {
  std::string key, value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

/// One compare of a txn: key's `target` EQUAL to the value given.
struct Compare {
  enum class Target { kCreate, kMod, kValue };
  std::string key;
  Target target = Target::kCreate;
  int64_t revision = 0;  ///< kCreate / kMod
  std::string value;     ///< kValue
};

/// One operation of a txn (put, delete, or range of one key).
struct Op {
  enum class Kind { kPut, kDelete, kGet };
  Kind kind = Kind::kPut;
  std::string key, value;
  int64_t lease = 0;
};

struct TxnResult {
  bool succeeded = false;
  int64_t revision = 0;
  std::vector<KeyValue> kvs;  ///< of the kGet ops of the branch that ran, in order
};

/// A change seen by a watch.
struct WatchEvent {
  bool deleted = false;
  KeyValue kv;  ///< kv.value is empty for a delete
};

class EtcdClient {
 public:
  explicit EtcdClient(EtcdOptions o);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  /// Every key starting with `prefix` (or exactly `key` when !prefix); the store's revision
  /// in `revision`.
  Result<std::vector<KeyValue>> range(const std::string& key, bool prefix, int64_t* revision);
  /// Returns the store's revision after the put.
  Result<int64_t> put(const std::string& key, const std::string& value, int64_t lease = 0);
  Status del(const std::string& key);
  Result<TxnResult> txn(const std::vector<Compare>& cmp, const std::vector<Op>& success,
                        const std::vector<Op>& failure);
  /// A lease of `ttl_s` seconds: its ID.
  Result<int64_t> lease_grant(int64_t ttl_s);
  /// Refreshes a lease; its TTL left (0 or less: the lease is gone, ENOENT).
  Result<int64_t> lease_keepalive(int64_t id);
  Status lease_revoke(int64_t id);
  /// The TTL a lease has left (ENOENT when it has expired).
  Result<int64_t> lease_ttl(int64_t id);
  /// Watches every key under `prefix` from `start_revision`, calling `on` with each batch of
  /// events until it returns false, `stop` is set (looked at about every 100 ms), or the
  /// stream breaks (an error then). Blocks.
  Status watch(const std::string& prefix, int64_t start_revision,
               const std::function<bool(const std::vector<WatchEvent>&)>& on,
               const std::atomic<bool>& stop);

  /// Calls in progress give up (ECANCELED) soon after `*f` becomes true (about a second: curl's
  /// progress interval), so a thread blocked on an unreachable member can be stopped.
  void abort_on(const std::atomic<bool>* f) { abort_ = f; }

  /// Calls made (a watch counts once) and those that failed; any thread may read them.
  uint64_t requests() const { return requests_.load(std::memory_order_relaxed); }
  uint64_t failed() const { return failed_.load(std::memory_order_relaxed); }

  /// What the last call that ended learnt of etcd: when it ended, and whether a member answered
  /// it (any answer, an error of the request included) or none could be reached (`why`). A call
  /// abandoned (ECANCELED) leaves it as it was; `at` is zero before the first call ends. Several
  /// threads each with their own client order what they learnt by `at`, not by when they say it.
  struct Heard {
    std::chrono::steady_clock::time_point at{};
    bool answered = false;
    std::string why;  ///< of an unreachable etcd
  };
  const Heard& last_heard() const { return heard_; }

  /// The endpoint the last call used (status, logs).
  const std::string& endpoint() const { return opt_.endpoints[cur_]; }

 private:
  struct Curl;
  using Sink = size_t (*)(char*, size_t, size_t, void*);
  /// The curl handle reset and set for a POST of `body` to `path` on the current endpoint,
  /// its response going to `sink(out)` (the handle, as void*: curl stays out of this header).
  void* prepare(const std::string& path, const std::string& body, Sink sink, void* out);
  /// POSTs `body` to `path` on the current endpoint, then the others in turn: the response.
  Result<std::string> post(const std::string& path, const std::string& body);
  Result<std::string> post_once(const std::string& path, const std::string& body);

  EtcdOptions opt_;
  size_t cur_ = 0;
  std::unique_ptr<Curl> curl_;
  const std::atomic<bool>* abort_ = nullptr;
  std::atomic<uint64_t> requests_{0}, failed_{0};
  std::string url_;  ///< of the call in progress (curl keeps a pointer to it)
  Heard heard_;
};

/// The end of the range of keys with this prefix (etcd's range_end for a prefix).
std::string prefix_end(const std::string& prefix);

}  // namespace vrdma::directory
