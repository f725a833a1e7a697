#include "backend/server.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <infiniband/verbs.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstring>

#include "common/log.h"
#include "common/paths.h"
#include "common/socket.h"

namespace vrdma::backend {

using namespace vrdma::proto;

namespace {


/// Names the peer of a connection in log lines: its guest, pid and session once it said Hello.
std::string who(const Server::Conn& c, int fd) {
  if (!c.session) return fmt::format("connection {} (before hello)", fd);
  return fmt::format("guest {} pid {} session {}", c.session->guest->name, c.session->pid,
                     c.session->id);
}

uint64_t now_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

}  // namespace

Server::Server(Config cfg)
    : opt_(std::move(cfg)), wake_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)), dev_(opt_.quotas) {}

void Server::stop(int sig) {
  stop_signal_.store(sig);
  stop_.store(true);
  if (wake_.valid()) {
    uint64_t one = 1;
    ssize_t n = ::write(wake_.get(), &one, sizeof(one));
    (void)n;
  }
}

void Server::watch(int fd, uint64_t tag) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = tag | static_cast<uint32_t>(fd);
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev);
}

// Every connection costs a descriptor before it has said who it is: those that have not said
// Hello are capped per uid and timed out, so idle connections cannot fill the descriptor table.
void Server::accept_all() {
  const uint64_t now = now_ns();
  for (;;) {
    int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (ListenerRest::out_of_descriptors(errno)) pause_listener(now, errno);
      return;
    }
    UniqueFd sock(fd);
    auto uid = peer_uid(fd);
    const uint32_t u = uid.is_ok() ? uid.value() : UINT32_MAX;
    uint32_t& pending = pending_by_uid_[u];
    if (pending >= static_cast<uint32_t>(opt_.max_pending_connections)) {
      uint64_t held = 0;
      if (pending_cap_log_.ready(now, held)) {
        VLOG_WARN(
            "uid {}: {} connections have not said hello (max_pending_connections); "
            "closing new ones{}",
            u, pending, log::held_note(held));
      }
      continue;  // closed: the client's next call sees the connection end
    }
    ++pending;
    Conn& c = conns_[fd];
    c.sock = std::move(sock);
    c.uid = u;
    c.hello_deadline_ns = now + uint64_t(opt_.hello_timeout_ms) * 1000000;
    pending_.emplace_back(c.hello_deadline_ns, fd);
    watch(fd, 0);
  }
}

void Server::leave_pending(Conn& c) {
  if (!c.hello_deadline_ns) return;
  c.hello_deadline_ns = 0;
  auto it = pending_by_uid_.find(c.uid);
  if (it != pending_by_uid_.end() && --it->second == 0) pending_by_uid_.erase(it);
}

void Server::expire_pending(uint64_t now) {
  while (!pending_.empty() && pending_.front().first <= now) {
    const auto [deadline, fd] = pending_.front();
    pending_.pop_front();
    auto it = conns_.find(fd);
    // Gone, or said Hello, or the descriptor is another connection's now.
    if (it == conns_.end() || it->second.hello_deadline_ns != deadline) continue;
    uint64_t held = 0;
    if (hello_log_.ready(now, held)) {
      VLOG_WARN("connection {} (uid {}) said no hello within {} ms; closing it{}", fd,
                it->second.uid, opt_.hello_timeout_ms, log::held_note(held));
    }
    drop(fd);
  }
}

void Server::pause_listener(uint64_t now, int err) {
  uint64_t held = 0;
  if (listen_rest_.start(now, held)) {
    VLOG_WARN("accept: {} ({} connections open); not accepting for {} ms or until one closes{}",
              std::strerror(err), conns_.size(), ListenerRest::kRestNs / 1000000,
              log::held_note(held));
  }
}

void Server::drop(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  leave_pending(it->second);
  listen_rest_.end();  // a descriptor is free again
  if (it->second.session) reporter_.note_change(it->second.uid);
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
  std::string guest;
  if (it->second.session) {
    int db = it->second.session->doorbell.get();
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, db, nullptr);
    doorbell_to_sock_.erase(db);
    guest = it->second.session->guest->name;
    cm_.session_closed(it->second.session);
    dev_.close_session(it->second.session);
  }
  conns_.erase(it);
  if (!guest.empty()) keep(guest);  // the keeper lets this connection go too
  keep_cm_changes();                // the peers of its CM ids heard
}

void Server::on_readable(int fd) {
  std::vector<uint8_t> msg;
  std::vector<UniqueFd> fds;
  for (;;) {
    // Looked up per message: a command may add connections (an import adopts the guest's).
    auto it = conns_.find(fd);
    if (it == conns_.end()) return;
    Status st = recv_msg(fd, msg, it->second.import ? kMaxImportMessage : kMaxRequest, fds);
    if (!st.is_ok() && st.err() == EMFILE && msg.size() >= sizeof(MsgHeader)) {
      // The descriptors it carried found no room here (the table is full): that command fails
      // with EMFILE, the session goes on.
      uint64_t held = 0;
      if (fds_log_.ready(now_ns(), held))
        VLOG_WARN("{}: {}; failing the command with EMFILE{}", who(it->second, fd), st.message(),
                  log::held_note(held));
      MsgHeader raw;
      std::memcpy(&raw, msg.data(), sizeof(raw));
      st = send_msg(fd, encode(static_cast<Op>(raw.op), raw.seq, -EMFILE, Empty{}));
      if (st.is_ok()) continue;
    }
    if (!st.is_ok()) {
      if (st.err() == EAGAIN) return;
      if (st.err() != ECONNRESET)
        VLOG_WARN("{}: {}; closing it", who(it->second, fd), st.message());
      drop(fd);
      return;
    }
    st = handle(it->second, msg, fds);
    it = conns_.find(fd);
    if (!st.is_ok()) {
      if (it != conns_.end()) VLOG_WARN("{}: {}; closing it", who(it->second, fd), st.message());
      drop(fd);
      return;
    }
    if (it != conns_.end() && (it->second.session || it->second.import)) leave_pending(it->second);
  }
}

// Answers one command. A malformed message gets an error response when its header can be
// read, and ends the session otherwise; a failing command only gets its errno back.
// long-function: one case per opcode, a dispatch table (most cases one line).
Status Server::handle(Conn& c, std::vector<uint8_t>& msg, std::vector<UniqueFd>& fds) {
  auto hdr = decode_request(msg);
  if (!hdr.is_ok()) {
    auto h = decode_header(msg);
    if (h.is_ok() || msg.size() >= sizeof(MsgHeader)) {
      MsgHeader raw;
      std::memcpy(&raw, msg.data(), sizeof(raw));
      auto out = encode(static_cast<Op>(raw.op), raw.seq, -hdr.err(), Empty{});
      (void)send_msg(c.sock.get(), out);
    }
    return error(hdr.err(), "bad request: " + hdr.status().message());
  }
  const MsgHeader h = hdr.value();
  const Op op = static_cast<Op>(h.op);
  if (sessionless(op) && op != Op::kStatus) {
    if (c.session) return error(EPROTO, "an operator command on a guest session");
    return handle_admin(c, h, msg, fds);
  }
  if ((op == Op::kHello) == (c.session != nullptr) && op != Op::kStatus)
    return error(EPROTO, c.session ? "second hello" : "command before hello");

  std::vector<uint8_t> out;
  std::vector<int> out_fds;
  UniqueFd give;  ///< a descriptor the response hands over (ring memfd, pipe end); closed after
  auto reply_err = [&](const Status& st) {
    VLOG_DEBUG("{}: {} failed: {}", who(c, c.sock.get()), proto::op_name(h.op), st.message());
    // The reason goes with the errno (the library says a quota's on the program's stderr).
    out = encode_error(op, h.seq, st.err(), st.message(), st.quota() ? kAnswerQuota : 0);
  };
  auto reply = [&](const auto& r) {  // Result<Body>: the body, or the error
    if (r.is_ok()) out = encode(op, h.seq, 0, r.value());
    else reply_err(r.status());
  };
  auto reply_handle = [&](const Result<uint32_t>& r) {
    if (r.is_ok()) out = encode(op, h.seq, 0, HandleResp{r.value(), 0});
    else reply_err(r.status());
  };
  auto reply_status = [&](const Status& st) {
    if (st.is_ok()) out = encode(op, h.seq, 0, Empty{});
    else reply_err(st);
  };
  auto handle_of = [&] { return body_of<HandleReq>(msg).value().handle; };
  // kDirectOffer: with kDirectOfferSrq the answer carries the session's lock tag too.
  auto reply_offer = [&](engine::Session& sess, const DirectOfferReq& req,
                         std::vector<UniqueFd>& owned) {
    DirectOfferSrqResp srq{};
    auto r = dev_.direct_offer(sess, req, owned, &srq.lock_tag);
    if (!r.is_ok() || !(req.flags & kDirectOfferSrq)) return reply(r);
    srq.offer = r.value();
    out = encode(op, h.seq, 0, srq);
  };
  engine::Session* s = c.session;
  int32_t status;
  switch (op) {
    case Op::kHello: {
      HelloResp resp{};
      engine::FdList fl;
      // Who the guest is comes from the kernel: a guest without credentials gets no session.
      auto cred = peer_cred(c.sock.get());
      if (!cred.is_ok()) {
        VLOG_WARN("{}: hello refused: {}", who(c, c.sock.get()), cred.status().message());
        reply_err(error(EPERM, cred.status().message()));
        break;
      }
      const HelloReq req = body_of<HelloReq>(msg).value();
      if (Status st = check_guest_name({req.guest, strnlen(req.guest, sizeof(req.guest))});
          !st.is_ok()) {
        VLOG_WARN("{}: hello refused: {}", who(c, c.sock.get()), st.message());
        reply_err(st);
        break;
      }
      auto r = dev_.open_session(req, cred.value(), resp, fl);
      if (!r.is_ok()) {
        reply_err(r.status());
        break;
      }
      c.session = r.value();
      out = encode(op, h.seq, 0, resp);
      out_fds = fl;
      int db = c.session->doorbell.get();
      doorbell_to_sock_[db] = c.sock.get();
      watch(db, kTagDoorbell);
      break;
    }
    case Op::kAllocPd: reply_handle(dev_.alloc_pd(*s)); break;
    case Op::kDeallocPd: reply_status(dev_.dealloc_pd(*s, handle_of())); break;
    case Op::kRegSegment: {
      UniqueFd fd = fds.empty() ? UniqueFd() : std::move(fds[0]);
      reply_handle(dev_.reg_segment(*s, body_of<RegSegmentReq>(msg).value(), std::move(fd)));
      break;
    }
    case Op::kRegMr: reply(dev_.reg_mr(*s, body_of<RegMrReq>(msg).value())); break;
    case Op::kDeregMr: reply_status(dev_.dereg_mr(*s, handle_of())); break;
    case Op::kDeregSegment: reply_status(dev_.dereg_segment(*s, handle_of())); break;
    case Op::kCreateChannel: reply_handle(dev_.create_channel(*s, give)); break;
    case Op::kDestroyChannel: reply_status(dev_.destroy_channel(*s, handle_of())); break;
    case Op::kCreateCq: reply(dev_.create_cq(*s, body_of<CreateCqReq>(msg).value(), give)); break;
    case Op::kDestroyCq: reply_status(dev_.destroy_cq(*s, handle_of())); break;
    case Op::kResizeCq:
      reply(dev_.resize_cq(*s, body_of<ResizeCqReq>(msg).value(), give));
      break;
    case Op::kReregMr:
      reply_status(dev_.rereg_mr(*s, body_of<ReregMrReq>(msg).value(),
                                 fds.empty() ? UniqueFd() : std::move(fds[0])));
      break;
    case Op::kAllocDm:
      reply(dev_.alloc_dm(*s, body_of<AllocDmReq>(msg).value(), give));
      break;
    case Op::kFreeDm:
      reply_status(dev_.free_dm(*s, handle_of()));
      break;
    case Op::kRegDmMr:
      reply(dev_.reg_dm_mr(*s, body_of<RegDmMrReq>(msg).value()));
      break;
    case Op::kAllocMw:
      reply(dev_.alloc_mw(*s, body_of<AllocMwReq>(msg).value()));
      break;
    case Op::kImportContext: {
      // Another process shares this socket (ibv_import_device). It has no part in the session's
      // command lock yet (the control page is what it asks for), so the answer goes on the
      // socket it attached, never on the shared one, where the other holder may be waiting for
      // an answer of its own. Without one: no answer at all.
      if (fds.empty()) return Status::ok();
      // Never blocks the backend: that end is the importer's alone.
      (void)::fcntl(fds[0].get(), F_SETFL, O_NONBLOCK);
      HelloResp resp{};
      dev_.session_hello(*s, resp, out_fds);
      (void)send_msg(fds[0].get(), encode(op, h.seq, 0, resp), out_fds);
      return Status::ok();
    }
    case Op::kImportObject:
      reply(dev_.import_object(*s, body_of<ImportObjectReq>(msg).value(), out_fds));
      break;
    case Op::kDeallocMw:
      reply_status(dev_.dealloc_mw(*s, handle_of()));
      break;
    case Op::kMwView:
      reply(dev_.mw_view(*s, body_of<MwViewReq>(msg).value()));
      break;
    case Op::kCreateQp: reply(dev_.create_qp(*s, body_of<CreateQpReq>(msg).value(), give)); break;
    case Op::kModifyQp: {
      const ModifyQpReq req = body_of<ModifyQpReq>(msg).value();
      const Status st = dev_.modify_qp(*s, req);
      reply_status(st);
      // RTR checks no reachability (verbs), but the program hears now why its sends will only
      // time out: the library says it on its stderr.
      const bool rtr = (req.mask & IBV_QP_STATE) && req.attr.qp_state == IBV_QPS_RTR;
      if (st.is_ok() && rtr && dev_.destination_unknown(*s, req.handle))
        add_answer_flags(out, kAnswerDestUnknown);
      break;
    }
    case Op::kQueryQp: reply(dev_.query_qp(*s, handle_of())); break;
    case Op::kDestroyQp: reply_status(dev_.destroy_qp(*s, handle_of())); break;
    case Op::kCreateSrq: reply(dev_.create_srq(*s, body_of<CreateSrqReq>(msg).value(), give)); break;
    case Op::kModifySrq: reply_status(dev_.modify_srq(*s, body_of<ModifySrqReq>(msg).value())); break;
    case Op::kQuerySrq: reply(dev_.query_srq(*s, handle_of())); break;
    case Op::kDestroySrq: reply_status(dev_.destroy_srq(*s, handle_of())); break;
    case Op::kOpenXrcd:
      reply_handle(dev_.open_xrcd(*s, body_of<OpenXrcdReq>(msg).value(),
                                  fds.empty() ? UniqueFd() : std::move(fds[0])));
      break;
    case Op::kCloseXrcd:
      reply_status(dev_.close_xrcd(*s, handle_of()));
      break;
    case Op::kCreateXrcSrq:
      reply(dev_.create_xrc_srq(*s, body_of<CreateXrcSrqReq>(msg).value(), give));
      break;
    case Op::kOpenQp:
      reply(dev_.open_qp(*s, body_of<OpenQpReq>(msg).value()));
      break;
    case Op::kAttachMcast:
      reply_status(dev_.attach_mcast(*s, body_of<McastReq>(msg).value()));
      break;
    case Op::kDetachMcast:
      reply_status(dev_.detach_mcast(*s, body_of<McastReq>(msg).value()));
      break;
    case Op::kDirectCookie:
      reply_status(dev_.direct_cookie(*s, body_of<DirectCookieReq>(msg).value()));
      break;
    case Op::kDirectPeer:
      reply(dev_.direct_peer(*s, handle_of()));
      break;
    case Op::kDirectProve:
      reply_status(
          dev_.direct_prove(*s, handle_of(), fds.empty() ? UniqueFd() : std::move(fds[0])));
      break;
    case Op::kDirectPeerUd:
      reply(dev_.direct_peer_ud(*s, body_of<DirectUdReq>(msg).value()));
      break;
    case Op::kDirectProveUd:
      reply_status(dev_.direct_prove_ud(*s, body_of<DirectUdReq>(msg).value(),
                                        fds.empty() ? UniqueFd() : std::move(fds[0])));
      break;
    case Op::kDirectGrantUd:
    case Op::kDirectGrant:
    case Op::kDirectRings:
    case Op::kDirectOffer:
    case Op::kDirectRemote: {
      std::vector<UniqueFd> owned;
      std::string peer;  // kDirectGrantUd's destination guest
      if (op == Op::kDirectGrant)
        reply(dev_.direct_grant(*s, handle_of(), owned, body_of<HandleReq>(msg).value().reserved));
      else if (op == Op::kDirectGrantUd)
        reply(dev_.direct_grant_ud(*s, body_of<DirectUdReq>(msg).value(), owned, peer));
      else if (op == Op::kDirectRings)
        reply(dev_.direct_rings(*s, handle_of(), owned, body_of<HandleReq>(msg).value().reserved));
      else if (op == Op::kDirectOffer)
        reply_offer(*s, body_of<DirectOfferReq>(msg).value(), owned);
      else reply(dev_.direct_remote(*s, handle_of(), owned, body_of<HandleReq>(msg).value().reserved));
      std::memcpy(&status, out.data() + offsetof(MsgHeader, status), sizeof(status));
      if (status == 0) {
        // A grant gives both QPs own completion rings: the keeper has them before the guest
        // hears of it (later completions go there; a restore without them would lose them).
        if (op == Op::kDirectGrant || op == Op::kDirectGrantUd) {
          keep(c.session->guest->name);
          if (op == Op::kDirectGrant) peer = dev_.direct_peer_guest(*s, handle_of());
          if (!peer.empty() && peer != c.session->guest->name) keep(peer);
        }
        // Across backends the same (an own ring), and the QP's direct state with it: a
        // restarted backend must know that its library talks to the peer's (a move asks it
        // back; an offer follows the peer). A kDirectOfferWhere changes nothing.
        if (op == Op::kDirectRemote ||
            (op == Op::kDirectOffer &&
             !(body_of<DirectOfferReq>(msg).value().flags & kDirectOfferWhere)))
          keep(c.session->guest->name);
        for (const UniqueFd& fd : owned) out_fds.push_back(fd.get());
        fit_send_buffer(c.sock.get(), out.size());
        return send_msg(c.sock.get(), out, out_fds);  // before `owned` closes them
      }
      break;
    }
    case Op::kStatus: {
      // What the caller may see (its own guests, no keys, unless it is an admin), by the
      // kernel's word on who it is; before or after hello alike.
      Viewer v;
      if (auto cred = peer_cred(c.sock.get()); cred.is_ok()) {
        v.uid = cred.value().uid;
        v.admin = is_admin_uid(v.uid, dev_.backend_uid());
      }
      // Non-admins: from a snapshot (Reporter::status_for), so a caller asking in a loop costs
      // the data path a lookup, not a rendering of every QP.
      const Reporter::View& view = reporter_.status_for(dev_, v, now_ns());
      const std::string& js = view.json;
      if (!v.admin) {
        VLOG_DEBUG("{}: status for uid {}: its own {} guest(s), keys and addresses hidden",
                   who(c, c.sock.get()), v.uid, view.guests);
      }
      if (js.size() + sizeof(MsgHeader) + 4 > kMaxResponse) {
        VLOG_WARN("{}: status document of {} bytes exceeds the {}-byte response limit",
                  who(c, c.sock.get()), js.size(), kMaxResponse);
        reply_err(error(E2BIG, "status too large"));
        break;
      }
      fit_send_buffer(c.sock.get(), js.size() + sizeof(MsgHeader) + 4);
      out = encode(op, h.seq, 0, Empty{});
      uint32_t n = static_cast<uint32_t>(js.size());
      out.insert(out.end(), reinterpret_cast<uint8_t*>(&n), reinterpret_cast<uint8_t*>(&n) + 4);
      out.insert(out.end(), js.begin(), js.end());
      uint32_t total = static_cast<uint32_t>(out.size());
      std::memcpy(out.data() + offsetof(MsgHeader, length), &total, 4);
      break;
    }
    default:  // sessionless ones went to handle_admin
      if (is_cm(op)) {
        out = cm_.handle(*s, h, msg, give);
        keep_cm_changes();  // keep_state: as below, before the guest hears the answer
      }
      break;
  }
  std::memcpy(&status, out.data() + offsetof(MsgHeader, status), sizeof(status));
  if (give.valid() && status == 0) out_fds = {give.get()};
  // keep_state: the keeper has every change before the guest hears of it.
  if (status == 0 && c.session && op != Op::kQueryQp && op != Op::kQuerySrq && op != Op::kStatus &&
      !is_cm(op)) {
    reporter_.note_change(c.uid);  // its next status shows this change
    keep(c.session->guest->name);
  }
  if (h.flags & kRequestNoAnswer) return Status::ok();  // posted: nobody reads an answer
  return send_msg(c.sock.get(), out, out_fds);
}

uint32_t Server::note_yield_stall(uint64_t now_ns) {
  stalls_ = now_ns - last_stall_ns_ < kYieldStallGapNs ? stalls_ + 1 : 1;
  last_stall_ns_ = now_ns;
  return stalls_;
}

void Server::note_stall(uint64_t awake_ns, uint64_t now_ns) {
  if (awake_ns < kStallNs) {
    // A baseline for the next stall's account, now and then (a system call: not every turn).
    if ((++stall_turns_ & 1023) == 0) ::getrusage(RUSAGE_THREAD, &stall_ru_);
    return;
  }
  reporter_.note_stall(awake_ns);
  rusage ru{};
  ::getrusage(RUSAGE_THREAD, &ru);
  auto us = [](const timeval& t) { return uint64_t(t.tv_sec) * 1000000 + uint64_t(t.tv_usec); };
  const uint64_t cpu_ms =
      (us(ru.ru_utime) + us(ru.ru_stime) - us(stall_ru_.ru_utime) - us(stall_ru_.ru_stime)) / 1000;
  const long preempted = ru.ru_nivcsw - stall_ru_.ru_nivcsw,
             blocked = ru.ru_nvcsw - stall_ru_.ru_nvcsw;
  stall_ru_ = ru;
  uint64_t held = 0;
  if (stall_log_.ready(now_ns, held))
    VLOG_WARN(
        "the data path did not look at its work for {} ms (since its last account it ran {} "
        "ms of CPU, was preempted {} times and blocked {}: preempted means not scheduled, the "
        "host's CPUs are oversubscribed); every QP's timers ran on meanwhile{}",
        awake_ns / 1000000, cpu_ms, preempted, blocked, log::held_note(held));
}

namespace {

/// [datapath] nice, for this thread (the engine's; on Linux a nice value is a thread's).
void set_engine_nice(int nice) {
  if (nice == 0) return;
  errno = 0;
  const int was = ::getpriority(PRIO_PROCESS, 0);
  if (errno == 0 && was == nice) return;
  if (::setpriority(PRIO_PROCESS, 0, nice) == 0) {
    VLOG_INFO("engine thread at nice {} ([datapath] nice)", nice);
  } else {
    VLOG_INFO(
        "engine thread stays at nice {}: nice {} not allowed ({}; root, CAP_SYS_NICE or "
        "RLIMIT_NICE): on a machine with fewer CPUs than busy pollers the mediated path's "
        "latency may double",
        was, nice, std::strerror(errno));
  }
}

}  // namespace

// long-function: the event loop (the hot path: device poll, spin, epoll), kept in one piece.
Status Server::run() {
  Status st = setup();
  if (!st.is_ok()) {
    // Started on demand, it lost a race it was meant to lose: what was wanted runs.
    if (st.err() == EALREADY && on_demand_) {
      VLOG_INFO("{}", st.message());
      return Status::ok();
    }
    return st;
  }
  VLOG_INFO("vrdmad {} listening on {}{}", VRDMA_VERSION, opt_.socket_path,
            activated_ ? " (socket activation)" : "");
  set_engine_nice(opt_.nice);
  uint64_t idle_since = now_ns();
  uint64_t last_work = now_ns();
  uint64_t last_command = 0;     // when the loop last answered a session's command
  uint64_t command_spin_ns = 0;  // how long after it the loop looks for the next one
  epoll_event evs[64];
  uint32_t iter = 0;
  uint64_t awake_since = now_ns();  // the loop's last start or wake-up: its time not asleep
  while (!stop_) {
    uint64_t now = now_ns();
    note_stall(now - awake_since, now);
    awake_since = now;
    if (!pending_.empty() && pending_.front().first <= now) expire_pending(now);
    listen_rest_.poll(now);
    if (metrics_) metrics_->poll(now);
    bool work = dev_.poll(now);
    if (tcp_) work |= tcp_->poll(now);
    keep_direct_changes();  // keep_state: before any command can act on them
    if (work) last_work = now;
    int timeout = 0;
    const bool spinning =
        now - last_work < uint64_t(opt_.spin_us) * 1000 && now >= spin_off_until_;
    if (spinning) {
      // Busy: look at the sockets only now and then; idle-spinning: give the CPU away.
      if (!work) {
        ::sched_yield();
        if (const uint64_t back = now_ns(); back - now >= kYieldStallNs &&
                                             note_yield_stall(back) >= kYieldStalls) {
          stalls_ = 0;
          spin_off_until_ = back + kYieldStalledNs;
          uint64_t held = 0;
          if (yield_log_.ready(back, held))
            VLOG_INFO("{} yields of the data path's spin kept it off its CPU 1 ms or more ({:.1f} "
                      "the last; the threads beside it do not yield back): it sleeps between "
                      "work for {} ms, woken by the guests' doorbells{}",
                      kYieldStalls, double(back - now) / 1e6, kYieldStalledNs / 1000000,
                      log::held_note(held));
        }
      }
      if ((++iter & 63) != 0) continue;
    } else if (now - last_command < command_spin_ns) {
      // Just answered a command: in a burst the guest's next one follows within µs (a QP's
      // INIT, RTR, RTS; a connection's calls). Look at the sockets (epoll_wait without
      // waiting) a while before sleeping, so it does not wait for this thread's CPU to wake;
      // as long as next_command_ finds the next command comes within it. No sched_yield:
      // beside a CPU-bound task each yield would give it a whole time slice.
    } else {
      dev_.set_sleeping(true);
      // Re-check after announcing sleep: a guest that posted before seeing the flag set
      // did not ring the doorbell (the two seq_cst accesses pair up).
      if (dev_.poll(now_ns())) {
        dev_.set_sleeping(false);
        last_work = now_ns();
        continue;
      }
      timeout = -1;
      uint64_t d = dev_.next_deadline();
      if (tcp_) {
        if (tcp_->poll(now_ns())) {  // frames the last device poll queued, or that arrived
          dev_.set_sleeping(false);
          last_work = now_ns();
          continue;
        }
        const uint64_t t = tcp_->next_deadline();
        if (t && (d == 0 || t < d)) d = t;
      }
      if (d) timeout = d > now ? static_cast<int>((d - now) / 1000000) + 1 : 0;
      // Wake for the next Hello deadline and for the end of the listeners' rests.
      for (uint64_t t : {pending_.empty() ? 0 : pending_.front().first, listen_rest_.until_ns(),
                         metrics_ ? metrics_->rest_until_ns() : 0}) {
        if (!t) continue;
        const int ms = t > now ? static_cast<int>((t - now) / 1000000) + 1 : 0;
        if (timeout < 0 || ms < timeout) timeout = ms;
      }
      if (metrics_ && metrics_->has_clients() && (timeout < 0 || timeout > 1000)) timeout = 1000;
      if (opt_.idle_exit_s > 0 && conns_.empty()) {
        int left = static_cast<int>(opt_.idle_exit_s * 1000 - (now - idle_since) / 1000000);
        if (left <= 0) {
          VLOG_INFO("no guests for {} s; exiting", opt_.idle_exit_s);
          break;
        }
        if (timeout < 0 || left < timeout) timeout = left;
      }
    }
    keep_direct_changes();  // the polls just above, when it sleeps
    int n = ::epoll_wait(epoll_.get(), evs, 64, timeout);
    if (timeout != 0) {
      dev_.set_sleeping(false);
      awake_since = now_ns();
    }
    for (int i = 0; i < n; ++i) {
      uint64_t tag = evs[i].data.u64;
      int fd = static_cast<int>(tag & 0xffffffff);
      if (tag & kTagWake) continue;
      if (tag & kTagMetrics) {
        metrics_->on_event(fd, evs[i].events, now_ns());
        continue;
      }
      if (tag & kTagCm) {
        cm_.on_timer();
        keep_cm_changes();
        continue;
      }
      if (tag & kTagDirectory) {
        on_directory();
        last_work = now_ns();
        continue;
      }
      if (tag & kTagTransport) {  // tcp_->poll() at the top of the loop reads it
        last_work = now_ns();
        continue;
      }
      if (tag & kTagListen) {
        accept_all();
      } else if (tag & kTagDoorbell) {
        uint64_t v;
        ssize_t r = ::read(fd, &v, sizeof(v));
        (void)r;
        last_work = now_ns();
      } else {
        // A command is not data-path work: no spin_us after it (a burst of control commands,
        // e.g. RDMA CM connects, would pay spin_us of CPU for each), only the short look for
        // the next command above. What it starts (a QP's rings) is data-path work the next poll
        // finds and spins on. BENCHMARKS.md, "RDMA CM connection rate", "Command round trip".
        if (command_spin_ns) next_command_.note(command_spin_ns, now_ns() - last_command);
        on_readable(fd);
        last_command = now_ns();
        command_spin_ns =
            std::min<uint64_t>(uint64_t(opt_.spin_us) * 1000, next_command_.budget_ns());
      }
    }
    if (!conns_.empty()) idle_since = now_ns();
    if (metrics_) metrics_->expire(now_ns());
    // Our QP count for our directory entry (written there with the next keepalive).
    if (directory_ && now_ns() >= qps_noted_ns_) {
      uint64_t qps = 0;
      for (const auto& [id, s] : dev_.sessions()) qps += s->qps.size();
      directory_->set_qps(qps);
      qps_noted_ns_ = now_ns() + 500'000'000;
    }
  }
  if (const int sig = stop_signal_.load(); sig != 0) {
    const char* name = ::sigabbrev_np(sig);
    VLOG_INFO("stopping on SIG{}: {} guest session(s) end{}", name ? name : "?",
              dev_.sessions().size(),
              keeper_.valid() ? ", and the keeper lets their state go" : "");
  }
  if (!activated_) unlink_beside(dir_, opt_.socket_path);
  unlink_beside(dir_, opt_.socket_path + ".pid");
  metrics_.reset();  // closes its clients and removes its unix socket, while we hold the lock
  // A clean exit ends the guests' devices: the keeper lets them go.
  if (keeper_.valid()) (void)send_msg(keeper_.get(), encode(Op::kKeepBye, 1, 0, Empty{}));
  return Status::ok();
}

}  // namespace vrdma::backend
