// The `vrdma` command: runs an unmodified verbs program on the vrdma device (`run`), starts the
// backend in the foreground (`backend`) and shows what the backend holds and did (`status`,
// `res show`, `stat`; see show.h) and creates the backends' TLS credentials (`cluster`; cluster.h).
// It only sets up an environment and talks the control protocol; it never touches a guest's rings.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli/admin.h"
#include "cli/cluster.h"
#include "cli/cluster_status.h"
#include "cli/device_view.h"
#include "cli/show.h"
#include "common/paths.h"
#include "common/socket.h"
#include "proto/command.h"

namespace vrdma::cli {
namespace {

namespace fs = std::filesystem;

constexpr int kIdleExitOnDemand = 60;      ///< seconds an auto-started backend lingers unused
constexpr int kBackendStartWaitMs = 5000;  ///< how long it may take to listen
/// Directory holding this executable (from /proc/self/exe), e.g. <prefix>/bin.
fs::path exe_dir() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) {
    fmt::print(stderr, "vrdma: cannot read /proc/self/exe: {}\n", ec.message());
    std::exit(1);
  }
  return exe.parent_path();
}

fs::path backend_binary() { return exe_dir() / "vrdmad"; }

/// Where our libibverbs.so.1 is: <libdir>/vrdma once installed (its own directory, so the
/// system's libibverbs stays untouched; CMakeLists.txt), <build>/lib in a build tree.
fs::path library_dir() {
  const fs::path installed = (exe_dir() / VRDMA_BIN_TO_LIB).lexically_normal();
  std::error_code ec;
  if (fs::exists(installed / "libibverbs.so.1", ec)) return installed;
  return (exe_dir() / ".." / "lib").lexically_normal();
}

/// Makes sure a backend accepts on `socket`, starting one if none does (and saying so).
bool ensure_backend(const std::string& socket) {
  auto r = connect_backend_socket(socket);
  if (r) return true;
  if (!no_backend_there(r.err())) {
    // Permission denied, a bad directory: starting another backend would not help.
    fmt::print(stderr, "vrdma run: {}\n", backend_unreachable_hint(socket, r.err()));
    return false;
  }
  auto started = start_backend(backend_binary().string(), socket, kIdleExitOnDemand);
  if (!started) {
    fmt::print(stderr, "vrdma run: cannot start a backend: {}\n", started.status().message());
    return false;
  }
  fmt::print(stderr,
             "vrdma run: started a backend (pid {}) on {}; its log is {}; it exits after {} s "
             "without guests\n",
             started->pid, socket, started->log, kIdleExitOnDemand);
  if (auto a = await_backend(socket, *started, kBackendStartWaitMs); !a) {
    fmt::print(stderr, "vrdma run: {}\n", a.status().message());
    return false;
  }
  return true;
}

void set_env(const char* name, const std::string& value) {
  if (::setenv(name, value.c_str(), 1) != 0) {
    fmt::print(stderr, "vrdma: setenv {}: {}\n", name, std::strerror(errno));
    std::exit(1);
  }
}

/// False when `--no-view` or VRDMA_VIEW=0 asks `vrdma run` to leave the program's mounts alone.
bool view_wanted(bool no_view) {
  const char* e = std::getenv("VRDMA_VIEW");
  return !no_view && !(e && std::string_view(e) == "0");
}

int cmd_run(const std::optional<std::string>& guest, const std::string& socket_opt, bool no_view,
            const std::vector<std::string>& command) {
  if (command.empty()) {
    fmt::print(stderr, "vrdma run: no command given (usage: vrdma run [options] -- CMD ARGS...)\n");
    return 2;
  }
  const fs::path dir = exe_dir();
  std::string lib_dir = library_dir().string();
  std::error_code ec;
  if (!fs::exists(library_dir() / "libibverbs.so.1", ec)) {
    fmt::print(stderr, "vrdma run: no libibverbs.so.1 in {} (is vrdma installed completely?)\n",
               lib_dir);
    return 1;
  }
  if (const char* old = std::getenv("LD_LIBRARY_PATH"); old && *old) {
    lib_dir += std::string(":") + old;
  }
  set_env("LD_LIBRARY_PATH", lib_dir);
  set_env("VRDMA_BACKEND", (dir / "vrdmad").string());
  if (guest) {
    if (Status st = check_guest_name(*guest); !st) {
      fmt::print(stderr, "vrdma run: --guest: {}\n", st.message());
      return 2;
    }
    set_env("VRDMA_GUEST", *guest);
  }
  if (!socket_opt.empty()) {
    set_env("VRDMA_SOCKET", socket_opt);
  }

  if (!ensure_backend(socket_path())) {
    return 1;
  }
  if (auto name = guest_name(); name.is_ok() && view_wanted(no_view)) {
    if (const std::string missing = provide_device_view(name.value()); !missing.empty()) {
      fmt::print(stderr,
                 "vrdma run: no /dev/infiniband/uverbs0 or /sys/class/infiniband for the program "
                 "({}): UCX and Open MPI will not find vrdma0, libibverbs-based tools still do "
                 "(they read sysfs under SYSFS_PATH); --no-view or VRDMA_VIEW=0 skips this\n",
                 missing);
    }
  }

  std::vector<char*> argv;
  argv.reserve(command.size() + 1);
  for (const auto& a : command) {
    argv.push_back(const_cast<char*>(a.c_str()));
  }
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  const int err = errno;
  fmt::print(stderr, "vrdma run: cannot execute {}: {}\n", command[0], std::strerror(err));
  return err == ENOENT ? 127 : 126;
}

int cmd_backend(const std::string& socket_opt, int idle_exit, const std::string& config,
                const std::optional<std::string>& check_config, const std::string& metrics_listen,
                bool direct_path, bool direct_remote, const std::vector<std::string>& more) {
  const std::string bin = backend_binary().string();
  std::vector<std::string> args = {bin};
  if (!socket_opt.empty()) {
    args.insert(args.end(), {"--socket", socket_opt});
  }
  if (!config.empty()) args.insert(args.end(), {"--config", config});
  if (check_config) {
    args.emplace_back("--check-config");
    if (!check_config->empty()) args.push_back(*check_config);
  }
  if (!metrics_listen.empty()) args.insert(args.end(), {"--metrics-listen", metrics_listen});
  if (direct_path) args.emplace_back("--direct-path");
  if (direct_remote) args.emplace_back("--direct-remote");
  if (idle_exit >= 0) {
    args.insert(args.end(), {"--idle-exit", std::to_string(idle_exit)});
  }
  // Every other vrdmad option (--listen, --peer, --log-level, ...) as given: vrdmad checks them.
  args.insert(args.end(), more.begin(), more.end());
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (auto& a : args) {
    argv.push_back(a.data());
  }
  argv.push_back(nullptr);
  ::execv(bin.c_str(), argv.data());
  const int err = errno;
  fmt::print(stderr, "vrdma backend: cannot execute {}: {}\n", bin, std::strerror(err));
  return err == ENOENT ? 127 : 126;
}

/// Asks the backend at `socket` for its status JSON. Exits the process with a message on error.
std::string query_status(const std::string& socket) {
  auto st = backend_status(socket, wait_ms(kStatusWaitMs));
  if (st) return std::move(st->json);
  const int err = st.err();
  if (err == EACCES || err == EPERM) {
    fmt::print(stderr, "vrdma: {}\n", backend_unreachable_hint(socket, err));
  } else if (no_backend_there(err)) {
    fmt::print(stderr, "vrdma: no backend is running at {} ({}); {}\n", socket,
               st.status().message(), backend_unreachable_hint(socket, err));
  } else {
    fmt::print(stderr, "vrdma: {}\n", st.status().message());
  }
  std::exit(1);
}

/// Reads a non-negative count from obj[key]; 0 when absent or not a number.
uint64_t count_of(const nlohmann::json& obj, const char* key) {
  if (!obj.is_object()) {
    return 0;
  }
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_number_integer()) {
    return 0;
  }
  const int64_t v = it->get<int64_t>();
  return v < 0 ? 0 : static_cast<uint64_t>(v);
}

std::string string_of(const nlohmann::json& obj, const char* key) {
  if (!obj.is_object()) {
    return "";
  }
  auto it = obj.find(key);
  if (it == obj.end()) {
    return "";
  }
  if (it->is_string()) {
    return it->get<std::string>();
  }
  return it->dump();
}

void print_table(const nlohmann::json& j) {
  constexpr const char* kRow = "{:<20} {:>6}  {:<40} {:>8}  {:<16} {:>4} {:>4} {:>4} {:>4}\n";
  fmt::print(kRow, "GUEST", "LID", "GID", "SESSIONS", "PIDS", "PD", "MR", "CQ", "QP");
  const nlohmann::json empty = nlohmann::json::object();
  const auto& guests = j.contains("guests") ? j["guests"] : empty;
  for (const auto& g : guests.is_array() ? guests : nlohmann::json::array()) {
    const auto& res = g.contains("resources") ? g["resources"] : empty;
    std::string pids;
    size_t nsessions = 0;
    if (g.contains("sessions") && g["sessions"].is_array()) {
      for (const auto& s : g["sessions"]) {
        if (!pids.empty()) {
          pids += ",";
        }
        pids += string_of(s, "pid");
        ++nsessions;
      }
    }
    if (pids.empty()) {
      pids = "-";
    }
    fmt::print(kRow, string_of(g, "guest"), cli::id_text(g.value("lid", nlohmann::json())),
               string_of(g, "gid"), nsessions, pids, count_of(res, "pd"), count_of(res, "mr"),
               count_of(res, "cq"), count_of(res, "qp"));
  }
  const auto& t = j.contains("totals") ? j["totals"] : empty;
  fmt::print("totals: {} guests, {} sessions, {} pd, {} mr, {} cq, {} qp, {} channel, {} segment\n",
             count_of(t, "guests"), count_of(t, "sessions"), count_of(t, "pd"), count_of(t, "mr"),
             count_of(t, "cq"), count_of(t, "qp"), count_of(t, "channel"), count_of(t, "segment"));
}

/// The backend's status document, parsed. Exits the process with a message on error.
nlohmann::json query_status_json(const std::string& socket_opt) {
  const std::string socket = socket_opt.empty() ? socket_path() : socket_opt;
  std::string text = query_status(socket);
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    fmt::print(stderr, "vrdma: the backend sent malformed status JSON: {}\n", text);
    std::exit(1);
  }
  return j;
}

int cmd_status(bool json, const std::string& socket_opt) {
  nlohmann::json j = query_status_json(socket_opt);
  if (json) {
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print("{}", status_header(j));
  print_table(j);
  return 0;
}

/// `vrdma res show [TYPE] [KEY VALUE]... [-j]` and `vrdma stat [qp|guest] [KEY VALUE]... [-j]`.
int cmd_show(bool stat, std::vector<std::string> words, bool json, bool details,
             const std::string& socket_opt) {
  const char* const cmd = stat ? "vrdma stat" : "vrdma res show";
  // The first word is the type when it names one (`guest` of `stat` is also a filter key, so
  // there it is the type only when a filter pair follows it).
  std::string type;
  if (!words.empty()) {
    const std::string& w = words.front();
    const bool named = stat ? w == "qp"
                            : (w == "qp" || w == "cq" || w == "mr" || w == "pd" || w == "srq" ||
                               w == "dm" || w == "mw" || w == "xrcd");
    if (named || words.size() % 2 == 1) {
      type = w;
      words.erase(words.begin());
    }
  }
  auto filters = parse_filters(words);
  if (!filters) {
    fmt::print(stderr, "{}: {}\n", cmd, filters.status().message());
    return 2;
  }
  // Check the arguments before asking the backend, so a typo is reported as one.
  const nlohmann::json empty = {{"res", nlohmann::json::object()}};
  auto check = stat ? stat_rows(empty, type.empty() ? "qp" : type, *filters)
                    : res_rows(empty, type.empty() ? "qp" : type, *filters);
  if (!check || (!stat && type.empty() && !filters->empty())) {
    fmt::print(stderr, "{}: {}\n", cmd,
               check ? "filters need a resource type (qp, cq, mr, pd, srq, dm, mw, xrcd)"
                     : check.status().message());
    return 2;
  }
  nlohmann::json j = query_status_json(socket_opt);
  if (!stat && type.empty()) {
    if (json) {
      fmt::print("{}\n", j["guests"].dump());
    } else {
      fmt::print("{}", res_summary(j));
    }
    return 0;
  }
  if (stat && type.empty()) {
    // Both views: the sums per guest (by the filters a guest row has), then each QP.
    Filters by_guest;
    for (const auto& f : *filters)
      if (f.first == "guest") by_guest.push_back(f);
    auto g = stat_rows(j, "guest", by_guest);
    auto q = stat_rows(j, "qp", *filters);
    if (json) {
      fmt::print("{}\n", nlohmann::json{{"guest", *g}, {"qp", *q}}.dump());
    } else {
      fmt::print("{}\n{}", stat_text("guest", *g), stat_text("qp", *q));
    }
    return 0;
  }
  // Above 1000 QPs the backend's status has no lists of objects, only their counts per guest
  // (res_omitted) and the per-guest sums: say so rather than print an empty list.
  if (const auto om = j.find("res_omitted"); om != j.end() && om->is_array()) {
    uint64_t n = 0;
    for (const auto& r : *om) n += count_of(r, type == "guest" ? "qp" : type.c_str());
    if (n && !(stat && type == "guest")) {
      fmt::print(stderr,
                 "{}: the backend holds {} {} row(s) and lists no objects above 1000 QPs; "
                 "`vrdma stat guest` and `vrdma status` have each guest's counts and sums\n",
                 cmd, n, type);
      return 1;
    }
  }
  auto rows = stat ? stat_rows(j, type, *filters) : res_rows(j, type, *filters);
  if (json && stat) {
    // One shape for `stat -j` and `stat TYPE -j`: an object with a member per counter set.
    fmt::print("{}\n", nlohmann::json{{type, *rows}}.dump());
  } else if (json) {
    fmt::print("{}\n", rows->dump());
  } else {
    fmt::print("{}", stat ? stat_text(type, *rows) : res_text(type, *rows, details));
  }
  return 0;
}

/// `vrdma cluster status [-j]`: the cluster as the backend at `socket` sees it (cluster_status.h).
int cmd_cluster_status(bool json, const std::string& socket) {
  const nlohmann::json view = cluster_view(query_status_json(socket));
  fmt::print("{}", json ? view.dump() + "\n" : cluster_text(view));
  return 0;
}

/// `vrdma cluster init|add-node|show [-j]`: exit 2 for a bad argument, 1 for any other failure.
int cmd_cluster(const std::string& sub, const std::string& dir, const std::string& name, int days,
                bool force, bool json) {
  Result<std::string> out = std::string();
  bool all_ok = true;  // of `show`: every certificate verified
  if (sub == "init" || sub == "add-node") {
    auto made = sub == "init" ? cluster_init(dir) : cluster_add_node(dir, name, days, force);
    if (made)
      out = json ? made->json.dump() + "\n" : made->text;
    else
      out = made.status();
  } else if (auto report = cluster_show(dir); report) {
    out = json ? nlohmann::json{{"dir", dir}, {"all_ok", report->all_ok}, {"certs", report->certs}}
                         .dump() +
                     "\n"
               : report->text;
    all_ok = report->all_ok;
  } else {
    out = report.status();
  }
  if (!out) {
    fmt::print(stderr, "vrdma cluster {}: {}\n", sub, out.status().message());
    return out.err() == EINVAL ? 2 : 1;
  }
  fmt::print("{}", *out);
  return all_ok ? 0 : 1;
}

/// `vrdma setup [--guest NAME] [--remove] [-j]`: the device view host-wide (device_view.h).
int cmd_setup(const std::string& guest, bool remove, bool json) {
  const char* const cmd = remove ? "vrdma setup --remove" : "vrdma setup";
  auto r = remove ? remove_host_view() : setup_host_view(guest);
  if (!r) {
    fmt::print(stderr, "{}: {}\n", cmd, r.status().message());
    return r.err() == EINVAL ? 2 : 1;
  }
  const nlohmann::json& j = *r;
  if (json) {
    fmt::print("{}\n", j.dump());
  } else if (remove && !j.value("removed", false)) {
    fmt::print("{}: nothing to remove (no {})\n", cmd, kHostViewState);
  } else if (remove) {
    for (const auto& line : j["undone"]) fmt::print("{}: {}\n", cmd, line.get<std::string>());
  } else {
    fmt::print(
        "{}: {}{} ({}) and {} for guest {} (LID {}, GID {}), for every program in this "
        "mount namespace until `vrdma setup --remove` or the next boot; recorded in {}\n",
        cmd, j.value("already", false) ? "already there: " : "", j.value("node", ""),
        j.value("node_kind", ""), j.value("sysfs", ""), j.value("guest", ""),
        cli::id_text(j.value("lid", nlohmann::json())), j.value("gid", ""), kHostViewState);
  }
  return 0;
}

/// For `vrdma run [opts] [--] CMD ARGS...`: moves CMD ARGS... into `command` and returns the
/// number of leading arguments left for the option parser.
int split_run_command(int argc, char** argv, std::vector<std::string>& command) {
  if (argc < 2 || std::string_view(argv[1]) != "run") {
    return argc;
  }
  int i = 2;
  while (i < argc) {
    std::string_view a = argv[i];
    if (a == "--") {
      command.assign(argv + i + 1, argv + argc);
      return i;
    }
    if (a == "--guest" || a == "--socket") {
      i += 2;  // option with a separate value
    } else if (a.starts_with("-")) {
      ++i;  // --opt=value, --help, or an error CLI11 reports
    } else {
      command.assign(argv + i, argv + argc);
      return i;
    }
  }
  return argc;
}

// long-function: the command line's table (subcommands and options, CLI11) and one dispatch.
int main_impl(int argc, char** argv) {
  CLI::App app{"vrdma: a user-space paravirtual RDMA device"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("vrdma ") + VRDMA_VERSION);

  std::string guest, run_socket;
  auto* run = app.add_subcommand(
      "run",
      "Run an unmodified verbs program on the vrdma device: vrdma run [opts] -- CMD ARGS...");
  run->add_option("--guest", guest,
                  "guest name (sets VRDMA_GUEST; default: one per process group)");
  run->add_option("--socket", run_socket, "backend socket (sets VRDMA_SOCKET)");
  bool no_view = false;
  run->add_flag("--no-view", no_view,
                "no /dev/infiniband/uverbs0 and sysfs view for the program (as VRDMA_VIEW=0)");
  run->footer("Everything after -- (or from the first non-option argument) is the command.");

  std::string backend_socket;
  int idle_exit = -1;  ///< -1: not given, vrdmad's default
  std::string config, check_config, metrics_listen;
  auto* backend = app.add_subcommand(
      "backend", "Run the backend (vrdmad) in the foreground; every vrdmad option is taken");
  backend->allow_extras();
  backend->footer(
      "Every other vrdmad option is passed on as given (--listen, --peer, --node, --cluster-dir, "
      "--insecure, --no-direct-path, --no-direct-remote, --keep-state, --spin-us, --nice, "
      "--log-level, --version): see `vrdmad --help`.");
  backend->add_option("--socket", backend_socket, "socket to listen on");
  backend->add_option("--config", config, "TOML config file (flags given here override it)");
  auto* check_opt = backend
                        ->add_option("--check-config", check_config,
                                     "validate the config file (FILE, or --config's) and exit "
                                     "(errors name the line)")
                        ->expected(0, 1)
                        ->type_name("[FILE]");
  backend->add_option("--metrics-listen", metrics_listen,
                      "serve Prometheus metrics on ADDR:PORT or unix:PATH (enables [metrics])");
  backend->add_option("--idle-exit", idle_exit, "exit after this many idle seconds (0: never)")
      ->check(CLI::Range(0, 86400 * 365));
  bool direct_path = false;
  backend->add_flag("--direct-path", direct_path,
                    "let guests of one uid copy to each other themselves ([datapath] direct_path)");
  bool direct_remote = false;
  backend->add_flag("--direct-remote", direct_remote,
                    "let the libraries of a QP pair on two backends talk TCP to each other "
                    "([datapath] direct_remote)");

  bool json = false;
  std::string status_socket;
  auto* status = app.add_subcommand("status", "Show the guests and resources of the backend");
  status->add_flag("-j,--json", json, "print the backend's status document as JSON");
  status->add_option("--socket", status_socket,
                     "backend socket (default: VRDMA_SOCKET or the system one)");

  std::vector<std::string> res_words, stat_words;
  bool res_json = false, stat_json = false;
  std::string res_socket, stat_socket;
  auto* res = app.add_subcommand("res", "Resources the backend holds, as iproute2's `rdma res`");
  res->require_subcommand(1);
  auto* res_show = res->add_subcommand(
      "show",
      "vrdma res show [qp|cq|mr|pd|srq|dm|mw|xrcd] [guest NAME] [lqpn N] [KEY VALUE]... [-j]");
  res_show->add_option("args", res_words, "resource type, then KEY VALUE filters");
  res_show->add_flag("-j,--json", res_json, "JSON output (an array of objects)");
  bool res_details = false;
  res_show->add_flag("-d,--details", res_details, "also why each QP's transport was chosen");
  res_show->add_option("--socket", res_socket, "backend socket");
  auto* stat = app.add_subcommand(
      "stat", "Counters per QP and per guest: vrdma stat [qp|guest] [KEY VALUE]... [-j]");
  stat->add_option("args", stat_words, "qp or guest, then KEY VALUE filters");
  stat->add_flag("-j,--json", stat_json, "JSON output");
  stat->add_option("--socket", stat_socket, "backend socket");

  std::string mig_guest, mig_to, mig_socket;
  bool mig_json = false, mig_force = false;
  auto* migrate = app.add_subcommand(
      "migrate", "Move a guest's device to another backend on this machine, live: its QPs keep "
                 "their numbers, keys and connections");
  migrate->add_option("guest", mig_guest, "guest name")->required();
  migrate->add_option("--to", mig_to, "socket of the backend that takes it")->required();
  migrate->add_option("--socket", mig_socket, "socket of the backend that serves it now");
  migrate->add_flag("-j,--json", mig_json, "print the result as JSON");
  migrate->add_flag("--force", mig_force,
                    "move it even where a peer of its QPs could not reach it afterwards");

  std::string snap_guest, snap_file, snap_socket;
  auto* snapshot = app.add_subcommand("snapshot", "Write a guest's device state to a file");
  snapshot->add_option("guest", snap_guest, "guest name")->required();
  snapshot->add_option("file", snap_file, "file to write")->required();
  snapshot->add_option("--socket", snap_socket, "backend socket");
  bool snap_json = false;
  snapshot->add_flag("-j,--json", snap_json, "print the result as JSON");

  std::string restore_file, restore_socket;
  auto* restore = app.add_subcommand(
      "restore", "Put a guest's device back into the state a snapshot file holds (the backend "
                 "must serve the guest, with the same resources)");
  restore->add_option("file", restore_file, "snapshot file")->required();
  restore->add_option("--socket", restore_socket, "backend socket");
  bool restore_json = false;
  restore->add_flag("-j,--json", restore_json, "print the result as JSON");

  std::string cl_dir = kDefaultClusterDir, cl_name;
  int cl_days = kDefaultNodeDays;
  bool cl_force = false;
  auto* cluster = app.add_subcommand("cluster", "The CA and node certificates of backends' TLS");
  cluster->require_subcommand(1);
  auto* cl_init = cluster->add_subcommand("init", "Create the cluster CA (ca.key, ca.pem)");
  auto* cl_add = cluster->add_subcommand("add-node", "Create NAME.key and NAME.pem for a backend");
  auto* cl_show = cluster->add_subcommand("show", "List the certificates and verify each");
  for (auto* c : {cl_init, cl_add, cl_show})
    c->add_option("--dir", cl_dir, "credentials directory")->capture_default_str();
  cl_add->add_option("name", cl_name, "the backend's node name (vrdmad --node)")->required();
  cl_add->add_option("--days", cl_days, "validity in days")
      ->check(CLI::Range(1, 36500))
      ->capture_default_str();
  cl_add->add_flag("--force", cl_force, "replace an existing NAME.key and NAME.pem");
  bool cl_json = false;
  for (auto* c : {cl_init, cl_add, cl_show}) c->add_flag("-j,--json", cl_json, "JSON output");
  std::string cl_socket;
  auto* cl_status = cluster->add_subcommand(
      "status", "Nodes, addresses, leases and guests of the directory, and this backend's peers");
  cl_status->add_flag("-j,--json", cl_json, "JSON output");
  cl_status->add_option("--socket", cl_socket, "backend socket");

  std::string setup_guest = "host";
  bool setup_remove = false, setup_json = false;
  auto* setup = app.add_subcommand(
      "setup",
      "As root: /dev/infiniband/uverbs0 and /sys/class/infiniband/vrdma0 for every "
      "program of this host, also those not started through `vrdma run`");
  setup
      ->add_option("--guest", setup_guest,
                   "whose GUID, LID and GID the sysfs view shows (programs of that guest: "
                   "VRDMA_GUEST=NAME)")
      ->capture_default_str();
  setup->add_flag("--remove", setup_remove, "undo what `vrdma setup` did, exactly");
  setup->add_flag("-j,--json", setup_json, "JSON output");

  // CLI11 never sees the command of `run`: its own options (say `-v`) must stay the program's.
  std::vector<std::string> command;
  argc = split_run_command(argc, argv, command);
  // A word that names no command is said so (CLI11 would only ask for a subcommand).
  if (argc > 1 && argv[1][0] != '-') {
    bool known = false;
    std::string names;
    for (const CLI::App* sub : app.get_subcommands({})) {
      known |= sub->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      fmt::print(stderr, "vrdma: unknown command '{}' (commands: {}; vrdma --help)\n", argv[1],
                 names);
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  if (*run) {
    return cmd_run(run->count("--guest") ? std::optional(guest) : std::nullopt, run_socket, no_view,
                   command);
  }
  if (*backend) {
    return cmd_backend(backend_socket, idle_exit, config,
                       check_opt->count() ? std::optional(check_config) : std::nullopt,
                       metrics_listen, direct_path, direct_remote, backend->remaining());
  }
  if (*status) {
    return cmd_status(json, status_socket);
  }
  if (*res_show) {
    return cmd_show(false, res_words, res_json, res_details, res_socket);
  }
  if (*stat) {
    return cmd_show(true, stat_words, stat_json, false, stat_socket);
  }
  if (*migrate) {
    return cmd_migrate(mig_guest, mig_to, mig_socket, mig_force, mig_json);
  }
  if (*snapshot) {
    return cmd_snapshot(snap_guest, snap_file, snap_socket, snap_json);
  }
  if (*restore) {
    return cmd_restore(restore_file, restore_socket, restore_json);
  }
  if (*setup) {
    return cmd_setup(setup_guest, setup_remove, setup_json);
  }
  if (*cl_status) return cmd_cluster_status(cl_json, cl_socket);
  if (*cluster) {
    return cmd_cluster(cluster->get_subcommands().front()->get_name(), cl_dir, cl_name, cl_days,
                       cl_force, cl_json);
  }
  return 2;
}

}  // namespace
}  // namespace vrdma::cli

int main(int argc, char** argv) {
  try {
    return vrdma::cli::main_impl(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vrdma: %s\n", e.what());
    return 1;
  }
}
