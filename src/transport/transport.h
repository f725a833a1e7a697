// The transport interface: how the engine's requester reaches a QP on another backend, and how
// what arrives from other backends reaches the engine. Same-host pairs ("shm") never come here:
// the engine executes them in one step. Implementations: tcp/ (cross host; also same host when
// forced with VRDMA_TRANSPORT=tcp).
// Concurrency: owned by the backend's engine thread, like the engine.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "proto/wire.h"

namespace vrdma::transport {

/// A run of bytes in backend memory (registered guest memory, mapped).
struct Span {
  uint8_t* p;
  uint64_t n;
};

/// Keeps memory that spans point into alive (a guest MR's segment) while bytes are in flight:
/// the guest may deregister the MR, or die, meanwhile.
using Hold = std::shared_ptr<const void>;

/// Where the payload of an arriving frame goes. Empty `spans`: the payload is discarded.
/// One per connection; the receiver may keep what it decided about the frame in `ctx` and
/// `scratch` until on_frame_done.
struct RxSink {
  std::vector<Span> spans;  ///< total bytes == the frame's payload when not empty
  std::vector<Hold> holds;
  bool accepted = false;             ///< receiver's: the frame is to be completed when done
  alignas(8) uint8_t ctx[512] = {};  ///< receiver's state for the frame
  std::vector<uint8_t> scratch;      ///< receiver's buffer (a datagram lands here)
};

/// A guest of this backend as the directory announces it.
struct GuestInfo {
  std::string name;
  uint16_t lid = 0;
  uint8_t gid[16] = {};
};

/// What the engine does with what arrives (implemented by engine::Device).
class Receiver {
 public:
  virtual ~Receiver() = default;
  /// A request, reply or direct-offer frame arrived from peer `node`; its payload (if any) is
  /// still unread.
  /// Fill `sink` to receive the payload in place, or leave it empty to drop it.
  virtual void on_frame(const std::string& node, const proto::wire::Frame& f, RxSink& sink) = 0;
  /// The payload of the frame last given to on_frame is in its sink (or was dropped).
  virtual void on_frame_done(const std::string& node, const proto::wire::Frame& f,
                             RxSink& sink) = 0;
  /// A connection to `node` is up (first time or after a break): unacknowledged work toward
  /// it is replayed.
  virtual void on_peer_up(const std::string& node) = 0;
  /// Peer `node` announced guest `g` (it joined there, or its device moved there): QPs facing
  /// it follow it.
  virtual void on_guest_located(const GuestInfo& g, const std::string& node) = 0;
  /// True while a QP here faces a guest on `node` (connected to it, not in error): the
  /// connection to `node` is not closed for being idle.
  virtual bool uses_peer(const std::string& node) const {
    (void)node;
    return false;
  }
};

/// Where a frame ends in its connection's byte stream (after send()): `conn` names the
/// connection (a new one after a reconnect), `end` the bytes queued on it up to that frame's end.
struct TxMark {
  uint64_t conn = 0;
  uint64_t end = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  /// This backend's node name.
  virtual const std::string& self() const = 0;
  /// True when every pair, even one on this backend, goes through this transport.
  virtual bool forced() const = 0;
  /// The peer node hosting the guest with this LID / GID, or "" when no peer announced one.
  virtual std::string locate_lid(uint16_t lid) const = 0;
  virtual std::string locate_gid(const uint8_t gid[16]) const = 0;
  /// Why the directory cannot answer now (its store is unreachable), or "": a destination it
  /// does not know then is said so, not silently retried.
  virtual std::string directory_unavailable() const { return {}; }
  /// Queues a frame for `node` with `payload` gathered from `spans` (read when the socket
  /// takes them, not copied now). A known peer with no connection is dialed now and the frame
  /// waits for the handshake. False when `node` cannot be reached now (not known, or its
  /// dials are failing: as a peer that is down).
  /// `flow` names the QP it is for (0: none), so that drop_flow can take it back.
  virtual bool send(const std::string& node, proto::wire::Type t, const void* body,
                    std::span<const Span> payload = {}, std::span<const Hold> holds = {},
                    uint64_t flow = 0) = 0;
  /// Takes back the frames of `flow` still queued for `node` and not begun on the socket (a QP
  /// that failed or went away: nothing of it may hold up the others). Frames batched with
  /// another flow's stay. The stream's marks keep their meaning.
  virtual void drop_flow(const std::string& node, uint64_t flow) = 0;
  /// Bytes of the stream up to `m` that this backend still holds (not yet handed to the
  /// socket): how deep in the queue the frame at `m` sits. 0 once written, or when `m` is of
  /// another connection.
  virtual uint64_t tx_unwritten(const std::string& node, const TxMark& m) const = 0;
  /// The mark of the frame last queued for `node` ({0, 0} without a connection).
  virtual TxMark tx_mark(const std::string& node) const = 0;
  /// True when the peer's TCP has acknowledged every byte up to `m` on that same connection:
  /// the frame is at the peer, not in a queue here (false when the connection is gone).
  virtual bool tx_delivered(const std::string& node, const TxMark& m) = 0;
  /// Grows whenever the connection to `node` moves: the peer acknowledged more of our bytes or
  /// sent us more of its own (an ACK timer spends no retry while it grows).
  virtual uint64_t tx_progress(const std::string& node) = 0;
  /// How long the connection to `node` may move nothing before its peer counts as not
  /// answering: the path's round trip and its variation as TCP measures them (TCP's own
  /// retransmission timeout without its floor); with a segment unacknowledged, TCP's timeout
  /// itself (the peer's TCP may delay its ACK until then); while TCP backs off a lost segment's
  /// retransmission (its first few backoffs), until its next try; in ns; 0 without a connection.
  virtual uint64_t tx_patience_ns(const std::string& node) = 0;
  /// How long an answer the peer sent may take to reach us through its TCP's recovery of a lost
  /// segment (which nothing here can see: the path's other direction), the path's retransmission
  /// timeout measured here standing for the peer's: its first tries and backoffs as
  /// tx_patience_ns waits them out for ours, from the first send; in ns; 0 without a connection.
  virtual uint64_t peer_recovery_ns(const std::string& node) = 0;
  /// True when the peer's TCP has acknowledged every byte sent to it and takes no more (its
  /// receive window is closed) while we have more to send: its backend is not reading (not
  /// scheduled, or stopped), on a path that delivers.
  virtual bool peer_window_closed(const std::string& node) = 0;
  /// True when frames to `node` go on a connection we dialed whose peer's TCP has acknowledged
  /// everything we sent on it and whose peer backend has not answered it yet (no Hello; TLS: no
  /// handshake): its host accepted the connection and no backend has taken it, as while a
  /// backend restarts under keep_state (its keeper holds the listener). A slow peer backend on a
  /// path that delivers, waited for as long as the transport waits for a Hello.
  virtual bool peer_not_taken(const std::string& /*node*/) { return false; }
  /// Where the connection to `node` stands as TCP sees it, for a log line when a QP gives up on
  /// it ("tcp: 3 segments unacknowledged, ..."); empty without one.
  virtual std::string path_state(const std::string& /*node*/) { return {}; }
  /// True when bytes from `node` have arrived that this backend has not read yet (in the
  /// socket, or buffered here): an answer may be among them. (A backend that was not scheduled
  /// for a while sees its timers before it reads what came meanwhile.)
  virtual bool rx_pending(const std::string& node) = 0;
  /// A local guest appeared (up) or left: told to every peer, now and on each (re)connect.
  virtual void announce(const GuestInfo& g, bool up) = 0;
  /// The peer nodes connected now (this node too when it dialed itself, forced). Empty for a
  /// transport without peers.
  virtual std::vector<std::string> connected() const { return {}; }
  /// The peer nodes a datagram to a multicast group goes to, once each: those connected now
  /// and those known but not connected (connections are made on demand: the send dials them).
  virtual std::vector<std::string> group_peers() const { return connected(); }
  /// The IPv4 address (network order) of the connection to `node`, as its socket's peer: where
  /// that backend's host is reached (a direct offer's libraries listen there). 0 when there is
  /// no connection or it is not IPv4.
  virtual uint32_t peer_ipv4(const std::string& node) const = 0;
  /// This end's IPv4 address (network order) of the connection to `node`: the address that
  /// backend reaches us by (where our libraries listen for a direct offer). 0 without one.
  virtual uint32_t local_ipv4(const std::string& node) const = 0;
  /// Dials `node` now when it is a peer this transport can dial and no connection to it is up
  /// or under way: whoever needs one soon (a direct offer's address) asks again then. False
  /// when no connection to it can come.
  virtual bool want_connection(const std::string& /*node*/) { return false; }
  /// A request or reply from `node` failed a check (it is not the QP's peer, or names a QP
  /// that is not there): counted, and logged (rate-limited) with the peer's address.
  virtual void refused_frame(const std::string& node, const std::string& why) = 0;
};

}  // namespace vrdma::transport
