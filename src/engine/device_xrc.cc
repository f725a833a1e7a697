// XRC in the device model: domains (ibv_open_xrcd), XRC SRQs (ibv_create_srq_ex with
// IBV_SRQT_XRC), receive QPs (IBV_QPT_XRC_RECV, ibv_open_qp) and the choice of SRQ per request
// (bind_xrc_srq, called by the one responder). A domain is the guest's: the guest is vrdma's
// protection boundary, so processes of one guest share a domain by a file, those of two guests
// never. The sending side (IBV_QPT_XRC_SEND) is an RC requester with an SRQ number per WQE.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <bit>

#include "common/log.h"
#include "common/memfd.h"
#include "engine/datapath_util.h"
#include "engine/device.h"
#include "proto/device_caps.h"

namespace vrdma::engine {

using namespace vrdma::proto;

namespace {

Xrcd* xrcd_of(Session& s, uint32_t handle) {
  auto it = s.xrcds.find(handle);
  if (it == s.xrcds.end()) return nullptr;
  auto d = s.guest->xrcds.find(it->second);
  return d == s.guest->xrcds.end() ? nullptr : d->second.get();
}

}  // namespace

Result<uint32_t> Device::open_xrcd(Session& s, const OpenXrcdReq& req, UniqueFd file) {
  Guest& g = *s.guest;
  if (req.oflags & ~static_cast<uint32_t>(O_CREAT | O_EXCL))
    return error(EINVAL, fmt::format("oflags {:#x}: only O_CREAT and O_EXCL", req.oflags));
  Xrcd* x = nullptr;
  struct stat st {};
  if (file.valid()) {
    if (::fstat(file.get(), &st) < 0) return error(errno, "fstat of the XRC domain's file");
    for (auto& [id, d] : g.xrcds) {
      if (d->has_inode && d->dev == st.st_dev && d->ino == st.st_ino) x = d.get();
    }
    if (x && (req.oflags & O_CREAT) && (req.oflags & O_EXCL))
      return error(EINVAL, "O_CREAT | O_EXCL and the file's XRC domain exists");
    if (!x && !(req.oflags & O_CREAT))
      return error(ENOENT, "the file has no XRC domain yet and O_CREAT was not given");
  } else if (!(req.oflags & O_CREAT)) {
    return error(EINVAL, "an XRC domain without a file (fd -1) needs O_CREAT");
  }
  if (!x && g.xrcds.size() >= kMaxXrcd)
    return error(ENOMEM, fmt::format("XRC domain limit ({}) reached", kMaxXrcd));
  if (s.xrcds.size() >= kMaxXrcd)
    return error(ENOMEM, fmt::format("XRC domain opens per session ({}) reached", kMaxXrcd));
  if (!x) {
    auto d = std::make_unique<Xrcd>();
    d->id = g.next_xrcd++;
    d->has_inode = file.valid();
    d->dev = st.st_dev;
    d->ino = st.st_ino;
    x = d.get();
    g.xrcds[d->id] = std::move(d);
  }
  x->opens++;
  const uint32_t h = new_handle(s, s.xrcds);
  s.xrcds[h] = x->id;
  return h;
}

void Device::maybe_free_xrcd(Guest& g, uint32_t id) {
  auto it = g.xrcds.find(id);
  if (it != g.xrcds.end() && it->second->opens == 0 && it->second->users == 0) g.xrcds.erase(it);
}

Status Device::close_xrcd(Session& s, uint32_t handle) {
  Xrcd* x = xrcd_of(s, handle);
  if (!x) return error(EINVAL, fmt::format("no XRC domain {}", handle));
  // ibv_close_xrcd(3): "may fail if any other resource is still associated with the XRCD".
  // What this session holds in it keeps its open: another session's need not.
  uint32_t opens_here = 0;
  for (const auto& [h, id] : s.xrcds) opens_here += id == x->id;
  if (opens_here == 1) {
    for (const auto& [h, srq] : s.srqs)
      if (srq->xrcd == x->id) return error(EBUSY, "the XRC domain still has SRQs of this process");
    for (const auto& [h, qpn] : s.xrc_qps) {
      auto q = s.guest->xrc_qps.find(qpn);
      if (q != s.guest->xrc_qps.end() && q->second->xrcd == x->id)
        return error(EBUSY, "the XRC domain still has receive QPs of this process");
    }
  }
  const uint32_t id = x->id;
  s.xrcds.erase(handle);
  x->opens--;
  maybe_free_xrcd(*s.guest, id);
  return Status::ok();
}

Result<CreateSrqResp> Device::create_xrc_srq(Session& s, const CreateXrcSrqReq& req,
                                             UniqueFd& ring) {
  auto checked = [&]() -> Result<CreateSrqResp> {
    Xrcd* x = xrcd_of(s, req.xrcd);
    if (!x) return error(EINVAL, fmt::format("no XRC domain {}", req.xrcd));
    auto cq = s.cqs.find(req.cq);
    if (cq == s.cqs.end()) return error(EINVAL, fmt::format("no CQ {}", req.cq));
    // The basic SRQ's checks, ring and accounting; then what makes it an XRC SRQ.
    ASSIGN_OR_RETURN(CreateSrqResp resp,
                     create_srq_checked(s, CreateSrqReq{req.pd, 0, req.attr}, ring));
    Guest& g = *s.guest;
    Srq& srq = *s.srqs.at(resp.handle);
    uint32_t n;
    do {
      n = g.next_srqn++ & 0xffffff;
    } while (n == 0 || g.xrc_srqs.count(n));
    srq.xrcd = x->id;
    srq.srqn = n;
    srq.cq = cq->second.get();
    srq.cq->users++;
    x->users++;
    g.xrc_srqs[n] = &srq;
    resp.srq_num = n;
    return resp;
  };
  return refused(s, "create_srq", checked());
}

void Device::unlink_xrc_srq(Srq& srq) {
  Guest& g = *srq.owner->guest;
  for (auto& [qpn, qp] : g.xrc_qps) {
    if (qp->srq == &srq) {
      qp->srq = nullptr;
      qp->recv_cq = nullptr;
    }
  }
  g.xrc_srqs.erase(srq.srqn);
  srq.cq->users--;
  if (auto x = g.xrcds.find(srq.xrcd); x != g.xrcds.end()) x->second->users--;
  maybe_free_xrcd(g, srq.xrcd);
}

bool Device::bind_xrc_srq(Qp& to, uint32_t srqn) {
  auto it = to.guest->xrc_srqs.find(srqn);
  if (it == to.guest->xrc_srqs.end() || it->second->xrcd != to.xrcd) return false;
  to.srq = it->second;
  to.recv_cq = it->second->cq;
  return true;
}

Result<CreateQpResp> Device::create_xrc_recv_qp(Session& s, const CreateQpReq& req) {
  Xrcd* x = xrcd_of(s, req.xrcd);
  if (!x) return error(EINVAL, fmt::format("no XRC domain {}", req.xrcd));
  ASSIGN_OR_RETURN(const uint32_t qpn, new_qpn(*s.guest));
  Guest& g = *s.guest;
  // No queues: a receive QP only answers. Its ring pointers stay null; it is never polled.
  auto qp = std::make_unique<Qp>();
  qp->handle = new_handle(s, s.qps);
  qp->qpn = qpn;
  qp->owner = &s;
  qp->guest = &g;
  qp->type = IBV_QPT_XRC_RECV;
  qp->pd = kNone;
  qp->xrcd = x->id;
  qp->opens = 1;
  qp->attr.qp_state = IBV_QPS_RESET;
  qp->attr.port_num = 1;
  qp->attr.path_mtu = IBV_MTU_4096;
  qp->flow = next_flow_++;
  charge(g, Res::kQp);
  x->users++;
  CreateQpResp resp{qp->handle, qpn, QpCaps{}, 0, 0};
  s.xrc_qps[qp->handle] = qpn;
  g.qps[qpn] = qp.get();
  g.xrc_qps[qpn] = std::move(qp);
  return resp;
}

Result<CreateQpResp> Device::open_qp(Session& s, const OpenQpReq& req) {
  if (req.qp_type != IBV_QPT_XRC_RECV)
    return error(EINVAL, fmt::format("ibv_open_qp of QP type {}: only XRC_RECV", req.qp_type));
  Xrcd* x = xrcd_of(s, req.xrcd);
  if (!x) return error(EINVAL, fmt::format("no XRC domain {}", req.xrcd));
  auto it = s.guest->xrc_qps.find(req.qpn);
  if (it == s.guest->xrc_qps.end() || it->second->xrcd != x->id)
    return error(EINVAL, fmt::format("no XRC receive QP {:#x} in that domain", req.qpn));
  Qp& qp = *it->second;
  qp.opens++;
  const uint32_t h = new_handle(s, s.qps);
  s.xrc_qps[h] = qp.qpn;
  return CreateQpResp{h, qp.qpn, QpCaps{}, 0, 0};
}

void Device::close_xrc_qp(Session& s, uint32_t handle) {
  auto h = s.xrc_qps.find(handle);
  if (h == s.xrc_qps.end()) return;
  const uint32_t qpn = h->second;
  s.xrc_qps.erase(h);
  Guest& g = *s.guest;
  auto it = g.xrc_qps.find(qpn);
  if (it == g.xrc_qps.end()) return;
  Qp& qp = *it->second;
  if (--qp.opens > 0) {
    // Async events and reports go to a session that still holds it, under its handle there.
    if (qp.owner == &s) {
      for (auto& [id, other] : sessions_) {
        if (other.get() == &s || other->guest != &g) continue;
        for (const auto& [oh, oqpn] : other->xrc_qps) {
          if (oqpn != qpn) continue;
          qp.owner = other.get();
          qp.handle = oh;
        }
      }
    }
    return;
  }
  bump_epoch(g);
  take_back(qp);  // its replies still queued for another backend
  g.retired += counters_of(qp);
  g.qps.erase(qpn);
  release(g, Res::kQp);
  const uint32_t x = qp.xrcd;
  if (auto d = g.xrcds.find(x); d != g.xrcds.end()) d->second->users--;
  g.xrc_qps.erase(it);
  maybe_free_xrcd(g, x);
}

void Device::close_session_xrc(Session& s) {
  while (!s.xrc_qps.empty()) close_xrc_qp(s, s.xrc_qps.begin()->first);
  for (auto& [h, srq] : s.srqs)
    if (srq->xrcd) unlink_xrc_srq(*srq);
  for (const auto& [h, id] : s.xrcds) {
    if (auto d = s.guest->xrcds.find(id); d != s.guest->xrcds.end()) d->second->opens--;
    maybe_free_xrcd(*s.guest, id);
  }
  s.xrcds.clear();
}

}  // namespace vrdma::engine
