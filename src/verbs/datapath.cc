// Guest side of the data path: post_send/post_recv write WQEs into the shared rings and
// publish them with one release store; poll_cq reads completions the backend wrote. No
// syscall here, except the doorbell write when the backend announced it is asleep.
#include <fcntl.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "common/log.h"
#include "verbs/ah.h"
#include "verbs/internal.h"

namespace vrdma::verbs {

using namespace vrdma::proto;

int post_send(ibv_qp* q, ibv_send_wr* wr, ibv_send_wr** bad) {
  VQp* qp = to_vqp(q);
  if (to_vctx(q->context)->dead.load(std::memory_order_relaxed)) {
    *bad = wr;
    return EIO;
  }
  // Posting to a QP that cannot send is an immediate error (proto/post_rules.h).
  if (!can_post_send(q->state)) {
    *bad = wr;
    return EINVAL;
  }
  // A send queue of 0 (ibv_create_qp's max_send_wr = 0) takes nothing: full, as on hardware.
  // The direct paths below would otherwise execute the WR without a slot.
  if (qp->sq_size == 0 && wr) {
    *bad = wr;
    return ENOMEM;
  }
  // ODP: the pages the WRs name are made reachable first (odp.cc; once per page).
  if (VContext* ctx = to_vctx(q->context); ctx->odp_mrs.load(std::memory_order_relaxed)) {
    for (const ibv_send_wr* w = wr; w; w = w->next) {
      if (!(w->send_flags & IBV_SEND_INLINE) && w->num_sge > 0)
        odp_fault_sges(*ctx, w->sg_list, w->num_sge,
                       w->opcode == IBV_WR_RDMA_READ || is_rdma_atomic(w->opcode));
    }
  }
  int rc = 0;
  qp->sq_lock.lock();
  // Peer on another backend, reached through its library (remote.cc).
  if (remote_post(*qp, wr, rc, bad)) {
    qp->sq_lock.unlock();
    return rc;
  }
  // Same-uid peer on this backend: execute what we can ourselves (direct.cc).
  direct_post(*qp, wr);
  if (!wr) {
    qp->sq_lock.unlock();
    return 0;
  }
  const uint32_t start = qp->sq_prod;
  for (; wr; wr = wr->next) {
    if (ring_full(qp->sq_hdr, qp->sq_prod, qp->sq_size, qp->sq_cons_seen)) {
      rc = ENOMEM;
      break;
    }
    if ((rc = check_post_send(q->qp_type, *wr, send_caps(*qp)))) break;
    SendWqe& w = qp->sq[qp->sq_prod & (qp->sq_size - 1)];
    w.wr_id = wr->wr_id;
    w.opcode = wr->opcode;
    // The backend reads IBV_SEND_INLINE as "the bytes are in the WQE": only where it counts.
    w.send_flags =
        is_inline(wr->opcode, wr->send_flags) ? wr->send_flags : wr->send_flags & ~IBV_SEND_INLINE;
    w.imm_data = wr->imm_data;
    w.num_sge = static_cast<uint32_t>(wr->num_sge);
    if (q->qp_type == IBV_QPT_UD) {
      pack_ud_dest(w, to_vah(wr->wr.ud.ah)->dest);
      w.ud_remote_qpn = wr->wr.ud.remote_qpn;
      w.ud_remote_qkey = wr->wr.ud.remote_qkey;
    } else if (wr->opcode == IBV_WR_ATOMIC_CMP_AND_SWP ||
               wr->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
      w.remote_addr = wr->wr.atomic.remote_addr;
      w.rkey = wr->wr.atomic.rkey;
      w.compare_add = wr->wr.atomic.compare_add;
      w.swap = wr->wr.atomic.swap;
    } else if (wr->opcode == IBV_WR_BIND_MW) {
      fill_bind(w, wr->bind_mw.mw, wr->bind_mw.rkey, wr->bind_mw.bind_info);
    } else if (wr->opcode == IBV_WR_LOCAL_INV) {
      w.rkey = wr->invalidate_rkey;
    } else {
      w.remote_addr = wr->wr.rdma.remote_addr;
      w.rkey = wr->wr.rdma.rkey;
    }
    // XRC: the SRQ of the target's domain (proto/ring.h: UD's qkey field).
    if (q->qp_type == IBV_QPT_XRC_SEND) w.ud_remote_qkey = wr->qp_type.xrc.remote_srqn;
    if (is_local_mw_op(wr->opcode)) {  // no data: its fields are all set
      w.num_sge = 0;
      w.inline_len = 0;
      qp->sq_prod++;
      continue;
    }
    w.inline_len = 0;
    if (w.send_flags & IBV_SEND_INLINE) {
      uint32_t off = 0;
      for (int i = 0; i < wr->num_sge; ++i) {
        std::memcpy(w.inline_data + off, reinterpret_cast<const void*>(wr->sg_list[i].addr),
                    wr->sg_list[i].length);
        off += wr->sg_list[i].length;
      }
      w.inline_len = off;
    } else {
      for (int i = 0; i < wr->num_sge; ++i)
        w.sge[i] = Sge{wr->sg_list[i].addr, wr->sg_list[i].length, wr->sg_list[i].lkey};
    }
    qp->sq_prod++;
  }
  if (qp->sq_prod != start) {
    qp->sq_hdr->producer.store(qp->sq_prod, std::memory_order_release);
    to_vctx(q->context)->ring_doorbell(qp->handle);
  }
  qp->sq_lock.unlock();
  if (rc) *bad = wr;
  return rc;
}

int post_recv(ibv_qp* q, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  VQp* qp = to_vqp(q);
  if (to_vctx(q->context)->dead.load(std::memory_order_relaxed)) {
    *bad = wr;
    return EIO;
  }
  if (!can_post_recv(q->state)) {
    *bad = wr;
    return EINVAL;
  }
  if (VContext* ctx = to_vctx(q->context); ctx->odp_mrs.load(std::memory_order_relaxed)) {
    for (const ibv_recv_wr* w = wr; w; w = w->next)
      if (w->num_sge > 0) odp_fault_sges(*ctx, w->sg_list, w->num_sge, true);
  }
  int rc = 0;
  qp->rq_lock.lock();
  const uint32_t start = qp->rq_prod;
  for (; wr; wr = wr->next) {
    if (ring_full(qp->rq_hdr, qp->rq_prod, qp->rq_size, qp->rq_cons_seen)) {
      rc = ENOMEM;
      break;
    }
    if ((rc = check_post_recv(*wr, qp->caps.max_recv_sge))) break;
    RecvWqe& r = qp->rq[qp->rq_prod & (qp->rq_size - 1)];
    r.wr_id = wr->wr_id;
    r.num_sge = static_cast<uint32_t>(wr->num_sge);
    for (int i = 0; i < wr->num_sge; ++i)
      r.sge[i] = Sge{wr->sg_list[i].addr, wr->sg_list[i].length, wr->sg_list[i].lkey};
    qp->rq_prod++;
  }
  if (qp->rq_prod != start) {
    qp->rq_hdr->producer.store(qp->rq_prod, std::memory_order_release);
    // A receive can unblock a sender the backend is holding in RNR wait (sooner than its
    // timer), unless a direct peer feeds this RQ: then waking the backend only costs a core.
    // (The backend looks at a QP in ERR with such an RQ on every turn: these receives flush.)
    if (!qp->rq_hdr->armed.load(std::memory_order_relaxed))
      to_vctx(q->context)->ring_doorbell(qp->handle);
  }
  qp->rq_lock.unlock();
  remote_receives_posted(*qp);
  if (rc) *bad = wr;
  return rc;
}

int poll_cq(ibv_cq* c, int n, ibv_wc* wc) {
  VCq* cq = to_vcq(c);
  cq->lock.lock();
  ++cq->polls_unchecked;
  int got = 0;
  bool progressed = false;
  while (got < n) {
    const Cqe* next = next_cqe(*cq);
    // Nothing here: read the connections of peers' libraries (remote.cc), once.
    if (!next && !got && !progressed && (progressed = true) && remote_progress(*cq))
      next = next_cqe(*cq);
    if (!next) break;
    const Cqe& e = *next;
    ibv_wc& w = wc[got++];
    w.wr_id = e.wr_id;
    w.status = static_cast<ibv_wc_status>(e.status);
    w.opcode = static_cast<ibv_wc_opcode>(e.opcode);
    w.vendor_err = e.vendor_err;
    w.byte_len = e.byte_len;
    w.imm_data = e.imm_data;
    w.qp_num = e.qp_num;
    w.src_qp = e.src_qp;
    w.wc_flags = e.wc_flags;
    w.pkey_index = e.pkey_index;
    w.slid = e.slid;
    w.sl = e.sl;
    w.dlid_path_bits = e.dlid_path_bits;
  }
  if (got) {
    publish_consumed(*cq);
    cq->empty_polls = 0;
    remote_found(*cq);
    poll_found();
  } else if (dead_on_empty_poll(*cq)) {
    cq->lock.unlock();
    errno = EIO;
    return -1;
  } else if (++cq->empty_polls % kYieldEvery == 0) {
    // A busy-polling application competes with the backend for the CPUs; when the CQ has
    // stayed empty for a while, let the backend (which produces completions) run. Without
    // this, on a machine with fewer cores than spinners, each completion waits for a
    // scheduler time slice (milliseconds). Only the empty path pays this syscall.
    const bool yield = should_yield(*cq);
    cq->lock.unlock();
    if (yield) ::sched_yield();
    poll_empty();
    return 0;
  } else {
    cq->lock.unlock();
    poll_empty();
    return 0;
  }
  cq->lock.unlock();
  return got;
}

uint64_t env_num(const char* name, uint64_t dflt, uint64_t max, const char* unit) {
  const char* e = ::secure_getenv(name);
  if (!e || !*e) return dflt;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(e, &end, 10);
  if (*end != '\0' || n > max) {
    VLOG_WARN("{}={}: not a number of {} up to {}; using {}", name, e, unit, max, dflt);
    return dflt;
  }
  return n;
}

uint64_t env_us(const char* name, uint64_t default_us, uint64_t max_us) {
  return env_num(name, default_us, max_us, "microseconds");
}

namespace {

/// The calling thread's polls (of any CQ) since one of them found a completion, when the run of
/// empty ones was first timed, and the last look at whether the machine is oversubscribed.
struct PollIdle {
  uint32_t empties = 0;
  uint64_t since_ns = 0;
  uint64_t looked_ns = 0;
  bool crowded = false;
};
thread_local PollIdle t_idle;

/// Empty polls between two looks at the clock: a look costs ~20 ns (vDSO), a poll ~10.
constexpr uint32_t kIdleLookEvery = 64;
/// How long a nap asks for; the kernel's timer slack (50 µs by default) comes on top.
constexpr long kNapNs = 20'000;
/// How long a verdict on the machine's load holds (one read of /proc/loadavg each).
constexpr uint64_t kCrowdLookNs = 1'000'000;
constexpr uint64_t kPollIdleUsDefault = 1000;

/// VRDMA_POLL_IDLE_US: how long a thread's polls find nothing before each later empty one may
/// nap (0: never; pure busy polling). Read once per process.
uint64_t nap_after_ns() {
  static const uint64_t ns = env_us("VRDMA_POLL_IDLE_US", kPollIdleUsDefault, 10'000'000) * 1000;
  return ns;
}

/// Whether more threads are runnable on the machine than it has CPUs (/proc/loadavg's fourth
/// field, "running/total": every scheduling class, idle priority included), i.e. whether a
/// spinning poller keeps someone from running. False when it cannot be read.
bool machine_crowded() {
  static const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  const int fd = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[128];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  // "0.52 0.58 0.59 3/389 12345": the running count follows the third space.
  const char* p = buf;
  for (int spaces = 0; *p && spaces < 3; ++p) spaces += *p == ' ';
  const long running = std::strtol(p, nullptr, 10);
  return cpus > 0 && running > cpus;
}

}  // namespace

void poll_found() {
  if (t_idle.empties) t_idle.empties = 0;
}

void poll_empty() {
  PollIdle& idle = t_idle;
  if (++idle.empties % kIdleLookEvery) return;
  const uint64_t after = nap_after_ns();
  if (after == 0) return;
  const uint64_t now = mono_ns();
  if (idle.empties == kIdleLookEvery) {
    idle.since_ns = now;
    return;
  }
  if (now - idle.since_ns < after) return;
  // This thread has found nothing for `after`: whatever it waits for (the backend, a peer's
  // library, a peer host) is not coming within a poll or two. If others want a CPU (idle
  // priority programs included, which sched_yield() never lets run), sleeping a few tens of
  // µs gives it to them and costs the next completion at most that (a small fraction of the
  // wait so far). On a machine with a CPU to spare nobody gains: keep polling. A thread whose
  // other CQ keeps producing never gets here (poll_found).
  if (now - idle.looked_ns >= kCrowdLookNs) {
    idle.looked_ns = now;
    idle.crowded = machine_crowded();
  }
  if (!idle.crowded) return;
  const timespec nap{0, kNapNs};
  ::nanosleep(&nap, nullptr);
}

bool dead_on_empty_poll(VCq& cq) {
  if (cq.polls_unchecked < kLivenessEvery) return false;
  cq.polls_unchecked = 0;
  return to_vctx(cq.cq.context)->backend_gone();
}

bool should_yield(const VCq& cq) {
  VContext& ctx = *to_vctx(cq.cq.context);
  // Completions of a CQ with no direct QP all come from the backend; those of one whose QPs
  // talk to peers' libraries come through the kernel (remote.h), which needs a CPU too, and a
  // program beside us may want this one.
  if (cq.own.empty() || !cq.rconns.empty()) return true;
  // A direct peer writes them itself: yielding would only delay them, unless the backend is
  // awake (it shares the CPUs) or we just woke it (it needs a CPU to run at all).
  if (!ctx.control_page()->backend_sleeping.load(std::memory_order_relaxed)) {
    ctx.woke_backend.store(false, std::memory_order_relaxed);
    return true;
  }
  return ctx.woke_backend.load(std::memory_order_relaxed);
}

int req_notify_cq(ibv_cq* c, int solicited_only) {
  VCq* cq = to_vcq(c);
  cq->hdr->armed.store(solicited_only ? 2 : 1, std::memory_order_seq_cst);
  cq->lock.lock();
  if (cq->rclaimed) remote_armed(*cq);
  cq->lock.unlock();
  return 0;
}

}  // namespace vrdma::verbs
