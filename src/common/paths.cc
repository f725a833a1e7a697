#include "common/paths.h"

#include <sys/stat.h>
#include <unistd.h>

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

}  // namespace vrdma
