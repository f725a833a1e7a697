// The backend's RDMA connection service (librdmacm's other half; docs/ARCHITECTURE.md, "RDMA
// CM"): event channels, ids, listeners by (port space, port), and the IB CM's exchange
// (REQ/REP/RTU/REJ/DREQ) between the ids of this backend's guests. Owned by the server thread.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/unique_fd.h"
#include "proto/command.h"

namespace vrdma::engine {
struct Session;
}

namespace vrdma::backend {

class CmService {
 public:
  /// The response to CM command `h` of session `s` (an encoded proto message); `give`: a
  /// descriptor the response hands over (kCmCreateChannel).
  std::vector<uint8_t> handle(const engine::Session& s, const proto::MsgHeader& h,
                              std::span<const uint8_t> msg, UniqueFd& give);
  /// The session ended (its process exited or crashed): its ids go as rdma_destroy_id would
  /// take them (peers hear REJECTED, UNREACHABLE or DISCONNECTED), its ports and channels too.
  void session_closed(const engine::Session* s);

  /// Ids and listening ports, for tests.
  size_t ids() const { return ids_.size(); }
  size_t ports() const { return ports_.size(); }

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
    proto::CmQpInfo qp{};  ///< what this end said of its QP (REQ or REP)
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
  Status accept(Id& id, const proto::CmConnReq& r);
  Status reject(Id& id, const proto::CmConnReq& r);
  Status establish(Id& id);
  Status disconnect(uint32_t handle, Id& id);
  /// What the peer of an id that goes away hears, by where the handshake was.
  void abandon(Id& id);
  /// The listener for (ps, port) that takes connections to `dst`; 0 when none.
  uint32_t listener_for(uint16_t ps, const proto::CmAddr& dst) const;
  /// Queues one event on the id's channel (dropped when the id or channel is gone).
  void emit(uint32_t handle, proto::CmEventType ev, int32_t status,
            const proto::CmQpInfo* peer = nullptr, std::span<const uint8_t> pdata = {},
            uint32_t listen_id = proto::kNone);
  void flush(Channel& ch);
  /// Closes the destroyed channels' sockets whose guest end is closed.
  void sweep_closing();

  std::unordered_map<uint32_t, Channel> channels_;
  std::unordered_set<uint32_t> backlogged_;  ///< channels with events waiting for room
  /// Destroyed channels' sockets, kept until the guest's end is closed or its session ends.
  std::vector<std::pair<uint32_t, UniqueFd>> closing_;
  std::unordered_map<uint32_t, Id> ids_;
  /// (port space, port) -> the id that holds it (bound, listening or connecting).
  std::map<std::pair<uint16_t, uint16_t>, uint32_t> ports_;
  /// Channels (open or closing) and ids per session, against the caps in cm.cc.
  struct Usage {
    uint32_t channels = 0, ids = 0;
  };
  std::unordered_map<uint32_t, Usage> usage_;  ///< by session id
  uint32_t next_handle_ = 1;  ///< channels and ids share it; never reused within 2^32
  uint16_t next_ephemeral_ = 0;
  log::Every backlog_log_{1'000'000'000};
};

}  // namespace vrdma::backend
