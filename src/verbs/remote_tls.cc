// The direct path across backends: its TLS sessions (TLS 1.3, an external PSK per QP pair; see
// remote_impl.h), and the socket BIO that writes without SIGPIPE.
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

const char* tls_reason() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  const char* r = e ? ERR_reason_error_string(e) : nullptr;
  return r ? r : "closed";
}

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

}  // namespace vrdma::verbs::dlink
