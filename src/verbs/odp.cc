// On-demand paging: ODP MRs (IBV_ACCESS_ON_DEMAND) are registered with no pages at all, in
// O(1) (the backend's MR has no extents); a page becomes reachable when a WQE or ibv_advise_mr
// touches it, or a peer's request through the rkey reaches it (the pager below): the library
// moves it into a segment as ibv_reg_mr would (memory.cc) and hands it to the backend
// (kReregMr with kReregOdpMap), once, and remembers it here. See docs/ARCHITECTURE.md,
// "On-demand paging".
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/log.h"
#include "verbs/internal.h"

namespace vrdma::verbs {

using namespace vrdma::proto;

/// The library's side of an ODP MR. Faults of one MR are serialised by `mu` (held across the
/// backend command, so that two threads do not fault the same pages in twice).
struct OdpMr {
  uint32_t handle = 0;
  uint32_t pd = 0;
  uint64_t addr = 0, length = 0;  ///< implicit: 0 and UINT64_MAX
  uint64_t iova = 0;              ///< where rkeys address byte 0 (the pager's requests)
  /// Access that lets the backend write its pages (local or remote write, atomics): every
  /// fault then needs writable pages, since a page in the backend's chunks takes any access.
  bool writable = false;
  std::mutex mu;
  std::map<uintptr_t, uintptr_t> faulted;  ///< page ranges the backend has, start -> end; apart
  std::vector<uint32_t> segments;          ///< process segment ids, given back at deregistration
};

namespace {

constexpr uintptr_t kPageSize = 4096;

std::shared_ptr<OdpMr> find_odp(VContext& ctx, uint32_t lkey) {
  std::lock_guard<std::mutex> g(ctx.odp_mu);
  auto it = ctx.odp.find(lkey);
  return it == ctx.odp.end() ? nullptr : it->second;
}

/// Records [a, b) as faulted in, joined with its neighbours. Under m.mu.
void remember(OdpMr& m, uintptr_t a, uintptr_t b) {
  auto next = m.faulted.lower_bound(a);
  if (next != m.faulted.begin()) {
    auto prev = std::prev(next);
    if (prev->second >= a) {
      a = prev->first;
      b = std::max(b, prev->second);
      next = m.faulted.erase(prev);
    }
  }
  while (next != m.faulted.end() && next->first <= b) {
    b = std::max(b, next->second);
    next = m.faulted.erase(next);
  }
  m.faulted.emplace(a, b);
}

/// Makes [a, b) of the MR reachable by the backend. Under m.mu.
int map_range(VContext& ctx, OdpMr& m, uintptr_t a, uintptr_t b) {
  auto req = std::make_unique<ReregMrReq>();
  req->handle = m.handle;
  req->flags = kReregOdpMap;
  req->mr.addr = a;
  req->mr.length = b - a;
  std::vector<uint32_t> segments;
  int rc = describe_memory(ctx, reinterpret_cast<void*>(a), b - a, req->mr, segments);
  Empty resp;
  if (rc == 0) rc = ctx.call(Op::kReregMr, req.get(), sizeof(*req), &resp, 0);
  if (rc != 0) {
    release_segments(ctx, segments);
    return rc;
  }
  m.segments.insert(m.segments.end(), segments.begin(), segments.end());
  remember(m, a, b);
  return 0;
}

/// Faults in the pages of [addr, addr + len) (within the MR) that the backend does not have
/// yet; EFAULT for a page that is not mapped with the access: readable, and writable when the
/// access (`write`) or the MR (OdpMr::writable) may write it. As the kernel's ODP, which faults
/// pages of a writable MR in for writing: once in the backend's chunks, a page takes a peer's
/// WRITE as well as the READ that brought it in.
int fault(VContext& ctx, OdpMr& m, uint64_t addr, uint64_t len, bool write) {
  if (len == 0) return 0;
  write = write || m.writable;
  const uint64_t mr_end = m.addr + m.length;  // UINT64_MAX for an implicit MR
  const uintptr_t lo = std::max<uintptr_t>(addr & ~(kPageSize - 1), m.addr);
  const uintptr_t hi = std::min<uint64_t>((addr + len + kPageSize - 1) & ~(kPageSize - 1), mr_end);
  std::lock_guard<std::mutex> g(m.mu);
  // The gaps of [lo, hi) between the ranges already faulted in, one by one.
  for (uintptr_t at = lo; at < hi;) {
    auto next = m.faulted.upper_bound(at);
    if (next != m.faulted.begin() && std::prev(next)->second > at) {
      at = std::prev(next)->second;  // inside a range the backend has
      continue;
    }
    const uintptr_t gap_end = next != m.faulted.end() ? std::min<uintptr_t>(next->first, hi) : hi;
    if (!pages_accessible(at, gap_end, write)) return EFAULT;
    if (int rc = map_range(ctx, m, at, gap_end)) return rc;
    at = gap_end;
  }
  return 0;
}

bool in_mr(const OdpMr& m, uint64_t addr, uint64_t len) {
  return addr >= m.addr && len <= m.length && addr - m.addr <= m.length - len;
}

/// The pager of a context: answers the backend's requests for pages of ODP MRs that a peer's
/// WRITE, READ or atomic reached before they were faulted in (proto::ControlPage's mailbox;
/// the requester waits meanwhile, as for an RNR NAK). It sleeps in poll on `odp_wake`, where the
/// backend sends a byte after each request (kReregOdpPager), or, with an older backend, polls
/// the mailbox every millisecond. poll, not a futex: ThreadSanitizer delivers the
/// registration's stop signal only in calls it intercepts.
void pager_loop(VContext* ctx) {
  ControlPage* cp = ctx->control_page();
  const int wake = ctx->odp_wake.get();
  while (!ctx->odp_pager_stop.load(std::memory_order_acquire)) {
    const uint32_t req = cp->odp_req.load(std::memory_order_acquire);
    if (req == cp->odp_done.load(std::memory_order_relaxed)) {
      if (wake < 0) {
        ::poll(nullptr, 0, 1);
        continue;
      }
      // A request stored before the byte that woke us is seen by the next look (the drain
      // comes first); one stored after it leaves its own byte.
      pollfd p{wake, POLLIN, 0};
      ::poll(&p, 1, -1);
      char drain[64];
      while (::recv(wake, drain, sizeof(drain), MSG_DONTWAIT) > 0) {
      }
      continue;
    }
    const uint32_t handle = cp->odp_mr;
    const uint64_t iova = cp->odp_addr, len = cp->odp_len;
    std::shared_ptr<OdpMr> m;
    {
      std::lock_guard<std::mutex> g(ctx->odp_mu);
      for (const auto& [key, o] : ctx->odp)
        if (o->handle == handle) m = o;
    }
    int rc = EINVAL;
    if (m && len && iova >= m->iova && len <= m->length && iova - m->iova <= m->length - len)
      rc = fault(*ctx, *m, m->addr + (iova - m->iova), len, false);
    if (rc)
      VLOG_DEBUG("ODP MR {}: a peer's access to {:#x}+{:#x} not faulted in: {}", handle, iova, len,
                 std::strerror(rc));
    cp->odp_status = static_cast<uint32_t>(rc);
    cp->odp_done.store(req, std::memory_order_release);
  }
}

/// Starts the pager with the context's first ODP MR that peers may reach (`handle`): gives the
/// backend the socket that wakes it, then runs it.
void start_pager(VContext& ctx, uint32_t handle) {
  std::lock_guard<std::mutex> g(ctx.odp_mu);
  if (ctx.odp_pager.joinable()) return;
  // VRDMA_ODP_WAKE=0: the pager polls every millisecond, as with an older backend (bench/odp.sh
  // compares the two).
  const char* env = ::secure_getenv("VRDMA_ODP_WAKE");
  int sv[2];
  if ((!env || std::strcmp(env, "0") != 0) &&
      ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) == 0) {
    ctx.odp_wake = UniqueFd(sv[0]);
    ctx.odp_kick = UniqueFd(sv[1]);
    auto req = std::make_unique<ReregMrReq>();
    req->handle = handle;
    req->flags = kReregOdpPager;
    Empty resp;
    const int fd = sv[1];
    if (int rc = ctx.call(Op::kReregMr, req.get(), sizeof(*req), &resp, 0,
                          std::span<const int>(&fd, 1))) {
      VLOG_DEBUG("ODP pager: the backend takes no wake-up socket ({}); polling every ms",
                 std::strerror(rc));
      ctx.odp_wake.reset();
      ctx.odp_kick.reset();
    }
  }
  ctx.odp_pager = std::thread(pager_loop, &ctx);
  ctx.control_page()->odp_pager.store(1, std::memory_order_release);
}

}  // namespace

ibv_mr* reg_odp_mr(ibv_pd* pd, void* addr, size_t length, uint64_t iova, unsigned access) {
  if (!pd || length == 0) return fail_ptr<ibv_mr>(EINVAL);
  // Implicit ODP: the whole address space, as rdma-core spells it.
  const bool implicit = !addr && length == SIZE_MAX;
  if (!addr && !implicit) return fail_ptr<ibv_mr>(EINVAL);
  VContext* ctx = to_vctx(pd->context);
  auto req = std::make_unique<RegMrReq>();
  req->pd = reinterpret_cast<VPd*>(pd)->handle;
  req->access = access & ~IBV_ACCESS_OPTIONAL_RANGE;
  req->addr = reinterpret_cast<uintptr_t>(addr);
  req->length = implicit ? UINT64_MAX : length;
  req->iova = implicit ? 0 : iova;
  req->num_extents = 0;
  RegMrResp resp{};
  if (int rc = ctx->call(Op::kRegMr, *req, resp)) return fail_ptr<ibv_mr>(rc);
  auto m = std::make_shared<OdpMr>();
  m->handle = resp.handle;
  m->pd = req->pd;
  m->addr = req->addr;
  m->length = req->length;
  m->iova = req->iova;
  m->writable =
      access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC);
  VMr* mr = new_vmr(pd, addr, length, resp,
                    LocalMr{req->addr, req->length, req->iova, req->access, req->pd});
  mr->odp = true;
  {
    std::lock_guard<std::mutex> g(ctx->odp_mu);
    ctx->odp[resp.lkey] = m;
  }
  ctx->odp_mrs.fetch_add(1, std::memory_order_relaxed);
  // Peers reach it through its rkey without any WQE of ours naming the pages first: the
  // pager faults in what their requests touch.
  constexpr unsigned kRemote =
      IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  if (access & kRemote) start_pager(*ctx, resp.handle);
  return &mr->mr;
}

void stop_odp_pager(VContext& ctx) {
  if (!ctx.odp_pager.joinable()) return;
  ctx.control_page()->odp_pager.store(0, std::memory_order_release);
  ctx.odp_pager_stop.store(true, std::memory_order_release);
  if (ctx.odp_kick.valid()) {
    const char b = 1;
    (void)::send(ctx.odp_kick.get(), &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  }
  ctx.odp_pager.join();
}

void forget_odp_mr(VContext& ctx, VMr& mr, std::vector<uint32_t>& segments) {
  std::shared_ptr<OdpMr> m;
  {
    std::lock_guard<std::mutex> g(ctx.odp_mu);
    auto it = ctx.odp.find(mr.mr.lkey);
    if (it == ctx.odp.end()) return;
    m = std::move(it->second);
    ctx.odp.erase(it);
  }
  ctx.odp_mrs.fetch_sub(1, std::memory_order_relaxed);
  // A fault on another thread finishes first (or finds the MR gone in the backend).
  std::lock_guard<std::mutex> g(m->mu);
  segments.insert(segments.end(), m->segments.begin(), m->segments.end());
  m->segments.clear();
}

int odp_reach(VContext& ctx, uint32_t key, uint64_t addr, uint64_t length, bool write) {
  std::shared_ptr<OdpMr> m = find_odp(ctx, key);
  if (!m) return 0;  // not ODP: its pages are all there
  if (!in_mr(*m, addr, length)) return EFAULT;
  return fault(ctx, *m, addr, length, write);
}

void odp_fault_sge(VContext& ctx, uint32_t lkey, uint64_t addr, uint64_t length, bool write) {
  if (length == 0) return;
  // Not posted as an error here: the backend answers the WQE (a protection error) when it
  // executes it, whether the range is outside the MR or a page cannot be reached.
  if (int rc = odp_reach(ctx, lkey, addr, length, write))
    VLOG_DEBUG("ODP lkey {:#x}: {:#x}+{:#x} not faulted in: {}", lkey, addr, length,
               std::strerror(rc));
}

void odp_fault_sges(VContext& ctx, const ibv_sge* sg, int num_sge, bool write) {
  for (int i = 0; i < num_sge; ++i) odp_fault_sge(ctx, sg[i].lkey, sg[i].addr, sg[i].length, write);
}

int advise_mr(ibv_pd* pd, ibv_advise_mr_advice advice, uint32_t flags, ibv_sge* sg_list,
              uint32_t num_sge) {
  if (!pd || !sg_list || num_sge == 0 || (flags & ~uint32_t{IBV_ADVISE_MR_FLAG_FLUSH}))
    return EINVAL;
  if (advice != IBV_ADVISE_MR_ADVICE_PREFETCH && advice != IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE &&
      advice != IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT)
    return EOPNOTSUPP;
  VContext& ctx = *to_vctx(pd->context);
  const uint32_t pd_handle = reinterpret_cast<VPd*>(pd)->handle;
  // All checked before anything is faulted in.
  std::vector<std::shared_ptr<OdpMr>> mrs;
  for (uint32_t i = 0; i < num_sge; ++i) {
    std::shared_ptr<OdpMr> m = find_odp(ctx, sg_list[i].lkey);
    if (!m || m->pd != pd_handle || !in_mr(*m, sg_list[i].addr, sg_list[i].length)) return EINVAL;
    mrs.push_back(std::move(m));
  }
  // Always synchronous (as IBV_ADVISE_MR_FLAG_FLUSH asks): done when this returns.
  for (uint32_t i = 0; i < num_sge; ++i) {
    const uint64_t a = sg_list[i].addr, n = sg_list[i].length;
    if (advice == IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT) {
      // Only what is resident already: nothing is faulted in that was not there.
      for (auto [lo, hi] : resident_runs(a & ~(kPageSize - 1), a + n, 64)) {
        const uintptr_t x = std::max<uintptr_t>(lo, a), y = std::min<uintptr_t>(hi, a + n);
        if (int rc = fault(ctx, *mrs[i], x, y - x, false)) return rc;
      }
      continue;
    }
    if (int rc = fault(ctx, *mrs[i], a, n, advice == IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE))
      return rc;
  }
  return 0;
}

}  // namespace vrdma::verbs
