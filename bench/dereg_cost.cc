// ibv_dereg_mr of a 64 MiB MR (issue 21): the last deregistration of a segment turns its pages
// back into anonymous memory (a copy with the other threads stopped, then mremap). Prints the
// time of ibv_reg_mr and ibv_dereg_mr of a fresh 64 MiB buffer, full of data ("full") or with
// one written byte per 2 MiB ("sparse"), a few times each. Run through `vrdma run` or with
// VRDMA_SOCKET/VRDMA_BACKEND set; see BENCHMARKS.md.
#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstring>

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}
}  // namespace

int main() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list || n < 1) return std::perror("ibv_get_device_list"), 1;
  ibv_context* ctx = ibv_open_device(list[0]);
  ibv_pd* pd = ctx ? ibv_alloc_pd(ctx) : nullptr;
  if (!pd) return std::perror("open/alloc_pd"), 1;
  constexpr size_t kLen = size_t{64} << 20;
  for (const char* mode : {"full", "sparse"}) {
    for (int i = 0; i < 5; ++i) {
      void* m = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) return std::perror("mmap"), 1;
      auto* p = static_cast<unsigned char*>(m);
      if (!std::strcmp(mode, "full")) {
        std::memset(p, 1, kLen);
      } else {
        for (size_t at = 0; at < kLen; at += size_t{2} << 20) p[at] = 1;
      }
      auto t = Clock::now();
      ibv_mr* mr = ibv_reg_mr(pd, m, kLen, IBV_ACCESS_LOCAL_WRITE);
      if (!mr) return std::perror("ibv_reg_mr"), 1;
      const double reg = ms_since(t);
      t = Clock::now();
      if (ibv_dereg_mr(mr)) return std::perror("ibv_dereg_mr"), 1;
      const double dereg = ms_since(t);
      std::printf("%s 64 MiB: ibv_reg_mr %.2f ms, ibv_dereg_mr %.2f ms\n", mode, reg, dereg);
      if (p[kLen - (size_t{2} << 20)] != 1) return std::fprintf(stderr, "contents lost\n"), 1;
      ::munmap(m, kLen);
    }
  }
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(list);
  return 0;
}
