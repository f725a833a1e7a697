// The RDMA CM state of a guest that moves (vrdma migrate): exported beside the device's state
// blob as versioned JSON with its channels' sockets, imported under the same handles by the
// target, whose peers are told by a kCm kMoved (docs/ARCHITECTURE.md, "RDMA CM": live
// migration). Owned by the server thread, as the rest of CmService.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "backend/cm.h"
#include "engine/device.h"
#include "transport/transport.h"

namespace vrdma::backend {

using namespace vrdma::proto;
using CmKind = wire::CmKind;
using nlohmann::json;

namespace {

/// The format of the JSON; an import refuses any other.
constexpr int kCmStateVersion = 1;
/// The longest an address resolution may have left (a guest's `timeout_ms` is 32 bits).
constexpr uint64_t kMaxResolveMs = std::numeric_limits<uint32_t>::max();

template <typename T>
std::vector<uint8_t> bytes_of(const T& v) {
  std::vector<uint8_t> b(sizeof(T));
  std::memcpy(b.data(), &v, sizeof(T));
  return b;
}

template <typename T>
T from_bytes(const json& j) {
  const auto b = j.get<std::vector<uint8_t>>();
  if (b.size() != sizeof(T)) throw std::invalid_argument("a field of the wrong size");
  T v;
  std::memcpy(&v, b.data(), sizeof(T));
  return v;
}

}  // namespace

std::string CmService::export_sessions(const std::unordered_map<uint32_t, uint64_t>& keys,
                                       std::vector<int>& fds) const {
  json chans = json::array(), sessions = json::array();
  for (const auto& [sid, key] : keys) sessions.push_back({{"owner", sid}, {"key", key}});
  for (const auto& [h, ch] : channels_) {
    if (!keys.count(ch.owner)) continue;
    json backlog = json::array();
    for (const auto& e : ch.backlog) backlog.push_back(e);
    chans.push_back({{"h", h}, {"owner", ch.owner}, {"fd", fds.size()}, {"backlog", backlog}});
    fds.push_back(ch.sock.get());
  }
  std::string text = json{
      {"version", kCmStateVersion},
      {"node", transport_ ? transport_->self() : std::string()},
      {"sessions", sessions},
      {"channels",
       chans}}.dump();
  text.pop_back();  // its '}': the ids follow, each as last written when it did not change
  text += ",\"ids\":[";
  bool first = true;
  for (const auto& [h, id] : ids_) {
    if (!keys.count(id.owner)) continue;
    text += first ? "" : ",";
    text += exported_text(h, id);
    first = false;
  }
  text += "]}";
  if (exported_.size() > 2 * ids_.size() + 64)  // the texts of ids that are gone
    std::erase_if(exported_, [this](const auto& e) { return !ids_.count(e.first); });
  return text;
}

namespace {

/// What an id's exported text says, as bytes to compare (zeroed first: no padding differs).
struct IdFields {
  uint32_t owner, channel, peer, listener, pending, backlog;
  uint16_t ps;
  uint8_t qp_type, state, holds_port, timewait, due;
  CmAddr src, dst;
  CmQpInfo qp;
};

}  // namespace

const std::string& CmService::exported_text(uint32_t h, const Id& id) const {
  // Whether its TIMEWAIT_EXIT is still to come (`timewait` stays set after it came).
  const bool due = id.timer_armed && id.timer->second.kind == TimerKind::kTimewait;
  IdFields f;
  std::memset(&f, 0, sizeof(f));
  f.owner = id.owner, f.channel = id.channel, f.peer = id.peer, f.listener = id.listener;
  f.pending = id.pending, f.backlog = id.backlog, f.ps = id.ps, f.qp_type = id.qp_type;
  f.state = static_cast<uint8_t>(id.state), f.holds_port = id.holds_port;
  f.timewait = id.timewait, f.due = due, f.src = id.src, f.dst = id.dst, f.qp = id.qp;
  Exported& e = exported_[h];
  // An address resolution under way: the time it has left changes, so the text is made anew.
  const bool resolving = id.timer_armed && id.timer->second.kind == TimerKind::kAddr;
  if (!resolving && e.fields.size() == sizeof(f) &&
      std::memcmp(e.fields.data(), &f, sizeof(f)) == 0 && e.node == id.node)
    return e.text;
  e.fields = resolving ? std::vector<uint8_t>{} : bytes_of(f);
  e.node = id.node;
  json j{{"h", h},
                {"owner", id.owner},
                {"channel", id.channel},
                {"ps", id.ps},
                {"qp_type", id.qp_type},
                {"state", static_cast<int>(id.state)},
                {"src", bytes_of(id.src)},
                {"dst", bytes_of(id.dst)},
                {"peer", id.peer},
                {"holds_port", id.holds_port},
                {"timewait", id.timewait},
                {"timewait_due", due},
                {"qp", bytes_of(id.qp)},
                {"node", id.node},
                {"listener", id.listener},
                {"pending", id.pending},
                {"backlog", id.backlog}};
  if (resolving) {
    const uint64_t now = cm_clock_ns();
    j["resolve_ms"] = id.resolve_deadline_ns > now ? (id.resolve_deadline_ns - now) / 1000000 : 0;
    j["resolve_src"] = bytes_of(id.resolve_src);
  }
  e.text = j.dump();
  return e.text;
}

Status CmService::import_sessions(std::string_view text, std::vector<UniqueFd>& fds,
                                  const std::unordered_map<uint64_t, uint32_t>& sessions,
                                  bool recover) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return error(EINVAL, "CM state: not JSON");
  std::string from;
  std::unordered_map<uint32_t, uint32_t> owner;  // old session id -> the new one
  std::unordered_map<uint32_t, Channel> chans;
  std::unordered_map<uint32_t, Id> ids;
  std::unordered_set<uint32_t> timewait_due;
  std::unordered_map<uint32_t, uint64_t> resolving;  // handle -> ms its resolution has left
  try {
    if (j.at("version").get<int>() != kCmStateVersion)
      return error(EPROTONOSUPPORT, fmt::format("CM state version {}", j.at("version").dump()));
    from = j.at("node").get<std::string>();
    for (const json& s : j.at("sessions")) {
      auto it = sessions.find(s.at("key").get<uint64_t>());
      if (it == sessions.end()) return error(EINVAL, "CM state: a session not imported");
      owner[s.at("owner").get<uint32_t>()] = it->second;
    }
    auto new_owner = [&](const json& e) {
      auto it = owner.find(e.at("owner").get<uint32_t>());
      if (it == owner.end()) throw std::invalid_argument("an owner not among the sessions");
      return it->second;
    };
    auto fresh = [&](uint32_t h) {
      if (h == 0 || h == kNone || ids_.count(h) || channels_.count(h) || chans.count(h) ||
          ids.count(h))
        throw std::invalid_argument(fmt::format("handle {} taken", h));
      return h;
    };
    for (const json& c : j.at("channels")) {
      Channel& ch = chans[fresh(c.at("h").get<uint32_t>())];
      ch.owner = new_owner(c);
      const size_t fd = c.at("fd").get<size_t>();
      if (fd >= fds.size() || !fds[fd].valid()) return error(EINVAL, "CM state: bad descriptor");
      ch.sock = std::move(fds[fd]);
      for (const json& e : c.at("backlog")) ch.backlog.push_back(e.get<std::vector<uint8_t>>());
    }
    for (const json& e : j.at("ids")) {
      const uint32_t h = fresh(e.at("h").get<uint32_t>());
      Id& id = ids[h];
      id.owner = new_owner(e);
      id.channel = e.at("channel").get<uint32_t>();
      if (!chans.count(id.channel)) return error(EINVAL, "CM state: an id's channel is missing");
      id.ps = e.at("ps").get<uint16_t>();
      id.qp_type = e.at("qp_type").get<uint8_t>();
      const int st = e.at("state").get<int>();
      if (st < 0 || st > static_cast<int>(State::kDisconnected))
        return error(EINVAL, "CM state: an id's state");
      id.state = static_cast<State>(st);
      id.src = from_bytes<CmAddr>(e.at("src"));
      id.dst = from_bytes<CmAddr>(e.at("dst"));
      id.peer = e.at("peer").get<uint32_t>();
      id.holds_port = e.at("holds_port").get<bool>();
      id.timewait = e.at("timewait").get<bool>();
      // Absent (an older source): due whenever it was set, as before.
      if (id.timewait && e.value("timewait_due", true)) timewait_due.insert(h);
      id.qp = from_bytes<CmQpInfo>(e.at("qp"));
      id.node = e.at("node").get<std::string>();
      if (id.node.size() >= wire::kNameMax) return error(EINVAL, "CM state: a node name");
      id.listener = e.at("listener").get<uint32_t>();
      id.pending = e.at("pending").get<uint32_t>();
      id.backlog = e.at("backlog").get<uint32_t>();
      // An address resolution under way (absent from an older source: it never ended there).
      if (e.contains("resolve_ms")) {
        id.resolve_src = from_bytes<CmAddr>(e.at("resolve_src"));
        resolving[h] = std::min<uint64_t>(e.at("resolve_ms").get<uint64_t>(), kMaxResolveMs);
      }
    }
  } catch (const std::exception& e) {
    return error(EINVAL, fmt::format("CM state: {}", e.what()));
  }
  const std::string self = transport_ ? transport_->self() : std::string();
  for (auto& [h, ch] : chans) {
    ++usage_[ch.owner].channels;
    note(ch.owner);
    if (!ch.backlog.empty()) backlogged_.insert(h);
    channels_.emplace(h, std::move(ch));
  }
  std::vector<std::pair<uint32_t, Id*>> tell_moved;
  for (auto& [h, moved] : ids) {
    Id& id = ids_[h] = std::move(moved);
    ++usage_[id.owner].ids;
    if (id.holds_port) {
      id.holds_port = false;
      if (!take_port(h, id, id.src.port).is_ok())
        VLOG_WARN("cm: port {} of moved id {} is taken here; the id holds none", id.src.port, h);
    }
    if (id.listener && !ids.count(id.listener)) id.listener = 0;  // its listener stayed behind
    if (timewait_due.count(h)) arm(h, id, kTimewaitMs, TimerKind::kTimewait);
    if (auto r = resolving.find(h); r != resolving.end()) {
      // Asked again from here at once (on_timer): the answer to the source's question goes
      // there, and this host may own the address or know the peer by its address now.
      id.resolve_deadline_ns = cm_clock_ns() + r->second * 1000000;
      arm(h, id, 0, TimerKind::kAddr);
    }
    const bool has_peer = id.peer != 0 && id.peer != kNone;
    // Moved (not recovered): where its peer is, seen from here. Recovered, a local peer is
    // still local (its guest's import brings it back, or settle_restored ends the id's wait).
    if (has_peer && !recover && id.node.empty()) {
      if (ids.count(id.peer)) continue;  // both ends moved together
      id.node = from;                    // its peer stayed on the source
    } else if (has_peer && !recover && id.node == self) {
      // Its peer is one of ours: both ends are here now.
      id.node.clear();
      if (auto p = ids_.find(id.peer);
          p != ids_.end() && p->second.peer == h && p->second.node == from)
        p->second.node.clear();
      continue;
    }
    // A handshake with a peer backend gets its timer back, a REQ not answered yet included.
    if ((id.state == State::kReqSent || id.state == State::kRepSent) && !id.node.empty())
      arm(h, id, kHandshakeStepMs, TimerKind::kHandshake);
    if (has_peer && !id.node.empty() && (!recover || from != self)) tell_moved.emplace_back(h, &id);
  }
  for (auto [h, id] : tell_moved) tell_moved_from(h, *id, from);
  return Status::ok();
}

void CmService::tell_moved_from(uint32_t h, const Id& id, const std::string& from) {
  wire::Cm m{};
  m.kind = static_cast<uint8_t>(CmKind::kMoved);
  m.src_id = h;
  m.dst_id = id.peer;
  m.private_len = static_cast<uint32_t>(std::min(from.size(), wire::kNameMax - 1));
  std::memcpy(m.private_data, from.data(), m.private_len);
  if (!transport_ || !transport_->send(id.node, wire::Type::kCm, &m))
    VLOG_WARN("cm: moved id {}: its peer's backend {} could not be told", h, id.node);
}

void CmService::settle_restored() {
  std::vector<uint32_t> orphans;
  for (const auto& [h, id] : ids_) {
    if (id.node.empty() && id.peer != 0 && id.peer != kNone && !ids_.count(id.peer))
      orphans.push_back(h);
  }
  std::sort(orphans.begin(), orphans.end());
  for (uint32_t h : orphans) {
    Id& id = ids_.at(h);
    VLOG_INFO("cm: id {}: its peer {} was not restored; it hears it went away", h, id.peer);
    receive(h, id, id.peer, CmKind::kGone, 0, nullptr, {});
  }
  for (uint32_t h : backlogged_) {
    if (auto ch = channels_.find(h); ch != channels_.end()) {
      flush(ch->second);
      note(ch->second.owner);
    }
  }
  std::erase_if(backlogged_, [this](uint32_t h) {
    auto ch = channels_.find(h);
    return ch == channels_.end() || ch->second.backlog.empty();
  });
}

void CmService::session_moved(const engine::Session* session) {
  for (uint32_t h : ids_of(session->id)) {
    Id& id = ids_.at(h);
    release_port(id);
    set_state(id, State::kIdle);  // out of its listener's backlog, if it was a request
    disarm(id);
    ids_.erase(h);
  }
  forget_channels(session->id);
}

void CmService::on_moved_wire(const std::string& node, const wire::Cm& m) {
  const std::string left(reinterpret_cast<const char*>(m.private_data), m.private_len);
  auto it = ids_.find(m.dst_id);
  const std::string self = transport_ ? transport_->self() : std::string();
  // It faced the node the id left (or, when that was us, was its local peer, gone from here).
  const bool ours = it != ids_.end() && it->second.peer == m.src_id &&
                    (it->second.node == left ||
                     (it->second.node.empty() && left == self && !ids_.count(m.src_id)));
  if (!ours) {
    if (transport_)
      transport_->refused_frame(node, fmt::format("cm MOVED: id {} is not the peer of {} on {}",
                                                  m.dst_id, m.src_id, left));
    return;
  }
  it->second.node = node;
  note(it->second.owner);
}

}  // namespace vrdma::backend
