#include "directory/etcd_directory.h"

#include <fmt/format.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "common/log.h"

namespace vrdma::directory {

namespace {

using nlohmann::json;

std::string hex_gid(const uint8_t gid[16]) {
  std::string s;
  for (int i = 0; i < 16; ++i) s += fmt::format("{:02x}", gid[i]);
  return s;
}

bool parse_gid(const std::string& s, uint8_t out[16]) {
  if (s.size() != 32) return false;
  for (int i = 0; i < 16; ++i) {
    unsigned v = 0;
    if (std::sscanf(s.c_str() + 2 * i, "%2x", &v) != 1) return false;
    out[i] = static_cast<uint8_t>(v);
  }
  return true;
}

std::string lid_name(uint16_t lid) { return fmt::format("{:04x}", lid); }

/// A LID key's value: whose it is ("NAME@NODE": node names have no '@').
std::string lid_holder(const std::string& guest, const std::string& node) {
  return guest + "@" + node;
}

std::string guest_value(const transport::GuestInfo& g, const std::string& node, uint64_t gen) {
  return json{{"name", g.name},
              {"lid", g.lid},
              {"gid", hex_gid(g.gid)},
              {"node", node},
              {"generation", gen}}
      .dump();
}

/// A guest entry's value; false when it is not one.
bool parse_guest(const std::string& v, transport::GuestInfo& g, std::string& node, uint64_t& gen) {
  try {
    const json j = json::parse(v);
    g.name = j.at("name").get<std::string>();
    g.lid = j.at("lid").get<uint16_t>();
    node = j.at("node").get<std::string>();
    gen = j.value("generation", uint64_t{0});
    return parse_gid(j.at("gid").get<std::string>(), g.gid);
  } catch (const json::exception&) {
    return false;
  }
}

}  // namespace

EtcdDirectory::EtcdDirectory(Options o)
    : opt_(std::move(o)), wake_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

Result<std::unique_ptr<EtcdDirectory>> EtcdDirectory::start(Options o) {
  if (o.etcd.endpoints.empty()) return error(EINVAL, "[directory] etcd: no endpoints");
  for (const std::string& e : o.etcd.endpoints) {
    if (!e.starts_with("http://") && !e.starts_with("https://"))
      return error(EINVAL, fmt::format("[directory] etcd: \"{}\" is not http://HOST:PORT or "
                                       "https://HOST:PORT",
                                       e));
  }
  if (o.prefix.empty() || o.prefix.back() != '/') o.prefix += '/';
  // A request that waits on a member (say during an election) must leave time to try the next
  // and to keep the lease alive: a quarter of the lease at most.
  o.etcd.timeout_ms = std::min(o.etcd.timeout_ms, std::max(200, o.lease_s * 1000 / 4));
  std::unique_ptr<EtcdDirectory> d(new EtcdDirectory(std::move(o)));
  if (!d->wake_.valid()) return error(errno, "eventfd");
  d->endpoint_ = d->opt_.etcd.endpoints.front();
  d->work_client_ = std::make_unique<EtcdClient>(d->opt_.etcd);
  d->watch_client_ = std::make_unique<EtcdClient>(d->opt_.etcd);
  d->worker_ = std::thread([p = d.get()] { p->worker(); });
  d->watcher_ = std::thread([p = d.get()] { p->watcher(); });
  VLOG_INFO("directory: etcd at {} (prefix {}, lease {} s)",
            fmt::format("{}", fmt::join(d->opt_.etcd.endpoints, ", ")), d->opt_.prefix,
            d->opt_.lease_s);
  return d;
}

EtcdDirectory::~EtcdDirectory() {
  stop_ = true;
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  if (watcher_.joinable()) watcher_.join();
}

void EtcdDirectory::wake() {
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
}

void EtcdDirectory::note(const EtcdClient::Heard& h) {
  std::lock_guard<std::mutex> l(mu_);
  if (h.at == Clock::time_point{} || h.at < heard_at_) return;
  heard_at_ = h.at;
  if (!h.answered) {
    if (reachable_.exchange(false) || unreachable_since_unix_ == 0) {
      unreachable_since_unix_ = static_cast<uint64_t>(::time(nullptr));
      VLOG_WARN("directory: {}; routes already known stay, new lookups fail until it answers",
                h.why);
    }
    last_error_ = h.why;
    return;
  }
  if (!reachable_.exchange(true) && unreachable_since_unix_ != 0) {
    VLOG_INFO("directory: etcd answers again (unreachable for {} s)",
              static_cast<uint64_t>(::time(nullptr)) - unreachable_since_unix_);
  }
  unreachable_since_unix_ = 0;
}

Status EtcdDirectory::put_node(EtcdClient& c, int64_t lease, uint64_t registered_unix,
                               uint64_t qps) {
  const std::string v = json{
      {"node", opt_.node},
      {"address", opt_.address},
      {"fingerprint", opt_.fingerprint},
      {"registered_unix", registered_unix},
      {"qps", qps}}.dump();
  {
    std::lock_guard<std::mutex> l(mu_);
    self_put_at_ = Clock::now();
  }
  RETURN_IF_ERROR(c.put(key("nodes", opt_.node), v, lease).status());
  qps_written_ = qps;
  return Status::ok();
}

Status EtcdDirectory::register_self(EtcdClient& c) {
  ASSIGN_OR_RETURN(const int64_t lease, c.lease_grant(opt_.lease_s));
  const uint64_t now = static_cast<uint64_t>(::time(nullptr));
  // A backend of this name that died may still hold the entry under its old lease: ours
  // replaces it (the name is the certificate's).
  RETURN_IF_ERROR(put_node(c, lease, now, qps_.load(std::memory_order_relaxed)));
  std::vector<transport::GuestInfo> guests;
  {
    std::lock_guard<std::mutex> l(mu_);
    lease_ = lease;
    registered_unix_ = now;
    ++cnt_.registrations;
    endpoint_ = c.endpoint();
    for (const auto& [name, g] : local_) guests.push_back(g);
  }
  registered_ = true;
  VLOG_INFO("directory: registered as {} ({}) in etcd {}, lease {:x} ({} s)", opt_.node,
            opt_.address, c.endpoint(), lease, opt_.lease_s);
  for (const transport::GuestInfo& g : guests) {
    Status st = put_guest(c, g);
    if (st.err() == EHOSTUNREACH) return st;
  }
  return Status::ok();
}

Status EtcdDirectory::put_guest(EtcdClient& c, const transport::GuestInfo& g) {
  const std::string gkey = key("guests", g.name), lkey = key("lids", lid_name(g.lid));
  const std::string mine = lid_holder(g.name, opt_.node);
  int64_t lease;
  {
    std::lock_guard<std::mutex> l(mu_);
    lease = lease_;
  }
  for (int attempt = 0; attempt < 5; ++attempt) {
    ASSIGN_OR_RETURN(std::vector<KeyValue> cur, c.range(gkey, false, nullptr));
    ASSIGN_OR_RETURN(std::vector<KeyValue> lid, c.range(lkey, false, nullptr));
    if (!lid.empty() && !lid[0].value.starts_with(g.name + "@")) {
      std::lock_guard<std::mutex> l(mu_);
      ++cnt_.conflicts;
      VLOG_ERROR(
          "directory: LID {:#x} of guest {} is held by {} in etcd: not published "
          "(its peers cannot reach it by LID; GIDs still work)",
          g.lid, g.name, lid[0].value);
      return error(EADDRINUSE, fmt::format("LID {:#x} is held by {}", g.lid, lid[0].value));
    }
    std::vector<Compare> cmp;
    // The LID: still free, or still the one this guest holds (here or where it comes from).
    if (lid.empty())
      cmp.push_back({lkey, Compare::Target::kCreate, 0, {}});
    else
      cmp.push_back({lkey, Compare::Target::kMod, lid[0].mod_revision, {}});
    uint64_t gen = 1;
    std::string from;
    if (cur.empty()) {
      cmp.push_back({gkey, Compare::Target::kCreate, 0, {}});
    } else {
      // Ours already (a refresh, or a new lease), or a move: compare-and-swap from the entry
      // we read, so two nodes never both take it.
      transport::GuestInfo old;
      uint64_t old_gen = 0;
      if (!parse_guest(cur[0].value, old, from, old_gen)) from.clear();
      gen = from == opt_.node ? old_gen : old_gen + 1;
      cmp.push_back({gkey, Compare::Target::kMod, cur[0].mod_revision, {}});
    }
    const std::vector<Op> ops = {{Op::Kind::kPut, gkey, guest_value(g, opt_.node, gen), lease},
                                 {Op::Kind::kPut, lkey, mine, lease}};
    ASSIGN_OR_RETURN(TxnResult r, c.txn(cmp, ops, {}));
    if (!r.succeeded) continue;  // someone wrote between our read and the txn: read again
    if (!from.empty() && from != opt_.node) {
      std::lock_guard<std::mutex> l(mu_);
      ++cnt_.moves;
      VLOG_INFO("directory: guest {} moved from {} to {} (generation {})", g.name, from, opt_.node,
                gen);
    }
    return Status::ok();
  }
  return error(EAGAIN, fmt::format("directory: guest {}: its entry kept changing", g.name));
}

Status EtcdDirectory::remove_guest(EtcdClient& c, const transport::GuestInfo& g) {
  const std::string gkey = key("guests", g.name), lkey = key("lids", lid_name(g.lid));
  ASSIGN_OR_RETURN(std::vector<KeyValue> cur, c.range(gkey, false, nullptr));
  if (!cur.empty()) {
    transport::GuestInfo old;
    std::string node;
    uint64_t gen = 0;
    // Only our own entry: a guest that moved away is the new node's now.
    if (parse_guest(cur[0].value, old, node, gen) && node == opt_.node) {
      RETURN_IF_ERROR(c.txn({{gkey, Compare::Target::kMod, cur[0].mod_revision, {}}},
                            {{Op::Kind::kDelete, gkey, {}, 0}}, {})
                          .status());
    }
  }
  return c
      .txn({{lkey, Compare::Target::kValue, 0, lid_holder(g.name, opt_.node)}},
           {{Op::Kind::kDelete, lkey, {}, 0}}, {})
      .status();
}

void EtcdDirectory::refresh_ttls(EtcdClient& c) {
  std::vector<std::pair<std::string, int64_t>> leases;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (const auto& [n, e] : nodes_) leases.emplace_back(n, e.lease);
  }
  for (auto& [n, lease] : leases) {
    auto r = c.lease_ttl(lease);
    if (r.err() == EHOSTUNREACH || r.err() == ECANCELED) return;  // status can wait
    std::lock_guard<std::mutex> l(mu_);
    auto it = nodes_.find(n);
    if (it != nodes_.end() && it->second.lease == lease) it->second.ttl_left = r ? *r : -1;
  }
}

void EtcdDirectory::worker() {
  EtcdClient& c = *work_client_;
  c.abort_on(&stop_);
  const auto keep_every = std::chrono::milliseconds(std::max(opt_.lease_s * 1000 / 3, 200));
  const auto retry_every = std::chrono::milliseconds(300);
  auto next_keep = Clock::now();
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    l.unlock();
    Status st = Status::ok();
    if (!registered_) {
      st = register_self(c);
      next_keep = Clock::now() + keep_every;
    }
    // The lease first: a write that waits on etcd must not let it run out.
    if (st.is_ok() && registered_ && Clock::now() >= next_keep) {
      int64_t lease;
      {
        std::lock_guard<std::mutex> g(mu_);
        lease = lease_;
      }
      auto r = c.lease_keepalive(lease);
      if (r.err() == ENOENT) {
        // etcd was away longer than the lease: our entries are gone; everything again.
        VLOG_WARN("directory: lease {:x} expired; registering again", lease);
        registered_ = false;
        l.lock();
        continue;
      }
      st = r.status();
      if (st.is_ok()) {
        next_keep = Clock::now() + keep_every;
        refresh_ttls(c);
      }
      // The QP count rides with the keepalive: a write only when it changed.
      if (const uint64_t q = qps_.load(std::memory_order_relaxed);
          st.is_ok() && q != qps_written_) {
        uint64_t since;
        {
          std::lock_guard<std::mutex> g(mu_);
          since = registered_unix_;
        }
        st = put_node(c, lease, since, q);
      }
    }
    // Local guests' joins, in order, then the leaves whose time came, until the lease is due
    // again; one that fails for lack of etcd waits for the next try.
    auto more = [&] { return st.is_ok() && !stop_ && Clock::now() < next_keep; };
    while (more()) {
      transport::GuestInfo joined;
      {
        std::lock_guard<std::mutex> g(mu_);
        if (pending_.empty()) break;
        joined = pending_.front();
      }
      Status r = put_guest(c, joined);
      if (!r.is_ok() && r.err() != EADDRINUSE) {  // a LID clash is final (logged); else again
        st = r;
        break;
      }
      std::lock_guard<std::mutex> g(mu_);
      // (It may have left meanwhile: announce() took it out of the queue then.)
      if (!pending_.empty() && pending_.front().name == joined.name) pending_.pop_front();
    }
    while (more()) {
      transport::GuestInfo gone;
      {
        std::lock_guard<std::mutex> g(mu_);
        auto it = std::find_if(leaving_.begin(), leaving_.end(),
                               [](const auto& e) { return e.second.second <= Clock::now(); });
        if (it == leaving_.end()) break;
        gone = it->second.first;
      }
      Status r = remove_guest(c, gone);
      if (!r.is_ok()) {
        st = r;
        break;
      }
      std::lock_guard<std::mutex> g(mu_);
      if (auto it = leaving_.find(gone.name);
          it != leaving_.end() && it->second.second <= Clock::now())
        leaving_.erase(it);
    }
    // What the last call learnt, this round's calls in refresh_ttls included (it leaves `st`
    // as it was): reachable or not, ordered against the watcher's by when each call ended.
    if (st.err() != ECANCELED) note(c.last_heard());
    if (!st.is_ok() && st.err() != EHOSTUNREACH && st.err() != ECANCELED) {
      // etcd answered but refused (our lease is gone, a request it did not take) or the entry
      // kept changing: tried again; what failed stays queued.
      uint64_t held = 0;
      if (retry_log_.ready(
              static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        Clock::now().time_since_epoch())
                                        .count()),
              held))
        VLOG_WARN("directory: {}; trying again{}", st.message(), log::held_note(held));
      if (st.err() == ENOENT || st.err() == EPROTO) registered_ = false;  // start over
    }
    l.lock();
    if (stop_) break;
    auto until = st.is_ok() && registered_ ? next_keep : Clock::now() + retry_every;
    for (const auto& [name, e] : leaving_) until = std::min(until, e.second);
    cv_.wait_until(l, until, [&] { return stop_.load() || (!pending_.empty() && st.is_ok()); });
  }
  l.unlock();
  // A clean exit: our entries go at once, not when the lease runs out (not waited for when etcd
  // is away: the lease ends them then).
  if (registered_ && reachable_) {
    int64_t lease;
    {
      std::lock_guard<std::mutex> g(mu_);
      lease = lease_;
    }
    c.abort_on(nullptr);
    (void)c.lease_revoke(lease);
  }
}

void EtcdDirectory::watcher() {
  EtcdClient& c = *watch_client_;
  c.abort_on(&stop_);
  while (!stop_) {
    int64_t rev = 0;
    auto all = c.range(opt_.prefix, true, &rev);
    note(c.last_heard());
    if (!all) {
      for (int i = 0; i < 3 && !stop_; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      reset(*all);
      watch_revision_ = rev;
    }
    wake();
    Status st = c.watch(
        opt_.prefix, rev + 1,
        [&](const std::vector<WatchEvent>& evs) {
          {
            std::lock_guard<std::mutex> l(mu_);
            for (const WatchEvent& e : evs) {
              if (!e.deleted && self_put_at_ != Clock::time_point{} &&
                  e.kv.key == key("nodes", opt_.node)) {
                watch_lag_ms_ = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() -
                                                                                      self_put_at_)
                                    .count();
                self_put_at_ = {};
              }
              apply(e.kv.key, e.kv.value, e.kv.mod_revision, e.deleted, e.kv.lease);
              ++cnt_.watch_events;
              watch_revision_ = std::max(watch_revision_, e.kv.mod_revision);
            }
          }
          wake();
          return true;
        },
        stop_);
    if (stop_) break;
    // A member that went away ends its stream: the range above tries every member and says
    // whether etcd as a whole is unreachable.
    VLOG_INFO("directory: {}; watching again", st.message());
    for (int i = 0; i < 3 && !stop_; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void EtcdDirectory::apply(const std::string& k, const std::string& value, int64_t mod_revision,
                          bool deleted, int64_t lease) {
  if (!k.starts_with(opt_.prefix)) return;
  const std::string rest = k.substr(opt_.prefix.size());
  if (rest.starts_with("nodes/")) {
    const std::string node = rest.substr(6);
    if (deleted) {
      if (nodes_.erase(node) && node != opt_.node) {
        VLOG_INFO("directory: node {} left (its lease ended or it stopped)", node);
        changes_.push_back({Change::Kind::kPeerDown, node, {}, {}});
      }
      return;
    }
    NodeEntry e;
    try {
      const json j = json::parse(value);
      e.node = j.at("node").get<std::string>();
      e.address = j.at("address").get<std::string>();
      e.fingerprint = j.value("fingerprint", "");
      e.registered_unix = j.value("registered_unix", uint64_t{0});
      e.qps = j.value("qps", uint64_t{0});
      e.lease = lease;
    } catch (const json::exception&) {
      VLOG_WARN("directory: {} is not a node entry; ignored", k);
      return;
    }
    if (e.node != node) return;
    auto old = nodes_.find(node);
    const bool changed = old == nodes_.end() || old->second.address != e.address;
    if (old != nodes_.end() && old->second.lease == e.lease) e.ttl_left = old->second.ttl_left;
    nodes_[node] = e;
    if (changed && node != opt_.node) {
      VLOG_INFO("directory: node {} at {}", node, e.address);
      changes_.push_back({Change::Kind::kPeerUp, node, e.address, {}});
    }
    return;
  }
  if (rest.starts_with("guests/")) {
    const std::string name = rest.substr(7);
    auto old = guests_.find(name);
    auto gid_of = [](const transport::GuestInfo& g) {
      std::array<uint8_t, 16> a;
      std::memcpy(a.data(), g.gid, 16);
      return a;
    };
    if (old != guests_.end()) gid_node_.erase(gid_of(old->second.info));
    if (deleted) {
      if (old != guests_.end()) guests_.erase(old);
      return;
    }
    GuestEntry e;
    if (!parse_guest(value, e.info, e.node, e.generation) || e.info.name != name) {
      VLOG_WARN("directory: {} is not a guest entry; ignored", k);
      return;
    }
    e.mod_revision = mod_revision;
    const bool moved = old == guests_.end() || old->second.node != e.node;
    gid_node_[gid_of(e.info)] = e.node;
    guests_[name] = e;
    if (moved) changes_.push_back({Change::Kind::kGuestMoved, e.node, {}, e.info});
    return;
  }
  if (rest.starts_with("lids/")) {
    unsigned lid = 0;
    if (std::sscanf(rest.c_str() + 5, "%x", &lid) != 1 || lid > 0xffff) return;
    if (deleted) {
      lid_owner_.erase(static_cast<uint16_t>(lid));
    } else {
      lid_owner_[static_cast<uint16_t>(lid)] = value;
    }
  }
}

void EtcdDirectory::reset(const std::vector<KeyValue>& kvs) {
  // Deletions of what is gone first (so a node that left while we did not watch is dropped),
  // then every entry as if new (apply() reports only what changed).
  std::map<std::string, bool> present;
  for (const KeyValue& kv : kvs) present[kv.key] = true;
  std::vector<std::string> gone;
  for (const auto& [n, e] : nodes_)
    if (!present.count(key("nodes", n))) gone.push_back(key("nodes", n));
  for (const auto& [n, e] : guests_)
    if (!present.count(key("guests", n))) gone.push_back(key("guests", n));
  for (const auto& [l, v] : lid_owner_)
    if (!present.count(key("lids", lid_name(l)))) gone.push_back(key("lids", lid_name(l)));
  for (const std::string& k : gone) apply(k, {}, 0, true);
  for (const KeyValue& kv : kvs) apply(kv.key, kv.value, kv.mod_revision, false, kv.lease);
}

void EtcdDirectory::poll(const std::function<void(const Change&)>& fn) {
  uint64_t v;
  (void)!::read(wake_.get(), &v, sizeof(v));
  std::vector<Change> out;
  {
    std::lock_guard<std::mutex> l(mu_);
    out.swap(changes_);
  }
  for (const Change& c : out) fn(c);
}

void EtcdDirectory::announce(const transport::GuestInfo& g, bool up) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (up) {
      local_[g.name] = g;
      leaving_.erase(g.name);
      pending_.push_back(g);
    } else {
      // A join not written yet is not written at all: the guest is no longer here, and its
      // entry may be another node's by now (a move), which a late write would take back.
      local_.erase(g.name);
      std::erase_if(pending_, [&](const transport::GuestInfo& p) { return p.name == g.name; });
      leaving_[g.name] = {g, Clock::now() + std::chrono::milliseconds(opt_.leave_delay_ms)};
    }
  }
  cv_.notify_all();
}

std::string EtcdDirectory::fingerprint_of(const std::string& node) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = nodes_.find(node);
  return it == nodes_.end() ? std::string() : it->second.fingerprint;
}

std::string EtcdDirectory::unavailable() const {
  if (reachable()) return {};
  std::lock_guard<std::mutex> l(mu_);
  return fmt::format("the directory (etcd) is unreachable: {}", last_error_);
}

std::string EtcdDirectory::locate_lid(uint16_t lid) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = lid_owner_.find(lid);
  if (it == lid_owner_.end()) return {};
  const size_t at = it->second.rfind('@');
  if (at == std::string::npos) return {};
  std::string node = it->second.substr(at + 1);
  // A peer's guest only while that peer is registered (its entries may outlive it by a
  // moment: a lease ends with a few deletions, not one).
  return node == opt_.node || !nodes_.count(node) ? std::string() : node;
}

std::string EtcdDirectory::locate_gid(const uint8_t gid[16]) const {
  std::array<uint8_t, 16> key;
  std::memcpy(key.data(), gid, 16);
  std::lock_guard<std::mutex> l(mu_);
  auto it = gid_node_.find(key);
  if (it == gid_node_.end()) return {};
  return it->second == opt_.node || !nodes_.count(it->second) ? std::string() : it->second;
}

nlohmann::json EtcdDirectory::status_json() const {
  std::lock_guard<std::mutex> l(mu_);
  const uint64_t now = static_cast<uint64_t>(::time(nullptr));
  json nodes = json::array();
  for (const auto& [n, e] : nodes_) {
    json guests = json::array();
    for (const auto& [gn, g] : guests_) {
      if (g.node == n)
        guests.push_back({{"name", gn}, {"lid", g.info.lid}, {"generation", g.generation}});
    }
    json jn = {{"node", n},
               {"address", e.address},
               {"fingerprint", e.fingerprint},
               {"registered_unix", e.registered_unix},
               {"age_s", now >= e.registered_unix ? now - e.registered_unix : 0},
               {"self", n == opt_.node},
               {"qps", e.qps},
               {"guests", guests}};
    if (e.ttl_left >= 0) jn["lease_ttl_s"] = e.ttl_left;
    nodes.push_back(std::move(jn));
  }
  json j = {{"kind", "etcd"},
            {"endpoints", opt_.etcd.endpoints},
            {"endpoint", endpoint_},
            {"prefix", opt_.prefix},
            {"node", opt_.node},
            {"address", opt_.address},
            {"reachable", reachable_.load()},
            {"registered", registered_.load()},
            {"lease_s", opt_.lease_s},
            {"lease_id", fmt::format("{:x}", lease_)},
            {"revision", watch_revision_},
            {"lease_age_s", registered_ && now >= registered_unix_ ? now - registered_unix_ : 0},
            {"nodes", nodes},
            {"counters",
             {{"requests", work_client_->requests() + watch_client_->requests()},
              {"failures", work_client_->failed() + watch_client_->failed()},
              {"registrations", cnt_.registrations},
              {"watch_events", cnt_.watch_events},
              {"lid_conflicts", cnt_.conflicts},
              {"moves_here", cnt_.moves}}}};
  if (watch_lag_ms_ >= 0) j["watch_lag_ms"] = watch_lag_ms_;
  if (unreachable_since_unix_) j["unreachable_since_unix"] = unreachable_since_unix_;
  if (!last_error_.empty()) j["last_error"] = last_error_;
  return j;
}

}  // namespace vrdma::directory
