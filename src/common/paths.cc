#include "common/paths.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/socket.h"

namespace vrdma {

namespace {

std::string dir_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) { return path.substr(path.rfind('/') + 1); }

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

std::string guest_name() {
  if (const char* e = ::secure_getenv("VRDMA_GUEST"); e && *e) return e;
  return "pgrp-" + std::to_string(::getpgrp());
}

Result<UniqueFd> open_socket_dir(const std::string& socket_path, bool create) {
  const std::string dir = dir_of(socket_path);
  if (create) {
    // mkdir -p, one level at a time; the last level is checked below, whoever made it.
    for (size_t i = 1; i <= dir.size(); ++i) {
      if (i == dir.size() || dir[i] == '/') ::mkdir(dir.substr(0, i).c_str(), 0700);
    }
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
    struct stat st{};
    std::string who;
    if (::stat(path.c_str(), &st) == 0) {
      who = " (owner uid " + std::to_string(st.st_uid) + ", group gid " + std::to_string(st.st_gid) +
            ")";
    }
    return "permission denied on " + path + who +
           ": run as the backend's user or a member of its group (vrdmad.socket: SocketGroup=), "
           "or use a backend of your own with VRDMA_SOCKET=$XDG_RUNTIME_DIR/vrdma/vrdmad.sock";
  }
  if (err == ENOENT || err == ECONNREFUSED) {
    return "nothing listens on " + path +
           ": start a backend (`vrdma backend`, or `systemctl start vrdmad.socket`), run the "
           "program through `vrdma run` (it starts one), or set VRDMA_SOCKET to a running "
           "backend's socket";
  }
  return "cannot connect to " + path + ": check VRDMA_SOCKET and that vrdmad runs";
}

}  // namespace vrdma
