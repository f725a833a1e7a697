// A stranger at a library's direct-path port (the hub, src/verbs/remote.cc), for direct_hub.sh:
// the attacks that need TLS with an external PSK, which Python's ssl module cannot do.
//
//   hub_tls_attacker plain HOST PORT TO_QPN FROM_QPN
//       A hello of the previous, plain-TCP protocol (version 3: magic, version, the real QPN
//       pair, a token) straight on the socket. The hub must close it unread and unanswered.
//       Prints "closed unanswered".
//   hub_tls_attacker psk HOST PORT TO_QPN FROM_QPN
//       TLS 1.3 naming the real QPN pair as its PSK identity, with a key that is not the pair's.
//       The handshake must fail. Prints "handshake failed: REASON".
// Exit status: 0 the hub refused as it must, 1 it did not, 2 a usage or local error.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "verbs/remote.h"

namespace {

using namespace vrdma::proto::dwire;

[[noreturn]] void die(int rc, const std::string& what) {
  std::fprintf(stderr, "hub_tls_attacker: %s\n", what.c_str());
  std::exit(rc);
}

/// A blocking TCP connection to HOST:PORT whose reads give up after a second.
int connect_to(const char* host, const char* port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::atoi(port)));
  if (::inet_pton(AF_INET, host, &a.sin_addr) != 1) die(2, std::string("not an address: ") + host);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0)
    die(2, std::string("connect: ") + std::strerror(errno));
  timeval tv{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

int plain(int fd, uint32_t to_qpn, uint32_t from_qpn) {
  struct {
    uint32_t magic, version, from_qpn, to_qpn, from_lid, flags;
    uint8_t token[16];
  } h{kDirectMagic, 3, from_qpn, to_qpn, 0, kTakesRequests, {}};
  RAND_bytes(h.token, sizeof(h.token));
  if (::send(fd, &h, sizeof(h), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(h)))
    die(2, std::string("send: ") + std::strerror(errno));
  uint8_t b[64];
  const ssize_t r = ::recv(fd, b, sizeof(b), 0);
  if (r > 0) die(1, "answered a plain hello with " + std::to_string(r) + " bytes");
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
    die(1, "still open 1 s after a plain hello");
  std::puts("closed unanswered");
  return 0;
}

PskIdentity g_id;
unsigned char g_key[kPskBytes];

int use_psk(SSL* s, const EVP_MD*, const unsigned char** id, size_t* idlen, SSL_SESSION** sess) {
  *sess = SSL_SESSION_new();
  SSL_SESSION_set1_master_key(*sess, g_key, sizeof(g_key));
  SSL_SESSION_set_cipher(*sess, SSL_CIPHER_find(s, kTlsCipher));
  SSL_SESSION_set_protocol_version(*sess, TLS1_3_VERSION);
  *id = reinterpret_cast<const unsigned char*>(&g_id);
  *idlen = sizeof(g_id);
  return 1;
}

int psk(int fd, uint32_t to_qpn, uint32_t from_qpn) {
  g_id = PskIdentity{kDirectMagic, kDirectVersion, from_qpn, to_qpn};
  RAND_bytes(g_key, sizeof(g_key));  // not derived from the offer's token: the attacker lacks it
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (!ctx || SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_ciphersuites(ctx, "TLS_AES_128_GCM_SHA256") != 1)
    die(2, "no TLS context");
  SSL_CTX_set_psk_use_session_callback(ctx, use_psk);
  SSL* s = SSL_new(ctx);
  SSL_set_fd(s, fd);
  if (SSL_connect(s) == 1) die(1, "the hub completed a handshake with a wrong key");
  const unsigned long e = ERR_get_error();
  const char* why = e ? ERR_reason_error_string(e) : "closed";
  std::printf("handshake failed: %s\n", why ? why : "?");
  SSL_free(s);
  SSL_CTX_free(ctx);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) die(2, "usage: hub_tls_attacker plain|psk HOST PORT TO_QPN FROM_QPN");
  const std::string mode = argv[1];
  const auto to_qpn = static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 0));
  const auto from_qpn = static_cast<uint32_t>(std::strtoul(argv[5], nullptr, 0));
  const int fd = connect_to(argv[2], argv[3]);
  if (mode == "plain") return plain(fd, to_qpn, from_qpn);
  if (mode == "psk") return psk(fd, to_qpn, from_qpn);
  die(2, "unknown mode " + mode);
}
