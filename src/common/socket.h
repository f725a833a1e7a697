// Unix-socket helpers for the control path: SOCK_SEQPACKET messages that may carry file
// descriptors (SCM_RIGHTS). Any thread; each call is one syscall.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

namespace vrdma {

inline constexpr size_t kMaxFdsPerMessage = 64;

/// Sends one message with up to kMaxFdsPerMessage descriptors (not closed here).
Status send_msg(int sock, std::span<const uint8_t> bytes, std::span<const int> fds = {});

/// Receives one message into `buf` (resized to what arrived) and any descriptors attached.
/// Returns ECONNRESET on orderly shutdown; EMSGSIZE when the message did not fit in `cap`;
/// EMFILE, with `buf` holding the message, when its descriptors were dropped (MSG_CTRUNC: this
/// process's descriptor table is full, or the sender attached more than kMaxFdsPerMessage).
/// `flags`: MSG_DONTWAIT to fail with EAGAIN instead of waiting.
Status recv_msg(int sock, std::vector<uint8_t>& buf, size_t cap, std::vector<UniqueFd>& fds,
                int flags = 0);

/// Sends `request` (with `fds`) and receives the one answer into `buf`, waiting at most
/// `timeout_ms` for it (0: for ever): ETIMEDOUT when none came, so a peer that is stopped or
/// hung does not hang the caller. For the one-shot calls of the CLI and of a starting backend.
Status call_msg(int sock, std::span<const uint8_t> request, std::span<const int> fds,
                std::vector<uint8_t>& buf, size_t cap, std::vector<UniqueFd>& got, int timeout_ms);

/// Connects to a SOCK_SEQPACKET listener. `send_timeout_ms` > 0 bounds the connect (a
/// listener whose backlog is full would block it) and every later send (SO_SNDTIMEO): they
/// fail with EAGAIN instead of waiting for a peer that does not read.
Result<UniqueFd> connect_unix(const std::string& path, int send_timeout_ms = 0);
/// Grows the send buffer of `sock` so one message of `bytes` fits (a SOCK_SEQPACKET message
/// larger than the buffer fails with EMSGSIZE). Best effort: capped by net.core.wmem_max.
void fit_send_buffer(int sock, size_t bytes);
/// A listening SOCK_SEQPACKET socket at `path`. It is bound beside `path` and renamed there once
/// it listens, so it replaces whatever `path` names: callers hold the socket's lock and have
/// judged an old file stale.
Result<UniqueFd> listen_unix(const std::string& path);
/// Who is at the other end of a unix socket, as the kernel recorded it at connect() (SO_PEERCRED):
/// what the backend trusts about a guest, never what the guest says of itself.
struct PeerCred {
  uint32_t pid = 0;
  uint32_t uid = UINT32_MAX;
  uint32_t gid = UINT32_MAX;
};
Result<PeerCred> peer_cred(int sock);
/// The uid of the process at the other end of a unix socket (SO_PEERCRED).
Result<uint32_t> peer_uid(int sock);
/// The backend's administrators: root and the user the backend runs as (`backend_uid`, its
/// euid). They may run operator commands, join any guest and see every key (ARCHITECTURE.md,
/// "Security: who may see and join what").
inline bool is_admin_uid(uint32_t uid, uint32_t backend_uid) {
  return uid == 0 || uid == backend_uid;
}

}  // namespace vrdma
