// What the backend tells operators about itself and its device: the status document that
// `vrdma status`, `vrdma res show` and `vrdma stat` read (the Status command), cut down to what
// the caller may see (visible_status), and the same numbers as Prometheus text for the metrics
// endpoint, rendered at most once per [metrics] min_interval_ms. Owned by the engine thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "backend/config.h"
#include "engine/device.h"

namespace vrdma::backend {

/// Who asks for the status document (SO_PEERCRED of the Status command's connection).
struct Viewer {
  uint32_t uid = engine::kNoUid;
  bool admin = false;  ///< root or the backend's user (is_admin_uid): sees everything
};

/// Gives the engine's report (Device::status_json, Device::report) the names operators see in
/// every JSON document, the CLI's text and the metrics: snake_case, and one name for one thing
/// wherever it appears: `guest` (a guest's name), `qpn` (a QP's own number), `dest_qpn`, `dlid`,
/// `sq_psn`, `rq_psn`, `sq_cqn`, `rq_cqn`, `qp_count` (a guest's open QPs, where `qps` would be
/// its list). Reporter::status applies it; tests/e2e/json_schema.sh checks the result.
void use_operator_names(nlohmann::json& doc);

/// The part of a status document (Reporter::status) that `v` may see. Admins: all of it. Anyone
/// else: only the guests it owns (`guests[].uid`) and their rows in `res` and `guest_counters`,
/// without MR keys and addresses (`lkey`, `rkey`, `iova`), and `totals` summed over those guests
/// only. `view` says which it is. Other users' QPNs, PSNs and keys are what a cross-uid
/// connection needs, so they never leave the backend (ARCHITECTURE.md, "Security").
nlohmann::json visible_status(nlohmann::json status, const Viewer& v);

class Reporter {
 public:
  explicit Reporter(const Config& cfg);
  /// The whole status document: `backend` (version, uptime, quotas, transports, peers, the
  /// data-path thread), the device's guests and totals, `res` and `guest_counters`.
  /// `lists`: with the rows of every object (`res`, each guest's `qps`); else their numbers
  /// (`res_omitted`, `qps_omitted`).
  nlohmann::json status(const engine::Device& dev, bool lists = true);
  /// A status document as one viewer sees it, as JSON text.
  struct View {
    std::string json;
    size_t guests = 0;  ///< how many guests it shows (for the log)
  };
  /// The status document as `v` may see it (visible_status). Admins get a fresh one; anyone else
  /// one cut from a snapshot at most [backend] status_min_interval_ms old (kept per uid until the
  /// next snapshot), or newer than the caller's own last change (note_change): repeated callers
  /// cost the engine thread a lookup, and a caller still sees at once what it just did.
  const View& status_for(const engine::Device& dev, const Viewer& v, uint64_t now_ns);
  /// A session of `uid` changed the device (a command that succeeded, a session that ended): its
  /// next status_for() renders a new snapshot.
  void note_change(uint32_t uid) { changed_uids_.insert(uid); }
  /// How many times status_for() rendered the whole document (for tests).
  uint64_t status_renders() const { return status_renders_; }
  /// Prometheus text exposition format 0.0.4 of the same document, as `v` may see it
  /// (visible_status; admins, and TCP scrapes, which carry no credentials: everything). The
  /// document is built on the engine thread, so at most once per [metrics] min_interval_ms:
  /// scrapes in between (by any local uid that can reach the endpoint) get the last snapshot,
  /// each non-admin uid's text cut from it once, and cost the rings nothing.
  std::string metrics(const engine::Device& dev, uint64_t now_ns,
                      const Viewer& v = Viewer{engine::kNoUid, true});
  /// How many times metrics() rendered a new snapshot (for tests).
  uint64_t metrics_renders() const { return metrics_renders_; }
  /// Where the TCP transport, once it runs, says which peer backends are connected now.
  void set_connected_peers(std::function<std::vector<std::string>()> f) {
    connected_peers_ = std::move(f);
  }
  /// Whether the backend was started on demand (`vrdma run`, or the library on first use).
  void set_on_demand(bool on) { on_demand_ = on; }
  /// Whether systemd started the backend (socket activation): it then restarts the backend,
  /// and keep_state's keeper is vrdmad-keeper.service, which only holds the state.
  void set_activated(bool on) { activated_ = on; }
  /// The data-path loop went `ns` without looking at its work (Server::note_stall).
  void note_stall(uint64_t ns) {
    ++stalls_;
    stall_max_ns_ = std::max(stall_max_ns_, ns);
  }
  /// ... and each configured peer as it dials it: an array of {address, node, state,
  /// last_error, last_error_unix, failures} (TcpTransport::DialInfo).
  void set_peer_dials(std::function<nlohmann::json()> f) { peer_dials_ = std::move(f); }
  /// ... and what it says of itself: security, peers (identity, cipher, since), refusals.
  void set_transport_details(std::function<nlohmann::json()> f) {
    transport_details_ = std::move(f);
  }

 private:
  nlohmann::json backend_info();

  const Config& cfg_;
  uint64_t start_wall_s_;
  uint64_t start_mono_ns_;
  uint64_t last_mono_ns_;  ///< previous sample, for the recent busy fraction
  uint64_t last_cpu_ns_;
  std::function<std::vector<std::string>()> connected_peers_;
  std::function<nlohmann::json()> transport_details_;
  std::function<nlohmann::json()> peer_dials_;
  bool on_demand_ = false;
  bool activated_ = false;
  nlohmann::json metrics_snapshot_;  ///< the last document metrics() built
  std::string metrics_text_;         ///< ... rendered whole (admins, TCP)
  /// ... as each non-admin uid sees it (cleared with each new snapshot; uids from SO_PEERCRED).
  std::map<uint32_t, std::string> metrics_views_;
  std::string process_text_;  ///< process_metrics() of the last snapshot
  uint64_t metrics_at_ns_ = 0;
  uint64_t metrics_renders_ = 0;
  uint64_t stalls_ = 0, stall_max_ns_ = 0;
  nlohmann::json status_snapshot_;  ///< the last whole document status_for() rendered
  uint64_t status_at_ns_ = 0;
  uint64_t status_renders_ = 0;
  bool have_status_snapshot_ = false;
  /// The snapshot as each non-admin uid sees it, dumped (cleared with each new snapshot). uids
  /// come from SO_PEERCRED, so there are as many entries as users who asked within one interval.
  std::map<uint32_t, View> status_views_;
  std::set<uint32_t> changed_uids_;  ///< uids that changed the device since the snapshot
  View admin_status_;                ///< the last fresh document status_for() gave an admin
};

/// Renders a status document (as Reporter::status builds it) as Prometheus text. Guests are
/// labelled `guest="NAME"` with `guest_names`, else `guest="lid-0xN"` (their LID, in hex as
/// `vrdma status` prints it: stable for the guest's life, and no name another user chose).
/// Without `per_qp`, no `vrdma_qp_*` series (one set per QP: many QPs, many series).
std::string prometheus_text(const nlohmann::json& status, bool guest_names, bool per_qp = true);

/// This process's `process_*` metrics, as Prometheus' client libraries name them: CPU seconds,
/// resident memory, open and maximum fds, start time.
std::string process_metrics();

}  // namespace vrdma::backend
