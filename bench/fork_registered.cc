// fork() of a process with 1 GiB registered (issue 21, item 6): without ibv_fork_init the
// child gets a private copy of registered pages; with it (argument "init") they are
// MADV_DONTFORK and nothing is copied; "noreg" forks with the 1 GiB not registered.
// Run through `vrdma run` or with VRDMA_SOCKET/VRDMA_BACKEND set; see BENCHMARKS.md.
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}
}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "plain";
  if (!std::strcmp(mode, "init")) ibv_fork_init();
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list || n < 1) return std::perror("ibv_get_device_list"), 1;
  ibv_context* ctx = ibv_open_device(list[0]);
  ibv_pd* pd = ctx ? ibv_alloc_pd(ctx) : nullptr;
  if (!pd) return std::perror("open/alloc_pd"), 1;
  constexpr size_t kLen = size_t{1} << 30;
  void* m = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return std::perror("mmap"), 1;
  std::memset(m, 1, kLen);
  ibv_mr* mr = nullptr;
  auto t = Clock::now();
  if (std::strcmp(mode, "noreg") != 0) {
    mr = ibv_reg_mr(pd, m, kLen, IBV_ACCESS_LOCAL_WRITE);
    if (!mr) return std::perror("ibv_reg_mr"), 1;
  }
  std::printf("%s: ibv_reg_mr of 1 GiB %.1f ms\n", mode, ms_since(t));
  for (int i = 0; i < 3; ++i) {
    t = Clock::now();
    const pid_t child = ::fork();
    if (child == 0) ::_exit(0);
    const double f = ms_since(t);
    ::waitpid(child, nullptr, 0);
    std::printf("  fork() %.1f ms\n", f);
  }
  if (mr) ibv_dereg_mr(mr);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(list);
  return 0;
}
