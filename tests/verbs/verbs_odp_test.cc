// On-demand paging (issue 24): ODP MRs, explicit and implicit, registered without pages (a
// 64 GiB reservation costs no memory and no segment), faulted in page by page when a WQE, a
// peer's request or ibv_advise_mr touches them; a page that is not mapped gives the error
// completion (local protection, remote access); odp_caps says so. docs/ARCHITECTURE.md, "On-demand
// paging".
#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "verbs_fixture.h"

namespace vrdma::test {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kReserved = size_t{64} << 30;  ///< 64 GiB of address space, no memory

/// The bytes of [addr, addr+len) mapped from the library's segments (`vrdma-seg` memfds),
/// according to /proc/self/maps.
size_t segment_bytes(const void* addr, size_t len) {
  const auto lo = reinterpret_cast<uintptr_t>(addr), hi = lo + len;
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) return 0;
  char line[4096];
  size_t bytes = 0;
  while (std::fgets(line, sizeof(line), f)) {
    unsigned long s = 0, e = 0;
    if (std::sscanf(line, "%lx-%lx", &s, &e) != 2 || e <= lo || s >= hi) continue;
    if (std::strstr(line, "vrdma-seg")) bytes += std::min<uintptr_t>(e, hi) - std::max(s, lo);
  }
  std::fclose(f);
  return bytes;
}

/// Threads of this process asleep in poll on one descriptor with no timeout, by
/// /proc/self/task/*/syscall (poll: 7 with an int timeout of -1, ppoll: 271 with a null one).
int threads_polling_forever() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/task");
  if (!d) return 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    FILE* f = std::fopen(("/proc/self/task/" + std::string(e->d_name) + "/syscall").c_str(), "re");
    if (!f) continue;
    long nr = -1;
    unsigned long long fds = 0, nfds = 0, timeout = 0;
    if (std::fscanf(f, "%ld %llx %llx %llx", &nr, &fds, &nfds, &timeout) == 4 && nfds == 1 &&
        ((nr == 7 && static_cast<int>(timeout) == -1) || (nr == 271 && timeout == 0)))
      ++n;
    std::fclose(f);
  }
  ::closedir(d);
  return n;
}

class VerbsOdpTest : public VerbsFixture {
 protected:
  void SetUp() override {
    VerbsFixture::SetUp();
    // One CQ per QP: a_'s completions (the requester's) apart from b_'s (the receiver's).
    std::tie(a_, b_) = connected_pair([&] {
      ibv_cq* cq = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
      EXPECT_NE(cq, nullptr);
      cqs_.push_back(cq);
      ibv_qp_init_attr ia{};
      ia.send_cq = ia.recv_cq = cq;
      ia.qp_type = IBV_QPT_RC;
      ia.cap.max_send_wr = ia.cap.max_recv_wr = 16;
      ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
      ibv_qp* qp = ibv_create_qp(pd_, &ia);
      EXPECT_NE(qp, nullptr);
      qps_.push_back(qp);
      return qp;
    });
  }
  void TearDown() override {
    for (ibv_mr* m : odp_) EXPECT_EQ(ibv_dereg_mr(m), 0);
    VerbsFixture::TearDown();
    if (reserved_) ::munmap(reserved_, kReserved);
  }

  ibv_mr* reg_odp(void* addr, size_t len, unsigned access = IBV_ACCESS_LOCAL_WRITE | kRemote) {
    ibv_mr* m = ibv_reg_mr(pd_, addr, len, static_cast<int>(access | IBV_ACCESS_ON_DEMAND));
    EXPECT_NE(m, nullptr) << std::strerror(errno);
    if (m) odp_.push_back(m);
    return m;
  }

  uint8_t* reserve() {
    void* p =
        ::mmap(nullptr, kReserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    EXPECT_NE(p, MAP_FAILED);
    reserved_ = static_cast<uint8_t*>(p);
    return reserved_;
  }

  /// 64 GiB reserved and registered as one ODP MR (`*m`), with `pages` made usable (never
  /// touched) at `gib` GiB into it: their address.
  uint8_t* usable_part(ibv_mr** m, size_t gib, size_t pages) {
    uint8_t* r = reserve();
    *m = reg_odp(r, kReserved);
    uint8_t* part = r + (gib << 30);
    EXPECT_EQ(::mprotect(part, pages * kPage, PROT_READ | PROT_WRITE), 0);
    return part;
  }

  /// One signaled WR on a_ (SEND, or WRITE/READ to raddr/rkey) of [addr, addr+len) under lkey.
  ibv_wc one(ibv_wr_opcode op, uint64_t addr, uint32_t len, uint32_t lkey, uint64_t raddr = 0,
             uint32_t rkey = 0) {
    Wr w;
    w.op = op;
    w.sges = {ibv_sge{addr, len, lkey}};
    w.raddr = raddr;
    w.rkey = rkey;
    EXPECT_EQ(post(a_, w), 0);
    auto wc = poll(a_->send_cq, 1);
    EXPECT_EQ(wc.size(), 1u);
    return wc.empty() ? ibv_wc{} : wc[0];
  }

  ibv_qp *a_ = nullptr, *b_ = nullptr;
  std::vector<ibv_mr*> odp_;
  uint8_t* reserved_ = nullptr;
};

TEST_F(VerbsOdpTest, QueryDeviceExAdvertisesOdp) {
  ibv_device_attr_ex attr{};
  ASSERT_EQ(ibv_query_device_ex(ctx_, nullptr, &attr), 0);
  EXPECT_EQ(attr.odp_caps.general_caps, uint64_t{IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT});
  constexpr uint32_t kAll = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE |
                            IBV_ODP_SUPPORT_READ | IBV_ODP_SUPPORT_ATOMIC |
                            IBV_ODP_SUPPORT_SRQ_RECV;
  EXPECT_EQ(attr.odp_caps.per_transport_caps.rc_odp_caps, kAll);
  EXPECT_NE(attr.odp_caps.per_transport_caps.uc_odp_caps & IBV_ODP_SUPPORT_WRITE, 0u);
  EXPECT_NE(attr.odp_caps.per_transport_caps.ud_odp_caps & IBV_ODP_SUPPORT_SEND, 0u);
}

// 64 GiB of reserved address space registers without a segment or a page of memory; pages
// made usable later and sent from are faulted in, those pages only.
TEST_F(VerbsOdpTest, SixtyFourGibReservedRegistersWithoutMemoryAndFaultsInWhatIsTouched) {
  uint8_t* r = reserve();
  ibv_mr* m = reg_odp(r, kReserved);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->length, kReserved);
  EXPECT_EQ(segment_bytes(r, kReserved), 0u);
  // Touched partly: 1 MiB at 10 GiB made writable and written after the registration.
  uint8_t* part = r + (size_t{10} << 30);
  ASSERT_EQ(::mprotect(part, 1 << 20, PROT_READ | PROT_WRITE), 0);
  std::memset(part, 0x6f, 1 << 20);
  ASSERT_EQ(post_recv(b_, 7, 0, 3 * kPage), 0);
  const ibv_wc s = one(IBV_WR_SEND, reinterpret_cast<uintptr_t>(part + 100), 2 * kPage, m->lkey);
  EXPECT_EQ(s.status, IBV_WC_SUCCESS) << ibv_wc_status_str(s.status);
  auto rx = poll(b_->recv_cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(buf_[0], 0x6f);
  EXPECT_EQ(buf_[2 * kPage - 1], 0x6f);
  // The three pages the SGE touched, nothing else.
  EXPECT_EQ(segment_bytes(r, kReserved), 3 * kPage);
  // A peer's WRITE into pages faulted in works; into pages never touched it is a remote
  // access error (the reservation is PROT_NONE there).
  std::memset(buf_.data(), 0x44, 64);
  const ibv_wc w = one(IBV_WR_RDMA_WRITE, addr(0), 64, mr_->lkey,
                       reinterpret_cast<uintptr_t>(part + kPage), m->rkey);
  EXPECT_EQ(w.status, IBV_WC_SUCCESS) << ibv_wc_status_str(w.status);
  EXPECT_EQ(part[kPage], 0x44);
  EXPECT_EQ(part[kPage + 64], 0x6f);
}

TEST_F(VerbsOdpTest, UnmappedPagesGiveTheErrorCompletions) {
  uint8_t* r = reserve();
  ibv_mr* m = reg_odp(r, kReserved);
  ASSERT_NE(m, nullptr);
  // A send from a page that is not mapped (PROT_NONE): local protection error.
  const ibv_wc s = one(IBV_WR_SEND, reinterpret_cast<uintptr_t>(r + 5 * kPage), 64, m->lkey);
  EXPECT_EQ(s.status, IBV_WC_LOC_PROT_ERR) << ibv_wc_status_str(s.status);
  EXPECT_EQ(segment_bytes(r, kReserved), 0u);
}

TEST_F(VerbsOdpTest, RemoteWriteIntoPagesNeverTouchedIsARemoteAccessError) {
  uint8_t* r = reserve();
  ibv_mr* m = reg_odp(r, kReserved);
  ASSERT_NE(m, nullptr);
  const ibv_wc w =
      one(IBV_WR_RDMA_WRITE, addr(0), 64, mr_->lkey, reinterpret_cast<uintptr_t>(r), m->rkey);
  EXPECT_EQ(w.status, IBV_WC_REM_ACCESS_ERR) << ibv_wc_status_str(w.status);
}

// Implicit ODP: the whole address space under one key; any buffer of the process is reachable
// when a WQE names it.
TEST_F(VerbsOdpTest, ImplicitOdpReachesAnyBufferAWqeNames) {
  ibv_mr* m = ibv_reg_mr(pd_, nullptr, SIZE_MAX, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND);
  ASSERT_NE(m, nullptr) << std::strerror(errno);
  odp_.push_back(m);
  EXPECT_EQ(m->addr, nullptr);
  EXPECT_EQ(m->length, SIZE_MAX);
  std::vector<uint8_t> src(3 * kPage, 0x33), dst(3 * kPage, 0);
  ibv_sge rs{reinterpret_cast<uintptr_t>(dst.data()), static_cast<uint32_t>(dst.size()), m->lkey};
  ibv_recv_wr rwr{};
  rwr.wr_id = 1;
  rwr.sg_list = &rs;
  rwr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_recv(b_, &rwr, &bad), 0);
  const ibv_wc s = one(IBV_WR_SEND, reinterpret_cast<uintptr_t>(src.data()), src.size(), m->lkey);
  EXPECT_EQ(s.status, IBV_WC_SUCCESS) << ibv_wc_status_str(s.status);
  auto rx = poll(b_->recv_cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(dst, src);
  // An implicit MR is what the name says: NULL with SIZE_MAX only.
  EXPECT_EQ(ibv_reg_mr(pd_, nullptr, 4096, IBV_ACCESS_ON_DEMAND), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

// ibv_advise_mr prefetches pages into an ODP MR: a peer's WRITE then reaches them without any
// local WQE having touched them. Its errors: a key that is not an ODP MR, a range outside the
// MR, unknown flags (EINVAL); pages that are not mapped (EFAULT).
TEST_F(VerbsOdpTest, AdviseMrPrefetchesAndRefusesWhatItCannot) {
  ibv_mr* m = nullptr;
  uint8_t* part = usable_part(&m, 3, 4);
  ASSERT_NE(m, nullptr);
  uint8_t* r = reserved_;
  ibv_sge sg{reinterpret_cast<uintptr_t>(part), static_cast<uint32_t>(2 * kPage), m->lkey};
  EXPECT_EQ(
      ibv_advise_mr(pd_, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IBV_ADVISE_MR_FLAG_FLUSH, &sg, 1), 0);
  EXPECT_EQ(segment_bytes(r, kReserved), 2 * kPage);
  std::memset(buf_.data(), 0x21, 64);
  const ibv_wc w = one(IBV_WR_RDMA_WRITE, addr(0), 64, mr_->lkey,
                       reinterpret_cast<uintptr_t>(part + kPage), m->rkey);
  EXPECT_EQ(w.status, IBV_WC_SUCCESS) << ibv_wc_status_str(w.status);
  EXPECT_EQ(part[kPage + 63], 0x21);
  // Errors.
  ibv_sge normal{addr(0), 64, mr_->lkey};
  EXPECT_EQ(ibv_advise_mr(pd_, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &normal, 1), EINVAL);
  EXPECT_EQ(ibv_advise_mr(pd_, IBV_ADVISE_MR_ADVICE_PREFETCH, 1u << 5, &sg, 1), EINVAL);
  ibv_sge outside{reinterpret_cast<uintptr_t>(r) - kPage, 64, m->lkey};
  EXPECT_EQ(ibv_advise_mr(pd_, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &outside, 1), EINVAL);
  ibv_sge unmapped{reinterpret_cast<uintptr_t>(r), 64, m->lkey};
  EXPECT_EQ(ibv_advise_mr(pd_, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &unmapped, 1), EFAULT);
  // NO_FAULT maps what is resident only: the two untouched pages of `part` stay out.
  ibv_sge rest{reinterpret_cast<uintptr_t>(part + 2 * kPage), static_cast<uint32_t>(2 * kPage),
               m->lkey};
  EXPECT_EQ(ibv_advise_mr(pd_, IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT, 0, &rest, 1), 0);
  EXPECT_EQ(segment_bytes(r, kReserved), 2 * kPage);
}

// A peer's WRITE and READ into pages of an ODP MR that no local WQE touched: the backend asks
// the library's pager, the requester waits as for an RNR NAK meanwhile, and the pages that
// request touched (those only) become reachable.
TEST_F(VerbsOdpTest, PeersFaultInPagesNeverTouchedLocally) {
  const int sleeping = threads_polling_forever();
  ibv_mr* m = nullptr;
  uint8_t* part = usable_part(&m, 7, 8);
  ASSERT_NE(m, nullptr);
  uint8_t* r = reserved_;
  std::memset(buf_.data(), 0x5e, 64);
  const ibv_wc w = one(IBV_WR_RDMA_WRITE, addr(0), 64, mr_->lkey,
                       reinterpret_cast<uintptr_t>(part + 3 * kPage + 8), m->rkey);
  EXPECT_EQ(w.status, IBV_WC_SUCCESS) << ibv_wc_status_str(w.status);
  EXPECT_EQ(part[3 * kPage + 8], 0x5e);
  EXPECT_EQ(part[3 * kPage + 71], 0x5e);
  EXPECT_EQ(segment_bytes(r, kReserved), kPage);
  part[6 * kPage] = 0x17;  // written by the application, never by a WQE
  const ibv_wc rd = one(IBV_WR_RDMA_READ, addr(100), 1, mr_->lkey,
                        reinterpret_cast<uintptr_t>(part + 6 * kPage), m->rkey);
  EXPECT_EQ(rd.status, IBV_WC_SUCCESS) << ibv_wc_status_str(rd.status);
  EXPECT_EQ(buf_[100], 0x17);
  EXPECT_EQ(segment_bytes(r, kReserved), 2 * kPage);
  // The pager sleeps until the backend wakes it (no 1 ms poll): one more thread in poll with
  // no timeout. Looked at until seen (it may be answering or about to sleep at any one look).
  bool asleep = false;
  for (int i = 0; i < 2000 && !asleep; ++i) {
    asleep = threads_polling_forever() > sleeping;
    if (!asleep) ::usleep(1000);
  }
  EXPECT_TRUE(asleep) << "the pager does not sleep in poll without a timeout";
}

// A page the application maps read-only: an ODP MR that only peers' READs reach (REMOTE_READ)
// takes it, a READ gets its bytes; an MR that can be written (write or atomic access) does not,
// so a peer's WRITE into it is a remote access error and the page keeps its bytes (the pager
// faults pages of a writable MR in for writing, as the kernel's ODP does).
TEST_F(VerbsOdpTest, PeersCannotWriteIntoPagesTheApplicationMapsReadOnly) {
  uint8_t* r = reserve();
  uint8_t* page = r + (size_t{5} << 30);
  ASSERT_EQ(::mprotect(page, kPage, PROT_READ | PROT_WRITE), 0);
  std::memset(page, 0x33, kPage);
  ASSERT_EQ(::mprotect(page, kPage, PROT_READ), 0);
  ibv_mr* ro = reg_odp(page, kPage, IBV_ACCESS_REMOTE_READ);
  ibv_mr* rw = reg_odp(r, kReserved);
  ASSERT_NE(ro, nullptr);
  ASSERT_NE(rw, nullptr);
  const ibv_wc rd =
      one(IBV_WR_RDMA_READ, addr(200), 8, mr_->lkey, reinterpret_cast<uintptr_t>(page), ro->rkey);
  EXPECT_EQ(rd.status, IBV_WC_SUCCESS) << ibv_wc_status_str(rd.status);
  EXPECT_EQ(buf_[207], 0x33);
  std::memset(buf_.data(), 0x5e, 64);
  const ibv_wc w = one(IBV_WR_RDMA_WRITE, addr(0), 64, mr_->lkey,
                       reinterpret_cast<uintptr_t>(page + 8), rw->rkey);
  EXPECT_EQ(w.status, IBV_WC_REM_ACCESS_ERR) << ibv_wc_status_str(w.status);
  EXPECT_EQ(page[8], 0x33);
  EXPECT_EQ(page[71], 0x33);
  // Deregistration gives the segments back: the page is private memory again, bytes kept.
  EXPECT_GT(segment_bytes(r, kReserved), 0u);
  EXPECT_EQ(ibv_dereg_mr(ro), 0);
  EXPECT_EQ(ibv_dereg_mr(rw), 0);
  odp_.clear();
  EXPECT_EQ(segment_bytes(r, kReserved), 0u);
  EXPECT_EQ(page[8], 0x33);
}

}  // namespace
}  // namespace vrdma::test
