// The direct path's control side: grants that let the library of an RC QP execute its WQEs
// itself, straight into its peer QP's memory, when both guests run as one uid on this backend
// and the requester could already write the peer's memory by the kernel's rules (it proved so
// with a /proc/PID/mem descriptor), or the operator declared them one tenant ([datapath]
// direct_trust, direct_tenants). The backend stays in the control
// path: it checks every condition at grant time, hands out only the peer's rings, MR table and
// segments, and ends grants by bumping the guests' epochs. docs/ARCHITECTURE.md, "Direct path".
// Across backends it only introduces two libraries (offer, then remote): they talk TCP.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>

#include "common/answer_spin.h"
#include "common/log.h"
#include "common/memfd.h"
#include "common/socket.h"
#include "engine/datapath_util.h"
#include "engine/device.h"
#include "engine/direct_trust.h"

namespace vrdma::engine {

using namespace vrdma::proto;

namespace {

/// A read-only descriptor of the same file: what a guest may map of a page only we write.
UniqueFd read_only(int fd) {
  return UniqueFd(::open(fmt::format("/proc/self/fd/{}", fd).c_str(), O_RDONLY | O_CLOEXEC));
}

/// A QP's own completion ring, as large as the CQ it stands in for (same handle, no channel).
Result<std::unique_ptr<Cq>> own_ring(const Cq& of) {
  auto r = std::make_unique<Cq>();
  r->handle = of.handle;
  r->owner = of.owner;
  r->size = of.size;
  r->stamps = of.stamps;
  RETURN_IF_ERROR(make_cq_ring(*r, "vrdma-qp-cq"));
  r->shared_producer = true;
  return r;
}

/// Tries of the backend for a receive side a library holds (Device::rx_lock_try): a holder
/// keeps it for one receive (a UD datagram's copy, about a microsecond; an SRQ's WQE).
constexpr int kRxLockSpins = 256;

/// How long the engine thread waits for a proof's read of the peer's memory; a read that takes
/// longer is settled at a later grant (Session::proving).
constexpr int kProofWaitMs = 5;

/// Takes in the proofs of `s` whose reads are done; true if one for session `peer` is still
/// being read.
bool settle_proofs(Session& s, uint32_t peer) {
  bool pending = false;
  std::erase_if(s.proving, [&](const Session::Proving& p) {
    if (!p.proof.wait(0)) {
      pending = pending || p.peer == peer;
      return false;
    }
    if (p.proof.good()) {
      s.may_write.push_back(p.peer);
      VLOG_INFO("direct path: pid {} (guest {}) may write {} by the kernel's rules", s.pid,
                s.guest->name, p.who);
    } else {
      VLOG_INFO(
          "direct path: pid {} (guest {}) offered no proof that it may write {}: the "
          "proof's process does not hold the cookie; the pair stays mediated",
          s.pid, s.guest->name, p.who);
    }
    return true;
  });
  return pending;
}

/// How long a guest's QPs stay off the direct path across backends after an ask that did not
/// find them all settled (Guest::direct_held_until_ns): the CLI asks every 10 ms; one that gave
/// up leaves them free again after this.
constexpr uint64_t kDirectHoldNs = 2'000'000'000;

/// Whether guest `g` is leaving the direct path across backends (a move or a snapshot is asking).
/// The kDirectNotifyFds descriptors of CQ `cq`, which has a channel, appended to `fds`: its ring
/// (for the `armed` word), the channel's write end, and a new read end of the same pipe (held by
/// the library, so that the pipe never loses its last reader).
Status add_notify_fds(const Cq& cq, std::vector<UniqueFd>& fds) {
  auto ch = cq.owner->channels.find(cq.channel);
  if (ch == cq.owner->channels.end()) return error(EIO, "direct path: the CQ's channel is gone");
  fds.push_back(dup_fd(cq.ring_fd.get()));
  fds.push_back(dup_fd(ch->second.write_end.get()));
  fds.push_back(read_only(ch->second.write_end.get()));
  return Status::ok();
}

bool direct_held(const Guest& g) {
  return g.direct_held_until_ns != 0 && mono_ns() < g.direct_held_until_ns;
}

/// Whether the QP's PD holds an ODP MR of its owner (such QPs stay on the backend's path).
bool pd_holds_odp(const Qp& q) {
  for (const auto& [h, mr] : q.owner->mrs) {
    if (mr->odp && mr->pd == q.pd) return true;
  }
  return false;
}

}  // namespace

bool Device::trusts(const Session& s, const Session& peer) const {
  if (direct_uid_enough_ || &s == &peer) return true;
  for (const auto& t : direct_tenants_) {
    if (std::find(t.begin(), t.end(), s.guest->name) != t.end() &&
        std::find(t.begin(), t.end(), peer.guest->name) != t.end())
      return true;
  }
  return std::find(s.may_write.begin(), s.may_write.end(), peer.id) != s.may_write.end();
}

Result<Session*> Device::direct_peer_session(Session& s, uint32_t handle) {
  if (!direct_) return error(EOPNOTSUPP, "the direct path is off ([datapath] direct_path)");
  Qp* a = find_qp(s, handle);
  if (!a) return error(EINVAL, fmt::format("no QP {}", handle));
  Qp* b = a->remote ? nullptr : local_responder(*a);
  if (!b) return error(EAGAIN, "direct path: peer QP not on this backend or not connected yet");
  if (b->owner->uid != s.uid || s.uid == kNoUid)
    return error(EPERM, "direct path: peer runs as another user");
  return b->owner;
}

std::string Device::direct_peer_guest(Session& s, uint32_t handle) {
  Qp* a = find_qp(s, handle);
  Qp* b = a && !a->remote ? local_responder(*a) : nullptr;
  return b ? b->guest->name : std::string();
}

Status Device::direct_cookie(Session& s, const DirectCookieReq& req) {
  if (req.addr == 0) return error(EINVAL, "direct cookie at address 0");
  s.cookie_addr = req.addr;
  std::memcpy(s.cookie.data(), req.cookie, kDirectCookieBytes);
  return Status::ok();
}

Result<DirectPeerResp> Device::direct_peer(Session& s, uint32_t handle) {
  ASSIGN_OR_RETURN(Session * peer, direct_peer_session(s, handle));
  return peer_pid(s, *peer);
}

Result<DirectPeerResp> Device::direct_peer_ud(Session& s, const DirectUdReq& req) {
  ASSIGN_OR_RETURN(Session * peer, direct_ud_peer_session(s, req));
  return peer_pid(s, *peer);
}

Result<Session*> Device::direct_ud_peer_session(Session& s, const DirectUdReq& req) {
  ASSIGN_OR_RETURN(Qp * b, ud_destination(s, req));
  if (b->owner->uid != s.uid || s.uid == kNoUid)
    return error(EPERM, "direct path: peer runs as another user");
  return b->owner;
}

Result<DirectPeerResp> Device::peer_pid(Session& s, Session& peer) {
  if (peer.cookie_addr == 0) return error(EAGAIN, "direct path: the peer has sent no cookie");
  // Only a number the caller could find in its own /proc: a peer in another pid namespace
  // (another container) stays unnamed, and the caller cannot prove anything.
  ASSIGN_OR_RETURN(uint32_t pid,
                   pid_as_seen_by(static_cast<pid_t>(s.pid), static_cast<pid_t>(peer.pid)));
  return DirectPeerResp{pid, 0};
}

Status Device::direct_prove(Session& s, uint32_t handle, UniqueFd proof) {
  ASSIGN_OR_RETURN(Session * peer, direct_peer_session(s, handle));
  return prove(s, peer, std::move(proof));
}

Status Device::direct_prove_ud(Session& s, const DirectUdReq& req, UniqueFd proof) {
  ASSIGN_OR_RETURN(Session * peer, direct_ud_peer_session(s, req));
  return prove(s, peer, std::move(proof));
}

Status Device::prove(Session& s, Session* peer, UniqueFd proof) {
  if (!proof.valid()) return error(EINVAL, "direct path: no proof attached");
  if (peer->cookie_addr == 0) return error(EAGAIN, "direct path: the peer has sent no cookie");
  if (settle_proofs(s, peer->id)) return error(EAGAIN, "direct path: an earlier proof is read");
  if (trusts(s, *peer)) return Status::ok();
  auto p = start_mem_proof(proof.get(), peer->cookie_addr, peer->cookie);
  const bool done = p.is_ok() && p.value().wait(kProofWaitMs);
  if (!p.is_ok() || (done && !p.value().good())) {
    const Status st =
        p.is_ok() ? error(EPERM, "the proof's process does not hold the cookie") : p.status();
    VLOG_INFO(
        "direct path: pid {} (guest {}) offered no proof that it may write pid {} (guest "
        "{}): {}; the pair stays mediated",
        s.pid, s.guest->name, peer->pid, peer->guest->name, st.message());
    return st;
  }
  if (!done) {  // a busy machine, or a peer whose memory stalls: the next grant looks again
    s.proving.push_back({peer->id, fmt::format("pid {} (guest {})", peer->pid, peer->guest->name),
                         std::move(p).value()});
    return error(EAGAIN, "direct path: the proof is being read");
  }
  s.may_write.push_back(peer->id);
  VLOG_INFO("direct path: pid {} (guest {}) may write pid {} (guest {}) by the kernel's rules",
            s.pid, s.guest->name, peer->pid, peer->guest->name);
  return Status::ok();
}

namespace {

/// The lock word of `to`'s receive side when others than the backend consume it too (a UD RQ
/// that direct senders feed, an SRQ that libraries feed), with its busy flag; null otherwise.
AtomicU32* rx_lock_word(Qp& to, bool*& busy) {
  if (to.srq) {
    busy = &to.srq->rx_busy;
    return to.srq->direct ? &to.srq->hdr->rx_lock : nullptr;
  }
  busy = &to.rx_busy;
  return to.type == IBV_QPT_UD && to.own_recv ? &to.rq_hdr->rx_lock : nullptr;
}

}  // namespace

bool Device::rx_lock_take(Qp& to) {
  bool* busy = nullptr;
  AtomicU32* w = rx_lock_word(to, busy);
  return !w || rx_lock_try(*w, *busy);  // RC, UC on their own RQ: one producer at a time
}

bool Device::rx_lock_try(AtomicU32& w, bool& busy) {
  // A library holds it for one receive (UD: one datagram's copy, at most an MTU): a short
  // wait. One preempted inside costs this datagram (UD is unreliable) or a later turn (an SRQ),
  // never the engine thread's time.
  const int tries = busy ? 1 : kRxLockSpins;
  for (int i = 0; i < tries; ++i) {
    uint32_t held = 0;
    if (w.compare_exchange_strong(held, kRxLockBackend, std::memory_order_acquire)) break;
    // Ours from before a crash (keep_state), or a session's that is gone (a process killed
    // inside a delivery): nobody will give it back.
    const bool orphan = held == kRxLockBackend || !rx_tag_live(held);
    if (orphan && w.compare_exchange_strong(held, kRxLockBackend, std::memory_order_acquire)) break;
    if (i + 1 == tries) {
      busy = true;
      return false;
    }
    __builtin_ia32_pause();
  }
  busy = false;
  return true;
}

bool Device::rx_tag_live(uint32_t held) const {
  if (sessions_.count(held - rx_tag_base_)) return true;
  // A library of a session restored from the backend before us (keep_state, a move) that has
  // not asked for a grant since holds the lock with that backend's tag: taking it over would
  // have two deliveries take the same receive (e2e.keep_state_ud: a datagram twice).
  for (const auto& [id, s] : sessions_) {
    for (const uint32_t t : s->kept_rx_tags)
      if (t && t == held) return true;
  }
  return false;
}

void Device::rx_lock_give(Qp& to) {
  bool* busy = nullptr;
  if (AtomicU32* w = rx_lock_word(to, busy)) w->store(0, std::memory_order_release);
}

void Device::set_srq_limit(Srq& q, uint32_t limit) {
  q.limit = limit;
  // Under the lock when libraries feed it, so that none that read the old value is still
  // taking a receive: it would not see the limit crossed. A holder that keeps it past the
  // tries leaves the crossing to the next receive the backend takes (libraries leave it that).
  const bool held = q.direct && rx_lock_try(q.hdr->rx_lock, q.rx_busy);
  q.hdr->srq_limit.store(limit, std::memory_order_release);
  if (held) q.hdr->rx_lock.store(0, std::memory_order_release);
}

void Device::bump_epoch(Guest& g) {
  if (!g.epoch.valid()) return;  // never granted: nobody looks
  reinterpret_cast<EpochPage*>(g.epoch.data())->epoch.fetch_add(1, std::memory_order_acq_rel);
  for (Qp* qp : g.active) qp->direct = false;
}

Status Device::give_own_send(Qp& qp) {
  if (qp.own_send) return Status::ok();
  ASSIGN_OR_RETURN(qp.own_send, own_ring(*qp.send_cq));
  qp.send_cq->hdr->direct_gen.fetch_add(1, std::memory_order_release);
  return Status::ok();
}

Status Device::give_own_recv(Qp& qp) {
  if (qp.own_recv) return Status::ok();
  ASSIGN_OR_RETURN(qp.own_recv, own_ring(*qp.recv_cq));
  // Start at the cursor the RQ is at, for peek_recv's resume; receives posted from now on ring
  // no doorbell (the library consumes them as well).
  qp.rq_hdr->consumer.store(qp.rq_cons, std::memory_order_release);
  qp.rq_hdr->armed.store(1, std::memory_order_release);
  qp.recv_cq->hdr->direct_gen.fetch_add(1, std::memory_order_release);
  return Status::ok();
}

Result<DirectGrantResp> Device::direct_grant(Session& s, uint32_t handle,
                                             std::vector<UniqueFd>& fds, uint32_t flags) {
  if (!direct_ && !direct_remote_)
    return error(EOPNOTSUPP, "the direct path is off ([datapath] direct_path)");
  Qp* a = find_qp(s, handle);
  if (!a) return error(EINVAL, fmt::format("no QP {}", handle));
  if (a->type != IBV_QPT_RC && a->type != IBV_QPT_UC)
    return error(EOPNOTSUPP, "direct path: RC and UC QPs only (UD: kDirectGrantUd)");
  if (a->state != IBV_QPS_RTS) return error(EAGAIN, "direct path: QP not in RTS");
  // A peer on another backend: the library asks kDirectRemote instead (even with direct_path
  // off, so that a library asks one question whatever the backend offers).
  if (a->remote) {
    // (Both RC and UC ask kDirectRemote: the library learns that it may from this answer.)
    return error(EREMOTE, "direct path: peer on another backend (kDirectRemote)");
  }
  if (!direct_) return error(EOPNOTSUPP, "the direct path is off ([datapath] direct_path)");
  if (a->route_pending) return error(EAGAIN, "direct path: destination not located yet");
  Qp* b = local_responder(*a);
  if (!b || !rq_open(b->state)) return error(EAGAIN, "direct path: peer QP not connected yet");
  if (b->srq) RETURN_IF_ERROR(srq_grantable(*b, flags));
  return grant_into(s, *a, *b, fds);
}

Status Device::srq_grantable(const Qp& b, uint32_t flags) const {
  const Srq& q = *b.srq;
  if (!(flags & kDirectGrantSrq))
    return error(EOPNOTSUPP,
                 "direct path: the peer QP is on an SRQ (this library cannot feed one)");
  if (q.xrcd) return error(EOPNOTSUPP, "direct path: XRC SRQs stay mediated");
  // The grant's MR table serves both the receive WQEs' lkeys (the SRQ's PD) and the rkeys
  // (the QP's PD): one PD only.
  if (q.pd != b.pd) return error(EOPNOTSUPP, "direct path: the peer's SRQ is in another PD");
  // (A QP of the SRQ connected across backends takes its receives under the lock too, and holds
  // one while a message's payload comes: take_recv.)
  return Status::ok();
}

void Device::feed_srq(Srq& q) {
  if (q.direct) return;
  // From now on every consumer takes its receives under the rx_lock, from the shared cursor.
  q.direct = true;
  q.hdr->consumer.store(q.cons, std::memory_order_release);
  q.hdr->armed.store(1, std::memory_order_release);
}

Result<Qp*> Device::ud_destination(Session& s, const DirectUdReq& req) {
  if (!direct_) return error(EOPNOTSUPP, "the direct path is off ([datapath] direct_path)");
  Qp* a = find_qp(s, req.qp);
  if (!a) return error(EINVAL, fmt::format("no QP {}", req.qp));
  if (a->type != IBV_QPT_UD) return error(EOPNOTSUPP, "direct path: kDirectGrantUd is UD's");
  if (a->state != IBV_QPS_RTS) return error(EAGAIN, "direct path: QP not in RTS");
  if (is_mcast(req.dest)) return error(EOPNOTSUPP, "direct path: multicast stays mediated");
  // Where execute_ud would send it: a guest of this backend, unless TCP is forced.
  if (transport_ && transport_->forced())
    return error(EOPNOTSUPP, "direct path: every datagram goes through the transport");
  Guest* g = nullptr;
  if (req.dest.is_global) {
    g = guest_by_gid(req.dest.dgid);
  } else if (auto it = guests_by_lid_.find(req.dest.dlid); it != guests_by_lid_.end()) {
    g = it->second;
  }
  if (!g) return error(EHOSTUNREACH, "direct path: destination not on this backend");
  auto it = g->qps.find(req.remote_qpn);
  if (it == g->qps.end() || it->second->type != IBV_QPT_UD || !rq_open(it->second->state))
    return error(EAGAIN, "direct path: no UD QP ready to receive there");
  return it->second;
}

Result<DirectGrantUdResp> Device::direct_grant_ud(Session& s, const DirectUdReq& req,
                                                  std::vector<UniqueFd>& fds,
                                                  std::string& peer_guest) {
  ASSIGN_OR_RETURN(Qp * b, ud_destination(s, req));
  if (b->srq) return error(EOPNOTSUPP, "direct path: the destination UD QP is on an SRQ");
  Qp* a = find_qp(s, req.qp);
  DirectGrantUdResp resp{};
  ASSIGN_OR_RETURN(resp.grant, grant_into(s, *a, *b, fds));
  resp.peer_qkey = b->attr.qkey;
  resp.my_qkey = a->attr.qkey;
  resp.lock_tag = rx_lock_tag(s);
  peer_guest = b->guest->name;
  return resp;
}

Result<DirectGrantResp> Device::grant_into(Session& s, Qp& qa, Qp& qb, std::vector<UniqueFd>& fds) {
  Qp* a = &qa;
  Qp* b = &qb;
  if (b->owner->uid != s.uid || s.uid == kNoUid)
    return error(EPERM, "direct path: peer runs as another user");
  if (!trusts(s, *b->owner)) {
    if (settle_proofs(s, b->owner->id)) return error(EAGAIN, "direct path: the proof is read");
    if (!trusts(s, *b->owner))
      return error(EACCES,
                   "direct path: no proof yet that this process may write the peer's "
                   "memory (kDirectPeer, kDirectProve)");
  }
  // Nothing of ours in flight: the library starts where the backend stopped.
  if (a->sq_cons != a->sq_hdr->producer.load(std::memory_order_acquire) || !a->unacked.empty() ||
      a->wait != Wait::kNone)
    return error(EAGAIN, "direct path: work in flight");

  DirectGrantResp resp{};
  // The peer's MRs in its QP's PD, and the segments they lie in.
  std::map<const Segment*, uint32_t> seg_index;
  std::vector<int> seg_fds;
  // ODP MRs gain pages as the owner's library faults them in; a grant would carry a snapshot,
  // and the library's own executor would touch pages never faulted in. Their QPs stay here.
  if (pd_holds_odp(*a) || pd_holds_odp(*b))
    return error(EOPNOTSUPP, "direct path: the QP's PD holds an ODP MR");
  for (const auto& [h, mr] : b->owner->mrs) {
    if (mr->pd != b->pd) continue;
    if (resp.num_mrs == kMaxDirectMrs || mr->chunks.size() > kMaxDirectChunks)
      return error(E2BIG, "direct path: the peer's MRs do not fit a grant");
    DirectMr& d = resp.mrs[resp.num_mrs++];
    d.key = mr->key;
    d.access = mr->access;
    d.addr = mr->addr;
    d.iova = mr->iova;
    d.length = mr->length;
    d.num_chunks = static_cast<uint32_t>(mr->chunks.size());
    for (size_t i = 0; i < mr->chunks.size(); ++i) {
      const Segment* seg = mr->segments[i].get();
      auto [it, fresh] = seg_index.emplace(seg, static_cast<uint32_t>(seg_fds.size()));
      if (fresh) seg_fds.push_back(seg->fd.get());
      d.chunks[i] = DirectChunk{mr->chunks[i].mr_offset, mr->chunks[i].length,
                                static_cast<uint64_t>(mr->chunks[i].base - seg->map.data()),
                                it->second, 0};
    }
  }
  if (seg_fds.size() + kDirectFixedFds + 2 * kDirectNotifyFds > kMaxFdsPerMessage)
    return error(E2BIG, "direct path: the peer's memory spans too many segments");

  // Both guests' epoch pages, made on first use.
  for (Guest* g : {a->guest, b->guest}) {
    if (g->epoch.valid()) continue;
    // Sealed against future writes: the guests get read-only descriptors of it, and one
    // reopened read-write through /proc/PID/fd must not let a guest move the epoch back.
    MappedRegion writer;
    ASSIGN_OR_RETURN(g->epoch_fd, make_write_sealed_memfd("vrdma-epoch", kPage, writer));
    g->epoch = std::move(writer);
    reinterpret_cast<EpochPage*>(g->epoch.data())->magic = kRingMagic;
  }
  // Own completion rings, kept for the QPs' lives: from now on all their completions, the
  // backend's and the library's, go there in order.
  RETURN_IF_ERROR(give_own_send(*a));
  RETURN_IF_ERROR(give_own_recv(*b));

  fds.clear();
  fds.push_back(dup_fd(b->srq ? b->srq->ring_fd.get() : b->ring_fd.get()));
  fds.push_back(dup_fd(a->own_send->ring_fd.get()));
  fds.push_back(dup_fd(b->own_recv->ring_fd.get()));
  fds.push_back(read_only(a->guest->epoch_fd.get()));
  fds.push_back(read_only(b->guest->epoch_fd.get()));
  for (int fd : seg_fds) fds.push_back(dup_fd(fd));
  // CQs with a completion channel: the library fires them itself (kDirectNotifyFds).
  for (const auto& [cq, bit] :
       {std::pair{a->send_cq, kDirectNotifySend}, std::pair{b->recv_cq, kDirectNotifyRecv}}) {
    if (cq->channel == kNone) continue;
    RETURN_IF_ERROR(add_notify_fds(*cq, fds));
    resp.notify |= bit;
  }
  for (const UniqueFd& fd : fds) {
    if (!fd.valid()) return error(EMFILE, "direct path: duplicating descriptors");
  }

  resp.peer_qpn = b->qpn;
  resp.peer_access = b->attr.qp_access_flags;
  resp.my_lid = a->guest->lid;
  if (Srq* q = b->srq) {
    // Its receives come from the SRQ, which the backend and other libraries consume too: one
    // at a time, under its rx_lock, from the shared consumer index from now on.
    feed_srq(*q);
    resp.peer_rq_entries = q->size;
    resp.peer_ring_bytes = q->ring.size();
    resp.peer_rq_offset = 0;
    resp.lock_tag = rx_lock_tag(s);
  } else {
    resp.peer_rq_entries = b->rq_size;
    resp.peer_ring_bytes = b->ring.size();
    resp.peer_rq_offset =
        static_cast<uint64_t>(reinterpret_cast<uint8_t*>(b->rq_hdr) - b->ring.data());
  }
  resp.send_ring_entries = a->own_send->size;
  resp.recv_ring_entries = b->own_recv->size;
  resp.my_epoch = reinterpret_cast<EpochPage*>(a->guest->epoch.data())->epoch.load();
  resp.peer_epoch = reinterpret_cast<EpochPage*>(b->guest->epoch.data())->epoch.load();
  resp.num_segments = static_cast<uint32_t>(seg_fds.size());
  resp.send_cq = a->send_cq->handle;
  resp.recv_cq = b->recv_cq->handle;
  a->direct = true;
  VLOG_INFO("direct path: guest {} QP {:#x} -> guest {} QP {:#x} ({} MRs, {} segments)",
            a->guest->name, a->qpn, b->guest->name, b->qpn, resp.num_mrs, resp.num_segments);
  return resp;
}

Result<DirectRingsResp> Device::direct_rings(Session& s, uint32_t handle,
                                             std::vector<UniqueFd>& fds, uint32_t skip) {
  auto it = s.cqs.find(handle);
  if (it == s.cqs.end()) return error(EINVAL, fmt::format("no CQ {}", handle));
  const Cq* cq = it->second.get();
  DirectRingsResp resp{};
  resp.gen = cq->hdr->direct_gen.load(std::memory_order_acquire);
  fds.clear();
  uint32_t seen = 0;  // rings of this CQ so far, those skipped included
  auto add = [&](const Qp& qp, const Cq& ring, uint32_t recv) -> Status {
    if (seen++ < skip || resp.count == kMaxDirectRings) return Status::ok();
    resp.rings[resp.count++] = DirectRing{qp.handle, recv, ring.size, 0};
    fds.push_back(dup_fd(ring.ring_fd.get()));
    return fds.back().valid() ? Status::ok() : error(EMFILE, "duplicating a ring descriptor");
  };
  // In the order of the session's QP table (a map by handle: the same from page to page while
  // direct_gen stays; a change moves it and the library asks again).
  for (const auto& [h, qp] : s.qps) {
    if (qp->own_send && qp->send_cq == cq) RETURN_IF_ERROR(add(*qp, *qp->own_send, 0));
    if (qp->own_recv && qp->recv_cq == cq) RETURN_IF_ERROR(add(*qp, *qp->own_recv, 1));
    if (resp.count == kMaxDirectRings) break;
  }
  return resp;
}

// ---- across backends ----

Result<DirectOfferResp> Device::direct_offer(Session& s, const DirectOfferReq& req,
                                             std::vector<UniqueFd>& fds, uint32_t* lock_tag) {
  if (!direct_remote_)
    return error(EOPNOTSUPP, "the direct path across backends is off ([datapath] direct_remote)");
  Qp* b = find_qp(s, req.qp);
  if (!b) return error(EINVAL, fmt::format("no QP {}", req.qp));
  if (!direct_remote_type(b->type)) return error(EOPNOTSUPP, "direct offer: RC and UC QPs only");
  if (b->srq && !(req.flags & kDirectOfferSrq))
    return error(EOPNOTSUPP, "direct offer: a QP on an SRQ (this library cannot take its receives)");
  if (b->srq && b->srq->xrcd) return error(EOPNOTSUPP, "direct offer: XRC SRQs stay mediated");
  if (!b->srq && (req.flags & kDirectOfferSrq))
    return error(EINVAL, "direct offer: kDirectOfferSrq for a QP not on an SRQ");
  // A library older than kDirectOfferNotify would not fire the CQ's channel.
  const bool notify = b->recv_cq->channel != kNone;
  if (notify && !(req.flags & kDirectOfferNotify))
    return error(EOPNOTSUPP, "direct offer: the receive CQ has a completion channel");
  if (b->state != IBV_QPS_RTR && b->state != IBV_QPS_RTS)
    return error(EAGAIN, "direct offer: QP not in RTR or RTS");
  if (b->route_pending) return error(EAGAIN, "direct offer: destination not located yet");
  if (b->sq_hdr->direct_revoke.load(std::memory_order_acquire) == kRevokeAsk)
    return error(EAGAIN, "direct offer: the QP is leaving the direct path");
  if (direct_held(*b->guest))
    return error(EAGAIN, "direct offer: the guest is leaving the direct path (a move)");
  if (!b->remote || !transport_) return error(EOPNOTSUPP, "direct offer: peer on this backend");
  DirectOfferResp resp{};
  resp.listen_ipv4 = transport_->local_ipv4(b->peer_node);
  const uint16_t flags = req.flags & ~(kDirectOfferNotify | kDirectOfferSrq);
  if (flags == kDirectOfferWhere && req.port == 0) {
    if (resp.listen_ipv4 == 0) {
      // No connection to that backend at this moment (made on demand, closed for being idle,
      // being replaced): one is dialed, and the library asks again (its hub's tick).
      if (transport_->want_connection(b->peer_node))
        return error(EAGAIN, fmt::format("direct offer: no connection to backend {} yet",
                                         b->peer_node));
      return error(EADDRNOTAVAIL,
                   fmt::format("direct offer: no address of ours toward backend {}", b->peer_node));
    }
    return resp;
  }
  if (flags != 0) return error(EINVAL, "direct offer: unknown flags");
  if (req.port == 0) return error(EINVAL, "direct offer: port 0");

  // Before the peer hears of it: from now on every receive completion of b goes to its own
  // ring, whoever produces it (this backend for what still comes mediated, or b's library).
  RETURN_IF_ERROR(give_own_recv(*b));
  b->offer_port = req.port;
  b->offer_ipv4 = resp.listen_ipv4;
  std::memcpy(b->offer_token, req.token, kDirectTokenBytes);
  if (!send_offer(*b))
    return error(EAGAIN, fmt::format("direct offer: no connection to backend {}", b->peer_node));

  b->offered = true;
  fds.clear();
  fds.push_back(dup_fd(b->own_recv->ring_fd.get()));
  if (notify) RETURN_IF_ERROR(add_notify_fds(*b->recv_cq, fds));
  for (const UniqueFd& fd : fds) {
    if (!fd.valid()) return error(EMFILE, "direct offer: duplicating a descriptor");
  }
  resp.recv_ring_entries = b->own_recv->size;
  resp.peer_qpn = b->attr.dest_qp_num;
  resp.my_lid = b->guest->lid;
  if (b->srq) {
    feed_srq(*b->srq);  // its library takes receives from it from now on
    if (lock_tag) *lock_tag = rx_lock_tag(s);
  }
  VLOG_INFO("direct offer: guest {} QP {:#x} takes QP {:#x} of backend {} on port {}",
            b->guest->name, b->qpn, b->attr.dest_qp_num, b->peer_node, req.port);
  return resp;
}

bool Device::send_offer(const Qp& b) {
  wire::DirectOffer o{};
  fill_route(o, b);
  o.port = b.offer_port;
  o.src_qpn = b.qpn;
  o.dst_qpn = b.attr.dest_qp_num;
  std::memcpy(o.token, b.offer_token, kDirectTokenBytes);
  return transport_->send(b.peer_node, wire::Type::kDirectOffer, &o);
}

void Device::carry_offer(Qp& b, const std::string& was_node) {
  if (!b.offered || !b.remote || !transport_ || b.peer_node == was_node) return;
  // Going back to the backends (asked, or answered): the offer ends, its library makes another.
  if (b.sq_hdr->direct_revoke.load(std::memory_order_acquire) != 0) return;
  // The peer's library dials the address its backend knows ours by, which our library listens
  // on only if it is the one it listened on for the old node (one per address and process).
  if (transport_->local_ipv4(b.peer_node) != b.offer_ipv4 || !send_offer(b)) {
    VLOG_INFO(
        "direct offer: guest {} QP {:#x}: not carried to backend {} (its library listens "
        "on another address, or no connection); the pair stays on the backends",
        b.guest->name, b.qpn, b.peer_node);
    return;
  }
  VLOG_INFO("direct offer: guest {} QP {:#x}: sent again to backend {}, where its peer moved",
            b.guest->name, b.qpn, b.peer_node);
}

void Device::on_direct_offer(const std::string& node, const wire::DirectOffer& o) {
  Guest* g = nullptr;
  if (o.is_global) {
    g = guest_by_gid(o.dgid);
  } else if (auto it = guests_by_lid_.find(o.dlid); it != guests_by_lid_.end()) {
    g = it->second;
  }
  if (!g) {
    VLOG_WARN("direct offer from {} for QP {:#x} of an unknown guest ({}); dropped", node,
              o.dst_qpn, o.is_global ? "by GID" : fmt::format("LID {:#x}", o.dlid));
    return;
  }
  // Kept only for a QP that exists: its reset or destruction erases the offer again.
  auto q = g->qps.find(o.dst_qpn);
  if (q == g->qps.end() || !direct_remote_type(q->second->type)) {
    VLOG_WARN("direct offer from {} for guest {}: no RC or UC QP {:#x}; dropped", node, g->name,
              o.dst_qpn);
    return;
  }
  RemoteOffer& r = g->direct_offers[o.dst_qpn];  // a later offer replaces an earlier one
  r.node = node;
  r.slid = o.slid;
  std::memcpy(r.sgid, o.sgid, 16);
  r.src_qpn = o.src_qpn;
  r.port = o.port;
  r.ipv4 = transport_ ? transport_->peer_ipv4(node) : 0;
  std::memcpy(r.token, o.token, kDirectTokenBytes);
  note_direct_change(*g);
  VLOG_DEBUG("direct offer from {}: QP {:#x} -> guest {} QP {:#x}, port {}", node, o.src_qpn,
             g->name, o.dst_qpn, o.port);
}

Result<DirectRemoteResp> Device::direct_remote(Session& s, uint32_t handle,
                                               std::vector<UniqueFd>& fds, uint32_t flags) {
  if (!direct_remote_)
    return error(EOPNOTSUPP, "the direct path across backends is off ([datapath] direct_remote)");
  Qp* a = find_qp(s, handle);
  if (!a) return error(EINVAL, fmt::format("no QP {}", handle));
  if (!direct_remote_type(a->type)) return error(EOPNOTSUPP, "direct remote: RC and UC QPs only");
  if (flags & ~kDirectRemoteNotify) return error(EINVAL, "direct remote: unknown flags");
  const bool notify = a->send_cq->channel != kNone;
  if (notify && !(flags & kDirectRemoteNotify))
    return error(EOPNOTSUPP, "direct remote: the send CQ has a completion channel");
  if (a->state != IBV_QPS_RTS) return error(EAGAIN, "direct remote: QP not in RTS");
  if (a->route_pending) return error(EAGAIN, "direct remote: destination not located yet");
  if (!a->remote) return error(EOPNOTSUPP, "direct remote: peer on this backend");
  if (a->sq_hdr->direct_revoke.load(std::memory_order_acquire) == kRevokeAsk)
    return error(EAGAIN, "direct remote: the QP is leaving the direct path");
  if (direct_held(*a->guest))
    return error(EAGAIN, "direct remote: the guest is leaving the direct path (a move)");
  if (a->sq_cons != a->sq_hdr->producer.load(std::memory_order_acquire) || !a->unacked.empty() ||
      a->wait != Wait::kNone)
    return error(EAGAIN, "direct remote: work in flight");
  auto it = a->guest->direct_offers.find(a->qpn);
  if (it == a->guest->direct_offers.end())
    return error(EAGAIN, "direct remote: the peer's library has not offered yet");
  const RemoteOffer& o = it->second;
  const bool from_peer =
      o.src_qpn == a->attr.dest_qp_num && o.node == a->peer_node &&
      (a->attr.is_global ? std::memcmp(o.sgid, a->attr.dgid, 16) == 0 : o.slid == a->attr.dlid);
  if (!from_peer) return error(EAGAIN, "direct remote: the offer is not from this QP's peer");
  if (o.ipv4 == 0) return error(EAGAIN, "direct remote: the peer backend's address is unknown");

  RETURN_IF_ERROR(give_own_send(*a));
  fds.clear();
  fds.push_back(dup_fd(a->own_send->ring_fd.get()));
  if (notify) RETURN_IF_ERROR(add_notify_fds(*a->send_cq, fds));
  for (const UniqueFd& fd : fds) {
    if (!fd.valid()) return error(EMFILE, "direct remote: duplicating a descriptor");
  }
  DirectRemoteResp resp{};
  resp.send_ring_entries = a->own_send->size;
  resp.peer_qpn = o.src_qpn;
  resp.my_lid = a->guest->lid;
  resp.peer_ipv4 = o.ipv4;
  resp.peer_port = o.port;
  std::memcpy(resp.token, o.token, kDirectTokenBytes);
  std::memcpy(a->used_offer_token, o.token, kDirectTokenBytes);
  a->direct = true;
  a->direct_remote = true;
  char ip[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &o.ipv4, ip, sizeof(ip));
  VLOG_INFO("direct path: guest {} QP {:#x} -> QP {:#x} of backend {} (library at {}:{})",
            a->guest->name, a->qpn, o.src_qpn, o.node, ip, o.port);
  return resp;
}

// ---- leaving the direct path across backends (before a move) ----

bool Device::revoke_holds(Qp& qp) {
  const uint32_t w = qp.sq_hdr->direct_revoke.load(std::memory_order_acquire);
  if (w == kRevokeAsk) return true;
  if (w != kRevokeDone) return false;
  // The library's answer: nothing of the pair is between the libraries any more, and what it
  // posted since it was asked waits in the send queue, after everything it executed itself.
  // Its library may go direct again from here (a new offer, a new kDirectRemote): the peer's
  // offer it used ended with the connection, but one its peer's library made since (it went
  // back first, and offered again) is kept.
  qp.direct_remote = false;
  qp.offered = false;
  qp.direct = false;
  auto& offers = qp.guest->direct_offers;
  if (auto it = offers.find(qp.qpn);
      it != offers.end() &&
      std::memcmp(it->second.token, qp.used_offer_token, kDirectTokenBytes) == 0)
    offers.erase(it);
  qp.sq_hdr->direct_revoke.store(0, std::memory_order_release);
  note_direct_change(*qp.guest);
  VLOG_INFO("direct path: guest {} QP {:#x} is on the backends again", qp.guest->name, qp.qpn);
  return false;
}

void Device::note_direct_change(const Guest& g) {
  if (track_direct_ &&
      std::find(direct_changed_.begin(), direct_changed_.end(), g.name) == direct_changed_.end())
    direct_changed_.push_back(g.name);
}

Status Device::leave_direct_remote(const std::string& name) {
  auto git = guests_.find(name);
  if (git == guests_.end()) return error(ENOENT, fmt::format("no guest {} on this backend", name));
  size_t asked = 0;
  for (Qp* qp : git->second->active) {
    if (!(qp->direct_remote || qp->offered)) continue;
    revoke_holds(*qp);  // takes an answer that came since the last look
    if (!(qp->direct_remote || qp->offered)) continue;
    // Asked (unless it is already): its library answers from its hub's next tick.
    uint32_t none = 0;
    qp->sq_hdr->direct_revoke.compare_exchange_strong(none, kRevokeAsk, std::memory_order_seq_cst);
    ++asked;
  }
  // Until every QP has answered, none goes direct again (a library whose answer the backend
  // took may offer or ask again at once); the export follows the ask that finds them settled.
  git->second->direct_held_until_ns = asked ? mono_ns() + kDirectHoldNs : 0;
  if (asked)
    return error(EINPROGRESS,
                 fmt::format("guest {}: {} QPs are leaving the direct path across backends (their "
                             "libraries settle what is in flight); ask again",
                             name, asked));
  return Status::ok();
}

}  // namespace vrdma::engine
