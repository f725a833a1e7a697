// The backend's RDMA connection service (librdmacm's other half; docs/ARCHITECTURE.md, "RDMA
// CM"): event channels, ids, listeners by (port space, port), and the IB CM's exchange
// (REQ/REP/RTU/REJ/DREQ) between ids of this backend's guests, or with a peer backend's ids over
// the transport (wire kCm). Owned by the server thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/unique_fd.h"
#include "proto/command.h"
#include "proto/wire.h"

namespace vrdma::engine {
struct Session;
}
namespace vrdma::transport {
class Transport;
}

namespace vrdma::backend {

/// CLOCK_MONOTONIC in ns: the clock of the service's timers.
uint64_t cm_clock_ns();
/// An IPv4 (224/4) or IPv6 (ff00::/8) multicast address.
bool is_multicast(const proto::CmAddr& a);

class CmService {
 public:
  CmService();
  /// The response to CM command `h` of session `s` (an encoded proto message); `give`: a
  /// descriptor the response hands over (kCmCreateChannel).
  std::vector<uint8_t> handle(const engine::Session& s, const proto::MsgHeader& h,
                              std::span<const uint8_t> msg, UniqueFd& give);
  /// The session ended (its process exited or crashed): its ids go as rdma_destroy_id would
  /// take them (peers hear REJECTED, UNREACHABLE or DISCONNECTED), its ports and channels too.
  void session_closed(const engine::Session* s);

  /// Live migration (cm_migrate.cc, docs/ARCHITECTURE.md "RDMA CM": live migration). The CM
  /// state of sessions `keys` (session id -> a key the target finds the session by: its socket's
  /// inode) as versioned JSON; `fds` gets each channel's socket (borrowed, in the JSON's order).
  std::string export_sessions(const std::unordered_map<uint32_t, uint64_t>& keys,
                              std::vector<int>& fds) const;
  /// Takes in what export_sessions gave (checked; all or nothing): the ids keep their handles
  /// (EEXIST when one is taken here), `sessions` maps each key to the imported session's id, and
  /// the peers of the moved ids are told they face this backend now (kMoved). `recover`: the
  /// state a keeper kept for this backend before it died (keep_state): the ids' peers stay where
  /// they were (a local peer comes back with its own guest's import; peer backends know this
  /// node by its name), so nobody is told, unless the node's name changed.
  Status import_sessions(std::string_view json, std::vector<UniqueFd>& fds,
                         const std::unordered_map<uint64_t, uint32_t>& sessions,
                         bool recover = false);
  /// After a keeper's restart imported every kept guest (import_sessions with `recover`): an id
  /// whose local peer did not come back hears what a peer that went away leaves (as a GONE),
  /// and the events that were waiting for room in their channels are sent.
  void settle_restored();

  /// keep_state: while on, the service notes the sessions whose CM state changed (an id, a
  /// channel, its waiting events), for the server to hand their guests' state to its keeper
  /// before anyone hears the answer. Off (the default): nothing is noted.
  void track_changes(bool on) { track_ = on; }
  bool has_changes() const { return !changed_.empty(); }
  /// The sessions noted since the last call.
  std::unordered_set<uint32_t> take_changes() { return std::exchange(changed_, {}); }
  /// Session `s` moved to another backend: its ids, channels and ports are forgotten here
  /// without a word to their peers (the target tells them).
  void session_moved(const engine::Session* s);

  /// Connections to an address of another backend's host go through `t` (see resolve_addr);
  /// `peers` lists the nodes connected now. Unset: this backend's addresses only.
  void set_transport(transport::Transport* t, std::function<std::vector<std::string>()> peers);
  /// A kCm message from peer backend `node`, its fields checked by the wire codec: applied when
  /// it is a REQ or names one of our ids whose peer is the sender's id there; refused (counted,
  /// logged) otherwise. A peer may be hostile: it reaches nothing a guest's command could not.
  void on_wire(const std::string& node, const proto::wire::Cm& m);
  /// Readable (a timerfd) when a timer is due: address resolution's timeout, TIMEWAIT_EXIT, a
  /// handshake with a peer backend that stopped answering. Then on_timer().
  int timer_fd() const { return timer_.get(); }
  void on_timer();

  /// Ids and listening ports, for tests.
  size_t ids() const { return ids_.size(); }
  size_t ports() const { return ports_.size(); }

  /// An address no peer's transport address names is asked of the peers again this often
  /// until its timeout (a neighbour solicitation retransmitted): a peer whose connection was
  /// being replaced, or that was not known yet by its name, did not hear the first question.
  static constexpr uint64_t kAddrAskMs = 200;

  /// A REQ or REP the transport could not take (no connection to that backend at that moment:
  /// one being replaced by a duplicate, a dial not answered yet) is offered again this often,
  /// kUnsentTries times, before the id is UNREACHABLE.
  static constexpr uint64_t kUnsentStepMs = 100;
  static constexpr uint32_t kUnsentTries = 10;

 private:
  /// Where an id is in the IB CM's exchange.
  enum class State : uint8_t {
    kIdle,
    kBound,
    kListen,
    kAddrResolved,
    kRouteResolved,
    kReqSent,  ///< active side: REQ out, waiting for REP or REJ
    kReqRcvd,  ///< passive side: the new id of a CONNECT_REQUEST
    kRepSent,  ///< passive side: accepted, waiting for RTU
    kRepRcvd,  ///< active side: CONNECT_RESPONSE delivered, RTU not yet sent
    kEstablished,
    kDisconnected,  ///< sent or received DREQ
  };
  enum class TimerKind : uint8_t { kAddr, kTimewait, kHandshake };
  /// A handshake with a peer backend (REQ or REP out) is checked this often: it fails with
  /// UNREACHABLE (-ETIMEDOUT) once the connection to that backend is down, or after
  /// kHandshakeTries checks (rdma_cm's REQ: 15 retries of about 4 s).
  static constexpr uint64_t kHandshakeStepMs = 1000;
  /// TIMEWAIT_EXIT this long after an end's DREQ or DREP (cm.cc, disconnect).
  static constexpr uint64_t kTimewaitMs = 50;
  static constexpr uint32_t kHandshakeTries = 60;
  struct Timer {
    uint32_t id;
    TimerKind kind;
  };
  struct Channel {
    uint32_t owner = 0;  ///< engine::Session::id (unique for the backend's life)
    UniqueFd sock;                             ///< non-blocking; the library reads the other end
    std::deque<std::vector<uint8_t>> backlog;  ///< events the socket had no room for yet
  };
  struct Id {
    uint32_t owner = 0;  ///< engine::Session::id (unique for the backend's life)
    uint32_t channel = 0;
    uint16_t ps = 0;
    uint8_t qp_type = 0;
    State state = State::kIdle;
    proto::CmAddr src{}, dst{};
    uint32_t peer = 0;  ///< the other end's id while a connection is being made or held
    bool holds_port = false;
    bool timewait = false;  ///< TIMEWAIT_EXIT is on its way (after this end's DREQ or DREP)
    proto::CmQpInfo qp{};   ///< what this end said of its QP (REQ or REP)
    std::string node;       ///< the backend of the other end (resolved or requesting); "": this one
    uint32_t listener = 0;  ///< kReqRcvd: the listener it came to (its backlog counts it)
    uint32_t pending = 0;   ///< a listener's requests not yet accepted or rejected
    uint32_t backlog = 0;   ///< a listener's limit on `pending`
    uint32_t tries = 0;     ///< handshake timer: checks of the peer backend so far
    /// Its REQ or REP while the transport has not taken it (kUnsentStepMs).
    std::optional<proto::wire::Cm> unsent;
    proto::CmAddr resolve_src{};  ///< kAddr timer: the source the resolution will give
    uint64_t resolve_deadline_ns = 0;  ///< kAddr timer: ADDR_ERROR then (cm_clock_ns)
    /// Its one pending timer (in timers_) when armed: a new one replaces it, and it goes with
    /// the id, so what a guest can make wait is bounded by its ids.
    bool timer_armed = false;
    std::multimap<uint64_t, Timer>::iterator timer;
  };
  using Reply = std::vector<uint8_t>;

  Reply create_channel(const engine::Session& s, const proto::MsgHeader& h, UniqueFd& give);
  Id* find(const engine::Session& s, uint32_t id);
  /// Gives `id` a port (its own, or an ephemeral one when 0); EADDRINUSE when taken.
  Status take_port(uint32_t handle, Id& id, uint16_t port);
  void release_port(Id& id);
  Status bind(uint32_t handle, Id& id, const proto::CmAddr& a);
  Status resolve_addr(uint32_t handle, Id& id, const proto::CmResolveReq& r);
  Status connect(uint32_t handle, Id& id, const proto::CmConnReq& r);
  Status accept(uint32_t handle, Id& id, const proto::CmConnReq& r);
  Status reject(uint32_t handle, Id& id, const proto::CmConnReq& r);
  Status establish(uint32_t handle, Id& id);
  Status disconnect(uint32_t handle, Id& id);
  /// MULTICAST_JOIN with the group's GID, LID and qkey (its address in the event's dst).
  Status join_mcast(uint32_t handle, Id& id, const proto::CmAddr& group);
  /// What the peer of an id that goes away hears, by where the handshake was.
  void abandon(uint32_t handle, Id& id);
  /// The listener for (ps, port) that takes connections to `dst`; 0 when none.
  uint32_t listener_for(uint16_t ps, const proto::CmAddr& dst) const;
  /// Queues one event on the id's channel (dropped when the id or channel is gone).
  void emit(uint32_t handle, proto::CmEventType ev, int32_t status,
            const proto::CmQpInfo* peer = nullptr, std::span<const uint8_t> pdata = {},
            uint32_t listen_id = proto::kNone, const proto::CmAddr* dst = nullptr);
  void flush(Channel& ch);
  /// The events that found no room before in session `session`'s channels, as far as they fit.
  void flush_backlogs(uint32_t session);
  /// Moves an id to `st`, leaving its listener's backlog when it was a pending request.
  void set_state(Id& id, State st);
  /// The request `m` (from `node`; "" for one of ours) to a listener here: the new id's handle,
  /// or 0 with the reject reason in `reason`.
  uint32_t take_request(const std::string& node, const proto::wire::Cm& m, int32_t& reason);
  /// Tells the other end of `id` (handle `from`) message `k`: directly when it is here, as a
  /// kCm frame to its backend otherwise.
  /// Sends `id`'s handshake message `m` (a REQ or REP) to its backend and arms the handshake
  /// timer: kHandshakeStepMs when the transport took it, kUnsentStepMs to offer it again if not.
  void send_handshake(uint32_t h, Id& id, const proto::wire::Cm& m);
  /// send_handshake's send: when the transport takes `m`, nothing is kept unsent and the
  /// handshake timer runs its kHandshakeStepMs steps; false (and nothing changed) when not.
  bool offer_handshake(uint32_t h, Id& id, const proto::wire::Cm& m);
  /// The end of `id`'s address resolution at `node` (an answer, or a peer's own address):
  /// ADDR_RESOLVED, or ADDR_ERROR when the id cannot take it.
  void resolve_to(uint32_t h, Id& id, const std::string& node);
  void tell(uint32_t from, Id& id, proto::wire::CmKind k, int32_t status = 0,
            const proto::CmQpInfo* qp = nullptr, std::span<const uint8_t> pdata = {});
  /// What id `h` does on message `k` from its peer `from` (here, or checked by on_wire).
  void receive(uint32_t h, Id& id, uint32_t from, proto::wire::CmKind k, int32_t status,
               const proto::CmQpInfo* qp, std::span<const uint8_t> pdata);
  /// The address resolution of `id` found `dst` on `node` ("": this host), from `src`:
  /// binds it if unbound, ADDR_RESOLVED.
  Status resolved(uint32_t handle, Id& id, const proto::CmAddr& src, const proto::CmAddr& dst,
                  const std::string& node);
  /// Asks every connected peer backend whether `dst` is its host's (kAddrQuery from id `handle`).
  void ask_peers(uint32_t handle, const proto::CmAddr& dst);
  /// A peer's kAddrQuery or kAddrReply (on_wire).
  void on_addr_wire(const std::string& node, const proto::wire::Cm& m);
  /// A peer's kMoved: id m.dst_id, whose peer m.src_id was on the node the message names, now
  /// faces `node` (cm_migrate.cc).
  void on_moved_wire(const std::string& node, const proto::wire::Cm& m);
  /// export_sessions' JSON text of id `h`, written again only when a field it says changed
  /// (keep_state exports a guest's ids after each of its CM commands; most did not change).
  const std::string& exported_text(uint32_t h, const Id& id) const;
  /// Tells the backend of moved id `h`'s peer that it is here now (kMoved, naming `from`).
  void tell_moved_from(uint32_t h, const Id& id, const std::string& from);
  struct Exported {
    std::vector<uint8_t> fields;  ///< what the text says, as bytes (cm_migrate.cc, IdFields)
    std::string node, text;
  };
  mutable std::unordered_map<uint32_t, Exported> exported_;  ///< by id handle
  /// keep_state: `owner`'s CM state changed (track_changes).
  void note(uint32_t owner) {
    if (track_) changed_.insert(owner);
  }
  /// A handle for a new channel or id: never 0 or kNone, never one in use here. Each backend
  /// starts at a random point, so the handles of a guest that moves in are free here.
  uint32_t new_handle();
  /// Whether `a` is an address of this host (see bindable_here, cm.cc): the answers that were
  /// yes are kept for kLocalCacheNs (an address removed from the host meanwhile still counts).
  bool local(const proto::CmAddr& a);
  static constexpr uint64_t kLocalCacheNs = 1'000'000'000;
  static constexpr size_t kLocalCacheSize = 16;
  /// The peer node whose host has IPv4 address `a` (its transport connection's), or "".
  std::string node_for(const proto::CmAddr& a) const;
  void arm(uint32_t h, Id& id, uint64_t after_ms, TimerKind k);
  void disarm(Id& id);
  void rearm_timerfd();
  /// The handles of session `session`'s ids, oldest first.
  std::vector<uint32_t> ids_of(uint32_t session) const;
  /// Drops session `session`'s channels (open or closing) and its usage counts.
  void forget_channels(uint32_t session);
  /// Closes the destroyed channels' sockets whose guest end is closed.
  void sweep_closing();

  std::unordered_map<uint32_t, Channel> channels_;
  std::unordered_set<uint32_t> backlogged_;  ///< channels with events waiting for room
  /// Destroyed channels' sockets, kept until the guest's end is closed or its session ends.
  std::vector<std::pair<uint32_t, UniqueFd>> closing_;
  std::unordered_map<uint32_t, Id> ids_;
  std::vector<std::pair<proto::CmAddr, uint64_t>> local_cache_;  ///< (address, when found local)
  /// (port space, port) -> the id that holds it (bound, listening or connecting).
  std::map<std::pair<uint16_t, uint16_t>, uint32_t> ports_;
  /// Channels (open or closing) and ids per session, against the caps in cm.cc.
  struct Usage {
    uint32_t channels = 0, ids = 0;
  };
  std::unordered_map<uint32_t, Usage> usage_;  ///< by session id
  uint32_t next_handle_;  ///< channels and ids share it; never reused within 2^32
  uint16_t next_ephemeral_ = 0;
  log::Every backlog_log_{1'000'000'000};
  transport::Transport* transport_ = nullptr;
  std::function<std::vector<std::string>()> peers_;
  std::multimap<uint64_t, Timer> timers_;  ///< by deadline (CLOCK_MONOTONIC ns)
  UniqueFd timer_;
  bool track_ = false;                    ///< track_changes
  std::unordered_set<uint32_t> changed_;  ///< sessions noted since take_changes
};

}  // namespace vrdma::backend
