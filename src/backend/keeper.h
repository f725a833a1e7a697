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
// The backend's TCP transport listener rides along (kKeepListener): the keeper holds it while
// the backend restarts, so the host still accepts its peers' connections (their QPs wait as for
// a slow backend), and hands it to the next backend, which asks before its transport starts
// (kKeepListenerAsk). It closes with the keeper (a goodbye, or no backend within the grace).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "proto/command.h"

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

/// What the keeper holds: the latest record of each guest, as the backend's messages build it.
/// A record (kImportBegin, kImportData..., kImportCm..., kImportCommit) replaces the guest's
/// device and CM state; one flagged kKeepCmOnly replaces its CM state alone (none kept for the
/// guest: ignored), as does a lone kImportCm outside a record (send_cm_state); one that does not
/// add up to what its begin announced changes nothing.
class KeptGuests {
 public:
  /// One message of the backend's (records and kKeepDrop; anything else is ignored); takes `fds`.
  void take(proto::Op op, const std::vector<uint8_t>& msg, std::vector<UniqueFd>& fds);
  /// A record cut off (its backend went): forgotten.
  void drop_partial() {
    partial_ = {};
    open_ = false;
  }
  /// kKeepRestore: every guest's record to `sock` (kImportRecover), then kKeepEnd.
  void hand_back(int sock) const;
  size_t size() const { return kept_.size(); }
  bool empty() const { return kept_.empty(); }

 private:
  struct Record {
    std::vector<uint8_t> blob;
    std::vector<UniqueFd> fds;
    std::string cm;                ///< the guest's RDMA CM state (JSON); empty: none
    std::vector<UniqueFd> cm_fds;  ///< its channels' sockets
  };
  std::map<std::string, Record> kept_;
  Record partial_;
  std::string partial_guest_;
  uint64_t partial_bytes_ = 0;
  uint32_t partial_fds_ = 0, partial_flags_ = 0;
  bool open_ = false;  ///< a kImportBegin came and its kImportCommit not yet
};

/// Sends one guest's state as kImportBegin/Data.../Commit on `sock` (no answer is read), with
/// `cm` as kImportCm pieces before the commit when given.
Status send_state(int sock, const std::string& guest, const std::vector<uint8_t>& blob,
                  std::span<const int> fds, uint32_t flags = 0, const CmPart* cm = nullptr);

/// keep_state: guest `guest`'s CM state alone, as one kImportCm message outside a record (an
/// ImportBeginReq flagged kKeepCmOnly, then the JSON) when it fits one, else as a record: one
/// wake-up of the keeper per CM change instead of three.
Status send_cm_state(int sock, const std::string& guest, const CmPart& cm);

}  // namespace vrdma::backend
