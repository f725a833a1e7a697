// The device where verbs consumers look for it: `vrdma run` shows the program it starts a
// /dev/infiniband/uverbs0 node and a sysfs view of vrdma0 (/sys/class/infiniband/vrdma0,
// /sys/class/infiniband_verbs/uverbs0) in a private mount namespace (docs/ARCHITECTURE.md, "The
// device where consumers look"). The library never opens either; UCX and Open MPI check them.
// `vrdma setup` puts the same view in the host's own mount namespace, for programs started
// without `vrdma run`, and `vrdma setup --remove` takes exactly that away again.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace vrdma::cli {

/// The sysfs view of `guest`'s device: (path under /sys/class, content) for every file, with the
/// values ibv_query_device/ibv_query_port/ibv_query_gid give that guest (identity.h).
std::vector<std::pair<std::string, std::string>> sysfs_view_files(std::string_view guest);

/// Makes the view visible to this process and to what it execs: as root in a mount namespace of
/// its own, else in a user namespace that maps the uid and gid to themselves (so the program
/// runs as the same user). Single-threaded callers only (unshare of a user namespace). Returns
/// "" when the view is there (or was already), else what is missing and why: the caller says so
/// and runs the program anyway. Nothing leaks to the host's mounts.
std::string provide_device_view(const std::string& guest);

/// Where `vrdma setup` records what it did, so that --remove undoes exactly that.
inline constexpr const char* kHostViewState = "/run/vrdma/setup.json";

/// `vrdma setup`, as root: the view of `guest` (its GUID, LID and GID) in the mount namespace the
/// caller is in (the host's, when run from a shell or a unit without mount sandboxing) until
/// remove_host_view() or the next boot. Refused where a kernel RDMA device is there (its nodes
/// and sysfs would be hidden). Returns what it did (the state file's contents, plus "already":
/// true when an earlier setup was found and left as it is), or why not, with nothing changed.
Result<nlohmann::json> setup_host_view(const std::string& guest);
/// `vrdma setup --remove`: unmounts what kHostViewState records, removes /dev/infiniband if
/// setup made it and the state file. Returns what it did ("removed": false when there was no
/// setup to undo).
Result<nlohmann::json> remove_host_view();

}  // namespace vrdma::cli
