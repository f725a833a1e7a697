// Registration cost of on-demand paging (issue 24): ibv_reg_mr with IBV_ACCESS_ON_DEMAND of a
// 64 GiB reservation (PROT_NONE, MAP_NORESERVE) and the implicit MR (NULL, SIZE_MAX), against an
// ordinary registration of 1 GiB written beforehand; and the first post that faults 1 MiB of an
// ODP MR in (ibv_advise_mr). Times ibv_reg_mr/ibv_dereg_mr a few times each. Run through
// `vrdma run` or with VRDMA_SOCKET set; see BENCHMARKS.md (bench/odp.sh).
#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "verbs_bench.h"

namespace {
using vrdma::bench::Clock;
using vrdma::bench::ms_since;

/// Registers [addr, addr + len) with `access` and deregisters it, `runs` times, printing each.
bool reg_dereg(ibv_pd* pd, const char* what, void* addr, size_t len, int access, int runs) {
  for (int i = 0; i < runs; ++i) {
    auto t = Clock::now();
    ibv_mr* mr = ibv_reg_mr(pd, addr, len, access);
    if (!mr) return std::perror(what), false;
    const double reg = ms_since(t);
    t = Clock::now();
    if (ibv_dereg_mr(mr)) return std::perror("ibv_dereg_mr"), false;
    std::printf("%s: ibv_reg_mr %.3f ms, ibv_dereg_mr %.3f ms\n", what, reg, ms_since(t));
  }
  return true;
}
}  // namespace

int main() {
  vrdma::bench::OpenDevice dev;
  ibv_pd* pd = dev.pd;
  if (!pd) return 1;
  constexpr int kOdp = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_ON_DEMAND;
  constexpr size_t kReserved = size_t{64} << 30, kGiB = size_t{1} << 30;
  void* r =
      ::mmap(nullptr, kReserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return std::perror("mmap 64 GiB"), 1;
  if (!reg_dereg(pd, "ODP 64 GiB reserved", r, kReserved, kOdp, 5)) return 1;
  if (!reg_dereg(pd, "ODP implicit", nullptr, SIZE_MAX, kOdp, 5)) return 1;
  // 1 MiB of the reservation made usable, then faulted in by ibv_advise_mr (the first post's
  // cost), then once more (cached: no backend command).
  auto* part = static_cast<uint8_t*>(r) + (size_t{10} << 30);
  if (::mprotect(part, 1 << 20, PROT_READ | PROT_WRITE)) return std::perror("mprotect"), 1;
  std::memset(part, 1, 1 << 20);
  ibv_mr* mr = ibv_reg_mr(pd, r, kReserved, kOdp & ~IBV_ACCESS_REMOTE_WRITE);
  if (!mr) return std::perror("ODP"), 1;
  for (const char* when : {"first", "again"}) {
    ibv_sge sg{reinterpret_cast<uintptr_t>(part), 1 << 20, mr->lkey};
    auto t = Clock::now();
    if (int rc = ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IBV_ADVISE_MR_FLAG_FLUSH,
                               &sg, 1))
      return std::fprintf(stderr, "ibv_advise_mr: %s\n", std::strerror(rc)), 1;
    std::printf("ODP fault-in of 1 MiB (%s): %.3f ms\n", when, ms_since(t));
  }
  if (ibv_dereg_mr(mr)) return std::perror("ibv_dereg_mr"), 1;
  ::munmap(r, kReserved);
  // An ordinary registration of 1 GiB the application wrote: every page moves into a segment.
  void* g = ::mmap(nullptr, kGiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (g == MAP_FAILED) return std::perror("mmap 1 GiB"), 1;
  std::memset(g, 1, kGiB);
  if (!reg_dereg(pd, "normal 1 GiB written", g, kGiB, IBV_ACCESS_LOCAL_WRITE, 3)) return 1;
  // The same 1 GiB as an ODP MR, local access only, and with remote access (the first one of
  // the context starts its pager thread): nothing is mapped at registration either way.
  if (!reg_dereg(pd, "ODP 1 GiB written, local", g, kGiB,
                 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND, 3))
    return 1;
  if (!reg_dereg(pd, "ODP 1 GiB written, remote", g, kGiB, kOdp, 3)) return 1;
  ::munmap(g, kGiB);
  return 0;
}
