// What the device holds and what it did, as JSON for operators: every PD, MR, CQ, SRQ and QP
// (field names of iproute2's `rdma res show` where one exists), per-QP counters and their sums
// per guest. `vrdma res show`, `vrdma stat` and the metrics endpoint all read this one report.
// Control path only (owned by the engine thread, like the rest of the Device).
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/device.h"
#include "engine/omitted_rows.h"
#include "engine/qp_state.h"

namespace vrdma::engine {

namespace {

/// ibv_wc_status names without the IBV_WC_ prefix: stable keys for JSON and metric labels
/// (the backend does not link libibverbs, so no ibv_wc_status_str()).
constexpr const char* kWcStatusNames[] = {
    "SUCCESS",
    "LOC_LEN_ERR",
    "LOC_QP_OP_ERR",
    "LOC_EEC_OP_ERR",
    "LOC_PROT_ERR",
    "WR_FLUSH_ERR",
    "MW_BIND_ERR",
    "BAD_RESP_ERR",
    "LOC_ACCESS_ERR",
    "REM_INV_REQ_ERR",
    "REM_ACCESS_ERR",
    "REM_OP_ERR",
    "RETRY_EXC_ERR",
    "RNR_RETRY_EXC_ERR",
    "LOC_RDD_VIOL_ERR",
    "REM_INV_RD_REQ_ERR",
    "REM_ABORT_ERR",
    "INV_EECN_ERR",
    "INV_EEC_STATE_ERR",
    "FATAL_ERR",
    "RESP_TIMEOUT_ERR",
    "GENERAL_ERR",
    "TM_ERR",
    "TM_RNDV_INCOMPLETE",
};
static_assert(std::size(kWcStatusNames) == IBV_WC_TM_RNDV_INCOMPLETE + 1);

/// Who owns a resource: the columns every `res show` line starts with.
nlohmann::json owner_of(const Session& s) {
  return {{"guest", s.guest->name}, {"pid", s.pid}, {"comm", s.comm}};
}

}  // namespace

const char* qp_type_name(ibv_qp_type t) {
  switch (t) {
    case IBV_QPT_RC:
      return "RC";
    case IBV_QPT_UC:
      return "UC";
    case IBV_QPT_UD:
      return "UD";
    case IBV_QPT_XRC_SEND:
      return "XRC_SEND";
    case IBV_QPT_XRC_RECV:
      return "XRC_RECV";
    default:
      return "?";
  }
}

std::string read_comm(uint32_t pid) {
  // The process name as `ps` shows it; "" when the pid is gone or in another pid namespace.
  const std::string path = "/proc/" + std::to_string(pid) + "/comm";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char buf[64];
  ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  if (n <= 0) return "";
  std::string s(buf, static_cast<size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s;
}

QpCounters& QpCounters::operator+=(const QpCounters& o) {
  msgs_sent += o.msgs_sent;
  bytes_sent += o.bytes_sent;
  msgs_received += o.msgs_received;
  bytes_received += o.bytes_received;
  retries += o.retries;
  rnr_naks += o.rnr_naks;
  ud_dropped += o.ud_dropped;
  for (size_t i = 0; i < std::size(wc_errors); ++i) wc_errors[i] += o.wc_errors[i];
  replays += o.replays;
  replayed_bytes += o.replayed_bytes;
  seq_naks += o.seq_naks;
  naks_sent += o.naks_sent;
  held += o.held;
  return *this;
}

/// Why a QP's messages travel as they do (a direct path overrides the transport chosen at RTR).
static std::string transport_why(const Qp& qp) {
  if (qp.direct_remote)
    return fmt::format("granted across backends: the libraries talk TCP (peer on {})",
                       qp.peer_node);
  if (qp.direct) return "granted: the library copies into the peer (same uid, same host)";
  return qp.transport_why;
}

/// What libraries moved for `qp` on the direct path, as counted in its own rings' headers.
static QpCounters direct_part(const Qp& qp) {
  QpCounters c;
  if (qp.own_send) {
    c.msgs_sent = qp.own_send->hdr->direct_msgs.load(std::memory_order_relaxed);
    c.bytes_sent = qp.own_send->hdr->direct_bytes.load(std::memory_order_relaxed);
  }
  if (qp.own_recv) {
    c.msgs_received = qp.own_recv->hdr->direct_msgs.load(std::memory_order_relaxed);
    c.bytes_received = qp.own_recv->hdr->direct_bytes.load(std::memory_order_relaxed);
  }
  return c;
}

QpCounters counters_of(const Qp& qp) {
  QpCounters c = qp.cnt;
  c += direct_part(qp);
  return c;
}

nlohmann::json counters_json(const QpCounters& c) {
  nlohmann::json errs = nlohmann::json::object();
  for (size_t i = 0; i < std::size(c.wc_errors); ++i) {
    if (c.wc_errors[i] == 0) continue;
    errs[kWcStatusNames[i]] = c.wc_errors[i];
  }
  return {{"msgs_sent", c.msgs_sent},
          {"bytes_sent", c.bytes_sent},
          {"msgs_received", c.msgs_received},
          {"bytes_received", c.bytes_received},
          {"retries", c.retries},
          {"rnr_naks", c.rnr_naks},
          {"ud_dropped", c.ud_dropped},
          {"replays", c.replays},
          {"replayed_bytes", c.replayed_bytes},
          {"seq_naks", c.seq_naks},
          {"naks_sent", c.naks_sent},
          {"held", c.held},
          {"wc_errors", errs}};
}

/// One `res qp` row, its owner's columns first; its counters are added to `guest_sum`.
static nlohmann::json qp_row(const Qp& q, QpCounters& guest_sum) {
  const Qp* qp = &q;
  // One read of the direct part serves the total and the part shown beside it.
  const QpCounters direct = direct_part(*qp);
  QpCounters cnt = qp->cnt;
  cnt += direct;
  guest_sum += cnt;
  const bool connected =
      qp->type != IBV_QPT_UD && qp->state >= IBV_QPS_RTR && qp->state <= IBV_QPS_SQD;
  // An XRC receive QP has no PD, CQs or rings of its own: the SRQ each request names gives them.
  const bool xrc_recv = qp->type == IBV_QPT_XRC_RECV;
  nlohmann::json r = owner_of(*qp->owner);
  r.update({{"lqpn", qp->qpn},
            {"type", qp_type_name(qp->type)},
            {"state", qp_state_name(qp->state)},
            {"sq-psn", qp->attr.sq_psn},
            {"rq-psn", qp->attr.rq_psn},
            {"pdn", xrc_recv ? 0 : qp->pd},
            {"sq-cqn", qp->send_cq ? qp->send_cq->handle : 0},
            {"rq-cqn", qp->recv_cq && !xrc_recv ? qp->recv_cq->handle : 0},
            {"transport", qp->direct || qp->direct_remote ? "direct" : qp->transport},
            {"transport_why", transport_why(*qp)},
            {"peer_node", qp->peer_node},
            {"counters", counters_json(cnt)}});
  // The part of them that libraries moved on the direct path (own rings' headers).
  if (qp->own_send) r["counters"]["direct_msgs_sent"] = direct.msgs_sent;
  if (qp->own_recv) r["counters"]["direct_msgs_received"] = direct.msgs_received;
  // Cursors, for a queue that seems stuck: what the guest posted, what the backend took.
  const auto posted = [](const proto::RingHeader* h) {
    return h ? h->producer.load(std::memory_order_relaxed) : 0;
  };
  r["ring"] = {{"sq_posted", posted(qp->sq_hdr)}, {"sq_taken", qp->sq_cons},
               {"sq_sent", qp->sq_sent},          {"rq_posted", posted(qp->rq_hdr)},
               {"rq_taken", qp->rq_cons},         {"wait", static_cast<int>(qp->wait)}};
  if (connected) {
    r["rqpn"] = qp->attr.dest_qp_num;
    r["dlid"] = qp->attr.dlid;
  }
  if (qp->srq && !xrc_recv) r["srqn"] = qp->srq->handle;
  if (xrc_recv) r.update({{"xrcdn", qp->xrcd}, {"opens", qp->opens}});
  return r;
}

/// One `res mw` row's own columns.
static nlohmann::json mw_fields(uint32_t handle, const Mw& mw) {
  nlohmann::json r = {{"mwn", handle},
                      {"pdn", mw.pd},
                      {"type", mw.type},
                      {"state", mw.bound ? "bound" : "free"},
                      {"rkey", mw.rkey}};
  if (mw.bound) {  // what it opens: a range of an MR (and, type 2, through which QP)
    r.update({{"mrn", mw.mr}, {"iova", mw.addr}, {"length", mw.length}, {"access", mw.access}});
    if (mw.type == IBV_MW_TYPE_2) r["qpn"] = mw.qpn;
  }
  return r;
}

/// A QP's counters with the part libraries moved on the direct path.
static QpCounters with_direct(const Qp& qp) {
  QpCounters c = qp.cnt;
  c += direct_part(qp);
  return c;
}

nlohmann::json Device::report(bool lists) const {
  nlohmann::json pds = nlohmann::json::array(), mrs = nlohmann::json::array(),
                 cqs = nlohmann::json::array(), srqs = nlohmann::json::array(),
                 qps = nlohmann::json::array(), dms = nlohmann::json::array(),
                 mws = nlohmann::json::array(), xrcds = nlohmann::json::array();
  std::map<const Guest*, QpCounters> per_guest;
  for (const auto& [name, g] : guests_) per_guest[g.get()] = g->retired;
  OmittedRows omitted;
  for (const auto& [id, s] : sessions_) {
    if (!lists) {  // the counters' sums only
      for (const auto& [h, qp] : s->qps) per_guest[qp->guest] += with_direct(*qp);
      const std::pair<const char*, size_t> counts[] = {
          {"pd", s->pds.size()}, {"mr", s->mrs.size()},   {"dm", s->dms.size()},
          {"cq", s->cqs.size()}, {"srq", s->srqs.size()}, {"qp", s->qps.size()},
          {"mw", s->mws.size()}};
      for (auto [type, n] : counts) omitted.add(s->guest->name, type, n);
      continue;
    }
    const nlohmann::json who = owner_of(*s);
    auto row = [&](nlohmann::json fields) {
      nlohmann::json r = who;
      r.update(fields);
      return r;
    };
    for (const auto& [h, pd] : s->pds) pds.push_back(row({{"pdn", h}, {"users", pd.users}}));
    for (const auto& [h, mr] : s->mrs) {
      mrs.push_back(row({{"mrn", h},
                         {"pdn", mr->pd},
                         {"lkey", mr->key},
                         {"rkey", mr->key},
                         {"mrlen", mr->length},
                         {"iova", mr->iova},
                         {"access", mr->access}}));
    }
    for (const auto& [h, dm] : s->dms) {
      dms.push_back(row({{"dmn", h}, {"length", dm.length}, {"segment", dm.segment}}));
    }
    for (const auto& [h, cq] : s->cqs) {
      nlohmann::json ch =
          cq->channel == proto::kNone ? nlohmann::json(nullptr) : nlohmann::json(cq->channel);
      cqs.push_back(row({{"cqn", h},
                         {"cqe", cq->size},
                         {"users", cq->users},
                         {"channel", ch},
                         {"overrun", cq->overrun},
                         // Cursors: what the backend produced, what the guest says it consumed.
                         {"ring", {{"produced", cq->prod},
                                   {"consumed", cq->hdr->consumer.load(std::memory_order_relaxed)},
                                   {"armed", cq->hdr->armed.load(std::memory_order_relaxed)}}}}));
    }
    for (const auto& [h, srq] : s->srqs) {
      srqs.push_back(row({{"srqn", h},
                          {"pdn", srq->pd},
                          {"wqe", srq->size},
                          {"max_sge", srq->max_sge},
                          {"limit", srq->limit},
                          {"users", srq->users}}));
      if (srq->xrcd)  // XRC: its domain, the number requests name it by, its CQ
        srqs.back().update(
            {{"xrcdn", srq->xrcd}, {"srq_num", srq->srqn}, {"cqn", srq->cq->handle}});
    }
    for (const auto& [h, qp] : s->qps) qps.push_back(qp_row(*qp, per_guest[qp->guest]));
    for (const auto& [h, mw] : s->mws) mws.push_back(row(mw_fields(h, *mw)));
  }
  // The guests' XRC domains and receive QPs (no session's: reported under a session holding it).
  for (const auto& [name, g] : guests_) {
    if (!lists) {
      for (const auto& [qpn, qp] : g->xrc_qps) per_guest[g.get()] += with_direct(*qp);
      omitted.add(name, "xrcd", g->xrcds.size());
      omitted.add(name, "qp", g->xrc_qps.size());
      continue;
    }
    for (const auto& [id, x] : g->xrcds) {
      xrcds.push_back({{"guest", name},
                       {"xrcdn", id},
                       {"file", x->has_inode ? nlohmann::json(x->ino) : nlohmann::json(nullptr)},
                       {"opens", x->opens},
                       {"users", x->users}});
    }
    for (const auto& [qpn, qp] : g->xrc_qps) qps.push_back(qp_row(*qp, per_guest[g.get()]));
  }
  nlohmann::json guests = nlohmann::json::array();
  QpCounters all = departed_all_;
  for (const auto& [g, c] : per_guest) {
    guests.push_back({{"guest", g->name},
                      {"lid", g->lid},
                      {"qps", g->qps.size()},
                      {"counters", counters_json(c)}});
    all += c;
  }
  // Guests that left: their totals as they went (newest first), with their owner, so that
  // each user sees their own.
  for (const Departed& d : departed_) {
    guests.push_back({{"guest", d.name},
                      {"lid", d.lid},
                      {"qps", 0},
                      {"uid", d.owner_uid},
                      {"left_unix", d.left_unix},
                      {"counters", counters_json(d.counters)}});
  }
  nlohmann::json doc{{"res",
                      {{"pd", pds},
                       {"mr", mrs},
                       {"dm", dms},
                       {"cq", cqs},
                       {"srq", srqs},
                       {"qp", qps},
                       {"mw", mws},
                       {"xrcd", xrcds}}},
                     {"guest_counters", guests},
                     {"backend_counters", counters_json(all)}};
  if (!lists) doc["res_omitted"] = omitted.rows();
  return doc;
}

}  // namespace vrdma::engine
