// Moving a guest's device between backends on one machine (live migration), and snapshots.
// The source freezes the guest simply by being busy: the engine thread exports the guest's state
// (engine/device_state_export.cc), hands the blob and every descriptor it names (memfds,
// doorbell, pipe ends and the guest's own connection) to the target backend over its socket (SCM_RIGHTS), waits
// for the target to import it, then forgets the guest without ending anything. The guest's
// process sees nothing but a pause: the same connection, rings and memory, now served by the
// target. Peers follow the guest through the directory (GuestUp from the target).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <set>

#include "backend/keeper.h"
#include "backend/server.h"
#include "common/log.h"
#include "common/paths.h"
#include "common/socket.h"
#include "proto/ring.h"

namespace vrdma::backend {

using namespace vrdma::proto;

namespace {

uint64_t mono_us() { return clock_ns(CLOCK_MONOTONIC) / 1000; }

/// CPU time of the calling thread: a move's wall time against it tells work from waiting for a CPU.
uint64_t thread_cpu_us() { return clock_ns(CLOCK_THREAD_CPUTIME_ID) / 1000; }

std::string name_of(const char* field, size_t max) { return std::string(field, strnlen(field, max)); }

/// Operator commands move guests between backends: only root or the backend's own user.
Status check_admin(int sock) {
  ASSIGN_OR_RETURN(uint32_t uid, peer_uid(sock));
  if (!is_admin_uid(uid, ::geteuid()))
    return error(EPERM, fmt::format("uid {} may not move guests", uid));
  return Status::ok();
}

/// Reads the target's answer to an import (blocking, with a deadline).
Result<std::vector<uint8_t>> read_answer(int sock) {
  std::vector<uint8_t> buf;
  std::vector<UniqueFd> fds;
  RETURN_IF_ERROR(recv_msg(sock, buf, kMaxRequest, fds));
  ASSIGN_OR_RETURN(MsgHeader h, decode_header(buf));
  if (h.status != 0) {
    const std::string why = reason_of(buf);
    return error(-h.status, "the target backend refused the import: " +
                                (why.empty() ? std::string(std::strerror(-h.status)) : why));
  }
  return buf;
}

}  // namespace

Status Server::handle_admin(Conn& c, const MsgHeader& h, std::vector<uint8_t>& msg,
                            std::vector<UniqueFd>& fds) {
  const Op op = static_cast<Op>(h.op);
  std::vector<uint8_t> out;
  auto fail = [&](const Status& st) {
    // EINPROGRESS: QPs leaving the direct path across backends; the CLI asks again at once.
    if (st.err() == EINPROGRESS)
      VLOG_DEBUG("{} from connection {}: {}", op_name(h.op), c.sock.get(), st.message());
    else
      VLOG_WARN("{} from connection {}: {}", op_name(h.op), c.sock.get(), st.message());
    out = encode_error(op, h.seq, st.err(), st.message());
  };
  if (Status st = check_admin(c.sock.get()); !st.is_ok()) {
    fail(st);
    return send_msg(c.sock.get(), out);
  }
  switch (op) {
    case Op::kMigrate: {
      const auto req = body_of<MigrateReq>(msg).value();
      if (Status st = check_guest_name(name_of(req.guest, sizeof(req.guest))); !st.is_ok()) {
        fail(st);
        break;
      }
      auto r = migrate_out(name_of(req.guest, sizeof(req.guest)),
                           name_of(req.target, sizeof(req.target)));
      if (r.is_ok()) out = encode(op, h.seq, 0, r.value());
      else fail(r.status());
      break;
    }
    case Op::kImportBegin:
      return import_begin(c, msg);  // no answer: the data follows at once
    case Op::kImportData:
      return import_data(c, msg, fds);
    case Op::kImportCm:
      return import_cm(c, msg, fds);
    case Op::kImportCommit: {
      auto r = import_commit(c);
      c.import.reset();
      if (r.is_ok()) out = encode(op, h.seq, 0, r.value());
      else fail(r.status());
      break;
    }
    case Op::kSnapshot: {
      const auto req = body_of<SnapshotReq>(msg).value();
      const std::string guest = name_of(req.guest, sizeof(req.guest));
      if (Status st = check_guest_name(guest); !st.is_ok()) {
        fail(st);
        break;
      }
      if (fds.empty()) {
        fail(error(EBADF, "snapshot without a file descriptor"));
        break;
      }
      if (!dev_.has_guest(guest)) {
        fail(error(ENOENT, no_such_guest(guest)));
        break;
      }
      const uint64_t t0 = mono_us();
      auto ex = export_with_sockets(guest);
      const uint64_t pause = mono_us() - t0;
      if (!ex.is_ok()) {
        fail(ex.status());
        break;
      }
      const auto& blob = ex.value().blob;
      size_t done = 0;
      while (done < blob.size()) {
        ssize_t w = ::write(fds[0].get(), blob.data() + done, blob.size() - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        done += static_cast<size_t>(w);
      }
      if (done != blob.size()) {
        fail(error(EIO, fmt::format("writing the snapshot: {}", std::strerror(errno))));
        break;
      }
      VLOG_INFO("guest {}: snapshot of {} bytes, {} QPs (held {} us)", guest, blob.size(),
                ex.value().qps, pause);
      out = encode(op, h.seq, 0,
                   SnapshotResp{blob.size(), pause, static_cast<uint32_t>(ex.value().qps), 0});
      break;
    }
    case Op::kRestore: {
      if (fds.empty()) {
        fail(error(EBADF, "restore without a file descriptor"));
        break;
      }
      auto r = restore_from(fds[0].get());
      if (r.is_ok()) out = encode(op, h.seq, 0, r.value());
      else fail(r.status());
      break;
    }
    default:
      return error(EPROTO, "not an operator command");
  }
  keep_cm_changes();  // the CM ids a move or a restore ended, or told
  return send_msg(c.sock.get(), out);
}

std::string Server::no_such_guest(const std::string& guest) const {
  std::set<std::string> names;
  for (const auto& [fd, conn] : conns_)
    if (conn.session) names.insert(conn.session->guest->name);
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
  return fmt::format("no guest {} here ({})", guest,
                     names.empty() ? std::string("no guests") : "guests: " + list);
}

Result<engine::GuestExport> Server::export_with_sockets(const std::string& guest, bool for_keeper) {
  RETURN_IF_ERROR(dev_.odp_movable(guest));  // docs/ARCHITECTURE.md, "On-demand paging"
  // QPs on the direct path across backends go back to the backends first; EINPROGRESS until
  // their libraries have settled (the CLI asks again). The keeper's copy keeps them direct:
  // their connections are the libraries', which a SIGKILLed backend leaves as they are.
  if (!for_keeper) RETURN_IF_ERROR(dev_.leave_direct_remote(guest));
  std::unordered_map<const engine::Session*, int> sock_of;
  for (const auto& [fd, conn] : conns_) {
    if (conn.session) sock_of[conn.session] = fd;
  }
  return dev_.export_guest(
      guest,
      [&](const engine::Session& s) {
        auto it = sock_of.find(&s);
        return it == sock_of.end() ? -1 : it->second;
      },
      for_keeper);
}

Result<ImportResp> Server::restore_from(int file) {
  std::vector<uint8_t> blob;
  uint8_t buf[65536];
  for (;;) {
    ssize_t n = ::read(file, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return error(errno, fmt::format("reading the snapshot: {}", std::strerror(errno)));
    if (n == 0) break;
    blob.insert(blob.end(), buf, buf + n);
    if (blob.size() > kMaxImportBytes) return error(E2BIG, "snapshot too large");
  }
  ASSIGN_OR_RETURN(std::string layout, engine::state_fd_layout(blob));
  const std::string guest = layout.substr(0, layout.find('\n'));
  if (!dev_.has_guest(guest))
    return error(ENOENT, fmt::format("guest {} is not served here (a snapshot is restored into "
                                     "the backend that serves the guest)", guest));
  // The device the guest has now lends its descriptors (its memory, rings and connections) to
  // the state in the file; both must name the same resources.
  ASSIGN_OR_RETURN(engine::GuestExport now, export_with_sockets(guest));
  ASSIGN_OR_RETURN(std::string now_layout, engine::state_fd_layout(now.blob));
  if (now_layout != layout)
    return error(EINVAL, fmt::format("guest {} has created or destroyed resources since the "
                                     "snapshot; it cannot be restored onto them", guest));
  ASSIGN_OR_RETURN(blob, engine::with_own_rings_of(blob, now.blob));
  auto dup_all = [&] {
    std::vector<UniqueFd> v;
    for (int f : now.fds) v.emplace_back(::fcntl(f, F_DUPFD_CLOEXEC, 0));
    return v;
  };
  std::vector<UniqueFd> fds = dup_all(), undo = dup_all();
  const uint64_t t0 = mono_us();
  release_guest(guest);
  auto sessions = dev_.import_guest(blob, fds, true);
  if (!sessions.is_ok()) {
    VLOG_WARN("guest {}: restore failed ({}); putting its device back as it was", guest,
              sessions.status().message());
    auto back = dev_.import_guest(now.blob, undo, true);
    if (back.is_ok()) {
      for (auto& is : back.value()) adopt(is.session, std::move(is.sock));
    }
    return sessions.status();
  }
  ImportResp r{};
  r.sessions = static_cast<uint32_t>(sessions.value().size());
  for (auto& is : sessions.value()) {
    r.qps += static_cast<uint32_t>(is.session->qps.size());
    adopt(is.session, std::move(is.sock));
  }
  r.served_mono_us = mono_us();
  r.import_us = r.served_mono_us - t0;
  keep(guest);
  VLOG_INFO("guest {}: device state restored from a snapshot ({} QPs, {} us)", guest, r.qps,
            r.import_us);
  return r;
}

Status Server::import_begin(Conn& c, const std::vector<uint8_t>& msg) {
  const auto req = body_of<ImportBeginReq>(msg).value();
  if (c.import) return error(EPROTO, "second import on one connection");
  if (req.bytes > kMaxImportBytes || req.fds > kMaxImportFds)
    return error(E2BIG, "import larger than the limits");
  c.import = std::make_unique<Conn::Import>();
  c.import->guest = name_of(req.guest, sizeof(req.guest));
  c.import->bytes = req.bytes;
  c.import->nfds = req.fds;
  c.import->recover = (req.flags & kImportRecover) != 0;
  c.import->blob.reserve(req.bytes);
  return Status::ok();
}

Status Server::import_cm(Conn& c, const std::vector<uint8_t>& msg, std::vector<UniqueFd>& fds) {
  if (!c.import) return error(EPROTO, "CM state without an import");
  Conn::Import& im = *c.import;
  if (im.cm.size() + msg.size() > kMaxImportBytes || im.cm_fds.size() + fds.size() > kMaxImportFds)
    return error(E2BIG, "CM state larger than the limits");
  im.cm.append(msg.begin() + sizeof(MsgHeader), msg.end());
  for (UniqueFd& f : fds) im.cm_fds.push_back(std::move(f));
  return Status::ok();
}

Status Server::import_data(Conn& c, const std::vector<uint8_t>& msg, std::vector<UniqueFd>& fds) {
  if (!c.import) return error(EPROTO, "import data without a begin");
  Conn::Import& im = *c.import;
  const size_t n = msg.size() - sizeof(MsgHeader);
  if (im.blob.size() + n > im.bytes || im.fds.size() + fds.size() > im.nfds)
    return error(EPROTO, "import data beyond what was announced");
  im.blob.insert(im.blob.end(), msg.begin() + sizeof(MsgHeader), msg.end());
  for (UniqueFd& f : fds) im.fds.push_back(std::move(f));
  return Status::ok();
}

Result<MigrateResp> Server::migrate_out(const std::string& guest, const std::string& target) {
  const uint64_t t0 = mono_us(), cpu0 = thread_cpu_us();
  if (!dev_.has_guest(guest)) return error(ENOENT, no_such_guest(guest));
  if (target == opt_.socket_path) return error(EINVAL, "the target is this backend");
  RETURN_IF_ERROR(dev_.leave_direct_remote(guest));  // before the target hears of anything
  ASSIGN_OR_RETURN(UniqueFd sock, connect_unix(target));
  timeval tv{10, 0};
  ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  // Direct grants of and into the guest end first: what its libraries and its peers' execute
  // from now on goes through the send queues, which move with it.
  dev_.end_direct_grants(guest);
  // The guest's own connections go with it, and its RDMA CM state beside the device's: its
  // sessions named by their connections' inodes, which the target's copies share.
  ASSIGN_OR_RETURN(engine::GuestExport ex, export_with_sockets(guest));
  std::vector<int> cm_fds;
  CmPart cm{cm_state_of(guest, cm_fds), {}};
  cm.fds = cm_fds;
  const uint64_t t1 = mono_us();
  RETURN_IF_ERROR(send_state(sock.get(), guest, ex.blob, ex.fds, 0, &cm));
  const uint64_t t2 = mono_us();
  ASSIGN_OR_RETURN(auto resp, read_answer(sock.get()));
  ASSIGN_OR_RETURN(ImportResp ir, body_of<ImportResp>(resp));
  // The target serves the guest from here on. Then stop serving it here, without ending anything
  // (unmapping its rings and memory; tens of ms with 64 QPs).
  const uint64_t t3 = mono_us(), cpu3 = thread_cpu_us();
  // The downtime ended when the target served the guest, which may be well before this thread
  // runs again to read its answer (on a busy machine the target, woken by the commit, takes the
  // CPU). Its clock is ours (a unix socket: one machine) unless a time namespace says otherwise:
  // a time outside this call's window is not taken.
  const bool served_here = ir.served_mono_us >= t1 && ir.served_mono_us <= t3;
  release_guest(guest, true);
  keep_drop(guest);
  const uint64_t release_us = mono_us() - t3;
  MigrateResp r{};
  r.downtime_us = (served_here ? ir.served_mono_us : t3) - t0;
  r.answered_us = t3 - t0;
  r.export_us = t1 - t0;
  r.transfer_us = t2 - t1;
  r.import_us = ir.import_us;
  r.bytes = ex.blob.size();
  r.qps = static_cast<uint32_t>(ex.qps);
  r.fds = static_cast<uint32_t>(ex.fds.size());
  VLOG_INFO("guest {} moved to {}: {} QPs, {} bytes, {} descriptors; frozen {} us (export {}, "
            "transfer {}, import {}; the answer read after {} us; this thread's CPU {} us); "
            "released here in {} us",
            guest, target, r.qps, r.bytes, r.fds, r.downtime_us, r.export_us, r.transfer_us,
            r.import_us, r.answered_us, cpu3 - cpu0, release_us);
  return r;
}

Result<ImportResp> Server::import_commit(Conn& c) {
  if (!c.import) return error(EPROTO, "import commit without a begin");
  Conn::Import& im = *c.import;
  if (im.blob.size() != im.bytes || im.fds.size() != im.nfds)
    return error(EPROTO, fmt::format("import incomplete: {} of {} bytes, {} of {} descriptors",
                                     im.blob.size(), im.bytes, im.fds.size(), im.nfds));
  const uint64_t t0 = mono_us(), cpu0 = thread_cpu_us();
  ASSIGN_OR_RETURN(auto sessions, dev_.import_guest(im.blob, im.fds, im.recover));
  if (!im.cm.empty()) {
    std::unordered_map<uint64_t, uint32_t> by_key;
    for (const auto& is : sessions) {
      struct stat st {};
      if (is.sock.valid() && ::fstat(is.sock.get(), &st) == 0) by_key[st.st_ino] = is.session->id;
    }
    // What fails here costs the guest its CM ids (its channels read end-of-stream), not the move
    // or the restart.
    if (Status st = cm_.import_sessions(im.cm, im.cm_fds, by_key, im.recover); !st.is_ok())
      VLOG_WARN("guest {}: its RDMA CM state was not taken in: {}", im.guest, st.message());
  }
  ImportResp r{};
  r.sessions = static_cast<uint32_t>(sessions.size());
  for (auto& is : sessions) {
    r.qps += static_cast<uint32_t>(is.session->qps.size());
    adopt(is.session, std::move(is.sock));
  }
  r.served_mono_us = mono_us();
  r.import_us = r.served_mono_us - t0;
  VLOG_DEBUG("guest {}: imported ({} QPs) in {} us, {} us of this thread's CPU", im.guest, r.qps,
             r.import_us, thread_cpu_us() - cpu0);
  keep(im.guest);
  return r;
}

void Server::adopt(engine::Session* s, UniqueFd sock) {
  if (!sock.valid()) return;
  // The connection is the guest's own, so the kernel still knows who made it: that, not the
  // blob, names the session's pid and uid. A blob of version 1 had no owner: the guest then
  // belongs to the uid of its first session with a connection.
  if (auto cred = peer_cred(sock.get()); cred.is_ok()) {
    s->pid = cred.value().pid;
    s->uid = cred.value().uid;
    if (s->guest->owner_uid == engine::kNoUid) s->guest->owner_uid = s->uid;
  }
  const int fd = sock.get();
  Conn& c = conns_[fd];
  c.sock = std::move(sock);
  c.session = s;
  watch(fd, 0);
  const int db = s->doorbell.get();
  doorbell_to_sock_[db] = fd;
  watch(db, kTagDoorbell);
}

void Server::release_guest(const std::string& guest, bool cm_moved) {
  std::vector<int> gone;
  for (auto& [fd, conn] : conns_) {
    if (conn.session && conn.session->guest->name == guest) gone.push_back(fd);
  }
  for (int fd : gone) {
    // Out of our epoll first: the target holds the same open files, so closing ours would not
    // remove them from it.
    const int db = conns_[fd].session->doorbell.get();
    // Its RDMA CM state moved with it, or (a restore) its ids end, their ports freed.
    if (cm_moved)
      cm_.session_moved(conns_[fd].session);
    else
      cm_.session_closed(conns_[fd].session);
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, db, nullptr);
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
    doorbell_to_sock_.erase(db);
    conns_.erase(fd);
  }
  dev_.detach_guest(guest);
}

}  // namespace vrdma::backend

namespace vrdma::backend {

Result<UniqueFd> Server::kept_listener() {
  auto sock = connect_unix(opt_.socket_path + ".keeper");
  if (!sock.is_ok()) return UniqueFd();  // none yet: start_keeper starts one
  use_keeper(std::move(sock.value()));
  std::vector<uint8_t> msg;
  std::vector<UniqueFd> fds;
  Status st = send_msg(keeper_.get(), encode(Op::kKeepListenerAsk, 1, 0, Empty{}));
  if (st.is_ok()) st = recv_msg(keeper_.get(), msg, kMaxImportMessage, fds);
  auto h = st.is_ok() ? decode_request(msg) : Result<MsgHeader>(st);
  if (!h.is_ok()) return h.status();  // the keeper went: start_keeper would fail alike
  if (static_cast<Op>(h.value().op) != Op::kKeepListener || fds.empty()) return UniqueFd();
  return std::move(fds.front());
}

void Server::use_keeper(UniqueFd sock) {
  keeper_ = std::move(sock);
  timeval tv{5, 0};
  ::setsockopt(keeper_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  // Room for a burst of records (a guest's CM state after each CM command): with the default
  // (~200 KiB) the server thread waited for the keeper to be scheduled every few connections.
  // Capped by net.core.wmem_max.
  constexpr int kKeeperBuffer = 4 << 20;
  ::setsockopt(keeper_.get(), SOL_SOCKET, SO_SNDBUF, &kKeeperBuffer, sizeof(kKeeperBuffer));
}

Status Server::connect_keeper(const std::string& path) {
  auto sock = connect_unix(path);
  if (!sock.is_ok() && activated_) {
    // Under systemd, systemd restarts us and the keeper is a unit of its own: a keeper we
    // forked would be killed with our cgroup and would restart us behind systemd's back.
    return error(sock.status().err(),
                 fmt::format("keep_state: no keeper answers at {} ({}): under systemd it is "
                             "vrdmad-keeper.service, started by vrdmad-keeper.socket, which "
                             "vrdmad.service wants (is vrdmad-keeper.socket installed?)",
                             path, sock.status().message()));
  }
  if (!sock.is_ok()) {
    // None: start one, detached (it must outlive us), and wait for it to listen.
    const pid_t pid = ::fork();
    if (pid < 0) return error(errno, "fork");
    if (pid == 0) {
      ::setsid();
      if (::fork() != 0) ::_exit(0);
      std::vector<std::string> args = {"/proc/self/exe", "--keeper", path,
                                       std::to_string(opt_.keep_state_grace_s)};
      // How to start us again, in the environment: on its command line it would look like us
      // to anything that finds the backend by its arguments.
      std::string restart;
      for (const std::string& a : opt_.self_argv) restart += a + '\x1f';
      ::setenv("VRDMA_KEEPER_RESTART", restart.c_str(), 1);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv("/proc/self/exe", argv.data());
      ::_exit(127);
    }
    ::waitpid(pid, nullptr, 0);
    for (int i = 0; i < 200 && !sock.is_ok(); ++i) {
      ::usleep(10000);
      sock = connect_unix(path);
    }
    if (!sock.is_ok()) return error(sock.status().err(), "the state keeper did not start");
  }
  use_keeper(std::move(sock.value()));
  return Status::ok();
}

Status Server::start_keeper() {
  const std::string path = opt_.socket_path + ".keeper";
  if (!keeper_.valid()) RETURN_IF_ERROR(connect_keeper(path));
  // The transport's listener, which the keeper holds while we restart: peers' connections are
  // accepted meanwhile, and a peer's QPs wait for us as for a slow backend.
  if (tcp_) {
    const int l = tcp_->listener_fd();
    RETURN_IF_ERROR(send_msg(keeper_.get(), encode(Op::kKeepListener, 1, 0, Empty{}), {&l, 1}));
  }
  // Whatever it kept from a backend before us comes back now.
  RETURN_IF_ERROR(send_msg(keeper_.get(), encode(Op::kKeepRestore, 1, 0, Empty{})));
  Conn from;  // the records arrive as imports do
  std::vector<std::string> restored;
  for (;;) {
    std::vector<uint8_t> msg;
    std::vector<UniqueFd> fds;
    RETURN_IF_ERROR(recv_msg(keeper_.get(), msg, kMaxImportMessage, fds));
    ASSIGN_OR_RETURN(MsgHeader h, decode_request(msg));
    const Op op = static_cast<Op>(h.op);
    if (op == Op::kKeepEnd) break;
    // A record that does not add up is skipped (logged); the others are still restored.
    if (op == Op::kImportBegin || op == Op::kImportData || op == Op::kImportCm) {
      if (op == Op::kImportBegin) from.import.reset();
      Status st = op == Op::kImportBegin  ? import_begin(from, msg)
                  : !from.import          ? Status::ok()
                  : op == Op::kImportData ? import_data(from, msg, fds)
                                          : import_cm(from, msg, fds);
      if (!st.is_ok()) {
        VLOG_WARN("state keeper: a kept guest is skipped: {}", st.message());
        from.import.reset();
      }
    } else if (op == Op::kImportCommit && from.import) {
      const std::string guest = from.import->guest;
      auto r = import_commit(from);
      if (r.is_ok()) {
        VLOG_INFO("guest {}: restored from the keeper ({} sessions, {} QPs, {} us)", guest,
                  r.value().sessions, r.value().qps, r.value().import_us);
        restored.push_back(guest);
      } else {
        VLOG_WARN("guest {}: its kept state could not be restored: {}", guest,
                  r.status().message());
        keep_drop(guest);
      }
      from.import.reset();
    }
  }
  // Ids whose local peer's guest did not come back hear that it went away.
  cm_.settle_restored();
  keep_cm_changes();
  timeval none{0, 0};
  ::setsockopt(keeper_.get(), SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
  VLOG_INFO("state keeper at {}: {} guest(s) restored", path, restored.size());
  return Status::ok();
}

void Server::keep(const std::string& guest) {
  if (!keeper_.valid()) return;
  if (!dev_.has_guest(guest)) {
    keep_drop(guest);
    return;
  }
  auto ex = export_with_sockets(guest, true);
  std::vector<int> cm_fds;  // its RDMA CM state rides along: the same sessions
  CmPart cm{ex.is_ok() ? cm_state_of(guest, cm_fds) : std::string(), {}};
  cm.fds = cm_fds;
  Status st = ex.is_ok() ? send_state(keeper_.get(), guest, ex.value().blob, ex.value().fds, 0, &cm)
                         : ex.status();
  if (!st.is_ok()) VLOG_WARN("guest {}: its state did not reach the keeper: {}", guest, st.message());
}

void Server::keep_direct_changes() {
  if (!keeper_.valid()) return;  // nothing is noted then (track_direct_changes)
  for (const std::string& guest : dev_.take_direct_changes()) keep(guest);
}

void Server::keep_cm_changes() {
  if (!keeper_.valid() || !cm_.has_changes()) return;
  const std::unordered_set<uint32_t> changed = cm_.take_changes();
  std::set<std::string> guests;  // a session that ended has no guest here any more: its guest's
                                 // own keep (drop) had the rest
  for (const auto& [fd, conn] : conns_) {
    if (conn.session && changed.count(conn.session->id)) guests.insert(conn.session->guest->name);
  }
  for (const std::string& guest : guests) {
    std::vector<int> fds;
    CmPart cm{cm_state_of(guest, fds), {}};
    cm.fds = fds;
    if (Status st = send_cm_state(keeper_.get(), guest, cm); !st.is_ok())
      VLOG_WARN("guest {}: its RDMA CM state did not reach the keeper: {}", guest, st.message());
  }
}

std::string Server::cm_state_of(const std::string& guest, std::vector<int>& fds) const {
  // Its sessions named by their connections' inodes, which every copy of them shares (the
  // migration target's, the keeper's).
  std::unordered_map<uint32_t, uint64_t> keys;
  for (const auto& [fd, conn] : conns_) {
    struct stat st {};
    if (conn.session && conn.session->guest->name == guest && ::fstat(fd, &st) == 0)
      keys[conn.session->id] = st.st_ino;
  }
  return cm_.export_sessions(keys, fds);
}

void Server::keep_drop(const std::string& guest) {
  if (!keeper_.valid()) return;
  KeepDropReq req{};
  std::memcpy(req.guest, guest.data(), std::min(guest.size(), sizeof(req.guest) - 1));
  (void)send_msg(keeper_.get(), encode(Op::kKeepDrop, 1, 0, req));
}

}  // namespace vrdma::backend
