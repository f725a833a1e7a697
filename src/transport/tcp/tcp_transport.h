// The TCP transport: one connection per pair of backends that talk, multiplexing all their QPs; the
// directory of which peer hosts which guest (announced on connect and on every change); frames
// of proto/wire.h, small ones batched into one write, large payloads written from and read into
// guest memory in place (writev/readv, non-blocking, resumable across partial transfers).
// Connections on demand: a peer the directory (etcd) found is dialed by the first frame for it;
// static peers are dialed at start (their announcements are the embedded directory). A
// connection idle for idle_close_ms that no QP on either side uses is closed by agreement
// (kClose). A broken connection is redialed (kRedialMs, doubling to kRedialMaxMs while dials
// fail); the engine replays its unacknowledged work when the peer is up again
// (Receiver::on_peer_up).
// Concurrency: owned by the engine thread; poll() is called from the backend's event loop.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/listener_rest.h"
#include "common/log.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "transport/directory.h"
#include "transport/tcp/endpoint.h"
#include "transport/tcp/tls.h"
#include "transport/transport.h"

namespace vrdma::transport::tcp {

/// A configured peer: "ADDR:PORT", or "NODE@ADDR:PORT" (ADDR: IPv4, or IPv6 in brackets) (only NODE
/// may answer there, and only the nodes named so may connect: the peers list is then an
/// allow-list).
struct PeerSpec {
  std::string node;  ///< "" when not named
  std::string addr;
  Endpoint sa;  ///< addr, parsed
};
Result<PeerSpec> parse_peer(const std::string& s);

class TcpTransport final : public Transport {
 public:
  struct Options {
    std::string node;                ///< this backend's name among its peers
    std::string listen;              ///< "ADDR:PORT" or "[IPV6]:PORT"
    std::vector<std::string> peers;  ///< backends to dial, "ADDR:PORT"
    bool force = false;              ///< every pair goes through TCP (dials its own listener)
    /// The cluster credential: every connection is TLS 1.3, mutually authenticated, and a
    /// peer's node name is its certificate's. Null: plain TCP (insecure; the caller decided).
    std::shared_ptr<const TlsContext> tls;
    /// A connection that carried nothing this long and that no QP of either side uses is
    /// closed (kClose); 0: never.
    uint64_t idle_close_ms = 0;
    /// A listener to take instead of binding `listen` when it listens there (keep_state: the
    /// one the keeper held while this backend restarted, with the connections its host
    /// accepted meanwhile); invalid: bind.
    UniqueFd listener{};
  };
  /// Connections made and ended by the on-demand rules (status, metrics).
  struct Counters {
    uint64_t dials = 0;        ///< connects started
    uint64_t idle_closes = 0;  ///< connections closed by agreement for being idle
  };
  /// What this backend refused, by reason (status, metrics).
  struct Refused {
    uint64_t handshake = 0;  ///< TLS handshake failed (no or a wrong credential, not TLS at all)
    uint64_t name = 0;       ///< Hello under a name not its certificate's, or not allowed
    uint64_t pending = 0;    ///< over the cap of unauthenticated connections, or too slow
    uint64_t directory = 0;  ///< a directory entry about what another node (or we) hold
    uint64_t frames = 0;     ///< a request/reply from a node that is not the QP's peer
  };
  /// A live connection to a peer (status).
  struct PeerInfo {
    std::string node, address, identity, cipher;
    uint64_t since_unix = 0;
    uint64_t queued_bytes = 0;   ///< frames queued here, not yet written to the socket/TLS
    uint64_t unacked_bytes = 0;  ///< written, not yet acknowledged by the peer's TCP
    uint64_t rx_bytes = 0;       ///< received on this connection
    uint64_t dropped_bytes = 0;  ///< queued frames taken back (their QP failed or went away)
  };
  /// Connections that have not finished the handshake and Hello: more are closed at accept.
  static constexpr size_t kMaxUnauthenticated = 64;
  /// ... and each is closed if it has not finished them by then.
  static constexpr uint64_t kHelloTimeoutMs = 5000;
  /// A node whose connection is down this long no longer holds its directory entries against
  /// another node's claim (a backend that died; its guests may start elsewhere).
  static constexpr uint64_t kOwnerGoneMs = 10000;
  /// After a node's Hello, its entries it has not announced again by then are dropped.
  static constexpr uint64_t kRedirectoryMs = 2000;
  static constexpr uint64_t kRedialMs = 20;
  /// Dials that keep failing back off, doubling up to this.
  static constexpr uint64_t kRedialMaxMs = 1000;
  /// A connect that has not finished by then is given up and redialed (a SYN to a host that
  /// is gone would otherwise wait for the kernel's minutes).
  /// Above the kernel's first SYN retransmission (1 s) and a long path's RTT: a lost SYN is
  /// retried by the kernel before we give up on the dial.
  static constexpr uint64_t kConnectTimeoutMs = 3000;
  /// While a connect is under way this long, another one starts beside it (a probe), and
  /// replaces the last probe as often: the kernel sends a connect's SYN again only after 1 s,
  /// then 2 s, so a link that comes back (an outage) was found 0-2 s late, and a QP made then
  /// spent its retry budget (0.54 s at `timeout` 14) on the wait. The first attempt still
  /// covers a path slower than this; whichever gets through first is the connection.
  static constexpr uint64_t kProbeMs = 200;
  /// A close asked and not answered by then is given up (the connection stays); a connection
  /// closing by agreement whose peer has not shut its side by then is closed anyway.
  static constexpr uint64_t kCloseWaitMs = 5000;
  /// With the embedded directory, a lookup that found nothing dials every configured peer not
  /// connected (their Hello brings their guests), at most once per this.
  static constexpr uint64_t kAskAllMs = 1000;
  /// How often idle connections and closing ones are looked at.
  static constexpr uint64_t kIdleCheckNs = 50'000'000;

  /// Binds the listener; dialing starts with the first poll().
  static Result<std::unique_ptr<TcpTransport>> create(Options o, Receiver& rx);
  ~TcpTransport() override;

  /// An epoll descriptor that is readable whenever poll() has something to do.
  int fd() const { return epoll_.get(); }
  /// Accepts, reads and dispatches what arrived, writes what is queued, redials. Never blocks.
  /// True when anything moved.
  bool poll(uint64_t now_ns);
  /// When poll() must run next even if nothing arrives (a redial), or 0.
  uint64_t next_deadline() const;
  /// Node names with a live connection (status, tests).
  std::vector<std::string> connected() const override;
  /// Node names this backend may talk to: the directory's nodes and the static peers known by
  /// name (connected or not); a frame for one of them dials it.
  std::vector<std::string> known() const;
  /// A group's datagram goes to every peer connected or known (the send dials a known one).
  std::vector<std::string> group_peers() const override;
  const Counters& counters() const { return counters_; }
  uint64_t idle_close_ms() const { return opt_.idle_close_ms; }
  std::vector<PeerInfo> peers();
  /// A configured peer as we dial it (status: each peer's state and why it last failed).
  struct DialInfo {
    std::string address, node;  ///< as configured ("" node: any may answer)
    std::string state;          ///< "connected", "connecting" or "not connected"
    std::string last_error;     ///< why the last attempt failed or the last connection ended
    uint64_t last_error_unix = 0;
    uint64_t failures = 0;  ///< attempts that failed since the last Hello
  };
  std::vector<DialInfo> dials() const;
  const Refused& refused() const { return refused_; }
  bool secure() const { return opt_.tls != nullptr; }
  /// Where the listener is bound ("[::1]:7000"; the port filled in when it was 0).
  const std::string& listen_address() const { return opt_.listen; }
  /// The listening socket (keep_state: the keeper holds a duplicate across a restart).
  int listener_fd() const { return listen_.get(); }
  /// A directory outside the transport (etcd): locate_* answer from it and announce() tells it
  /// too. Null (the default): the embedded directory alone.
  void set_directory(Directory* d) { directory_ = d; }
  /// A peer the directory found: dialed at "ADDR:PORT", and only `node` may answer there
  /// (replaces an earlier address of it).
  Status add_peer(const std::string& node, const std::string& addr);
  /// A peer that left the directory: no longer dialed; its connection is closed.
  void drop_peer(const std::string& node);

  const std::string& self() const override { return opt_.node; }
  bool forced() const override { return opt_.force; }
  std::string locate_lid(uint16_t lid) const override;
  std::string locate_gid(const uint8_t gid[16]) const override;
  std::string directory_unavailable() const override {
    return directory_ ? directory_->unavailable() : std::string();
  }
  bool send(const std::string& node, proto::wire::Type t, const void* body,
            std::span<const Span> payload, std::span<const Hold> holds, uint64_t flow) override;
  void drop_flow(const std::string& node, uint64_t flow) override;
  uint64_t tx_unwritten(const std::string& node, const TxMark& m) const override;
  void announce(const GuestInfo& g, bool up) override;
  uint32_t peer_ipv4(const std::string& node) const override;
  uint32_t local_ipv4(const std::string& node) const override;
  bool want_connection(const std::string& node) override;
  TxMark tx_mark(const std::string& node) const override;
  bool tx_delivered(const std::string& node, const TxMark& m) override;
  uint64_t tx_progress(const std::string& node) override;
  uint64_t tx_patience_ns(const std::string& node) override;
  uint64_t peer_recovery_ns(const std::string& node) override;
  bool peer_window_closed(const std::string& node) override;
  bool peer_not_taken(const std::string& node) override;
  std::string path_state(const std::string& node) override;
  bool rx_pending(const std::string& node) override;
  void refused_frame(const std::string& node, const std::string& why) override;

 private:
  struct TxItem {
    std::vector<uint8_t> bytes;  ///< frame headers and small payloads, batched
    std::vector<Span> spans;     ///< a large payload, gathered from guest memory at write time
    std::vector<Hold> holds;
    uint64_t total = 0;
    uint64_t flow = 0;     ///< the flow of every frame in it, or 0 (mixed, or none)
    bool dropped = false;  ///< taken back: skipped (its `total` still counts in the stream)
  };
  /// Each connection's read buffer.
  static constexpr size_t kRbufBytes = 64 * 1024;
  enum class Rx : uint8_t { kHead, kPayload };
  struct Conn {
    UniqueFd fd;
    std::string node;         ///< from its Hello
    std::string dialed;       ///< the address we dialed; "" when accepted
    std::string addr;         ///< the peer's ADDR:PORT (logs)
    std::string expect;       ///< the node that must answer (a "NODE@ADDR:PORT" peer), or ""
    std::unique_ptr<TlsStream> tls;  ///< null: plain TCP
    uint64_t opened_ns = 0;          ///< accepted or dialed (the hello deadline counts from here)
    uint64_t since_unix = 0;         ///< when its Hello arrived
    bool connecting = false;  ///< non-blocking connect in progress
    uint64_t dialed_ns = 0;   ///< when the connect started
    bool hello = false;       ///< the peer's Hello arrived
    bool again = false;       ///< in rx_again_
    bool out_ready = false;   ///< EPOLLOUT reported in this poll
    bool drained = false;     ///< TLS: this visit's last socket read emptied it
    bool want_out = false;    ///< EPOLLOUT is registered
    bool dead = false;        ///< closed; freed at the end of poll()
    uint64_t active_ns = 0;   ///< when a frame was last queued or bytes last arrived
    uint64_t asked_ns = 0;    ///< when we asked the peer to close it (kClose kAsk), or 0
    /// Closing by agreement: nothing more is queued on it; its queue is written, then our
    /// side shut (`shut`); it is closed when the peer's side ends too (`peer_eof`).
    bool closing = false;
    bool duplicate = false;  ///< closing: the other of two connections dialed at once
    bool shut = false;
    bool peer_eof = false;
    uint64_t closing_ns = 0;
    // receive side
    std::vector<uint8_t> rbuf;
    size_t rpos = 0, rend = 0;
    Rx rx = Rx::kHead;
    proto::wire::Frame frame;
    RxSink sink;
    uint64_t left = 0;      ///< payload bytes still to come
    uint64_t rx_bytes = 0;  ///< bytes read from the socket so far (progress marker)
    size_t span_i = 0;
    uint64_t span_off = 0;
    // send side
    std::deque<TxItem> txq;
    uint64_t sent = 0;  ///< bytes of txq.front() already written
    // where frames are in the stream (Transport::TxMark)
    uint64_t id = 0;          ///< this connection's number (TxMark::conn)
    uint64_t queued_end = 0;  ///< stream bytes queued so far
    uint64_t written = 0;     ///< ... of which written (to the socket, or into TLS)
    /// TLS: (ciphertext produced, plaintext written) after each record; popped once acked.
    std::deque<std::pair<uint64_t, uint64_t>> marks;
    uint64_t plain_acked = 0;  ///< stream bytes the peer's TCP acknowledged (last computed)
    /// Dropped items are counted in `written` without reaching the socket. Plain TCP: the
    /// socket bytes written before each skip, and the bytes skipped up to it (TLS maps through
    /// `marks`).
    uint64_t skipped = 0;
    std::deque<std::pair<uint64_t, uint64_t>> skips;
    uint64_t skipped_acked = 0;  ///< of `skipped`, those behind what the peer acknowledged
    uint64_t dropped_bytes = 0;
    uint64_t dropped_queued = 0;  ///< of them, still in txq (not passed over yet)
  };
  struct Dial {
    std::string addr;
    std::string expect;  ///< "NODE@": only NODE may answer
    Endpoint sa;
    Conn* conn = nullptr;
    Conn* probe = nullptr;  ///< a second connect beside `conn`'s, under way (kProbeMs)
    uint64_t next_ns = 0;
    uint64_t backoff_ms = kRedialMs;  ///< doubles while dials fail; back to kRedialMs on Hello
    std::string node;  ///< who answered there last; no redial while we have a connection to it
    std::string last_error;  ///< DialInfo
    uint64_t last_error_unix = 0;
    uint64_t failures = 0;
    /// Dialed (and redialed) only while wanted: static peers from the start, a directory's
    /// node once a frame is for it; no longer after its connection closed for being idle.
    bool wanted = true;
  };
  /// An attempt on `d` failed, or its connection ended: `why` is kept for status.
  static void note_failure(Dial& d, const std::string& why);
  struct Remote {
    std::string node, name;
    bool stale = false;  ///< from before the node's last Hello, not announced again yet
  };
  /// A node's claim on a LID or GID another node holds: applied when that node lets it go.
  struct Claim {
    std::string node;
    GuestInfo g;
  };

  TcpTransport(Options o, Receiver& rx) : opt_(std::move(o)), rx_(rx) {}
  Status start();
  /// Accepts what is queued; false when the listener had to be paused (no descriptors).
  bool accept_all(uint64_t now_ns);
  void watch_listener(bool on);
  /// Dials `d` (its connection in `conn`) and backs its next dial off.
  void dial(Dial& d, uint64_t now_ns);
  /// A non-blocking connect to `d`'s address with our Hello queued; null when it failed at once.
  Conn* connect_to(Dial& d, uint64_t now_ns);
  /// `d`'s connect is under way: a probe beside it every kProbeMs.
  void probe(Dial& d, uint64_t now_ns);
  /// A dialed connection's connect finished: of a dial's attempt and its probe, the other goes.
  void connected(Conn& c);
  Conn* add_conn(UniqueFd fd, const std::string& dialed, uint64_t now_ns);
  /// Moves the TLS handshake on; false when the connection failed (closed then).
  bool handshake(Conn& c);
  /// Reads plaintext (through TLS when on): like check_read's result.
  ssize_t read_into(Conn& c, void* p, size_t n);
  /// Reads and dispatches what arrived on c (bounded); true when anything moved.
  bool read_conn(Conn& c);
  /// Writes what txq holds through TLS; false when the connection failed.
  bool flush_tls(Conn& c);
  /// Closes connections that did not finish their hello in time.
  void expire_unauthenticated(uint64_t now_ns);
  /// Applies the claims whose holder let go (or is gone).
  void settle_claims(uint64_t now_ns);
  /// The node holding this LID/GID against `node`'s claim, or "" when the claim may be applied.
  std::string holder_against(const std::string& node, const GuestInfo& g, uint64_t now_ns) const;
  void apply_guest(const std::string& node, const GuestInfo& g);
  /// Counts a refusal and logs it (refuse_log_ bounds the lines; the rest are counted).
  template <typename... Args>
  void refuse(uint64_t& counter, fmt::format_string<Args...> f, Args&&... args);
  bool allowed(const std::string& node) const;
  bool connected_to(const std::string& node) const { return by_node_.count(node) != 0; }
  /// The connection frames for `node` go on: the live one, or the one being dialed for it.
  Conn* tx_conn(const std::string& node) const;
  /// TCP_INFO of that connection; false without one.
  bool tcp_info_of(const std::string& node, ::tcp_info& ti);
  /// The dial of a known peer `node`, or null.
  Dial* dial_of(const std::string& node);
  /// dial_of(node), wanted from now on and dialed now unless connected, dialing or backing off.
  Dial* want_dial(const std::string& node);
  /// Asks to close connections idle for idle_close_ms; gives up unanswered asks.
  void check_idle(uint64_t now_ns);
  void on_close(Conn& c);
  /// Both sides agreed: no more frames on `c`; it is written out, shut, and closed at the end.
  /// `duplicate`: the connection both sides drop after dialing each other at once (on_hello),
  /// not an idle one (not counted as an idle close).
  void begin_closing(Conn& c, bool duplicate = false);
  /// Writes out a closing connection: shuts our side once its queue is empty; closes it when
  /// the peer's side ended too.
  void finish_closing(Conn& c);
  void close_conn(Conn* c, const std::string& why);
  void set_out(Conn& c, bool on);
  /// False when the connection failed (it is closed then).
  bool read_some(Conn& c);
  /// What a read/readv returned: the bytes (> 0), 0 for "nothing now", -1 when the connection
  /// failed or ended (it is closed then).
  ssize_t check_read(Conn& c, ssize_t r);
  bool flush(Conn& c);
  /// Dispatches complete frames in c.rbuf; false on a protocol error (closed then).
  bool consume(Conn& c);
  void on_hello(Conn& c);
  void on_guest(Conn& c, bool up);
  void queue(Conn& c, proto::wire::Type t, const void* body, std::span<const Span> payload,
             std::span<const Hold> holds, uint64_t flow = 0);
  /// Passes over dropped items at the head of c's queue (they count as written).
  void skip_dropped(Conn& c);
  void send_directory(Conn& c);

  Options opt_;
  Receiver& rx_;
  UniqueFd epoll_, listen_;
  /// The listener's rest when accept finds no descriptor (one log line per 10 s).
  ListenerRest accept_rest_{10'000'000'000};
  std::vector<Dial> dials_;
  std::map<int, std::unique_ptr<Conn>> conns_;      ///< by fd
  std::unordered_map<std::string, Conn*> by_node_;  ///< the connection frames to a node use
  std::map<std::string, GuestInfo> local_;          ///< our guests, by name
  std::unordered_map<uint16_t, Remote> by_lid_;
  std::map<std::array<uint8_t, 16>, Remote> by_gid_;
  std::vector<std::unique_ptr<Conn>> graveyard_;  ///< closed during poll(); freed at its end
  std::vector<std::string> allow_;                ///< nodes named in peers ("" = any)
  size_t unauthenticated_ = 0;                    ///< accepted connections before their hello
  /// All connections before their hello (dialed ones too): the hello deadline is looked at
  /// only while there are any (not on every poll of a forced-TCP backend, whose own accepted
  /// connection is never in by_node_).
  size_t prehello_ = 0;
  std::vector<Conn*> rx_again_;  ///< TLS connections with plaintext left to read (no EPOLLIN)
  std::map<std::string, uint64_t> down_since_;  ///< nodes whose connection broke, and when
  /// Nodes that said Hello again: their entries not announced again by then are dropped.
  std::map<std::string, uint64_t> stale_until_;
  std::map<uint16_t, Claim> claims_;  ///< refused claims, by LID
  uint64_t now_ns_ = 0;               ///< of the last poll()
  Refused refused_;
  uint64_t next_conn_id_ = 1;
  /// Stream bytes of `c` the peer's TCP acknowledged (SIOCOUTQ: what the kernel still holds).
  uint64_t acked_of(Conn& c);
  /// Refusal lines: 20 at once, then one a second; the rest are counted in the next line.
  log::Burst refuse_log_{1'000'000'000, 20};
  Directory* directory_ = nullptr;        ///< set_directory
  Counters counters_;
  /// A lookup found nothing (embedded directory): poll() dials every configured peer.
  mutable bool lookup_missed_ = false;
  uint64_t asked_all_ns_ = 0;  ///< when that last happened
  uint64_t idle_checked_ns_ = 0;
  size_t closing_ = 0;  ///< connections closing by agreement
};

template <typename... Args>
void TcpTransport::refuse(uint64_t& counter, fmt::format_string<Args...> f, Args&&... args) {
  ++counter;
  uint64_t held = 0;
  if (refuse_log_.ready(now_ns_, held))
    VLOG_WARN("{}{}", fmt::format(f, std::forward<Args>(args)...), log::held_note(held));
}

}  // namespace vrdma::transport::tcp
