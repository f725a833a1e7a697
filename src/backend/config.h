// The backend's configuration: built-in defaults, then a TOML file (`vrdmad --config FILE`),
// then command-line flags. Every key is documented in packaging/vrdmad.toml. A file with an
// unknown key, a wrong type or a value out of range is rejected as a whole, with its line.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/quotas.h"

namespace vrdma::backend {

struct Config {
  // [backend]
  std::string socket_path;       ///< unix socket guests connect to ("" = VRDMA_SOCKET/default)
  int idle_exit_s = 0;           ///< exit after this long with no session; 0: never
  std::string log_level = "info";
  /// A keeper process holds the guests' state, so a backend that dies is replaced without them
  /// noticing more than a pause (backend/keeper.h).
  bool keep_state = false;
  int keep_state_grace_s = 10;  ///< how long the keeper waits for a backend to come back
  /// Connections that have not said Hello, per uid: more are closed at once.
  int max_pending_connections = 64;
  /// How long a connection may stay without saying Hello (or starting an import) before it is
  /// closed.
  int hello_timeout_ms = 5000;
  /// A caller that is not an admin gets the status document from a snapshot at most this many ms
  /// old (rendering it runs on the engine thread, and any local uid may ask, even before Hello);
  /// admins get a fresh one. 0: every request renders.
  int status_min_interval_ms = 100;
  // [datapath]
  int spin_us = 200;             ///< how long to poll idle rings before sleeping
  /// The engine thread's nice value, set at start when the backend may (root, CAP_SYS_NICE or
  /// RLIMIT_NICE). -3: its load weight about two busy-polling guests', so the scheduler's
  /// balancing gives a spinning engine a CPU of its own instead of a guest's time slices
  /// (BENCHMARKS.md, "The engine's nice value"). 0 leaves it alone.
  int nice = -3;
  /// Guests of one uid on this backend may move their bytes themselves (docs/ARCHITECTURE.md,
  /// "Direct path"; on by default, the trust rule below still applies); such guests move, are
  /// snapshotted and kept (keep_state) like the rest.
  bool direct_path = true;
  /// Who may get a direct grant into whose memory (always: one uid). "kernel": a process that
  /// shows it could already write the peer's memory (/proc/PID/mem, by the kernel's ptrace
  /// rules: Yama, LSMs, namespaces). "uid": every two guests of one uid (the operator declares
  /// each uid one tenant).
  std::string direct_trust = "kernel";
  /// Guests the operator declares one tenant, by name: those named in one list trust each other
  /// without a proof (one uid still).
  std::vector<std::vector<std::string>> direct_tenants;
  /// The same across backends: the libraries of an RC QP pair on two backends talk TLS over TCP
  /// to each other, the backends only introduce them. On by default.
  bool direct_remote = true;
  // [quotas] (per guest), and [backend] max_mapped_bytes (quotas.max_mapped_bytes: all guests)
  engine::Quotas quotas;
  // [transport]
  std::string node;              ///< this backend's name among its peers ("" = hostname)
  std::string listen;            ///< "ADDR:PORT" for backend-to-backend TCP; "" = off
  std::vector<std::string> peers;  ///< "ADDR:PORT" of other backends
  std::string force;             ///< "" (choose per peer) or "tcp" (also for same-host pairs)
  /// A peer connection that carried nothing this long and that no QP on either side uses is
  /// closed (by agreement); 0 = never.
  int idle_close_s = 60;
  /// The cluster credential (`vrdma cluster`): DIR/ca.pem, DIR/NODE.pem, DIR/NODE.key; `ca`,
  /// `cert`, `key` name the files one by one instead (or override one of them).
  std::string cluster_dir, tls_ca, tls_cert, tls_key;
  /// Run the TCP transport with no credential on a non-loopback address (anyone who reaches
  /// the port can inject into guests' connections): only when the operator says so.
  bool insecure = false;
  // [directory] (docs/ARCHITECTURE.md, "The directory on etcd")
  /// etcd's client URLs ("http://HOST:PORT", "https://..."): peers and guests are found there
  /// (the static peers are not dialed then). Empty: the embedded directory.
  std::vector<std::string> etcd;
  std::string etcd_ca, etcd_cert, etcd_key;  ///< TLS toward etcd (files; curl's)
  std::string etcd_prefix = "/vrdma/";       ///< the cluster's keys live under it
  int etcd_lease_s = 5;        ///< a backend's entries vanish this long after it stops
  int etcd_timeout_ms = 2000;  ///< one request to etcd
  /// Where peers dial this backend ("ADDR:PORT"); "" = [transport] listen (not a wildcard).
  std::string advertise;
  // [metrics]
  bool metrics_enabled = false;
  std::string metrics_listen = "127.0.0.1:9464";  ///< "ADDR:PORT" or "unix:/PATH"
  /// The mode of a unix:PATH socket (who may connect: whoever may write it, so 0600 or 0660).
  mode_t metrics_socket_mode = 0600;
  /// Scrapes within this many ms of the last rendering get that snapshot (the rendering runs on
  /// the engine thread, and any local uid can scrape).
  int metrics_min_interval_ms = 1000;
  /// Label guests by name (chosen by their users: who runs what) instead of by LID.
  bool metrics_guest_names = false;
  /// Series per QP (`vrdma_qp_*`); off: per guest and backend-wide only.
  bool metrics_per_qp = true;
  /// How this backend was started (absolute program path first): the keeper starts it again.
  std::vector<std::string> self_argv;

  /// Reads a TOML file over the current values. Errors name the file and line.
  Status load_file(const std::string& path);
  /// Reads TOML text (`origin` names it in errors).
  Status load_string(std::string_view text, const std::string& origin);
};

}  // namespace vrdma::backend
