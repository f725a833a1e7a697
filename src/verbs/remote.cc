// The direct path across backends in the library (see remote.h).
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
// requester then writes kRewind and its requests from the dropped one on again (an RNR NAK with
// an infinite retry count, as rnr_retry 7 asks). So every WR keeps what it takes to be sent again.
//
// Threads. The application's thread posts (writes requests) and, while it polls an empty CQ,
// reads the connections of that CQ's QPs itself; the hub's thread waits in epoll for the rest:
// a target that only spins on its memory, a backlog to flush. Per connection: rx_mu (reading and
// executing), tx_mu (writing and the backlog); per QP: fl_mu (WRs in flight, the send ring, and
// the order requests are written in). Order: rx_mu, fl_mu, tx_mu; nothing takes an rx_mu while
// it holds fl_mu or tx_mu, nor fl_mu while it holds tx_mu. Innermost, ssl_mu: held only around
// each call into the connection's TLS session, which a read and a write must not enter at once.
//
// TLS. Every connection is TLS 1.3 with an external PSK (no certificates): the dialer names the
// QP pair (PskIdentity), both derive the key from the offer's token with HKDF, and the acceptor
// finds the offer by that identity. A stranger without the token fails the handshake; one that
// does not even start with a TLS record is closed unread and unanswered. Reads: a TLS record is
// decrypted whole, so what the socket held may now sit in the session (SSL_has_pending), where
// epoll does not see it: a read stops only once the session holds nothing. Writes: one record at
// a time (a frame header and a small payload in one); a record the socket did not take is the
// session's to finish, and the next write must offer the same bytes first (SSL_write's rule): the
// backlog keeps them first in line.
#include "verbs/remote.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/core_names.h>
#include <openssl/err.h>
#include <openssl/kdf.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "common/listener_rest.h"
#include "common/log.h"
#include "common/rdma_atomic.h"
#include "proto/device_caps.h"
#include "verbs/internal.h"
#include "verbs/stop_world.h"

namespace vrdma::verbs {

using namespace vrdma::proto;

// The direct path's tuning and TLS types (named, not anonymous: Conn and Hub hold these). The
// wire format itself is proto/direct_wire.h.
namespace dlink {

constexpr size_t kRxBuf = 64 * 1024;
constexpr uint64_t kDirectReadMin = 16 * 1024;  ///< payloads this large are read in place
/// After a frame with such a payload, the next header is read with at most this much behind it:
/// a large payload that follows then goes in place, not through the buffer (one copy less).
constexpr size_t kHeaderReadAfterLarge = 1024;
constexpr int kDialMs = 1000;         ///< connect, TLS handshake and hello, in all
constexpr size_t kTlsRecord = 16384;  ///< the most plaintext a TLS record carries
/// A connection whose TLS handshake and hello have not come by then is closed; at most kMaxPending
/// wait at a time (more are closed as they come): strangers can hold neither descriptors nor the
/// hub's thread.
constexpr uint64_t kHelloMs = 2000;
constexpr size_t kMaxPending = 16;
constexpr size_t kMaxListeners = 8;                ///< addresses a hub listens on
constexpr uint64_t kStrangerLogNs = 1000000000;    ///< a line per kind of refusal per second
constexpr uint64_t kAcceptLogNs = 10000000000ull;  ///< accept out of descriptors: every 10 s
constexpr int kClaimMs = 10;
/// After the hub took a request off a connection it polls for this long before it sleeps again
/// (VRDMA_SPIN_US overrides; 0 sleeps at once), as the backend does (--spin-us): a target that
/// spins on its memory (ib_write_lat) takes the next request without a wake-up, which costs
/// ~60 us on a 2-vCPU VM whose CPUs the spinning programs hold.
constexpr uint64_t kHubSpinUs = 200;

struct SslFree {
  void operator()(SSL* s) const noexcept { SSL_free(s); }
  void operator()(SSL_CTX* c) const noexcept { SSL_CTX_free(c); }
};
/// A TLS session. It never closes its descriptor (set_socket): declared after the UniqueFd, it
/// is freed before the descriptor closes.
using SslPtr = std::unique_ptr<SSL, SslFree>;
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslFree>;

}  // namespace dlink

using namespace dlink;
using namespace proto::dwire;

namespace {

/// OpenSSL's socket BIO writes with write(2): to a connection whose peer is gone (its process
/// killed: an RST) that raises SIGPIPE, which kills the application unless it ignores it. A
/// library must not: this BIO is the socket BIO but for its writes, which use MSG_NOSIGNAL.
int nosignal_write(BIO* b, const char* in, int n) {
  int fd = -1;
  BIO_get_fd(b, &fd);
  BIO_clear_retry_flags(b);
  const ssize_t w = ::send(fd, in, static_cast<size_t>(n), MSG_NOSIGNAL);
  if (w <= 0 && BIO_sock_should_retry(static_cast<int>(w))) BIO_set_retry_write(b);
  return static_cast<int>(w);
}

const BIO_METHOD* nosignal_socket_method() {
  static BIO_METHOD* m = [] {
    const BIO_METHOD* sock = BIO_s_socket();
    BIO_METHOD* own = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK | BIO_TYPE_DESCRIPTOR,
                                   "vrdma socket (no SIGPIPE)");
    if (!own) return own;
    BIO_meth_set_write(own, nosignal_write);
    BIO_meth_set_read(own, BIO_meth_get_read(sock));
    BIO_meth_set_puts(own, BIO_meth_get_puts(sock));
    BIO_meth_set_ctrl(own, BIO_meth_get_ctrl(sock));
    BIO_meth_set_create(own, BIO_meth_get_create(sock));
    BIO_meth_set_destroy(own, BIO_meth_get_destroy(sock));
    return own;
  }();
  return m;
}

/// SSL_set_fd, with nosignal_socket_method's BIO. False when out of memory.
bool set_socket(SSL* ssl, int fd) {
  const BIO_METHOD* m = nosignal_socket_method();
  BIO* b = m ? BIO_new(m) : nullptr;
  if (!b) return false;
  BIO_set_fd(b, fd, BIO_NOCLOSE);
  SSL_set_bio(ssl, b, b);
  return true;
}

}  // namespace

namespace {

constexpr uint32_t kAskFirst = 64;      ///< posts between asks after a "not yet"
constexpr uint32_t kAskMax = 1u << 16;  ///< ... growing to this

uint64_t now_ns() {
  timespec t;
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1000000000 + uint64_t(t.tv_nsec);
}
uint64_t now_ms() { return now_ns() / 1000000; }

uint64_t hub_spin_ns() {
  const char* e = ::secure_getenv("VRDMA_SPIN_US");
  if (!e || !*e) return kHubSpinUs * 1000;
  char* end = nullptr;
  const unsigned long long us = std::strtoull(e, &end, 10);
  if (*end != '\0' || us > 10000000) {
    VLOG_WARN("VRDMA_SPIN_US={}: not a number of microseconds up to 10000000; using {}", e,
              kHubSpinUs);
    return kHubSpinUs * 1000;
  }
  return us * 1000;
}

uint8_t frame_type(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_SEND:
      return kSend;
    case IBV_WR_SEND_WITH_IMM:
      return kSendImm;
    case IBV_WR_RDMA_WRITE:
      return kWrite;
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return kWriteImm;
    case IBV_WR_RDMA_READ:
      return kRead;
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return kCas;
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return kFaa;
    default:
      return 0;
  }
}

ibv_wc_opcode wc_opcode(uint32_t op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
      return IBV_WC_RDMA_READ;
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return IBV_WC_COMP_SWAP;
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return IBV_WC_FETCH_ADD;
    default:
      return IBV_WC_SEND;
  }
}

bool answered_by_data(uint32_t op) {
  return op == IBV_WR_RDMA_READ || op == IBV_WR_ATOMIC_CMP_AND_SWP ||
         op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

}  // namespace

/// What the hub's epoll reports: the stop event, the listener, a connection in its hello, or a
/// connection. The kind is told by the object's address (run()), never read through it: a
/// connection may be gone by the time its event is looked at.
struct Watch {
  enum Kind { kStop, kWake, kListen, kPending, kConn };
};

struct Conn : Watch {
  UniqueFd fd;
  SslPtr ssl;         ///< the TLS session on `fd`: every byte goes through it
  std::mutex ssl_mu;  ///< innermost: one call into `ssl` at a time
  /// Why a read failed, when TLS said (say, a record that failed its integrity check).
  const char* tls_err = nullptr;
  Hub* hub = nullptr;
  /// Which frames it may bring: the peer's requests (it is our QP's `in`), answers to ours (it
  /// is our `out`); both once one connection carries both directions. Set before any such
  /// frame can come.
  std::atomic<bool> req_in{false}, resp_in{false};
  bool peer_takes_requests = true;  ///< ours may go on it (the dialer said so in its hello)
  const ibv_cq* send_cq = nullptr;  ///< the CQs whose polls read this connection
  const ibv_cq* recv_cq = nullptr;
  const RingHeader* rq_hdr = nullptr;  ///< the QP's receive queue
  std::mutex rx_mu;
  VQp* qp = nullptr;  ///< under rx_mu; null once the QP is gone
  // Receiving: a buffer, and the frame being taken in.
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
  RecvWqe rwqe{};        ///< responder: the receive WQE the frame lands in
  uint32_t rcons = 0;
  bool nak_sent = false;  ///< responder: after a NAK, requests are dropped until the peer closes
  /// Responder: requests executed, and how many of them the peer has been told of (by an ACK
  /// here, or riding on a request of ours on the other connection).
  std::atomic<uint64_t> executed{0}, acked{0};
  bool rnr = false;  ///< responder: sent kRnr; requests are dropped until the peer's kRewind
  /// The application polls a CQ of this connection's QP, and reads it itself: the hub does not
  /// watch it for data (its wake-ups would only take the CPU from the poller). Ends when a poll
  /// finds a completion, or when the polls stop (`polls` still, checked every kClaimMs).
  std::atomic<bool> claimed{false};
  std::atomic<uint32_t> polls{0};
  uint32_t polls_seen = 0;  ///< the hub's
  // Sending: what the socket did not take yet.
  std::mutex tx_mu;
  struct Piece {
    std::vector<uint8_t> own;  ///< a copy, or empty when `p` is the application's memory
    const uint8_t* p;
    size_t n;
  };
  std::deque<Piece> backlog;
  std::vector<uint8_t> rec = std::vector<uint8_t>(kTlsRecord);  ///< a record's bytes gathered
  std::atomic<bool> want_out{false};
  std::atomic<bool> broken{false};
  std::mutex arm_mu;  ///< one epoll_ctl at a time, from the current flags
  bool watched = false;
};

struct Hub {
  VContext* ctx = nullptr;
  SslCtxPtr tls;  ///< both sides' TLS settings (make_tls)
  std::mutex mu;  ///< conns, and the control fields of every RemoteQp
  std::vector<std::shared_ptr<Conn>> conns;
  std::atomic<uint32_t> gen{1};  ///< moves when conns does
  UniqueFd ep, stop;
  UniqueFd wake;  ///< a connection the thread did not make: its wait gets the tick (hub_timeout)
  Watch stop_w, wake_w;
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
    bool shook = false;     ///< the handshake is done: the hello comes through `ssl`
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
  /// Strangers, counted by the thread (read by anyone): hellos refused (not TLS, a failed
  /// handshake: no offer for its identity, a wrong key; a wrong QPN pair, magic or version, or
  /// no hello), connections closed because kMaxPending were waiting, and hellos
  /// that did not come within kHelloMs.
  std::atomic<uint64_t> refused{0}, over_cap{0}, timed_out{0};
  log::Every refused_log{kStrangerLogNs}, over_cap_log{kStrangerLogNs},
      timed_out_log{kStrangerLogNs};  ///< the thread's own
  std::thread thr;
};

namespace {

void epoll_set(Hub& h, int op, int fd, uint32_t events, Watch* w) {
  epoll_event e{};
  e.events = events;
  e.data.ptr = w;
  ::epoll_ctl(h.ep.get(), op, fd, &e);
}

/// Makes the hub watch `c` for what it needs now: data (unless it waits for a receive) and room
/// to write (while there is a backlog).
void rearm(Conn& c) {
  std::lock_guard<std::mutex> g(c.arm_mu);
  if (c.broken.load()) {
    if (c.watched) epoll_set(*c.hub, EPOLL_CTL_DEL, c.fd.get(), 0, nullptr);
    c.watched = false;
    return;
  }
  uint32_t ev = EPOLLRDHUP;
  if (!c.claimed.load()) ev |= EPOLLIN;
  if (c.want_out.load()) ev |= EPOLLOUT;
  epoll_set(*c.hub, c.watched ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c.fd.get(), ev, &c);
  c.watched = true;
}

void set_sock_opts(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  unsigned int ms = 5000;  // a peer that vanished (data unacknowledged) ends the connection
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms));
}

// ---- TLS ----

/// The key of a QP pair's connection: HKDF-SHA256 of the offer's token, the identity as info.
bool derive_psk(const uint8_t* token, const PskIdentity& id, uint8_t (&key)[kPskBytes]) {
  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, "HKDF", nullptr);
  EVP_KDF_CTX* k = kdf ? EVP_KDF_CTX_new(kdf) : nullptr;
  EVP_KDF_free(kdf);
  if (!k) return false;
  char digest[] = "SHA256";
  OSSL_PARAM p[] = {OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0),
                    OSSL_PARAM_construct_octet_string(
                        OSSL_KDF_PARAM_KEY, const_cast<uint8_t*>(token), kDirectTokenBytes),
                    OSSL_PARAM_construct_octet_string(
                        OSSL_KDF_PARAM_SALT, const_cast<char*>(kPskSalt), sizeof(kPskSalt) - 1),
                    OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO,
                                                      const_cast<PskIdentity*>(&id), sizeof(id)),
                    OSSL_PARAM_construct_end()};
  const bool ok = EVP_KDF_derive(k, key, kPskBytes, p) == 1;
  EVP_KDF_CTX_free(k);
  return ok;
}

/// A PSK is taken as a resumed session, whose context must be the connection's once peers are
/// verified (SSL_VERIFY_PEER, make_tls).
constexpr unsigned char kSidCtx[] = "vrdma direct";

/// A session that resumes nothing: it only carries the PSK to the handshake. Null on failure.
SSL_SESSION* psk_session(SSL* s, const uint8_t* token, const PskIdentity& id) {
  const SSL_CIPHER* cipher = SSL_CIPHER_find(s, kTlsCipher);
  uint8_t key[kPskBytes];
  if (!cipher || !derive_psk(token, id, key)) return nullptr;
  SSL_SESSION* ps = SSL_SESSION_new();
  const bool ok = ps && SSL_SESSION_set1_master_key(ps, key, sizeof(key)) == 1 &&
                  SSL_SESSION_set_cipher(ps, cipher) == 1 &&
                  SSL_SESSION_set1_id_context(ps, kSidCtx, sizeof(kSidCtx) - 1) == 1 &&
                  SSL_SESSION_set_protocol_version(ps, TLS1_3_VERSION) == 1;
  OPENSSL_cleanse(key, sizeof(key));
  if (!ok) {
    SSL_SESSION_free(ps);
    return nullptr;
  }
  return ps;
}

/// The dialer's PSK, for the handshake of dial() (its SSL's app data while it runs).
struct DialPsk {
  PskIdentity id;
  const uint8_t* token;
};

int psk_use(SSL* s, const EVP_MD* md, const unsigned char** id, size_t* idlen, SSL_SESSION** sess) {
  *sess = nullptr;
  const auto* d = static_cast<const DialPsk*>(SSL_get_app_data(s));
  const SSL_CIPHER* cipher = SSL_CIPHER_find(s, kTlsCipher);
  if (!d || !cipher) return 0;
  if (md && md != SSL_CIPHER_get_handshake_digest(cipher)) return 1;  // not for this hash: none
  *sess = psk_session(s, d->token, d->id);
  if (!*sess) return 0;
  *id = reinterpret_cast<const unsigned char*>(&d->id);
  *idlen = sizeof(d->id);
  return 1;
}

/// The QP that offered to take `from_qpn`'s connection (ctx.objs_mu and Hub::mu held).
VQp* offer_of(VContext& ctx, uint32_t to_qpn, uint32_t from_qpn) {
  for (const auto& [handle, qp] : ctx.qps) {
    const RemoteQp* r = qp->remote.get();
    if (r && r->offered && !r->dead && qp->qp.qp_num == to_qpn && r->peer_qpn == from_qpn)
      return qp;
  }
  return nullptr;
}

/// The acceptor's side of the PSK (the hub's thread, in SSL_accept): the key of the offer the
/// identity names, or none (the handshake then fails: there is no certificate to fall back on).
int psk_find(SSL* s, const unsigned char* idp, size_t idlen, SSL_SESSION** sess) {
  *sess = nullptr;
  auto* p = static_cast<Hub::Pending*>(SSL_get_app_data(s));
  Hub* h = static_cast<Hub*>(SSL_CTX_get_app_data(SSL_get_SSL_CTX(s)));
  if (!p || !h) return 0;
  PskIdentity id{};
  if (idlen != sizeof(id)) {
    p->why = "not an identity of ours";
    return 1;
  }
  std::memcpy(&id, idp, sizeof(id));
  if (id.magic != kDirectMagic || id.version != kDirectVersion) {
    p->why = "a library of another version";
    return 1;
  }
  {
    VContext& ctx = *h->ctx;
    std::lock_guard<std::mutex> go(ctx.objs_mu);
    std::lock_guard<std::mutex> g(h->mu);
    VQp* qp = offer_of(ctx, id.to_qpn, id.from_qpn);
    if (!qp) {
      p->why = fmt::format("no offer of QP {:#x} to QP {:#x}", id.to_qpn, id.from_qpn);
      return 1;
    }
    std::memcpy(p->token, qp->remote->token, kDirectTokenBytes);
  }
  *sess = psk_session(s, p->token, id);
  if (!*sess) return 0;
  p->known = true;
  p->id = id;
  p->why = fmt::format("a wrong key for QP {:#x} to QP {:#x}", id.to_qpn, id.from_qpn);
  return 1;
}

/// Both sides' settings: TLS 1.3 and one suite only; the PSK or nothing (no certificate is
/// trusted, so a peer cannot fall back to one); no tickets, no session cache.
SslCtxPtr make_tls(Hub& h) {
  SslCtxPtr t(SSL_CTX_new(TLS_method()));
  if (!t || SSL_CTX_set_min_proto_version(t.get(), TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_max_proto_version(t.get(), TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_ciphersuites(t.get(), "TLS_AES_128_GCM_SHA256") != 1 ||
      SSL_CTX_set_num_tickets(t.get(), 0) != 1)
    return nullptr;
  SSL_CTX_set_options(t.get(), SSL_OP_NO_TICKET);
  SSL_CTX_set_session_cache_mode(t.get(), SSL_SESS_CACHE_OFF);
  SSL_CTX_set_verify(t.get(), SSL_VERIFY_PEER, nullptr);
  SSL_CTX_set_session_id_context(t.get(), kSidCtx, sizeof(kSidCtx) - 1);
  // A record at a time per write (partial writes), and a write retried from another place
  // (the backlog's copy): see send_frame.
  SSL_CTX_set_mode(t.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_CTX_set_psk_use_session_callback(t.get(), psk_use);
  SSL_CTX_set_psk_find_session_callback(t.get(), psk_find);
  SSL_CTX_set_app_data(t.get(), &h);
  return t;
}

/// The reason of the oldest TLS error of this thread (the queue is emptied).
const char* tls_reason() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  const char* r = e ? ERR_reason_error_string(e) : nullptr;
  return r ? r : "closed";
}

/// One read from the session: bytes, 0 none now, -1 closed or failed (`tls_err` says why, if
/// TLS knows). `more`: the session still holds bytes (the socket may not wake anyone for them).
ssize_t tls_read(Conn& c, void* p, size_t n, bool& more) {
  std::lock_guard<std::mutex> g(c.ssl_mu);
  ERR_clear_error();  // SSL_get_error reads this thread's queue: an application's leftovers too
  const int r = SSL_read(c.ssl.get(), p, static_cast<int>(std::min<size_t>(n, INT_MAX)));
  more = SSL_has_pending(c.ssl.get()) == 1;
  if (r > 0) return r;
  const int e = SSL_get_error(c.ssl.get(), r);
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) return 0;
  c.tls_err = e == SSL_ERROR_SSL ? tls_reason() : nullptr;
  ERR_clear_error();
  return -1;
}

/// Writes the first bytes of `iov` past `skip`, one record's worth (gathered into Conn::rec when
/// they are in pieces): how many, 0 none now, -1 broken (tx_mu held). Always min(kTlsRecord,
/// what is there) bytes, so a record the socket did not take is offered again, the same bytes
/// first and at least as many, by the next write from the same place in line.
ssize_t tls_write(Conn& c, const iovec* iov, size_t n, size_t skip) {
  size_t i = 0;
  while (i < n && skip >= iov[i].iov_len) skip -= iov[i++].iov_len;
  if (i == n) return 0;
  const uint8_t* p = static_cast<const uint8_t*>(iov[i].iov_base) + skip;
  size_t len = iov[i].iov_len - skip;
  if (len < kTlsRecord && i + 1 < n) {
    uint8_t* at = std::copy_n(p, len, c.rec.data());
    for (++i; i < n && len < kTlsRecord; ++i) {
      const size_t k = std::min(iov[i].iov_len, kTlsRecord - len);
      at = std::copy_n(static_cast<const uint8_t*>(iov[i].iov_base), k, at);
      len += k;
    }
    p = c.rec.data();
  }
  len = std::min(len, kTlsRecord);
  std::lock_guard<std::mutex> g(c.ssl_mu);
  ERR_clear_error();
  const int w = SSL_write(c.ssl.get(), p, static_cast<int>(len));
  if (w > 0) return w;
  const int e = SSL_get_error(c.ssl.get(), w);
  ERR_clear_error();
  return e == SSL_ERROR_WANT_WRITE || e == SSL_ERROR_WANT_READ ? 0 : -1;
}

// ---- sending ----

/// Writes a frame and its data: what the socket takes now, the rest into the backlog (copied
/// when `copy`; else referenced: a requester's payload, which the application leaves alone until
/// the WR completes). False when the connection is broken.
bool send_frame(Conn& c, const Frame& f, const MemSpan* data, size_t nd, bool copy) {
  std::lock_guard<std::mutex> g(c.tx_mu);
  if (c.broken.load(std::memory_order_relaxed)) return false;
  iovec iov[kMaxSge + 1];
  size_t n = 0, total = sizeof(f);
  iov[n++] = iovec{const_cast<Frame*>(&f), sizeof(f)};
  for (size_t i = 0; i < nd; ++i) {
    if (!data[i].n) continue;
    iov[n++] = iovec{data[i].p, data[i].n};
    total += data[i].n;
  }
  size_t done = 0;
  if (c.backlog.empty()) {
    for (;;) {
      const ssize_t w = tls_write(c, iov, n, done);
      tsan_ring_release();  // what arrives later may answer what this sent (see tsan_ring_edge)
      if (w < 0) {
        c.broken.store(true);
        return false;
      }
      done += static_cast<size_t>(w);
      if (done == total) return true;
      if (w == 0) break;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const auto* p = static_cast<const uint8_t*>(iov[i].iov_base);
    size_t len = iov[i].iov_len;
    if (done >= len) {
      done -= len;
      continue;
    }
    p += done;
    len -= done;
    done = 0;
    Conn::Piece pc;
    if (i == 0 || copy) {
      pc.own.assign(p, p + len);
      pc.p = pc.own.data();
    } else {
      pc.p = p;
    }
    pc.n = len;
    c.backlog.push_back(std::move(pc));
  }
  if (!c.want_out.exchange(true)) rearm(c);
  return true;
}

/// Writes what it can of the backlog (tx_mu held). False when the connection broke.
bool flush_locked(Conn& c) {
  while (!c.backlog.empty()) {
    iovec iov[64];
    size_t n = 0;
    for (auto it = c.backlog.begin(); it != c.backlog.end() && n < 64; ++it)
      iov[n++] = iovec{const_cast<uint8_t*>(it->p), it->n};
    const ssize_t w = tls_write(c, iov, n, 0);
    tsan_ring_release();
    if (w < 0) {
      c.broken.store(true);
      return false;
    }
    if (w == 0) return true;
    size_t done = static_cast<size_t>(w);
    while (done && !c.backlog.empty()) {
      Conn::Piece& pc = c.backlog.front();
      if (done >= pc.n) {
        done -= pc.n;
        c.backlog.pop_front();
      } else {
        pc.p += done;
        pc.n -= done;
        done = 0;
      }
    }
  }
  if (c.want_out.exchange(false)) rearm(c);
  return true;
}

// ---- completions and errors ----

/// Drops the oldest WR in flight (fl_mu held).
void pop_head(RemoteQp& r) {
  if (r.inflight.front().sent) r.awaiting.fetch_sub(1, std::memory_order_relaxed);
  r.inflight.pop_front();
}

/// Writes the completion of a requester's WR (tx: fl_mu held).
void complete(VQp& qp, RemoteQp& r, const Inflight& e, int status) {
  if (status == IBV_WC_SUCCESS) count(r.send, e.len);
  if (!e.signaled && status == IBV_WC_SUCCESS) return;
  if (!has_room(r.send)) {
    VLOG_ERROR("direct path: send CQ of QP {:#x} overrun; a completion is lost", qp.qp.qp_num);
    return;
  }
  Cqe c{};
  c.wr_id = e.wr_id;
  c.status = static_cast<uint32_t>(status);
  c.opcode = wc_opcode(e.opcode);
  c.byte_len = status == IBV_WC_SUCCESS ? e.len : 0;
  c.qp_num = qp.qp.qp_num;
  push(r.send, c);
}

/// Completes the head with `head_status` (or its own local error) and flushes the rest (fl_mu).
void flush_inflight(VQp& qp, RemoteQp& r, int head_status) {
  bool head = true;
  while (!r.inflight.empty()) {
    const Inflight& e = r.inflight.front();
    int st = IBV_WC_WR_FLUSH_ERR;
    if (head) st = head_status >= 0 ? head_status : (!e.sent ? e.status : IBV_WC_WR_FLUSH_ERR);
    complete(qp, r, e, st);
    pop_head(r);
    head = false;
  }
  r.failing = true;
}

/// The QP to ERR on the direct path: its connections end (the peer sees them close) and the
/// backend moves it (flushing its receive queue). Once.
void to_error(VQp& qp, const char* why) {
  RemoteQp& r = *qp.remote;
  if (r.failed.exchange(true)) return;
  r.active.store(false);
  VLOG_WARN("direct path: QP {:#x} to the error state: {}", qp.qp.qp_num, why);
  std::shared_ptr<Conn> conns[2];
  if (Hub* h = to_vctx(qp.qp.context)->hub_raw.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(h->mu);  // teardown may be taking them away
    conns[0] = r.out;
    conns[1] = r.in;
  }
  for (const auto& c : conns) {
    if (c) ::shutdown(c->fd.get(), SHUT_RDWR);
  }
  ModifyQpReq req{};
  req.handle = qp.handle;
  req.mask = IBV_QP_STATE;
  req.attr.qp_state = IBV_QPS_ERR;
  Empty resp;
  to_vctx(qp.qp.context)->call(Op::kModifyQp, &req, sizeof(req), &resp, 0);
}

/// The peer has executed `n` of our requests (fl_mu held): those answered by an ACK complete,
/// up to the first that waits for its data (READ, atomic); then a WR that failed locally, if it
/// is now the head, completes with its error (`fail`: the QP goes to ERR). False: the peer
/// claims more than was sent (a broken peer).
bool acked_upto(VQp& qp, RemoteQp& r, uint64_t n, bool& fail) {
  if (n > r.sent) return false;
  r.peer_executed = std::max(r.peer_executed, n);
  while (!r.inflight.empty() && r.inflight.front().sent &&
         r.inflight.front().seq < r.peer_executed && !answered_by_data(r.inflight.front().opcode)) {
    complete(qp, r, r.inflight.front(), IBV_WC_SUCCESS);
    pop_head(r);
  }
  if (!r.inflight.empty() && !r.inflight.front().sent) {
    flush_inflight(qp, r, -1);
    fail = true;
  }
  return true;
}

/// Writes a WR's request (fl_mu held: requests go out in the order of their numbers), with the
/// ACK for the peer's requests riding on it. False: the connection is broken.
bool write_request(RemoteQp& r, Conn& out, Inflight& e) {
  Conn* in = r.in_raw.load(std::memory_order_acquire);
  e.f.ack = in ? in->executed.load() : 0;
  if (in && e.f.ack) in->acked.store(e.f.ack);
  if (!carries_data(e.f.type)) return send_frame(out, e.f, nullptr, 0, true);
  const MemSpan inl{e.inl_data, e.len};
  return e.inl ? send_frame(out, e.f, &inl, 1, true) : send_frame(out, e.f, e.local, e.nl, false);
}

/// The peer's kResume: kRewind, then every request from the one it dropped on, in order (fl_mu
/// held). A write that fails leaves it to the reader, which finds the connection broken.
void resend(RemoteQp& r, Conn& out) {
  r.rnr = false;
  Frame w{};
  w.type = kRewind;
  if (!send_frame(out, w, nullptr, 0, true)) return;
  for (Inflight& e : r.inflight) {
    if (!e.sent) break;  // failed locally: completes in its turn, and the QP goes to ERR
    if (e.seq >= r.resend_from && !write_request(r, out, e)) return;
  }
}

/// This process's MR for a key in `pd` (thread-safe; no cache).
bool find_mr(VContext& ctx, uint32_t pd, uint32_t key, LocalMr& out) {
  std::lock_guard<std::mutex> g(ctx.mr_mu);
  auto it = ctx.local_mrs.find(key);
  if (it == ctx.local_mrs.end() || it->second.pd != pd) return false;
  out = it->second;
  return true;
}

/// The responder's rules (proto/responder_rules.h) for a WRITE, READ or atomic (`op`) of `len`
/// bytes at `iova` under `rkey`, against this process's MRs: IBV_WC_SUCCESS and in `p` where
/// that lies here (null when it names no memory), or the status the requester gets.
ibv_wc_status rkey_memory(VQp& qp, uint32_t op, uint32_t rkey, uint64_t iova, uint64_t len,
                          uint8_t*& p) {
  p = nullptr;
  LocalMr mr;
  RemoteMrView view;
  if (find_mr(*to_vctx(qp.qp.context), qp.pd, rkey, mr))
    view = RemoteMrView{true, mr.access, mr.iova, mr.length};
  const ibv_wc_status st = check_remote_request(op, qp.access, iova, len, view);
  if (st == IBV_WC_SUCCESS && (names_remote_memory(len) || is_rdma_atomic(op)))
    p = local_ptr(mr, mr.addr + (iova - mr.iova));
  return st;
}

// ---- receiving ----

/// Reads into the buffer: 1 got bytes, 0 none now, -1 closed or failed.
int fill(Conn& c) {
  if (c.beg == c.end) {
    c.beg = c.end = 0;
  } else if (c.buf.size() - c.end < sizeof(Frame)) {
    std::memmove(c.buf.data(), c.buf.data() + c.beg, c.end - c.beg);
    c.end -= c.beg;
    c.beg = 0;
  }
  size_t want = c.buf.size() - c.end;
  if (c.large && c.rx == Conn::Rx::kHeader) want = std::min(want, kHeaderReadAfterLarge);
  bool more = false;
  const ssize_t r = tls_read(c, c.buf.data() + c.end, want, more);
  if (r > 0) {
    tsan_ring_acquire();
    c.end += static_cast<size_t>(r);
    c.emptied = !more;
    return 1;
  }
  c.emptied = true;
  return r == 0 ? 0 : -1;
}

void advance(Conn& c, uint64_t n) {
  while (n) {
    const uint64_t k = std::min(n, c.dst[c.di].n - c.doff);
    c.doff += k;
    n -= k;
    if (c.doff == c.dst[c.di].n) ++c.di, c.doff = 0;
  }
}

/// Moves payload into its destination: 1 all of it is there, 0 more to come, -1 broken.
int rx_payload(Conn& c) {
  while (c.left) {
    if (c.beg < c.end) {
      uint64_t n = std::min<uint64_t>(c.left, c.end - c.beg);
      c.left -= n;
      if (!c.discard) {
        const uint8_t* p = c.buf.data() + c.beg;
        while (n) {
          const uint64_t k = std::min(n, c.dst[c.di].n - c.doff);
          std::memcpy(c.dst[c.di].p + c.doff, p, k);
          p += k;
          n -= k;
          c.beg += k;
          advance(c, k);
        }
      } else {
        c.beg += n;
      }
      continue;
    }
    if (c.discard || c.left < kDirectReadMin) {
      const int r = fill(c);
      if (r <= 0) return r;
      continue;
    }
    // Large: straight into the destination, a record at a time.
    bool more = false;
    const ssize_t r =
        tls_read(c, c.dst[c.di].p + c.doff, std::min(c.left, c.dst[c.di].n - c.doff), more);
    c.emptied = r <= 0 || !more;
    if (r > 0) {
      tsan_ring_acquire();
      advance(c, static_cast<uint64_t>(r));
      c.left -= static_cast<uint64_t>(r);
    } else {
      return static_cast<int>(r);
    }
  }
  return 1;
}

enum class Start { kGo, kFail };

/// An ACK for what this responder executed and has not told the peer of yet.
void send_ack(Conn& c) {
  const uint64_t e = c.executed.load();
  if (e == c.acked.load() || c.nak_sent) return;
  Frame a{};
  a.type = kAck;
  a.arg0 = e;
  send_frame(c, a, nullptr, 0, true);
  c.acked.store(e);
}

void send_nak(Conn& c, ibv_wc_status st) {
  Frame f{};
  f.type = kNak;
  f.status = static_cast<uint8_t>(st);
  f.arg0 = c.executed.load();
  send_frame(c, f, nullptr, 0, true);
  c.acked.store(f.arg0);
  c.nak_sent = true;
}

/// Whether a request that needs a receive can be executed now: one is posted, and its
/// completion has room (rx_mu held: this library is the ring's producer).
bool receivable(VQp& qp, RemoteQp& r) {
  const uint32_t cons = qp.rq_hdr->consumer.load(std::memory_order_acquire);
  const uint32_t prod = qp.rq_hdr->producer.load(std::memory_order_seq_cst);
  return prod != cons && prod - cons <= qp.rq_size && has_room(r.recv);
}

/// The responder's receive WQE for the frame, copied out (not consumed). False: none posted
/// yet, or no room for its completion.
bool peek_recv(Conn& c, VQp& qp, RemoteQp& r) {
  if (!receivable(qp, r)) return false;
  const uint32_t cons = qp.rq_hdr->consumer.load(std::memory_order_relaxed);
  const RecvWqe& w = qp.rq[cons & (qp.rq_size - 1)];
  c.rwqe.wr_id = w.wr_id;
  c.rwqe.num_sge = std::min<uint32_t>(w.num_sge, kMaxSge);
  std::memcpy(c.rwqe.sge, w.sge, c.rwqe.num_sge * sizeof(Sge));
  c.rcons = cons;
  return true;
}

/// A kRnr owed a kResume and a receive is there now: the peer sends its requests again (rx_mu
/// held). Called after a post_recv, from empty polls and from the hub's tick.
void try_resume(Conn& c, VQp& qp, RemoteQp& r) {
  if (!r.resume_owed.load(std::memory_order_seq_cst) || !receivable(qp, r) ||
      !r.resume_owed.exchange(false))
    return;
  Frame f{};
  f.type = kResume;
  f.arg0 = c.executed.load();
  send_frame(c, f, nullptr, 0, true);
  c.acked.store(f.arg0);
}

/// The request being read found no receive: the peer is told (kRnr, with how many of its
/// requests were executed: the number of this one), and this one and those after it are dropped
/// until its kRewind (rx_mu held).
void send_rnr(Conn& c, VQp& qp, RemoteQp& r) {
  Frame f{};
  f.type = kRnr;
  f.arg0 = c.executed.load();
  send_frame(c, f, nullptr, 0, true);
  c.acked.store(f.arg0);
  c.rnr = true;
  VLOG_DEBUG("direct path: QP {:#x} has no receive for request {} of its peer: kRnr", qp.qp.qp_num,
             f.arg0);
  // Owed before looking again: a receive posted in between either is seen here or sees the flag.
  r.resume_owed.store(true, std::memory_order_seq_cst);
  try_resume(c, qp, r);
}

/// The receive completion of a consumed WQE (status success unless given).
void push_recv(Conn& c, VQp& qp, RemoteQp& r, int status) {
  qp.rq_hdr->consumer.store(c.rcons + 1, std::memory_order_release);
  Cqe e{};
  e.wr_id = c.rwqe.wr_id;
  e.status = static_cast<uint32_t>(status);
  e.opcode = c.f.type == kWriteImm ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
  if (status == IBV_WC_SUCCESS) {
    e.byte_len = c.f.len;
    if (c.f.type != kSend) {
      e.wc_flags = IBV_WC_WITH_IMM;
      e.imm_data = c.f.imm;
    }
  }
  e.qp_num = qp.qp.qp_num;
  e.src_qp = r.peer_qpn;
  e.slid = static_cast<uint16_t>(r.peer_lid);
  push(r.recv, e);
}

/// A request's header has arrived: check it against our memory and say where its data goes.
Start start_request(Conn& c, VQp& qp, RemoteQp& r, bool& fail) {
  const Frame& f = c.f;
  c.nd = c.di = 0;
  c.doff = 0;
  c.discard = false;
  c.left = 0;
  // Dropped: after a NAK; after a kRnr until the peer's resend begins (kRewind, which is
  // dropped too: it only ends that; a stray one is ignored); one that finds no receive.
  bool drop = c.nak_sent || c.rnr || f.type == kRewind;
  if (!drop && consumes_recv(f.type) && !peek_recv(c, qp, r)) {
    send_rnr(c, qp, r);
    drop = true;
  }
  if (drop) {
    if (f.type == kRewind) c.rnr = false;
    c.discard = true;
    c.left = carries_data(f.type) ? f.len : 0;
    return Start::kGo;
  }
  VContext& ctx = *to_vctx(qp.qp.context);
  switch (f.type) {
    case kSend:
    case kSendImm: {
      uint64_t cap = 0;
      for (uint32_t i = 0; i < c.rwqe.num_sge; ++i) {
        const Sge& s = c.rwqe.sge[i];
        if (!s.length) continue;
        LocalMr mr;
        if (!find_mr(ctx, qp.pd, s.lkey, mr) || !(mr.access & IBV_ACCESS_LOCAL_WRITE) ||
            !in_range(mr.addr, mr.length, s.addr, s.length)) {
          push_recv(c, qp, r, IBV_WC_LOC_PROT_ERR);
          send_nak(c, IBV_WC_REM_OP_ERR);
          fail = true;
          return Start::kFail;
        }
        c.dst[c.nd++] = MemSpan{local_ptr(mr, s.addr), s.length};
        cap += s.length;
      }
      if (cap < f.len) {
        push_recv(c, qp, r, IBV_WC_LOC_LEN_ERR);
        send_nak(c, IBV_WC_REM_INV_REQ_ERR);
        fail = true;
        return Start::kFail;
      }
      c.left = f.len;
      return Start::kGo;
    }
    case kWrite:
    case kWriteImm: {
      uint8_t* p;
      if (const ibv_wc_status st = rkey_memory(qp, IBV_WR_RDMA_WRITE, f.rkey, f.raddr, f.len, p);
          st != IBV_WC_SUCCESS) {
        send_nak(c, st);
        c.discard = true;
        c.left = f.len;
        return Start::kGo;
      }
      if (p) c.dst[c.nd++] = MemSpan{p, f.len};
      c.left = f.len;
      return Start::kGo;
    }
    case kRead: {
      uint8_t* p;
      if (const ibv_wc_status st = rkey_memory(qp, IBV_WR_RDMA_READ, f.rkey, f.raddr, f.len, p);
          st != IBV_WC_SUCCESS) {
        send_nak(c, st);
        return Start::kGo;
      }
      Frame a{};
      a.type = kReadResp;
      a.len = f.len;
      a.arg0 = c.executed.fetch_add(1) + 1;
      const MemSpan d{p, f.len};
      send_frame(c, a, &d, 1, true);
      c.acked.store(a.arg0);
      count(r.recv, f.len);
      return Start::kGo;
    }
    case kCas:
    case kFaa: {
      uint8_t* p;
      const uint32_t op = f.type == kFaa ? IBV_WR_ATOMIC_FETCH_AND_ADD : IBV_WR_ATOMIC_CMP_AND_SWP;
      ibv_wc_status st = rkey_memory(qp, op, f.rkey, f.raddr, 8, p);
      // Aligned where it lies in this process too (split locks, as the backend checks).
      if (st == IBV_WC_SUCCESS && (reinterpret_cast<uintptr_t>(p) & 7)) st = IBV_WC_REM_INV_REQ_ERR;
      if (st != IBV_WC_SUCCESS) {
        send_nak(c, st);
        return Start::kGo;
      }
      const uint64_t old =
          rdma_atomic(reinterpret_cast<uint64_t*>(p), f.type == kFaa, f.arg0, f.arg1);
      Frame a{};
      a.type = kAtomicResp;
      a.len = 8;
      a.arg0 = c.executed.fetch_add(1) + 1;
      a.arg1 = old;
      send_frame(c, a, nullptr, 0, true);
      c.acked.store(a.arg0);
      count(r.recv, 8);
      return Start::kGo;
    }
    default:
      return Start::kFail;  // not a request: checked by the caller
  }
}

void finish_request(Conn& c, VQp& qp, RemoteQp& r) {
  if (c.nak_sent || c.discard) return;
  const uint8_t t = c.f.type;
  if (t == kRead || t == kCas || t == kFaa) return;  // answered at the start
  if (consumes_recv(t)) push_recv(c, qp, r, IBV_WC_SUCCESS);
  count(r.recv, c.f.len);
  c.executed.fetch_add(1);
}

/// An ACK riding on the peer's request: it executed `n` of ours (fl_mu taken here).
bool ack_riding(VQp& qp, RemoteQp& r, uint64_t n, bool& fail) {
  std::lock_guard<std::mutex> g(r.fl_mu);
  return r.failing || acked_upto(qp, r, n, fail);
}

/// A response's header has arrived (requester).
Start start_response(Conn& c, VQp& qp, RemoteQp& r, bool& fail, const char*& why) {
  const Frame& f = c.f;
  c.nd = c.di = 0;
  c.doff = 0;
  c.discard = false;
  c.left = 0;
  std::lock_guard<std::mutex> g(r.fl_mu);
  if (r.failing) {  // already in error: take the bytes, do nothing
    c.discard = true;
    c.left = f.type == kReadResp ? f.len : 0;
    return Start::kGo;
  }
  const bool data = f.type == kReadResp || f.type == kAtomicResp;
  const uint64_t before = data ? f.arg0 - 1 : f.arg0;
  if ((data && f.arg0 == 0) || !acked_upto(qp, r, before, fail)) {
    why = "the peer answered out of order";
    return Start::kFail;
  }
  if (fail) return Start::kFail;
  if (f.type == kAck) return Start::kGo;
  if (f.type == kRnr) {
    if (r.rnr || f.arg0 != r.peer_executed || f.arg0 >= r.sent) {
      why = "the peer refused a request that was not sent for want of a receive";
      return Start::kFail;
    }
    r.rnr = true;  // nothing more is written until its kResume
    r.resend_from = f.arg0;
    return Start::kGo;
  }
  if (f.type == kResume) {
    if (!r.rnr) {
      why = "the peer asked to resend what it had not refused";
      return Start::kFail;
    }
    VLOG_DEBUG("direct path: QP {:#x} sends its requests from {} again", qp.qp.qp_num,
               r.resend_from);
    resend(r, c);
    return Start::kGo;
  }
  Inflight* e = r.inflight.empty() ? nullptr : &r.inflight.front();
  if (!e || !e->sent || e->seq != before) {
    why = "the peer answered a request that was not sent";
    return Start::kFail;
  }
  if (f.type == kNak) {
    flush_inflight(qp, r, f.status);
    fail = true;
    why = "the peer refused a request";
    return Start::kFail;
  }
  if (f.type == kAtomicResp) {
    if (!answered_by_data(e->opcode) || e->opcode == IBV_WR_RDMA_READ) {
      why = "an atomic result for another WR";
      return Start::kFail;
    }
    std::memcpy(e->local[0].p, &f.arg1, 8);
    complete(qp, r, *e, IBV_WC_SUCCESS);
    pop_head(r);
    acked_upto(qp, r, f.arg0, fail);
    return fail ? Start::kFail : Start::kGo;
  }
  // kReadResp
  if (e->opcode != IBV_WR_RDMA_READ || f.len != e->len) {
    why = "READ data for another WR";
    return Start::kFail;
  }
  for (uint8_t i = 0; i < e->nl; ++i) c.dst[c.nd++] = e->local[i];
  c.left = f.len;
  return Start::kGo;
}

/// False: the QP goes to ERR (a WR after it failed locally).
bool finish_response(Conn& c, VQp& qp, RemoteQp& r) {
  if (c.f.type != kReadResp || c.discard) return true;
  std::lock_guard<std::mutex> g(r.fl_mu);
  if (r.inflight.empty()) return true;
  complete(qp, r, r.inflight.front(), IBV_WC_SUCCESS);
  pop_head(r);
  bool fail = false;
  acked_upto(qp, r, c.f.arg0, fail);
  return !fail;
}

/// The connection closed or failed. A requester with WRs in flight puts its QP in ERR (they
/// complete with RETRY_EXC_ERR, as a peer that stopped answering does); otherwise the peer is
/// just gone, and the next post finds out.
void broken(Conn& c, VQp& qp, const char* why) {
  c.broken.store(true);
  rearm(c);
  if (!c.resp_in.load()) return;
  RemoteQp& r = *qp.remote;
  bool any;
  {
    std::lock_guard<std::mutex> g(r.fl_mu);
    any = !r.inflight.empty();
    if (any) flush_inflight(qp, r, IBV_WC_RETRY_EXC_ERR);
  }
  if (any) to_error(qp, why);
}

/// Reads and executes what has arrived (rx_mu held, c.qp set). True when it took anything.
/// `defer_ack`: the application's thread reads; the responder's ACK waits to ride on its next
/// request (remote_post), or goes at its next empty poll (remote_progress).
bool drain(Conn& c, bool defer_ack) {
  VQp& qp = *c.qp;
  RemoteQp& r = *qp.remote;
  if (c.broken.load()) return false;
  bool did = false;
  for (;;) {
    if (c.rx == Conn::Rx::kHeader) {
      if (c.end - c.beg < sizeof(Frame)) {
        // A read that left nothing in the TLS session most likely left the socket empty too:
        // another read now would find nothing, and cost a syscall between every request and its
        // answer (the next poll, or the hub's next EPOLLIN, reads what comes later; what the
        // session holds, epoll does not see: it is read now).
        if (did && c.beg == c.end && c.emptied) break;
        const int got = fill(c);
        if (got < 0) {
          broken(c, qp, c.tls_err ? c.tls_err : "the peer's library closed the connection");
          return true;
        }
        if (got == 0) break;
        continue;
      }
      std::memcpy(&c.f, c.buf.data() + c.beg, sizeof(Frame));
      c.beg += sizeof(Frame);
      c.rx = Conn::Rx::kStart;
      did = true;
      if (const Status st = check_frame(c.f); !st.is_ok()) {  // a broken peer: a lost connection
        ::shutdown(c.fd.get(), SHUT_RDWR);
        broken(c, qp, st.message().c_str());
        return true;
      }
    }
    const bool req = request_dir(c.f.type);
    if (c.rx == Conn::Rx::kStart) {
      bool fail = false;
      const char* why = "the peer sent a malformed frame";
      Start s;
      if (req ? !c.req_in.load(std::memory_order_acquire) || c.f.len > kMaxMsgSize
              : !response_dir(c.f.type) || !c.resp_in.load(std::memory_order_acquire)) {
        s = Start::kFail;
      } else if (req && c.f.ack && !ack_riding(qp, r, c.f.ack, fail)) {
        why = "the peer acknowledged requests that were not sent";
        s = Start::kFail;
      } else if (fail) {
        why = "a WR failed on the direct path";
        s = Start::kFail;
      } else {
        s = req ? start_request(c, qp, r, fail) : start_response(c, qp, r, fail, why);
      }
      if (s == Start::kFail) {
        if (!fail) {  // a broken peer: end it as a lost connection
          ::shutdown(c.fd.get(), SHUT_RDWR);
          broken(c, qp, why);
        } else {
          to_error(qp, req ? "a request failed at this responder" : why);
          c.broken.store(true);
          rearm(c);
        }
        return true;
      }
      c.rx = Conn::Rx::kPayload;
      c.large = !c.discard && c.left >= kDirectReadMin;
    }
    const int got = rx_payload(c);
    if (got < 0) {
      broken(c, qp, c.tls_err ? c.tls_err : "the peer's library closed the connection");
      return true;
    }
    if (got == 0) break;
    if (req) {
      finish_request(c, qp, r);
    } else if (!finish_response(c, qp, r)) {
      to_error(qp, "a WR failed on the direct path");
      return true;
    }
    c.rx = Conn::Rx::kHeader;
  }
  // One cumulative ACK for what this batch executed.
  if (c.req_in.load(std::memory_order_relaxed) && !defer_ack) send_ack(c);
  return did;
}

// ---- the hub ----

void register_conn(Hub& h, const std::shared_ptr<Conn>& c) {
  {
    std::lock_guard<std::mutex> g(h.mu);
    h.conns.push_back(c);
    h.gen.fetch_add(1, std::memory_order_release);
  }
  rearm(*c);
  const uint64_t one = 1;
  if (::write(h.wake.get(), &one, sizeof(one)) < 0) {
    VLOG_WARN("direct path: cannot wake the hub thread: {}", std::strerror(errno));
  }
}

/// Ends a connection for good: nothing reads it or writes it again.
void retire(Hub& h, const std::shared_ptr<Conn>& c) {
  {
    std::lock_guard<std::mutex> g(c->rx_mu);
    c->qp = nullptr;
  }
  {
    std::lock_guard<std::mutex> g(c->tx_mu);
    c->backlog.clear();
    c->broken.store(true);
  }
  rearm(*c);
  ::shutdown(c->fd.get(), SHUT_RDWR);
  std::lock_guard<std::mutex> g(h.mu);
  std::erase(h.conns, c);
  h.gen.fetch_add(1, std::memory_order_release);
}

std::shared_ptr<Conn> find_conn(Hub& h, const Watch* p) {
  std::lock_guard<std::mutex> g(h.mu);
  for (const auto& c : h.conns) {
    if (static_cast<const Watch*>(c.get()) == p) return c;
  }
  return nullptr;
}

/// "ADDR:PORT" of a peer, for log lines.
std::string addr_of(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof(ip));
  return fmt::format("{}:{}", ip, ntohs(a.sin_port));
}

/// Compares tokens in a time that does not depend on where they differ.
bool same_token(const uint8_t* a, const uint8_t* b) {
  uint8_t d = 0;
  for (size_t i = 0; i < kDirectTokenBytes; ++i) d |= a[i] ^ b[i];
  return d == 0;
}

/// Counts a stranger's connection and logs it (a line a second at most, with the count): it is
/// closed by the caller, unanswered.
void refuse(Hub& h, const Hub::Pending& p, const char* why) {
  const uint64_t n = h.refused.fetch_add(1, std::memory_order_relaxed) + 1;
  uint64_t held = 0;
  if (h.refused_log.ready(now_ns(), held))
    VLOG_WARN("direct path: refused a connection from {}: {} ({} refused so far){}",
              addr_of(p.from), why, n, log::held_note(held));
}

/// Writes a hello's answer: false unless all of it went (tx_mu held, for a published one).
bool answer_hello(Conn& c, const HelloAck& ack) {
  const iovec v{const_cast<HelloAck*>(&ack), sizeof(ack)};
  return tls_write(c, &v, 1, 0) == static_cast<ssize_t>(sizeof(ack));
}

/// A dialer's hello is complete, inside a TLS session whose key was that of the offer its
/// identity named. Unless the hello names the same QP pair and the offer is still the one the
/// key came from, nothing else is done: the connection is refused and closed, unanswered.
void accept_hello(Hub& h, Hub::Pending& p) {
  VContext& ctx = *h.ctx;
  if (const Status st = check_hello(p.h); !st.is_ok()) {
    refuse(h, p, st.message().c_str());
    return;
  }
  if (!p.known || p.h.from_qpn != p.id.from_qpn || p.h.to_qpn != p.id.to_qpn) {
    refuse(h, p, "a hello for another QP pair than its key's");
    return;
  }
  HelloAck ack{kDirectMagic, EPERM, 0, 0};
  auto c = std::make_shared<Conn>();
  // Taken before the connection is published: the answer goes out before anything of ours.
  std::unique_lock<std::mutex> tx(c->tx_mu);
  {
    std::lock_guard<std::mutex> go(ctx.objs_mu);
    std::lock_guard<std::mutex> g(h.mu);
    VQp* qp = offer_of(ctx, p.h.to_qpn, p.h.from_qpn);
    RemoteQp* r = qp ? qp->remote.get() : nullptr;
    // One per QP's life in RTR/RTS (a reset ends it and the offer); and none when our own
    // dial got there first: the peer's library then adopts that one (EBUSY tells it).
    if (r && same_token(r->token, p.token) && r->in) {
      ack.err = EBUSY;
    } else if (r && same_token(r->token, p.token)) {
      c->req_in.store(true);
      c->peer_takes_requests = (p.h.flags & kTakesRequests) != 0;
      c->fd = std::move(p.fd);
      c->ssl = std::move(p.ssl);
      c->hub = &h;
      c->qp = qp;
      c->send_cq = qp->qp.send_cq;
      c->recv_cq = qp->qp.recv_cq;
      c->rq_hdr = qp->rq_hdr;
      r->peer_lid = p.h.from_lid;
      ack.lid = r->my_lid;
      r->in = c;
      r->in_raw.store(c.get(), std::memory_order_release);
      h.conns.push_back(c);
      h.gen.fetch_add(1, std::memory_order_release);
      ack.err = 0;
    }
  }
  if (ack.err == EPERM) {
    refuse(h, p,
           fmt::format("no offer of QP {:#x} to QP {:#x} with that key", p.h.to_qpn, p.h.from_qpn)
               .c_str());
    return;
  }
  if (ack.err == 0) {
    // From now on the session reads ahead (fewer syscalls): nothing was read past the hello.
    SSL_set_read_ahead(c->ssl.get(), 1);
    if (!answer_hello(*c, ack)) c->broken.store(true);
    tx.unlock();
    rearm(*c);
    VLOG_INFO("direct path: QP {:#x} takes QP {:#x}'s requests from its library at {} ({}, {})",
              p.h.to_qpn, p.h.from_qpn, addr_of(p.from), SSL_get_version(c->ssl.get()),
              SSL_get_cipher_name(c->ssl.get()));
    return;
  }
  tx.unlock();
  c->fd = std::move(p.fd);
  c->ssl = std::move(p.ssl);
  answer_hello(*c, ack);
  VLOG_INFO("direct path: QP {:#x} has a connection from QP {:#x}'s library already", p.h.to_qpn,
            p.h.from_qpn);
}

/// A handshake's next step, then the hello: 1 it is all there, 0 more to come, -1 refused
/// (`why`). A connection that does not open with a TLS handshake record is refused before a
/// byte of it is read: nothing of a stranger's plaintext is parsed, nor answered.
int hello_step(Hub& h, Hub::Pending& p, std::string& why) {
  if (!p.ssl) {
    uint8_t first = 0;
    const ssize_t r = ::recv(p.fd.get(), &first, 1, MSG_PEEK);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (r <= 0) {
      why = r == 0 ? "closed before its hello" : "failed before its hello";
      return -1;
    }
    constexpr uint8_t kTlsHandshake = 22;  // a TLS record's content type
    if (first != kTlsHandshake) {
      why = "not TLS (a stranger, or a library of an older version)";
      return -1;
    }
    p.ssl.reset(SSL_new(h.tls.get()));
    if (!p.ssl || !set_socket(p.ssl.get(), p.fd.get())) {
      why = "no TLS session for it";
      return -1;
    }
    SSL_set_app_data(p.ssl.get(), &p);
    SSL_set_accept_state(p.ssl.get());
  }
  SSL* s = p.ssl.get();
  ERR_clear_error();
  const int r = p.shook ? SSL_read(s, reinterpret_cast<uint8_t*>(&p.h) + p.got,
                                   static_cast<int>(sizeof(Hello) - p.got))
                        : SSL_accept(s);
  if (r > 0 && !p.shook) {
    p.shook = true;
    SSL_set_app_data(s, nullptr);
    return hello_step(h, p, why);  // the hello may have come with the handshake's end
  }
  if (r > 0) {
    p.got += static_cast<size_t>(r);
    return p.got == sizeof(Hello) ? 1 : 0;
  }
  const int e = SSL_get_error(s, r);
  p.want_out = e == SSL_ERROR_WANT_WRITE;
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) return 0;
  if (p.shook) {
    ERR_clear_error();
    why = "closed before its hello";
  } else {
    why = fmt::format("its TLS handshake failed: {}{}", tls_reason(),
                      p.why.empty() ? "" : " (" + p.why + ")");
  }
  return -1;
}

/// Reads what came of a handshake and hello. True when the connection is done with (checked, or
/// refused: it is closed with `p`). A watched one (`deadline` set) is no longer watched then.
bool read_hello(Hub& h, Hub::Pending& p) {
  std::string why;
  const int step = hello_step(h, p, why);
  if (step == 0) {
    if (p.deadline)
      epoll_set(h, EPOLL_CTL_MOD, p.fd.get(), EPOLLIN | (p.want_out ? uint32_t{EPOLLOUT} : 0u), &p);
    return false;
  }
  // Unwatched before the descriptor may move to a connection, which the hub watches anew.
  if (p.deadline) epoll_set(h, EPOLL_CTL_DEL, p.fd.get(), 0, nullptr);
  if (step > 0)
    accept_hello(h, p);
  else
    refuse(h, p, why.c_str());
  return true;
}

void on_pending(Hub& h, Hub::Pending* p) {
  auto it =
      std::find_if(h.pending.begin(), h.pending.end(), [&](const auto& x) { return x.get() == p; });
  if (it == h.pending.end()) return;  // (checked by the caller too)
  if (read_hello(h, *p)) h.pending.erase(it);
}

/// Takes the connections waiting at listener `l`. A hello that is there in full at once is
/// checked at once; others wait in `pending`, at most kMaxPending of them: more are closed.
void accept_all(Hub& h, Hub::Listener& l) {
  for (;;) {
    auto p = std::make_unique<Hub::Pending>();
    socklen_t len = sizeof(p->from);
    p->fd = UniqueFd(::accept4(l.fd.get(), reinterpret_cast<sockaddr*>(&p->from), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!p->fd.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      uint64_t held = 0;
      if (ListenerRest::out_of_descriptors(errno) && l.rest.start(now_ns(), held))
        VLOG_WARN(
            "direct path: cannot accept peers' libraries on port {}: {}; not listening for "
            "{} ms{}",
            l.port, std::strerror(errno), ListenerRest::kRestNs / 1000000, log::held_note(held));
      return;  // EAGAIN: all taken
    }
    set_sock_opts(p->fd.get());
    if (read_hello(h, *p)) continue;
    if (h.pending.size() >= kMaxPending) {
      const uint64_t n = h.over_cap.fetch_add(1, std::memory_order_relaxed) + 1;
      uint64_t held = 0;
      if (h.over_cap_log.ready(now_ns(), held))
        VLOG_WARN(
            "direct path: closed a connection from {}: {} others have not said hello yet ({} "
            "closed so far){}",
            addr_of(p->from), kMaxPending, n, log::held_note(held));
      continue;
    }
    p->deadline = now_ms() + kHelloMs;
    epoll_set(h, EPOLL_CTL_ADD, p->fd.get(), EPOLLIN | (p->want_out ? uint32_t{EPOLLOUT} : 0u),
              p.get());
    h.pending.push_back(std::move(p));
  }
}

/// Closes the connections whose hello is late.
void expire_pending(Hub& h, uint64_t now) {
  std::erase_if(h.pending, [&](const auto& p) {
    if (p->deadline > now) return false;
    epoll_set(h, EPOLL_CTL_DEL, p->fd.get(), 0, nullptr);
    const uint64_t n = h.timed_out.fetch_add(1, std::memory_order_relaxed) + 1;
    uint64_t held = 0;
    if (h.timed_out_log.ready(now_ns(), held))
      VLOG_WARN("direct path: closed a connection from {}: no hello within {} ms ({} so far){}",
                addr_of(p->from), kHelloMs, n, log::held_note(held));
    return true;
  });
}

/// How long the hub may wait for an event. While it has connections, kClaimMs: the application
/// may claim one at any time (it says nothing to the hub), and the hub must see when its polls
/// stop, to take the connection back and send the ACK it owes. While hellos are awaited, their
/// deadlines; while a listener rests, its end.
int hub_timeout(Hub& h, uint64_t now) {
  int ms = -1;
  auto at_most = [&](int m) { ms = ms < 0 ? m : std::min(ms, m); };
  {
    std::lock_guard<std::mutex> g(h.mu);
    if (!h.conns.empty()) at_most(kClaimMs);
  }
  if (!h.pending.empty()) at_most(200);
  for (size_t i = 0; i < h.nlisteners.load(std::memory_order_acquire); ++i) {
    if (const uint64_t until = h.listeners[i].rest.until_ns())
      at_most(until > now ? static_cast<int>((until - now + 999999) / 1000000) : 0);
  }
  return ms;
}

/// Claims whose polls stopped without a completion: the hub watches those connections again.
void release_idle_claims(Hub& h) {
  std::vector<std::shared_ptr<Conn>> idle;
  {
    std::lock_guard<std::mutex> g(h.mu);
    for (const auto& c : h.conns) {
      if (!c->claimed.load(std::memory_order_relaxed)) continue;
      const uint32_t p = c->polls.load(std::memory_order_relaxed);
      if (p == c->polls_seen) idle.push_back(c);
      c->polls_seen = p;
    }
  }
  for (const auto& c : idle) {
    c->claimed.store(false);
    if (c->req_in.load()) send_ack(*c);
    rearm(*c);
  }
}

/// kResumes owed for receives posted since (post_recv sends them itself; this catches a
/// completion ring that had no room, and a post that raced with the kRnr).
void resume_waiting(Hub& h) {
  std::vector<std::shared_ptr<Conn>> owe;
  {
    std::lock_guard<std::mutex> g(h.mu);
    for (const auto& c : h.conns) {
      if (c->req_in.load(std::memory_order_relaxed)) owe.push_back(c);
    }
  }
  for (const auto& c : owe) {
    std::lock_guard<std::mutex> g(c->rx_mu);
    if (c->qp && c->qp->remote) try_resume(*c, *c->qp, *c->qp->remote);
  }
}

void run(Hub& h) {
  sigset_t all;
  ::sigfillset(&all);
  // Except the signal that stops it while memory is registered (stop_world.h): it allocates.
  ::sigdelset(&all, stop_signal());
  ::pthread_sigmask(SIG_BLOCK, &all, nullptr);
  epoll_event ev[32];
  uint64_t resumed_at = now_ms();
  const uint64_t spin_ns = hub_spin_ns();
  uint64_t busy_at = 0;  ///< when the hub last read a connection
  ::pthread_setname_np(::pthread_self(), "vrdma-hub");
  for (;;) {
    const uint64_t now = now_ns();
    const bool spin = now - busy_at < spin_ns;
    const int n = ::epoll_wait(h.ep.get(), ev, 32, spin ? 0 : hub_timeout(h, now));
    if (n == 0 && spin) {
      // Polling: the CPU goes to whoever else wants it between polls (a spinning target has
      // to run to see its memory).
      ::sched_yield();
      continue;
    }
    for (int i = 0; i < n; ++i) {
      // A connection may have gone since epoll_wait returned: the pointer is only compared
      // with what still exists (find_conn, pending) before anything reads through it.
      // Listeners stay as long as the hub.
      auto* w = static_cast<Watch*>(ev[i].data.ptr);
      const size_t nl = h.nlisteners.load(std::memory_order_acquire);
      const bool listener = std::any_of(h.listeners.begin(), h.listeners.begin() + nl,
                                        [&](const Watch& l) { return &l == w; });
      const Watch::Kind kind = w == &h.stop_w   ? Watch::kStop
                               : w == &h.wake_w ? Watch::kWake
                               : listener       ? Watch::kListen
                               : std::any_of(h.pending.begin(), h.pending.end(),
                                             [&](const auto& p) { return p.get() == w; })
                                   ? Watch::kPending
                                   : Watch::kConn;
      switch (kind) {
        case Watch::kStop:
          return;
        case Watch::kWake: {  // only empties the eventfd: the tick is set up below
          uint64_t n;
          [[maybe_unused]] const ssize_t got = ::read(h.wake.get(), &n, sizeof(n));
          break;
        }
        case Watch::kListen:
          accept_all(h, *static_cast<Hub::Listener*>(w));
          break;
        case Watch::kPending:
          on_pending(h, static_cast<Hub::Pending*>(w));
          break;
        case Watch::kConn: {
          std::shared_ptr<Conn> c = find_conn(h, w);
          if (!c) break;
          if (ev[i].events & EPOLLOUT) {
            std::lock_guard<std::mutex> g(c->tx_mu);
            flush_locked(*c);
          }
          if (ev[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) {
            std::lock_guard<std::mutex> g(c->rx_mu);
            if (!c->qp) break;
            if (drain(*c, false)) busy_at = now;
          }
          break;
        }
      }
    }
    release_idle_claims(h);
    const uint64_t t = now_ms();
    if (t - resumed_at >= kClaimMs) {
      resume_waiting(h);
      resumed_at = t;
    }
    expire_pending(h, t);
    const uint64_t tn = now_ns();
    for (size_t i = 0; i < h.nlisteners.load(std::memory_order_acquire); ++i)
      h.listeners[i].rest.poll(tn);
  }
}

/// The process's hub, started on first use (an epoll set, a thread; listeners come with the
/// first offer on each address, listen_on()). Null when it cannot be made.
Hub* hub_of(VContext& ctx) {
  if (Hub* h = ctx.hub_raw.load(std::memory_order_acquire)) return h;
  std::lock_guard<std::mutex> g(ctx.hub_make);
  if (ctx.hub) return ctx.hub.get();
  auto h = std::make_shared<Hub>();
  h->ctx = &ctx;
  h->ep = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  h->stop = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  h->wake = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!h->ep.valid() || !h->stop.valid() || !h->wake.valid()) {
    VLOG_WARN("direct path: cannot start the hub: {}", std::strerror(errno));
    return nullptr;
  }
  h->tls = make_tls(*h);
  if (!h->tls) {
    VLOG_WARN("direct path: cannot start the hub: no TLS context: {}", tls_reason());
    return nullptr;
  }
  epoll_set(*h, EPOLL_CTL_ADD, h->stop.get(), EPOLLIN, &h->stop_w);
  epoll_set(*h, EPOLL_CTL_ADD, h->wake.get(), EPOLLIN, &h->wake_w);
  Hub* raw = h.get();
  h->thr = std::thread([raw] { run(*raw); });
  ctx.hub = std::move(h);
  ctx.hub_raw.store(raw, std::memory_order_release);
  return raw;
}

/// The port the hub listens on at `ipv4` (network order; the address our backend says the peer's
/// library dials), listening there first if it does not yet; 0 when it cannot.
uint16_t listen_on(Hub& h, uint32_t ipv4) {
  std::lock_guard<std::mutex> g(h.listen_mu);
  const size_t n = h.nlisteners.load(std::memory_order_relaxed);
  for (size_t i = 0; i < n; ++i) {
    if (h.listeners[i].ipv4 == ipv4) return h.listeners[i].port;
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = ipv4;
  const std::string at = addr_of(a);
  if (n == kMaxListeners) {
    VLOG_WARN("direct path: not listening on {} too: {} addresses already", at, kMaxListeners);
    return 0;
  }
  Hub::Listener& l = h.listeners[n];
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  socklen_t alen = sizeof(a);
  if (!fd.valid() || ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::listen(fd.get(), 64) != 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &alen) != 0) {
    VLOG_WARN("direct path: cannot listen for peers' libraries on {}: {}", at,
              std::strerror(errno));
    return 0;
  }
  l.fd = std::move(fd);
  l.ipv4 = ipv4;
  l.port = ntohs(a.sin_port);
  l.rest.bind(h.ep.get(), l.fd.get(), reinterpret_cast<uintptr_t>(static_cast<Watch*>(&l)));
  // Published before it is watched: the thread tells a listener's events by this count.
  h.nlisteners.store(n + 1, std::memory_order_release);
  epoll_set(h, EPOLL_CTL_ADD, l.fd.get(), EPOLLIN, &l);
  VLOG_DEBUG("direct path: listening for peers' libraries on {}", addr_of(a));
  return l.port;
}

RemoteQp& remote_of(Hub& h, VQp& qp) {
  std::lock_guard<std::mutex> g(h.mu);
  if (!qp.remote) qp.remote = std::make_unique<RemoteQp>();
  return *qp.remote;
}

/// Connects to the peer's library (blocking, bounded by kDialMs in all): TCP, a TLS handshake
/// with the key derived from `token`, the hello and its answer. The connection (its session in
/// `ssl`) and the peer's LID, or invalid with errno and `why` (EBUSY: the peer's library has
/// dialed us).
UniqueFd dial(Hub& h, uint32_t ipv4, uint16_t port, const Hello& hello, const uint8_t* token,
              SslPtr& ssl, uint32_t& peer_lid, const char*& why) {
  why = nullptr;
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return {};
  set_sock_opts(fd.get());
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = ipv4;
  a.sin_port = htons(port);
  const uint64_t deadline = now_ms() + kDialMs;
  auto wait_for = [&](short ev) {
    const uint64_t now = now_ms();
    pollfd p{fd.get(), ev, 0};
    return now < deadline && ::poll(&p, 1, static_cast<int>(deadline - now)) == 1 &&
           (p.revents & ev);
  };
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (errno != EINPROGRESS || !wait_for(POLLOUT) ||
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      if (err) errno = err;
      return {};
    }
  }
  ssl.reset(SSL_new(h.tls.get()));
  if (!ssl || !set_socket(ssl.get(), fd.get())) {
    errno = ENOMEM;
    return {};
  }
  SSL_set_connect_state(ssl.get());
  const DialPsk psk{PskIdentity{kDirectMagic, kDirectVersion, hello.from_qpn, hello.to_qpn}, token};
  SSL_set_app_data(ssl.get(), const_cast<DialPsk*>(&psk));
  // Each step until it is done, waiting for what it asks; no read ahead until the hello's
  // answer is in (what follows it is the hub's to read, and epoll does not see the session).
  auto step = [&](auto&& call) {
    for (;;) {
      ERR_clear_error();
      const int r = call();
      if (r > 0) return r;
      const int e = SSL_get_error(ssl.get(), r);
      if ((e == SSL_ERROR_WANT_READ && wait_for(POLLIN)) ||
          (e == SSL_ERROR_WANT_WRITE && wait_for(POLLOUT)))
        continue;
      if (e == SSL_ERROR_SSL) why = tls_reason();
      ERR_clear_error();
      errno = e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE ? ETIMEDOUT : ECONNRESET;
      return r;
    }
  };
  const int shook = step([&] { return SSL_connect(ssl.get()); });
  SSL_set_app_data(ssl.get(), nullptr);
  if (shook <= 0) return {};
  if (!SSL_session_reused(ssl.get())) {  // the PSK made the session, nothing else could
    errno = EPROTO;
    return {};
  }
  if (step([&] { return SSL_write(ssl.get(), &hello, sizeof(hello)); }) <= 0) return {};
  HelloAck ack{};
  size_t got = 0;
  while (got < sizeof(ack)) {
    const int r = step([&] {
      return SSL_read(ssl.get(), reinterpret_cast<uint8_t*>(&ack) + got,
                      static_cast<int>(sizeof(ack) - got));
    });
    if (r <= 0) return {};  // refused: a hello the peer's hub does not know is not answered
    got += static_cast<size_t>(r);
  }
  if (!check_hello_ack(ack).is_ok() || ack.err != 0) {
    errno = ack.err > 0 && ack.err < 4096 ? ack.err : EPROTO;
    return {};
  }
  SSL_set_read_ahead(ssl.get(), 1);
  peer_lid = ack.lid;
  return fd;
}

void back_off(RemoteQp& r, uint32_t base) {
  r.backoff = std::min(std::max(r.backoff * 2, base), kAskMax);
  r.ask_wait = r.backoff;
}

/// Asks the backend for the peer's offer and connects (under the SQ lock). True: `out` is up.
bool connect_out(VQp& qp) {
  VContext& ctx = *to_vctx(qp.qp.context);
  // Only when everything the backend took from this SQ is completed: nothing can pass it.
  if (qp.sq_hdr->retired.load(std::memory_order_acquire) != qp.sq_prod) return false;
  if (qp.remote && qp.remote->ask_wait) {
    --qp.remote->ask_wait;
    return false;
  }
  Hub* h = hub_of(ctx);
  if (!h) return false;
  RemoteQp& r = remote_of(*h, qp);
  DirectRemoteResp resp{};
  std::vector<UniqueFd> fds;
  HandleReq req{qp.handle, 0};
  if (const int rc = ctx.call(Op::kDirectRemote, req, resp, {}, &fds)) {
    if (rc == EAGAIN)
      back_off(r, kAskFirst);
    else
      r.never = true;
    return false;
  }
  if (fds.size() != 1 || !resp.send_ring_entries ||
      (resp.send_ring_entries & (resp.send_ring_entries - 1)) ||
      !map_ring(r.send, fds[0].get(), resp.send_ring_entries)) {
    VLOG_WARN("direct path: unusable answer for QP {:#x}; staying on the backend", qp.qp.qp_num);
    r.never = true;
    return false;
  }
  r.send.seen = r.send.hdr->consumer.load(std::memory_order_acquire);
  // The peer's library has dialed us: its connection takes our requests too.
  auto adoptable = [&] {
    std::lock_guard<std::mutex> g(h->mu);
    return r.in && !r.in->broken.load() && r.in->peer_takes_requests ? r.in : nullptr;
  };
  std::shared_ptr<Conn> c = adoptable();
  if (!c) {
    const Hello hello{kDirectMagic,  kDirectVersion, qp.qp.qp_num,
                      resp.peer_qpn, resp.my_lid,    r.offered ? kTakesRequests : 0};
    uint32_t peer_lid = 0;
    SslPtr ssl;
    const char* why = nullptr;
    UniqueFd fd = dial(*h, resp.peer_ipv4, resp.peer_port, hello, resp.token, ssl, peer_lid, why);
    if (fd.valid()) {
      c = std::make_shared<Conn>();
      c->fd = std::move(fd);
      c->ssl = std::move(ssl);
      c->hub = h;
      c->qp = &qp;
      c->send_cq = qp.qp.send_cq;
      c->recv_cq = qp.qp.recv_cq;
      c->rq_hdr = qp.rq_hdr;
      c->resp_in.store(true);
      {
        std::lock_guard<std::mutex> g(h->mu);
        r.out = c;
        // The peer's requests come on it too, unless its own dial got here first (then each
        // direction keeps its own connection).
        if (!r.in && r.offered) {
          c->req_in.store(true);
          r.peer_lid = peer_lid;
          r.in = c;
          r.in_raw.store(c.get(), std::memory_order_release);
        }
      }
      register_conn(*h, c);
    } else if (errno == EBUSY) {
      c = adoptable();  // both dialed at once, and the peer's got there first
    }
    if (!c) {
      char ip[INET_ADDRSTRLEN] = "?";
      ::inet_ntop(AF_INET, &resp.peer_ipv4, ip, sizeof(ip));
      VLOG_WARN(
          "direct path: QP {:#x} cannot reach its peer's library at {}:{} ({}); staying on "
          "the backend",
          qp.qp.qp_num, ip, resp.peer_port, why ? why : std::strerror(errno));
      back_off(r, kAskMax / 4);
      return false;
    }
  }
  if (!c->resp_in.load()) {  // adopted
    std::lock_guard<std::mutex> g(h->mu);
    c->resp_in.store(true);
    r.out = c;
  }
  r.active.store(true, std::memory_order_release);
  VLOG_INFO("direct path: QP {:#x} sends to QP {:#x} through its library ({}, {}){}", qp.qp.qp_num,
            resp.peer_qpn, SSL_get_version(c->ssl.get()), SSL_get_cipher_name(c->ssl.get()),
            c == r.in ? " (one connection both ways)" : "");
  return true;
}

/// A WR's local memory, checked against our MRs: success, or the error its completion gets.
int local_memory(VContext& ctx, VQp& qp, const ibv_send_wr& wr, Inflight& e, MemSpan* out,
                 size_t& n) {
  const uint32_t need = answered_by_data(wr.opcode) ? IBV_ACCESS_LOCAL_WRITE : 0;
  uint64_t len = 0;
  if (const int st = local_sges(ctx, qp, wr, need, out, n, len); st != IBV_WC_SUCCESS) return st;
  if (wr.opcode == IBV_WR_ATOMIC_CMP_AND_SWP || wr.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    if (len != 8 || n != 1) return IBV_WC_LOC_LEN_ERR;
  }
  e.len = static_cast<uint32_t>(len);
  return IBV_WC_SUCCESS;
}

/// Ends a QP's connections (it leaves RTS, or goes).
void teardown(VQp& qp) {
  Hub* h = to_vctx(qp.qp.context)->hub_raw.load(std::memory_order_acquire);
  if (!h || !qp.remote) return;
  std::shared_ptr<Conn> in, out;
  {
    std::lock_guard<std::mutex> g(h->mu);
    qp.remote->dead = true;
    qp.remote->in_raw.store(nullptr);
    in = std::move(qp.remote->in);
    out = std::move(qp.remote->out);
  }
  qp.remote->active.store(false);
  // What we executed and have not acknowledged yet (an ACK that was to ride on a request of
  // ours) goes before the connection closes: the peer's WRs complete.
  if (in) {
    send_ack(*in);
    retire(*h, in);
  }
  if (out && out != in) retire(*h, out);
}

}  // namespace

bool remote_post(VQp& qp, ibv_send_wr* wr, int& rc, ibv_send_wr** bad) {
  // A QP posted to through ibv_wr_* writes its WQEs straight into the ring: it stays there.
  if (qp.qp.qp_type != IBV_QPT_RC || qp.qp_ex.wr_start) return false;
  VContext& ctx = *to_vctx(qp.qp.context);
  if (!(ctx.control_page()->features & kFeatureDirectRemote)) return false;
  RemoteQp* r = qp.remote.get();
  if (!r || !r->active.load(std::memory_order_acquire)) {
    if (r && (r->failed.load() || r->never || r->dead)) return false;
    if (!connect_out(qp)) return false;
    r = qp.remote.get();
  }
  rc = 0;
  bool fail = false;
  for (; wr; wr = wr->next) {
    const uint8_t type = frame_type(wr->opcode);
    if (!type || wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > qp.caps.max_send_sge) {
      rc = EINVAL;
      break;
    }
    if ((wr->send_flags & IBV_SEND_INLINE) && carries_data(type)) {
      uint64_t total = 0;
      for (int i = 0; i < wr->num_sge; ++i) total += wr->sg_list[i].length;
      if (total > std::min(qp.caps.max_inline_data, kMaxInline)) {
        rc = EINVAL;
        break;
      }
    }
    Inflight e;
    e.wr_id = wr->wr_id;
    e.opcode = wr->opcode;
    e.signaled = qp.sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
    MemSpan data[kMaxSge];
    size_t nd = 0;
    const int st = local_memory(ctx, qp, *wr, e, data, nd);
    std::lock_guard<std::mutex> fl(r->fl_mu);
    if (r->inflight.size() >= qp.sq_size) {
      rc = ENOMEM;
      break;
    }
    if (r->failing || st != IBV_WC_SUCCESS || !r->out || r->out->broken.load()) {
      // It completes in order, with its error (or flushed, after one).
      e.status = r->failing             ? IBV_WC_WR_FLUSH_ERR
                 : st != IBV_WC_SUCCESS ? st
                                        : IBV_WC_RETRY_EXC_ERR;
      r->failing = true;
      r->inflight.push_back(e);
      if (r->inflight.size() == 1) {
        flush_inflight(qp, *r, -1);
        fail = true;
      }
      continue;
    }
    e.sent = true;
    e.seq = r->sent++;
    Frame& f = e.f;
    f.type = type;
    f.flags = static_cast<uint16_t>(wr->send_flags & IBV_SEND_SOLICITED);
    f.imm = wr->imm_data;
    f.len = e.len;
    if (type == kCas || type == kFaa) {
      f.rkey = wr->wr.atomic.rkey;
      f.raddr = wr->wr.atomic.remote_addr;
      f.arg0 = wr->wr.atomic.compare_add;
      f.arg1 = wr->wr.atomic.swap;
    } else {
      f.rkey = wr->wr.rdma.rkey;
      f.raddr = wr->wr.rdma.remote_addr;
    }
    Inflight& q = r->inflight.emplace_back(e);
    if ((wr->send_flags & IBV_SEND_INLINE) && carries_data(type)) {
      // The application may reuse inline data at once: a resend takes it from here.
      q.inl = true;
      uint8_t* at = q.inl_data;
      for (size_t i = 0; i < nd; ++i) at = std::copy_n(data[i].p, data[i].n, at);
    } else {
      q.nl = static_cast<uint8_t>(nd);
      std::copy(data, data + nd, q.local);
    }
    r->awaiting.fetch_add(1, std::memory_order_relaxed);
    // After a kRnr it waits in line for the peer's kResume (resend()).
    if (!r->rnr && !write_request(*r, *r->out, q)) {
      flush_inflight(qp, *r, IBV_WC_RETRY_EXC_ERR);
      fail = true;
    }
  }
  if (fail) to_error(qp, "a WR failed on the direct path");
  if (rc) *bad = wr;
  return true;
}

void remote_before_modify(VQp& qp, int mask, const ibv_qp_attr& attr) {
  if (!(mask & IBV_QP_STATE) || !qp.remote) return;
  const ibv_qp_state to = attr.qp_state;
  if (to == IBV_QPS_RTS && qp.qp.state == IBV_QPS_RTS) return;  // attributes only
  if (to == IBV_QPS_RTR || to == IBV_QPS_RTS) return;           // on its way up
  // Leaving RTS: in ERR the WRs in flight are flushed; in RESET they are dropped.
  qp.sq_lock.lock();
  if (to == IBV_QPS_ERR || to == IBV_QPS_SQE || to == IBV_QPS_SQD) {
    std::lock_guard<std::mutex> g(qp.remote->fl_mu);
    if (!qp.remote->inflight.empty()) flush_inflight(qp, *qp.remote, IBV_WC_WR_FLUSH_ERR);
  }
  teardown(qp);
  qp.remote->failed.store(true);
  if (to == IBV_QPS_RESET) qp.remote.reset();
  qp.sq_lock.unlock();
}

void remote_after_modify(VQp& qp, int mask, const ibv_qp_attr& attr) {
  if (mask & IBV_QP_ACCESS_FLAGS) qp.access = attr.qp_access_flags;
  if (!(mask & IBV_QP_STATE) || (attr.qp_state != IBV_QPS_RTR && attr.qp_state != IBV_QPS_RTS))
    return;
  VContext& ctx = *to_vctx(qp.qp.context);
  if (qp.qp.qp_type != IBV_QPT_RC || qp.qp.srq ||
      !(ctx.control_page()->features & kFeatureDirectRemote) ||
      (qp.remote && (qp.remote->offered || qp.remote->dead)))
    return;
  Hub* h = hub_of(ctx);
  if (!h) return;
  RemoteQp& r = remote_of(*h, qp);
  // We listen only where the peer's library will dial: the address our backend says.
  DirectOfferReq req{};
  req.qp = qp.handle;
  req.flags = kDirectOfferWhere;
  DirectOfferResp where{};
  if (const int rc = ctx.call(Op::kDirectOffer, req, where)) {
    if (rc == EADDRNOTAVAIL)
      VLOG_INFO("direct path: QP {:#x} stays on the backends: no address of ours for its peer",
                qp.qp.qp_num);
    return;  // not for this QP (or not yet)
  }
  req.flags = 0;
  req.port = listen_on(*h, where.listen_ipv4);
  if (req.port == 0) return;
  if (::getrandom(req.token, sizeof(req.token), 0) != static_cast<ssize_t>(sizeof(req.token)))
    return;
  DirectOfferResp resp{};
  std::vector<UniqueFd> fds;
  if (ctx.call(Op::kDirectOffer, req, resp, {}, &fds) != 0) return;  // not for this QP (or not yet)
  if (fds.size() != 1 || !resp.recv_ring_entries ||
      (resp.recv_ring_entries & (resp.recv_ring_entries - 1))) {
    VLOG_WARN("direct path: unusable offer answer for QP {:#x}", qp.qp.qp_num);
    return;
  }
  OwnRing ring;
  if (!map_ring(ring, fds[0].get(), resp.recv_ring_entries)) return;
  ring.seen = ring.hdr->consumer.load(std::memory_order_acquire);
  std::lock_guard<std::mutex> g(h->mu);
  r.recv = std::move(ring);
  std::memcpy(r.token, req.token, kDirectTokenBytes);
  r.peer_qpn = resp.peer_qpn;
  r.my_lid = resp.my_lid;
  r.offered = true;
}

void remote_destroy(VQp& qp) {
  if (!qp.remote) return;
  qp.sq_lock.lock();
  teardown(qp);
  qp.sq_lock.unlock();
}

bool remote_progress(VCq& cq) {
  Hub* h = to_vctx(cq.cq.context)->hub_raw.load(std::memory_order_acquire);
  if (!h) return false;
  const uint32_t gen = h->gen.load(std::memory_order_acquire);
  if (gen != cq.rgen) {
    std::lock_guard<std::mutex> g(h->mu);
    cq.rconns.clear();
    for (const auto& c : h->conns) {
      if (c->send_cq == &cq.cq || c->recv_cq == &cq.cq) cq.rconns.push_back(c);
    }
    cq.rgen = gen;
  }
  bool did = false;
  for (const auto& c : cq.rconns) {
    if (c->broken.load(std::memory_order_relaxed)) continue;
    // The application polls again without having posted: what it owes goes now.
    const bool req_in = c->req_in.load(std::memory_order_relaxed);
    if (req_in) send_ack(*c);
    c->polls.store(c->polls.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    if (!c->claimed.load(std::memory_order_relaxed)) {
      c->claimed.store(true);
      rearm(*c);
      cq.rclaimed = true;
    }
    if (c->want_out.load(std::memory_order_relaxed)) {
      std::unique_lock<std::mutex> t(c->tx_mu, std::try_to_lock);
      if (t) flush_locked(*c);
    }
    std::unique_lock<std::mutex> l(c->rx_mu, std::try_to_lock);
    if (!l || !c->qp) continue;
    RemoteQp& r = *c->qp->remote;
    // Nothing of ours waits for an answer: a connection of responses only has nothing we need,
    // and reading it costs a syscall a poll.
    if (!req_in && r.awaiting.load(std::memory_order_relaxed) == 0) continue;
    did |= drain(*c, true);
    if (req_in) try_resume(*c, *c->qp, r);
  }
  return did;
}

void remote_release(VCq& cq) {
  // Only the connections that bring what the application may now wait for in memory: the peer's
  // requests to a QP with no receive posted (WRITEs, which complete nothing here). A QP with
  // receives posted, or with requests of ours unanswered, is waited on by polling; so is one
  // whose peer has sent no request yet (a READ ping-pong's requester: a release would cost
  // two epoll_ctl a round trip). The rest stays claimed until the polls stop (kClaimMs).
  bool any = false;
  for (const auto& c : cq.rconns) {
    if (!c->claimed.load(std::memory_order_relaxed)) continue;
    bool keep = !c->req_in.load(std::memory_order_relaxed) ||
                c->executed.load(std::memory_order_relaxed) == 0 ||
                c->broken.load(std::memory_order_relaxed) ||
                c->rq_hdr->producer.load(std::memory_order_relaxed) !=
                    c->rq_hdr->consumer.load(std::memory_order_relaxed);
    if (!keep && c->resp_in.load(std::memory_order_relaxed)) {
      std::unique_lock<std::mutex> l(c->rx_mu, std::try_to_lock);
      keep = !l || !c->qp || c->qp->remote->awaiting.load(std::memory_order_relaxed) != 0;
    }
    if (keep) {
      any = true;
      continue;
    }
    c->claimed.store(false);
    send_ack(*c);
    rearm(*c);
  }
  cq.rclaimed = any;
}

void remote_receives_posted(VQp& qp) {
  RemoteQp* r = qp.remote.get();
  if (!r) return;
  // The receive's producer index before the flag (send_rnr() stores them the other way round).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!r->resume_owed.load(std::memory_order_seq_cst)) return;
  Hub* h = to_vctx(qp.qp.context)->hub_raw.load(std::memory_order_acquire);
  if (!h) return;
  std::shared_ptr<Conn> c;
  {
    std::lock_guard<std::mutex> g(h->mu);
    c = r->in;
  }
  if (!c) return;
  std::lock_guard<std::mutex> l(c->rx_mu);
  if (c->qp) try_resume(*c, qp, *r);
}

void remote_shutdown(VContext& ctx) {
  std::shared_ptr<Hub> h;
  {
    std::lock_guard<std::mutex> g(ctx.hub_make);
    h = std::move(ctx.hub);
    ctx.hub_raw.store(nullptr);
  }
  if (!h) return;
  const uint64_t one = 1;
  if (::write(h->stop.get(), &one, sizeof(one)) < 0) {
    VLOG_WARN("direct path: cannot stop the hub thread: {}", std::strerror(errno));
    h->thr.detach();
    return;
  }
  h->thr.join();
}

}  // namespace vrdma::verbs
