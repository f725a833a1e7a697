// What `vrdma status`, `vrdma res show` and `vrdma stat` print, computed from the backend's
// status document (src/backend/report.h). Pure functions of the JSON, so they are unit-tested
// without a backend.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace vrdma::cli {

/// A LID or QPN as every text output prints it: 0x hex, as the backend's log lines and
/// ibv_rc_pingpong do (JSON keeps numbers; filters take decimal or 0x). "-" for no number.
std::string id_text(const nlohmann::json& v);

/// A size in bytes as text, in binary units without a space: "512B", "4KiB", "1.5MiB" (one
/// decimal where it is not whole). JSON keeps bytes. "-" for no number.
std::string size_text(const nlohmann::json& v);

/// "KEY VALUE" pairs from the command line (`guest NAME`, `qpn N`, ...).
using Filters = std::vector<std::pair<std::string, std::string>>;

/// Splits `guest g1 qpn 17` into pairs; an odd count is an error. iproute2's names (`lqpn`,
/// `rqpn`, `sq-psn`, ...) are taken for the names the rows carry (`qpn`, `dest_qpn`, `sq_psn`).
Result<Filters> parse_filters(const std::vector<std::string>& words);

/// The rows of `res.<type>` (type: qp, cq, mr, pd, srq, dm) that pass every filter. Numbers match
/// a decimal or 0x value (sizes also as size_text prints them), words in any case; a key that
/// the type does not have is an error naming the valid ones.
Result<nlohmann::json> res_rows(const nlohmann::json& status, const std::string& type,
                                const Filters& filters);

/// One `rdma res show`-style line per row: "vrdma0 guest g qpn 17 type RC state RTS ...", every
/// value one word (MR access bits as LOCAL_WRITE,REMOTE_READ). With `details` (`-d`, as
/// iproute2's), a QP's transport is followed by why it was chosen, in parentheses.
std::string res_text(const std::string& type, const nlohmann::json& rows, bool details = false);

/// `vrdma res show` with no type: the counts per guest.
std::string res_summary(const nlohmann::json& status);

/// Counter rows for `vrdma stat`: `what` is "qp" (per QP) or "guest" (sums per guest).
Result<nlohmann::json> stat_rows(const nlohmann::json& status, const std::string& what,
                                 const Filters& filters);
std::string stat_text(const std::string& what, const nlohmann::json& rows);

/// Why moving `guest` from the backend whose status document is `from` to the one of `to`
/// would strand a connected QP of it: a peer that stays on `from`, or one on a third backend,
/// that the target cannot reach by TCP (no transport on either side, or neither backend knows
/// the other's node). Empty when every peer stays reachable. Sockets name the backends.
std::string stranded_by_move(const nlohmann::json& from, const nlohmann::json& to,
                             const std::string& guest);

/// `vrdma status`: the backend's header lines (version, uptime, transports, threads, quotas, and
/// for a caller who is not an admin, that the view is cut down to its own guests).
std::string status_header(const nlohmann::json& status);

}  // namespace vrdma::cli
