// UD multicast within one backend (ibv_attach_mcast/detach, rdma_join_multicast): a group is a
// multicast GID (ff00::/8) with its LID; a datagram sent to it reaches every UD QP of this
// backend attached to it whose qkey matches, the sender's own included (no
// IBV_QP_CREATE_BLOCK_SELF_MCAST_LB). Groups span the backend's guests, as a fabric's partition
// does; they do not cross to other backends. Owned by the engine thread.
#include <algorithm>

#include "common/log.h"
#include "engine/datapath_util.h"

namespace vrdma::engine {

using namespace vrdma::proto;

namespace {

bool multicast_gid(const uint8_t gid[16]) { return gid[0] == 0xff; }

}  // namespace

bool Device::is_mcast(const UdDest& d) {
  return d.is_global ? multicast_gid(d.dgid) : d.dlid >= 0xc000 && d.dlid != 0xffff;
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

void Device::send_mcast(Qp& qp, const SendWqe& w, const UdDest& dest, uint64_t len) {
  const uint32_t qkey = (w.ud_remote_qkey & 0x80000000u) ? qp.attr.qkey : w.ud_remote_qkey;
  complete_send(qp, w, IBV_WC_SUCCESS, static_cast<uint32_t>(len));  // sent, whatever happens
  qp.cnt.msgs_sent++;
  qp.cnt.bytes_sent += len;
  const McastGroup* grp = nullptr;
  if (dest.is_global) {
    McastKey key;
    std::memcpy(key.data(), dest.dgid, 16);
    if (auto it = mcast_.find(key); it != mcast_.end()) grp = &it->second;
  } else {
    for (const auto& [k, g] : mcast_) {
      if (g.lid == dest.dlid) grp = &g;
    }
  }
  if (!grp) {
    qp.cnt.ud_dropped++;
    return;
  }
  const Inbound in = inbound_of(qp, w, len);
  // A copy: delivery may end a receiver's QP (a faulting receive buffer), never the group.
  const std::vector<Qp*> to = grp->qps;
  for (Qp* r : to) {
    if (rq_open(r->state) && r->attr.qkey == qkey)
      deliver_ud(*r, in, true, qp.guest->gid, src_, dest.sl);
    else
      r->cnt.ud_dropped++;
  }
}

}  // namespace vrdma::engine
