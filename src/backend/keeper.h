// The state keeper: a small process beside vrdmad (`vrdmad --keeper PATH GRACE_S`)
// that holds the latest state of every guest of its backend (the export blob and duplicates of
// every descriptor it names, the guests' connections included), so that a backend that dies -
// SIGKILL, a crash - can be replaced without the guests noticing more than a pause: their
// connections stay open (the keeper holds the other reference), and the new backend imports
// their state from the keeper. When its backend's connection ends without a goodbye the keeper
// starts the backend again (at most 10 times a minute); if no backend comes back within
// the grace time it lets everything go, and the guests then see their device gone.
// Under systemd (socket activation, packaging/vrdmad-keeper.{socket,service}) the keeper is a
// unit of its own and restarts nothing: systemd restarts vrdmad.service, the one owner of
// restarts, and the keeper only holds the state across it (ARCHITECTURE.md, keep_state).
// Only the keeper's own uid may connect (SO_PEERCRED).
// Protocol (SOCK_SEQPACKET, proto/command.h): the backend sends kImportBegin/Data/Commit per guest
// (no answer), kKeepDrop when a guest leaves, kKeepBye on a clean exit, and kKeepRestore once
// after it starts: the keeper answers with every record (Begin/Data/Commit) and kKeepEnd.
#pragma once

#include <span>
#include <string>
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

namespace vrdma::backend {

/// Runs the keeper on `path` (or on the listener systemd passed, whose path it takes) until its
/// backend says goodbye or the grace time passes. `backend_argv`: how to start the backend
/// again; empty: someone else does (systemd), the keeper only waits for it.
int run_keeper(std::string path, int grace_s, std::vector<std::string> backend_argv);

/// One guest's kept state, as the keeper hands it back.
struct KeptGuest {
  std::string guest;
  std::vector<uint8_t> blob;
  std::vector<UniqueFd> fds;
};

/// The guest's RDMA CM state that rides beside its device's in a move (CmService's JSON and
/// its channels' sockets).
struct CmPart {
  std::string json;
  std::span<const int> fds;
};

/// Sends one guest's state as kImportBegin/Data.../Commit on `sock` (no answer is read), with
/// `cm` as kImportCm pieces before the commit when given.
Status send_state(int sock, const std::string& guest, const std::vector<uint8_t>& blob,
                  std::span<const int> fds, uint32_t flags = 0, const CmPart* cm = nullptr);

}  // namespace vrdma::backend
