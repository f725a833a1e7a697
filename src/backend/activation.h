// systemd socket activation without libsystemd: sd_listen_fds() semantics. When LISTEN_PID is
// our pid and LISTEN_FDS >= 1, descriptor 3 is the listening control socket systemd made for
// us (packaging/vrdmad.socket); the variables are then cleared so children do not inherit them.
#pragma once

#include <string>

#include "common/status.h"
#include "common/unique_fd.h"

namespace vrdma::backend {

/// The inherited listener (made non-blocking and close-on-exec) and its path, or an invalid
/// fd when we were not socket-activated. Errors when the inherited fd is not a listening
/// SOCK_SEQPACKET unix socket.
Result<UniqueFd> inherited_listener(std::string& path);

}  // namespace vrdma::backend
