// An ordinary application that registers fresh buffers, deregisters and frees them in a loop
// (tests/security/reg_churn.sh): malloc'd buffers of changing sizes, some from the heap and some
// mapped, as a real program's are. Prints `warm FDS` after the first iterations and `done FDS`
// at the end (FDS: its own open descriptors), each time waiting for a line on stdin, so that
// the test can count the backend's descriptors at both points.
//   reg_churn ITERATIONS
#include <dirent.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

namespace {

int open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d)) ++n;
    ::closedir(d);
  }
  return n - 3;  // ".", ".." and the directory's own descriptor
}

void checkpoint(const char* what) {
  std::printf("%s %d\n", what, open_fds());
  std::fflush(stdout);
  char line[64];
  (void)!std::fgets(line, sizeof(line), stdin);
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 5000;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list || n == 0) {
    std::printf("no device\n");
    return 1;
  }
  ibv_context* ctx = ibv_open_device(list[0]);
  if (!ctx) {
    std::printf("open failed: %s\n", std::strerror(errno));
    return 1;
  }
  ibv_pd* pd = ibv_alloc_pd(ctx);
  if (!pd) {
    std::printf("alloc_pd failed: %s\n", std::strerror(errno));
    return 1;
  }
  std::mt19937 rng(42);
  for (int i = 0; i < iterations; ++i) {
    if (i == 10) checkpoint("warm");
    // 4 KiB .. 1 MiB: below and above malloc's mmap threshold.
    const size_t len = 4096u << (rng() % 9);
    auto* buf = static_cast<unsigned char*>(std::malloc(len));
    if (!buf) return 1;
    std::memset(buf, i & 0xff, len);
    ibv_mr* mr = ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
    if (!mr) {
      std::printf("registration %d of %zu bytes failed: %s\n", i, len, std::strerror(errno));
      return 1;
    }
    if (buf[len - 1] != (i & 0xff)) {
      std::printf("registration %d changed the buffer\n", i);
      return 1;
    }
    if (int rc = ibv_dereg_mr(mr)) {
      std::printf("deregistration %d failed: %s\n", i, std::strerror(rc));
      return 1;
    }
    std::free(buf);
  }
  checkpoint("done");
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(list);
  std::printf("ok %d registrations\n", iterations);
  return 0;
}
