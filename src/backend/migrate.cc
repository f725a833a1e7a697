// Moving a guest's device between backends on one machine (live migration), and snapshots.
// The source freezes the guest simply by being busy: the engine thread exports the guest's state
// (engine/device_state.cc), hands the blob and every descriptor it names (memfds, doorbell, pipe
// ends and the guest's own connection) to the target backend over its socket (SCM_RIGHTS), waits
// for the target to import it, then forgets the guest without ending anything. The guest's
// process sees nothing but a pause: the same connection, rings and memory, now served by the
// target. Peers follow the guest through the directory (GuestUp from the target).
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstring>

#include <fmt/format.h>

#include "backend/server.h"
#include "common/log.h"
#include "common/socket.h"

namespace vrdma::backend {

using namespace vrdma::proto;

namespace {

uint64_t mono_us() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000ull + uint64_t(ts.tv_nsec) / 1000;
}

std::string name_of(const char* field, size_t max) { return std::string(field, strnlen(field, max)); }

/// Operator commands move guests between backends: only root or the backend's own user.
Status check_admin(int sock) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
    return error(errno, "SO_PEERCRED");
  if (cred.uid != 0 && cred.uid != ::geteuid())
    return error(EPERM, fmt::format("uid {} may not move guests", cred.uid));
  return Status::ok();
}

/// Sends one request and reads its response (blocking, with a deadline).
Result<std::vector<uint8_t>> round_trip(int sock, std::span<const uint8_t> req) {
  RETURN_IF_ERROR(send_msg(sock, req));
  std::vector<uint8_t> buf;
  std::vector<UniqueFd> fds;
  RETURN_IF_ERROR(recv_msg(sock, buf, kMaxRequest, fds));
  ASSIGN_OR_RETURN(MsgHeader h, decode_header(buf));
  if (h.status != 0) return error(-h.status, "the target backend refused the import");
  return buf;
}

}  // namespace

Status Server::handle_admin(Conn& c, const MsgHeader& h, std::vector<uint8_t>& msg,
                            std::vector<UniqueFd>& fds) {
  const Op op = static_cast<Op>(h.op);
  std::vector<uint8_t> out;
  auto fail = [&](const Status& st) {
    VLOG_WARN("op {} from connection {}: {}", h.op, c.sock.get(), st.message());
    out = encode(op, h.seq, -st.err(), Empty{});
  };
  if (Status st = check_admin(c.sock.get()); !st.is_ok()) {
    fail(st);
    return send_msg(c.sock.get(), out);
  }
  switch (op) {
    case Op::kMigrate: {
      const auto req = body_of<MigrateReq>(msg).value();
      auto r = migrate_out(name_of(req.guest, sizeof(req.guest)),
                           name_of(req.target, sizeof(req.target)));
      if (r.is_ok()) out = encode(op, h.seq, 0, r.value());
      else fail(r.status());
      break;
    }
    case Op::kImportBegin: {
      const auto req = body_of<ImportBeginReq>(msg).value();
      if (c.import) return error(EPROTO, "second import on one connection");
      if (req.bytes > kMaxImportBytes || req.fds > kMaxImportFds)
        return error(E2BIG, "import larger than the limits");
      c.import = std::make_unique<Conn::Import>();
      c.import->guest = name_of(req.guest, sizeof(req.guest));
      c.import->bytes = req.bytes;
      c.import->nfds = req.fds;
      c.import->blob.reserve(req.bytes);
      return Status::ok();  // no answer: the data follows at once
    }
    case Op::kImportData: {
      if (!c.import) return error(EPROTO, "import data without a begin");
      Conn::Import& im = *c.import;
      const size_t n = msg.size() - sizeof(MsgHeader);
      if (im.blob.size() + n > im.bytes || im.fds.size() + fds.size() > im.nfds)
        return error(EPROTO, "import data beyond what was announced");
      im.blob.insert(im.blob.end(), msg.begin() + sizeof(MsgHeader), msg.end());
      for (UniqueFd& f : fds) im.fds.push_back(std::move(f));
      return Status::ok();
    }
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
      if (fds.empty()) {
        fail(error(EBADF, "snapshot without a file descriptor"));
        break;
      }
      const uint64_t t0 = mono_us();
      auto ex = dev_.export_guest(guest, [](const engine::Session&) { return -1; });
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
    default:
      return error(EPROTO, "not an operator command");
  }
  return send_msg(c.sock.get(), out);
}

Result<MigrateResp> Server::migrate_out(const std::string& guest, const std::string& target) {
  const uint64_t t0 = mono_us();
  if (!dev_.has_guest(guest)) return error(ENOENT, fmt::format("no guest {} here", guest));
  if (target == opt_.socket_path) return error(EINVAL, "the target is this backend");
  ASSIGN_OR_RETURN(UniqueFd sock, connect_unix(target));
  timeval tv{10, 0};
  ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  // The guest's own connections go with it.
  std::unordered_map<const engine::Session*, int> sock_of;
  for (const auto& [fd, conn] : conns_) {
    if (conn.session) sock_of[conn.session] = fd;
  }
  ASSIGN_OR_RETURN(engine::GuestExport ex, dev_.export_guest(guest, [&](const engine::Session& s) {
                     auto it = sock_of.find(&s);
                     return it == sock_of.end() ? -1 : it->second;
                   }));
  const uint64_t t1 = mono_us();
  ImportBeginReq begin{};
  std::memcpy(begin.guest, guest.data(), std::min(guest.size(), sizeof(begin.guest) - 1));
  begin.bytes = ex.blob.size();
  begin.fds = static_cast<uint32_t>(ex.fds.size());
  RETURN_IF_ERROR(send_msg(sock.get(), encode(Op::kImportBegin, 1, 0, begin)));
  size_t off = 0, fi = 0;
  while (off < ex.blob.size() || fi < ex.fds.size()) {
    const size_t n = std::min(kMaxImportChunk, ex.blob.size() - off);
    const size_t nf = std::min(kMaxFdsPerMessage, ex.fds.size() - fi);
    std::vector<uint8_t> m = encode(Op::kImportData, 2, 0, Empty{});
    m.insert(m.end(), ex.blob.begin() + off, ex.blob.begin() + off + n);
    const uint32_t len = static_cast<uint32_t>(m.size());
    std::memcpy(m.data() + offsetof(MsgHeader, length), &len, sizeof(len));
    RETURN_IF_ERROR(send_msg(sock.get(), m, {ex.fds.data() + fi, nf}));
    off += n;
    fi += nf;
  }
  const uint64_t t2 = mono_us();
  ASSIGN_OR_RETURN(auto resp, round_trip(sock.get(), encode(Op::kImportCommit, 3, 0, Empty{})));
  ASSIGN_OR_RETURN(ImportResp ir, body_of<ImportResp>(resp));
  // The target serves the guest from here on: its downtime ends now. Then stop serving it here,
  // without ending anything (unmapping its rings and memory; tens of ms with 64 QPs).
  const uint64_t t3 = mono_us();
  release_guest(guest);
  const uint64_t release_us = mono_us() - t3;
  MigrateResp r{};
  r.downtime_us = t3 - t0;
  r.export_us = t1 - t0;
  r.transfer_us = t2 - t1;
  r.import_us = ir.import_us;
  r.bytes = ex.blob.size();
  r.qps = static_cast<uint32_t>(ex.qps);
  r.fds = static_cast<uint32_t>(ex.fds.size());
  VLOG_INFO("guest {} moved to {}: {} QPs, {} bytes, {} descriptors; frozen {} us (export {}, "
            "transfer {}, import {}); released here in {} us",
            guest, target, r.qps, r.bytes, r.fds, r.downtime_us, r.export_us, r.transfer_us,
            r.import_us, release_us);
  return r;
}

Result<ImportResp> Server::import_commit(Conn& c) {
  if (!c.import) return error(EPROTO, "import commit without a begin");
  Conn::Import& im = *c.import;
  if (im.blob.size() != im.bytes || im.fds.size() != im.nfds)
    return error(EPROTO, fmt::format("import incomplete: {} of {} bytes, {} of {} descriptors",
                                     im.blob.size(), im.bytes, im.fds.size(), im.nfds));
  const uint64_t t0 = mono_us();
  ASSIGN_OR_RETURN(auto sessions, dev_.import_guest(im.blob, im.fds));
  ImportResp r{};
  r.sessions = static_cast<uint32_t>(sessions.size());
  for (auto& is : sessions) {
    r.qps += static_cast<uint32_t>(is.session->qps.size());
    adopt(is.session, std::move(is.sock));
  }
  r.import_us = mono_us() - t0;
  return r;
}

void Server::adopt(engine::Session* s, UniqueFd sock) {
  if (!sock.valid()) return;
  const int fd = sock.get();
  Conn& c = conns_[fd];
  c.sock = std::move(sock);
  c.session = s;
  watch(fd, 0);
  const int db = s->doorbell.get();
  doorbell_to_sock_[db] = fd;
  watch(db, kTagDoorbell);
}

void Server::release_guest(const std::string& guest) {
  std::vector<int> gone;
  for (auto& [fd, conn] : conns_) {
    if (conn.session && conn.session->guest->name == guest) gone.push_back(fd);
  }
  for (int fd : gone) {
    // Out of our epoll first: the target holds the same open files, so closing ours would not
    // remove them from it.
    const int db = conns_[fd].session->doorbell.get();
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, db, nullptr);
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
    doorbell_to_sock_.erase(db);
    conns_.erase(fd);
  }
  dev_.detach_guest(guest);
}

}  // namespace vrdma::backend
