// vrdmad's event loop: accepts guest sessions on a unix socket, answers their control
// commands, and drives the device's data path. One thread owns everything; it spins while
// rings are busy and sleeps on epoll (sockets + per-session doorbells) when they are not.
#pragma once

#include <sys/resource.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>

#include "backend/cm.h"
#include "backend/config.h"
#include "backend/metrics_http.h"
#include "backend/report.h"
#include "common/answer_spin.h"
#include "common/listener_rest.h"
#include "common/log.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "directory/etcd_directory.h"
#include "engine/device.h"
#include "transport/tcp/tcp_transport.h"

namespace vrdma::fuzz {
class CommandFuzzer;
}

namespace vrdma::backend {

class Server {
 public:
  explicit Server(Config cfg);
  /// Binds the socket (serialised by a lock file) and runs until a signal or idle exit. When
  /// another backend holds the lock: EALREADY saying which one and how to replace it, or, for a
  /// backend started on demand (set_on_demand), ok without running.
  Status run();
  /// Started by `vrdma run` or the library (vrdmad --on-demand), not by an operator: losing
  /// the socket to another backend is no failure, and the status says so.
  void set_on_demand(bool on) {
    on_demand_ = on;
    reporter_.set_on_demand(on);
  }
  /// Any thread, and async-signal-safe: asks run() to return and wakes it. `sig`: the signal
  /// that asked, for the shutdown line of the log.
  void stop(int sig = 0);

  /// One guest connection (a verbs context); public so log helpers can name it.
  struct Conn {
    UniqueFd sock;
    engine::Session* session = nullptr;
    /// A backend handing us a guest (kImportBegin..kImportCommit): what arrived so far.
    struct Import {
      std::string guest;
      uint64_t bytes = 0;
      uint32_t nfds = 0;
      std::vector<uint8_t> blob;
      std::vector<UniqueFd> fds;
      bool recover = false;  ///< the kept state of a backend that died
      std::string cm;        ///< kImportCm: the guest's RDMA CM state (JSON)
      std::vector<UniqueFd> cm_fds;  ///< kImportCm: its channels' sockets
    };
    std::unique_ptr<Import> import;
    uint32_t uid = UINT32_MAX;       ///< SO_PEERCRED at accept
    uint64_t hello_deadline_ns = 0;  ///< nonzero while it has not said Hello (or begun an import)
  };

 private:
  friend class ::vrdma::fuzz::CommandFuzzer;  ///< tests/fuzz/fuzz_command.cc calls handle()
  Status setup();
  void accept_all();
  /// The connection said Hello or began an import: it no longer counts as pending.
  void leave_pending(Conn& c);
  /// Closes the connections whose Hello deadline has passed.
  void expire_pending(uint64_t now);
  /// accept found no descriptor left: the listener rests (ListenerRest) until a connection
  /// closes or its time is up (it stays readable, and the loop would spin on it).
  void pause_listener(uint64_t now, int err);
  void on_readable(int fd);
  void drop(int fd);
  Status handle(Conn& c, std::vector<uint8_t>& msg, std::vector<UniqueFd>& fds);
  void watch(int fd, uint64_t tag);
  /// The operator and backend-to-backend commands (migrate.cc): no session, admin callers only.
  Status handle_admin(Conn& c, const proto::MsgHeader& h, std::vector<uint8_t>& msg,
                      std::vector<UniqueFd>& fds);
  /// Moves guest `guest` to the backend at `target`; the guest is unchanged here on failure.
  Result<proto::MigrateResp> migrate_out(const std::string& guest, const std::string& target);
  /// The pieces of an import (a migrating backend's, or the keeper's after a restart), checked
  /// against what kImportBegin announced.
  Status import_begin(Conn& c, const std::vector<uint8_t>& msg);
  Status import_data(Conn& c, const std::vector<uint8_t>& msg, std::vector<UniqueFd>& fds);
  /// kImportCm: a piece of the guest's RDMA CM state (JSON) and its channels' sockets.
  Status import_cm(Conn& c, const std::vector<uint8_t>& msg, std::vector<UniqueFd>& fds);
  Result<proto::ImportResp> import_commit(Conn& c);
  /// "no guest NAME here (guests: ...)": the guests this backend serves, for a refusal.
  std::string no_such_guest(const std::string& guest) const;
  /// The guest's state, its connections included (the layout a snapshot and the keeper use).
  /// A move or a snapshot (`for_keeper` false) takes its QPs off the direct path across
  /// backends first (EINPROGRESS until they are); the keeper's copy keeps them on it.
  Result<engine::GuestExport> export_with_sockets(const std::string& guest,
                                                  bool for_keeper = false);
  /// vrdma restore: the snapshot read from `file` becomes the state of the guest's device.
  Result<proto::ImportResp> restore_from(int file);
  /// Serves an imported session here: its connection and doorbell join the loop.
  void adopt(engine::Session* s, UniqueFd sock);
  /// Stops serving the sessions of `guest` without ending them (their device moved).
  /// `cm_moved`: its RDMA CM state went with it (forgotten here, peers told by the target);
  /// otherwise its CM ids end as a closed session's.
  void release_guest(const std::string& guest, bool cm_moved = false);
  /// keep_state: connects to the keeper (starting one if none answers; kept_listener may have
  /// connected already), hands it the transport's listener and takes back the guests of a
  /// backend that died.
  Status start_keeper();
  /// keep_state, before the transport starts: the listener a keeper held across our restart
  /// (then connected to it), or none (no keeper answers: a first start).
  Result<UniqueFd> kept_listener();
  /// Talks to the keeper on `sock` from now on.
  void use_keeper(UniqueFd sock);
  /// Connects to the keeper at `path`, starting one when none answers (not under systemd).
  Status connect_keeper(const std::string& path);
  /// keep_state: hands the keeper guest `guest`'s current state, its RDMA CM state included
  /// (or, when it is gone, drops it).
  void keep(const std::string& guest);
  /// keep_state: hands the keeper the RDMA CM state of every guest whose CM state changed
  /// (CmService::track_changes), alone (kKeepCmOnly). Nothing without a keeper.
  void keep_cm_changes();
  /// keep_state: hands the keeper the state of every guest whose direct state across backends
  /// changed outside a command (Device::take_direct_changes). Nothing without a keeper.
  void keep_direct_changes();
  /// The RDMA CM state of `guest`'s sessions (CmService::export_sessions, each session named by
  /// its connection's inode); `fds` gets its channels' sockets (borrowed).
  std::string cm_state_of(const std::string& guest, std::vector<int>& fds) const;
  void keep_drop(const std::string& guest);

  // What an epoll event is for: a tag in the high bits of its data, the fd in the low 32.
  static constexpr uint64_t kTagListen = 1ull << 62;
  static constexpr uint64_t kTagDoorbell = 1ull << 61;
  static constexpr uint64_t kTagWake = 1ull << 60;
  static constexpr uint64_t kTagMetrics = 1ull << 59;
  static constexpr uint64_t kTagTransport = 1ull << 58;
  static constexpr uint64_t kTagCm = 1ull << 57;  ///< the connection service's timers
  static constexpr uint64_t kTagDirectory = 1ull << 56;  ///< the directory on etcd has changes

  /// The TLS context of [transport]'s credential; null for plain TCP (loopback, or insecure).
  Result<std::shared_ptr<const transport::tcp::TlsContext>> transport_credential() const;
  Config opt_;
  UniqueFd wake_;  ///< eventfd that stop() writes, so a sleeping loop notices
  UniqueFd dir_;   ///< the socket's directory, checked (open_socket_dir): its files open from here
  UniqueFd lock_, listen_, epoll_;

  /// The directory on etcd ([directory] etcd); null: the embedded one. Declared before tcp_,
  /// which tells it about guests until it is destroyed.
  std::unique_ptr<directory::EtcdDirectory> directory_;
  uint64_t qps_noted_ns_ = 0;  ///< when our QP count goes to directory_ next
  /// Starts directory_ and hands it to tcp_.
  Status start_directory();
  /// Applies what the directory saw change: peers to dial or drop, guests that moved.
  void on_directory();
  /// Cross-backend traffic; null: off. Declared before dev_ so it outlives it: the device tells
  /// it about guests that leave while it is destroyed.
  std::unique_ptr<transport::tcp::TcpTransport> tcp_;
  engine::Device dev_;
  std::unordered_map<int, Conn> conns_;             ///< by socket fd
  std::unordered_map<int, int> doorbell_to_sock_;   ///< doorbell fd -> socket fd
  /// Connections that have not said Hello: their count per uid (max_pending_connections), and
  /// their deadlines in accept order (an entry whose connection moved on is skipped).
  std::unordered_map<uint32_t, uint32_t> pending_by_uid_;
  std::deque<std::pair<uint64_t, int>> pending_;
  ListenerRest listen_rest_;  ///< the listener's rest when descriptors run out (pause_listener)
  log::Every pending_cap_log_{1'000'000'000}, hello_log_{1'000'000'000}, fds_log_{1'000'000'000};
  /// The main loop's time awake between two looks at its work, when longer than kStallNs: the
  /// backend was not scheduled (or a step was slow), and every QP's timers counted it.
  void note_stall(uint64_t awake_ns, uint64_t now_ns);
  static constexpr uint64_t kStallNs = 100'000'000;
  /// How long the loop looks for a guest's next command after answering one, before it sleeps
  /// (at most --spin-us): the spin of a caller for its answer (common/answer_spin.h), here for
  /// the next command; it stops when commands stop following within it. Engine thread.
  AnswerSpin next_command_;
  /// The spin after work gives the CPU away between polls (sched_yield). Yields that keep the
  /// loop off its CPU kYieldStallNs or more, kYieldStalls of them less than kYieldStallGapNs
  /// apart, mean the threads beside it do not yield back (programs that spin on their memory,
  /// ib_write_lat's targets; CPU-bound ones): each yield then costs the guests' next request a
  /// scheduler time slice (4 ms), so the loop sleeps instead of spinning, woken by the guests'
  /// doorbells, for kYieldStalledNs before it tries again. (Such a yield now and then is the
  /// scheduler's business: across hosts, where the spin also reads the transport, turning it
  /// off at the first, or after 3 within 100 ms, made ib_write_lat through the backends
  /// 10.5 -> 12-35 µs; with 20 it stays at 10-11, and the same host's case still turns it off.)
  static constexpr uint64_t kYieldStallNs = 1'000'000, kYieldStallGapNs = 100'000'000,
                            kYieldStalledNs = 250'000'000;
  static constexpr uint32_t kYieldStalls = 20;
  uint64_t spin_off_until_ = 0;  ///< the loop does not spin after work until then
  uint64_t last_stall_ns_ = 0;   ///< the last long yield
  uint32_t stalls_ = 0;          ///< long yields, each within kYieldStallGapNs of the one before
  /// One more long yield at `now_ns`: how many in a row (stalls_).
  uint32_t note_yield_stall(uint64_t now_ns);
  log::Every yield_log_{60'000'000'000};
  log::Every stall_log_{1'000'000'000};
  uint32_t stall_turns_ = 0;
  rusage stall_ru_{};  ///< the thread's usage at the last account
  std::atomic<bool> stop_{false};
  std::atomic<int> stop_signal_{0};
  Reporter reporter_{opt_};
  std::unique_ptr<MetricsHttp> metrics_;  ///< null unless [metrics] enabled
  bool activated_ = false;                ///< listener inherited from systemd (not ours to unlink)
  UniqueFd keeper_;                       ///< keep_state: connection to the keeper
  bool on_demand_ = false;                ///< set_on_demand
  CmService cm_;                          ///< the RDMA connection service (librdmacm)
};

}  // namespace vrdma::backend
