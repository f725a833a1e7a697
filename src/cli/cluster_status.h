// `vrdma cluster status [-j]`: the cluster as this backend sees it, from its status document:
// with the directory on etcd every registered node (address, lease, guests) and which of them
// this backend is connected to; with the embedded directory, its connected peers.
// Runs in the CLI only.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace vrdma::cli {

/// The cluster view of a status document (`vrdma status --json`): {"directory": "etcd" |
/// "embedded" | "off", "node", "connected": [...], "nodes": [...], "etcd": {...}}.
nlohmann::json cluster_view(const nlohmann::json& status);
/// The same as text, a line per node and one per guest.
std::string cluster_text(const nlohmann::json& view);

}  // namespace vrdma::cli
