// A guest's XRC objects from a device-state blob (version 8; the rest of the importer is
// device_state_import.cc, the exporter device_state_export.cc): its domains, the XRC fields of
// its sessions' SRQs, its receive QPs and the sessions' handles on domains and receive QPs.
// As everywhere in the importer, nothing is trusted: every id, number and handle is checked,
// and the use counts (a domain's opens and users, a receive QP's opens) are recounted from the
// references, never read.
#include <fmt/format.h>

#include "engine/device_state_reader.h"
#include "proto/device_caps.h"
#include "proto/device_state.h"

namespace vrdma::engine::state {

using namespace vrdma::proto;

namespace {

/// A session's list of [handle, value] pairs under `key` (its XRC domain opens, its handles on
/// receive QPs): each handle in range and not used by another of its objects of that list.
template <typename Fn>
void read_pairs(Importer& im, const json& js, const Session& s, const char* key, Fn&& add) {
  Reader& rd = im.rd;
  for (const json& e : rd.arr(js, key)) {
    if (!e.is_array() || e.size() != 2 || !e[0].is_number_unsigned() ||
        !e[1].is_number_unsigned() || e[1].get<uint64_t>() > UINT32_MAX)
      rd.fail(fmt::format("{} entry", key));
    if (!rd.st.is_ok()) return;
    const uint32_t h = e[0].get<uint32_t>();
    im.handle_ok(s, h, key);
    if (s.qps.count(h) || s.srqs.count(h)) rd.fail(fmt::format("{} handle of another object", key));
    if (!rd.st.is_ok()) return;
    add(h, e[1].get<uint32_t>());
  }
}

/// One receive QP of the guest: its QP entry (the session fields it has none of stay empty),
/// its domain, the SRQ it answers through and the session it is reported under.
void import_recv_qp(Importer& im, const json& jq,
                    const std::vector<std::unique_ptr<Session>>& sessions, Guest& g) {
  Reader& rd = im.rd;
  QpRefs refs;
  std::unique_ptr<Qp> qp = read_qp(im, jq, refs);
  const uint32_t xrcd = rd.num<uint32_t>(jq, "xrcd"), srqn = rd.num<uint32_t>(jq, "srqn");
  const size_t owner = rd.num<size_t>(jq, "owner");
  if (!rd.st.is_ok()) return;
  if (refs.type != IBV_QPT_XRC_RECV) return rd.fail("XRC receive QP type");
  if (refs.state > IBV_QPS_ERR) return rd.fail("XRC receive QP state");
  if (qp->qpn < 0x11 || qp->qpn > 0xffffff || g.qps.count(qp->qpn))
    return rd.fail("XRC receive QPN");
  if (!g.xrcds.count(xrcd)) return rd.fail("XRC receive QP in an unknown domain");
  if (owner >= sessions.size()) return rd.fail("XRC receive QP's session");
  Session& s = *sessions[owner];
  im.handle_ok(s, qp->handle, "XRC receive QP");
  if (!rd.st.is_ok()) return;
  qp->type = IBV_QPT_XRC_RECV;
  qp->state = static_cast<ibv_qp_state>(refs.state);
  qp->attr.qp_state = refs.state;
  qp->owner = &s;
  qp->guest = &g;
  qp->pd = kNone;
  qp->xrcd = xrcd;
  qp->sq_size = qp->rq_size = qp->sq_cons = qp->rq_cons = qp->sq_sent = 0;
  qp->caps = QpCaps{};
  if (srqn) {  // the SRQ the last request named (bind_xrc_srq), as it was
    auto it = g.xrc_srqs.find(srqn);
    if (it == g.xrc_srqs.end() || it->second->xrcd != xrcd)
      return rd.fail("XRC receive QP's SRQ number");
    qp->srq = it->second;
    qp->recv_cq = it->second->cq;
  }
  g.qps[qp->qpn] = qp.get();
  g.xrc_qps[qp->qpn] = std::move(qp);
}

}  // namespace

void import_xrcds(Importer& im, const json& doc, Guest& g, uint32_t version) {
  if (version < 8) return;
  Reader& rd = im.rd;
  g.next_xrcd = rd.num<uint32_t>(doc, "next_xrcd");
  g.next_srqn = rd.num<uint32_t>(doc, "next_srqn");
  for (const json& e : rd.arr(doc, "xrcds")) {
    if (!rd.st.is_ok()) return;
    auto x = std::make_unique<Xrcd>();
    x->id = rd.num<uint32_t>(e, "id");
    x->dev = rd.num<uint64_t>(e, "dev");
    x->ino = rd.num<uint64_t>(e, "ino");
    auto inode = e.find("inode");
    if (inode == e.end() || !inode->is_boolean()) rd.fail("XRC domain's inode flag");
    if (!rd.st.is_ok()) return;
    x->has_inode = inode->get<bool>();
    // open_xrcd takes next_xrcd for a new domain: no domain may have it or a later id.
    if (x->id == 0 || x->id >= g.next_xrcd) return rd.fail("XRC domain id");
    if (g.xrcds.size() >= kMaxXrcd) return rd.fail("more XRC domains than a guest may hold");
    for (const auto& [id, d] : g.xrcds) {
      if (x->has_inode && d->has_inode && d->dev == x->dev && d->ino == x->ino)
        return rd.fail("two XRC domains of one inode");
    }
    if (!g.xrcds.emplace(x->id, std::move(x)).second) return rd.fail("XRC domain twice");
  }
}

void import_xrc_srq(Importer& im, const json& jq, Srq& q, Session& s, Guest& g) {
  Reader& rd = im.rd;
  if (!jq.contains("xrcd") || !rd.st.is_ok()) return;
  q.xrcd = rd.num<uint32_t>(jq, "xrcd");
  q.srqn = rd.num<uint32_t>(jq, "srqn");
  const uint32_t cq = rd.num<uint32_t>(jq, "cq");
  if (!rd.st.is_ok()) return;
  auto x = g.xrcds.find(q.xrcd);
  if (x == g.xrcds.end()) return rd.fail("XRC SRQ in an unknown domain");
  if (q.srqn == 0 || q.srqn > 0xffffff || g.xrc_srqs.count(q.srqn))
    return rd.fail("XRC SRQ number zero, too large or twice");
  auto c = s.cqs.find(cq);
  if (c == s.cqs.end()) return rd.fail("XRC SRQ on an unknown CQ");
  q.cq = c->second.get();
  q.cq->users++;
  x->second->users++;
  g.xrc_srqs[q.srqn] = &q;
}

void import_xrc_holds(Importer& im, const json& doc,
                      const std::vector<std::unique_ptr<Session>>& sessions, Guest& g,
                      uint32_t version) {
  if (version < 8) return;
  Reader& rd = im.rd;
  for (const json& jq : rd.arr(doc, "xrc_qps")) {
    if (!rd.st.is_ok()) return;
    import_recv_qp(im, jq, sessions, g);
  }
  const json& jsessions = rd.arr(doc, "sessions");
  for (size_t i = 0; rd.st.is_ok() && i < sessions.size() && i < jsessions.size(); ++i) {
    Session& s = *sessions[i];
    read_pairs(im, jsessions[i], s, "xrcds", [&](uint32_t h, uint32_t id) {
      auto x = g.xrcds.find(id);
      if (x == g.xrcds.end()) return rd.fail("XRC domain open of an unknown domain");
      if (!s.xrcds.emplace(h, id).second) return rd.fail("XRC domain handle twice");
      if (s.xrcds.size() > kMaxXrcd)
        return rd.fail("more XRC domain opens than a session may hold");
      x->second->opens++;
    });
    read_pairs(im, jsessions[i], s, "xrc_qps", [&](uint32_t h, uint32_t qpn) {
      auto q = g.xrc_qps.find(qpn);
      if (q == g.xrc_qps.end()) return rd.fail("handle on an unknown XRC receive QP");
      if (s.xrcds.count(h) || !s.xrc_qps.emplace(h, qpn).second)
        return rd.fail("XRC receive QP handle twice");
      q->second->opens++;
    });
  }
  if (!rd.st.is_ok()) return;
  // Each receive QP is held, under its handle in the session it is reported under; each domain
  // is opened or has something in it (device_xrc.cc frees it otherwise).
  for (const auto& [qpn, qp] : g.xrc_qps) {
    auto h = qp->owner->xrc_qps.find(qp->handle);
    if (h == qp->owner->xrc_qps.end() || h->second != qpn)
      return rd.fail("XRC receive QP not held by the session it names");
    g.xrcds.at(qp->xrcd)->users++;
  }
  for (const auto& [id, x] : g.xrcds) {
    if (x->opens == 0 && x->users == 0) return rd.fail("XRC domain nothing holds");
  }
}

}  // namespace vrdma::engine::state
