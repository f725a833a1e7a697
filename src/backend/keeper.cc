#include "backend/keeper.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <map>
#include <string_view>

#include "backend/activation.h"
#include "common/log.h"
#include "common/paths.h"
#include "common/socket.h"
#include "proto/command.h"

namespace vrdma::backend {

using namespace vrdma::proto;

namespace {

constexpr size_t kMaxRestarts = 10;  ///< per minute; a backend that keeps dying is let go

uint64_t now_ms() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000 + uint64_t(ts.tv_nsec) / 1000000;
}

/// Starts the backend again in its own session; it stays our child, so we see it die before it
/// has even connected (a backend killed while it starts would otherwise leave us waiting).
/// `restarts`: how many times it has been started again so far, for its `vrdma status`.
pid_t start_backend(const std::vector<std::string>& argv, uint64_t restarts) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::setsid();
  ::setenv("VRDMA_KEEPER_RESTARTS", std::to_string(restarts).c_str(), 1);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  ::execv(args[0], args.data());
  ::_exit(127);
}

/// A backend killed a moment ago may still hold its lock (`<socket>.lock`: its descriptors
/// close while it exits), and one started then would find its socket taken and exit at once.
/// Waits up to 1 s for the lock to be free. The keeper's socket is `<socket>.keeper`
/// (Server::start_keeper).
void wait_for_backend_lock(const UniqueFd& dir, const std::string& keeper_path) {
  constexpr std::string_view kSuffix = ".keeper";
  if (!keeper_path.ends_with(kSuffix)) return;
  auto lock = open_beside(dir, keeper_path.substr(0, keeper_path.size() - kSuffix.size()) + ".lock",
                          O_RDWR);
  if (!lock.is_ok()) return;
  for (int i = 0; i < 500; ++i) {
    if (::flock(lock.value().get(), LOCK_EX | LOCK_NB) == 0) return;  // closing it unlocks
    ::usleep(2000);
  }
}

}  // namespace

namespace {

/// `data` and `fds` as messages `op` (variable body), a chunk and up to kMaxFdsPerMessage each.
Status send_pieces(int sock, Op op, std::span<const uint8_t> data, std::span<const int> fds) {
  size_t off = 0, fi = 0;
  while (off < data.size() || fi < fds.size()) {
    const size_t n = std::min(kMaxImportChunk, data.size() - off);
    const size_t nf = std::min(kMaxFdsPerMessage, fds.size() - fi);
    std::vector<uint8_t> m = encode(op, 2, 0, Empty{});
    m.insert(m.end(), data.begin() + static_cast<ptrdiff_t>(off),
             data.begin() + static_cast<ptrdiff_t>(off + n));
    const uint32_t len = static_cast<uint32_t>(m.size());
    std::memcpy(m.data() + offsetof(MsgHeader, length), &len, sizeof(len));
    RETURN_IF_ERROR(send_msg(sock, m, fds.subspan(fi, nf)));
    off += n;
    fi += nf;
  }
  return Status::ok();
}

}  // namespace

Status send_state(int sock, const std::string& guest, const std::vector<uint8_t>& blob,
                  std::span<const int> fds, uint32_t flags, const CmPart* cm) {
  ImportBeginReq begin{};
  std::memcpy(begin.guest, guest.data(), std::min(guest.size(), sizeof(begin.guest) - 1));
  begin.bytes = blob.size();
  begin.fds = static_cast<uint32_t>(fds.size());
  begin.flags = flags;
  RETURN_IF_ERROR(send_msg(sock, encode(Op::kImportBegin, 1, 0, begin)));
  RETURN_IF_ERROR(send_pieces(sock, Op::kImportData, blob, fds));
  if (cm) {
    const auto* p = reinterpret_cast<const uint8_t*>(cm->json.data());
    RETURN_IF_ERROR(send_pieces(sock, Op::kImportCm, {p, cm->json.size()}, cm->fds));
  }
  return send_msg(sock, encode(Op::kImportCommit, 3, 0, Empty{}));
}

Status send_cm_state(int sock, const std::string& guest, const CmPart& cm) {
  ImportBeginReq b{};
  std::memcpy(b.guest, guest.data(), std::min(guest.size(), sizeof(b.guest) - 1));
  b.bytes = cm.json.size();
  b.fds = static_cast<uint32_t>(cm.fds.size());
  b.flags = kKeepCmOnly;
  if (sizeof(b) + cm.json.size() > kMaxImportChunk || cm.fds.size() > kMaxFdsPerMessage)
    return send_state(sock, guest, {}, {}, kKeepCmOnly, &cm);
  std::vector<uint8_t> m = encode(Op::kImportCm, 5, 0, Empty{});
  const auto* p = reinterpret_cast<const uint8_t*>(&b);
  m.insert(m.end(), p, p + sizeof(b));
  m.insert(m.end(), cm.json.begin(), cm.json.end());
  const uint32_t len = static_cast<uint32_t>(m.size());
  std::memcpy(m.data() + offsetof(MsgHeader, length), &len, sizeof(len));
  return send_msg(sock, m, cm.fds);
}

namespace {

/// The keeper's socket. Under systemd (vrdmad-keeper.socket) the listener is systemd's: one
/// keeper at a time, and the socket file is not ours to remove. Otherwise ours, under its lock;
/// `listener` stays invalid when another keeper holds the lock (one per backend). With a
/// listener, the pid file beside it is written.
struct KeeperSocket {
  UniqueFd dir;
  UniqueFd listener;
  UniqueFd lock;
  bool activated = false;
};

/// `path` becomes systemd's socket's path when it started us.
Result<KeeperSocket> open_keeper_socket(std::string& path) {
  KeeperSocket k;
  ASSIGN_OR_RETURN(k.listener, inherited_listener(path));
  k.activated = k.listener.valid();
  ASSIGN_OR_RETURN(k.dir, open_socket_dir(path, true));
  if (!k.activated) {
    ASSIGN_OR_RETURN(k.lock, open_beside(k.dir, path + ".lock", O_RDWR | O_CREAT));
    if (::flock(k.lock.get(), LOCK_EX | LOCK_NB) < 0) return k;
    unlink_beside(k.dir, path);
    ASSIGN_OR_RETURN(k.listener, listen_unix(path));
  }
  write_pid_beside(k.dir, path + ".pid");
  return k;
}

/// The next backend on `listener`; invalid when the connection is refused. The state is the
/// guests' connections and memory: only our own user may hand it over or take it back (the
/// socket's mode says the same; this holds whoever made the socket).
UniqueFd accept_backend(const UniqueFd& listener) {
  UniqueFd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  auto uid = fd.valid() ? peer_uid(fd.get()) : Result<uint32_t>(error(errno, "accept"));
  if (uid.is_ok() && uid.value() != ::geteuid()) {
    VLOG_WARN("keeper: a connection from uid {} refused (only uid {} hands over state)",
              uid.value(), ::geteuid());
    return UniqueFd();
  }
  return uid.is_ok() ? std::move(fd) : UniqueFd();
}

}  // namespace

void KeptGuests::take(Op op, const std::vector<uint8_t>& msg, std::vector<UniqueFd>& fds) {
  const std::span<const uint8_t> data{msg.data() + sizeof(MsgHeader),
                                      msg.size() - sizeof(MsgHeader)};
  switch (op) {
    case Op::kImportBegin: {
      const auto b = body_of<ImportBeginReq>(msg).value();
      partial_ = {};
      open_ = true;
      partial_guest_.assign(b.guest, strnlen(b.guest, sizeof(b.guest)));
      partial_bytes_ = b.bytes;
      partial_fds_ = b.fds;
      partial_flags_ = b.flags;
      break;
    }
    case Op::kImportData:
      partial_.blob.insert(partial_.blob.end(), data.begin(), data.end());
      for (UniqueFd& f : fds) partial_.fds.push_back(std::move(f));
      break;
    case Op::kImportCm: {
      if (open_) {
        partial_.cm.append(data.begin(), data.end());
        for (UniqueFd& f : fds) partial_.cm_fds.push_back(std::move(f));
        break;
      }
      // Alone (send_cm_state): what a kKeepCmOnly record would say, in one message.
      ImportBeginReq b;
      if (data.size() < sizeof(b)) break;
      std::memcpy(&b, data.data(), sizeof(b));
      auto it = kept_.find(std::string(b.guest, strnlen(b.guest, sizeof(b.guest))));
      if (it == kept_.end() || !(b.flags & kKeepCmOnly) || b.bytes != data.size() - sizeof(b) ||
          b.fds != fds.size())
        break;
      it->second.cm.assign(data.begin() + sizeof(b), data.end());
      it->second.cm_fds = std::move(fds);
      break;
    }
    case Op::kImportCommit: {
      const bool whole =
          partial_.blob.size() == partial_bytes_ && partial_.fds.size() == partial_fds_;
      auto it = kept_.find(partial_guest_);
      if (whole && !(partial_flags_ & kKeepCmOnly)) {
        kept_[partial_guest_] = std::move(partial_);  // the device and its CM state
      } else if (whole && it != kept_.end()) {
        it->second.cm = std::move(partial_.cm);  // its CM state alone changed
        it->second.cm_fds = std::move(partial_.cm_fds);
      }
      partial_ = {};
      open_ = false;
      break;
    }
    case Op::kKeepDrop: {
      const auto b = body_of<KeepDropReq>(msg).value();
      kept_.erase(std::string(b.guest, strnlen(b.guest, sizeof(b.guest))));
      break;
    }
    default:
      break;
  }
}

void KeptGuests::hand_back(int sock) const {
  for (const auto& [guest, r] : kept_) {
    std::vector<int> raw, cm_raw;
    for (const UniqueFd& f : r.fds) raw.push_back(f.get());
    for (const UniqueFd& f : r.cm_fds) cm_raw.push_back(f.get());
    const CmPart cm{r.cm, cm_raw};
    if (Status s =
            send_state(sock, guest, r.blob, raw, kImportRecover, r.cm.empty() ? nullptr : &cm);
        !s.is_ok())
      VLOG_WARN("keeper: handing guest {} back: {}", guest, s.message());
  }
  (void)send_msg(sock, encode(Op::kKeepEnd, 4, 0, Empty{}));
}

int run_keeper(std::string path, int grace_s, std::vector<std::string> backend_argv) {
  auto sock = open_keeper_socket(path);
  if (!sock.is_ok()) {
    VLOG_ERROR("keeper: {}", sock.status().message());
    return 1;
  }
  if (!sock.value().listener.valid()) return 0;  // one per backend
  const bool activated = sock.value().activated;
  const UniqueFd& dir = sock.value().dir;
  const UniqueFd& listener = sock.value().listener;
  ::signal(SIGPIPE, SIG_IGN);
  KeptGuests kept;
  UniqueFd backend;
  // The backend's transport listener (kKeepListener): open while it restarts, so that its host
  // accepts peers' connections and their QPs wait as for a slow backend, not a gone one.
  UniqueFd transport_listener;
  uint64_t deadline = now_ms() + uint64_t(grace_s) * 1000;  // for the first backend to connect
  std::deque<uint64_t> restarts;
  uint64_t restarted = 0;  ///< backends started again, in all
  pid_t started = -1;  ///< the backend we started last, until it connects
  // Starts the backend again unless it keeps dying; true when one was started.
  auto restart = [&](const char* why) {
    const uint64_t now = now_ms();
    while (!restarts.empty() && now - restarts.front() > 60000) restarts.pop_front();
    deadline = now + uint64_t(grace_s) * 1000;
    if (restarts.size() >= kMaxRestarts || backend_argv.empty()) {
      VLOG_WARN("keeper: {}; waiting {} s for a backend to come back", why, grace_s);
      return false;
    }
    restarts.push_back(now);
    VLOG_WARN("keeper: {}; starting it again for {} guest(s)", why, kept.size());
    wait_for_backend_lock(dir, path);
    started = start_backend(backend_argv, ++restarted);
    return true;
  };
  auto finish = [&](int rc) {
    if (!activated) unlink_beside(dir, path);
    unlink_beside(dir, path + ".pid");
    return rc;
  };
  VLOG_INFO("keeper: holding guests' state for the backend at {}{}", path,
            activated ? " (socket activation: systemd restarts the backend)" : "");
  for (;;) {
    pollfd p[2] = {{listener.get(), POLLIN, 0}, {backend.get(), POLLIN, 0}};
    int timeout = -1;
    // Reap what we started; one that died before it connected is started again.
    for (pid_t p; (p = ::waitpid(-1, nullptr, WNOHANG)) > 0;) {
      if (p == started && !backend.valid()) {
        started = -1;
        restart("the backend died before it connected");
      } else if (p == started) {
        started = -1;
      }
    }
    if (!backend.valid()) {
      const uint64_t now = now_ms();
      if (now >= deadline) {
        if (!kept.empty())
          VLOG_WARN("keeper: no backend came back within {} s; letting {} guest(s) go", grace_s,
                    kept.size());
        return finish(kept.empty() ? 0 : 1);
      }
      timeout = static_cast<int>(std::min<uint64_t>(deadline - now, 100));
    }
    if (::poll(p, backend.valid() ? 2 : 1, timeout) < 0 && errno != EINTR) return finish(1);
    if (p[0].revents & POLLIN) {
      if (UniqueFd fd = accept_backend(listener); fd.valid()) {
        backend = std::move(fd);  // a new backend takes over
        kept.drop_partial();
        started = -1;  // whichever it is, one connected: its death shows as EOF from now on
      }
      continue;
    }
    if (!backend.valid() || !(p[1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    std::vector<uint8_t> msg;
    std::vector<UniqueFd> fds;
    Status st = recv_msg(backend.get(), msg, kMaxImportMessage, fds);
    auto h = st.is_ok() ? decode_request(msg) : Result<MsgHeader>(st);
    if (!h.is_ok()) {
      backend.reset();
      kept.drop_partial();
      if (kept.empty()) return finish(0);
      // The backend died (no goodbye): start it again, holding on to its guests meanwhile.
      restart("backend gone without a goodbye");
      continue;
    }
    switch (const Op op = static_cast<Op>(h.value().op)) {
      case Op::kKeepBye:
        return finish(0);
      case Op::kKeepRestore:
        kept.hand_back(backend.get());
        break;
      case Op::kKeepListener:
        if (!fds.empty()) transport_listener = std::move(fds.front());
        break;
      case Op::kKeepListenerAsk: {
        const int l = transport_listener.get();
        (void)send_msg(backend.get(), encode(Op::kKeepListener, 1, 0, Empty{}),
                       l >= 0 ? std::span<const int>(&l, 1) : std::span<const int>());
        break;
      }
      default:
        kept.take(op, msg, fds);
        break;
    }
  }
}

}  // namespace vrdma::backend
