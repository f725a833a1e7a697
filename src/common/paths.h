// Where things live: the backend's socket (VRDMA_SOCKET, else /run/vrdma/vrdmad.sock for root,
// else $XDG_RUNTIME_DIR/vrdma or /tmp/vrdma-UID), and the guest name of this process; how the
// CLI and the library reach the backend there, start one on demand, and say why they cannot.
#pragma once

#include <sys/types.h>

#include <cerrno>
#include <string>
#include <string_view>

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
/// The rule for a guest name, checked by the library, the backend and the CLI alike: 1 to 63
/// bytes of letters, digits and `. _ - : @ +`, not starting with `-` (it would read as an
/// option on a command line). EINVAL saying what is wrong with `name`, and the rule.
Status check_guest_name(std::string_view name);
/// VRDMA_GUEST if set (even to ""), checked against the rule; else "pgrp-<process group id>"
/// (one guest per process group).
Result<std::string> guest_name();
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
/// Whether a failed connect to the backend's socket (`err`) means that no backend serves it, so
/// that one may be started there; any other error (permission denied, a bad directory) must be
/// reported as it is.
inline bool no_backend_there(int err) { return err == ENOENT || err == ECONNREFUSED; }

inline constexpr off_t kBackendLogRotateBytes = 10 << 20;
/// A backend started on demand (start_backend).
struct StartedBackend {
  pid_t pid = -1;
  std::string log;  ///< where its output goes
};
/// Starts `bin --socket SOCK --idle-exit IDLE_EXIT_S --on-demand` detached from us (double fork,
/// new session, stdin /dev/null, output appended to vrdmad.log beside the socket, which is first
/// rotated to vrdmad.log.1 when over kBackendLogRotateBytes; none of our descriptors, no
/// LD_PRELOAD): what `vrdma run` and the library do when no backend answers.
/// `--on-demand` tells it to leave quietly when it loses the race to another backend. Safe in a
/// multi-threaded process (the child only calls async-signal-safe functions before exec).
Result<StartedBackend> start_backend(const std::string& bin, const std::string& sock,
                                     int idle_exit_s);
/// Connects to the backend that `started` is, waiting up to `timeout_ms` for it to listen; stops
/// waiting as soon as that process has exited (after one last try: another backend may have won
/// the race) and then says so, with the last line of its log. `send_timeout_ms`: as
/// connect_unix().
Result<UniqueFd> await_backend(const std::string& sock, const StartedBackend& started,
                               int timeout_ms, int send_timeout_ms = 0);

/// "backend pid N does not answer on SOCK within MS ms: ...", for a call on `fd` (connected to
/// the backend's socket `sock`) that timed out; N is who serves it (SO_PEERCRED, or the pid file
/// beside the socket when that is systemd's).
std::string not_answering(int fd, const std::string& sock, int timeout_ms);
/// What a backend's status says, asked with a deadline.
struct BackendStatus {
  pid_t pid = 0;     ///< the process serving the socket (SO_PEERCRED of the listener)
  std::string json;  ///< the status document
};
/// Asks the backend at `sock` for its status (proto::Op::kStatus), waiting at most `timeout_ms`
/// for the answer: ETIMEDOUT "backend pid N does not answer ..." when it is stopped or hung;
/// connect errors as connect_backend_socket().
Result<BackendStatus> backend_status(const std::string& sock, int timeout_ms);

}  // namespace vrdma
