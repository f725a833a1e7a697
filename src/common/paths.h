// Where things live: the backend's socket (VRDMA_SOCKET, else /run/vrdma/vrdmad.sock for root,
// else $XDG_RUNTIME_DIR/vrdma or /tmp/vrdma-UID), and the guest name of this process.
#pragma once

#include <string>

#include "common/status.h"
#include "common/unique_fd.h"

namespace vrdma {

/// VRDMA_* and XDG_RUNTIME_DIR are read with secure_getenv: a setuid or otherwise AT_SECURE
/// program that loads the library ignores them (and never starts a backend).
std::string socket_path();
/// socket_path() without VRDMA_SOCKET: /run/vrdma/vrdmad.sock for root, else
/// $XDG_RUNTIME_DIR/vrdma/vrdmad.sock or /tmp/vrdma-UID/vrdmad.sock.
std::string default_socket_path();
/// Connects to the backend's socket `path`. At the default path, whose directory another user
/// could have made first, the directory is checked (open_socket_dir) before anything that
/// listens there is trusted with our memory: EPERM and why when it fails. `send_timeout_ms`: as
/// connect_unix().
Result<UniqueFd> connect_backend_socket(const std::string& path, int send_timeout_ms = 0);
/// VRDMA_GUEST if set, else "pgrp-<process group id>" (one guest per process group).
std::string guest_name();
/// The directory holding the backend's socket `socket_path` and the files beside it (lock, pid
/// file, log), checked before anything in it is trusted: with `create`, made (0700, and any
/// missing parents) when missing. It must be a directory, not a symlink, owned by the effective
/// uid or by root, and writable by no one else: otherwise another user who made it first
/// (/tmp/vrdma-UID, where there is no XDG_RUNTIME_DIR) could serve our device or point our files
/// at theirs. EPERM with what is wrong and what to do; ENOENT when missing and not `create`.
/// Returns it open (O_PATH), for open_beside().
Result<UniqueFd> open_socket_dir(const std::string& socket_path, bool create);
/// Opens the file `path` (beside the socket: its last component is looked up in `dir`, from
/// open_socket_dir) with `flags` | O_NOFOLLOW | O_CLOEXEC, mode 0600 when it creates it: a
/// symlink planted there fails with ELOOP instead of being followed.
Result<UniqueFd> open_beside(const UniqueFd& dir, const std::string& path, int flags);
/// Replaces the file `path` in `dir` with "PID\n" (the pid files beside the socket).
void write_pid_beside(const UniqueFd& dir, const std::string& path);
/// Removes the file `path` from `dir` (not following anything).
void unlink_beside(const UniqueFd& dir, const std::string& path);
/// What to do when connecting to the backend's socket `path` failed with `err`: one sentence
/// for the user's first mistakes (no backend, permission denied, wrong socket).
std::string backend_unreachable_hint(const std::string& path, int err);

}  // namespace vrdma
