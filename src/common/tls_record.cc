#include "common/tls_record.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>

#include <intel-ipsec-mb.h>

#include <endian.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/guest_fault.h"

namespace vrdma::tls {

namespace {

struct Suite {
  uint16_t id;
  const char* digest;
  const EVP_CIPHER* (*cipher)();
  size_t key;
  bool gcm;  ///< AES-GCM: sealed and opened through Intel's ipsec-mb (RecordCipher::Gcm)
};
const Suite kSuites[] = {
    {0x1301, "SHA256", EVP_aes_128_gcm, 16, true},
    {0x1302, "SHA384", EVP_aes_256_gcm, 32, true},
    {0x1303, "SHA256", EVP_chacha20_poly1305, 32, false},
};

/// Records of less plaintext than this are gathered into place before they are sealed.
constexpr size_t kGatherBelow = 512;

/// ipsec-mb's functions for this CPU (chosen once, read-only after): null when it has none.
const IMB_MGR* gcm_lib() {
  static const IMB_MGR* const m = [] {
    IMB_MGR* r = alloc_mb_mgr(0);
    if (r) init_mb_mgr_auto(r, nullptr);
    return r;
  }();
  return m;
}

const Suite* suite_of(uint16_t id) {
  for (const Suite& s : kSuites)
    if (s.id == id) return &s;
  return nullptr;
}

/// HKDF-Expand-Label(secret, label, "", n) (RFC 8446, 7.1).
bool expand_label(const char* digest, std::span<const uint8_t> secret, const char* label,
                  uint8_t* out, size_t n) {
  uint8_t info[2 + 1 + 255 + 1];
  const size_t ll = 6 + std::strlen(label);
  info[0] = static_cast<uint8_t>(n >> 8);
  info[1] = static_cast<uint8_t>(n);
  info[2] = static_cast<uint8_t>(ll);
  std::memcpy(info + 3, "tls13 ", 6);
  std::memcpy(info + 9, label, ll - 6);
  info[3 + ll] = 0;  // no context
  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, "HKDF", nullptr);
  EVP_KDF_CTX* kctx = kdf ? EVP_KDF_CTX_new(kdf) : nullptr;
  EVP_KDF_free(kdf);
  if (!kctx) return false;
  int mode = EVP_KDF_HKDF_MODE_EXPAND_ONLY;
  const OSSL_PARAM params[] = {
      OSSL_PARAM_construct_int(OSSL_KDF_PARAM_MODE, &mode),
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, const_cast<char*>(digest), 0),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<uint8_t*>(secret.data()),
                                        secret.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, info, 4 + ll),
      OSSL_PARAM_construct_end()};
  const bool ok = EVP_KDF_derive(kctx, out, n, params) == 1;
  EVP_KDF_CTX_free(kctx);
  return ok;
}

}  // namespace

/// ipsec-mb's AES-GCM with the key of this generation (its round keys and GHASH powers).
struct RecordCipher::Gcm {
  gcm_key_data key;
  aes_gcm_enc_dec_t whole;  ///< a record in one call: encrypt or decrypt, as the direction is
  aes_gcm_init_t init;      ///< and in pieces (sealing only)
  aes_gcm_enc_dec_update_t update;
  aes_gcm_enc_dec_finalize_t finalize;
};

void RecordCipher::GcmFree::operator()(Gcm* g) const {
  OPENSSL_cleanse(g, sizeof(*g));
  delete g;
}

RecordCipher::~RecordCipher() {
  EVP_CIPHER_CTX_free(ctx_);
  OPENSSL_cleanse(key_, sizeof(key_));
  if (!secret_.empty()) OPENSSL_cleanse(secret_.data(), secret_.size());
}

bool RecordCipher::init(uint16_t suite, std::span<const uint8_t> secret, bool seal) {
  if (!suite_of(suite) || secret.empty()) return false;
  suite_ = suite;
  seal_ = seal;
  secret_.assign(secret.begin(), secret.end());
  return derive();
}

bool RecordCipher::update() {
  const Suite& s = *suite_of(suite_);
  std::vector<uint8_t> next(secret_.size());
  if (!expand_label(s.digest, secret_, "traffic upd", next.data(), next.size())) return false;
  OPENSSL_cleanse(secret_.data(), secret_.size());
  secret_ = std::move(next);
  return derive();
}

bool RecordCipher::derive() {
  const Suite& s = *suite_of(suite_);
  if (!expand_label(s.digest, secret_, "key", key_, s.key) ||
      !expand_label(s.digest, secret_, "iv", iv_, sizeof(iv_)))
    return false;
  seq_ = 0;
  EVP_CIPHER_CTX_free(ctx_);
  ctx_ = nullptr;
  gcm_.reset();
  if (const IMB_MGR* m = gcm_lib(); s.gcm && m) {
    const bool k128 = s.key == 16;
    gcm_.reset(new Gcm{});
    Gcm& g = *gcm_;
    g.whole = seal_ ? (k128 ? m->gcm128_enc : m->gcm256_enc)
                    : (k128 ? m->gcm128_dec : m->gcm256_dec);
    g.init = k128 ? m->gcm128_init : m->gcm256_init;
    g.update = k128 ? m->gcm128_enc_update : m->gcm256_enc_update;
    g.finalize = k128 ? m->gcm128_enc_finalize : m->gcm256_enc_finalize;
    (k128 ? m->gcm128_pre : m->gcm256_pre)(key_, &g.key);
    OPENSSL_cleanse(key_, sizeof(key_));
    return true;
  }
  // The key is set once; each record sets only its nonce.
  ctx_ = EVP_CIPHER_CTX_new();
  const int ok = !ctx_                                                          ? 0
                 : seal_ ? EVP_EncryptInit_ex(ctx_, s.cipher(), nullptr, key_, nullptr)
                         : EVP_DecryptInit_ex(ctx_, s.cipher(), nullptr, key_, nullptr);
  OPENSSL_cleanse(key_, sizeof(key_));
  if (ok != 1) {
    EVP_CIPHER_CTX_free(ctx_);
    ctx_ = nullptr;
  }
  return ctx_ != nullptr;
}

void RecordCipher::nonce(uint8_t* out) const {
  // RFC 8446 5.3: the IV XOR the record's sequence number, big-endian in its last 8 bytes.
  uint64_t tail;
  std::memcpy(out, iv_, 4);
  std::memcpy(&tail, iv_ + 4, 8);
  tail ^= htobe64(seq_);
  std::memcpy(out + 4, &tail, 8);
}

size_t RecordCipher::seal(uint8_t type, const uint8_t* p, size_t n, uint8_t* out) {
  const iovec one{const_cast<uint8_t*>(p), n};
  return seal(type, std::span<const iovec>(&one, 1), out);
}

size_t RecordCipher::seal(uint8_t type, std::span<const iovec> pieces, uint8_t* out) {
  size_t n = 0;
  for (const iovec& v : pieces) n += v.iov_len;
  const size_t len = n + 1 + kTlsTag;
  out[0] = kTlsAppData;  // the outer type of every protected record
  out[1] = 3;
  out[2] = 3;
  out[3] = static_cast<uint8_t>(len >> 8);
  out[4] = static_cast<uint8_t>(len);
  uint8_t iv[12];
  nonce(iv);
  if (gcm_) {
    Gcm& g = *gcm_;
    gcm_context_data cx;
    uint8_t* at = out + kTlsHeader;
    if (n < kGatherBelow) {
      // A small record (a frame's header, its payload, the type) is gathered into place and
      // sealed there in one call: each of ipsec-mb's calls costs ~100-150 instructions of its own.
      for (const iovec& v : pieces) {
        if (v.iov_len) std::memcpy(at, v.iov_base, v.iov_len);
        at += v.iov_len;
      }
      *at = type;
      g.whole(&g.key, &cx, out + kTlsHeader, out + kTlsHeader, n + 1, iv, out, kTlsHeader, at + 1,
              kTlsTag);
    } else {
      // Sealed piece by piece into place: ipsec-mb carries a partial block across updates.
      g.init(&g.key, &cx, iv, out, kTlsHeader);
      for (const iovec& v : pieces) {
        if (!v.iov_len) continue;
        g.update(&g.key, &cx, at, static_cast<const uint8_t*>(v.iov_base), v.iov_len);
        at += v.iov_len;
      }
      g.update(&g.key, &cx, at, &type, 1);
      g.finalize(&g.key, &cx, at + 1, kTlsTag);
    }
    // (`cx` is not wiped: what it holds of the key, g.key holds for the connection's life.)
    ++seq_;
    return kTlsHeader + len;
  }
  int l = 0;
  uint8_t* at = out + kTlsHeader;
  // Sealing into our own buffer with a key already set cannot fail but on a broken library.
  EVP_EncryptInit_ex(ctx_, nullptr, nullptr, nullptr, iv);
  EVP_EncryptUpdate(ctx_, nullptr, &l, out, kTlsHeader);
  for (const iovec& v : pieces) {
    if (!v.iov_len) continue;
    EVP_EncryptUpdate(ctx_, at, &l, static_cast<const uint8_t*>(v.iov_base),
                      static_cast<int>(v.iov_len));
    at += l;
  }
  EVP_EncryptUpdate(ctx_, at, &l, &type, 1);
  at += l;
  EVP_EncryptFinal_ex(ctx_, at, &l);
  at += l;
  EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_GET_TAG, kTlsTag, out + kTlsHeader + n + 1);
  ++seq_;
  return kTlsHeader + len;
}

ssize_t RecordCipher::open(const uint8_t* rec, size_t len, uint8_t* out, uint8_t& type) {
  const size_t body = len - kTlsHeader - kTlsTag;
  uint8_t iv[12], tag[kTlsTag];
  nonce(iv);
  if (gcm_) {
    Gcm& g = *gcm_;
    gcm_context_data cx;
    g.whole(&g.key, &cx, out, rec + kTlsHeader, body, iv, rec, kTlsHeader, tag, kTlsTag);
    if (CRYPTO_memcmp(tag, rec + len - kTlsTag, kTlsTag) != 0) return -1;
  } else {
    std::memcpy(tag, rec + len - kTlsTag, kTlsTag);
    int l = 0;
    if (EVP_DecryptInit_ex(ctx_, nullptr, nullptr, nullptr, iv) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_SET_TAG, kTlsTag, tag) != 1 ||
        EVP_DecryptUpdate(ctx_, nullptr, &l, rec, kTlsHeader) != 1 ||
        EVP_DecryptUpdate(ctx_, out, &l, rec + kTlsHeader, static_cast<int>(body)) != 1 ||
        EVP_DecryptFinal_ex(ctx_, out + body, &l) != 1)
      return -1;
  }
  ++seq_;
  // The inner plaintext: content, its type, zero padding.
  size_t n = body;
  while (n > 0 && out[n - 1] == 0) --n;
  if (n == 0) return -1;
  type = out[n - 1];
  return static_cast<ssize_t>(n - 1);
}

// ---- RecordStream ----

namespace {

/// Records sealed with one key before a KeyUpdate: AES-GCM's limit with TLS 1.3's safety
/// margin is 2^24.5 full records (RFC 8446, 5.5); the same for every suite, for simplicity.
constexpr uint64_t kRecordsPerKey = uint64_t{1} << 24;
/// A KeyUpdate message (RFC 8446, 4.6.3): type 24, length 1, update_not_requested.
constexpr uint8_t kKeyUpdate[] = {24, 0, 0, 1, 0};

}  // namespace

RecordStream::~RecordStream() {
  if (!in_.empty()) OPENSSL_cleanse(in_.data(), in_.size());  // plaintext opened in place
}

bool RecordStream::start(uint16_t suite, std::span<const uint8_t> tx_secret,
                         std::span<const uint8_t> rx_secret, size_t buf_bytes) {
  if (!tx_.init(suite, tx_secret, true) || !rx_.init(suite, rx_secret, false)) return false;
  buf_bytes = std::max(buf_bytes, 2 * kTlsMaxRecord);
  out_.resize(buf_bytes);
  in_.resize(buf_bytes);
  return true;
}

bool RecordStream::add_out(std::span<const uint8_t> c) {
  if (c.size() > out_.size() - out_tail_) return false;
  std::memcpy(out_.data() + out_tail_, c.data(), c.size());
  out_tail_ += c.size();
  return true;
}

bool RecordStream::add_in(std::span<const uint8_t> c) {
  if (c.size() > in_.size() - in_tail_) return false;
  std::memcpy(in_.data() + in_tail_, c.data(), c.size());
  in_tail_ += c.size();
  return true;
}

ssize_t RecordStream::pull(int fd, bool* drained, size_t max) {
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
  const size_t room = std::min(in_.size() - in_tail_, max);
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

int RecordStream::push(int fd) {
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

ssize_t RecordStream::open_head(uint8_t* to, size_t room, std::string& why) {
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
  const bool direct = to && body <= room;  // else opened in place, and read from there
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
    if (out[4] == 1) update_due_.store(true);  // update_requested: we answer with our own
    if (rx_.update()) return 0;
    why = "TLS: cannot derive the next keys";
    return -1;
  }
  why = type == kTlsAlert ? "the peer closed its TLS session"
                          : "an unexpected TLS record (type " + std::to_string(type) + ")";
  return -1;
}

ssize_t RecordStream::read(void* p, size_t n, std::string& why, bool p_is_ours) {
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
    const ssize_t r = open_head(p_is_ours ? dst + got : nullptr, n - got, why);
    if (r == -2) break;
    if (r < 0) return -1;
    got += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(got);
}

size_t RecordStream::record_need() const {
  const size_t have = in_tail_ - in_head_;
  if (have < kTlsHeader) return kTlsHeader - have;
  const uint8_t* h = in_.data() + in_head_;
  const size_t whole = kTlsHeader + (size_t{h[3]} << 8 | h[4]);
  return have >= whole ? 0 : whole - have;
}

bool RecordStream::has_buffered() const {
  if (plain_pos_ < plain_end_) return true;
  const size_t have = in_tail_ - in_head_;
  if (have < kTlsHeader) return false;
  const uint8_t* h = in_.data() + in_head_;
  return have >= kTlsHeader + (size_t{h[3]} << 8 | h[4]);
}

bool RecordStream::out_room() {
  if (out_head_ == out_tail_) {
    out_head_ = out_tail_ = 0;
  } else if (out_.size() - out_tail_ < kTlsMaxRecord && out_head_ > 0) {
    std::memmove(out_.data(), out_.data() + out_head_, out_tail_ - out_head_);
    out_tail_ -= out_head_;
    out_head_ = 0;
  }
  return out_.size() - out_tail_ >= kTlsMaxRecord;
}

bool RecordStream::maybe_update(std::string& why) {
  if ((!update_due_.load(std::memory_order_relaxed) && tx_.seq() < kRecordsPerKey) || !out_room())
    return true;
  const size_t w = tx_.seal(kTlsHandshake, kKeyUpdate, sizeof(kKeyUpdate), &out_[out_tail_]);
  out_tail_ += w;
  produced_ += w;
  update_due_.store(false, std::memory_order_relaxed);
  if (tx_.update()) return true;
  why = "cannot derive the next keys";
  return false;
}

ssize_t RecordStream::write(const void* p, size_t n, std::string& why, uintptr_t* fault) {
  if (!fault) {
    const iovec one{const_cast<void*>(p), n};
    return write(&one, 1, 0, why);
  }
  if (!maybe_update(why)) return -1;
  const auto* src = static_cast<const uint8_t*>(p);
  size_t took = 0;
  while (took < n && out_room()) {
    const size_t k = std::min(n - took, kTlsMaxPlain);
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
    out_tail_ += job.w;
    produced_ += job.w;
    took += k;
  }
  return static_cast<ssize_t>(took);
}

ssize_t RecordStream::write(const iovec* iov, size_t n, size_t skip, std::string& why) {
  if (!maybe_update(why)) return -1;
  size_t i = 0, took = 0;
  while (i < n && skip >= iov[i].iov_len) skip -= iov[i++].iov_len;
  while (i < n && out_room()) {
    // One record: up to kTlsMaxPlain bytes from as many pieces as that spans.
    iovec pieces[16];
    size_t np = 0, len = 0;
    while (i < n && len < kTlsMaxPlain && np < std::size(pieces)) {
      const size_t k = std::min(iov[i].iov_len - skip, kTlsMaxPlain - len);
      pieces[np++] = iovec{static_cast<uint8_t*>(iov[i].iov_base) + skip, k};
      len += k;
      skip += k;
      if (skip == iov[i].iov_len) ++i, skip = 0;
    }
    const size_t w = tx_.seal(kTlsAppData, std::span<const iovec>(pieces, np), &out_[out_tail_]);
    out_tail_ += w;
    produced_ += w;
    took += len;
  }
  return static_cast<ssize_t>(took);
}

void take_traffic_secret(const char* line, std::vector<uint8_t>& client,
                         std::vector<uint8_t>& server) {
  std::vector<uint8_t>* to = nullptr;
  if (std::strncmp(line, "CLIENT_TRAFFIC_SECRET_0 ", 24) == 0) to = &client;
  if (std::strncmp(line, "SERVER_TRAFFIC_SECRET_0 ", 24) == 0) to = &server;
  if (!to) return;
  if (!to->empty()) OPENSSL_cleanse(to->data(), to->size());
  to->clear();
  for (const char* h = std::strrchr(line, ' ') + 1; h[0] && h[1]; h += 2) {
    const char b[3] = {h[0], h[1], 0};
    to->push_back(static_cast<uint8_t>(std::strtoul(b, nullptr, 16)));
  }
}

}  // namespace vrdma::tls
