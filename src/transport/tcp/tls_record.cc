#include "transport/tcp/tls_record.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>

#include <cstring>

namespace vrdma::transport::tcp {

namespace {

struct Suite {
  uint16_t id;
  const char* digest;
  const EVP_CIPHER* (*cipher)();
  size_t key;
};
constexpr Suite kSuites[] = {
    {0x1301, "SHA256", EVP_aes_128_gcm, 16},
    {0x1302, "SHA384", EVP_aes_256_gcm, 32},
    {0x1303, "SHA256", EVP_chacha20_poly1305, 32},
};

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
  EVP_CIPHER_CTX_free(ctx_);
  ctx_ = EVP_CIPHER_CTX_new();
  seq_ = 0;
  // The key is set once; each record sets only its nonce.
  const int ok = seal_ ? EVP_EncryptInit_ex(ctx_, s.cipher(), nullptr, key_, nullptr)
                       : EVP_DecryptInit_ex(ctx_, s.cipher(), nullptr, key_, nullptr);
  OPENSSL_cleanse(key_, sizeof(key_));
  if (ok != 1) {
    EVP_CIPHER_CTX_free(ctx_);
    ctx_ = nullptr;
  }
  return ctx_ != nullptr;
}

void RecordCipher::nonce(uint8_t* out) const {
  std::memcpy(out, iv_, sizeof(iv_));
  for (int i = 0; i < 8; ++i) out[4 + i] ^= static_cast<uint8_t>(seq_ >> (56 - 8 * i));
}

size_t RecordCipher::seal(uint8_t type, const uint8_t* p, size_t n, uint8_t* out) {
  const size_t len = n + 1 + kTlsTag;
  out[0] = kTlsAppData;  // the outer type of every protected record
  out[1] = 3;
  out[2] = 3;
  out[3] = static_cast<uint8_t>(len >> 8);
  out[4] = static_cast<uint8_t>(len);
  uint8_t iv[12];
  nonce(iv);
  int l = 0;
  uint8_t* body = out + kTlsHeader;
  // Sealing into our own buffer with a key already set cannot fail but on a broken library.
  EVP_EncryptInit_ex(ctx_, nullptr, nullptr, nullptr, iv);
  EVP_EncryptUpdate(ctx_, nullptr, &l, out, kTlsHeader);
  EVP_EncryptUpdate(ctx_, body, &l, p, static_cast<int>(n));
  EVP_EncryptUpdate(ctx_, body + n, &l, &type, 1);
  EVP_EncryptFinal_ex(ctx_, body + n + 1, &l);
  EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_GET_TAG, kTlsTag, body + n + 1);
  ++seq_;
  return kTlsHeader + len;
}

ssize_t RecordCipher::open(const uint8_t* rec, size_t len, uint8_t* out, uint8_t& type) {
  const size_t body = len - kTlsHeader - kTlsTag;
  uint8_t iv[12], tag[kTlsTag];
  nonce(iv);
  std::memcpy(tag, rec + len - kTlsTag, kTlsTag);
  int l = 0;
  if (EVP_DecryptInit_ex(ctx_, nullptr, nullptr, nullptr, iv) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_SET_TAG, kTlsTag, tag) != 1 ||
      EVP_DecryptUpdate(ctx_, nullptr, &l, rec, kTlsHeader) != 1 ||
      EVP_DecryptUpdate(ctx_, out, &l, rec + kTlsHeader, static_cast<int>(body)) != 1 ||
      EVP_DecryptFinal_ex(ctx_, out + body, &l) != 1)
    return -1;
  ++seq_;
  // The inner plaintext: content, its type, zero padding.
  size_t n = body;
  while (n > 0 && out[n - 1] == 0) --n;
  if (n == 0) return -1;
  type = out[n - 1];
  return static_cast<ssize_t>(n - 1);
}

}  // namespace vrdma::transport::tcp
