// The machine's limit for a same-host copy: single-thread memcpy bandwidth between two buffers
// that stay warm, per message size (8 B .. 4 MiB, plus 64 MiB to show the memory-bound rate).
// Prints "SIZE GBPS" lines; bench/compare.py compares RDMA WRITE bandwidth against it.
// Usage: memcpy_bw [SIZE...]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  std::vector<size_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::strtoull(argv[i], nullptr, 10));
  if (sizes.empty()) sizes = {8, 64, 512, 4096, 65536, 1 << 20, 4 << 20, 64 << 20};
  for (size_t n : sizes) {
    std::vector<char> a(n, 'a'), b(n, 'b');
    // Enough repetitions for ~0.2 s, found by doubling.
    using clock = std::chrono::steady_clock;
    double secs = 0;
    size_t reps = 1;
    for (;;) {
      auto t0 = clock::now();
      for (size_t r = 0; r < reps; ++r) {
        std::memcpy(b.data(), a.data(), n);
        asm volatile("" : : "r"(b.data()) : "memory");  // keep every copy
      }
      secs = std::chrono::duration<double>(clock::now() - t0).count();
      if (secs > 0.2) break;
      reps *= 2;
    }
    std::printf("%zu %.3f\n", n, double(n) * double(reps) / secs / 1e9);
  }
  return 0;
}
