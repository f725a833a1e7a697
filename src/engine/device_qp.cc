// Control path of the device model: completion channels, CQs, QPs (create, modify, query,
// destroy) and SRQs.
#include "engine/device.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <iterator>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "common/guest_fault.h"
#include "common/identity.h"
#include "common/log.h"
#include "common/memfd.h"
#include "engine/datapath_util.h"
#include "engine/qp_state.h"
#include "proto/device_caps.h"
#include "proto/wire.h"

namespace vrdma::engine {

using namespace vrdma::proto;

Result<uint32_t> Device::create_channel(Session& s, UniqueFd& read_end) {
  if (s.channels.size() >= kMaxChannels) return error(EMFILE, "channel limit reached");
  int p[2];
  if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) < 0) return error(errno, "pipe2");
  read_end = UniqueFd(p[0]);
  // The guest may set O_NONBLOCK on its end itself; ours stays non-blocking so a guest that
  // never reads cannot stall the engine.
  ::fcntl(p[0], F_SETFL, 0);
  uint32_t h = new_handle(s, s.channels);
  Channel& c = s.channels[h];
  c.handle = h;
  c.write_end = UniqueFd(p[1]);
  return h;
}

Status Device::destroy_channel(Session& s, uint32_t handle) {
  auto it = s.channels.find(handle);
  if (it == s.channels.end()) return error(EINVAL, fmt::format("no channel {}", handle));
  if (it->second.users) return error(EBUSY, "channel still has CQs");
  s.channels.erase(it);
  return Status::ok();
}

Result<CreateCqResp> Device::create_cq(Session& s, const CreateCqReq& req, UniqueFd& ring) {
  return refused(s, "create_cq", create_cq_checked(s, req, ring));
}

Result<CreateCqResp> Device::create_cq_checked(Session& s, const CreateCqReq& req, UniqueFd& ring) {
  if (req.cqe == 0 || req.cqe > kMaxCqe)
    return error(EINVAL, fmt::format("cqe {} outside 1..{}", req.cqe, kMaxCqe));
  if (s.cqs.size() >= kMaxCq) return error(ENOMEM, "CQ limit reached");
  RETURN_IF_ERROR(check_depth(*s.guest, "CQ", req.cqe));
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kCq));
  Channel* ch = nullptr;
  if (req.channel != kNone) {
    auto it = s.channels.find(req.channel);
    if (it == s.channels.end()) return error(EINVAL, fmt::format("no channel {}", req.channel));
    ch = &it->second;
  }
  if (req.stamps & ~kStampAll) return error(EINVAL, fmt::format("stamps {:#x}", req.stamps));
  auto cq = std::make_unique<Cq>();
  cq->size = std::bit_ceil(req.cqe + 1);
  cq->stamps = req.stamps;
  RETURN_IF_ERROR(make_cq_ring(*cq, "vrdma-cq"));
  ring = dup_fd(cq->ring_fd.get());
  if (!ring.valid()) return error(errno, "dup of the CQ ring's memfd");
  charge(*s.guest, Res::kCq);
  cq->owner = &s;
  cq->handle = new_handle(s, s.cqs);
  if (ch) {
    cq->channel = ch->handle;
    ch->users++;
  }
  CreateCqResp resp{cq->handle, cq->size - 1, cq->ring.size()};
  s.cqs[cq->handle] = std::move(cq);
  return resp;
}

Status Device::destroy_cq(Session& s, uint32_t handle) {
  auto it = s.cqs.find(handle);
  if (it == s.cqs.end()) return error(EINVAL, fmt::format("no CQ {}", handle));
  if (it->second->users) return error(EBUSY, "CQ still used by a QP");
  if (it->second->channel != kNone) s.channels[it->second->channel].users--;
  s.cqs.erase(it);
  release(*s.guest, Res::kCq);
  return Status::ok();
}

Result<CreateCqResp> Device::resize_cq(Session& s, const ResizeCqReq& req, UniqueFd& ring) {
  return refused(s, "resize_cq", resize_cq_checked(s, req, ring));
}

Result<CreateCqResp> Device::resize_cq_checked(Session& s, const ResizeCqReq& req, UniqueFd& ring) {
  auto it = s.cqs.find(req.handle);
  if (it == s.cqs.end()) return error(EINVAL, fmt::format("no CQ {}", req.handle));
  Cq& cq = *it->second;
  if (req.cqe == 0 || req.cqe > kMaxCqe)
    return error(EINVAL, fmt::format("cqe {} outside 1..{}", req.cqe, kMaxCqe));
  // The library published its consumer cursor before asking, and polls nothing meanwhile.
  const uint32_t cons = cq.hdr->consumer.load(std::memory_order_acquire);
  const uint32_t held = cq.prod - cons;
  if (held > cq.size) return error(EINVAL, "the CQ's consumer index is corrupt");
  // Completions of this CQ waiting in its QPs' own rings (direct path) are outstanding too;
  // a resize leaves those rings alone. Their cursors are the guest's: each is capped.
  uint64_t outstanding = held;
  for (const auto& [h, qp] : s.qps) {
    for (const Cq* own : {qp->send_cq == &cq ? qp->own_send.get() : nullptr,
                          qp->recv_cq == &cq ? qp->own_recv.get() : nullptr}) {
      if (own)
        outstanding += std::min(own->hdr->producer.load(std::memory_order_acquire) -
                                    own->hdr->consumer.load(std::memory_order_acquire),
                                own->size);
    }
  }
  if (req.cqe < outstanding)
    return error(EINVAL,
                 fmt::format("cqe {} below the {} completions it holds", req.cqe, outstanding));
  RETURN_IF_ERROR(check_depth(*s.guest, "CQ", req.cqe));
  Cq fresh;
  fresh.size = std::bit_ceil(req.cqe + 1);
  fresh.stamps = cq.stamps;
  RETURN_IF_ERROR(make_cq_ring(fresh, "vrdma-cq"));
  const uint32_t size = fresh.size;
  // Same free-running cursors, so the library's own consumer cursor stays valid; completions
  // keep their order (and their stamps).
  for (uint32_t i = cons; i != cq.prod; ++i) {
    fresh.entries[i & (size - 1)] = cq.entries[i & (cq.size - 1)];
    if (cq.stamp) fresh.stamp[i & (size - 1)] = cq.stamp[i & (cq.size - 1)];
  }
  RingHeader* hdr = fresh.hdr;
  hdr->direct_gen.store(cq.hdr->direct_gen.load(std::memory_order_relaxed));
  hdr->armed.store(cq.hdr->armed.load(std::memory_order_acquire));
  hdr->consumer.store(cons, std::memory_order_relaxed);
  hdr->producer.store(cq.prod, std::memory_order_release);
  ring = dup_fd(fresh.ring_fd.get());
  if (!ring.valid()) return error(errno, "dup of the CQ ring's memfd");
  if (cq.channel != kNone && s.guest->epoch.valid()) {
    // Direct peers fire this CQ's channel through the old ring's `armed` word until their
    // grants end: leave it armed (an extra event rather than a lost one) and end the grants.
    cq.hdr->armed.store(1, std::memory_order_seq_cst);
    bump_epoch(*s.guest);
  }
  cq.ring = std::move(fresh.ring);
  cq.ring_fd = std::move(fresh.ring_fd);
  cq.size = size;
  cq.attach();
  cq.overrun = false;
  return CreateCqResp{cq.handle, size - 1, cq.ring.size()};
}

Result<CreateQpResp> Device::create_qp(Session& s, const CreateQpReq& req, UniqueFd& ring) {
  return refused(s, "create_qp", create_qp_checked(s, req, ring));
}

Result<CreateQpResp> Device::create_qp_checked(Session& s, const CreateQpReq& req, UniqueFd& ring) {
  if (req.qp_type == IBV_QPT_XRC_RECV) return create_xrc_recv_qp(s, req);  // no PD, CQs, rings
  auto pd = s.pds.find(req.pd);
  if (pd == s.pds.end()) return error(EINVAL, fmt::format("no PD {}", req.pd));
  auto scq = s.cqs.find(req.send_cq), rcq = s.cqs.find(req.recv_cq);
  if (scq == s.cqs.end() || rcq == s.cqs.end()) return error(EINVAL, "no such CQ");
  Srq* srq = nullptr;
  if (req.srq != kNone) {
    auto it = s.srqs.find(req.srq);
    if (it == s.srqs.end()) return error(EINVAL, fmt::format("no SRQ {}", req.srq));
    srq = it->second.get();
  }
  if (req.qp_type != IBV_QPT_RC && req.qp_type != IBV_QPT_UC && req.qp_type != IBV_QPT_UD &&
      req.qp_type != IBV_QPT_XRC_SEND)
    return error(EOPNOTSUPP, fmt::format("QP type {} is not supported", req.qp_type));
  if (req.qp_type == IBV_QPT_XRC_SEND && srq) return error(EINVAL, "an XRC_SEND QP has no SRQ");
  QpCaps c = req.caps;
  if (req.qp_type == IBV_QPT_XRC_SEND) {  // a send queue only (ibv_create_qp_ex(3))
    c.max_recv_wr = 0;
    c.max_recv_sge = 0;
  }
  if (srq) {  // receives come from the SRQ: the QP's own receive queue is unused (ignored caps)
    c.max_recv_wr = 0;
    c.max_recv_sge = 0;
  }
  // 0 work requests is valid: a QP that only sends or only receives (qperf's one-way tests).
  // Its ring keeps one slot, which the library never posts to (ENOMEM, as on hardware).
  RETURN_IF_ERROR(check_caps({{"max_send_wr", c.max_send_wr, kMaxQpWr},
                              {"max_recv_wr", c.max_recv_wr, kMaxQpWr},
                              {"max_send_sge", c.max_send_sge, kMaxSge},
                              {"max_recv_sge", c.max_recv_sge, kMaxSge},
                              {"max_inline_data", c.max_inline_data, kMaxInline}}));
  RETURN_IF_ERROR(check_depth(*s.guest, "send queue", c.max_send_wr));
  RETURN_IF_ERROR(check_depth(*s.guest, "receive queue", c.max_recv_wr));
  ASSIGN_OR_RETURN(const uint32_t qpn, new_qpn(*s.guest));
  Guest& g = *s.guest;

  auto qp = std::make_unique<Qp>();
  qp->sq_size = std::bit_ceil(std::max<uint32_t>(c.max_send_wr, 1));
  qp->rq_size = std::bit_ceil(std::max<uint32_t>(c.max_recv_wr, 1));
  size_t sq_bytes = page_round(ring_bytes(qp->sq_size, sizeof(SendWqe)));
  size_t rq_bytes = page_round(ring_bytes(qp->rq_size, sizeof(RecvWqe)));
  ASSIGN_OR_RETURN(ring, make_sealed_memfd("vrdma-qp", sq_bytes + rq_bytes));
  qp->ring = MappedRegion::map_shared(ring.get(), sq_bytes + rq_bytes);
  if (!qp->ring.valid()) return error(errno, "mapping QP rings");
  qp->ring_fd = dup_fd(ring.get());
  charge(g, Res::kQp);
  qp->sq_hdr = reinterpret_cast<RingHeader*>(qp->ring.data());
  qp->rq_hdr = reinterpret_cast<RingHeader*>(qp->ring.data() + sq_bytes);
  init_ring(qp->sq_hdr, RingKind::kSq, sizeof(SendWqe), qp->sq_size);
  init_ring(qp->rq_hdr, RingKind::kRq, sizeof(RecvWqe), qp->rq_size);
  qp->sq = ring_entries<SendWqe>(qp->sq_hdr);
  qp->rq = ring_entries<RecvWqe>(qp->rq_hdr);
  qp->handle = new_handle(s, s.qps);
  qp->qpn = qpn;
  qp->owner = &s;
  qp->guest = &g;
  qp->type = static_cast<ibv_qp_type>(req.qp_type);
  qp->pd = req.pd;
  qp->send_cq = scq->second.get();
  qp->recv_cq = rcq->second.get();
  qp->srq = srq;
  if (srq) srq->users++;
  qp->sq_sig_all = req.sq_sig_all != 0;
  qp->caps = c;
  // Report what the rings really hold (none for a queue of 0: its slot is never posted to).
  qp->caps.max_send_wr = c.max_send_wr ? qp->sq_size : 0;
  qp->caps.max_recv_wr = c.max_recv_wr ? qp->rq_size : 0;
  qp->caps.max_send_sge = std::max<uint32_t>(c.max_send_sge, 1);
  qp->caps.max_recv_sge = std::max<uint32_t>(c.max_recv_sge, 1);
  // Every send WQE has kMaxInline bytes of room for inline data whatever was asked: report it,
  // as hardware reports its WQE's room (programs count on it: rdma_xclient posts inline on a QP
  // made with max_inline_data 0). A queue that cannot send has none.
  qp->caps.max_inline_data = c.max_send_wr ? kMaxInline : 0;
  qp->attr.qp_state = IBV_QPS_RESET;
  qp->attr.port_num = 1;
  qp->attr.path_mtu = IBV_MTU_4096;
  pd->second.users++;
  qp->send_cq->users++;
  qp->recv_cq->users++;
  CreateQpResp resp{qp->handle, qpn, qp->caps, sq_bytes + rq_bytes, sq_bytes};
  qp->flow = next_flow_++;
  g.qps[qpn] = qp.get();
  active_.push_back(qp.get());
  if (g.active.empty()) active_guests_.push_back(&g);
  g.active.push_back(qp.get());
  s.qp_slots.emplace(qp->handle % kReadySlots, qp.get());
  s.qps[qp->handle] = std::move(qp);
  return resp;
}

Result<uint32_t> Device::new_qpn(Guest& g) {
  RETURN_IF_ERROR(check_quota(g, Res::kQp));
  size_t nqp = 0;
  for (auto& [id, ss] : sessions_) nqp += ss->qps.size();
  for (auto& [name, gg] : guests_) nqp += gg->xrc_qps.size();  // the guests' XRC receive QPs
  if (nqp >= kMaxQp) return error(ENOMEM, "QP limit reached");
  uint32_t qpn;
  do {
    qpn = g.next_qpn++ & 0xffffff;
  } while (qpn < 0x11 || g.qps.count(qpn));
  return qpn;
}

Qp* Device::find_qp(Session& s, uint32_t handle) {
  auto it = s.qps.find(handle);
  if (it != s.qps.end()) return it->second.get();
  auto x = s.xrc_qps.find(handle);
  if (x == s.xrc_qps.end()) return nullptr;
  auto q = s.guest->xrc_qps.find(x->second);
  return q == s.guest->xrc_qps.end() ? nullptr : q->second.get();
}

Status Device::modify_qp(Session& s, const ModifyQpReq& req) {
  return refused(s, "modify_qp", modify_qp_checked(s, req));
}

Status Device::modify_qp_checked(Session& s, const ModifyQpReq& req) {
  Qp* qp = find_qp(s, req.handle);
  if (!qp) return error(EINVAL, fmt::format("no QP {}", req.handle));
  bump_epoch(*s.guest);
  const QpAttr& a = req.attr;
  const uint32_t m = modify_mask(qp->type, req.mask);
  // Range-check before the cast: an ibv_qp_state outside the enum's values is undefined
  // behaviour (found by fuzz_ring).
  if ((m & IBV_QP_STATE) && a.qp_state > IBV_QPS_ERR)
    return error(EINVAL, fmt::format("unknown QP state {}", a.qp_state));
  const auto next = (m & IBV_QP_STATE) ? static_cast<ibv_qp_state>(a.qp_state) : qp->state;
  if ((m & IBV_QP_CUR_STATE) && a.cur_qp_state != static_cast<uint32_t>(qp->state))
    return error(EINVAL, "cur_qp_state does not match the QP's state");
  RETURN_IF_ERROR(check_modify_qp(qp->type, qp->state, next, m));
  if ((m & IBV_QP_PORT) && a.port_num != 1) return error(EINVAL, "port_num must be 1");
  if ((m & IBV_QP_PKEY_INDEX) && a.pkey_index != 0) return error(EINVAL, "pkey_index must be 0");
  if ((m & IBV_QP_PATH_MTU) && (a.path_mtu < IBV_MTU_256 || a.path_mtu > kPortMaxMtu))
    return error(EINVAL, "path_mtu out of range");
  if ((m & IBV_QP_AV) && a.ah_port_num > 1) return error(EINVAL, "AV port_num must be 1");
  if ((m & IBV_QP_ACCESS_FLAGS) && (a.qp_access_flags & ~kQpAccessAccepted))
    return error(EINVAL, fmt::format("qp_access_flags {:#x}: unknown bits {:#x}", a.qp_access_flags,
                                     a.qp_access_flags & ~kQpAccessAccepted));
  if ((m & IBV_QP_MAX_QP_RD_ATOMIC) && a.max_rd_atomic > kMaxRdAtomic) return error(EINVAL, "max_rd_atomic");
  if ((m & IBV_QP_MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic > kMaxRdAtomic)
    return error(EINVAL, "max_dest_rd_atomic");
  if ((m & IBV_QP_MIN_RNR_TIMER) && a.min_rnr_timer > 31) return error(EINVAL, "min_rnr_timer");
  if ((m & IBV_QP_TIMEOUT) && a.timeout > 31) return error(EINVAL, "timeout");
  if ((m & IBV_QP_RETRY_CNT) && a.retry_cnt > 7) return error(EINVAL, "retry_cnt");
  if ((m & IBV_QP_RNR_RETRY) && a.rnr_retry > 7) return error(EINVAL, "rnr_retry");

  QpAttr& q = qp->attr;
  if (m & IBV_QP_ACCESS_FLAGS) q.qp_access_flags = a.qp_access_flags;
  if (m & IBV_QP_PKEY_INDEX) q.pkey_index = a.pkey_index;
  if (m & IBV_QP_PORT) q.port_num = a.port_num;
  if (m & IBV_QP_QKEY) q.qkey = a.qkey;
  if (m & IBV_QP_AV) {
    q.dlid = a.dlid;
    q.sl = a.sl;
    q.src_path_bits = a.src_path_bits;
    q.static_rate = a.static_rate;
    q.is_global = a.is_global;
    q.ah_port_num = a.ah_port_num;
    q.sgid_index = a.sgid_index;
    q.hop_limit = a.hop_limit;
    q.traffic_class = a.traffic_class;
    q.flow_label = a.flow_label;
    std::memcpy(q.dgid, a.dgid, 16);
  }
  if (m & IBV_QP_PATH_MTU) q.path_mtu = a.path_mtu;
  if (m & IBV_QP_TIMEOUT) q.timeout = a.timeout;
  if (m & IBV_QP_RETRY_CNT) q.retry_cnt = a.retry_cnt;
  if (m & IBV_QP_RNR_RETRY) q.rnr_retry = a.rnr_retry;
  if (m & IBV_QP_RQ_PSN) q.rq_psn = qp->expected_psn = a.rq_psn & 0xffffff;
  if (m & IBV_QP_SQ_PSN) q.sq_psn = qp->next_psn = a.sq_psn & 0xffffff;
  if (m & (IBV_QP_RQ_PSN | IBV_QP_SQ_PSN)) publish_psns(*qp);
  if (m & IBV_QP_MAX_QP_RD_ATOMIC) q.max_rd_atomic = a.max_rd_atomic;
  if (m & IBV_QP_MAX_DEST_RD_ATOMIC) q.max_dest_rd_atomic = a.max_dest_rd_atomic;
  if (m & IBV_QP_MIN_RNR_TIMER) q.min_rnr_timer = a.min_rnr_timer;
  if (m & IBV_QP_DEST_QPN) q.dest_qp_num = a.dest_qp_num & 0xffffff;
  if (m & IBV_QP_EN_SQD_ASYNC_NOTIFY) q.en_sqd_async_notify = a.en_sqd_async_notify;
  if (m & IBV_QP_STATE) {
    ibv_qp_state prev = qp->state;
    qp->state = next;
    q.qp_state = next;
    // Connecting: the destination decides the transport (a local guest or a peer's).
    if (next == IBV_QPS_RTR && prev != IBV_QPS_RTR) choose_route(*qp);
    if (next == IBV_QPS_RTS) {
      qp->retry_left = q.retry_cnt;
      qp->rnr_left = q.rnr_retry;
    }
    if (next == IBV_QPS_ERR || next == IBV_QPS_RESET) take_back(*qp);
    if (next == IBV_QPS_RESET && qp->type == IBV_QPT_XRC_RECV) {
      qp->srq = nullptr;  // no queues of its own to discard
      qp->recv_cq = nullptr;
    } else if (next == IBV_QPS_RESET) {
      // RESET discards all outstanding work without completions.
      qp->unacked.clear();
      qp->sq_cons = qp->sq_hdr->producer.load(std::memory_order_acquire);
      qp->rq_cons = qp->rq_hdr->producer.load(std::memory_order_acquire);
      qp->sq_hdr->consumer.store(qp->sq_cons, std::memory_order_release);
      qp->rq_hdr->consumer.store(qp->rq_cons, std::memory_order_release);
      qp->sq_hdr->retired.store(qp->sq_cons, std::memory_order_release);
      qp->sq_sent = qp->sq_cons;
      // A direct connection across backends ends with it: its peer's offer was for this
      // connection, and the backend executes its send queue again.
      qp->direct_remote = false;
      qp->offered = false;
      qp->sq_hdr->direct_revoke.store(0, std::memory_order_release);
      qp->replay_known = false;
      qp->direct = false;
      s.guest->direct_offers.erase(qp->qpn);
    }
    // Leaving RTS (to ERR, RESET, SQD) or entering it ends any retry wait: in ERR the head WQE
    // is flushed, and a pending deadline must not keep the backend from sleeping.
    if (next != prev) {
      qp->wait = Wait::kNone;
      qp->rx_busy_since_ns = 0;
      qp->probe = false;
    }
    VLOG_DEBUG("qp {:#x} (guest {}): {} -> {}", qp->qpn, s.guest->name, qp_state_name(prev),
               qp_state_name(next));
  }
  mark_ready(*qp);  // a new state may give its queues work (RTS: WQEs posted before; ERR: flush)
  return Status::ok();
}

Result<QueryQpResp> Device::query_qp(Session& s, uint32_t handle) {
  Qp* qp = find_qp(s, handle);
  if (!qp) return error(EINVAL, fmt::format("no QP {}", handle));
  QueryQpResp r{};
  r.attr = qp->attr;
  r.attr.qp_state = qp->state;
  r.attr.cur_qp_state = qp->state;
  r.caps = qp->caps;
  return r;
}

void Device::fail_peers(const Session& s) {
  if (s.qps.empty()) return;
  std::vector<Session*> owed;
  for (Guest* g : active_guests_) {
    for (Qp* peer : g->active) {
      if (peer->owner == &s || peer->type == IBV_QPT_UD || peer->remote) continue;
      if (peer->state != IBV_QPS_RTR && peer->state != IBV_QPS_RTS && peer->state != IBV_QPS_SQD)
        continue;
      const Qp* to = lookup_remote(*peer);
      if (!to || to->owner != &s) continue;
      enter_error(*peer, "its connected peer's session ended");
      post_async(*peer->owner, IBV_EVENT_QP_FATAL, peer->handle);
      if (std::find(owed.begin(), owed.end(), peer->owner) == owed.end())
        owed.push_back(peer->owner);
    }
  }
  // A direct peer's library that died inside fire() took the CQ's arm and wrote no event: the
  // peer's waiter would sleep beside the completions it wrote (and the flushes above).
  for (Session* p : owed) fire_owed_events(*p);
}

void Device::destroy_qp_now(Session& s, Qp& qp) {
  Guest& g = *qp.guest;
  bump_epoch(g);
  take_back(qp);
  mcast_forget(qp);
  g.retired += counters_of(qp);
  g.qps.erase(qp.qpn);
  g.direct_offers.erase(qp.qpn);
  // Found and erased, not std::remove'd: a destroy costs a scan up to it and a memmove, not a
  // pass over every QP (10,000 destroys, BENCHMARKS.md "QPs on one backend").
  auto erase_one = [&qp](std::vector<Qp*>& v) {
    if (auto it = std::find(v.begin(), v.end(), &qp); it != v.end()) v.erase(it);
  };
  erase_one(active_);
  erase_one(g.active);
  if (qp.ready) erase_one(g.ready);
  for (auto [it, end] = s.qp_slots.equal_range(qp.handle % kReadySlots); it != end; ++it) {
    if (it->second == &qp) {
      s.qp_slots.erase(it);
      break;
    }
  }
  if (g.active.empty()) {
    active_guests_.erase(std::remove(active_guests_.begin(), active_guests_.end(), &g),
                         active_guests_.end());
  }
  // Type 2 windows bound through it are reachable through nothing now: they are invalidated,
  // or they would hold their MR (dereg_mr is EBUSY while bound) until deallocated.
  for (auto& [h, mw] : s.mws)
    if (mw->type == IBV_MW_TYPE_2 && mw->bound && mw->qpn == qp.qpn) mw->bound = false;
  release(g, Res::kQp);
  s.pds[qp.pd].users--;
  qp.send_cq->users--;
  qp.recv_cq->users--;
  if (qp.srq) qp.srq->users--;
  s.qps.erase(qp.handle);
}

Status Device::destroy_qp(Session& s, uint32_t handle) {
  if (s.xrc_qps.count(handle)) {  // an XRC receive QP: this session's handle on it goes
    close_xrc_qp(s, handle);
    return Status::ok();
  }
  Qp* qp = find_qp(s, handle);
  if (!qp) return error(EINVAL, fmt::format("no QP {}", handle));
  destroy_qp_now(s, *qp);
  return Status::ok();
}

Result<CreateSrqResp> Device::create_srq(Session& s, const CreateSrqReq& req, UniqueFd& ring) {
  return refused(s, "create_srq", create_srq_checked(s, req, ring));
}

Result<CreateSrqResp> Device::create_srq_checked(Session& s, const CreateSrqReq& req,
                                                 UniqueFd& ring) {
  auto pd = s.pds.find(req.pd);
  if (pd == s.pds.end()) return error(EINVAL, fmt::format("no PD {}", req.pd));
  const SrqAttr& a = req.attr;
  // An SRQ of 0 receives could never be used (rxe refuses it too); 0 SGEs means 1, as for QPs.
  if (a.max_wr == 0) return error(EINVAL, "max_wr = 0: an SRQ holds at least one receive");
  RETURN_IF_ERROR(check_caps({{"max_wr", a.max_wr, kMaxQpWr}, {"max_sge", a.max_sge, kMaxSge}}));
  if (a.srq_limit > a.max_wr)
    return error(EINVAL, fmt::format("srq_limit {} above max_wr {}", a.srq_limit, a.max_wr));
  if (s.srqs.size() >= kMaxSrq) return error(ENOMEM, "SRQ limit reached");
  RETURN_IF_ERROR(check_depth(*s.guest, "SRQ", a.max_wr));
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kSrq));
  auto srq = std::make_unique<Srq>();
  srq->size = std::bit_ceil(a.max_wr);
  const size_t bytes = page_round(ring_bytes(srq->size, sizeof(RecvWqe)));
  ASSIGN_OR_RETURN(ring, make_sealed_memfd("vrdma-srq", bytes));
  srq->ring = MappedRegion::map_shared(ring.get(), bytes);
  if (!srq->ring.valid()) return error(errno, "mapping SRQ ring");
  srq->ring_fd = dup_fd(ring.get());
  charge(*s.guest, Res::kSrq);
  srq->hdr = reinterpret_cast<RingHeader*>(srq->ring.data());
  init_ring(srq->hdr, RingKind::kRq, sizeof(RecvWqe), srq->size);
  srq->entries = ring_entries<RecvWqe>(srq->hdr);
  srq->handle = new_handle(s, s.srqs);
  srq->owner = &s;
  srq->pd = req.pd;
  srq->max_sge = std::max<uint32_t>(a.max_sge, 1);
  srq->limit = a.srq_limit;
  srq->hdr->srq_limit.store(srq->limit, std::memory_order_release);
  pd->second.users++;
  CreateSrqResp resp{srq->handle, 0, SrqAttr{srq->size, srq->max_sge, srq->limit, 0}, bytes};
  s.srqs[srq->handle] = std::move(srq);
  return resp;
}

Status Device::modify_srq(Session& s, const ModifySrqReq& req) {
  return refused(s, "modify_srq", modify_srq_checked(s, req));
}

Status Device::modify_srq_checked(Session& s, const ModifySrqReq& req) {
  auto it = s.srqs.find(req.handle);
  if (it == s.srqs.end()) return error(EINVAL, fmt::format("no SRQ {}", req.handle));
  if (req.mask & ~uint32_t{IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT}) return error(EINVAL, "SRQ attr mask");
  // Resizing is an optional capability (IBV_DEVICE_SRQ_RESIZE) the device does not have.
  if (req.mask & IBV_SRQ_MAX_WR) return error(EINVAL, "SRQ resize is not supported");
  if (req.mask & IBV_SRQ_LIMIT) {
    if (req.attr.srq_limit > it->second->size) return error(EINVAL, "srq_limit above max_wr");
    set_srq_limit(*it->second, req.attr.srq_limit);
  }
  return Status::ok();
}

Result<SrqAttr> Device::query_srq(Session& s, uint32_t handle) {
  auto it = s.srqs.find(handle);
  if (it == s.srqs.end()) return error(EINVAL, fmt::format("no SRQ {}", handle));
  const Srq& q = *it->second;
  return SrqAttr{q.size, q.max_sge, q.limit, 0};
}

Status Device::destroy_srq(Session& s, uint32_t handle) {
  auto it = s.srqs.find(handle);
  if (it == s.srqs.end()) return error(EINVAL, fmt::format("no SRQ {}", handle));
  if (it->second->users) return error(EBUSY, "SRQ still used by a QP");
  if (it->second->xrcd) unlink_xrc_srq(*it->second);
  s.pds[it->second->pd].users--;
  s.srqs.erase(it);
  release(*s.guest, Res::kSrq);
  return Status::ok();
}

}  // namespace vrdma::engine
