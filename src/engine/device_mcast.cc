// UD multicast (ibv_attach_mcast/detach, rdma_join_multicast): a group is a multicast GID
// (ff00::/8) with its LID; a datagram sent to it reaches every UD QP of this backend attached to
// it whose qkey matches, the sender's own included (no IBV_QP_CREATE_BLOCK_SELF_MCAST_LB), and
// goes once to every peer backend (connected, or known and dialed by the send), which delivers
// it to its own members the same way and never sends it on. Groups span the cluster's guests, as
// one partition of a fabric does. Owned by the engine thread.
#include <algorithm>

#include "common/log.h"
#include "engine/datapath_util.h"

namespace vrdma::engine {

using namespace vrdma::proto;

namespace {

bool multicast_gid(const uint8_t gid[16]) { return gid[0] == 0xff; }

bool multicast_addr(bool global, const uint8_t gid[16], uint16_t lid) {
  return global ? multicast_gid(gid) : lid >= 0xc000 && lid != 0xffff;
}

}  // namespace

bool Device::is_mcast(const UdDest& d) { return multicast_addr(d.is_global, d.dgid, d.dlid); }

bool Device::is_mcast(const wire::Request& rq) {
  return rq.qp_type == IBV_QPT_UD && multicast_addr(rq.is_global, rq.dgid, rq.dlid);
}

Status Device::attach_mcast(Session& s, const McastReq& r) {
  Qp* qp = find_qp(s, r.qp);
  if (!qp) return error(EINVAL, fmt::format("no QP {}", r.qp));
  if (qp->type != IBV_QPT_UD) return error(EINVAL, "only UD QPs join multicast groups");
  if (!multicast_gid(r.gid)) return error(EINVAL, "not a multicast GID");
  McastKey key;
  std::memcpy(key.data(), r.gid, 16);
  auto it = mcast_.find(key);
  if (it != mcast_.end() &&
      std::find(it->second.qps.begin(), it->second.qps.end(), qp) != it->second.qps.end())
    return Status::ok();  // attached already
  size_t joined = 0;
  for (const auto& [k, grp] : mcast_) joined += std::count(grp.qps.begin(), grp.qps.end(), qp);
  if (joined >= kMaxQpMcastGroups) return error(ENOMEM, "QP in too many multicast groups");
  if (it == mcast_.end()) {
    if (mcast_.size() >= kMaxMcastGroups) return error(ENOMEM, "multicast group limit");
    it = mcast_.emplace(key, McastGroup{r.lid, {}}).first;
  }
  if (it->second.qps.size() >= kMaxMcastQpAttach) return error(ENOMEM, "multicast group full");
  it->second.qps.push_back(qp);
  return Status::ok();
}

Status Device::detach_mcast(Session& s, const McastReq& r) {
  Qp* qp = find_qp(s, r.qp);
  if (!qp) return error(EINVAL, fmt::format("no QP {}", r.qp));
  McastKey key;
  std::memcpy(key.data(), r.gid, 16);
  auto it = mcast_.find(key);
  if (it == mcast_.end()) return error(EINVAL, "QP not attached to that group");
  auto at = std::find(it->second.qps.begin(), it->second.qps.end(), qp);
  if (at == it->second.qps.end()) return error(EINVAL, "QP not attached to that group");
  it->second.qps.erase(at);
  if (it->second.qps.empty()) mcast_.erase(it);
  return Status::ok();
}

void Device::mcast_forget(Qp& qp) {
  if (qp.type != IBV_QPT_UD || mcast_.empty()) return;
  for (auto it = mcast_.begin(); it != mcast_.end();) {
    std::erase(it->second.qps, &qp);
    it = it->second.qps.empty() ? mcast_.erase(it) : std::next(it);
  }
}

const Device::McastGroup* Device::mcast_group(bool global, const uint8_t gid[16],
                                              uint16_t lid) const {
  if (global) {
    McastKey key;
    std::memcpy(key.data(), gid, 16);
    auto it = mcast_.find(key);
    return it == mcast_.end() ? nullptr : &it->second;
  }
  const McastGroup* grp = nullptr;
  for (const auto& [k, g] : mcast_) {
    if (g.lid == lid) grp = &g;
  }
  return grp;
}

void Device::deliver_mcast(const McastGroup& grp, uint32_t qkey, const Inbound& in,
                           const uint8_t sgid[16], std::span<const Span> src, uint8_t sl) {
  // A copy: delivery may end a receiver's QP (a faulting receive buffer), never the group.
  const std::vector<Qp*> to = grp.qps;
  for (Qp* r : to) {
    if (rq_open(r->state) && r->attr.qkey == qkey)
      deliver_ud(*r, in, true, sgid, src, sl);
    else
      r->cnt.ud_dropped++;
  }
}

void Device::send_mcast(Qp& qp, const SendWqe& w, const UdDest& dest, uint64_t len) {
  // Every peer backend, connected or known, gets one copy, whether or not it has members (it
  // drops the copy then): no membership to keep in step across backends; see ARCHITECTURE.md,
  // "Multicast". The transport copies a datagram when queuing it (at most an MTU).
  size_t peers = 0;
  if (transport_) {
    const wire::Request rq = ud_request(qp, w, dest, len);
    for (const std::string& node : transport_->group_peers()) {
      if (node != transport_->self() && transport_->send(node, wire::Type::kRequest, &rq, src_))
        ++peers;
    }
  }
  // Sent, whoever receives it; remote members are not waited for. (Completed before the
  // local delivery, which may take the sender's own QP to ERR: a member whose receive faults.)
  complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));
  qp.cnt.msgs_sent++;
  qp.cnt.bytes_sent += len;
  if (const McastGroup* grp = mcast_group(dest.is_global, dest.dgid, dest.dlid)) {
    const uint32_t qkey = (w.ud_remote_qkey & 0x80000000u) ? qp.attr.qkey : w.ud_remote_qkey;
    deliver_mcast(*grp, qkey, inbound_of(qp, w, len), qp.guest->gid, src_, dest.sl);
  } else if (peers == 0) {
    qp.cnt.ud_dropped++;
  }
}

void Device::on_mcast(const std::string& node, const wire::Request& rq, transport::RxSink& sink) {
  // Checked as any datagram from a peer: its source is a guest of that node. Our own node
  // (TCP forced) never sends us a group's datagram: its members had it in send_mcast.
  if (node == transport_->self() || !ud_source_ok(node, rq)) {
    transport_->refused_frame(node,
                              "a datagram to a multicast group whose source LID/GID is "
                              "not that node's");
    return;
  }
  // No member here: dropped, as every peer gets the group's datagrams.
  if (!mcast_group(rq.is_global, rq.dgid, rq.dlid)) return;
  sink.scratch.resize(wire::kMaxUdPayload);
  if (rq.length) sink.spans.push_back({sink.scratch.data(), rq.length});
  sink.accepted = true;
}

void Device::on_mcast_done(const wire::Request& rq, transport::RxSink& sink) {
  // Looked up again: members may have left while the payload streamed in.
  const McastGroup* grp = mcast_group(rq.is_global, rq.dgid, rq.dlid);
  if (!grp) return;
  const Span s{sink.scratch.data(), rq.length};
  deliver_mcast(*grp, rq.qkey, inbound_of(rq), rq.sgid, {&s, rq.length ? 1u : 0u}, rq.sl);
}

}  // namespace vrdma::engine
