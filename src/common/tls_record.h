// The TLS 1.3 record layer (RFC 8446, section 5) that vrdma runs itself once OpenSSL has finished
// a handshake, as kernel TLS would: the same records, keys, nonces and key updates, but sealed
// straight into a send buffer and opened straight into a read buffer, a syscall carrying many
// records. OpenSSL 3.0's own record layer copies each record twice more and reads a record's
// header and body in separate syscalls (docs/ARCHITECTURE.md, "Trust across hosts";
// BENCHMARKS.md, "TLS bandwidth"). Two users: the backends' transport (transport/tcp/tls.h,
// after a handshake with certificates) and the libraries' direct path across backends
// (verbs/remote_tls.cc, after a handshake with a PSK).
#pragma once

#include <openssl/types.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace vrdma::tls {

/// TLS record sizes: header, AEAD tag, most plaintext per record, most a peer may send.
constexpr size_t kTlsHeader = 5;
constexpr size_t kTlsTag = 16;
constexpr size_t kTlsMaxPlain = 16384;
constexpr size_t kTlsMaxRecord = kTlsHeader + kTlsMaxPlain + 256;
/// The AES-GCM suites are sealed and opened with Intel's ipsec-mb (its VAES/AVX-512 code where
/// the CPU has it, AVX2 or SSE where not), ChaCha20-Poly1305 with OpenSSL's EVP: the same AEAD
/// and the same bytes on the wire as OpenSSL's. On this machine kind (Xeon with VAES) ipsec-mb
/// seals 64 bytes in 0.04 µs and 16 KiB in 0.9, EVP in 0.19 and 2.5: OpenSSL 3.0 has no VAES
/// code, and its EVP layer spends ~3,000 instructions a record looking parameters up by name
/// (docs/ARCHITECTURE.md, "TLS").
/// Inner content types (RFC 8446, 5.1).
constexpr uint8_t kTlsAlert = 21;
constexpr uint8_t kTlsHandshake = 22;
constexpr uint8_t kTlsAppData = 23;

/// One direction of a connection: its traffic secret, the key and IV derived from it, and the
/// record sequence number (the nonce: replayed, reordered or dropped records fail to open).
/// Concurrency: one thread per object.
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
  /// The same for plaintext in pieces (their sum <= kTlsMaxPlain): no gathering copy.
  size_t seal(uint8_t type, std::span<const iovec> pieces, uint8_t* out);
  /// Opens the record rec (header and body, `len` bytes in all) into out (room for its body
  /// less the tag; may be rec + kTlsHeader): the inner plaintext's length with `type` set,
  /// or -1 when it fails its check (nothing of it may be used then).
  ssize_t open(const uint8_t* rec, size_t len, uint8_t* out, uint8_t& type);
  uint64_t seq() const { return seq_; }
  bool ready() const { return ctx_ != nullptr || gcm_ != nullptr; }

 private:
  bool derive();
  void nonce(uint8_t* out) const;

  struct Gcm;  ///< ipsec-mb's key schedule, for the AES-GCM suites (else ctx_, EVP)
  struct GcmFree {
    void operator()(Gcm* g) const;
  };
  EVP_CIPHER_CTX* ctx_ = nullptr;
  std::unique_ptr<Gcm, GcmFree> gcm_;
  uint16_t suite_ = 0;
  bool seal_ = false;
  std::vector<uint8_t> secret_;
  uint8_t key_[32] = {};
  uint8_t iv_[12] = {};
  uint64_t seq_ = 0;
};

/// An established TLS 1.3 session's records on a non-blocking socket: ciphertext to the socket
/// and from it in a buffer each way, many records per syscall; KeyUpdate both ways (ours after
/// 2^24 records, as AES-GCM's limit asks; the peer's whenever it sends one).
/// Concurrency: the sending side (write, push, out_pending, produced, sent) and the receiving
/// side (pull, read, has_buffered) each on one thread at a time; the two may run at once.
class RecordStream {
 public:
  RecordStream() = default;
  ~RecordStream();
  RecordStream(const RecordStream&) = delete;
  RecordStream& operator=(const RecordStream&) = delete;

  /// Starts from the handshake's traffic secrets (`suite` as in RecordCipher::init), with
  /// `buf_bytes` of ciphertext each way (at least two records'; 256 KiB: 16 records a syscall).
  /// False when the suite or the secrets are unusable.
  bool start(uint16_t suite, std::span<const uint8_t> tx_secret,
             std::span<const uint8_t> rx_secret, size_t buf_bytes);
  bool started() const { return tx_.ready(); }
  /// Ciphertext that belongs to the session from before start(): what the handshake wrote and
  /// the socket has not taken yet, and what was read after the handshake's last record.
  /// Each fits in the buffers (false if not).
  bool add_out(std::span<const uint8_t> c);
  bool add_in(std::span<const uint8_t> c);

  /// Reads ciphertext from `fd`, at most `max` bytes: bytes read (> 0), 0 for none now (EAGAIN,
  /// or no room until records are read), -1 when the connection ended (errno set; 0 for EOF).
  /// `drained`: the read got less than it had room for (the socket is empty now).
  ssize_t pull(int fd, bool* drained = nullptr, size_t max = SIZE_MAX);
  /// The ciphertext still missing for the record at the head (its header's first), 0 when it
  /// is all there: what a reader that must take nothing past one record pulls (a hello).
  size_t record_need() const;
  /// Writes pending ciphertext to `fd`: 1 all written, 0 some left (EAGAIN), -1 failed (errno).
  int push(int fd);
  bool out_pending() const { return out_tail_ > out_head_; }
  /// Ciphertext sealed so far, and written to the socket so far.
  uint64_t produced() const { return produced_; }
  uint64_t sent() const { return sent_; }

  /// Decrypts whole records into p: bytes (> 0), 0 when a whole record is not there yet, -1 on
  /// a forged, altered or closing record (`why`; nothing of that record is left in p). With
  /// `p_is_ours` false (p is an application's or a guest's memory) a record is opened in this
  /// stream's buffer and only its checked plaintext copied to p: a forged record's bytes never
  /// reach p, even for the moment before its tag fails.
  ssize_t read(void* p, size_t n, std::string& why, bool p_is_ours = true);
  /// Plaintext that read() can return without more ciphertext.
  bool has_buffered() const;
  /// Encrypts up to n bytes into whole records: the bytes taken (0 while the outgoing buffer
  /// is full: push() first); -1 on an error (`why`). With `fault`, p is guest memory, sealed
  /// straight from there under a fault guard (common/guest_fault.h): a record whose bytes
  /// fault is sent as zeros instead, and *fault is set to the address.
  ssize_t write(const void* p, size_t n, std::string& why, uintptr_t* fault = nullptr);
  /// The same for the bytes of iov past the first `skip`, a record over several pieces where
  /// they are small (a frame's header and its payload in one record).
  ssize_t write(const iovec* iov, size_t n, size_t skip, std::string& why);

 private:
  /// Opens the record at the head of in_: into `to` when its plaintext fits in `room`, else in
  /// place (then read from plain_pos_): the bytes put at `to`, -2 when no whole record is
  /// there, -1 when it fails its check or closes the session (`why`). Takes a KeyUpdate.
  ssize_t open_head(uint8_t* to, size_t room, std::string& why);
  /// Makes room for a record at the end of out_ (moving what is left to the front): false
  /// when there is none (push() first).
  bool out_room();
  /// Before a record: our KeyUpdate, when the peer asked for one or the key has sealed its
  /// share. False on an error (`why`).
  bool maybe_update(std::string& why);

  RecordCipher tx_, rx_;
  std::atomic<bool> update_due_{false};  ///< the peer asked for a KeyUpdate (read sets it)
  uint64_t sent_ = 0, produced_ = 0;
  /// Ciphertext to the socket [out_head_, out_tail_), and from it [in_head_, in_tail_); the
  /// plaintext of a record opened in place but not yet read, [plain_pos_, plain_end_) of in_.
  std::vector<uint8_t> out_, in_;
  size_t out_head_ = 0, out_tail_ = 0, in_head_ = 0, in_tail_ = 0, plain_pos_ = 0, plain_end_ = 0;
};

/// OpenSSL's key log callback line for a TLS 1.3 application traffic secret: into `client` or
/// `server` (CLIENT_TRAFFIC_SECRET_0, SERVER_TRAFFIC_SECRET_0); other lines are left alone.
void take_traffic_secret(const char* line, std::vector<uint8_t>& client,
                         std::vector<uint8_t>& server);

}  // namespace vrdma::tls
