// The direct path across backends, inside the library: what its files share (remote.cc the
// API, remote_conn.cc the hub and connections, remote_datapath.cc requests and responses,
// remote_tls.cc the TLS sessions, the dial and the writing of frames). Private to those files;
// remote.h is the rest of the library's view.
//
// Connections. A QP pair shares one TCP connection, dialed by the first of the two libraries to
// send; the other adopts it when it sends too (a requester whose peer's library has dialed it
// uses that connection instead of dialing). Both directions then ride on one stream: the kernel
// acknowledges each side's data on the other side's, where two one-way connections cost a pure
// TCP ACK per message, inside the receiver's recv() (a ping-pong 14 -> 20 us per round trip
// across the namespace hosts). Only when both dial at once do two connections stay, one per
// direction, each carrying requests one way and their responses back.
//
// No receive. A request that finds no receive (or no room for its completion) is not waited
// for on the stream: that would stop the responses behind it, which the application may be
// waiting for before it posts one. The responder answers kRnr and drops it and every request
// after it until the requester's kRewind; it sends kResume once a receive is posted, and the
// requester then writes kRewind and its requests from the dropped one on again (an RNR NAK, retried
// at once). A QP whose rnr_retry is below 7 does not wait that long: it resends after the
// responder's min_rnr_timer (which kRnr carries), rnr_retry times, then completes the WR with
// RNR_RETRY_EXC_ERR (proto/responder_rules.h). So every WR keeps what it takes to be sent again.
//
// Threads. The application's thread posts (writes requests) and, while it polls an empty CQ,
// reads the connections of that CQ's QPs itself; the hub's thread waits in epoll for the rest:
// a target that only spins on its memory, a backlog to flush. Per connection: rx_mu (reading and
// executing), tx_mu (writing and the backlog); per QP: fl_mu (WRs in flight, the send ring, and
// the order requests are written in). Order: rx_mu, fl_mu, tx_mu; nothing takes an rx_mu while
// it holds fl_mu or tx_mu, nor fl_mu while it holds tx_mu. Innermost, ssl_mu: held only around
// each call into the connection's TLS session, which a read and a write must not enter at once.
//
// Revoke (before a move of either guest: the connection cannot move with it). Our backend asks
// (RingHeader::direct_revoke = kRevokeAsk, seen at the hub's tick), or the peer's library does
// (its kRevoke frame). We then send nothing more ourselves (posts go to the send queue, which the
// backend holds while the word says kRevokeAsk), send kRevoke with how many requests we sent in
// all, and keep reading, executing and answering. Once every request of ours is answered and we
// have executed every one the peer's kRevoke counts, nothing of the pair is between the two
// libraries: the connections close and the word says kRevokeDone. The backends then carry the
// QPs from their cursors and PSNs, which the direct path never moved. Once our backend has
// taken the answer (the word is 0 again: after the move, or the snapshot), the QP starts
// afresh (rejoin): a QP that had offered offers again (the new backend says where to listen;
// the peer's backend passes the offer on as the first time), a requester asks kDirectRemote at
// its next post, and the pair goes direct again as at first, with nothing in flight.
//
// TLS. Every connection is TLS 1.3 with an external PSK (no certificates): the dialer names the
// QP pair (PskIdentity), both derive the key from the offer's token with HKDF, and the acceptor
// finds the offer by that identity. A stranger without the token fails the handshake; one that
// does not even start with a TLS record is closed unread and unanswered. OpenSSL runs only the
// handshake: its records are then ours (common/tls_record.h, as the backends' transport does),
// sealed straight from the frames' pieces into a send buffer and opened from a read buffer,
// many records a syscall, the reading side (rx_mu) and the writing side (tx_mu) each on its
// own. The hello and its answer are read a record at a time, no byte past them: what follows
// is in the socket, where epoll sees it. Reads: what the stream holds (whole records read from
// the socket) epoll does not see: a read stops only once the stream holds nothing. Writes: the
// bytes a write takes are sealed at once; ciphertext the socket did not take waits in the
// stream, and the connection wants EPOLLOUT until it is gone (want_out).
#pragma once

#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <array>
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/listener_rest.h"
#include "common/log.h"
#include "common/tls_record.h"
#include "common/unique_fd.h"
#include "proto/direct_wire.h"
#include "verbs/internal.h"
#include "verbs/remote.h"

namespace vrdma::verbs {

// The direct path's tuning, its TLS types and (below) the functions its files share: a named
// namespace, hidden like every symbol of the library but the verbs. The wire format itself is
// proto/direct_wire.h.
namespace dlink {

constexpr size_t kRxBuf = 64 * 1024;
constexpr uint64_t kDirectReadMin = 16 * 1024;  ///< payloads this large are read in place
/// After a frame with such a payload, the next header is read with at most this much behind it:
/// a large payload that follows then goes in place, not through the buffer (one copy less).
constexpr size_t kHeaderReadAfterLarge = 1024;
constexpr int kDialMs = 1000;  ///< connect, TLS handshake and hello, in all
/// The one TLS 1.3 suite of the libraries' connections (make_tls): with AES-NI, the cheapest.
constexpr const char* kTlsSuite = "TLS_AES_128_GCM_SHA256";
/// Each direction's ciphertext buffer of a connection: up to 8 records a syscall.
constexpr size_t kTlsBuf = 8 * tls::kTlsMaxRecord;
/// A connection whose TLS handshake and hello have not come by then is closed; at most kMaxPending
/// wait at a time (more are closed as they come): strangers can hold neither descriptors nor the
/// hub's thread.
constexpr uint64_t kHelloMs = 2000;
constexpr size_t kMaxPending = 16;
constexpr size_t kMaxListeners = 8;                ///< addresses a hub listens on
constexpr uint64_t kStrangerLogNs = 1000000000;    ///< a line per kind of refusal per second
constexpr uint64_t kAcceptLogNs = 10000000000ull;  ///< accept out of descriptors: every 10 s
constexpr int kClaimMs = 10;
/// An empty poll whose CQ's previous empty poll was longer ago than this claims no connection
/// that brought the peer's requests since, and gives such claims back: an application that
/// calls its progress once a millisecond between sleeps (ucx_perftest's passive side) held a
/// peer's READ until its next poll, where the hub, woken by the request, answers at once.
/// (Not for a long gap alone: ib_write_bw's polls come between bursts of posts, and with its
/// connection unclaimed the hub's wake-ups for the ACKs took the CPU from it: its 4 KiB stream
/// across hosts fell 5x.)
constexpr uint64_t kUnclaimGapNs = 200'000;
/// A claim a poll gives back on finding a completion (remote_release: the application may now
/// wait in its memory for the peer's WRITE) leaves the ACK it owes to ride on the application's
/// next request, which in a WRITE ping-pong (ib_write_lat) follows within microseconds: the
/// peer, still polling for that ACK, then reads the WRITE with it and executes it in its own
/// poll, where an ACK sent alone ended the peer's poll and left the WRITE to its hub's wake-up
/// (37 µs typical one way across the namespace hosts, ib_send_lat's 4.2). Neither posting nor
/// polling within this long (a poll sends what it owes), the hub sends it (Hub::ack_timer):
/// a peer's WR waits at most ~1.5 ms for it then. The hub wakes about once per this long while
/// ACKs are deferred; at 200 µs those wake-ups made ib_write_lat's average 24-39 µs, at 1 ms
/// 11-16 (typical 5-8 in both).
constexpr uint64_t kAckDeferNs = 1'000'000;
/// After the hub took a request off a connection it polls for this long before it sleeps again
/// (VRDMA_POLL_SPIN_US overrides; 0 sleeps at once), as the backend does (--spin-us): a target
/// that spins on its memory (ib_write_lat) takes the next request without a wake-up, which costs
/// ~60 us on a 2-vCPU VM whose CPUs the spinning programs hold.
constexpr uint64_t kHubSpinUs = 200;

struct SslFree {
  void operator()(SSL* s) const noexcept { SSL_free(s); }
  void operator()(SSL_CTX* c) const noexcept { SSL_CTX_free(c); }
};
/// A TLS session during its handshake. It never closes its descriptor (set_socket).
using SslPtr = std::unique_ptr<SSL, SslFree>;
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslFree>;

/// A handshake's traffic secrets, which OpenSSL's key log callback hands over (make_tls; the
/// SSL's ex data at secrets_index()) and the take-over gives to the connection's own records.
struct TlsSecrets {
  std::vector<uint8_t> client, server;
  TlsSecrets() = default;
  TlsSecrets(const TlsSecrets&) = delete;
  TlsSecrets& operator=(const TlsSecrets&) = delete;
  ~TlsSecrets();
};

}  // namespace dlink

// The files of the direct path across backends read the protocol's names and their own
// unqualified; this header is theirs only.
using namespace vrdma::proto;
using namespace proto::dwire;
using namespace dlink;

/// What the hub's epoll reports: the stop event, the listener, a connection in its hello, or a
/// connection. The kind is told by the object's address (run()), never read through it: a
/// connection may be gone by the time its event is looked at.
struct Watch {
  enum Kind { kStop, kWake, kAckTimer, kListen, kPending, kConn };
};

/// A connection to a peer's library. Its fields go by what guards them, group by group (the
/// lock order is in this file's opening comment); the atomics are read by any thread.
struct Conn : Watch {
  // Set before the connection is published (RemoteQp::in/out under Hub::mu, register_conn)
  // and read-only from then on.
  UniqueFd fd;
  /// The TLS session's records on `fd`, every byte: its reading side under rx_mu, its writing
  /// side under tx_mu.
  std::unique_ptr<tls::RecordStream> rs;
  Hub* hub = nullptr;
  bool peer_takes_requests = true;  ///< ours may go on it (the dialer said so in its hello)
  const ibv_cq* send_cq = nullptr;  ///< the CQs whose polls read this connection
  const ibv_cq* recv_cq = nullptr;
  const RingHeader* rq_hdr = nullptr;  ///< the QP's receive queue (or its SRQ)
  /// Which frames it may bring: the peer's requests (it is our QP's `in`), answers to ours (it
  /// is our `out`); both once one connection carries both directions. Set before any such
  /// frame can come.
  std::atomic<bool> req_in{false}, resp_in{false};

  // Reading and executing: under rx_mu.
  std::mutex rx_mu;
  VQp* qp = nullptr;  ///< null once the QP is gone
  /// Why a read failed, when TLS said (say, a record that failed its integrity check).
  std::string tls_err;
  // A buffer, and the frame being taken in.
  std::vector<uint8_t> buf = std::vector<uint8_t>(kRxBuf);
  size_t beg = 0, end = 0;
  enum class Rx { kHeader, kStart, kPayload } rx = Rx::kHeader;
  Frame f{};
  uint64_t left = 0;     ///< payload bytes still to come
  bool large = false;    ///< the last frame's payload was kDirectReadMin or more (see fill())
  bool emptied = false;  ///< the last read of the socket left nothing in it (see drain())
  MemSpan dst[kMaxSge];
  size_t nd = 0, di = 0;
  uint64_t doff = 0;
  bool discard = false;  ///< the payload goes nowhere
  bool lost = false;     ///< ... and the request counts as executed (UC: lost, not refused)
  bool uc_dead = false;  ///< responder, UC: our QP failed a receive; every request is lost
  RecvWqe rwqe{};        ///< responder: the receive WQE the frame lands in
  uint32_t rcons = 0;
  /// Responder: after a NAK, requests are dropped until the peer closes. Written under rx_mu;
  /// atomic because send_ack reads it from threads that do not hold rx_mu (a poll's first look,
  /// the hub's release of an idle claim).
  std::atomic<bool> nak_sent{false};
  /// Responder: requests executed (written under rx_mu), and how many of them the peer has been
  /// told of (by an ACK here, or riding on a request of ours on the other connection).
  std::atomic<uint64_t> executed{0}, acked{0};
  bool rnr = false;  ///< responder: sent kRnr; requests are dropped until the peer's kRewind

  // Who reads it: atomics, and the hub's own count.
  /// The application polls a CQ of this connection's QP, and reads it itself: the hub does not
  /// watch it (its wake-ups would only take the CPU from the poller; and with the descriptor in
  /// an epoll at all, each segment that arrives runs epoll's callback in the sender's softirq),
  /// but for EPOLLOUT while a write waits for room (rearm). Ends when a poll
  /// finds a completion, or when the polls stop (`polls` still, checked every kClaimMs).
  std::atomic<bool> claimed{false};
  std::atomic<uint32_t> polls{0};
  uint32_t polls_seen = 0;  ///< the hub's thread's only
  std::atomic<uint64_t> executed_polled{0};  ///< `executed` at the last empty poll (kUnclaimGapNs)
  /// When unclaim(c, false) left an ACK owed (mono_ns; 0: none): Hub::ack_timer's.
  std::atomic<uint64_t> ack_deferred_ns{0};

  // Writing: under tx_mu, what the socket did not take yet.
  std::mutex tx_mu;
  struct Piece {
    std::vector<uint8_t> own;  ///< a copy, or empty when `p` is the application's memory
    const uint8_t* p;
    size_t n;
  };
  std::deque<Piece> backlog;
  /// `polls` when a request of the application's was last written out at once: the first of a
  /// burst of posts goes at once, the rest only seal into the stream (`held`) until the next
  /// poll of the connection's CQs writes them out with one syscall (remote_progress), or the
  /// hub does when the polls stop (release_idle_claims). Only while the connection is claimed.
  uint32_t pushed_at_polls = ~0u;
  std::atomic<bool> held{false};
  std::atomic<bool> want_out{false};
  std::atomic<bool> broken{false};

  // The hub's epoll registration: under arm_mu, one epoll_ctl at a time, from the current flags.
  std::mutex arm_mu;
  bool watched = false;
};

struct Hub {
  VContext* ctx = nullptr;
  /// Both sides' TLS settings (make_tls), made the first time a QP goes direct to a peer on
  /// another host (hub_tls): SSL_CTX_new costs ~10 M instructions (~3 ms), half of a same-host
  /// ibv_rc_pingpong's, whose QPs never need it.
  SslCtxPtr tls;
  std::once_flag tls_once;
  std::mutex mu;  ///< conns, and the control fields of every RemoteQp
  std::vector<std::shared_ptr<Conn>> conns;
  /// A QP dials its peer's library only while the context has fewer connections than this
  /// (VRDMA_DIRECT_REMOTE_QPS, default kDirectConnsDefault); the others stay on the backends.
  size_t max_conns = 0;
  bool said_max = false;  ///< the first QP kept on the backends by max_conns was logged (under mu)
  std::atomic<uint32_t> gen{1};  ///< moves when conns does
  UniqueFd ep, stop;
  UniqueFd wake;  ///< a connection the thread did not make: its wait gets the tick (hub_timeout)
  Watch stop_w, wake_w;
  /// Deferred ACKs (kAckDeferNs): armed by unclaim(c, false) when `ack_armed` was clear (a
  /// timer costs a VM exit: ~10 µs on the 2-vCPU VM, more than the ACK's send); when it fires,
  /// the hub sends the ACKs deferred at least half that long ago that did not ride on a
  /// request since, and arms it again for younger ones.
  UniqueFd ack_timer;
  Watch ack_w;
  std::atomic<bool> ack_armed{false};
  /// A listener on one address of this host: the one our backend says the peer's library
  /// dials (several only when QPs face backends reached through different addresses). Made by
  /// the application's thread under listen_mu, published by `nlisteners`; from then on only
  /// the thread touches `rest`. Never closed before the hub goes.
  struct Listener : Watch {
    UniqueFd fd;
    uint32_t ipv4 = 0;  ///< network order
    uint16_t port = 0;  ///< host order
    /// accept found no descriptor: the listener is not watched for a while (not to spin).
    ListenerRest rest{kAcceptLogNs};
  };
  std::mutex listen_mu;
  std::array<Listener, kMaxListeners> listeners;
  std::atomic<size_t> nlisteners{0};
  /// A connection until its hello is checked: at most kMaxPending, each for kHelloMs.
  struct Pending : Watch {
    UniqueFd fd;
    SslPtr ssl;             ///< once its first byte is a TLS handshake's
    TlsSecrets secrets;     ///< what the handshake reports (make_tls's key log callback)
    std::unique_ptr<tls::RecordStream> rs;  ///< after the handshake: the hello comes through it
    bool shook = false;     ///< the handshake is done
    bool want_out = false;  ///< the handshake waits for room to write
    /// From psk_find(): the identity it found an offer for, and that offer's token; or why none.
    bool known = false;
    PskIdentity id{};
    uint8_t token[kDirectTokenBytes] = {};
    std::string why;
    Hello h{};
    size_t got = 0;
    uint64_t deadline = 0;
    sockaddr_in from{};
  };
  std::vector<std::unique_ptr<Pending>> pending;  ///< the thread's own
  /// The QPs that offered or were let send directly (watch_qp), for the revoke tick: under
  /// qps_mu, which a destroy or a reset takes too (outside every lock here but a QP's SQ lock).
  std::mutex qps_mu;
  std::vector<VQp*> qps;
  std::atomic<size_t> nqps{0};
  /// QPs whose WRs in flight fail when their retry budget runs out (RemoteQp::doomed_at), for
  /// doom_tick; under doom_mu (taken under any other lock, nothing under it).
  std::mutex doom_mu;
  std::vector<VQp*> doomed;
  /// Strangers, counted by the thread (read by anyone): hellos refused (not TLS, a failed
  /// handshake: no offer for its identity, a wrong key; a wrong QPN pair, magic or version, or
  /// no hello), connections closed because kMaxPending were waiting, and hellos
  /// that did not come within kHelloMs.
  std::atomic<uint64_t> refused{0}, over_cap{0}, timed_out{0};
  log::Every refused_log{kStrangerLogNs}, over_cap_log{kStrangerLogNs},
      timed_out_log{kStrangerLogNs};  ///< the thread's own
  std::thread thr;
};

namespace dlink {

/// The dialer's PSK, for the handshake of dial() (its SSL's app data while it runs).
struct DialPsk {
  PskIdentity id;
  const uint8_t* token;
};

#if defined(__SANITIZE_THREAD__)
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
extern "C" void AnnotateIgnoreSyncBegin(const char* file, int line);
extern "C" void AnnotateIgnoreSyncEnd(const char* file, int line);
/// While it lives, ThreadSanitizer does not see this thread touch memory (nor, with `sync`,
/// the atomic it does). For the library's copies of a direct peer's data into or out of
/// registered memory, and its atomics there: a NIC's DMA, ordered with the application's own
/// accesses through the peer's process (its messages, its completions), which ThreadSanitizer
/// cannot see, as it cannot see the backend's copies on the mediated paths. The library's own
/// state around them stays checked.
class DmaUnseen {
 public:
  explicit DmaUnseen(bool sync = false) : sync_(sync) {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
    if (sync_) AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
  }
  ~DmaUnseen() {
    if (sync_) AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
  DmaUnseen(const DmaUnseen&) = delete;
  DmaUnseen& operator=(const DmaUnseen&) = delete;

 private:
  bool sync_;
};
#else
struct DmaUnseen {
  explicit DmaUnseen(bool = false) {}
};
#endif

/// The QP types whose pairs may talk library to library (proto::direct_remote_type): RC, and UC
/// (no RNR: a request that finds no receive, or a WRITE the responder's memory refuses, is lost,
/// and its requester completes it successfully once the responder has counted it).
inline bool remote_type(const VQp& qp) { return proto::direct_remote_type(qp.qp.qp_type); }

inline bool answered_by_data(uint32_t op) {
  return op == IBV_WR_RDMA_READ || op == IBV_WR_ATOMIC_CMP_AND_SWP ||
         op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

// remote_tls.cc: the TLS sessions.

/// SSL_set_fd, with nosignal_socket_method's BIO. False when out of memory.
bool set_socket(SSL* ssl, int fd);
/// The QP that offered to take `from_qpn`'s connection (ctx.objs_mu and Hub::mu held).
VQp* offer_of(VContext& ctx, uint32_t to_qpn, uint32_t from_qpn);
/// Both sides' settings: TLS 1.3 and one suite only; the PSK or nothing (no certificate is
/// trusted, so a peer cannot fall back to one); no tickets, no session cache.
SslCtxPtr make_tls(Hub& h);
/// The hub's TLS context, made on first use (Hub::tls): null when OpenSSL cannot make one
/// (said once).
SSL_CTX* hub_tls(Hub& h);
/// The reason of the oldest TLS error of this thread (the queue is emptied).
const char* tls_reason();
/// Connects to the peer's library (blocking, bounded by kDialMs in all): TCP, a TLS handshake
/// with the key derived from `token`, the hello and its answer. The connection (its records in
/// `rs`) and the peer's LID, or invalid with errno and `why` (EBUSY: the peer's library has
/// dialed us).
UniqueFd dial(Hub& h, uint32_t ipv4, uint16_t port, const Hello& hello, const uint8_t* token,
              std::unique_ptr<tls::RecordStream>& rs, uint32_t& peer_lid, std::string& why);
/// The SSL ex data index of a handshake's TlsSecrets (one for the process, taken at first use).
int secrets_index();
/// After `s`'s handshake (a socket BIO, no read ahead: nothing past the handshake was read):
/// the connection's records from its traffic secrets, OpenSSL's no more. Null (`why` set) when
/// OpenSSL gave no secrets or holds data.
std::unique_ptr<tls::RecordStream> take_over(SSL* s, TlsSecrets& sec, const char*& why);
/// Up to n bytes of plaintext from records of `rs` on `fd`, reading no byte of the socket past
/// the record they come in (a hello, its answer): bytes, 0 none now, -1 closed or failed
/// (`why` set when TLS says why).
ssize_t read_bounded(tls::RecordStream& rs, int fd, void* p, size_t n, std::string& why);
/// One read from the connection: bytes, 0 none now, -1 closed or failed (`tls_err` says why, if
/// TLS knows; rx_mu held). `more`: the stream still holds plaintext or whole records (the
/// socket may not wake anyone for them). `p_is_ours` false: p is the application's memory
/// (RecordStream::read).
ssize_t tls_read(Conn& c, void* p, size_t n, bool& more, bool p_is_ours = true);
/// Seals the bytes of `iov` past `skip`, as many as the stream has room for, and writes out what
/// the socket takes (tx_mu held): the bytes taken, 0 none now (the socket is full), -1 broken.
/// What was sealed but not written waits in the stream (tls_push; Conn::want_out).
ssize_t tls_write(Conn& c, const iovec* iov, size_t n, size_t skip);
/// Writes out what the stream holds (tx_mu held): 1 all of it, 0 some left, -1 broken.
int tls_push(Conn& c);

// remote_tls.cc too: writing frames through the connection's records.

/// Writes a frame and its data: what the socket takes now, the rest into the backlog (copied
/// when `copy`). `may_hold`: an application's request, which may wait sealed for its next poll
/// (Conn::held). False when the connection is broken.
bool send_frame(Conn& c, const Frame& f, const MemSpan* data, size_t nd, bool copy,
                bool may_hold = false);
/// Writes what it can of the stream and the backlog (tx_mu held). False when the connection broke.
bool flush_locked(Conn& c);
/// Writes out what is held (Conn::held): requests held for a poll, once the connection is no
/// longer claimed, and what a batch held (Cork).
void flush_held(Conn& c);
/// The connection whose batch of the peer's frames this thread is reading (drain, under its
/// rx_mu), or none: what the thread sends on it meanwhile (answers, ACKs, NAKs) is sealed and
/// held, and written out with one syscall when the batch ends, or before the connection or the
/// QP fails. Each send otherwise runs the whole of TCP for one segment (an 8 B READ's answer
/// ~3 µs, the peer's receive included): 16 READs in flight were answered at 0.33 M/s. Other
/// threads' sends go at once, as always.
inline thread_local Conn* t_corked = nullptr;
/// Sets t_corked for its scope; release() ends it early and writes out what was held.
class Cork {
 public:
  explicit Cork(Conn& c) : c_(c), outer_(t_corked) { t_corked = &c; }
  ~Cork() { release(); }
  Cork(const Cork&) = delete;
  Cork& operator=(const Cork&) = delete;
  void release() {
    if (t_corked != &c_) return;
    t_corked = outer_;
    if (c_.held.load(std::memory_order_relaxed)) flush_held(c_);
  }

 private:
  Conn& c_;
  Conn* outer_;
};

// remote_memory.cc: what a peer's request may touch here.

/// This process's MR for a key in `pd` (thread-safe; no cache).
bool find_mr(VContext& ctx, uint32_t pd, uint32_t key, LocalMr& out);
/// A SEND_WITH_INV's invalidation of `rkey` by responder `qp`, done by the backend, which keeps
/// windows (kMwView, kMwViewInvalidate). False: check_invalidate refused it.
bool invalidate_window(VQp& qp, uint32_t rkey);
/// The responder's rules for a WRITE, READ or atomic (`op`) of `len` bytes at `iova` under
/// `rkey`, against this process's MRs or a window over one: IBV_WC_SUCCESS and in `p` where that
/// lies here (null when it names no memory), or the status the requester gets.
ibv_wc_status rkey_memory(VQp& qp, uint32_t op, uint32_t rkey, uint64_t iova, uint64_t len,
                          uint8_t*& p);

// remote_datapath.cc: requests, responses, completions.

/// Completes the head with `head_status` (or its own local error) and flushes the rest (fl_mu).
/// `why`: the QP goes to ERR (to_error, first: the backend hears of it before the completions
/// can be polled); null when the application moves it itself (ibv_modify_qp).
void flush_inflight(VQp& qp, RemoteQp& r, int head_status, const char* why);
/// The QP to ERR on the direct path: its connections end (the peer sees them close) and the
/// backend moves it (flushing its receive queue). Once. Called with fl_mu (and rx_mu) held from
/// flush_inflight: the Hub::mu and the context's rpc_mu it takes are taken under no other lock.
/// `quiet` (a UC responder whose receive failed): the connections stay, and the peer never
/// hears of it (what it sends next is lost, start_request).
void to_error(VQp& qp, const char* why, bool quiet = false);
/// Writes a WR's request (fl_mu held: requests go out in the order of their numbers), with the
/// ACK for the peer's requests riding on it. False: the connection is broken.
bool write_request(RemoteQp& r, Conn& out, Inflight& e, bool may_hold = false);
/// An ACK for what this responder executed and has not told the peer of yet.
void send_ack(Conn& c);
/// Where `qp`'s receives come from: its RQ, or its SRQ's ring.
const RingHeader* receive_queue(const VQp& qp);
/// A kRnr owed a kResume and a receive is there now: the peer sends its requests again (rx_mu
/// held). Called after a post_recv (or post_srq_recv), from empty polls and from the hub's tick.
void try_resume(Conn& c, VQp& qp, RemoteQp& r);
/// A counted RNR retry whose wait is over: the requests the peer dropped go again (rx_mu held,
/// `c` the connection our requests go on). From empty polls and the hub's tick.
void rnr_retry_due(Conn& c, VQp& qp, RemoteQp& r);
/// Reads and executes what has arrived (rx_mu held, c.qp set). True when it took anything.
/// `defer_ack`: the application's thread reads; the responder's ACK waits to ride on its next
/// request (remote_post), or goes at its next empty poll (remote_progress).
bool drain(Conn& c, bool defer_ack);

// remote_conn.cc: the hub and hellos (dial is remote_tls.cc's).

uint64_t now_ms();  ///< CLOCK_MONOTONIC (mono_ns, common/clock.h)
/// TCP_NODELAY, and a TCP_USER_TIMEOUT that ends a connection to a peer that vanished.
void set_sock_opts(int fd);

/// Makes the hub watch `c` for what it needs now: data (unless it waits for a receive) and room
/// to write (while there is a backlog).
void rearm(Conn& c);
/// The application's claim on `c` ends: the hub reads it again, what was held for the next poll
/// goes out, and the ACK owed with it: now, or with `ack_now` false on the application's next
/// request or from the hub kAckDeferNs later, whichever comes first.
void unclaim(Conn& c, bool ack_now = true);
/// Hub::ack_timer goes off `ns` from now (remote_timeout.cc), and what it does then: the ACKs
/// deferred at least half kAckDeferNs ago go, and it is armed again for younger ones.
void arm_ack_timer(Hub& h, uint64_t ns);
void send_deferred_acks(Hub& h);
/// The process's hub, started on first use (an epoll set, a thread; listeners come with the
/// first offer on each address, listen_on()). Null when it cannot be made.
Hub* hub_of(VContext& ctx);
/// The port the hub listens on at `ipv4` (network order; the address our backend says the peer's
/// library dials), listening there first if it does not yet; 0 when it cannot.
uint16_t listen_on(Hub& h, uint32_t ipv4);
RemoteQp& remote_of(Hub& h, VQp& qp);
/// Asks the backend for the peer's offer and connects (under the SQ lock). True: `out` is up.
bool connect_out(VQp& qp);
/// The peer's library of `qp` went (its connection closed or reset) with WRs in flight (fl_mu
/// held): they fail when the QP's retry budget runs out (doom_tick), as a fabric's retries
/// would. False (fail them now): the QP's timeout is 0 (no timeout).
bool doom(Hub& h, VQp& qp, RemoteQp& r, const char* why);
/// doom's reason when a post finds the connection ended.
constexpr const char* kPeerGone = "the connection to the peer's library ended";
/// The doomed QPs whose time has come: their WRs in flight fail (RETRY_EXC_ERR), the QP goes
/// to ERR. The hub's tick (qps_mu taken here).
void doom_tick(Hub& h);
/// QPs with WRs in flight whose connection has moved nothing of theirs past TCP's own retries
/// (an outage) for their retry budget: those WRs fail (RETRY_EXC_ERR), the QP goes to ERR, as
/// through the backends. The hub's tick (qps_mu taken here).
void ack_tick(Hub& h);
/// Ends a QP's connections (it leaves RTS, or goes).
/// `take_arrived` (the QP is destroyed): what the peer's library sent that has arrived is taken
/// first, as a device executes what reached a QP while it lived.
void teardown(VQp& qp, bool take_arrived = false);
/// Ends a connection for good: nothing reads it or writes it again.
void retire(Hub& h, const std::shared_ptr<Conn>& c);

// remote_revoke.cc: back to the backends.

constexpr int kRevokeTickMs = 50;  ///< how often a hub without connections looks for an ask
/// An empty poll reads a connection it has no answer to wait for once in this many.
constexpr uint32_t kRevokeReadEvery = 64;
/// Library connections a context dials at most by default (Hub::max_conns). Measured on 2 vCPUs
/// across two namespace hosts, ib_write_bw -s 4096 -q 64: all 64 QPs direct 262-375 MB/s, the
/// backends' transport 660-860, 8 direct and 56 on the backends 1245-1382; -q 8, all direct:
/// 1148-1397 (BENCHMARKS.md, "Many QPs on the direct path across backends").
constexpr size_t kDirectConnsDefault = 8;
/// The QP joins the hub's list (Hub::qps): it offered, or its backend let it send directly.
void watch_qp(Hub& h, VQp& qp);
/// Wakes the hub's thread from its wait, which then sets up its tick anew (hub_timeout): false
/// when the eventfd could not be written.
bool wake_hub(Hub& h);
/// The QP leaves the hub's list (destroyed or reset; qps_mu held).
void forget_qp(Hub& h, VQp& qp);
/// The QP sends nothing more to the peer's library (its posts go to the send queue, which the
/// backend holds meanwhile) and tells it so (kRevoke). Once. No lock but rx_mu held.
void begin_revoke(VQp& qp, RemoteQp& r);
/// Sends kRevoke on `c`: no request of ours after it (r.sent in all). Takes fl_mu.
void tell_revoke(RemoteQp& r, Conn& c);
/// While it lives, connect_out is dialing (RemoteQp::dialing).
struct Dialing {
  explicit Dialing(RemoteQp& r) : r_(r) { r_.dialing.store(true); }
  ~Dialing() { r_.dialing.store(false); }
  Dialing(const Dialing&) = delete;
  Dialing& operator=(const Dialing&) = delete;

 private:
  RemoteQp& r_;
};
/// The peer's kRevoke, read from `c` (rx_mu held).
void peer_revoked(Conn& c, VQp& qp, RemoteQp& r);
/// The hub's tick: begins the revokes our backend asked for, answers those that are settled,
/// and takes the QPs whose answer the backend has taken onto the direct path again (rejoin).
void revoke_tick(Hub& h);
/// Offers the peer's library a connection to `qp` (kDirectOffer: where to listen, then the
/// port and a fresh token): 0, EAGAIN (not yet) or why never (for now). `watched`: from the
/// revoke tick (Hub::qps_mu held; the QP is on its list already), else no lock held.
int offer(Hub& h, VQp& qp, RemoteQp& r, bool watched);

}  // namespace dlink
}  // namespace vrdma::verbs
