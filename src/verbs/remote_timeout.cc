// The direct path across backends: the requester's timers. What is in flight fails with
// IBV_WC_RETRY_EXC_ERR, as on a fabric, when the QP's retry budget (timeout, retry_cnt) runs
// out after the peer's library went (doom), or while the connection to it moves nothing
// (ack_tick: an outage; docs/ARCHITECTURE.md, "Reliability (RC)" under "Across backends").
// Never while TCP still delivers: a slow path or a slow peer only waits. And the responder's:
// the ACKs a poll left to ride on the application's next request (Hub::ack_timer).
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "common/log.h"
#include "verbs/internal.h"
#include "verbs/remote_impl.h"

namespace vrdma::verbs::dlink {

namespace {

/// How long a fabric would retry before RETRY_EXC_ERR: the ACK timeout (4.096 µs x 2^timeout)
/// times retry_cnt + 1, at most a minute; 0 for timeout 0 (no timeout: not waited for ever).
uint64_t retry_budget_ns(const VQp& qp) {
  if (qp.ack_timeout == 0) return 0;
  const uint64_t ack = 4096ull << std::min<uint8_t>(qp.ack_timeout, 31);
  return std::min<uint64_t>(ack * (qp.retry_cnt + 1u), 60'000'000'000ull);
}

/// TCP has retransmitted our oldest unacknowledged segment by its timer more than this many
/// times in a row with no ACK (tcpi_backoff; reset by an ACK of new data): as in the backends'
/// transport (TcpTransport::tx_patience_ns), the first ones are a lossy path's recovery, waited
/// out (50, 100, 200, 400 ms at the options of common/rc_tcp.h); beyond, the path moves nothing.
constexpr uint8_t kBackoffsWaited = 3;

/// Whether `c`'s path moves nothing of ours (kBackoffsWaited passed), with TCP's current
/// retransmission timeout and its view for the log line.
bool path_stalled(const Conn& c, uint64_t& rto_ns, std::string& state) {
  tcp_info ti{};
  socklen_t len = sizeof(ti);
  if (::getsockopt(c.fd.get(), IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return false;
  if (ti.tcpi_unacked == 0 || ti.tcpi_backoff <= kBackoffsWaited) return false;
  rto_ns = uint64_t{ti.tcpi_rto} * 1000;
  state = fmt::format("tcp: {} segments unacknowledged, backoff {}, rto {} ms, {} retransmissions",
                      ti.tcpi_unacked, ti.tcpi_backoff, ti.tcpi_rto / 1000, ti.tcpi_total_retrans);
  return true;
}

}  // namespace

void ack_tick(Hub& h) {
  std::lock_guard<std::mutex> q(h.qps_mu);
  const uint64_t now = mono_ns();
  for (VQp* qp : h.qps) {
    RemoteQp& r = *qp->remote;
    if (!r.awaiting.load(std::memory_order_relaxed) || r.failed.load() || r.doomed_at) {
      r.stalled_since = 0;
      continue;
    }
    std::shared_ptr<Conn> out;
    {
      std::lock_guard<std::mutex> g(h.mu);
      out = r.out;
    }
    std::string state;
    uint64_t rto_ns = 0;
    if (!out || out->broken.load() || !path_stalled(*out, rto_ns, state)) {
      r.stalled_since = 0;
      continue;
    }
    if (!r.stalled_since) r.stalled_since = now;
    // The budget, but not before TCP's next try of its own (one retransmission timeout, at
    // most 1 s): a lossy path that lost a segment's fourth try too still gets its fifth.
    const uint64_t budget = retry_budget_ns(*qp);
    if (!budget || now - r.stalled_since < std::max(budget, rto_ns)) continue;
    VLOG_INFO(
        "direct path: QP {:#x}: retries exhausted: the connection to the peer's library "
        "moved nothing for the QP's retry budget ({} ms) after TCP's own retries; {}",
        qp->qp.qp_num, budget / 1000000, state);
    constexpr const char* kWhy =
        "transport retries exhausted (the connection to the peer's library moved nothing)";
    std::lock_guard<std::mutex> g(r.fl_mu);
    if (!r.inflight.empty()) flush_inflight(*qp, r, IBV_WC_RETRY_EXC_ERR, kWhy);
  }
}

bool doom(Hub& h, VQp& qp, RemoteQp& r, const char* why) {
  if (r.doomed_at) return true;
  const uint64_t budget = retry_budget_ns(qp);
  if (!budget) return false;
  // As over a fabric whose peer QP is gone, what is in flight fails when the retries would
  // have run out, not at once. A peer that destroys its QP right after its last receive
  // (ibv_srq_pingpong, whose other side has a SEND per QP in flight beyond what it waits for)
  // failed its peer's run before.
  r.doomed_at = mono_ns() + budget;
  r.doomed_why = why;
  {
    std::lock_guard<std::mutex> d(h.doom_mu);
    h.doomed.push_back(&qp);
  }
  wake_hub(h);  // its wait gets the tick (hub_timeout)
  return true;
}

void doom_tick(Hub& h) {
  std::lock_guard<std::mutex> q(h.qps_mu);
  std::vector<VQp*> due;
  {
    std::lock_guard<std::mutex> d(h.doom_mu);
    if (h.doomed.empty()) return;
    const uint64_t now = mono_ns();
    std::erase_if(h.doomed, [&](VQp* qp) {
      if (!qp->remote || now < qp->remote->doomed_at) return false;
      due.push_back(qp);
      return true;
    });
  }
  for (VQp* qp : due) {  // (flush_inflight moves the QP to ERR)
    RemoteQp& r = *qp->remote;
    std::lock_guard<std::mutex> g(r.fl_mu);
    if (!r.inflight.empty()) flush_inflight(*qp, r, IBV_WC_RETRY_EXC_ERR, r.doomed_why);
  }
}

/// Hub::ack_timer goes off `ns` from now.
void arm_ack_timer(Hub& h, uint64_t ns) {
  const itimerspec at{{0, 0}, {static_cast<time_t>(ns / 1000000000),
                               static_cast<long>(ns % 1000000000)}};
  ::timerfd_settime(h.ack_timer.get(), 0, &at, nullptr);
}

/// Hub::ack_timer fired: what the connections no poll reads have owed for a while goes now.
void send_deferred_acks(Hub& h) {
  uint64_t n;
  [[maybe_unused]] const ssize_t got = ::read(h.ack_timer.get(), &n, sizeof(n));
  h.ack_armed.store(false);  // before the scan: a deferral after it arms the timer itself
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> g(h.mu);
    conns = h.conns;
  }
  const uint64_t now = mono_ns();
  uint64_t next = 0;  ///< the soonest a younger deferral is due
  for (const auto& c : conns) {
    const uint64_t at = c->ack_deferred_ns.load();
    if (!at || c->claimed.load() || c->broken.load()) continue;  // none, or a poll's
    if (now - at < kAckDeferNs / 2) {
      const uint64_t due = at + kAckDeferNs - now;
      next = next ? std::min(next, due) : due;
      continue;
    }
    c->ack_deferred_ns.store(0);
    std::lock_guard<std::mutex> g(c->rx_mu);  // as drain sends it
    if (c->qp) send_ack(*c);  // (nothing if it rode on a request meanwhile)
  }
  if (next && !h.ack_armed.exchange(true)) arm_ack_timer(h, next);
}

}  // namespace vrdma::verbs::dlink
