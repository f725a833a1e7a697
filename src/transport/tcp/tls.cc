#include "transport/tcp/tls.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/guest_fault.h"

namespace vrdma::transport::tcp {

namespace {

/// Each direction of a connection's BIO pair: the handshake's ciphertext.
constexpr size_t kPairBytes = 256 * 1024;
/// Each direction's ciphertext buffer after the handshake: up to 16 records a syscall.
constexpr size_t kBufBytes = 256 * 1024 + tls::kTlsMaxRecord;

std::string cn_of(X509* cert) {
  char cn[256] = {};
  if (!cert ||
      X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, cn, sizeof(cn)) <= 0)
    return {};
  return cn;
}

/// SHA-256 of the certificate (DER), "AB:CD:..." ("" for none).
std::string fingerprint_of(X509* cert) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (!cert || X509_digest(cert, EVP_sha256(), md, &n) != 1) return {};
  std::string out;
  for (unsigned i = 0; i < n; ++i) out += fmt::format("{}{:02X}", i ? ":" : "", md[i]);
  return out;
}

Status check_key_file(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0)
    return error(errno, fmt::format("{}: {}", path, std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    return error(EINVAL, fmt::format("{}: not a regular file (a symlink?)", path));
  if (st.st_uid != ::geteuid() && st.st_uid != 0)
    return error(EPERM, fmt::format("{}: owned by uid {}, not by this backend's user or root", path,
                                    st.st_uid));
  if (st.st_mode & 077)
    return error(EPERM, fmt::format("{}: others may read it (mode {:04o}): chmod 600 {}", path,
                                    st.st_mode & 07777, path));
  return Status::ok();
}

}  // namespace

/// OpenSSL's key log callback: the TLS 1.3 application traffic secrets, which the stream's own
/// record layer takes over once the handshake is done (nothing is logged anywhere).
struct TlsSecrets {
  static void on_line(const SSL* ssl, const char* line) {
    auto* s = static_cast<TlsStream*>(SSL_get_ex_data(ssl, 0));
    if (s) tls::take_traffic_secret(line, s->client_secret_, s->server_secret_);
  }
};

std::string tls_errors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    out += out.empty() ? "" : "; ";
    out += buf;
  }
  return out.empty() ? "no detail from OpenSSL" : out;
}

TlsFiles TlsFiles::in_dir(const std::string& dir, const std::string& node) {
  return {dir + "/ca.pem", dir + "/" + node + ".pem", dir + "/" + node + ".key"};
}

Result<std::unique_ptr<TlsContext>> TlsContext::load(const TlsFiles& f, const std::string& node) {
  ERR_clear_error();
  for (const std::string* file : {&f.ca, &f.cert, &f.key}) {
    if (::access(file->c_str(), F_OK) != 0)
      return error(errno, fmt::format("TLS: {}: {}: this node's credential is not there (make it "
                                      "with `vrdma cluster add-node {}` where the cluster CA is, "
                                      "then copy ca.pem, {}.pem and {}.key here)",
                                      *file, std::strerror(errno), node, node, node));
  }
  RETURN_IF_ERROR(check_key_file(f.key));
  SSL_CTX* raw = SSL_CTX_new(TLS_method());
  if (!raw) return error(ENOMEM, "TLS: " + tls_errors());
  std::unique_ptr<TlsContext> ctx(new TlsContext(raw));
  SSL_CTX_set_min_proto_version(raw, TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(raw, TLS1_3_VERSION);
  // AES-128-GCM first: with AES-NI it is the cheapest authenticated cipher there is.
  SSL_CTX_set_ciphersuites(raw,
                           "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256:"
                           "TLS_AES_256_GCM_SHA384");
  SSL_CTX_set_num_tickets(raw, 0);  // no resumption: connections are few and long
  SSL_CTX_set_session_cache_mode(raw, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_mode(raw, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_CTX_set_keylog_callback(raw, &TlsSecrets::on_line);
  if (SSL_CTX_load_verify_file(raw, f.ca.c_str()) != 1)
    return error(EINVAL, fmt::format("TLS: cannot load the cluster CA {}: {}", f.ca, tls_errors()));
  if (SSL_CTX_use_certificate_chain_file(raw, f.cert.c_str()) != 1)
    return error(EINVAL,
                 fmt::format("TLS: cannot load the certificate {}: {}", f.cert, tls_errors()));
  if (SSL_CTX_use_PrivateKey_file(raw, f.key.c_str(), SSL_FILETYPE_PEM) != 1)
    return error(EINVAL, fmt::format("TLS: cannot load the key {}: {}", f.key, tls_errors()));
  if (SSL_CTX_check_private_key(raw) != 1)
    return error(EINVAL, fmt::format("TLS: {} is not the key of {}", f.key, f.cert));
  // Our own certificate must pass the check our peers make, or we would only learn it from them.
  X509* own = SSL_CTX_get0_certificate(raw);
  const std::string cn = cn_of(own);
  if (cn != node)
    return error(EINVAL, fmt::format("TLS: {} names node \"{}\", but this backend is \"{}\" "
                                     "(vrdma cluster add-node {})",
                                     f.cert, cn, node, node));
  X509_STORE_CTX* vctx = X509_STORE_CTX_new();
  X509_STORE_CTX_init(vctx, SSL_CTX_get_cert_store(raw), own, nullptr);
  const bool ok = X509_verify_cert(vctx) == 1;
  const int verr = X509_STORE_CTX_get_error(vctx);
  X509_STORE_CTX_free(vctx);
  if (!ok)
    return error(EINVAL, fmt::format("TLS: {} does not verify against {}: {}", f.cert, f.ca,
                                     X509_verify_cert_error_string(verr)));
  SSL_CTX_set_verify(raw, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  return ctx;
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

TlsStream::TlsStream(const TlsContext& ctx, bool server) {
  ssl_ = SSL_new(ctx.get());
  SSL_set_ex_data(ssl_, 0, this);
  BIO_new_bio_pair(&int_, kPairBytes, &ext_, kPairBytes);
  SSL_set_bio(ssl_, int_, int_);  // the session owns its end
  if (server) {
    SSL_set_accept_state(ssl_);
  } else {
    SSL_set_connect_state(ssl_);
  }
}

TlsStream::~TlsStream() {
  SSL_free(ssl_);
  BIO_free(ext_);
}

ssize_t TlsStream::pull(int fd, bool* drained) {
  if (established_) return rs_.pull(fd, drained);
  char* p = nullptr;
  const int room = BIO_nwrite0(ext_, &p);
  if (room <= 0) return 0;
  const ssize_t r = ::read(fd, p, static_cast<size_t>(room));
  if (drained) *drained = r < room;
  if (r > 0) {
    BIO_nwrite(ext_, &p, static_cast<int>(r));
    return r;
  }
  if (r < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
  if (r == 0) errno = 0;
  return -1;
}

int TlsStream::push(int fd) {
  if (established_) return rs_.push(fd);
  for (;;) {
    char* p = nullptr;
    const int n = BIO_nread0(ext_, &p);
    if (n <= 0) return 1;
    const ssize_t w = ::send(fd, p, static_cast<size_t>(n), MSG_NOSIGNAL);
    if (w < 0) return errno == EAGAIN || errno == EINTR ? 0 : -1;
    BIO_nread(ext_, &p, static_cast<int>(w));
    sent_ += static_cast<uint64_t>(w);
    if (w < n) return 0;
  }
}

bool TlsStream::out_pending() const {
  return established_ ? rs_.out_pending() : BIO_ctrl_pending(ext_) > 0;
}

uint64_t TlsStream::produced() const {
  return established_ ? produced_ + rs_.produced() : BIO_number_written(int_);
}

uint64_t TlsStream::sent() const { return sent_ + rs_.sent(); }

int TlsStream::handshake(std::string& why) {
  if (established_) return 1;
  ERR_clear_error();
  const int r = SSL_do_handshake(ssl_);
  if (r == 1) {
    if (!take_over(why)) return -1;
    established_ = true;
    peer_name_ = cn_of(SSL_get0_peer_certificate(ssl_));
    peer_fingerprint_ = fingerprint_of(SSL_get0_peer_certificate(ssl_));
    cipher_ = SSL_get_cipher_name(ssl_);
    return 1;
  }
  const int e = SSL_get_error(ssl_, r);
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) return 0;
  const long v = SSL_get_verify_result(ssl_);
  why = v != X509_V_OK ? fmt::format("certificate: {}", X509_verify_cert_error_string(v))
                       : tls_errors();
  return -1;
}

bool TlsStream::take_over(std::string& why) {
  const uint16_t suite = SSL_CIPHER_get_protocol_id(SSL_get_current_cipher(ssl_));
  const bool server = SSL_is_server(ssl_) == 1;
  const bool keys = rs_.start(suite, server ? server_secret_ : client_secret_,
                              server ? client_secret_ : server_secret_, kBufBytes);
  for (std::vector<uint8_t>* s : {&client_secret_, &server_secret_}) {
    if (!s->empty()) OPENSSL_cleanse(s->data(), s->size());
    s->clear();
  }
  if (!keys) {
    why = fmt::format("no traffic keys for {} from OpenSSL", SSL_get_cipher_name(ssl_));
    return false;
  }
  if (SSL_has_pending(ssl_) == 1) {
    why = "data inside the TLS session right after the handshake";
    return false;
  }
  // What the handshake wrote that has not gone to the socket yet, and what we read after it
  // (each at most a pair's direction, within the buffers).
  char* p = nullptr;
  for (int n; (n = BIO_nread0(ext_, &p)) > 0; BIO_nread(ext_, &p, n))
    rs_.add_out({reinterpret_cast<const uint8_t*>(p), static_cast<size_t>(n)});
  std::vector<uint8_t> rest(BIO_ctrl_pending(int_));
  if (!rest.empty()) {
    const int got = BIO_read(int_, rest.data(), static_cast<int>(rest.size()));
    rs_.add_in({rest.data(), got > 0 ? static_cast<size_t>(got) : 0});
  }
  produced_ = BIO_number_written(int_);
  return true;
}

ssize_t TlsStream::read(void* p, size_t n, std::string& why) {
  return established_ ? rs_.read(p, n, why) : 0;
}

bool TlsStream::has_buffered() const {
  if (!established_) return SSL_has_pending(ssl_) == 1 || BIO_ctrl_pending(int_) > 0;
  return rs_.has_buffered();
}

ssize_t TlsStream::write(const void* p, size_t n, std::string& why, uintptr_t* fault) {
  return established_ ? rs_.write(p, n, why, fault) : 0;
}

std::string cert_file_fingerprint(const std::string& pem_file) {
  FILE* f = std::fopen(pem_file.c_str(), "r");
  if (!f) return {};
  X509* x = PEM_read_X509(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  std::string out = fingerprint_of(x);
  X509_free(x);
  return out;
}

}  // namespace vrdma::transport::tcp
