// A guest's device state as a blob: the exporter (live migration and snapshots). The format
// is in proto/device_state.h; fixed-layout structs travel as byte strings of their exact size
// and descriptors by their index in a list sent beside the blob. The importer is
// device_state_import.cc.
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
#include "engine/device_state_reader.h"
#include "proto/device_caps.h"
#include "proto/device_state.h"
namespace vrdma::engine {

using namespace vrdma::proto;
using json = nlohmann::json;

namespace {

template <typename T>
json bytes_of(const T& v) {
  static_assert(std::is_trivially_copyable_v<T>);
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  return json::binary(std::vector<uint8_t>(p, p + sizeof(T)));
}

/// Collects the descriptors the blob names, each with a key that says what it is (so a restore
/// can check it is the same), for the session being exported (`si`).
struct Exporter {
  GuestExport& out;
  json fdkeys = json::array();
  size_t si = 0;

  int64_t fd(int f, std::string_view what, uint32_t h = 0) {
    if (f < 0) return -1;
    out.fds.push_back(f);
    fdkeys.push_back(fmt::format("s{}.{}.{}", si, what, h));
    return static_cast<int64_t>(out.fds.size() - 1);
  }
};

// ---- export: one function per kind of resource ----

json export_mrs(const Session& s) {
  json mrs = json::array();
  for (const auto& [h, mr] : s.mrs) {
    json ext = json::array();
    for (size_t i = 0; i < mr->chunks.size(); ++i) {
      const MrChunk& c = mr->chunks[i];
      uint32_t seg_h = kNone;
      for (const auto& [sh, seg] : s.segments) {
        if (seg == mr->segments[i]) seg_h = sh;
      }
      ext.push_back({seg_h, c.base - mr->segments[i]->map.data(), c.mr_offset, c.length});
    }
    mrs.push_back({{"h", h},
                   {"key", mr->key},
                   {"pd", mr->pd},
                   {"access", mr->access},
                   {"addr", mr->addr},
                   {"iova", mr->iova},
                   {"length", mr->length},
                   {"ext", std::move(ext)}});
  }
  return mrs;
}

json export_mws(const Session& s) {
  json mws = json::array();
  for (const auto& [h, mw] : s.mws)
    mws.push_back({{"h", h},
                   {"pd", mw->pd},
                   {"type", mw->type},
                   {"rkey", mw->rkey},
                   {"bound", mw->bound ? 1 : 0},
                   {"mr", mw->mr},
                   {"qpn", mw->qpn},
                   {"access", mw->access},
                   {"addr", mw->addr},
                   {"length", mw->length}});
  return mws;
}

/// A QP's atomic cache as one byte string (version 11), up to its last entry that is not empty
/// (most QPs never ran an atomic: none).
json atomic_cache_bytes(const Qp& qp) {
  size_t n = qp.atomic_cache.size();
  while (n > 0 && qp.atomic_cache[n - 1] == std::pair<uint32_t, uint64_t>{}) --n;
  std::vector<uint8_t> b(n * sizeof(proto::AtomicCacheEntry));
  for (size_t i = 0; i < n; ++i) {
    const auto& [psn, value] = qp.atomic_cache[i];
    const proto::AtomicCacheEntry e{psn, static_cast<uint32_t>(value),
                                    static_cast<uint32_t>(value >> 32)};
    std::memcpy(b.data() + i * sizeof(e), &e, sizeof(e));
  }
  return json::binary(std::move(b));
}

json export_qp(Exporter& ex, uint32_t h, const Qp& qp) {
  std::vector<uint8_t> in_flight(qp.unacked.size() * sizeof(InFlight));
  for (size_t i = 0; i < qp.unacked.size(); ++i) {
    const Qp::Outstanding& o = qp.unacked[i];
    const InFlight f{o.psn, o.len, o.has_result ? 1u : 0u};
    std::memcpy(in_flight.data() + i * sizeof(InFlight), &f, sizeof(f));
  }
  return {{"h", h},
          {"qpn", qp.qpn},
          {"type", static_cast<uint32_t>(qp.type)},
          {"state", static_cast<uint32_t>(qp.state)},
          {"pd", qp.pd},
          // An XRC receive QP has no CQs or rings (its entry is in the guest's "xrc_qps").
          {"scq", qp.send_cq ? qp.send_cq->handle : kNone},
          {"rcq", qp.recv_cq ? qp.recv_cq->handle : kNone},
          {"srq", qp.srq ? qp.srq->handle : kNone},
          {"sig_all", qp.sq_sig_all},
          {"caps", bytes_of(qp.caps)},
          {"attr", bytes_of(qp.attr)},
          {"fd", ex.fd(qp.ring_fd.get(), "qp", h)},
          {"sq_size", qp.sq_size},
          {"rq_size", qp.rq_size},
          {"sq_cons", qp.sq_cons},
          {"rq_cons", qp.rq_cons},
          {"wait", static_cast<uint32_t>(qp.wait)},
          {"rnr_left", qp.rnr_left},
          {"retry_left", qp.retry_left},
          {"wait_until", qp.wait_until_ns},
          {"cnt", bytes_of(qp.cnt)},
          {"in_flight", json::binary(std::move(in_flight))},
          // The shm path never advances sq_sent (nothing is in flight there).
          {"sq_sent", qp.remote ? qp.sq_sent : qp.sq_cons},
          {"next_psn", qp.next_psn},
          {"expected_psn", qp.expected_psn},
          {"acache", atomic_cache_bytes(qp)},
          {"acache_next", qp.atomic_cache_next},
          // The route it had: reroute() on the target settles from it.
          {"remote", qp.remote},
          {"peer_node", qp.peer_node}};
}

json export_session(Exporter& ex, const Session& s, int sock) {
  json js = {{"pid", s.pid},
             {"uid", s.uid},
             {"comm", s.comm},
             {"next_handle", s.next_handle},
             {"control", ex.fd(s.control_fd.get(), "control")},
             {"doorbell", ex.fd(s.doorbell.get(), "doorbell")},
             {"async_r", ex.fd(s.async_read.get(), "async_r")},
             {"async_w", ex.fd(s.async_write.get(), "async_w")},
             {"sock", ex.fd(sock, "sock")}};
  json pds = json::array();
  for (const auto& [h, pd] : s.pds) pds.push_back(h);
  js["pds"] = std::move(pds);
  json segs = json::array();
  for (const auto& [h, seg] : s.segments)
    segs.push_back({h, ex.fd(seg->fd.get(), "seg", h), seg->map.size()});
  js["segs"] = std::move(segs);
  js["mrs"] = export_mrs(s);
  json dms = json::array();
  for (const auto& [h, dm] : s.dms)
    dms.push_back({{"h", h}, {"seg", dm.segment}, {"length", dm.length}});
  js["dms"] = std::move(dms);
  js["mws"] = export_mws(s);
  // Version 7: where its library keeps its direct-path cookie, so that a peer can prove again
  // after the move that it may write this process (trust by session is not carried: the ids
  // change, and the kernel is asked again).
  if (s.cookie_addr)
    js["cookie"] = {{"addr", s.cookie_addr},
                    {"bytes", json::binary({s.cookie.begin(), s.cookie.end()})}};
  json chans = json::array();
  for (const auto& [h, ch] : s.channels) chans.push_back({h, ex.fd(ch.write_end.get(), "chan", h)});
  js["chans"] = std::move(chans);
  json cqs = json::array();
  for (const auto& [h, cq] : s.cqs) {
    cqs.push_back({{"h", h},
                   {"fd", ex.fd(cq->ring_fd.get(), "cq", h)},
                   {"size", cq->size},
                   {"prod", cq->prod},
                   {"channel", cq->channel},
                   {"overrun", cq->overrun},
                   {"stamps", cq->stamps}});
  }
  js["cqs"] = std::move(cqs);
  json srqs = json::array();
  for (const auto& [h, q] : s.srqs) {
    srqs.push_back({{"h", h},
                    {"fd", ex.fd(q->ring_fd.get(), "srq", h)},
                    {"pd", q->pd},
                    {"size", q->size},
                    {"cons", q->cons},
                    {"max_sge", q->max_sge},
                    {"limit", q->limit}});
    // Version 8: an XRC SRQ's domain, number and CQ.
    if (q->xrcd) srqs.back().update({{"xrcd", q->xrcd}, {"srqn", q->srqn}, {"cq", q->cq->handle}});
  }
  js["srqs"] = std::move(srqs);
  // Version 8: its XRC domain opens and its handles on receive QPs (the guest's "xrc_qps").
  js["xrcds"] = s.xrcds;
  js["xrc_qps"] = s.xrc_qps;
  json qps = json::array();
  for (const auto& [h, qp] : s.qps) {
    qps.push_back(export_qp(ex, h, *qp));
    ex.out.qps++;
  }
  js["qps"] = std::move(qps);
  return js;
}

/// Version 7: the QPs' own completion rings (direct path), added to their entries in
/// `sessions`, with descriptors after every session's: a restore compares the layout without
/// them (state_fd_layout), since a grant made after a snapshot adds them.
void export_own_rings(Exporter& ex, const Guest& g, json& sessions) {
  ex.si = 0;
  for (json& js : sessions) {
    for (json& jq : js["qps"]) {
      const Qp* qp = g.qps.at(jq["qpn"].get<uint32_t>());
      for (const auto& [r, key] :
           {std::pair{qp->own_send.get(), "own_send"}, std::pair{qp->own_recv.get(), "own_recv"}}) {
        if (r)
          jq[key] = {{"fd", ex.fd(r->ring_fd.get(), key, qp->handle)},
                     {"size", r->size},
                     {"stamps", r->stamps}};
      }
    }
    ++ex.si;
  }
}

/// Version 8: the guest's XRC domains (by id and the inode that names them; their use counts
/// are recounted on import) and receive QPs, each as a QP entry with its domain, the SRQ it
/// answers through (0: none yet) and the session (index in `order`) whose handle it is under.
void export_xrc(const Guest& g, const std::vector<const Session*>& order, Exporter& ex, json& doc) {
  json xrcds = json::array();
  for (const auto& [id, x] : g.xrcds)
    xrcds.push_back({{"id", id}, {"inode", x->has_inode}, {"dev", x->dev}, {"ino", x->ino}});
  json qps = json::array();
  for (const auto& [qpn, qp] : g.xrc_qps) {
    json jq = export_qp(ex, qp->handle, *qp);
    const auto owner = std::find(order.begin(), order.end(), qp->owner);
    jq.update({{"xrcd", qp->xrcd},
               {"srqn", qp->srq ? qp->srq->srqn : 0},
               {"owner", static_cast<size_t>(owner - order.begin())}});
    qps.push_back(std::move(jq));
  }
  doc["next_xrcd"] = g.next_xrcd;
  doc["next_srqn"] = g.next_srqn;
  doc["xrcds"] = std::move(xrcds);
  doc["xrc_qps"] = std::move(qps);
}

}  // namespace

Result<GuestExport> Device::export_guest(const std::string& name,
                                         const std::function<int(const Session&)>& sock_of,
                                         bool keep_direct) const {
  auto git = guests_.find(name);
  if (git == guests_.end()) return error(ENOENT, fmt::format("no guest {} on this backend", name));
  const Guest& g = *git->second;
  for (const Qp* qp : g.active) {
    if (!keep_direct && (qp->direct_remote || qp->offered))
      return error(EBUSY, fmt::format("guest {}: QP {:#x} has used the direct path across "
                                      "backends, whose connection cannot move yet",
                                      name, qp->qpn));
  }
  GuestExport out;
  Exporter ex{out};
  json sessions = json::array();
  std::vector<const Session*> order;
  for (const auto& [sid, sp] : sessions_) {
    const Session& s = *sp;
    if (s.guest != &g) continue;
    sessions.push_back(export_session(ex, s, sock_of(s)));
    // The rx_lock tags its library may hold (Session::kept_rx_tags): ours, and those it kept.
    json tags = json::array({rx_lock_tag(s)});
    for (const uint32_t t : s.kept_rx_tags)
      if (t) tags.push_back(t);
    sessions.back()["rx_tags"] = std::move(tags);
    order.push_back(&s);
    ++ex.si;
  }
  export_own_rings(ex, g, sessions);
  json doc = {{"magic", kStateMagic},
              {"version", kStateVersion},
              {"name", g.name},
              {"owner_uid", g.owner_uid},
              {"lid", g.lid},
              {"next_qpn", g.next_qpn},
              {"next_key_index", g.next_key_index},
              {"retired", bytes_of(g.retired)},
              {"sessions", std::move(sessions)},
              {"fdkeys", std::move(ex.fdkeys)}};
  export_xrc(g, order, ex, doc);
  if (keep_direct) state::export_direct(g, doc);
  out.blob = json::to_cbor(doc);
  return out;
}
}  // namespace vrdma::engine
