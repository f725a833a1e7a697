// The metrics endpoint: a minimal HTTP/1.x server for `GET /metrics` (Prometheus text format
// 0.0.4), run inside the backend's single event loop with non-blocking sockets. Off unless
// [metrics] enabled = true. A client gets one response and the connection closes; requests are
// bounded (8 KiB of headers), and the oldest client is evicted when too many are open, so slow
// or garbage clients cost a few descriptors and never block the data path. It listens on TCP
// (ADDR:PORT) or on a unix stream socket ("unix:PATH"), where the kernel tells who scrapes
// (SO_PEERCRED), so the caller can render per viewer and file permissions can restrict scrapes.
// Owned by the server thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "common/listener_rest.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace vrdma::backend {

class MetricsHttp {
 public:
  /// Renders the body of a scrape by `uid`: the scraper's uid over a unix socket (SO_PEERCRED),
  /// nullopt over TCP (no credentials).
  using Render = std::function<std::string(std::optional<uint32_t> uid)>;
  static constexpr size_t kMaxRequest = 8192;
  static constexpr size_t kMaxClients = 16;
  static constexpr uint64_t kClientTimeoutNs = 5'000'000'000ull;

  /// `epoll`: the server's epoll set; every fd is registered with `tag | fd` as its data.
  MetricsHttp(int epoll, uint64_t tag, Render render);
  /// Removes the unix socket file it made, if it is still the one it bound.
  ~MetricsHttp();
  MetricsHttp(const MetricsHttp&) = delete;
  MetricsHttp& operator=(const MetricsHttp&) = delete;
  /// Binds and listens on "ADDR:PORT" (IPv4, or [IPv6]) or "unix:PATH". Errors name the address.
  /// unix:PATH: PATH is absolute and its directory is checked as the backend's socket directory
  /// is (open_socket_dir: not a symlink, owned by the euid or root, writable by no one else); a
  /// socket file left there is removed only if nothing listens on it, so the caller must hold
  /// the lock that makes it stale (the backend's `<socket>.lock`); anything else there is an
  /// error. The socket gets `socket_mode` (e.g. 0600, 0660) before it listens.
  Status listen(const std::string& addr, mode_t socket_mode = 0600);
  /// An epoll event for one of our fds (the listener or a client).
  void on_event(int fd, uint32_t events, uint64_t now_ns);
  /// Closes clients that have not finished within kClientTimeoutNs.
  void expire(uint64_t now_ns);
  /// Watches the listener again once a rest (accept out of descriptors) is over.
  void poll(uint64_t now_ns) { rest_.poll(now_ns); }
  /// Nonzero while the listener rests: when the loop must wake to watch it again.
  uint64_t rest_until_ns() const { return rest_.until_ns(); }
  /// accept4 calls so far, and rests for want of descriptors (for tests).
  uint64_t accepts() const { return accepts_; }
  uint64_t rests() const { return rest_.rests(); }
  /// Whether a client is open (the loop must then wake up now and then to expire it).
  bool has_clients() const { return !clients_.empty(); }
  /// The TCP port actually bound (0 on a unix socket).
  int port() const { return port_; }
  /// Where scrapes go, for logs: "http://ADDR:PORT/metrics" or "unix:PATH".
  const std::string& where() const { return where_; }

 private:
  struct Client {
    UniqueFd sock;
    uint64_t since_ns = 0;
    std::string in, out;
    size_t sent = 0;
    std::optional<uint32_t> uid;  ///< SO_PEERCRED, on a unix socket
  };
  Status listen_unix(const std::string& path, mode_t mode);
  /// Adds the bound, listening `fd` to the epoll set as the listener.
  Status watch(UniqueFd fd);
  void accept_all(uint64_t now_ns);
  void on_readable(Client& c);
  void respond(Client& c, int code, const char* reason, const char* type, const std::string& body);
  /// Writes what it can; closes the client when all is sent or on error.
  void flush(int fd);
  void close_client(int fd);

  int epoll_;
  uint64_t tag_;
  Render render_;
  UniqueFd listen_;
  int port_ = 0;
  std::string where_;
  /// unix:PATH: the checked directory, the path, and the inode bound (unlinked only if still it).
  UniqueFd dir_;
  std::string unix_path_;
  dev_t unix_dev_ = 0;
  ino_t unix_ino_ = 0;
  std::map<int, Client> clients_;  ///< by fd
  ListenerRest rest_;              ///< the listener's rest when accept finds no descriptor
  uint64_t accepts_ = 0;
};

}  // namespace vrdma::backend
