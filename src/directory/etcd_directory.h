// The directory on etcd ([directory] etcd): this backend registers itself (node name, transport
// address, credential fingerprint) under a lease it keeps alive, writes its guests (name, LID,
// GID, owning node, generation) under that lease, and watches the prefix for the others. A LID
// is claimed with a create-if-absent txn (cluster-unique); a guest's move is a compare-and-swap
// of its entry from the old node to the new. Layout under `prefix` (values are JSON):
//   nodes/NODE   {"node","address","fingerprint","registered_unix","qps"}
//   guests/NAME  {"name","lid","gid","node","generation"}
//   lids/LLLL    the guest's name (LLLL: the LID in hex)
// Two threads talk to etcd (a worker: registration, keepalive, guests; a watcher: range + watch);
// the engine thread reads a copy of what they saw and takes the changes with poll().
// When etcd is unreachable the copy stays (existing QPs keep their routes), a LID or GID not in it
// is "not located", and the worker registers again once etcd answers.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/log.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "directory/etcd.h"
#include "transport/directory.h"

namespace vrdma::directory {

using Clock = std::chrono::steady_clock;

class EtcdDirectory final : public transport::Directory {
 public:
  struct Options {
    EtcdOptions etcd;
    std::string prefix = "/vrdma/";
    std::string node;         ///< this backend's name
    std::string address;      ///< where peers dial its transport, "ADDR:PORT"
    std::string fingerprint;  ///< SHA-256 of its certificate ("" without TLS)
    int lease_s = 5;          ///< its entries vanish this long after it stops keeping them
    /// A guest that left is deleted from etcd this much later (a move's destination takes
    /// the entry over meanwhile).
    int leave_delay_ms = 1000;
  };
  /// What the engine thread learns from poll().
  struct Change {
    enum class Kind { kPeerUp, kPeerDown, kGuestMoved };
    Kind kind;
    std::string node;     ///< the peer, or the guest's new owner
    std::string address;  ///< kPeerUp: where to dial it
    transport::GuestInfo guest;
  };

  /// Starts the threads; registration happens in the background (status says when).
  static Result<std::unique_ptr<EtcdDirectory>> start(Options o);
  ~EtcdDirectory() override;

  /// Readable (an eventfd) when poll() has changes to hand out.
  int fd() const { return wake_.get(); }
  /// Hands the changes seen since the last call to `fn`. Engine thread.
  void poll(const std::function<void(const Change&)>& fn);

  void announce(const transport::GuestInfo& g, bool up) override;
  std::string locate_lid(uint16_t lid) const override;
  std::string locate_gid(const uint8_t gid[16]) const override;
  std::string unavailable() const override;
  std::string fingerprint_of(const std::string& node) const override;

  /// This backend's QP count, for its node entry: written there with the next keepalive when it
  /// changed (so at most every third of the lease). Any thread.
  void set_qps(uint64_t n) { qps_.store(n, std::memory_order_relaxed); }

  /// True while the last exchange with etcd worked.
  bool reachable() const { return reachable_.load(std::memory_order_relaxed); }
  /// True once this backend is registered under a live lease.
  bool registered() const { return registered_.load(std::memory_order_relaxed); }
  /// The cluster as last seen: nodes (address, fingerprint, lease), their guests, this
  /// backend's state toward etcd (`vrdma cluster status`).
  nlohmann::json status_json() const;

 private:
  struct NodeEntry {
    std::string node, address, fingerprint;
    uint64_t registered_unix = 0;
    int64_t lease = 0;
    int64_t ttl_left = -1;  ///< the lease's TTL left when last asked (-1: not asked yet)
    uint64_t qps = 0;       ///< its QP count as it last wrote it
  };
  struct GuestEntry {
    transport::GuestInfo info;
    std::string node;
    uint64_t generation = 0;
    int64_t mod_revision = 0;
  };

  explicit EtcdDirectory(Options o);
  void worker();
  void watcher();
  /// Grants a lease, writes the node entry and every local guest under it.
  Status register_self(EtcdClient& c);
  /// Writes this backend's node entry under `lease` (registration, or a new QP count).
  Status put_node(EtcdClient& c, int64_t lease, uint64_t registered_unix, uint64_t qps);
  /// Writes guest `g` as ours: created (claiming its LID), refreshed, or moved here by CAS.
  Status put_guest(EtcdClient& c, const transport::GuestInfo& g);
  Status remove_guest(EtcdClient& c, const transport::GuestInfo& g);
  /// Asks etcd the TTL left of every known node's lease (status).
  void refresh_ttls(EtcdClient& c);
  /// Applies one key's new value (or its deletion) to the copy; queues what the engine hears.
  /// Called with mu_ held.
  void apply(const std::string& key, const std::string& value, int64_t mod_revision, bool deleted,
             int64_t lease = 0);
  /// The copy becomes exactly `kvs` (after a fresh range). Called with mu_ held.
  void reset(const std::vector<KeyValue>& kvs);
  /// Takes what a client's last call learnt (reachable or not) unless the other thread's client
  /// learnt something later: a success that ended before a failure was seen says nothing of now.
  void note(const EtcdClient::Heard& h);
  void wake();
  std::string key(const char* kind, const std::string& name) const {
    return opt_.prefix + kind + "/" + name;
  }

  Options opt_;
  UniqueFd wake_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> reachable_{false};
  std::atomic<bool> registered_{false};
  std::atomic<uint64_t> qps_{0};  ///< set_qps
  uint64_t qps_written_ = 0;      ///< the count in our node entry (worker thread)
  /// One client per thread (created before them, so status can read their counters).
  std::unique_ptr<EtcdClient> work_client_, watch_client_;
  std::thread worker_, watcher_;

  mutable std::mutex mu_;  ///< guards everything below
  std::condition_variable cv_;
  std::map<std::string, NodeEntry> nodes_;
  std::map<std::string, GuestEntry> guests_;           ///< by name
  std::map<uint16_t, std::string> lid_owner_;          ///< LID -> "NAME@NODE"
  std::map<std::array<uint8_t, 16>, std::string> gid_node_;  ///< GID -> owning node
  std::map<std::string, transport::GuestInfo> local_;  ///< our guests, by name
  std::deque<transport::GuestInfo> pending_;  ///< joins (and refreshes) not written yet, in order
  /// Guests that left, deleted from etcd once their time comes: a guest moving away is taken
  /// over by the destination's compare-and-swap meanwhile (its entry never vanishes, the
  /// generation counts the move), and a guest back here by then is not deleted at all.
  std::map<std::string, std::pair<transport::GuestInfo, std::chrono::steady_clock::time_point>>
      leaving_;                                        ///< local changes not written yet
  std::vector<Change> changes_;                        ///< for the engine's next poll()
  int64_t lease_ = 0;
  uint64_t registered_unix_ = 0;
  uint64_t unreachable_since_unix_ = 0;
  std::chrono::steady_clock::time_point heard_at_{};  ///< of the newest Heard taken (note)
  std::string last_error_;
  std::string endpoint_;
  struct Counters {
    uint64_t registrations = 0, watch_events = 0, conflicts = 0, moves = 0;
  } cnt_;
  int64_t watch_revision_ = 0;  ///< the store's revision the copy is at
  /// Watch lag: when our last write of our node entry began, until the watch shows it (then
  /// watch_lag_ms_ is how long that took: etcd's commit plus the watch's delivery).
  Clock::time_point self_put_at_{};
  int64_t watch_lag_ms_ = -1;               ///< -1: not measured yet
  log::Burst retry_log_{1'000'000'000, 5};  ///< the worker's own: refusals it tries again
};

}  // namespace vrdma::directory
