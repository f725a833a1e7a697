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
constexpr size_t kBufBytes = 256 * 1024 + kTlsMaxRecord;
/// Records sealed with one key before a KeyUpdate: AES-GCM's limit with TLS 1.3's safety
/// margin is 2^24.5 full records (RFC 8446, 5.5); the same for every suite, for simplicity.
constexpr uint64_t kRecordsPerKey = uint64_t{1} << 24;
/// A KeyUpdate message (RFC 8446, 4.6.3): type 24, length 1, update_not_requested.
constexpr uint8_t kKeyUpdate[] = {24, 0, 0, 1, 0};

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
    std::vector<uint8_t>* to = nullptr;
    if (!s) return;
    if (std::strncmp(line, "CLIENT_TRAFFIC_SECRET_0 ", 24) == 0) to = &s->client_secret_;
    if (std::strncmp(line, "SERVER_TRAFFIC_SECRET_0 ", 24) == 0) to = &s->server_secret_;
    if (!to) return;
    to->clear();
    for (const char* h = std::strrchr(line, ' ') + 1; h[0] && h[1]; h += 2) {
      const char b[3] = {h[0], h[1], 0};
      to->push_back(static_cast<uint8_t>(std::strtoul(b, nullptr, 16)));
    }
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
  if (!in_.empty()) OPENSSL_cleanse(in_.data(), in_.size());  // plaintext opened in place
}

ssize_t TlsStream::pull(int fd, bool* drained) {
  if (established_) {
    // Room at the end: records opened and read are dropped from the front first.
    const bool plain = plain_pos_ < plain_end_;
    const size_t keep = plain ? plain_pos_ : in_head_;
    if (!plain && in_head_ == in_tail_) {
      in_head_ = in_tail_ = 0;
    } else if (keep > 0 && in_.size() - in_tail_ < kTlsMaxRecord) {
      std::memmove(in_.data(), in_.data() + keep, in_tail_ - keep);
      in_head_ -= keep;
      in_tail_ -= keep;
      if (plain) plain_pos_ -= keep, plain_end_ -= keep;
    }
    const size_t room = in_.size() - in_tail_;
    if (room == 0) return 0;
    const ssize_t r = ::read(fd, in_.data() + in_tail_, room);
    if (drained) *drained = r < static_cast<ssize_t>(room);
    if (r > 0) {
      in_tail_ += static_cast<size_t>(r);
      return r;
    }
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (r == 0) errno = 0;
    return -1;
  }
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
  if (established_) {
    const size_t n = out_tail_ - out_head_;
    if (n == 0) return 1;
    const ssize_t w = ::send(fd, out_.data() + out_head_, n, MSG_NOSIGNAL);
    if (w < 0) return errno == EAGAIN || errno == EINTR ? 0 : -1;
    out_head_ += static_cast<size_t>(w);
    sent_ += static_cast<uint64_t>(w);
    if (static_cast<size_t>(w) < n) return 0;  // the socket is full: the next would say EAGAIN
    out_head_ = out_tail_ = 0;
    return 1;
  }
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
  return established_ ? out_tail_ > out_head_ : BIO_ctrl_pending(ext_) > 0;
}

uint64_t TlsStream::produced() const { return established_ ? produced_ : BIO_number_written(int_); }

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
  const bool keys = tx_.init(suite, server ? server_secret_ : client_secret_, true) &&
                    rx_.init(suite, server ? client_secret_ : server_secret_, false);
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
  out_.resize(kBufBytes);
  in_.resize(kBufBytes);
  // What the handshake wrote that has not gone to the socket yet, and what we read after it.
  char* p = nullptr;
  for (int n; (n = BIO_nread0(ext_, &p)) > 0; BIO_nread(ext_, &p, n)) {
    std::memcpy(out_.data() + out_tail_, p, static_cast<size_t>(n));
    out_tail_ += static_cast<size_t>(n);
  }
  const size_t rest = BIO_ctrl_pending(int_);
  if (rest > 0) in_tail_ = static_cast<size_t>(BIO_read(int_, in_.data(), static_cast<int>(rest)));
  produced_ = BIO_number_written(int_);
  return true;
}

ssize_t TlsStream::open_head(uint8_t* to, size_t room, std::string& why) {
  const size_t have = in_tail_ - in_head_;
  if (have < kTlsHeader) return -2;
  uint8_t* rec = in_.data() + in_head_;
  const size_t len = size_t{rec[3]} << 8 | rec[4];
  if (rec[0] != kTlsAppData || rec[1] != 3 || rec[2] != 3 || len < 1 + kTlsTag ||
      kTlsHeader + len > kTlsMaxRecord) {
    why = "a record failed its check (forged or altered): a malformed header";
    return -1;
  }
  if (have < kTlsHeader + len) return -2;
  const size_t body = len - kTlsTag;
  const bool direct = body <= room;  // else opened in place, and read from there
  uint8_t* out = direct ? to : rec + kTlsHeader;
  uint8_t type = 0;
  const ssize_t r = rx_.open(rec, kTlsHeader + len, out, type);
  in_head_ += kTlsHeader + len;
  if (r < 0) {
    std::memset(out, 0, body);  // nothing of a forged record is left behind
    why = "a record failed its check (forged or altered)";
    return -1;
  }
  if (type == kTlsAppData) {
    if (direct) return r;
    plain_pos_ = static_cast<size_t>(out - in_.data());
    plain_end_ = plain_pos_ + static_cast<size_t>(r);
    return 0;
  }
  if (type == kTlsHandshake && r == sizeof(kKeyUpdate) &&
      std::memcmp(out, kKeyUpdate, sizeof(kKeyUpdate) - 1) == 0 && out[4] <= 1) {
    update_due_ |= out[4] == 1;  // update_requested: we answer with our own
    if (rx_.update()) return 0;
    why = "TLS: cannot derive the next keys: " + tls_errors();
    return -1;
  }
  why = type == kTlsAlert ? "the peer closed its TLS session"
                          : fmt::format("an unexpected TLS record (type {})", type);
  return -1;
}

ssize_t TlsStream::read(void* p, size_t n, std::string& why) {
  if (!established_) return 0;
  auto* dst = static_cast<uint8_t*>(p);
  size_t got = 0;
  while (got < n) {
    if (plain_pos_ < plain_end_) {
      const size_t k = std::min(n - got, plain_end_ - plain_pos_);
      std::memcpy(dst + got, in_.data() + plain_pos_, k);
      got += k;
      plain_pos_ += k;
      continue;
    }
    plain_pos_ = plain_end_ = 0;
    const ssize_t r = open_head(dst + got, n - got, why);
    if (r == -2) break;
    if (r < 0) return -1;
    got += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(got);
}

bool TlsStream::has_buffered() const {
  if (!established_) return SSL_has_pending(ssl_) == 1 || BIO_ctrl_pending(int_) > 0;
  if (plain_pos_ < plain_end_) return true;
  const size_t have = in_tail_ - in_head_;
  if (have < kTlsHeader) return false;
  const uint8_t* h = in_.data() + in_head_;
  return have >= kTlsHeader + (size_t{h[3]} << 8 | h[4]);
}

bool TlsStream::out_room() {
  if (out_head_ == out_tail_) {
    out_head_ = out_tail_ = 0;
  } else if (out_.size() - out_tail_ < kTlsMaxRecord && out_head_ > 0) {
    std::memmove(out_.data(), out_.data() + out_head_, out_tail_ - out_head_);
    out_tail_ -= out_head_;
    out_head_ = 0;
  }
  return out_.size() - out_tail_ >= kTlsMaxRecord;
}

ssize_t TlsStream::write(const void* p, size_t n, std::string& why, uintptr_t* fault) {
  if (!established_) return 0;
  if ((update_due_ || tx_.seq() >= kRecordsPerKey) && out_room()) {
    const size_t w = tx_.seal(kTlsHandshake, kKeyUpdate, sizeof(kKeyUpdate), &out_[out_tail_]);
    out_tail_ += w;
    produced_ += w;
    update_due_ = false;
    if (!tx_.update()) {
      why = "cannot derive the next keys: " + tls_errors();
      return -1;
    }
  }
  const auto* src = static_cast<const uint8_t*>(p);
  size_t took = 0;
  while (took < n && out_room()) {
    const size_t k = std::min(n - took, kTlsMaxPlain);
    size_t w = 0;
    if (!fault) {
      w = tx_.seal(kTlsAppData, src + took, k, &out_[out_tail_]);
    } else {
      // Sealed from guest memory, no copy first. A fault leaves the record half done, under
      // the sequence number it had (counted only at its end); sealed again from zeros, the
      // nonce still goes on the wire once: the first try never leaves this buffer.
      struct Job {
        RecordCipher* c;
        const uint8_t* p;
        size_t n;
        uint8_t* out;
        size_t w;
      } job{&tx_, src + took, k, &out_[out_tail_], 0};
      uintptr_t at = 0;
      if (!run_guarded(
              [](void* a) {
                auto* j = static_cast<Job*>(a);
                j->w = j->c->seal(kTlsAppData, j->p, j->n, j->out);
              },
              &job, at)) {
        static const uint8_t kZeros[kTlsMaxPlain] = {};
        *fault = at;
        job.w = tx_.seal(kTlsAppData, kZeros, k, &out_[out_tail_]);
      }
      w = job.w;
    }
    out_tail_ += w;
    produced_ += w;
    took += k;
  }
  return static_cast<ssize_t>(took);
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
