// A guest that leaves or moves: detaching it from this backend, and rerouting or settling the
// QPs that face it once the directory says where it went (live migration).
#include <fcntl.h>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>

#include "common/identity.h"
#include "common/log.h"
#include "common/memfd.h"
#include "engine/datapath_util.h"
#include "proto/device_caps.h"
#include "proto/device_state.h"
#include "proto/post_rules.h"
namespace vrdma::engine {

using namespace vrdma::proto;
using json = nlohmann::json;

void Device::detach_guest(const std::string& name) {
  auto it = guests_.find(name);
  if (it == guests_.end()) return;
  Guest* g = it->second.get();
  bump_epoch(*g);
  std::vector<Session*> ss;
  for (auto& [id, s] : sessions_) {
    if (s->guest == g) ss.push_back(s.get());
  }
  for (Session* s : ss) close_session_impl(s, true);
}

void Device::end_direct_grants(const std::string& name) {
  if (auto it = guests_.find(name); it != guests_.end()) bump_epoch(*it->second);
}

// ---- following a guest that moved ----

void Device::on_guest_located(const transport::GuestInfo& gi, const std::string& node) {
  Guest g;  // only its identity: what for_qps_facing compares
  g.lid = gi.lid;
  std::memcpy(g.gid, gi.gid, 16);
  for_qps_facing(g, [&](Qp& qp) {
    if (!qp.remote || qp.peer_node != node) reroute(qp);
  });
}

void Device::reroute(Qp& qp) {
  if (qp.type == IBV_QPT_UD) return;
  if (qp.state != IBV_QPS_RTR && qp.state != IBV_QPS_RTS && qp.state != IBV_QPS_SQD) return;
  // A grant relied on where the peer was: it ended with the peer's epoch (end_direct_grants)
  // and the library asks again where the peer is now.
  qp.direct = false;
  const bool was_remote = qp.remote;
  const std::string was_node = qp.peer_node;
  const std::string was_transport = qp.transport;
  choose_route(qp, true);
  if (qp.route_pending && was_remote) {
    // Not known here (yet): keep going to where it was; the directory will say where it is.
    qp.remote = true;
    qp.route_pending = false;
    qp.transport = was_transport;
    qp.peer_node = was_node;
    qp.transport_why = "destination not known here yet; following it when it is announced";
    return;
  }
  if (was_remote && !qp.remote) {
    settle_locally(qp);
  } else if (!was_remote && qp.remote) {
    // Nothing is in flight on shm: every WQE before sq_cons completed.
    qp.unacked.clear();
    qp.sq_sent = qp.sq_cons;
    if (qp.wait == Wait::kAck) qp.wait = Wait::kNone;
  } else if (qp.remote && is_reliable(qp.type) && !qp.unacked.empty() && qp.wait != Wait::kRnr) {
    qp.retry_left = qp.attr.retry_cnt;
    qp.wait = Wait::kAck;
    qp.wait_until_ns = now_ns_ + ack_ns(qp);
    qp.replay_now = true;
  } else if (!qp.remote && qp.wait == Wait::kAck) {
    qp.wait = Wait::kNone;  // waiting for a peer that was away: try again now
  }
  // A move of 64 QPs whose peers stay where they were changes no route: one line per QP at info
  // level was ~10% of the import's time, the guest frozen.
  const bool changed = qp.transport != was_transport || qp.peer_node != was_node;
  log::emit(changed ? log::Level::kInfo : log::Level::kDebug, "qp {:#x} (guest {}): {} {}{}{} ({})",
            qp.qpn, qp.guest->name, changed ? "now" : "still", qp.transport,
            qp.remote ? " to " : "", qp.peer_node, qp.transport_why);
  carry_offer(qp, was_node);
}

void Device::settle_locally(Qp& qp) {
  Qp* to = lookup_remote(qp);
  if (qp.wait == Wait::kAck) qp.wait = Wait::kNone;
  if (!to || !is_reliable(qp.type)) {
    // No responder state to settle against: what was in flight runs again from the SQ.
    if (!qp.unacked.empty()) qp.next_psn = qp.unacked.front().psn;
    qp.unacked.clear();
    qp.sq_sent = qp.sq_cons;
    return;
  }
  // The peer executed exactly the PSNs before its expected one: those complete now (a READ or
  // atomic whose answer was lost gets it here), the rest go back to the send queue.
  while (!qp.unacked.empty() && wire::psn_diff(qp.unacked.front().psn, to->expected_psn) < 0) {
    const Qp::Outstanding o = qp.unacked.front();
    qp.unacked.pop_front();
    ibv_wc_status st = IBV_WC_SUCCESS;
    if (!o.has_result && (o.w.opcode == IBV_WR_RDMA_READ || is_atomic(o.w.opcode))) {
      dst_.clear();
      src_.clear();
      uint64_t len = 0;
      if (!resolve_sges(qp, o.w.sge, o.w.num_sge, IBV_ACCESS_LOCAL_WRITE, dst_, len) ||
          len < o.len) {
        st = IBV_WC_LOC_PROT_ERR;
      } else if (o.w.opcode == IBV_WR_RDMA_READ) {
        const Response r = respond_begin(*to, inbound_of(qp, o.w, o.len));
        uintptr_t fault = 0;
        if (r.kind != Response::kOk)
          st = r.status ? r.status : IBV_WC_REM_INV_REQ_ERR;
        else if (!guarded_copy(src_, dst_, o.len, fault))
          st = in_spans(src_, fault) ? IBV_WC_REM_ACCESS_ERR : IBV_WC_LOC_PROT_ERR;
      } else {
        st = IBV_WC_REM_INV_REQ_ERR;  // its result is no longer known
        for (const auto& [psn, value] : to->atomic_cache) {
          if (psn == (o.psn | Qp::kAtomicCacheValid)) {
            const Span result{reinterpret_cast<uint8_t*>(const_cast<uint64_t*>(&value)), 8};
            uintptr_t fault = 0;
            st = guarded_copy({&result, 1}, dst_, 8, fault) ? IBV_WC_SUCCESS : IBV_WC_LOC_PROT_ERR;
          }
        }
      }
    }
    complete_send(qp, o.w, st, st == IBV_WC_SUCCESS ? o.len : 0);
    if (st != IBV_WC_SUCCESS) {
      enter_error(qp, "in-flight request could not be settled after the peer moved here");
      return;
    }
  }
  qp.next_psn = to->expected_psn;
  qp.unacked.clear();
  qp.sq_sent = qp.sq_cons;
  publish_psns(qp);
}

}  // namespace vrdma::engine
