// Events: a channel's messages turned into rdma_cm_events (a CONNECT_REQUEST's new id, the
// peer's parameters, the library's half of the exchange on CONNECT_RESPONSE and MULTICAST_JOIN),
// rdma_get_cm_event, rdma_ack_cm_event and rdma_event_str.
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/wait_readable.h"
#include "rdmacm/internal.h"

namespace vrdma::rdmacm {

using namespace vrdma::proto;

namespace {

/// How long a connect that finds no listener is tried again (every kListenerRetryMs) before
/// REJECTED reaches the application. A real fabric spends about that resolving the address and
/// route, which programs count on: perftest -R's client connects as soon as the server said it
/// would listen, and vrdma resolves a local address at once.
constexpr uint64_t kListenerGraceMs = 200;
constexpr int kListenerRetryMs = 10;

VId* lookup(uint32_t handle) {
  auto it = cm().ids.find(handle);
  return it == cm().ids.end() ? nullptr : it->second;
}

/// A CONNECT_REQUEST's new id: the listener's context, channel and port space.
VId* new_request_id(const CmEvent& e, VId* l) {
  auto* n = new VId();
  n->handle = e.id;
  n->id.context = l->id.context;
  n->id.channel = l->id.channel;
  n->id.ps = l->id.ps;
  n->id.qp_type = l->id.qp_type;
  n->peer = e.peer;
  n->have_peer = true;
  n->ep_qp = l->ep_qp;
  n->ep_has_qp = l->ep_has_qp;
  n->id.pd = l->id.pd;
  attach_device(n);
  return n;
}

/// The connection parameters the other end's REQ or REP gives this one, as rdma_cm reports
/// them: its initiator depth is our responder resources and the reverse.
void fill_param(VEvent* ve, const CmEvent& e, bool ud) {
  rdma_cm_event& ev = ve->ev;
  const void* pd = e.private_len ? ve->pdata : nullptr;
  const auto len = static_cast<uint8_t>(std::min<uint32_t>(e.private_len, 255));
  if (ud) {
    rdma_ud_param& u = ev.param.ud;
    u.private_data = pd;
    u.private_data_len = len;
    u.qp_num = e.peer.qpn;
    u.qkey = e.peer.qkey;
    u.ah_attr.dlid = e.peer.lid;
    u.ah_attr.port_num = 1;
    u.ah_attr.is_global = 1;
    std::memcpy(&u.ah_attr.grh.dgid, e.peer.gid, 16);
    u.ah_attr.grh.hop_limit = 1;
    return;
  }
  rdma_conn_param& p = ev.param.conn;
  p.private_data = pd;
  p.private_data_len = len;
  p.responder_resources = e.peer.initiator_depth;
  p.initiator_depth = e.peer.responder_resources;
  p.flow_control = e.peer.flow_control;
  p.retry_count = e.peer.retry_count;
  p.rnr_retry_count = e.peer.rnr_retry_count;
  p.srq = e.peer.srq;
  p.qp_num = e.peer.qpn;
}

/// The backend went away (the channel's socket reads end-of-stream): DEVICE_REMOVAL once for
/// each id of the channel, as a device that disappears gives; then null (ENODEV).
VEvent* removal_event(VChannel* ch) {
  Cm& c = cm();
  std::lock_guard<std::mutex> g(c.mu);
  for (auto& [handle, v] : c.ids) {
    if (v->id.channel != &ch->ch || v->removed) continue;
    v->removed = true;
    auto* ve = new VEvent();
    ve->ev.event = RDMA_CM_EVENT_DEVICE_REMOVAL;
    ve->ev.id = &v->id;
    ve->owner = v;
    ++v->reported;
    c.live.insert(ve);
    return ve;
  }
  return nullptr;
}

/// What event `e` does to its id `v` (address, path, the peer's QP, the id's own QP, multicast
/// groups) before the application sees it in `ve`.
void apply_event(VEvent* ve, VId* v, const CmEvent& e) {
  Cm& c = cm();
  const bool ud = v->id.qp_type == IBV_QPT_UD;
  switch (static_cast<CmEventType>(e.event)) {
    case CmEventType::kAddrResolved: {
      std::lock_guard<std::mutex> g(c.mu);
      v->addr_resolved = true;
      break;
    }
    case CmEventType::kRouteResolved:
      set_path(v);
      break;
    case CmEventType::kConnectRequest:
      set_path(v);
      fill_param(ve, e, ud);
      break;
    case CmEventType::kEstablished:
      if (ud) {  // SIDR: the peer's QP, for its address handle
        v->peer = e.peer;
        v->have_peer = true;
        fill_param(ve, e, true);
      }
      break;
    case CmEventType::kConnectResponse:
      v->peer = e.peer;
      v->have_peer = true;
      set_path(v);
      fill_param(ve, e, false);
      // With a QP on the id, the library finishes the exchange (RTR, RTS, RTU) and the
      // application sees ESTABLISHED, as with rdma-core; without one it calls rdma_establish.
      if (v->id.qp) {
        if (move_qp(v, {IBV_QPS_RTR, IBV_QPS_RTS}) == 0 && establish(v) == 0) {
          ve->ev.event = RDMA_CM_EVENT_ESTABLISHED;
        } else {
          ve->ev.event = RDMA_CM_EVENT_CONNECT_ERROR;
          ve->ev.status = -(errno ? errno : EIO);
        }
      }
      break;
    case CmEventType::kRejected:
      fill_param(ve, e, ud);
      break;
    case CmEventType::kMulticastJoin: {
      // The group's address handle, QPN and qkey; the context given to the join; the id's QP
      // joins the group here, as rdma-core's library attaches it on this event.
      fill_param(ve, e, true);
      ibv_gid mgid;
      std::memcpy(&mgid, e.peer.gid, sizeof(mgid));
      {
        std::lock_guard<std::mutex> g(c.mu);
        for (VMc& mc : v->mcs) {
          if (mc.addr.family != e.dst.family || std::memcmp(mc.addr.addr, e.dst.addr, 16)) continue;
          mc.mgid = mgid;
          mc.mlid = e.peer.lid;
          ve->ev.param.ud.private_data = mc.context;
        }
      }
      if (v->id.qp) {
        if (int rc = ibv_attach_mcast(v->id.qp, &mgid, e.peer.lid)) {
          ve->ev.event = RDMA_CM_EVENT_MULTICAST_ERROR;
          ve->ev.status = -rc;
        }
      }
      break;
    }
    default:
      break;
  }
}

/// Turns one message of the channel's socket into an event; null when it is for an id that is
/// gone (or malformed), to be skipped.
VEvent* make_event(std::span<const uint8_t> msg) {
  auto h = decode_header(msg);
  if (!h.is_ok() || h->op != static_cast<uint16_t>(Op::kCmEvent)) return nullptr;
  auto body = body_of<CmEvent>(msg);
  if (!body.is_ok()) return nullptr;
  const CmEvent& e = body.value();
  Cm& c = cm();
  auto* ve = new VEvent();
  ve->ev.event = static_cast<rdma_cm_event_type>(e.event);
  ve->ev.status = e.status;
  const uint32_t plen = std::min<uint32_t>(e.private_len, kCmPrivateMax);
  std::memcpy(ve->pdata, e.private_data, plen);
  VId* v;
  VId* retry = nullptr;
  {
    std::lock_guard<std::mutex> g(c.mu);
    if (e.event == static_cast<uint32_t>(CmEventType::kConnectRequest)) {
      VId* l = lookup(e.listen_id);
      if (!l)
        v = nullptr;
      else {
        v = new_request_id(e, l);
        c.ids[e.id] = v;
        ve->ev.listen_id = &l->id;
      }
    } else {
      v = lookup(e.id);
    }
    if (v && e.event == static_cast<uint32_t>(CmEventType::kRejected) &&
        e.status == kCmRejInvalidService && v->connect_ms &&
        mono_ms() - v->connect_ms < kListenerGraceMs) {
      retry = v;
      v = nullptr;
    }
    if (v) {
      ++v->reported;
      c.live.insert(ve);
    }
  }
  if (retry) {
    delete ve;
    ::usleep(kListenerRetryMs * 1000);
    if (send_conn(retry, Op::kCmConnect, retry->mine, retry->connect_pdata.data(),
                  retry->connect_pdata.size()) != 0) {
      std::lock_guard<std::mutex> g(c.mu);
      retry->connect_ms = 0;
    }
    return nullptr;
  }
  if (!v) {
    // The listener went: its request is refused (the requester hears REJECTED).
    if (e.event == static_cast<uint32_t>(CmEventType::kConnectRequest))
      (void)call(Op::kCmDestroyId, HandleReq{e.id, 0});
    delete ve;
    return nullptr;
  }
  ve->owner = v;
  ve->ev.id = &v->id;
  set_addrs(v, &e.src, &e.dst, e.event == static_cast<uint32_t>(CmEventType::kAddrResolved));
  apply_event(ve, v, e);
  return ve;
}

}  // namespace

}  // namespace vrdma::rdmacm

using namespace vrdma::rdmacm;

CM_EXPORT int rdma_get_cm_event(rdma_event_channel* channel, rdma_cm_event** event) {
  if (!channel || !event) return fail(EINVAL);
  auto* ch = reinterpret_cast<VChannel*>(channel);
  ch->readers.fetch_add(1);
  if (ch->closed.load()) {
    // Destroyed before this thread came to read it (rping's event thread, when the main thread
    // tears down first): it waits for ever, as one that was already blocked on it does, rather
    // than failing (which such threads answer by exiting the process).
    for (;;) ::pause();
  }
  std::vector<uint8_t> buf(sizeof(vrdma::proto::MsgHeader) + sizeof(vrdma::proto::CmEvent) + 64);
  int rc = 0;
  for (;;) {
    // Waiting in poll, not recv: a thread there can be stopped (common/wait_readable.h).
    if (vrdma::wait_readable(channel->fd)) {  // EINTR, as recv would have failed
      rc = -1;
      break;
    }
    const ssize_t n = ::recv(channel->fd, buf.data(), buf.size(), 0);
    if (n < 0) {  // EAGAIN with O_NONBLOCK, EINTR
      rc = -1;
      break;
    }
    if (n == 0) {  // the backend went away: the device is gone
      VEvent* ve = removal_event(ch);
      cm().acked.notify_all();  // an rdma_destroy_id may wait for it (cma.cc, removal_owed)
      if (ve)
        *event = &ve->ev;
      else
        rc = fail(ENODEV);
      break;
    }
    VEvent* ve = make_event({buf.data(), static_cast<size_t>(n)});
    if (ve) {
      *event = &ve->ev;
      break;
    }
  }
  const int err = errno;
  if (ch->readers.fetch_sub(1) == 1 && ch->closed.load() && !ch->fd_closed.exchange(true))
    ::close(ch->ch.fd);
  errno = err;
  return rc;
}

CM_EXPORT int rdma_ack_cm_event(rdma_cm_event* event) {
  if (!event) return fail(EINVAL);
  auto* ve = reinterpret_cast<VEvent*>(event);
  Cm& c = cm();
  {
    std::lock_guard<std::mutex> g(c.mu);
    if (!c.live.erase(ve)) return fail(EINVAL);  // acked already
    ++ve->owner->acked;
  }
  c.acked.notify_all();
  delete ve;
  return 0;
}

CM_EXPORT const char* rdma_event_str(rdma_cm_event_type event) {
  switch (event) {
    case RDMA_CM_EVENT_ADDR_RESOLVED:
      return "RDMA_CM_EVENT_ADDR_RESOLVED";
    case RDMA_CM_EVENT_ADDR_ERROR:
      return "RDMA_CM_EVENT_ADDR_ERROR";
    case RDMA_CM_EVENT_ROUTE_RESOLVED:
      return "RDMA_CM_EVENT_ROUTE_RESOLVED";
    case RDMA_CM_EVENT_ROUTE_ERROR:
      return "RDMA_CM_EVENT_ROUTE_ERROR";
    case RDMA_CM_EVENT_CONNECT_REQUEST:
      return "RDMA_CM_EVENT_CONNECT_REQUEST";
    case RDMA_CM_EVENT_CONNECT_RESPONSE:
      return "RDMA_CM_EVENT_CONNECT_RESPONSE";
    case RDMA_CM_EVENT_CONNECT_ERROR:
      return "RDMA_CM_EVENT_CONNECT_ERROR";
    case RDMA_CM_EVENT_UNREACHABLE:
      return "RDMA_CM_EVENT_UNREACHABLE";
    case RDMA_CM_EVENT_REJECTED:
      return "RDMA_CM_EVENT_REJECTED";
    case RDMA_CM_EVENT_ESTABLISHED:
      return "RDMA_CM_EVENT_ESTABLISHED";
    case RDMA_CM_EVENT_DISCONNECTED:
      return "RDMA_CM_EVENT_DISCONNECTED";
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
      return "RDMA_CM_EVENT_DEVICE_REMOVAL";
    case RDMA_CM_EVENT_MULTICAST_JOIN:
      return "RDMA_CM_EVENT_MULTICAST_JOIN";
    case RDMA_CM_EVENT_MULTICAST_ERROR:
      return "RDMA_CM_EVENT_MULTICAST_ERROR";
    case RDMA_CM_EVENT_ADDR_CHANGE:
      return "RDMA_CM_EVENT_ADDR_CHANGE";
    case RDMA_CM_EVENT_TIMEWAIT_EXIT:
      return "RDMA_CM_EVENT_TIMEWAIT_EXIT";
  }
  return "UNKNOWN EVENT";
}
