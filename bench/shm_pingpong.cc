// The machine's limit for a same-host ping-pong: two processes sharing one anonymous mapping,
// each copying an S-byte message into the other's half and flipping a sequence word the other
// spins on (no syscall, no sleep). What no mediated path can beat; bench/compare.py reports
// vrdma's latency against it. Prints "N iters, S bytes: U usec one-way" (half a round trip).
// Usage: shm_pingpong -s SIZE -n ITERS
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

namespace {

struct alignas(64) Side {
  std::atomic<uint64_t> seq{0};
};

void run(Side& mine, Side& theirs, char* in, char* out, const char* msg, size_t size, long iters,
         bool first) {
  for (long i = 1; i <= iters; ++i) {
    if (first) {
      std::memcpy(out, msg, size);
      theirs.seq.store(i, std::memory_order_release);
      while (mine.seq.load(std::memory_order_acquire) != uint64_t(i)) {
      }
    } else {
      while (mine.seq.load(std::memory_order_acquire) != uint64_t(i)) {
      }
      std::memcpy(out, in, size);
      theirs.seq.store(i, std::memory_order_release);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  size_t size = 8;
  long iters = 100000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (argv[i][1] == 's') size = std::strtoul(argv[i + 1], nullptr, 10);
    if (argv[i][1] == 'n') iters = std::strtol(argv[i + 1], nullptr, 10);
  }
  const size_t len = 2 * sizeof(Side) + 2 * size + 4096;
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  auto* sides = new (p) Side[2];
  char* buf0 = static_cast<char*>(p) + 2 * sizeof(Side);  // messages to process 0
  char* buf1 = buf0 + size;                               // messages to process 1
  char* msg = static_cast<char*>(std::malloc(size ? size : 1));
  std::memset(msg, 'x', size);
  pid_t pid = ::fork();
  if (pid == 0) {
    run(sides[1], sides[0], buf1, buf0, msg, size, iters, false);
    _exit(0);
  }
  auto t0 = std::chrono::steady_clock::now();
  run(sides[0], sides[1], buf0, buf1, msg, size, iters, true);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int st = 0;
  ::waitpid(pid, &st, 0);
  std::printf("%ld iters, %zu bytes: %.3f usec one-way\n", iters, size, s * 1e6 / double(iters) / 2);
  return 0;
}
