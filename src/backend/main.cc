// vrdmad: the vrdma backend, the process that plays the RDMA device for the guests of a host.
// Configuration: built-in defaults < --config FILE (TOML) < command-line flags.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>

#include <CLI/CLI.hpp>

#include "backend/keeper.h"
#include "backend/server.h"
#include "common/log.h"
#include "common/paths.h"

namespace {
vrdma::backend::Server* g_server = nullptr;
void on_signal(int sig) {
  if (g_server) g_server->stop(sig);
}

// `vrdmad --keeper PATH GRACE_S`, started by a backend with keep_state (backend/keeper.h);
// how to start the backend again comes in VRDMA_KEEPER_RESTART. `vrdmad --keeper PATH
// --config FILE`: vrdmad-keeper.service, the grace from the file's keep_state_grace_s.
int keeper_main(int argc, char** argv) {
  int grace_s = std::atoi(argv[3]);
  if (std::string(argv[3]) == "--config") {
    vrdma::backend::Config file;
    vrdma::Status st =
        argc >= 5 ? file.load_file(argv[4]) : vrdma::error(EINVAL, "--config needs a FILE");
    if (!st.is_ok()) {
      fmt::print(stderr, "vrdmad --keeper: {}\n", st.message());
      return 2;
    }
    grace_s = file.keep_state_grace_s;
  }
  std::vector<std::string> restart;
  if (const char* r = ::secure_getenv("VRDMA_KEEPER_RESTART")) {
    std::string cur;
    for (const char* c = r; *c; ++c) {
      if (*c == '\x1f') {
        restart.push_back(cur);
        cur.clear();
      } else {
        cur += *c;
      }
    }
    ::unsetenv("VRDMA_KEEPER_RESTART");
  }
  return vrdma::backend::run_keeper(argv[2], grace_s, std::move(restart));
}

/// The environment's settings over the file's and the flags' (a backend the library starts on
/// first use has no flags for them); false on a value it does not know.
bool apply_environment(vrdma::backend::Config& cfg) {
  // VRDMA_DIRECT_PATH=1 / 0: as --direct-path / --no-direct-path (for a backend the library
  // starts on first use).
  if (const char* d = ::secure_getenv("VRDMA_DIRECT_PATH"); d && std::string(d) == "1")
    cfg.direct_path = true;
  else if (d && std::string(d) == "0")
    cfg.direct_path = false;
  // VRDMA_DIRECT_REMOTE=1 / 0: as --direct-remote / --no-direct-remote.
  if (const char* d = ::secure_getenv("VRDMA_DIRECT_REMOTE"); d && std::string(d) == "1")
    cfg.direct_remote = true;
  else if (d && std::string(d) == "0")
    cfg.direct_remote = false;
  // VRDMA_TRANSPORT=tcp: every pair through TCP, even two guests of this backend (tests the
  // cross-host path on one host).
  if (const char* t = ::secure_getenv("VRDMA_TRANSPORT"); t && *t) {
    if (std::string(t) != "tcp" && std::string(t) != "auto") {
      fmt::print(stderr, "vrdmad: VRDMA_TRANSPORT={} (expected tcp or auto)\n", t);
      return false;
    }
    cfg.force = std::string(t) == "tcp" ? "tcp" : "";
  }
  return true;
}

// Every guest connection, ring and registered segment is one of our descriptors, and a
// service starts with a soft limit of 1024: take what the hard limit allows
// (packaging/vrdmad.service sets LimitNOFILE).
void raise_descriptor_limit() {
  if (rlimit nofile{}; ::getrlimit(RLIMIT_NOFILE, &nofile) == 0) {
    const rlim_t soft = nofile.rlim_cur;
    nofile.rlim_cur = nofile.rlim_max;
    if (soft != nofile.rlim_max && ::setrlimit(RLIMIT_NOFILE, &nofile) != 0)
      VLOG_WARN("raising the descriptor limit from {} to {}: {}", soft, nofile.rlim_max,
                std::strerror(errno));
    else
      VLOG_DEBUG("descriptor limit {} (was {})", nofile.rlim_cur, soft);
  }
}

/// Runs the backend until SIGINT or SIGTERM; the process's exit code.
int serve(const vrdma::backend::Config& cfg, bool on_demand) {
  ::signal(SIGPIPE, SIG_IGN);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  vrdma::backend::Server server(cfg);
  server.set_on_demand(on_demand);
  g_server = &server;
  vrdma::Status st = server.run();
  if (!st.is_ok()) {
    VLOG_ERROR("{}", st.message());
    return 1;
  }
  return 0;
}

}  // namespace

// long-function: the option table (one statement per flag) and the flags laid over the file.
int main(int argc, char** argv) {
  if (argc >= 4 && std::string(argv[1]) == "--keeper") return keeper_main(argc, argv);
  vrdma::backend::Config cfg;
  {
    char self[4096] = {};
    if (::readlink("/proc/self/exe", self, sizeof(self) - 1) > 0) cfg.self_argv.push_back(self);
    for (int i = 1; i < argc && !cfg.self_argv.empty(); ++i) cfg.self_argv.push_back(argv[i]);
  }
  std::string config_file;
  bool check_only = false;
  // Flags are parsed twice: first to find --config, then over the file's values.
  std::string socket;
  int idle_exit = -1, spin_us = -1, nice = 100;
  CLI::App app{"vrdmad: the vrdma backend (the software RDMA device)"};
  app.set_version_flag("--version", std::string("vrdmad ") + VRDMA_VERSION);
  std::string log_level;
  app.add_option("--log-level", log_level,
                 "error, warn, info or debug (over VRDMA_LOG and [backend] log_level)")
      ->check(CLI::IsMember({"error", "warn", "info", "debug"}));
  app.add_option("--config", config_file, "TOML config file (see packaging/vrdmad.toml)");
  // One form for both programs: `--check-config FILE`, or `--config FILE --check-config`.
  std::string check_file;
  auto* check_opt = app.add_option("--check-config", check_file,
                                   "validate the config file (FILE, or --config's) and exit")
                        ->expected(0, 1)
                        ->type_name("[FILE]");
  app.add_option("--socket", socket, "unix socket guests connect to");
  app.add_option("--idle-exit", idle_exit, "exit after this many seconds without guests (0: never)");
  app.add_option("--spin-us", spin_us, "microseconds to poll idle rings before sleeping");
  app.add_option("--nice", nice, "the engine thread's nice value ([datapath] nice, -3; 0: as started)")
      ->check(CLI::Range(-20, 19));
  app.add_option("--listen", cfg.listen, "ADDR:PORT for backend-to-backend TCP");
  app.add_option("--peer", cfg.peers, "ADDR:PORT of another backend (repeatable)");
  app.add_option("--node", cfg.node, "this backend's name among its peers");
  std::string cluster_dir;
  app.add_option("--cluster-dir", cluster_dir,
                 "the cluster credential: DIR/ca.pem, DIR/NODE.pem, DIR/NODE.key (vrdma cluster "
                 "init / add-node); backends authenticate each other with TLS 1.3");
  bool insecure = false;
  app.add_flag("--insecure", insecure,
               "allow the TCP transport with no credential on a non-loopback address: no "
               "authentication, no encryption ([transport] insecure)");
  std::string metrics_listen;
  bool direct_path = false, no_direct_path = false;
  app.add_flag("--direct-path", direct_path,
               "let guests of one uid copy to each other themselves, the backend only granting "
               "and revoking ([datapath] direct_path; the default)");
  app.add_flag("--no-direct-path", no_direct_path,
               "keep every guest's work on the backend ([datapath] direct_path = false)");
  bool direct_remote = false, no_direct_remote = false;
  app.add_flag("--direct-remote", direct_remote,
               "let the libraries of an RC or UC QP pair on two backends talk TLS over TCP to "
               "each other, the backends only introducing them ([datapath] direct_remote; the "
               "default)");
  app.add_flag("--no-direct-remote", no_direct_remote,
               "keep every QP pair across backends on the backends' transport ([datapath] "
               "direct_remote = false)");
  bool keep_state = false;
  app.add_flag("--keep-state", keep_state,
               "keep guests' state in a keeper process: a backend that dies is replaced without "
               "ending their connections ([backend] keep_state)");
  app.add_option("--metrics-listen", metrics_listen,
                 "serve Prometheus metrics on ADDR:PORT or unix:PATH (enables [metrics])");
  // Internal: set by `vrdma run` and the library when they start a backend (paths.h,
  // start_backend). Without it, a socket another backend serves is an error.
  bool on_demand = false;
  app.add_flag("--on-demand", on_demand)->group("");
  CLI11_PARSE(app, argc, argv);
  check_only = check_opt->count() > 0;
  if (!check_file.empty()) {
    if (!config_file.empty() && config_file != check_file) {
      fmt::print(stderr, "vrdmad: two config files ({} and {}): give one\n", config_file,
                 check_file);
      return 2;
    }
    config_file = check_file;
  }

  if (!config_file.empty()) {
    // Flags given on the command line win over the file.
    auto listen = cfg.listen;
    auto peers = cfg.peers;
    auto node = cfg.node;
    vrdma::Status st = cfg.load_file(config_file);
    if (!st.is_ok()) {
      fmt::print(stderr, "vrdmad: {}\n", st.message());
      return 2;
    }
    if (!listen.empty()) cfg.listen = listen;
    if (!peers.empty()) cfg.peers = peers;
    if (!node.empty()) cfg.node = node;
  } else if (check_only) {
    fmt::print(stderr, "vrdmad: --check-config needs a FILE (or --config FILE)\n");
    return 2;
  }
  if (!socket.empty()) cfg.socket_path = socket;
  if (!cluster_dir.empty()) cfg.cluster_dir = cluster_dir;
  if (insecure) cfg.insecure = true;
  if (idle_exit >= 0) cfg.idle_exit_s = idle_exit;
  if (spin_us >= 0) cfg.spin_us = spin_us;
  if (nice != 100) cfg.nice = nice;
  if (keep_state) cfg.keep_state = true;
  if (direct_path) cfg.direct_path = true;
  if (no_direct_path) cfg.direct_path = false;
  if (direct_remote) cfg.direct_remote = true;
  if (no_direct_remote) cfg.direct_remote = false;
  if (!metrics_listen.empty()) {
    cfg.metrics_enabled = true;
    cfg.metrics_listen = metrics_listen;
  }
  if (cfg.socket_path.empty()) cfg.socket_path = vrdma::socket_path();
  if (cfg.node.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    cfg.node = host;
  }
  if (!apply_environment(cfg)) return 2;
  if (check_only) {
    fmt::print("{}: ok\n", config_file);
    return 0;
  }
  if (!log_level.empty()) {
    cfg.log_level = log_level;
    ::setenv("VRDMA_LOG", log_level.c_str(), 1);  // the flag wins over the environment
  }
  if (::secure_getenv("VRDMA_LOG") == nullptr) ::setenv("VRDMA_LOG", cfg.log_level.c_str(), 0);

  raise_descriptor_limit();
  return serve(cfg, on_demand);
}
