// The direct path for UD QPs (docs/ARCHITECTURE.md, "Direct path"): a grant per destination
// (the guest an address handle names and a QPN), made and ended as an RC QP's is. Unlike RC, a
// UD QP receives from anyone: several libraries and the backend may deliver into one receive
// side at once, so each holds the destination RQ header's `rx_lock` while it takes a receive
// and writes its completion. No syscall here but the rare grant; what cannot go direct (a wrong
// qkey, no receive posted, a receive too small, a lock held too long) goes to the send queue,
// and the backend executes it with the mediated path's outcome.
#include <algorithm>
#include <cstring>

#include "verbs/ah.h"
#include "verbs/direct.h"
#include "verbs/internal.h"

namespace vrdma::verbs {

using namespace vrdma::proto;

namespace {

/// Destinations a QP keeps grants (or refusals) for. Beyond them a destination stays mediated
/// until an entry without a grant can make room: evicting live grants round-robin would ask
/// the backend on every post.
constexpr size_t kMaxUdGrants = 32;

bool same_dest(const UdGrant& u, const UdDest& d, uint32_t qpn) {
  return u.qpn == qpn && u.dest.dlid == d.dlid && u.dest.is_global == d.is_global &&
         (!d.is_global || std::memcmp(u.dest.dgid, d.dgid, 16) == 0);
}

/// The destination's entry, made (and asked for) when there is none; null while refused.
UdGrant* grant_for(VQp& qp, const UdDest& dest, uint32_t qpn) {
  auto it = std::find_if(qp.ud_grants.begin(), qp.ud_grants.end(),
                         [&](const auto& u) { return same_dest(*u, dest, qpn); });
  if (it == qp.ud_grants.end()) {
    if (qp.ud_grants.size() == kMaxUdGrants) {
      auto idle = std::find_if(qp.ud_grants.begin(), qp.ud_grants.end(),
                               [](const auto& u) { return !u->grant && !u->asking.proof_failed; });
      if (idle == qp.ud_grants.end()) return nullptr;
      qp.ud_grants.erase(idle);
    }
    auto u = std::make_unique<UdGrant>();
    u->dest = dest;
    u->qpn = qpn;
    qp.ud_grants.push_back(std::move(u));
    it = qp.ud_grants.end() - 1;
  }
  UdGrant& u = **it;
  if (u.grant) return &u;
  if (u.asking.wait) {
    --u.asking.wait;
    return nullptr;
  }
  DirectUdReq req{qp.handle, qpn, dest};
  DirectGrantUdResp resp{};
  u.grant = ask_grant(
      qp, GrantAsk{Op::kDirectGrantUd, Op::kDirectPeerUd, Op::kDirectProveUd, &req, sizeof(req)},
      u.asking, &resp, sizeof(resp), resp.grant);
  if (!u.grant) return nullptr;
  u.peer_qkey = resp.peer_qkey;
  u.my_qkey = resp.my_qkey;
  u.lock_tag = resp.lock_tag;
  qp.granted.store(true, std::memory_order_release);
  return &u;
}

/// Steps the spans past their first `n` bytes; false if they hold fewer.
bool skip_bytes(MemSpan*& s, size_t& count, uint64_t n) {
  while (n && count) {
    const uint64_t k = std::min(n, s->n);
    s->p += k;
    s->n -= k;
    n -= k;
    if (s->n == 0) ++s, --count;
  }
  return n == 0;
}

/// Delivers one SEND into the destination, the rx_lock held: the receive WQE, the GRH's room
/// (filled when the address handle is global), the payload, the receive completion.
bool deliver_datagram(VContext& ctx, VQp& qp, UdGrant& u, const ibv_send_wr& wr,
                      const MemSpan* local, uint64_t len) {
  Grant& g = *u.grant;
  // Another sender may have taken receives since posted_receives() looked: the consumer index
  // again, under the lock; the producer's cached copy only moves forward, so it still holds.
  const uint32_t rcons = g.peer_rq_hdr->consumer.load(std::memory_order_acquire);
  uint32_t avail = g.peer_rq_seen - rcons;
  if (avail == 0 || avail > g.peer_rq_size)
    avail = (g.peer_rq_seen = g.peer_rq_hdr->producer.load(std::memory_order_acquire)) - rcons;
  if (avail == 0 || avail > g.peer_rq_size || !has_room(g.peer_recv)) return false;
  RecvWqe rwqe;
  MemSpan spans[kMaxDirectSpans];
  size_t nr = 0;
  uint64_t cap = 0;
  if (!take_recv_wqe(g, rcons, rwqe) || !recv_spans(g, rwqe, spans, nr, cap)) return false;
  if (cap < kGrhBytes + len) return false;  // the backend completes it with LOC_LEN_ERR
  const UdDest& d = u.dest;
  if (d.is_global) {
    uint8_t grh[kGrhBytes];
    fill_grh(grh, len, ctx.hello.gid, d.dgid);
    const MemSpan from{grh, kGrhBytes};
    copy_spans(&from, spans, kGrhBytes);
  }
  MemSpan* payload = spans;
  size_t left = nr;
  skip_bytes(payload, left, kGrhBytes);
  copy_spans(local, payload, len);
  g.peer_rq_hdr->consumer.store(rcons + 1, std::memory_order_release);
  // As the backend's deliver_ud writes it.
  Cqe rc{};
  rc.wr_id = rwqe.wr_id;
  rc.status = IBV_WC_SUCCESS;
  rc.opcode = IBV_WC_RECV;
  rc.byte_len = static_cast<uint32_t>(kGrhBytes + len);
  rc.wc_flags = d.is_global ? IBV_WC_GRH : 0;
  if (wr.opcode == IBV_WR_SEND_WITH_IMM) {
    rc.wc_flags |= IBV_WC_WITH_IMM;
    rc.imm_data = wr.imm_data;
  }
  rc.qp_num = g.peer_qpn;
  rc.src_qp = qp.qp.qp_num;
  rc.slid = static_cast<uint16_t>(g.my_lid);
  rc.sl = d.sl;
  push(g.peer_recv, rc);
  count(g.peer_recv, len);
  return true;
}

/// Executes one UD SEND straight into its destination; false (nothing done) when it must go to
/// the backend.
bool execute_ud(VContext& ctx, VQp& qp, UdGrant& u, const ibv_send_wr& wr) {
  if (wr.opcode != IBV_WR_SEND && wr.opcode != IBV_WR_SEND_WITH_IMM) return false;
  Grant& g = *u.grant;
  const bool signaled = qp.sig_all || (wr.send_flags & IBV_SEND_SIGNALED);
  if (signaled && !has_room(g.send)) return false;
  MemSpan local[kMaxSge];
  size_t nl = 0;
  uint64_t len = 0;
  if (local_sges(ctx, qp, wr, 0, local, nl, len) != IBV_WC_SUCCESS || len > kUdMaxMessage)
    return false;
  // The high bit of the WR's qkey says "use the QP's own qkey" (IB spec 10.2.5). A wrong one
  // drops the datagram: the backend does that, and counts it.
  const uint32_t qkey = (wr.wr.ud.remote_qkey & 0x80000000u) ? u.my_qkey : wr.wr.ud.remote_qkey;
  if (qkey != u.peer_qkey) return false;
  // Wait for a receive (the peer may be a little behind) before taking the lock: the backend
  // and other senders must not wait while we do.
  if (posted_receives(g, g.peer_rq_hdr->consumer.load(std::memory_order_acquire)) == 0)
    return false;
  if (!take_rx_lock(*g.peer_rq_hdr, u.lock_tag)) return false;
  const bool done = deliver_datagram(ctx, qp, u, wr, local, len);
  give_rx_lock(*g.peer_rq_hdr);
  if (!done) return false;
  fire(g.recv_notify, (wr.send_flags & IBV_SEND_SOLICITED) != 0);
  count(g.send, len);
  if (signaled) {
    Cqe e{};
    e.wr_id = wr.wr_id;
    e.status = IBV_WC_SUCCESS;
    e.opcode = IBV_WC_SEND;
    e.byte_len = static_cast<uint32_t>(len);
    e.qp_num = qp.qp.qp_num;
    push(g.send, e);
    fire(g.send_notify, false);
  }
  return true;
}

}  // namespace

void direct_post_ud(VQp& qp, ibv_send_wr*& wr) {
  VContext& ctx = *to_vctx(qp.qp.context);
  while (wr) {
    if (!wr->wr.ud.ah) return;  // the ring's loop refuses it
    UdGrant* u = grant_for(qp, to_vah(wr->wr.ud.ah)->dest, wr->wr.ud.remote_qpn);
    if (!u) return;
    if (!grant_still_good(*ctx.control_page(), *u->grant)) {
      u->grant.reset();  // the next post to it asks again
      return;
    }
    if (!execute_ud(ctx, qp, *u, *wr)) return;
    wr = wr->next;
  }
}

}  // namespace vrdma::verbs
