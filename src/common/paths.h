// Where things live: the backend's socket (VRDMA_SOCKET, else /run/vrdma/vrdmad.sock for root,
// else $XDG_RUNTIME_DIR/vrdma or /tmp/vrdma-UID), and the guest name of this process.
#pragma once

#include <string>

namespace vrdma {

std::string socket_path();
/// VRDMA_GUEST if set, else "pgrp-<process group id>" (one guest per process group).
std::string guest_name();
/// Creates the parent directory of `path` (mode 0700 when it creates it).
void ensure_parent_dir(const std::string& path);
/// What to do when connecting to the backend's socket `path` failed with `err`: one sentence
/// for the user's first mistakes (no backend, permission denied, wrong socket).
std::string backend_unreachable_hint(const std::string& path, int err);

}  // namespace vrdma
