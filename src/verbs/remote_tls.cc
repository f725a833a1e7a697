// The direct path across backends: its TLS sessions (TLS 1.3, an external PSK per QP pair; see
// remote_impl.h): the dial, OpenSSL's handshake on a socket BIO that writes without SIGPIPE,
// then the connection's own records (common/tls_record.h), and the frames written through them.
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
#include "verbs/remote_impl.h"
#include "verbs/stop_world.h"

namespace vrdma::verbs::dlink {

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

bool set_socket(SSL* ssl, int fd) {
  const BIO_METHOD* m = nosignal_socket_method();
  BIO* b = m ? BIO_new(m) : nullptr;
  if (!b) return false;
  BIO_set_fd(b, fd, BIO_NOCLOSE);
  SSL_set_bio(ssl, b, b);
  return true;
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

VQp* offer_of(VContext& ctx, uint32_t to_qpn, uint32_t from_qpn) {
  for (const auto& [handle, qp] : ctx.qps) {
    const RemoteQp* r = qp->remote.get();
    if (r && r->offered && !r->dead && !r->revoking.load() && qp->qp.qp_num == to_qpn &&
        r->peer_qpn == from_qpn)
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

TlsSecrets::~TlsSecrets() {
  for (std::vector<uint8_t>* v : {&client, &server})
    if (!v->empty()) OPENSSL_cleanse(v->data(), v->size());
}

int secrets_index() {
  static const int i = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return i;
}

/// OpenSSL's key log callback: the traffic secrets go to the handshake's TlsSecrets, nowhere else.
void keep_secret(const SSL* s, const char* line) {
  if (auto* sec = static_cast<TlsSecrets*>(SSL_get_ex_data(s, secrets_index())))
    tls::take_traffic_secret(line, sec->client, sec->server);
}

SslCtxPtr make_tls(Hub& h) {
  SslCtxPtr t(SSL_CTX_new(TLS_method()));
  if (!t || SSL_CTX_set_min_proto_version(t.get(), TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_max_proto_version(t.get(), TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_ciphersuites(t.get(), kTlsSuite) != 1 ||
      SSL_CTX_set_num_tickets(t.get(), 0) != 1)
    return nullptr;
  SSL_CTX_set_options(t.get(), SSL_OP_NO_TICKET);
  SSL_CTX_set_session_cache_mode(t.get(), SSL_SESS_CACHE_OFF);
  SSL_CTX_set_verify(t.get(), SSL_VERIFY_PEER, nullptr);
  SSL_CTX_set_session_id_context(t.get(), kSidCtx, sizeof(kSidCtx) - 1);
  // The traffic secrets, for the connection's own records after the handshake (take_over).
  SSL_CTX_set_keylog_callback(t.get(), keep_secret);
  SSL_CTX_set_psk_use_session_callback(t.get(), psk_use);
  SSL_CTX_set_psk_find_session_callback(t.get(), psk_find);
  SSL_CTX_set_app_data(t.get(), &h);
  return t;
}

SSL_CTX* hub_tls(Hub& h) {
  std::call_once(h.tls_once, [&h] {
    h.tls = make_tls(h);
    if (!h.tls) VLOG_WARN("direct path: no TLS context for peers' libraries: {}", tls_reason());
  });
  return h.tls.get();
}

const char* tls_reason() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  const char* r = e ? ERR_reason_error_string(e) : nullptr;
  return r ? r : "closed";
}

std::unique_ptr<tls::RecordStream> take_over(SSL* s, TlsSecrets& sec, const char*& why) {
  SSL_set_ex_data(s, secrets_index(), nullptr);
  const bool server = SSL_is_server(s) == 1;
  auto rs = std::make_unique<tls::RecordStream>();
  if (SSL_has_pending(s) == 1) {
    why = "data inside the TLS session right after the handshake";
    return nullptr;
  }
  if (!rs->start(SSL_CIPHER_get_protocol_id(SSL_get_current_cipher(s)),
                 server ? sec.server : sec.client, server ? sec.client : sec.server, kTlsBuf)) {
    why = "no traffic keys from OpenSSL";
    return nullptr;
  }
  return rs;
}

ssize_t read_bounded(tls::RecordStream& rs, int fd, void* p, size_t n, std::string& why) {
  for (;;) {
    const ssize_t r = rs.read(p, n, why);
    if (r != 0) return r;
    const ssize_t got = rs.pull(fd, nullptr, rs.record_need());
    if (got <= 0) return got;
  }
}

ssize_t tls_read(Conn& c, void* p, size_t n, bool& more, bool p_is_ours) {
  std::string why;
  for (;;) {
    const ssize_t r = c.rs->read(p, n, why, p_is_ours);
    if (r > 0) {
      more = c.rs->has_buffered();
      return r;
    }
    more = false;
    if (r < 0) {
      c.tls_err = std::move(why);
      return -1;
    }
    const ssize_t got = c.rs->pull(c.fd.get());
    if (got < 0) {
      if (errno) c.tls_err = fmt::format("the connection failed: {}", std::strerror(errno));
      return -1;
    }
    if (got == 0) return 0;
  }
}

int tls_push(Conn& c) { return c.rs->push(c.fd.get()); }

ssize_t tls_write(Conn& c, const iovec* iov, size_t n, size_t skip) {
  std::string why;
  ssize_t took = c.rs->write(iov, n, skip, why);
  int pushed = took < 0 ? -1 : tls_push(c);
  if (took == 0 && pushed == 1) {  // the stream was full, and now is empty
    took = c.rs->write(iov, n, skip, why);
    pushed = took < 0 ? -1 : tls_push(c);
  }
  return pushed < 0 ? -1 : took;
}

UniqueFd dial(Hub& h, uint32_t ipv4, uint16_t port, const Hello& hello, const uint8_t* token,
              std::unique_ptr<tls::RecordStream>& rs, uint32_t& peer_lid, std::string& why) {
  why.clear();
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
  SSL_CTX* tls = hub_tls(h);
  SslPtr ssl(tls ? SSL_new(tls) : nullptr);
  if (!ssl || !set_socket(ssl.get(), fd.get())) {
    errno = ENOMEM;
    return {};
  }
  SSL_set_connect_state(ssl.get());
  const DialPsk psk{PskIdentity{kDirectMagic, kDirectVersion, hello.from_qpn, hello.to_qpn}, token};
  TlsSecrets secrets;
  SSL_set_app_data(ssl.get(), const_cast<DialPsk*>(&psk));
  SSL_set_ex_data(ssl.get(), secrets_index(), &secrets);
  // The handshake, each step waiting for what it asks. No read ahead: what the peer sends after
  // it stays in the socket.
  for (;;) {
    ERR_clear_error();
    const int r = SSL_connect(ssl.get());
    if (r > 0) break;
    const int e = SSL_get_error(ssl.get(), r);
    if ((e == SSL_ERROR_WANT_READ && wait_for(POLLIN)) ||
        (e == SSL_ERROR_WANT_WRITE && wait_for(POLLOUT)))
      continue;
    if (e == SSL_ERROR_SSL) why = tls_reason();
    ERR_clear_error();
    SSL_set_ex_data(ssl.get(), secrets_index(), nullptr);
    errno = e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE ? ETIMEDOUT : ECONNRESET;
    return {};
  }
  SSL_set_app_data(ssl.get(), nullptr);
  if (!SSL_session_reused(ssl.get())) {  // the PSK made the session, nothing else could
    errno = EPROTO;
    return {};
  }
  const char* fail = nullptr;
  rs = take_over(ssl.get(), secrets, fail);
  if (!rs) {
    why = fail;
    errno = EPROTO;
    return {};
  }
  // The hello, then its answer, through our records.
  if (rs->write(&hello, sizeof(hello), why) != static_cast<ssize_t>(sizeof(hello))) {
    errno = EPROTO;
    return {};
  }
  for (int pushed; (pushed = rs->push(fd.get())) != 1;) {
    if (pushed < 0 || !wait_for(POLLOUT)) {
      errno = pushed < 0 ? errno : ETIMEDOUT;
      return {};
    }
  }
  HelloAck ack{};
  size_t got = 0;
  while (got < sizeof(ack)) {
    const ssize_t r =
        read_bounded(*rs, fd.get(), reinterpret_cast<uint8_t*>(&ack) + got, sizeof(ack) - got, why);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    // Refused: a hello the peer's hub does not know is not answered.
    if (r < 0 || !wait_for(POLLIN)) {
      errno = r < 0 ? ECONNRESET : ETIMEDOUT;
      return {};
    }
  }
  if (!check_hello_ack(ack).is_ok() || ack.err != 0) {
    errno = ack.err > 0 && ack.err < 4096 ? ack.err : EPROTO;
    return {};
  }
  peer_lid = ack.lid;
  return fd;
}

// ---- writing frames ----

/// Writes a frame and its data: what the socket takes now, the rest into the backlog (copied
/// when `copy`; else referenced: a requester's payload, which the application leaves alone until
/// the WR completes). False when the connection is broken.
bool send_frame(Conn& c, const Frame& f, const MemSpan* data, size_t nd, bool copy,
                bool may_hold) {
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
  // (A frame larger than a record goes at once, and with it what the batch held: sealing a
  // large answer whole before its first byte leaves only delays it.)
  const bool corked = total <= tls::kTlsMaxPlain && t_corked == &c;
  const bool claimed = may_hold && c.claimed.load(std::memory_order_relaxed);
  if (c.backlog.empty() && (corked || claimed)) {
    // Not the first request since the application's last poll: sealed now, written out at its
    // next poll with the rest of the burst (one syscall for many). During this thread's batch
    // of the peer's frames: written out when it ends (t_corked).
    const uint32_t polls = c.polls.load(std::memory_order_relaxed);
    if (corked || polls == c.pushed_at_polls) {
      std::string why;
      const ssize_t w = c.rs->write(iov, n, 0, why);
      if (w < 0) {
        c.broken.store(true);
        return false;
      }
      tsan_ring_release();  // sealed now: its answer may come once a later write sends it
      done = static_cast<size_t>(w);
      if (done == total) {
        c.held.store(true, std::memory_order_relaxed);
        return true;
      }
    }
    if (claimed) c.pushed_at_polls = polls;
  }
  if (c.backlog.empty()) {
    for (;;) {
      const ssize_t w = tls_write(c, iov, n, done);
      tsan_ring_release();  // what arrives later may answer what this sent (see tsan_ring_edge)
      if (w < 0) {
        c.broken.store(true);
        return false;
      }
      done += static_cast<size_t>(w);
      if (done == total) break;
      if (w == 0) break;
    }
  }
  if (done == total) {
    // All sealed; what the socket did not take waits in the stream for EPOLLOUT.
    if (!c.rs->out_pending()) {
      c.held.store(false, std::memory_order_relaxed);
    } else if (!c.want_out.exchange(true)) {
      rearm(c);
    }
    return true;
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

bool flush_locked(Conn& c) {
  for (;;) {
    const int pushed = tls_push(c);
    tsan_ring_release();
    if (pushed < 0) {
      c.broken.store(true);
      return false;
    }
    if (pushed == 0) {
      // The socket is full: EPOLLOUT (again). A flush of what a batch or a claim held
      // (flush_held) may be the first to find it full, and nothing else would write it then.
      if (!c.want_out.exchange(true)) rearm(c);
      return true;
    }
    c.held.store(false, std::memory_order_relaxed);
    if (c.backlog.empty()) break;
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

void flush_held(Conn& c) {
  // Under tx_mu whatever `held` says: a post that saw the connection still claimed holds its
  // request under tx_mu, and one that takes tx_mu after this sees it unclaimed.
  std::lock_guard<std::mutex> g(c.tx_mu);
  if (c.held.load(std::memory_order_relaxed)) flush_locked(c);
}

}  // namespace vrdma::verbs::dlink
