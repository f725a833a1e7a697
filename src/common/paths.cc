#include "common/paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>

namespace vrdma {

std::string socket_path() {
  if (const char* e = std::getenv("VRDMA_SOCKET"); e && *e) return e;
  if (::geteuid() == 0) return "/run/vrdma/vrdmad.sock";
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x && *x)
    return std::string(x) + "/vrdma/vrdmad.sock";
  return "/tmp/vrdma-" + std::to_string(::geteuid()) + "/vrdmad.sock";
}

std::string guest_name() {
  if (const char* e = std::getenv("VRDMA_GUEST"); e && *e) return e;
  return "pgrp-" + std::to_string(::getpgrp());
}

void ensure_parent_dir(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos || slash == 0) return;
  std::string dir = path.substr(0, slash);
  // mkdir -p, one level at a time.
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') ::mkdir(dir.substr(0, i).c_str(), 0700);
  }
}

std::string backend_unreachable_hint(const std::string& path, int err) {
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
