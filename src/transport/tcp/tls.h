// TLS 1.3 between backends (OpenSSL): mutual authentication with a cluster CA, the peer's node
// name bound to its certificate's CN, every byte after the handshake encrypted and integrity
// protected (AES-GCM). Why TLS, and what it costs: docs/ARCHITECTURE.md, "Trust across hosts".
// OpenSSL runs the handshake over a memory BIO pair, not the socket; once it is done the stream
// seals and opens the records itself (common/tls_record.h) in its own buffers, and the transport moves
// ciphertext between those and its non-blocking socket, one read() or send() for many records.
// Concurrency: one thread (the backend's engine thread) per object.
#pragma once

#include <openssl/types.h>
#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tls_record.h"

namespace vrdma::transport::tcp {

/// A node's credential: the cluster CA, its certificate (subject CN = its node name), its key.
struct TlsFiles {
  std::string ca, cert, key;
  /// DIR/ca.pem, DIR/NODE.pem, DIR/NODE.key (what `vrdma cluster add-node NODE` writes).
  static TlsFiles in_dir(const std::string& dir, const std::string& node);
};

class TlsContext {
 public:
  /// Loads and checks the credential of `node`: the key file is a regular file of this uid or
  /// root that no one else may read; the certificate verifies against the CA and names `node`.
  static Result<std::unique_ptr<TlsContext>> load(const TlsFiles& f, const std::string& node);
  ~TlsContext();
  SSL_CTX* get() const { return ctx_; }

 private:
  explicit TlsContext(SSL_CTX* c) : ctx_(c) {}
  SSL_CTX* ctx_;
};

/// One connection's TLS session over a memory BIO pair.
class TlsStream {
 public:
  TlsStream(const TlsContext& ctx, bool server);
  ~TlsStream();
  TlsStream(const TlsStream&) = delete;
  TlsStream& operator=(const TlsStream&) = delete;

  /// Reads ciphertext from `fd` into the session: bytes read (> 0), 0 for none now (EAGAIN, or
  /// no room until the session consumes), -1 when the connection ended (errno set; 0 for EOF).
  /// `drained`: the read got less than it had room for (the socket is empty now).
  ssize_t pull(int fd, bool* drained = nullptr);
  /// Writes pending ciphertext to `fd`: 1 all written, 0 some left (EAGAIN), -1 failed (errno).
  int push(int fd);
  bool out_pending() const;
  /// Ciphertext produced by the session so far, and written to the socket so far.
  uint64_t produced() const;
  uint64_t sent() const;

  /// Advances the handshake: 1 done, 0 more to exchange, -1 failed (`why` says why).
  int handshake(std::string& why);
  bool established() const { return established_; }
  /// The verified peer's certificate CN, and the cipher suite (after the handshake).
  const std::string& peer_name() const { return peer_name_; }
  /// The SHA-256 fingerprint of the verified peer's certificate, "AB:CD:..." (after the
  /// handshake; what the directory on etcd records for each node).
  const std::string& peer_fingerprint() const { return peer_fingerprint_; }
  const std::string& cipher() const { return cipher_; }

  /// Decrypts whole records into p: bytes (> 0), 0 when a whole record is not there yet, -1
  /// on a forged, altered or closing record (`why`; nothing of that record is left in p).
  ssize_t read(void* p, size_t n, std::string& why);
  /// Plaintext that read() can return without more ciphertext.
  bool has_buffered() const;
  /// Encrypts up to n bytes into whole records: the bytes taken (0 while the outgoing buffer is
  /// full: push() first); -1 on an error (`why`). With `fault`, p is guest memory, sealed
  /// straight from there under a fault guard (common/guest_fault.h): a record whose bytes
  /// fault is sent as zeros instead, and *fault is set to the address.
  ssize_t write(const void* p, size_t n, std::string& why, uintptr_t* fault = nullptr);

 private:
  friend struct TlsSecrets;
  /// Hands the connection from OpenSSL's records to ours (after the handshake): the traffic
  /// secrets, and the ciphertext still inside the BIO pair either way.
  bool take_over(std::string& why);

  SSL* ssl_ = nullptr;
  BIO* ext_ = nullptr;  ///< our end of the pair: the handshake's ciphertext to and from the socket
  BIO* int_ = nullptr;  ///< the session's end
  bool established_ = false;
  uint64_t sent_ = 0;      ///< ciphertext sent before the take-over
  uint64_t produced_ = 0;  ///< and produced
  std::string peer_name_, peer_fingerprint_, cipher_;
  /// The traffic secrets OpenSSL reported (its key log callback), until the take-over.
  std::vector<uint8_t> client_secret_, server_secret_;
  tls::RecordStream rs_;  ///< the session's records after the take-over
};

/// The SHA-256 fingerprint of a PEM certificate file, "AB:CD:..." ("" when unreadable).
std::string cert_file_fingerprint(const std::string& pem_file);

/// The queued OpenSSL errors as one line (and clears them).
std::string tls_errors();

}  // namespace vrdma::transport::tcp
