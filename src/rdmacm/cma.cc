// rdma_cma.h over the backend's connection service (backend/cm.h): the control connection,
// event channels (a socket per channel whose messages are events), ids and the connection
// exchange. QPs are ordinary vrdma QPs, made and moved through the public verbs API (qp.cc).
#include <arpa/inet.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <vector>

#include "common/log.h"
#include "common/paths.h"
#include "common/socket.h"
#include "proto/ring.h"
#include "rdmacm/internal.h"

namespace vrdma::rdmacm {

using namespace vrdma::proto;

namespace {

constexpr int kCallTimeoutMs = 30000;
/// Room for the largest answer of the connection service (a header and a fixed body; no status
/// text): recv_msg sizes (and zero-fills) its buffer to the cap on every call, and kMaxResponse's
/// 1 MiB was most of a connection's setup time (see BENCHMARKS.md, "RDMA CM connection rate").
constexpr size_t kCmMaxResponse = 256;
static_assert(kCmMaxResponse >= sizeof(MsgHeader) + sizeof(CmAddrResp) &&
              kCmMaxResponse >= sizeof(MsgHeader) + sizeof(HandleResp));
/// Commands posted (post()) whose answers are not read yet, at most: their answers wait in the
/// socket's receive buffer, which must not fill up (the backend would stop answering).
constexpr uint32_t kMaxUnanswered = 64;

CmAddr to_cm_addr(const sockaddr* sa) {
  CmAddr a{};
  if (!sa) return a;
  if (sa->sa_family == AF_INET) {
    const auto* sin = reinterpret_cast<const sockaddr_in*>(sa);
    a.family = AF_INET;
    a.port = ntohs(sin->sin_port);
    std::memcpy(a.addr, &sin->sin_addr, 4);
  } else if (sa->sa_family == AF_INET6) {
    const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(sa);
    a.family = AF_INET6;
    a.port = ntohs(sin6->sin6_port);
    a.scope_id = sin6->sin6_scope_id;
    std::memcpy(a.addr, &sin6->sin6_addr, 16);
  } else {
    a.family = sa->sa_family;  // refused by the backend (EAFNOSUPPORT)
  }
  return a;
}

void from_cm_addr(const CmAddr& a, sockaddr_storage* out) {
  std::memset(out, 0, sizeof(*out));
  if (a.family == AF_INET) {
    auto* sin = reinterpret_cast<sockaddr_in*>(out);
    sin->sin_family = AF_INET;
    sin->sin_port = htons(a.port);
    std::memcpy(&sin->sin_addr, a.addr, 4);
  } else if (a.family == AF_INET6) {
    auto* sin6 = reinterpret_cast<sockaddr_in6*>(out);
    sin6->sin6_family = AF_INET6;
    sin6->sin6_port = htons(a.port);
    sin6->sin6_scope_id = a.scope_id;
    std::memcpy(&sin6->sin6_addr, a.addr, 16);
  }
}

bool wildcard(const sockaddr* sa) {
  if (sa->sa_family == AF_INET)
    return reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr == INADDR_ANY;
  if (sa->sa_family == AF_INET6)
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
  return false;
}

}  // namespace

void attach_device(VId* v) {
  Cm& c = cm();
  v->id.verbs = c.ctx;
  v->id.port_num = 1;
  std::memcpy(&v->id.route.addr.addr.ibaddr.sgid, &c.gid, sizeof(c.gid));
  v->id.route.addr.addr.ibaddr.pkey = htobe16(0xffff);
}

void set_addrs(VId* v, const CmAddr* src, const CmAddr* dst, bool attach) {
  std::lock_guard<std::mutex> g(cm().mu);
  sockaddr_storage ss;
  if (src && src->family) {
    from_cm_addr(*src, &ss);
    std::memcpy(&v->id.route.addr.src_storage, &ss, sizeof(ss));
  }
  if (dst && dst->family) {
    from_cm_addr(*dst, &ss);
    std::memcpy(&v->id.route.addr.dst_storage, &ss, sizeof(ss));
  }
  if (attach) attach_device(v);
}

void set_path(VId* v) {
  ibv_sa_path_rec& p = v->path;
  std::memcpy(&p.sgid, &cm().gid, sizeof(p.sgid));
  p.slid = htobe16(cm().port.lid);
  if (v->have_peer) {
    std::memcpy(&p.dgid, v->peer.gid, 16);
    p.dlid = htobe16(v->peer.lid);
    std::memcpy(&v->id.route.addr.addr.ibaddr.dgid, v->peer.gid, 16);
  }
  p.pkey = htobe16(0xffff);
  p.hop_limit = 1;
  p.reversible = 1;
  p.numb_path = 1;
  p.mtu = cm().port.active_mtu;
  p.mtu_selector = 2;  // exactly
  p.rate = 3;          // 10 Gb/s, as ibv_query_port says
  p.packet_life_time = 14;
  v->id.route.path_rec = &v->path;
  v->id.route.num_paths = 1;
}

namespace {

int open_channel(VChannel** out) {
  if (ensure_open()) return -1;
  auto* ch = new VChannel();
  HandleResp r{};
  int fd = -1;
  if (call(Op::kCmCreateChannel, nullptr, 0, &r, sizeof(r), &fd) || fd < 0) {
    const int err = errno ? errno : EIO;
    delete ch;
    return fail(err);
  }
  ch->ch.fd = fd;
  ch->handle = r.handle;
  *out = ch;
  return 0;
}

/// Destroyed channels, kept (not freed) so that a thread still inside rdma_get_cm_event on
/// one, or entering it late, reads valid memory; the oldest are freed past kBuried.
constexpr size_t kBuried = 1024;
struct Graveyard {
  std::mutex mu;
  std::deque<VChannel*> channels;
};
Graveyard& graveyard() {
  static auto* g = new Graveyard();  // never destroyed: it is still reachable at exit
  return *g;
}

void close_channel(VChannel* ch) {
  (void)call(Op::kCmDestroyChannel, HandleReq{ch->handle, 0});
  // A reader blocked on the fd keeps it (the backend keeps its end until ours closes, so the
  // reader stays blocked, as on a kernel rdma_cm fd); the last reader out closes it.
  ch->closed.store(true);
  if (ch->readers.load() == 0 && !ch->fd_closed.exchange(true)) ::close(ch->ch.fd);
  Graveyard& y = graveyard();
  std::lock_guard<std::mutex> g(y.mu);
  y.channels.push_back(ch);
  if (y.channels.size() > kBuried) {
    VChannel* old = y.channels.front();
    y.channels.pop_front();
    if (old->readers.load() == 0) delete old;  // else a blocked reader: left for ever
  }
}

/// Waits for the next event of a synchronous id and keeps it in id->event (acked by the next
/// wait or by rdma_destroy_id): 0 when it is `want` with status 0, else -1 with errno.
int complete(VId* v, rdma_cm_event_type want) {
  if (v->id.event) {
    rdma_ack_cm_event(v->id.event);
    v->id.event = nullptr;
  }
  rdma_cm_event* e;
  if (rdma_get_cm_event(v->id.channel, &e)) return -1;
  v->id.event = e;
  if (e->event == want && e->status == 0) return 0;
  if (e->event == RDMA_CM_EVENT_REJECTED) return fail(ECONNREFUSED);
  if (e->status < 0) return fail(-e->status);
  return fail(EINVAL);
}

}  // namespace

int send_conn(VId* v, Op op, const vrdma::proto::CmQpInfo& qp, const void* pdata, size_t len) {
  if (len > private_data_limit(v, op) || (len && !pdata)) return fail(EINVAL);
  vrdma::proto::CmConnReq req{};
  req.id = v->handle;
  req.qp = qp;
  req.private_len = static_cast<uint32_t>(len);
  if (len) std::memcpy(req.private_data, pdata, len);
  return call(op, req);
}

Cm& cm() {
  static Cm* c = new Cm();  // never destroyed: ids may outlive static destructors
  return *c;
}

int ensure_open() {
  Cm& c = cm();
  std::lock_guard<std::mutex> g(c.rpc_mu);
  if (c.sock >= 0) return 0;
  if (!c.ctx) {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (!list || n == 0) {
      if (list) ibv_free_device_list(list);
      return fail(ENODEV);
    }
    c.ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    if (!c.ctx) return -1;
    if (ibv_query_port(c.ctx, 1, &c.port) || ibv_query_device(c.ctx, &c.dev) ||
        ibv_query_gid(c.ctx, 1, 0, &c.gid)) {
      const int err = errno ? errno : EIO;
      ibv_close_device(c.ctx);
      c.ctx = nullptr;
      return fail(err);
    }
  }
  // Our own session in the guest: the connection service's commands never wait behind (or
  // race with) the verbs library's on the device's socket.
  auto sock = connect_backend_socket(socket_path(), kCallTimeoutMs);
  if (!sock.is_ok()) {
    VLOG_ERROR("rdmacm: cannot reach the vrdma backend: {}",
               backend_unreachable_hint(socket_path(), sock.status().err()));
    return fail(ENODEV);
  }
  Result<std::string> guest = guest_name();
  if (!guest.is_ok()) {
    VLOG_ERROR("rdmacm: {}", guest.status().message());
    return fail(EINVAL);
  }
  HelloReq req{};
  std::snprintf(req.guest, sizeof(req.guest), "%s", guest->c_str());
  req.pid = static_cast<uint32_t>(::getpid());
  std::vector<uint8_t> msg = encode(Op::kHello, ++c.seq, 0, req);
  std::vector<UniqueFd> fds;  // the session's control page (its features), doorbell, events
  Status st = send_msg(sock.value().get(), msg);
  if (st.is_ok()) st = recv_msg(sock.value().get(), msg, kMaxResponse, fds);
  if (!st.is_ok()) return fail(st.err());
  auto h = decode_header(msg);
  if (!h.is_ok()) return fail(EPROTO);
  if (h->status) {
    VLOG_ERROR("rdmacm: the backend refused guest '{}': {}", *guest, std::strerror(-h->status));
    return fail(-h->status);
  }
  // Its features, from the control page it handed over: whether posted commands get answers.
  if (!fds.empty()) {
    void* cp = ::mmap(nullptr, sizeof(ControlPage), PROT_READ, MAP_SHARED, fds[0].get(), 0);
    if (cp != MAP_FAILED) {
      const auto* page = static_cast<const ControlPage*>(cp);
      c.no_answer = page->magic == kRingMagic && (page->features & kFeatureNoAnswer);
      ::munmap(cp, sizeof(ControlPage));
    }
  }
  c.sock = sock.value().release();
  return 0;
}

namespace {

/// Sends one command on the service's connection (under Cm::rpc_mu); its sequence number.
Result<uint32_t> send_command(Cm& c, Op op, const void* body, size_t body_len, uint32_t flags = 0) {
  if (c.sock < 0) return error(ENODEV, "no connection to the backend");
  std::vector<uint8_t> msg(sizeof(MsgHeader) + body_len);
  const MsgHeader h{
      kMagic, kVersion, static_cast<uint16_t>(op), static_cast<uint32_t>(msg.size()), ++c.seq,
      0,      flags};
  std::memcpy(msg.data(), &h, sizeof(h));
  if (body_len) std::memcpy(msg.data() + sizeof(h), body, body_len);
  Status st = send_msg(c.sock, msg);
  if (!st.is_ok()) return error(st.err() == EAGAIN ? ETIMEDOUT : st.err(), st.message());
  return h.seq;
}

/// Reads answers until the one to command `seq` (under Cm::rpc_mu), into `msg` and `fds`;
/// those before it (posted commands', a timed-out call's) are dropped: answers come in order,
/// so none is left unanswered before `seq`. 0, or -1 with errno.
int await_answer(Cm& c, uint16_t op, uint32_t seq, std::vector<uint8_t>& msg,
                 std::vector<UniqueFd>& fds) {
  const uint64_t start = mono_ns();
  const uint64_t spun = c.answer_spin.budget_ns();
  for (;;) {
    // Spun for first (common/answer_spin.h), then waited for in poll.
    const uint64_t now = mono_ns();
    Status st = now - start < spun
                    ? spin_recv(c.sock, msg, kCmMaxResponse, fds, spun - (now - start))
                    : error(EAGAIN, "");
    if (st.err() == EAGAIN) {
      pollfd p{c.sock, POLLIN, 0};
      int n;
      do {
        n = ::poll(&p, 1, kCallTimeoutMs);
      } while (n < 0 && errno == EINTR);
      if (n == 0) {
        VLOG_ERROR("rdmacm: {}: the backend did not answer within {} ms", op_name(op),
                   kCallTimeoutMs);
        return fail(ETIMEDOUT);
      }
      st = recv_msg(c.sock, msg, kCmMaxResponse, fds);
    }
    if (!st.is_ok()) return fail(st.err());
    auto rh = decode_header(msg);
    if (!rh.is_ok()) return fail(EPROTO);
    if (rh->seq != seq) continue;
    c.unanswered = 0;
    c.answer_spin.note(spun, mono_ns() - start);
    return 0;
  }
}

}  // namespace

int call(Op op, const void* body, size_t body_len, void* resp, size_t resp_len, int* fd_out) {
  Cm& c = cm();
  std::lock_guard<std::mutex> g(c.rpc_mu);
  auto seq = send_command(c, op, body, body_len);
  if (!seq.is_ok()) return fail(seq.status().err());
  std::vector<uint8_t> msg;
  std::vector<UniqueFd> fds;
  if (await_answer(c, static_cast<uint16_t>(op), seq.value(), msg, fds)) return -1;
  const MsgHeader* rh = reinterpret_cast<const MsgHeader*>(msg.data());
  if (rh->status) return fail(-rh->status);
  if (resp_len && msg.size() == sizeof(MsgHeader) + resp_len)
    std::memcpy(resp, msg.data() + sizeof(MsgHeader), resp_len);
  else if (resp_len)
    return fail(EPROTO);
  if (fd_out && !fds.empty()) *fd_out = fds[0].release();
  return 0;
}

int establish(VId* v) {
  bool answered;
  {
    std::lock_guard<std::mutex> g(cm().mu);
    answered = v->active && v->have_peer;
  }
  // The RTU after a CONNECT_RESPONSE: not waited for. Were the acceptor gone meanwhile, its
  // DISCONNECTED follows, as on a fabric where the RTU met nobody.
  if (!answered) return call(Op::kCmEstablish, vrdma::proto::HandleReq{v->handle, 0});
  post(Op::kCmEstablish, vrdma::proto::HandleReq{v->handle, 0});
  return 0;
}

void post(Op op, const void* body, size_t body_len) {
  Cm& c = cm();
  std::lock_guard<std::mutex> g(c.rpc_mu);
  if (c.no_answer) {
    (void)send_command(c, op, body, body_len, kRequestNoAnswer);
    return;
  }
  if (c.unanswered >= kMaxUnanswered) {  // their answers wait in our socket's buffer: read them
    std::vector<uint8_t> msg;
    std::vector<UniqueFd> fds;
    (void)await_answer(c, static_cast<uint16_t>(op), c.seq, msg, fds);
  }
  if (send_command(c, op, body, body_len).is_ok()) ++c.unanswered;
}

namespace {

/// At exit, the answers to posted commands are read: a process that ends right after
/// rdma_destroy_id would otherwise close its connection under them, which the backend logs as
/// a session reset.
__attribute__((destructor)) void read_posted_answers() {
  Cm& c = cm();
  // Not when another thread is inside a call (it reads them): exit must not wait for it.
  std::unique_lock<std::mutex> g(c.rpc_mu, std::try_to_lock);
  if (!g.owns_lock() || c.sock < 0 || c.unanswered == 0) return;
  pollfd p{c.sock, POLLIN, 0};
  std::vector<uint8_t> msg;
  std::vector<UniqueFd> fds;
  // Briefly: the backend answers at once, or is gone.
  while (::poll(&p, 1, 1000) > 0 && recv_msg(c.sock, msg, kCmMaxResponse, fds).is_ok()) {
    auto rh = decode_header(msg);
    if (!rh.is_ok() || rh->seq == c.seq) break;
  }
  c.unanswered = 0;
}

}  // namespace

int create_id(rdma_event_channel* channel, rdma_cm_id** id, void* context, rdma_port_space ps,
              ibv_qp_type qp_type) {
  if (!id) return fail(EINVAL);
  if (ensure_open()) return -1;
  auto* v = new VId();
  if (!channel) {
    if (open_channel(&v->own)) {
      delete v;
      return -1;
    }
    channel = &v->own->ch;
  }
  CmCreateIdReq req{reinterpret_cast<VChannel*>(channel)->handle, static_cast<uint16_t>(ps),
                    service_qp_type(qp_type), 0};
  HandleResp r{};
  if (call(Op::kCmCreateId, &req, sizeof(req), &r, sizeof(r))) {
    const int err = errno;
    if (v->own) close_channel(v->own);
    delete v;
    return fail(err);
  }
  v->handle = r.handle;
  v->id.channel = channel;
  v->id.context = context;
  v->id.ps = ps;
  v->id.qp_type = qp_type;
  {
    std::lock_guard<std::mutex> g(cm().mu);
    cm().ids[v->handle] = v;
  }
  *id = &v->id;
  return 0;
}

size_t private_data_limit(const VId* v, Op op) {
  return cm_private_limit(static_cast<uint16_t>(v->id.ps), service_qp_type(v->id.qp_type), op);
}

}  // namespace vrdma::rdmacm

using namespace vrdma::rdmacm;
using vrdma::proto::Op;

CM_EXPORT rdma_event_channel* rdma_create_event_channel() {
  VChannel* ch;
  if (open_channel(&ch)) return nullptr;
  return &ch->ch;
}

CM_EXPORT void rdma_destroy_event_channel(rdma_event_channel* channel) {
  if (channel) close_channel(reinterpret_cast<VChannel*>(channel));
}

CM_EXPORT int rdma_create_id(rdma_event_channel* channel, rdma_cm_id** id, void* context,
                             rdma_port_space ps) {
  // Read as a number: a value outside the enum (udaddy's -p takes any) is the caller's error.
  int n;
  static_assert(sizeof(n) == sizeof(ps));
  std::memcpy(&n, &ps, sizeof(n));
  if (n != RDMA_PS_TCP && n != RDMA_PS_UDP && n != RDMA_PS_IB && n != RDMA_PS_IPOIB)
    return fail(EINVAL);
  const ibv_qp_type t = n == RDMA_PS_UDP || n == RDMA_PS_IPOIB ? IBV_QPT_UD : IBV_QPT_RC;
  return create_id(channel, id, context, ps, t);
}

namespace {
/// The backend went away (the id's channel hung up) and a thread waits on that channel in
/// rdma_get_cm_event, not yet given this id's DEVICE_REMOVAL. A kernel device queues the removal
/// on every id before the application can hear of the loss any other way; here a CQ's poll may
/// tell it first (rping's CQ thread), and an id destroyed then would leave the waiting thread
/// ENODEV instead of its event. Under Cm::mu.
bool removal_owed(const VId& v) {
  if (v.removed || !v.id.channel || v.own) return false;
  const auto* ch = reinterpret_cast<const VChannel*>(v.id.channel);
  if (ch->readers.load() == 0 || ch->closed.load() || ch->fd_closed.load()) return false;
  pollfd p{v.id.channel->fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLRDHUP));
}
/// How long rdma_destroy_id waits for a waiting thread to take the id's removal (removal_owed).
constexpr auto kRemovalWait = std::chrono::seconds(2);
}  // namespace

CM_EXPORT int rdma_destroy_id(rdma_cm_id* id) {
  if (!id) return fail(EINVAL);
  VId* v = to_vid(id);
  if (id->event) {
    rdma_ack_cm_event(id->event);
    id->event = nullptr;
  }
  Cm& c = cm();
  {
    std::unique_lock<std::mutex> g(c.mu);
    if (removal_owed(*v)) c.acked.wait_for(g, kRemovalWait, [v] { return v->removed; });
  }
  {
    // As rdma-core: every event handed out for the id must be acked first (said once, after a
    // second, so that a program that forgot one knows why it stopped).
    std::unique_lock<std::mutex> g(c.mu);
    auto all_acked = [v] { return v->acked == v->reported; };
    if (!c.acked.wait_for(g, std::chrono::seconds(1), all_acked)) {
      VLOG_WARN("rdma_destroy_id waits for {} unacked event(s) of the id (rdma_ack_cm_event)",
                v->reported - v->acked);
      c.acked.wait(g, all_acked);
    }
    c.ids.erase(v->handle);
  }
  // Nothing to wait for: the backend takes it before this process's next command, and the
  // answer, whatever it is, would change nothing here.
  post(Op::kCmDestroyId, vrdma::proto::HandleReq{v->handle, 0});
  if (v->own) close_channel(v->own);
  delete v;
  return 0;
}

CM_EXPORT int rdma_bind_addr(rdma_cm_id* id, sockaddr* addr) {
  if (!id || !addr) return fail(EINVAL);
  VId* v = to_vid(id);
  vrdma::proto::CmAddrReq req{v->handle, 0, to_cm_addr(addr)};
  vrdma::proto::CmAddrResp r{};
  if (call(Op::kCmBind, &req, sizeof(req), &r, sizeof(r))) return -1;
  // A wildcard address names no device yet (as with rdma-core): requests bring it.
  set_addrs(v, &r.addr, nullptr, !wildcard(addr));
  return 0;
}

CM_EXPORT int rdma_resolve_addr(rdma_cm_id* id, sockaddr* src_addr, sockaddr* dst_addr,
                                int timeout_ms) {
  if (!id || !dst_addr) return fail(EINVAL);
  VId* v = to_vid(id);
  vrdma::proto::CmResolveReq req{v->handle, static_cast<uint32_t>(std::max(timeout_ms, 0)),
                                 to_cm_addr(src_addr), to_cm_addr(dst_addr)};
  set_addrs(v, nullptr, &req.dst, false);
  if (call(Op::kCmResolveAddr, req)) return -1;
  return v->own ? complete(v, RDMA_CM_EVENT_ADDR_RESOLVED) : 0;
}

CM_EXPORT int rdma_resolve_route(rdma_cm_id* id, int timeout_ms) {
  if (!id) return fail(EINVAL);
  VId* v = to_vid(id);
  vrdma::proto::CmResolveReq req{v->handle, static_cast<uint32_t>(std::max(timeout_ms, 0)), {}, {}};
  // With its address resolved and no connect yet the backend takes it (ROUTE_RESOLVED
  // follows): not waited for. Otherwise its answer is the caller's (EINVAL).
  bool resolved;
  {
    std::lock_guard<std::mutex> g(cm().mu);
    resolved = v->addr_resolved && !v->active;
  }
  if (resolved)
    post(Op::kCmResolveRoute, req);
  else if (call(Op::kCmResolveRoute, req))
    return -1;
  return v->own ? complete(v, RDMA_CM_EVENT_ROUTE_RESOLVED) : 0;
}

CM_EXPORT int rdma_listen(rdma_cm_id* id, int backlog) {
  if (!id) return fail(EINVAL);
  vrdma::proto::CmListenReq req{to_vid(id)->handle, static_cast<uint32_t>(std::max(backlog, 0))};
  return call(Op::kCmListen, req);
}

CM_EXPORT int rdma_connect(rdma_cm_id* id, rdma_conn_param* conn_param) {
  if (!id) return fail(EINVAL);
  VId* v = to_vid(id);
  rdma_conn_param param =
      conn_param ? *conn_param : rdma_conn_param{nullptr, 0, 0, 0, 0, 7, 7, 0, 0};
  param.private_data = nullptr;
  const CmQpInfo mine = local_qp_info(v, &param);
  const auto* pd = static_cast<const uint8_t*>(conn_param ? conn_param->private_data : nullptr);
  const size_t len = conn_param ? conn_param->private_data_len : 0;
  {
    // Before the REQ, under the lock the event thread takes: its answer (CONNECT_RESPONSE, or
    // a REJECTED to send again) may be read there before send_conn returns.
    std::lock_guard<std::mutex> g(cm().mu);
    v->param = param;
    v->active = true;
    v->mine = mine;
    v->connect_pdata.assign(pd, pd + (pd ? len : 0));
    v->connect_ms = mono_ms();
  }
  if (send_conn(v, Op::kCmConnect, mine, pd, len)) {
    std::lock_guard<std::mutex> g(cm().mu);
    v->connect_ms = 0;
    return -1;
  }
  return v->own ? complete(v, RDMA_CM_EVENT_ESTABLISHED) : 0;
}

CM_EXPORT int rdma_accept(rdma_cm_id* id, rdma_conn_param* conn_param) {
  if (!id) return fail(EINVAL);
  VId* v = to_vid(id);
  if (!v->have_peer) return fail(EINVAL);
  if (conn_param) {
    v->param = *conn_param;
  } else {  // what the requester offered
    v->param = rdma_conn_param{};
    v->param.responder_resources = v->peer.initiator_depth;
    v->param.initiator_depth = v->peer.responder_resources;
    v->param.rnr_retry_count = 7;
  }
  v->param.private_data = nullptr;
  v->mine = local_qp_info(v, &v->param);
  if (id->qp && id->qp_type != IBV_QPT_UD && move_qp(v, {IBV_QPS_RTR, IBV_QPS_RTS})) return -1;
  if (send_conn(v, Op::kCmAccept, v->mine, conn_param ? conn_param->private_data : nullptr,
                conn_param ? conn_param->private_data_len : 0))
    return -1;
  if (!v->own || id->qp_type == IBV_QPT_UD) return 0;
  return complete(v, RDMA_CM_EVENT_ESTABLISHED);
}

CM_EXPORT int rdma_establish(rdma_cm_id* id) {
  if (!id) return fail(EINVAL);
  VId* v = to_vid(id);
  if (id->qp && move_qp(v, {IBV_QPS_RTR, IBV_QPS_RTS})) return -1;
  return establish(v);
}

CM_EXPORT int rdma_reject(rdma_cm_id* id, const void* private_data, uint8_t private_data_len) {
  if (!id) return fail(EINVAL);
  return send_conn(to_vid(id), Op::kCmReject, {}, private_data, private_data_len);
}

CM_EXPORT int rdma_reject_ece(rdma_cm_id* id, const void* private_data, uint8_t private_data_len) {
  return rdma_reject(id, private_data, private_data_len);
}

CM_EXPORT int rdma_disconnect(rdma_cm_id* id) {
  if (!id) return fail(EINVAL);
  // The QP stops first (its outstanding work flushes), as rdma-core does on IB.
  if (id->qp && id->qp_type != IBV_QPT_UD) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    (void)ibv_modify_qp(id->qp, &a, IBV_QP_STATE);
  }
  return call(Op::kCmDisconnect, vrdma::proto::HandleReq{to_vid(id)->handle, 0});
}

CM_EXPORT int rdma_get_request(rdma_cm_id* listen, rdma_cm_id** id) {
  if (!listen || !id) return fail(EINVAL);
  VId* l = to_vid(listen);
  if (!l->own) return fail(EINVAL);  // only a synchronous listener
  rdma_cm_event* e;
  for (;;) {
    if (rdma_get_cm_event(listen->channel, &e)) return -1;
    if (e->event == RDMA_CM_EVENT_CONNECT_REQUEST) break;
    const int status = e->status;
    rdma_ack_cm_event(e);
    if (status) return fail(status < 0 ? -status : EIO);
  }
  VId* n = to_vid(e->id);
  // The new id is synchronous too: a channel of its own.
  if (rdma_migrate_id(&n->id, nullptr)) {
    const int err = errno;
    rdma_ack_cm_event(e);
    return fail(err);
  }
  n->id.event = e;
  if (n->ep_has_qp) {
    ibv_qp_init_attr a = n->ep_qp;
    if (rdma_create_qp(&n->id, n->id.pd, &a)) {
      const int err = errno;
      rdma_destroy_id(&n->id);
      return fail(err);
    }
  }
  *id = &n->id;
  return 0;
}

CM_EXPORT int rdma_migrate_id(rdma_cm_id* id, rdma_event_channel* channel) {
  if (!id) return fail(EINVAL);
  VId* v = to_vid(id);
  VChannel* own = nullptr;
  if (!channel) {
    if (open_channel(&own)) return -1;
    channel = &own->ch;
  }
  vrdma::proto::CmMigrateReq req{v->handle, reinterpret_cast<VChannel*>(channel)->handle};
  if (call(Op::kCmMigrateId, req)) {
    const int err = errno;
    if (own) close_channel(own);
    return fail(err);
  }
  if (v->own) close_channel(v->own);
  v->own = own;
  id->channel = channel;
  return 0;
}

CM_EXPORT ibv_context** rdma_get_devices(int* num_devices) {
  if (ensure_open()) {
    if (num_devices) *num_devices = 0;
    return static_cast<ibv_context**>(std::calloc(1, sizeof(ibv_context*)));
  }
  auto** list = static_cast<ibv_context**>(std::calloc(2, sizeof(ibv_context*)));
  if (!list) return nullptr;
  list[0] = cm().ctx;
  if (num_devices) *num_devices = 1;
  return list;
}

CM_EXPORT void rdma_free_devices(ibv_context** list) { std::free(list); }

CM_EXPORT __be16 rdma_get_src_port(rdma_cm_id* id) {
  const sockaddr* sa = &id->route.addr.src_addr;
  if (sa->sa_family == AF_INET) return reinterpret_cast<const sockaddr_in*>(sa)->sin_port;
  if (sa->sa_family == AF_INET6) return reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port;
  return 0;
}

CM_EXPORT __be16 rdma_get_dst_port(rdma_cm_id* id) {
  const sockaddr* sa = &id->route.addr.dst_addr;
  if (sa->sa_family == AF_INET) return reinterpret_cast<const sockaddr_in*>(sa)->sin_port;
  if (sa->sa_family == AF_INET6) return reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port;
  return 0;
}

CM_EXPORT int rdma_set_option(rdma_cm_id* id, int level, int optname, void* optval, size_t optlen) {
  if (!id || (optlen && !optval)) return fail(EINVAL);
  // Accepted and of no effect on one backend: type of service, address reuse, v6-only, the
  // ACK timeout (the QP's own timeout still applies), explicit IB paths.
  if (level == RDMA_OPTION_ID &&
      (optname == RDMA_OPTION_ID_TOS || optname == RDMA_OPTION_ID_REUSEADDR ||
       optname == RDMA_OPTION_ID_AFONLY || optname == RDMA_OPTION_ID_ACK_TIMEOUT))
    return 0;
  if (level == RDMA_OPTION_IB && optname == RDMA_OPTION_IB_PATH) return 0;
  return fail(ENOSYS);
}

CM_EXPORT int rdma_notify(rdma_cm_id* id, ibv_event_type) { return id ? 0 : fail(EINVAL); }

// Multicast: groups of the cluster's guests (engine/device_mcast.cc). The backend answers a
// join with MULTICAST_JOIN (the group's GID, LID, qkey), on which the id's QP is attached.
CM_EXPORT int rdma_join_multicast(rdma_cm_id* id, sockaddr* addr, void* context) {
  if (!id || !addr) return fail(EINVAL);
  VId* v = to_vid(id);
  const CmAddr a = to_cm_addr(addr);
  {
    std::lock_guard<std::mutex> g(cm().mu);
    for (const VMc& mc : v->mcs) {
      if (mc.addr.family == a.family && !std::memcmp(mc.addr.addr, a.addr, 16))
        return fail(EADDRINUSE);  // joined already
    }
    v->mcs.push_back(VMc{a, context, {}, 0});
  }
  if (call(Op::kCmJoinMcast, vrdma::proto::CmAddrReq{v->handle, 0, a}) == 0) return 0;
  const int err = errno;
  std::lock_guard<std::mutex> g(cm().mu);
  v->mcs.pop_back();
  return fail(err);
}

CM_EXPORT int rdma_join_multicast_ex(rdma_cm_id* id, rdma_cm_join_mc_attr_ex* attr, void* context) {
  if (!attr || !(attr->comp_mask & RDMA_CM_JOIN_MC_ATTR_ADDRESS)) return fail(EINVAL);
  return rdma_join_multicast(id, attr->addr, context);
}

CM_EXPORT int rdma_leave_multicast(rdma_cm_id* id, sockaddr* addr) {
  if (!id || !addr) return fail(EINVAL);
  VId* v = to_vid(id);
  const CmAddr a = to_cm_addr(addr);
  VMc left;
  {
    std::lock_guard<std::mutex> g(cm().mu);
    auto it = std::find_if(v->mcs.begin(), v->mcs.end(), [&a](const VMc& mc) {
      return mc.addr.family == a.family && !std::memcmp(mc.addr.addr, a.addr, 16);
    });
    if (it == v->mcs.end()) return fail(EADDRNOTAVAIL);
    left = *it;
    v->mcs.erase(it);
  }
  if (id->qp && left.mlid) (void)ibv_detach_mcast(id->qp, &left.mgid, left.mlid);
  return call(Op::kCmLeaveMcast, vrdma::proto::CmAddrReq{v->handle, 0, a});
}

// Enhanced connection establishment: vrdma has no options to negotiate; an ECE of zeroes.
CM_EXPORT int rdma_set_local_ece(rdma_cm_id* id, ibv_ece* ece) {
  return id && ece ? 0 : fail(EINVAL);
}
CM_EXPORT int rdma_get_remote_ece(rdma_cm_id* id, ibv_ece* ece) {
  if (!id || !ece) return fail(EINVAL);
  *ece = ibv_ece{};
  return 0;
}
