// The backend's start: the socket lock, the listeners, the TCP transport and its credential,
// the directory; and what the transport shows in status. Moved from server.cc unchanged.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>

#include <fstream>

#include "backend/activation.h"
#include "backend/server.h"
#include "common/log.h"
#include "common/paths.h"
#include "common/socket.h"
#include "transport/tcp/tls.h"

namespace vrdma::backend {

namespace {

/// Why a backend may not serve `sock`: which one does (its pid, who started it, when it exits,
/// as its status says within a second) and how to replace it.
std::string another_backend(const std::string& sock) {
  constexpr int kAskMs = 1000;
  auto st = backend_status(sock, kAskMs);
  std::string pid = "PID", who;
  if (st.is_ok()) {
    pid = std::to_string(st.value().pid);
    const auto j = nlohmann::json::parse(st.value().json, nullptr, false);
    const auto& b = j.is_object() && j.contains("backend") ? j["backend"] : nlohmann::json();
    const bool on_demand = b.is_object() && b.value("on_demand", false);
    const int idle = b.is_object() ? b.value("idle_exit_s", 0) : 0;
    who = fmt::format("pid {}, {}; {}", pid,
                      on_demand ? "started on demand by `vrdma run` or a program's first use"
                                : "started by an operator or a service",
                      idle > 0 ? fmt::format("it exits after {} s without guests", idle)
                               : std::string("it runs until stopped"));
  } else if (st.err() == ETIMEDOUT) {
    who = st.status().message();
  } else {
    std::ifstream f(sock + ".pid");
    if (!(f >> pid)) pid = "PID";
    who = fmt::format("pid {} holds its lock but does not accept yet: {}", pid,
                      st.status().message());
  }
  return fmt::format(
      "another backend already serves {} ({}). This one does not start, and its "
      "options are not applied. To replace it, stop that one (kill {}, or "
      "`systemctl stop vrdmad.socket vrdmad` for the service) and start this "
      "again; or serve another socket (--socket PATH, and VRDMA_SOCKET=PATH for "
      "the programs)",
      sock, who, pid);
}

/// What the TCP transport shows in status: how it is protected, who is connected as whom, and
/// what it refused.
nlohmann::json transport_json(transport::tcp::TcpTransport& t) {
  nlohmann::json peers = nlohmann::json::array();
  for (const auto& p : t.peers()) {
    peers.push_back({{"node", p.node},
                     {"address", p.address},
                     {"identity", p.identity},
                     {"cipher", p.cipher},
                     {"since_unix", p.since_unix},
                     {"queued_bytes", p.queued_bytes},
                     {"unacked_bytes", p.unacked_bytes},
                     {"rx_bytes", p.rx_bytes},
                     {"dropped_bytes", p.dropped_bytes}});
  }
  const auto& r = t.refused();
  return {{"security", t.secure() ? "tls" : "insecure"},
          {"peers", peers},
          {"known", t.known()},
          {"connections",
           {{"dials", t.counters().dials},
            {"idle_closes", t.counters().idle_closes},
            {"idle_close_s", t.idle_close_ms() / 1000}}},
          {"refused",
           {{"handshake", r.handshake},
            {"name", r.name},
            {"pending", r.pending},
            {"directory", r.directory},
            {"frames", r.frames}}}};
}

nlohmann::json dials_json(const transport::tcp::TcpTransport& t) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& d : t.dials()) {
    out.push_back({{"address", d.address},
                   {"node", d.node},
                   {"state", d.state},
                   {"last_error", d.last_error},
                   {"last_error_unix", d.last_error_unix},
                   {"failures", d.failures}});
  }
  return out;
}

}  // namespace

Result<std::shared_ptr<const transport::tcp::TlsContext>> Server::transport_credential() const {
  using transport::tcp::TlsFiles;
  TlsFiles f;
  if (!opt_.cluster_dir.empty()) f = TlsFiles::in_dir(opt_.cluster_dir, opt_.node);
  if (!opt_.tls_ca.empty()) f.ca = opt_.tls_ca;
  if (!opt_.tls_cert.empty()) f.cert = opt_.tls_cert;
  if (!opt_.tls_key.empty()) f.key = opt_.tls_key;
  if (f.ca.empty() && f.cert.empty() && f.key.empty()) {
    // No credential: plain TCP, which anyone who reaches the port can speak. Only on loopback
    // (one host, forced TCP) unless the operator says so.
    const std::string listen = opt_.listen.empty() ? "127.0.0.1:0" : opt_.listen;
    ASSIGN_OR_RETURN(auto sa, transport::tcp::parse_endpoint(listen));
    if (!transport::tcp::is_loopback(sa) && !opt_.insecure)
      return error(EPERM,
                   fmt::format("[transport] listen {} is not a loopback address and no cluster "
                               "credential is configured: anyone who reaches the port could "
                               "inject into guests' connections. Create one (vrdma cluster init; "
                               "vrdma cluster add-node {}) and set [transport] cluster_dir "
                               "(--cluster-dir), or run unauthenticated with [transport] "
                               "insecure = true (--insecure)",
                               listen, opt_.node));
    if (!transport::tcp::is_loopback(sa))
      VLOG_WARN(
          "transport tcp: INSECURE (insecure = true): peers are not authenticated and "
          "traffic is not encrypted");
    return std::shared_ptr<const transport::tcp::TlsContext>();
  }
  if (f.ca.empty() || f.cert.empty() || f.key.empty())
    return error(EINVAL, "[transport]: the credential needs ca, cert and key (or cluster_dir)");
  auto ctx = transport::tcp::TlsContext::load(f, opt_.node);
  if (!ctx.is_ok()) return ctx.status();
  return std::shared_ptr<const transport::tcp::TlsContext>(std::move(ctx).value());
}

Status Server::setup() {
  // systemd's socket, when it started us: its path is the one to lock.
  ASSIGN_OR_RETURN(UniqueFd inherited, inherited_listener(opt_.socket_path));
  activated_ = inherited.valid();
  reporter_.set_activated(activated_);
  ASSIGN_OR_RETURN(dir_, open_socket_dir(opt_.socket_path, true));
  ASSIGN_OR_RETURN(lock_, open_beside(dir_, opt_.socket_path + ".lock", O_RDWR | O_CREAT));
  if (::flock(lock_.get(), LOCK_EX | LOCK_NB) < 0) {
    if (errno == EWOULDBLOCK) {
      // A backend started on demand that lost the race leaves quietly: no need to ask.
      if (on_demand_) return error(EALREADY, "another backend owns " + opt_.socket_path);
      return error(EALREADY, another_backend(opt_.socket_path));
    }
    return error(errno, "flock");
  }
  epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) return error(errno, "epoll_create1");
  // Metrics first: a backend that cannot serve what it was configured to never takes guests.
  if (opt_.metrics_enabled) {
    // The control socket's path, and the files beside it, are not the metrics' to take.
    for (const char* suffix : {"", ".lock", ".pid"}) {
      if (opt_.metrics_listen == "unix:" + opt_.socket_path + suffix)
        return error(EINVAL, fmt::format("metrics listen {}: the backend's own {}",
                                         opt_.metrics_listen, *suffix ? "file" : "socket"));
    }
    // Over TCP no one is known, so a scrape sees what an admin sees (guests by LID unless
    // guest_names). Over a unix socket a scraper who is not an admin sees its own guests only,
    // as with `vrdma status`.
    metrics_ = std::make_unique<MetricsHttp>(
        epoll_.get(), kTagMetrics, [this](std::optional<uint32_t> uid) {
          Viewer v{engine::kNoUid, true};
          if (uid) v = Viewer{*uid, is_admin_uid(*uid, dev_.backend_uid())};
          return reporter_.metrics(dev_, cm_clock_ns(), v);
        });
    // We hold the lock: a socket file left at a unix path is stale.
    RETURN_IF_ERROR(metrics_->listen(opt_.metrics_listen, opt_.metrics_socket_mode));
    VLOG_INFO("metrics on {}", metrics_->where());
  }
  listen_ = std::move(inherited);
  if (!activated_) {
    // We hold the lock: any socket file left is stale.
    unlink_beside(dir_, opt_.socket_path);
    ASSIGN_OR_RETURN(listen_, listen_unix(opt_.socket_path));
  }
  write_pid_beside(dir_, opt_.socket_path + ".pid");
  watch(listen_.get(), kTagListen);
  listen_rest_.bind(epoll_.get(), listen_.get(), kTagListen | static_cast<uint32_t>(listen_.get()));
  if (!wake_.valid()) return error(EMFILE, "eventfd");
  watch(wake_.get(), kTagWake);
  watch(cm_.timer_fd(), kTagCm);
  // Backends talk over TCP when a listen address is given, or for every pair when forced.
  if (!opt_.listen.empty() || opt_.force == "tcp") {
    transport::tcp::TcpTransport::Options to{
        opt_.node,  opt_.listen.empty() ? "127.0.0.1:0" : opt_.listen,
        opt_.peers, opt_.force == "tcp",
        nullptr,    uint64_t(opt_.idle_close_s) * 1000};
    if (!opt_.etcd.empty()) to.peers.clear();  // peers come from the directory
    if (opt_.keep_state) {                     // a restart: the listener the keeper held meanwhile
      ASSIGN_OR_RETURN(to.listener, kept_listener());
    }
    ASSIGN_OR_RETURN(to.tls, transport_credential());
    ASSIGN_OR_RETURN(tcp_, transport::tcp::TcpTransport::create(std::move(to), dev_));
    dev_.set_transport(tcp_.get());
    // The CM asks every known peer (a frame for one not connected dials it) and every connected
    // one: a peer given by address alone is known by name only once a dial of ours reached it,
    // and a backend that started first was dialed by its peers before that.
    cm_.set_transport(tcp_.get(), [this] { return tcp_->group_peers(); });
    dev_.set_cm_receiver([this](const std::string& node, const proto::wire::Cm& m) {
      cm_.on_wire(node, m);
      keep_cm_changes();
    });
    watch(tcp_->fd(), kTagTransport);
    reporter_.set_connected_peers([this] { return tcp_->connected(); });
    reporter_.set_transport_details([this] {
      nlohmann::json j = transport_json(*tcp_);
      if (directory_) j["directory"] = directory_->status_json();
      return j;
    });
    reporter_.set_peer_dials([this] { return dials_json(*tcp_); });
    if (!opt_.etcd.empty()) RETURN_IF_ERROR(start_directory());
  } else if (!opt_.etcd.empty()) {
    return error(EINVAL, "[directory] etcd needs the TCP transport: set [transport] listen");
  }
  if (opt_.keep_state) {
    cm_.track_changes(true);  // the keeper holds the guests' CM state too
    RETURN_IF_ERROR(start_keeper());
  }
  dev_.set_direct(opt_.direct_path);
  dev_.set_direct_trust(opt_.direct_trust == "uid", opt_.direct_tenants);
  dev_.set_direct_remote(opt_.direct_remote);
  // keep_state: what the backend knows of the direct path across backends changes outside
  // commands too (a peer's offer, a revoke's answer); the keeper has it before a command acts.
  dev_.track_direct_changes(opt_.keep_state && opt_.direct_remote);
  return Status::ok();
}

Status Server::start_directory() {
  directory::EtcdDirectory::Options o;
  o.etcd = {opt_.etcd, opt_.etcd_ca, opt_.etcd_cert, opt_.etcd_key, opt_.etcd_timeout_ms};
  o.prefix = opt_.etcd_prefix;
  o.node = opt_.node;
  o.lease_s = opt_.etcd_lease_s;
  o.address = opt_.advertise.empty() ? opt_.listen : opt_.advertise;
  ASSIGN_OR_RETURN(auto sa, transport::tcp::parse_endpoint(o.address));
  if (sa.unspecified() || sa.port() == 0)
    return error(EINVAL, fmt::format("[directory]: peers cannot dial {}; set [directory] "
                                     "advertise = \"ADDR:PORT\" (where they reach this backend)",
                                     o.address));
  if (!opt_.peers.empty())
    VLOG_WARN("[transport] peers are not dialed: with [directory] etcd, peers come from etcd");
  if (tcp_->secure()) {
    std::string cert = opt_.tls_cert;
    if (cert.empty() && !opt_.cluster_dir.empty())
      cert = transport::tcp::TlsFiles::in_dir(opt_.cluster_dir, opt_.node).cert;
    o.fingerprint = transport::tcp::cert_file_fingerprint(cert);
  }
  ASSIGN_OR_RETURN(directory_, directory::EtcdDirectory::start(std::move(o)));
  tcp_->set_directory(directory_.get());
  watch(directory_->fd(), kTagDirectory);
  return Status::ok();
}

void Server::on_directory() {
  using Change = directory::EtcdDirectory::Change;
  directory_->poll([this](const Change& c) {
    switch (c.kind) {
      case Change::Kind::kPeerUp:
        if (Status st = tcp_->add_peer(c.node, c.address); !st.is_ok())
          VLOG_WARN("directory: node {} at {}: {}; not dialed", c.node, c.address, st.message());
        break;
      case Change::Kind::kPeerDown:
        tcp_->drop_peer(c.node);
        break;
      case Change::Kind::kGuestMoved:
        dev_.on_guest_located(c.guest, c.node);
        break;
    }
  });
}

}  // namespace vrdma::backend
