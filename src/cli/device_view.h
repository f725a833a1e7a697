// The device where verbs consumers look for it: `vrdma run` shows the program it starts a
// /dev/infiniband/uverbs0 node and a sysfs view of vrdma0 (/sys/class/infiniband/vrdma0,
// /sys/class/infiniband_verbs/uverbs0) in a private mount namespace (docs/ARCHITECTURE.md, "The
// device where consumers look"). The library never opens either; UCX and Open MPI check them.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

}  // namespace vrdma::cli
