#include "common/paths.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "common/socket.h"
#include "proto/command.h"

extern char** environ;

namespace vrdma {

namespace {

std::string dir_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) { return path.substr(path.rfind('/') + 1); }

/// " (owner uid U, group gid G, mode 0NNN)" of `path`, or "" when it cannot be seen.
std::string owner_and_mode(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  return fmt::format(" (owner uid {}, group gid {}, mode {:04o})", st.st_uid, st.st_gid,
                     st.st_mode & 07777);
}

uint64_t mono_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000 + uint64_t(ts.tv_nsec) / 1000000;
}

/// Whether process `pid` still runs (not gone, not a zombie waiting for its new parent).
bool running(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;
  const auto paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] != 'Z' &&
         line[paren + 2] != 'X';
}

/// The last non-empty line of the file `path` (its last 4 KiB), or "".
std::string last_line(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  f.seekg(0, std::ios::end);
  const std::streamoff size = f.tellg();
  const std::streamoff from = size > 4096 ? size - 4096 : 0;
  f.seekg(from);
  std::string tail(static_cast<size_t>(size - from), '\0');
  f.read(tail.data(), static_cast<std::streamsize>(tail.size()));
  while (!tail.empty() && (tail.back() == '\n' || tail.back() == '\r')) tail.pop_back();
  return tail.substr(tail.rfind('\n') + 1);
}

/// The process serving the connected backend socket `fd`: the listener's creator (SO_PEERCRED),
/// or, when that is systemd (socket activation), the pid the backend wrote beside `sock`.
pid_t serving_pid(int fd, const std::string& sock) {
  auto cred = peer_cred(fd);
  pid_t pid = cred.is_ok() ? static_cast<pid_t>(cred.value().pid) : 0;
  if (pid == 1) {
    std::ifstream f(sock + ".pid");
    pid_t p = 0;
    if (f >> p && p > 0) pid = p;
  }
  return pid;
}

}  // namespace

std::string socket_path() {
  if (const char* e = ::secure_getenv("VRDMA_SOCKET"); e && *e) return e;
  return default_socket_path();
}

std::string default_socket_path() {
  if (::geteuid() == 0) return "/run/vrdma/vrdmad.sock";
  if (const char* x = ::secure_getenv("XDG_RUNTIME_DIR"); x && *x)
    return std::string(x) + "/vrdma/vrdmad.sock";
  return "/tmp/vrdma-" + std::to_string(::geteuid()) + "/vrdmad.sock";
}

Result<UniqueFd> connect_backend_socket(const std::string& path, int send_timeout_ms) {
  if (path == default_socket_path()) {
    auto dir = open_socket_dir(path, false);
    if (!dir.is_ok() && dir.err() != ENOENT) return dir.status();
  }
  return connect_unix(path, send_timeout_ms);
}

Status check_guest_name(std::string_view name) {
  constexpr size_t kMaxLen = proto::kGuestNameMax - 1;
  const auto bad = [&](const std::string& what) {
    std::string shown;
    for (unsigned char c : name.substr(0, kMaxLen + 8))
      shown += c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c))
                                     : fmt::format("\\x{:02x}", c);
    if (name.size() > kMaxLen + 8) shown += "...";
    return error(EINVAL, fmt::format("guest name '{}' {}: a guest name is 1 to {} bytes of "
                                     "letters, digits and . _ - : @ +, not starting with -",
                                     shown, what, kMaxLen));
  };
  if (name.empty()) return bad("is empty");
  if (name.size() > kMaxLen) return bad(fmt::format("is {} bytes long", name.size()));
  if (name.front() == '-') return bad("starts with - (it would read as an option)");
  for (unsigned char c : name) {
    if (std::isalnum(c) && c < 0x80) continue;
    if (std::strchr("._-:@+", c) && c != 0) continue;
    if (c == ' ') return bad("has a space");
    return bad(c >= 0x21 && c < 0x7f ? fmt::format("has '{}'", static_cast<char>(c))
                                     : fmt::format("has the byte 0x{:02x}", c));
  }
  return Status::ok();
}

Result<std::string> guest_name() {
  if (const char* e = ::secure_getenv("VRDMA_GUEST")) {
    if (Status st = check_guest_name(e); !st.is_ok())
      return error(st.err(), "VRDMA_GUEST: " + st.message());
    return std::string(e);
  }
  return "pgrp-" + std::to_string(::getpgrp());
}

Result<UniqueFd> open_socket_dir(const std::string& socket_path, bool create) {
  const std::string dir = dir_of(socket_path);
  if (create) {
    // mkdir -p, one level at a time; the last level is checked below, whoever made it.
    for (size_t i = 1; i < dir.size(); ++i) {
      if (dir[i] == '/') ::mkdir(dir.substr(0, i).c_str(), 0700);
    }
    // Root's default directory as vrdmad.socket makes it (DirectoryMode=0755, whatever the
    // umask): the socket's own mode says who may connect. Any other stays its user's alone.
    const bool system_dir = ::geteuid() == 0 && dir == "/run/vrdma";
    if (::mkdir(dir.c_str(), system_dir ? 0755 : 0700) == 0 && system_dir)
      ::chmod(dir.c_str(), 0755);
  }
  UniqueFd fd(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) {
    const int e = errno;
    if (e == ENOENT) return error(ENOENT, dir + " does not exist");
    if (e == ELOOP || e == ENOTDIR)
      return error(EPERM, fmt::format("{} is not a directory but a symlink or a file: another "
                                      "user may have planted it; remove it",
                                      dir));
    return error(e, fmt::format("open {}: {}", dir, std::strerror(e)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) < 0) return error(errno, "fstat " + dir);
  const uid_t me = ::geteuid();
  if (st.st_uid != me && st.st_uid != 0)
    return error(EPERM, fmt::format("{} belongs to uid {}, not to you (uid {}) or root: another "
                                    "user may have made it to serve your device; remove it, or "
                                    "set XDG_RUNTIME_DIR or VRDMA_SOCKET to a directory of yours",
                                    dir, st.st_uid, me));
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    return error(EPERM, fmt::format("{} is writable by other users (mode {:04o}): they could "
                                    "replace the backend's socket or its files; chmod go-w it, "
                                    "or use a private directory (VRDMA_SOCKET)",
                                    dir, st.st_mode & 07777));
  return fd;
}

Result<UniqueFd> open_beside(const UniqueFd& dir, const std::string& path, int flags) {
  UniqueFd fd(::openat(dir.get(), base_of(path).c_str(), flags | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) {
    const int e = errno;
    return error(e, fmt::format("open {}: {}{}", path, std::strerror(e),
                                e == ELOOP ? " (a symlink: not followed; remove it)" : ""));
  }
  return fd;
}

void write_pid_beside(const UniqueFd& dir, const std::string& path) {
  auto f = open_beside(dir, path, O_WRONLY | O_CREAT | O_TRUNC);
  if (!f.is_ok()) return;
  const std::string s = std::to_string(::getpid()) + "\n";
  ssize_t n = ::write(f.value().get(), s.data(), s.size());
  (void)n;
}

void unlink_beside(const UniqueFd& dir, const std::string& path) {
  ::unlinkat(dir.get(), base_of(path).c_str(), 0);
}

std::string backend_unreachable_hint(const std::string& path, int err) {
  if (err == EPERM) {
    // The directory, when it is what is wrong, says so itself.
    if (auto dir = open_socket_dir(path, false); !dir.is_ok() && dir.err() == EPERM)
      return dir.status().message();
  }
  if (err == EACCES || err == EPERM) {
    // The socket's mode, or, when even that cannot be seen, its directory's.
    std::string who = owner_and_mode(path);
    if (who.empty()) {
      const std::string dir = dir_of(path);
      if (std::string d = owner_and_mode(dir); !d.empty())
        who = fmt::format(": its directory {}{} is closed to you", dir, d);
    }
    const std::string mine = default_socket_path();
    return fmt::format(
        "permission denied on {}{}: run as the backend's user or a member of its group "
        "(vrdmad.socket: SocketGroup=), or use a backend of your own{}",
        path, who,
        mine == path ? std::string(" (VRDMA_SOCKET)")
                     : fmt::format(" at your default socket {} (unset VRDMA_SOCKET; `vrdma run` "
                                   "starts one there)",
                                   mine));
  }
  if (err == ENOENT || err == ECONNREFUSED) {
    return "nothing listens on " + path +
           ": start a backend (`vrdma backend`, or `systemctl start vrdmad.socket`), run the "
           "program through `vrdma run` (it starts one), or set VRDMA_SOCKET to a running "
           "backend's socket";
  }
  return "cannot connect to " + path + ": check VRDMA_SOCKET and that vrdmad runs";
}

Result<StartedBackend> start_backend(const std::string& bin, const std::string& sock,
                                     int idle_exit_s) {
  if (::access(bin.c_str(), X_OK) != 0) return error(ENOENT, bin + " is not executable");
  ASSIGN_OR_RETURN(UniqueFd dir, open_socket_dir(sock, true));
  StartedBackend out;
  out.log = dir_of(sock) + "/vrdmad.log";
  // One older generation is kept: a log that outgrew the limit starts again (a backend started
  // on demand lives until idle; a long-lived one runs under systemd, whose journal rotates).
  if (struct stat st{}; ::fstatat(dir.get(), "vrdmad.log", &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                        S_ISREG(st.st_mode) && st.st_size > kBackendLogRotateBytes)
    ::renameat(dir.get(), "vrdmad.log", dir.get(), "vrdmad.log.1");
  auto log = open_beside(dir, out.log, O_WRONLY | O_CREAT | O_APPEND);
  // Everything the child needs is made before fork(): after it, only async-signal-safe calls.
  const std::string idle = std::to_string(idle_exit_s);
  const char* argv[] = {bin.c_str(),  "--socket",    sock.c_str(), "--idle-exit",
                        idle.c_str(), "--on-demand", nullptr};
  std::vector<char*> envp;
  for (char** e = environ; e && *e; ++e)
    if (std::strncmp(*e, "LD_PRELOAD=", 11) != 0) envp.push_back(*e);
  envp.push_back(nullptr);
  const int log_fd = log.is_ok() ? log.value().get() : -1;
  const bool absolute = !sock.empty() && sock.front() == '/';
  int p[2];
  if (::pipe2(p, O_CLOEXEC) < 0) return error(errno, fmt::format("pipe: {}", std::strerror(errno)));
  UniqueFd pid_in(p[0]), pid_out(p[1]);
  const pid_t child = ::fork();
  if (child < 0) return error(errno, fmt::format("fork: {}", std::strerror(errno)));
  if (child == 0) {
    // Intermediate child: a new session, then fork again so the daemon is no session leader
    // and is reparented when this one exits; it tells us the daemon's pid.
    ::setsid();
    const pid_t daemon = ::fork();
    if (daemon != 0) {
      if (daemon > 0 && ::write(p[1], &daemon, sizeof(daemon)) != sizeof(daemon)) ::_exit(1);
      ::_exit(daemon < 0 ? 1 : 0);
    }
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    if (log_fd >= 0) {
      ::dup2(log_fd, STDOUT_FILENO);
      ::dup2(log_fd, STDERR_FILENO);
    }
    // Keep none of the caller's descriptors (a test harness's pipe, say) alive in the daemon.
    ::close_range(3, ~0U, 0);
    // A relative socket path stays relative to where the caller runs.
    if (absolute && ::chdir("/") != 0) {
    }
    ::execve(bin.c_str(), const_cast<char* const*>(argv), envp.data());
    ::_exit(127);
  }
  pid_out.reset();
  int wstatus = 0;
  while (::waitpid(child, &wstatus, 0) < 0 && errno == EINTR) {
  }
  ssize_t n;
  do {
    n = ::read(pid_in.get(), &out.pid, sizeof(out.pid));
  } while (n < 0 && errno == EINTR);
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0 || n != sizeof(out.pid) || out.pid <= 0)
    return error(EAGAIN, "could not detach the backend (fork failed)");
  return out;
}

Result<UniqueFd> await_backend(const std::string& sock, const StartedBackend& started,
                               int timeout_ms, int send_timeout_ms) {
  const uint64_t deadline = mono_ms() + static_cast<uint64_t>(timeout_ms);
  // Once it has exited, a backend that won the race against it may still be binding.
  constexpr uint64_t kRaceGraceMs = 500;
  uint64_t gone_at = 0;
  for (;;) {
    auto r = connect_backend_socket(sock, send_timeout_ms);
    if (r.is_ok() || !no_backend_there(r.err())) return r;
    const uint64_t now = mono_ms();
    if (!gone_at && !running(started.pid)) gone_at = now;
    if (gone_at && now - gone_at >= kRaceGraceMs) {
      const std::string last = last_line(started.log);
      return error(ECHILD,
                   fmt::format("the backend it started (pid {}) exited{}; its log is {}",
                               started.pid, last.empty() ? "" : ": \"" + last + "\"", started.log));
    }
    if (now >= deadline)
      return error(ETIMEDOUT, fmt::format("the backend it started (pid {}) does not listen on {} "
                                          "after {} ms; its log is {}",
                                          started.pid, sock, timeout_ms, started.log));
    timespec ts{0, 10 * 1000 * 1000};
    ::nanosleep(&ts, nullptr);
  }
}

std::string not_answering(int fd, const std::string& sock, int timeout_ms) {
  const pid_t pid = serving_pid(fd, sock);
  return fmt::format(
      "backend pid {} does not answer on {} within {} ms: it is stopped (SIGSTOP, "
      "a debugger) or hung; `kill -CONT {}`, or stop it and start another",
      pid, sock, timeout_ms, pid);
}

Result<BackendStatus> backend_status(const std::string& sock, int timeout_ms) {
  ASSIGN_OR_RETURN(UniqueFd fd, connect_backend_socket(sock, timeout_ms));
  BackendStatus out;
  out.pid = serving_pid(fd.get(), sock);
  constexpr uint32_t kSeq = 1;
  std::vector<uint8_t> buf;
  std::vector<UniqueFd> got;
  Status st = call_msg(fd.get(), proto::encode(proto::Op::kStatus, kSeq, 0, proto::StatusReq{}), {},
                       buf, proto::kMaxResponse, got, timeout_ms);
  if (st.err() == ETIMEDOUT) return error(ETIMEDOUT, not_answering(fd.get(), sock, timeout_ms));
  if (!st.is_ok())
    return error(st.err(), fmt::format("asking {} for its status: {}", sock, st.message()));
  auto hdr = proto::decode_header(buf);
  if (!hdr) return error(EPROTO, fmt::format("bad status response: {}", hdr.status().message()));
  if (hdr->op != static_cast<uint16_t>(proto::Op::kStatus) || hdr->seq != kSeq)
    return error(EPROTO, fmt::format("status response does not match the request (op {}, seq {})",
                                     hdr->op, hdr->seq));
  if (hdr->status != 0)
    return error(-hdr->status, fmt::format("the backend refused the status request: {}",
                                           std::strerror(-hdr->status)));
  const size_t off = sizeof(proto::MsgHeader);
  uint32_t len = 0;
  if (buf.size() < off + sizeof(len))
    return error(EPROTO, fmt::format("status response too short ({} bytes)", buf.size()));
  std::memcpy(&len, buf.data() + off, sizeof(len));
  if (buf.size() - off - sizeof(len) < len)
    return error(EPROTO, fmt::format("status response truncated ({} of {} JSON bytes)",
                                     buf.size() - off - sizeof(len), len));
  out.json.assign(reinterpret_cast<const char*>(buf.data() + off + sizeof(len)), len);
  return out;
}

}  // namespace vrdma
