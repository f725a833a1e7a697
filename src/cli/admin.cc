// The operator's requests to a backend: migrate, snapshot, restore (admin.h).
#include "cli/admin.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <span>
#include <thread>
#include <vector>

#include "cli/show.h"
#include "common/paths.h"
#include "common/socket.h"
#include "proto/command.h"

namespace vrdma::cli {

int wait_ms(int fallback) {
  const char* e = std::getenv("VRDMA_TIMEOUT_MS");
  if (!e || !*e) return fallback;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  return *end == '\0' && v >= 0 && v <= 86400000 ? static_cast<int>(v) : fallback;
}

namespace {

/// Sends one operator request (with descriptors) to the backend at `socket` and returns the
/// response body, or why not: the backend's own reason when it refused.
template <typename Resp, typename Req>
Result<Resp> admin_request_once(const std::string& socket, proto::Op op, const Req& req,
                                std::span<const int> fds, int timeout_ms) {
  auto sock = connect_backend_socket(socket, timeout_ms);
  if (!sock) {
    const int err = sock.status().err();
    if (err == EACCES || err == EPERM) return error(err, backend_unreachable_hint(socket, err));
    return error(err, fmt::format("no backend is running at {} ({}); {}", socket,
                                  sock.status().message(), backend_unreachable_hint(socket, err)));
  }
  std::vector<uint8_t> buf;
  std::vector<UniqueFd> got;
  Status st = call_msg(sock->get(), proto::encode(op, 1, 0, req), fds, buf, proto::kMaxRequest, got,
                       timeout_ms);
  if (st.err() == ETIMEDOUT)
    return error(ETIMEDOUT, not_answering(sock->get(), socket, timeout_ms));
  if (!st) return error(st.err(), fmt::format("talking to {}: {}", socket, st.message()));
  auto hdr = proto::decode_header(buf);
  if (!hdr || hdr->op != static_cast<uint16_t>(op))
    return error(EPROTO, fmt::format("bad response from {}", socket));
  if (hdr->status != 0) {
    const std::string why = proto::reason_of(buf);
    return error(-hdr->status, fmt::format("the backend at {} refused: {}", socket,
                                           why.empty() ? fmt::format("{} (its log says why)",
                                                                     std::strerror(-hdr->status))
                                                       : why));
  }
  auto body = proto::body_of<Resp>(buf);
  if (!body) return error(EPROTO, fmt::format("malformed response from {}", socket));
  return body.value();
}

/// admin_request_once, asked again while the backend answers EINPROGRESS (the guest's QPs are
/// leaving the direct path across backends: their libraries settle what is in flight first),
/// within the same wait.
template <typename Resp, typename Req>
Result<Resp> admin_request(const std::string& socket, proto::Op op, const Req& req,
                           std::span<const int> fds = {}) {
  const int timeout_ms = wait_ms(kAdminWaitMs);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    auto r = admin_request_once<Resp>(socket, op, req, fds, timeout_ms);
    if (r || r.status().err() != EINPROGRESS || std::chrono::steady_clock::now() >= until) return r;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

/// Copies the guest name `v` into the request's field, or says what is wrong with it.
template <size_t N>
bool put_guest(char (&dst)[N], const std::string& v, const char* cmd) {
  static_assert(N == proto::kGuestNameMax);
  if (Status st = check_guest_name(v); !st) {
    fmt::print(stderr, "vrdma {}: {}\n", cmd, st.message());
    return false;
  }
  std::memcpy(dst, v.data(), v.size());
  return true;
}

/// Prints why an operator command failed; its exit code.
int admin_failed(const char* cmd, const Status& st) {
  fmt::print(stderr, "vrdma {}: {}\n", cmd, st.message());
  return 1;
}

}  // namespace

int cmd_migrate(const std::string& guest, const std::string& to, const std::string& socket_opt,
                bool force, bool json) {
  const std::string socket = socket_opt.empty() ? socket_path() : socket_opt;
  proto::MigrateReq req{};
  if (!put_guest(req.guest, guest, "migrate")) return 2;
  if (to.empty() || to.size() >= sizeof(req.target)) {
    fmt::print(stderr, "vrdma migrate: the target socket path must be 1..{} bytes\n",
               sizeof(req.target) - 1);
    return 2;
  }
  std::memcpy(req.target, to.data(), to.size());
  // A move the guest's peers could not follow would look like success and then fail their
  // QPs (retry counter exceeded): both backends' status say whether each peer stays reachable.
  // Where either does not answer, the move's own request below says why.
  auto status_of = [](const std::string& sock) {
    auto st = backend_status(sock, wait_ms(kStatusWaitMs));
    return st ? nlohmann::json::parse(st->json, nullptr, /*allow_exceptions=*/false)
              : nlohmann::json();
  };
  const nlohmann::json from_status = status_of(socket);
  const nlohmann::json to_status = to != socket ? status_of(to) : nlohmann::json();
  auto node_of = [](const nlohmann::json& st) {
    const auto b = st.is_object() ? st.find("backend") : st.end();
    return b != st.end() && b->is_object() ? b->value("node", std::string()) : std::string();
  };
  auto name_of = [&](const std::string& sock, const nlohmann::json& st) {
    const std::string node = node_of(st);
    return node.empty() ? sock : fmt::format("{} (node {})", sock, node);
  };
  if (std::string why = from_status.is_object() && to_status.is_object()
                            ? stranded_by_move(from_status, to_status, guest)
                            : std::string();
      !why.empty()) {
    if (!force) {
      fmt::print(stderr,
                 "vrdma migrate: refused: {}. Give both backends [transport] listen and each "
                 "other as peers, or move it anyway with --force\n",
                 why);
      return 1;
    }
    fmt::print(stderr, "vrdma migrate: --force: {}\n", why);
  }
  auto r = admin_request<proto::MigrateResp>(socket, proto::Op::kMigrate, req);
  if (!r) return admin_failed("migrate", r.status());
  if (json) {
    fmt::print("{}\n", nlohmann::json{{"guest", guest},
                                      {"from", socket},
                                      {"from_node", node_of(from_status)},
                                      {"to", to},
                                      {"to_node", node_of(to_status)},
                                      {"downtime_us", r->downtime_us},
                                      {"answered_us", r->answered_us},
                                      {"export_us", r->export_us},
                                      {"transfer_us", r->transfer_us},
                                      {"import_us", r->import_us},
                                      {"bytes", r->bytes},
                                      {"qps", r->qps},
                                      {"fds", r->fds}}
                           .dump());
  } else {
    fmt::print(
        "guest {} moved from {} to {}: downtime {} us (export {} us, transfer {} us, import {} "
        "us); {} QPs, {} of state, {} descriptors\n",
        guest, name_of(socket, from_status), name_of(to, to_status), r->downtime_us, r->export_us,
        r->transfer_us, r->import_us, r->qps, cli::size_text(r->bytes), r->fds);
  }
  return 0;
}

int cmd_snapshot(const std::string& guest, const std::string& file, const std::string& socket_opt,
                 bool json) {
  const std::string socket = socket_opt.empty() ? socket_path() : socket_opt;
  proto::SnapshotReq req{};
  if (!put_guest(req.guest, guest, "snapshot")) return 2;
  // Written beside FILE and renamed over it once whole: a failed snapshot leaves nothing.
  std::string tmp = file + ".partXXXXXX";
  UniqueFd f(::mkostemp(tmp.data(), O_CLOEXEC));
  if (!f.valid()) {
    fmt::print(stderr, "vrdma snapshot: cannot create {} beside {}: {}\n", tmp, file,
               std::strerror(errno));
    return 1;
  }
  const int fd = f.get();
  auto r = admin_request<proto::SnapshotResp>(socket, proto::Op::kSnapshot, req, {&fd, 1});
  if (r && ::fsync(fd) == 0 && ::rename(tmp.c_str(), file.c_str()) == 0) {
    if (json) {
      fmt::print("{}\n", nlohmann::json{{"guest", guest},
                                        {"file", file},
                                        {"bytes", r->bytes},
                                        {"qps", r->qps},
                                        {"pause_us", r->pause_us}}
                             .dump());
      return 0;
    }
    fmt::print("guest {}: {} of device state ({} QPs) in {}; its QPs were held {} us\n", guest,
               cli::size_text(r->bytes), r->qps, file, r->pause_us);
    return 0;
  }
  const Status st =
      r ? error(errno, fmt::format("{}: {}", file, std::strerror(errno))) : r.status();
  ::unlink(tmp.c_str());
  return admin_failed("snapshot", st);
}

int cmd_restore(const std::string& file, const std::string& socket_opt, bool json) {
  const std::string socket = socket_opt.empty() ? socket_path() : socket_opt;
  UniqueFd f(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!f.valid()) {
    fmt::print(stderr, "vrdma restore: {}: {}\n", file, std::strerror(errno));
    return 1;
  }
  const int fd = f.get();
  auto r =
      admin_request<proto::ImportResp>(socket, proto::Op::kRestore, proto::RestoreReq{}, {&fd, 1});
  if (!r) return admin_failed("restore", r.status());
  if (json) {
    fmt::print(
        "{}\n",
        nlohmann::json{
            {"file", file}, {"sessions", r->sessions}, {"qps", r->qps}, {"pause_us", r->import_us}}
            .dump());
    return 0;
  }
  fmt::print("restored {}: {} session(s), {} QPs; the guest's QPs were held {} us\n", file,
             r->sessions, r->qps, r->import_us);
  return 0;
}

}  // namespace vrdma::cli
