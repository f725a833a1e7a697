// ibv_reg_mr while other threads run (issue 21, item 6): registration moves pages into a segment,
// and no write by another thread to those pages may be lost meanwhile, inside the MR or beside
// it; buffers on a thread's stack are refused with EFAULT. After the last deregistration the
// pages are anonymous private memory again (issue 21), and no write is lost then either.
// Private file mappings (a program's .data, MAP_PRIVATE of a file) register too (issue 24), as
// librdmacm's rdma_server/rdma_client need; shared ones and pages past a file's end do not.
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "verbs_fixture.h"

namespace vrdma::test {
namespace {

class VerbsRegTest : public VerbsFixture {};

constexpr size_t kPage = 4096;
constexpr size_t kPages = 16;
constexpr int kWorkers = 3;
constexpr int kRegistrations = 2000;

/// Where worker `t` keeps its counter in page `p` of a region: in the first and the last page
/// outside the MR (which starts 256 bytes into the region and ends 256 bytes before its end),
/// in every other page inside it.
size_t counter_offset(size_t p, int t) {
  if (p == 0) return 8 * static_cast<size_t>(t);
  if (p == kPages - 1) return p * kPage + kPage - 8 * static_cast<size_t>(t + 1);
  return p * kPage + 2048 + 8 * static_cast<size_t>(t);
}

/// Whether any page of [addr, addr+len) is mapped from one of the library's segments (a
/// `vrdma-seg` memfd) according to /proc/self/maps.
bool in_segment(const void* addr, size_t len) {
  const auto lo = reinterpret_cast<uintptr_t>(addr), hi = lo + len;
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) return false;
  char line[4096];
  bool found = false;
  while (std::fgets(line, sizeof(line), f)) {
    unsigned long s = 0, e = 0;
    if (std::sscanf(line, "%lx-%lx", &s, &e) != 2 || e <= lo || s >= hi) continue;
    if (std::strstr(line, "vrdma-seg")) found = true;
  }
  std::fclose(f);
  return found;
}

enum class Moving {
  kRegistering,    ///< the workers write while the MR is registered and deregistered
  kDeregistering,  ///< the MR is registered before they write, deregistered while they do
};

// Workers increment their counters in the current region (each counter has one writer) while
// the test registers and/or deregisters an MR on it; each worker counts its increments itself.
// After each round the workers stop and the region must hold every increment they counted.
// Every round takes fresh anonymous pages, so every registration copies and remaps them, and
// every deregistration makes them anonymous memory again.
void expect_no_lost_write(ibv_pd* pd, Moving moving, int max_rounds) {
  std::atomic<uint8_t*> region{nullptr};
  std::atomic<int> round{0}, stop_round{0}, done_count{0};
  std::atomic<bool> quit{false};
  std::atomic<uint64_t> progress[kWorkers] = {};
  uint64_t counted[kWorkers][kPages] = {};  // a worker's own counts, read after it is done

  std::vector<std::thread> workers;
  for (int t = 0; t < kWorkers; ++t) {
    workers.emplace_back([&, t] {
      int seen = 0;
      while (!quit.load(std::memory_order_acquire)) {
        const int r = round.load(std::memory_order_acquire);
        if (r == seen) {
          std::this_thread::yield();
          continue;
        }
        uint8_t* base = region.load(std::memory_order_acquire);
        uint64_t local[kPages] = {};
        while (stop_round.load(std::memory_order_acquire) != r) {
          for (size_t p = 0; p < kPages; ++p) {
            std::atomic_ref<uint64_t> c(*reinterpret_cast<uint64_t*>(base + counter_offset(p, t)));
            c.store(c.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
            ++local[p];
          }
          progress[t].fetch_add(1, std::memory_order_relaxed);
        }
        std::copy(local, local + kPages, counted[t]);
        seen = r;
        done_count.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  }

  const auto start = std::chrono::steady_clock::now();
  uint64_t lost = 0, increments = 0;
  int rounds = 0, still_shared = 0;
  for (; rounds < max_rounds; ++rounds) {
    // A cap, not an assertion: a slow machine runs fewer rounds.
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(4)) break;
    void* m =
        ::mmap(nullptr, kPages * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(m, MAP_FAILED);
    auto* base = static_cast<uint8_t*>(m);
    ibv_mr* mr = nullptr;
    if (moving == Moving::kDeregistering) {
      mr = ibv_reg_mr(pd, base + 256, kPages * kPage - 512, IBV_ACCESS_LOCAL_WRITE);
      ASSERT_NE(mr, nullptr) << std::strerror(errno);
    }
    uint64_t before[kWorkers];
    for (int t = 0; t < kWorkers; ++t) before[t] = progress[t].load(std::memory_order_relaxed);
    region.store(base, std::memory_order_release);
    round.store(rounds + 1, std::memory_order_release);
    // Every worker writes in this region before the pages move.
    for (int t = 0; t < kWorkers; ++t) {
      while (progress[t].load(std::memory_order_relaxed) == before[t]) std::this_thread::yield();
    }
    if (moving == Moving::kRegistering) {
      mr = ibv_reg_mr(pd, base + 256, kPages * kPage - 512, IBV_ACCESS_LOCAL_WRITE);
      ASSERT_NE(mr, nullptr) << std::strerror(errno);
    }
    ASSERT_EQ(ibv_dereg_mr(mr), 0);
    // Still writing: the pages moved under them.
    if (moving == Moving::kDeregistering && in_segment(base, kPages * kPage)) ++still_shared;
    stop_round.store(rounds + 1, std::memory_order_release);
    while (done_count.load(std::memory_order_acquire) != kWorkers * (rounds + 1))
      std::this_thread::yield();
    for (int t = 0; t < kWorkers; ++t) {
      for (size_t p = 0; p < kPages; ++p) {
        const uint64_t got = *reinterpret_cast<uint64_t*>(base + counter_offset(p, t));
        increments += counted[t][p];
        if (got != counted[t][p]) lost += counted[t][p] - got;
      }
    }
    ASSERT_EQ(::munmap(m, kPages * kPage), 0);
  }
  quit.store(true, std::memory_order_release);
  for (auto& w : workers) w.join();
  ::testing::Test::RecordProperty(moving == Moving::kRegistering ? "registrations" : "rounds",
                                  rounds);
  EXPECT_GT(rounds, 0);
  EXPECT_EQ(lost, 0u) << "of " << increments << " increments in " << rounds << " rounds";
  EXPECT_EQ(still_shared, 0) << "rounds whose pages stayed in a segment after deregistration";
}

// TSan holds an asynchronous signal back until the thread enters one of its interceptors: the
// workers of expect_no_lost_write spin in instrumented code only, so none would stop and every
// move of the pages would time out. The release and asan-ubsan builds run these.
#if defined(__SANITIZE_THREAD__)
#define SKIP_UNDER_TSAN()                                                               \
  GTEST_SKIP() << "ThreadSanitizer defers the stop signal of threads that never leave " \
                  "instrumented code"
#else
#define SKIP_UNDER_TSAN() (void)0
#endif

TEST_F(VerbsRegTest, NoWriteIsLostWhileRegistering) {
  SKIP_UNDER_TSAN();
  expect_no_lost_write(pd_, Moving::kRegistering, kRegistrations);
}

// The last deregistration copies the pages into anonymous memory and mremaps it over them: no
// write by another thread may be lost there either (bounded: 500 rounds, 4 s at most).
TEST_F(VerbsRegTest, NoWriteIsLostWhileDeregistering) {
  SKIP_UNDER_TSAN();
  expect_no_lost_write(pd_, Moving::kDeregistering, 500);
}

/// Fills `len` bytes with a pattern of `seed` (no zero page: every page holds data).
void fill(uint8_t* p, size_t len, uint8_t seed) {
  for (size_t i = 0; i < len; ++i) p[i] = static_cast<uint8_t>(seed + i * 7 + (i >> 12));
}
/// Whether bytes [from, to) of `p` still hold fill(p, ..., seed)'s pattern.
bool holds(const uint8_t* p, size_t from, size_t to, uint8_t seed) {
  for (size_t i = from; i < to; ++i)
    if (p[i] != static_cast<uint8_t>(seed + i * 7 + (i >> 12))) return false;
  return true;
}

// After the last deregistration the pages are private anonymous memory again, with their
// contents: MADV_FREE is accepted (EINVAL on shared memory) and MADV_DONTNEED zeroes them (a
// memfd's pages read back their old contents). The old code left them in the segment.
TEST_F(VerbsRegTest, MmapPagesAreAnonymousAgainAfterDeregistration) {
  constexpr size_t kLen = 64 * kPage;
  void* m = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  auto* p = static_cast<uint8_t*>(m);
  fill(p, kLen, 3);
  std::memset(p + 10 * kPage, 0, 4 * kPage);  // zero pages stay zeros
  ibv_mr* mr = ibv_reg_mr(pd_, p + 100, kLen - 200, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  EXPECT_TRUE(in_segment(p, kLen));
  ASSERT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_FALSE(in_segment(p, kLen)) << "still mapped from a vrdma-seg memfd";
  EXPECT_TRUE(holds(p, 0, 10 * kPage, 3));
  for (size_t i = 10 * kPage; i < 14 * kPage; ++i) ASSERT_EQ(p[i], 0) << i;
  EXPECT_TRUE(holds(p, 14 * kPage, kLen, 3));
  // Writable as before.
  p[5] = 0x77;
  EXPECT_EQ(p[5], 0x77);
  EXPECT_EQ(::madvise(p + 32 * kPage, 16 * kPage, MADV_FREE), 0) << std::strerror(errno);
  ASSERT_EQ(::madvise(p, 16 * kPage, MADV_DONTNEED), 0);
  bool zeros = true;
  for (size_t i = 0; i < 16 * kPage; ++i) zeros = zeros && p[i] == 0;
  EXPECT_TRUE(zeros) << "MADV_DONTNEED did not zero the pages";
  // Registered again: a new segment, the same contents.
  fill(p, kLen, 9);
  mr = ibv_reg_mr(pd_, p, kLen, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  EXPECT_TRUE(holds(p, 0, kLen, 9));
  ASSERT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_TRUE(holds(p, 0, kLen, 9));
  EXPECT_FALSE(in_segment(p, kLen));
  ::munmap(m, kLen);
}

// The same for a malloc'd heap buffer (its pages hold malloc's data beside it) and a protection
// that is not read-write; only pages inside the buffer are advised.
TEST_F(VerbsRegTest, MallocPagesAreAnonymousAgainAfterDeregistration) {
  constexpr size_t kLen = 96 * 1024;  // below malloc's mmap threshold: the heap
  auto* p = static_cast<uint8_t*>(std::malloc(kLen));
  ASSERT_NE(p, nullptr);
  fill(p, kLen, 5);
  ibv_mr* mr = ibv_reg_mr(pd_, p, kLen, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  EXPECT_TRUE(in_segment(p, kLen));
  ASSERT_EQ(ibv_dereg_mr(mr), 0);
  // The pages wholly inside the buffer: its first and last page may hold a neighbour that is
  // still registered (the fixture's buffer may be on the heap too), and stay in its segment.
  auto* inner =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + kPage - 1) & ~(kPage - 1));
  EXPECT_FALSE(in_segment(inner, 16 * kPage)) << "still mapped from a vrdma-seg memfd";
  EXPECT_TRUE(holds(p, 0, kLen, 5));
  EXPECT_EQ(::madvise(inner, 4 * kPage, MADV_FREE), 0) << std::strerror(errno);
  ASSERT_EQ(::madvise(inner + 8 * kPage, 4 * kPage, MADV_DONTNEED), 0);
  bool zeros = true;
  for (size_t i = 0; i < 4 * kPage; ++i) zeros = zeros && inner[8 * kPage + i] == 0;
  EXPECT_TRUE(zeros) << "MADV_DONTNEED did not zero the pages";
  std::free(p);
  // Read-only pages stay read-only, with their contents.
  void* m = ::mmap(nullptr, 8 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  fill(static_cast<uint8_t*>(m), 8 * kPage, 11);
  ASSERT_EQ(::mprotect(m, 8 * kPage, PROT_READ), 0);
  mr = ibv_reg_mr(pd_, m, 8 * kPage, 0);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  ASSERT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_FALSE(in_segment(m, 8 * kPage));
  EXPECT_TRUE(holds(static_cast<uint8_t*>(m), 0, 8 * kPage, 11));
  char line[4096];
  bool readonly = false;
  FILE* f = std::fopen("/proc/self/maps", "re");
  ASSERT_NE(f, nullptr);
  while (std::fgets(line, sizeof(line), f)) {
    unsigned long s = 0, e = 0;
    char perms[5] = {};
    if (std::sscanf(line, "%lx-%lx %4s", &s, &e, perms) == 3 &&
        s <= reinterpret_cast<uintptr_t>(m) && e > reinterpret_cast<uintptr_t>(m))
      readonly = std::string(perms) == "r--p";
  }
  std::fclose(f);
  EXPECT_TRUE(readonly);
  ::munmap(m, 8 * kPage);
}

// A small heap buffer shares its pages with the allocator's other chunks, some of them freed:
// registering it copies those pages whole into a segment, and the last deregistration copies
// them back, freed chunks included, as bytes that are never interpreted. ThreadSanitizer reported
// those copies as "heap-use-after-free" (seen under librdmacm's rdma_reg_msgs); the neighbours
// that are still allocated keep their contents and the allocator keeps working.
TEST_F(VerbsRegTest, SmallHeapBufferBesideFreedChunksRegisters) {
  constexpr int kChunks = 256;
  constexpr size_t kChunk = 48;
  std::vector<uint8_t*> chunks(kChunks);
  // Allocates the chunks from `first` on, every `step`th, each with its pattern; then frees the
  // odd ones.
  auto allocate = [&chunks](int first, int step) {
    for (int i = first; i < kChunks; i += step) {
      chunks[i] = static_cast<uint8_t*>(std::malloc(kChunk));
      if (chunks[i]) fill(chunks[i], kChunk, static_cast<uint8_t>(i));
    }
    for (int i = 1; i < kChunks; i += 2) {
      std::free(chunks[i]);
      chunks[i] = nullptr;
    }
  };
  allocate(0, 1);
  for (int i = 0; i < kChunks; i += 2) ASSERT_NE(chunks[i], nullptr);
  uint8_t* const buf = chunks[kChunks / 2];
  ibv_mr* mr = ibv_reg_mr(pd_, buf, kChunk, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  EXPECT_TRUE(in_segment(buf, kChunk));
  // The allocator works on the moved pages: freed chunks are handed out again and freed.
  allocate(1, 2);
  ASSERT_EQ(ibv_dereg_mr(mr), 0);
  for (int i = 0; i < kChunks; i += 2) {
    EXPECT_TRUE(holds(chunks[i], 0, kChunk, static_cast<uint8_t>(i))) << "chunk " << i;
    std::free(chunks[i]);
  }
}

// Two MRs on one segment: the first deregistration leaves the pages in it (the other MR still
// names them); the last makes them anonymous.
TEST_F(VerbsRegTest, PagesStayInTheSegmentWhileAnotherMrNamesThem) {
  constexpr size_t kLen = 16 * kPage;
  void* m = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  auto* p = static_cast<uint8_t*>(m);
  fill(p, kLen, 1);
  ibv_mr* a = ibv_reg_mr(pd_, p, kLen, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(a, nullptr) << std::strerror(errno);
  ibv_mr* b = ibv_reg_mr(pd_, p + kPage, kPage, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(b, nullptr) << std::strerror(errno);
  ASSERT_EQ(ibv_dereg_mr(a), 0);
  EXPECT_TRUE(in_segment(p, kLen));
  ASSERT_EQ(ibv_dereg_mr(b), 0);
  EXPECT_FALSE(in_segment(p, kLen));
  EXPECT_TRUE(holds(p, 0, kLen, 1));
  ::munmap(m, kLen);
}

void expect_refused(ibv_pd* pd, void* buf, size_t len) {
  errno = 0;
  ibv_mr* mr = ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
  EXPECT_EQ(mr, nullptr);
  EXPECT_EQ(errno, EFAULT);
  if (mr) ibv_dereg_mr(mr);
}

// gtest runs tests on the main thread: this buffer is in "[stack]".
TEST_F(VerbsRegTest, MainThreadStackIsRefused) {
  alignas(64) volatile char buf[8192];
  buf[0] = 1;
  expect_refused(pd_, const_cast<char*>(buf), sizeof(buf));
  EXPECT_EQ(buf[0], 1);
}

// A pthread's stack is an anonymous mapping like any other; registering it used to remap the
// registering thread's own stack under it and crash the process.
TEST_F(VerbsRegTest, OwnPthreadStackIsRefused) {
  std::thread([&] {
    alignas(64) volatile char buf[8192];
    buf[100] = 7;
    expect_refused(pd_, const_cast<char*>(buf), sizeof(buf));
    EXPECT_EQ(buf[100], 7);
  }).join();
}

// Another thread's stack, registered while that thread waits (its stack pointer in that mapping).
TEST_F(VerbsRegTest, OtherThreadsStackIsRefused) {
  std::atomic<char*> buf{nullptr};
  std::atomic<bool> leave{false};
  std::thread other([&] {
    alignas(64) char local[8192];
    local[0] = 3;
    buf.store(local, std::memory_order_release);
    while (!leave.load(std::memory_order_acquire)) ::usleep(1000);
    EXPECT_EQ(local[0], 3);
  });
  while (!buf.load(std::memory_order_acquire)) std::this_thread::yield();
  expect_refused(pd_, buf.load(), 8192);
  leave.store(true, std::memory_order_release);
  other.join();
}

// After ibv_fork_init() registered pages are MADV_DONTFORK, as with rdma-core: a child has no
// mapping there (and fork() copies nothing), while the parent keeps its data; once deregistered
// they are inherited again. Without it a child
// gets a private copy (verbs_two_process_test and the e2e tests fork with registered memory).
TEST_F(VerbsRegTest, ForkInitLeavesRegisteredPagesOutOfTheChild) {
  ASSERT_EQ(ibv_fork_init(), 0);
  EXPECT_EQ(ibv_is_fork_initialized(), IBV_FORK_ENABLED);
  constexpr size_t kLen = 4 * kPage;
  void* m = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  std::memset(m, 0x5a, kLen);
  ibv_mr* mr = ibv_reg_mr(pd_, m, kLen, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // mincore fails with ENOMEM on an address with no mapping.
    unsigned char vec[4];
    const bool mapped = ::mincore(m, kLen, vec) == 0 || errno != ENOMEM;
    ::_exit(mapped ? 1 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(static_cast<unsigned char*>(m)[kLen - 1], 0x5a);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  // Deregistered, the pages are anonymous memory again, without MADV_DONTFORK (rdma-core
  // MADV_DOFORKs them at ibv_dereg_mr): a child gets them copy-on-write, with their contents.
  const pid_t child2 = ::fork();
  ASSERT_GE(child2, 0);
  if (child2 == 0) {
    unsigned char vec[4];
    if (::mincore(m, kLen, vec) != 0) ::_exit(1);
    auto* c = static_cast<unsigned char*>(m);
    c[0] = 0x11;  // the child's own copy
    ::_exit(c[kLen - 1] == 0x5a && c[0] == 0x11 ? 0 : 2);
  }
  ASSERT_EQ(::waitpid(child2, &status, 0), child2);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(static_cast<unsigned char*>(m)[0], 0x5a);
  ::munmap(m, kLen);
}

/// A program's initialised static data: in the mapping of the test binary's own file.
alignas(4096) uint8_t g_static_data[3 * kPage] = {1, 2, 3};

/// An RC QP pair on our own LID with a CQ, for RDMA WRITEs into memory under test.
class FileMappingTest : public VerbsRegTest {
 protected:
  void SetUp() override {
    VerbsRegTest::SetUp();
    if (HasFatalFailure()) return;
    cq_ = ibv_create_cq(ctx_, 16, nullptr, nullptr, 0);
    ASSERT_NE(cq_, nullptr);
    cqs_.push_back(cq_);
    auto make = [&] {
      ibv_qp_init_attr a{};
      a.send_cq = a.recv_cq = cq_;
      a.qp_type = IBV_QPT_RC;
      a.cap = {8, 8, 1, 1, 0};
      ibv_qp* qp = ibv_create_qp(pd_, &a);
      EXPECT_NE(qp, nullptr);
      if (qp) qps_.push_back(qp);
      return qp;
    };
    std::tie(a_, b_) = connected_pair(make);
  }

  /// RDMA WRITEs `len` bytes of buf_ (filled with `seed`) to `to` under `rkey`; the status.
  ibv_wc_status write_into(uint64_t to, uint32_t rkey, uint32_t len, uint8_t seed) {
    std::memset(buf_.data(), seed, len);
    Wr w{.op = IBV_WR_RDMA_WRITE, .sges = {sge(0, len)}, .wr_id = seed, .raddr = to, .rkey = rkey};
    EXPECT_EQ(post(a_, w), 0);
    auto wcs = poll(cq_, 1);
    return wcs.empty() ? IBV_WC_GENERAL_ERR : wcs[0].status;
  }

  void TearDown() override {
    for (const std::string& f : files_) ::unlink(f.c_str());
    VerbsRegTest::TearDown();
  }

  /// A temporary file of `pages` pages, each filled with its index + 1 (removed at TearDown:
  /// the library looks at a mapped file by its name).
  int temp_file(size_t pages) {
    char path[] = "/tmp/vrdma-filemap-XXXXXX";
    const int fd = ::mkstemp(path);
    EXPECT_GE(fd, 0);
    files_.push_back(path);
    std::vector<uint8_t> page(kPage);
    for (size_t i = 0; i < pages; ++i) {
      std::memset(page.data(), static_cast<int>(i + 1), kPage);
      EXPECT_EQ(::pwrite(fd, page.data(), kPage, static_cast<off_t>(i * kPage)),
                static_cast<ssize_t>(kPage));
    }
    return fd;
  }

  ibv_cq* cq_ = nullptr;
  ibv_qp *a_ = nullptr, *b_ = nullptr;
  std::vector<std::string> files_;
};

TEST_F(FileMappingTest, StaticDataRegistersAndTakesRdmaWrites) {
  uint8_t* p = g_static_data;
  ibv_mr* mr = ibv_reg_mr(pd_, p + 100, 2 * kPage, IBV_ACCESS_LOCAL_WRITE | kRemote);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  EXPECT_EQ(p[0], 1);
  EXPECT_EQ(p[2], 3);
  EXPECT_EQ(write_into(reinterpret_cast<uintptr_t>(p) + 200, mr->rkey, 1000, 0x42), IBV_WC_SUCCESS);
  EXPECT_EQ(p[200], 0x42);
  EXPECT_EQ(p[1199], 0x42);
  EXPECT_EQ(p[1200], 0);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  p[3] = 9;  // still ordinary writable memory
  EXPECT_EQ(p[200], 0x42);
}

TEST_F(FileMappingTest, PrivateFileMappingRegistersAndTheFileStaysAsItWas) {
  constexpr size_t kPages = 4;
  const int fd = temp_file(kPages);
  ASSERT_GE(fd, 0);
  auto* m = static_cast<uint8_t*>(
      ::mmap(nullptr, kPages * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0));
  ASSERT_NE(m, MAP_FAILED);
  m[0] = 0x77;  // a page the process wrote before
  ibv_mr* mr = ibv_reg_mr(pd_, m + kPage, 2 * kPage, IBV_ACCESS_LOCAL_WRITE | kRemote);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  EXPECT_EQ(write_into(reinterpret_cast<uintptr_t>(m) + kPage + 16, mr->rkey, 64, 0x5c),
            IBV_WC_SUCCESS);
  EXPECT_EQ(m[kPage + 16], 0x5c);
  EXPECT_EQ(m[kPage + 80], 2) << "the rest of the page keeps the file's bytes";
  EXPECT_EQ(m[2 * kPage], 3);
  EXPECT_EQ(m[0], 0x77);
  EXPECT_EQ(m[3 * kPage], 4);
  uint8_t on_disk = 0;
  ASSERT_EQ(::pread(fd, &on_disk, 1, kPage + 16), 1);
  EXPECT_EQ(on_disk, 2) << "MAP_PRIVATE: the file never sees the write";
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(m[kPage + 16], 0x5c);
  ::munmap(m, kPages * kPage);
  ::close(fd);
}

TEST_F(FileMappingTest, SharedFileMappingsAndPagesPastTheEndAreRefused) {
  const int fd = temp_file(2);
  ASSERT_GE(fd, 0);
  void* shared = ::mmap(nullptr, 2 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(shared, MAP_FAILED);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd_, shared, kPage, IBV_ACCESS_LOCAL_WRITE), nullptr);
  EXPECT_EQ(errno, EFAULT);
  ::munmap(shared, 2 * kPage);
  // Four pages of a two-page file: the last two would fault (SIGBUS) when read.
  auto* past =
      static_cast<uint8_t*>(::mmap(nullptr, 4 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0));
  ASSERT_NE(past, MAP_FAILED);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd_, past, 4 * kPage, IBV_ACCESS_LOCAL_WRITE), nullptr);
  EXPECT_EQ(errno, EFAULT);
  ibv_mr* inside = ibv_reg_mr(pd_, past, 2 * kPage, IBV_ACCESS_LOCAL_WRITE);
  EXPECT_NE(inside, nullptr) << "the pages the file has";
  if (inside) {
    EXPECT_EQ(ibv_dereg_mr(inside), 0);
  }
  ::munmap(past, 4 * kPage);
  ::close(fd);
}

}  // namespace
}  // namespace vrdma::test
