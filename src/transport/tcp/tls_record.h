// The TLS 1.3 record layer (RFC 8446, section 5) that the transport runs itself once OpenSSL has
// finished the handshake, as kernel TLS would: the same records, keys, nonces and key updates,
// but sealed straight into the transport's send buffer and opened straight into its read
// buffer, a syscall carrying many records. OpenSSL 3.0's own record layer copies each record
// twice more (docs/ARCHITECTURE.md, "Trust across hosts"; BENCHMARKS.md, "TLS bandwidth").
// Concurrency: one thread per object.
#pragma once

#include <openssl/types.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace vrdma::transport::tcp {

/// TLS record sizes: header, AEAD tag, most plaintext per record, most a peer may send.
constexpr size_t kTlsHeader = 5;
constexpr size_t kTlsTag = 16;
constexpr size_t kTlsMaxPlain = 16384;
constexpr size_t kTlsMaxRecord = kTlsHeader + kTlsMaxPlain + 256;
/// Inner content types (RFC 8446, 5.1).
constexpr uint8_t kTlsAlert = 21;
constexpr uint8_t kTlsHandshake = 22;
constexpr uint8_t kTlsAppData = 23;

/// One direction of a connection: its traffic secret, the key and IV derived from it, and the
/// record sequence number (the nonce: replayed, reordered or dropped records fail to open).
class RecordCipher {
 public:
  RecordCipher() = default;
  ~RecordCipher();
  RecordCipher(const RecordCipher&) = delete;
  RecordCipher& operator=(const RecordCipher&) = delete;

  /// Sets up from a TLS 1.3 traffic secret for `suite` (SSL_CIPHER_get_protocol_id): false
  /// for a suite this layer does not know.
  bool init(uint16_t suite, std::span<const uint8_t> secret, bool seal);
  /// The next generation of keys (a KeyUpdate): secret = HKDF-Expand-Label(secret,
  /// "traffic upd"), the sequence back to 0.
  bool update();
  /// Seals n (<= kTlsMaxPlain) bytes of p with inner type `type` into out (room for
  /// kTlsHeader + n + 1 + kTlsTag): the record's size.
  size_t seal(uint8_t type, const uint8_t* p, size_t n, uint8_t* out);
  /// Opens the record rec (header and body, `len` bytes in all) into out (room for its body
  /// less the tag; may be rec + kTlsHeader): the inner plaintext's length with `type` set,
  /// or -1 when it fails its check (nothing of it may be used then).
  ssize_t open(const uint8_t* rec, size_t len, uint8_t* out, uint8_t& type);
  uint64_t seq() const { return seq_; }
  bool ready() const { return ctx_ != nullptr; }

 private:
  bool derive();
  void nonce(uint8_t* out) const;

  EVP_CIPHER_CTX* ctx_ = nullptr;
  uint16_t suite_ = 0;
  bool seal_ = false;
  std::vector<uint8_t> secret_;
  uint8_t key_[32] = {};
  uint8_t iv_[12] = {};
  uint64_t seq_ = 0;
};

}  // namespace vrdma::transport::tcp
