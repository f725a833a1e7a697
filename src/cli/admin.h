// The operator's requests to a backend (`vrdma migrate`, `snapshot`, `restore`), and how long
// the CLI waits for a backend's answer.
#pragma once

#include <string>

namespace vrdma::cli {

/// How long `status`, `res` and `stat` wait for the backend's answer: it builds the document
/// at once, so a backend that takes longer is stopped or hung.
inline constexpr int kStatusWaitMs = 3000;
/// How long an operator command waits: a migration waits up to 10 s for its target.
inline constexpr int kAdminWaitMs = 20000;

/// VRDMA_TIMEOUT_MS when set (as for the library; 0: for ever), else `fallback`.
int wait_ms(int fallback);

/// `vrdma migrate GUEST --to SOCKET`: refuses a move that would strand the guest's peers unless
/// `force`. Each returns the command's exit code, having printed the outcome.
int cmd_migrate(const std::string& guest, const std::string& to, const std::string& socket_opt,
                bool force, bool json);
/// `vrdma snapshot GUEST FILE`: FILE appears only whole.
int cmd_snapshot(const std::string& guest, const std::string& file, const std::string& socket_opt,
                 bool json);
/// `vrdma restore FILE`.
int cmd_restore(const std::string& file, const std::string& socket_opt, bool json);

}  // namespace vrdma::cli
