// Registered memory: makes the pages of an MR reachable by the backend. Anonymous private
// pages are moved into a sealed memfd ("segment") mapped at the same address, so the guest
// keeps using the same pointers and the backend maps the same pages: the data path is a plain
// memcpy, with no syscall per message (process_vm_writev costs ~3.5 µs per call). Pages that
// are already in a segment are reused. See docs/ARCHITECTURE.md, "Registered memory".
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/log.h"
#include "common/memfd.h"
#include "verbs/internal.h"

namespace vrdma::verbs {
namespace {

constexpr uintptr_t kPage = 4096;
constexpr char kSegPrefix[] = "/memfd:vrdma-seg-";

struct ProcSegment {
  uintptr_t start, end;  ///< where it was made; parts may have been unmapped since
  UniqueFd fd;
};

/// Every segment of this process, by id. Segments are process-wide: several contexts (sessions)
/// may register the same pages.
std::mutex g_segments_mu;
std::map<uint32_t, ProcSegment> g_segments;
uint32_t g_next_segment = 1;

struct Vma {
  uintptr_t start, end;
  uint64_t offset;
  char perms[5];
  std::string path;
};

std::vector<Vma> read_maps(uintptr_t lo, uintptr_t hi) {
  std::vector<Vma> out;
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) return out;
  char line[4096];
  while (std::fgets(line, sizeof(line), f)) {
    Vma v{};
    unsigned long s, e;
    unsigned long long off;
    int pos = 0;
    if (std::sscanf(line, "%lx-%lx %4s %llx %*s %*s %n", &s, &e, v.perms, &off, &pos) < 4) continue;
    if (e <= lo || s >= hi) continue;
    v.start = s;
    v.end = e;
    v.offset = off;
    std::string p = pos ? std::string(line + pos) : std::string();
    while (!p.empty() && (p.back() == '\n' || p.back() == ' ')) p.pop_back();
    v.path = p;
    out.push_back(v);
  }
  std::fclose(f);
  return out;
}

// Whole pages move into a segment, including the bytes around the MR that share its pages (the
// application's other data). Those reads are intended, so the address sanitizer, which would
// see a heap buffer's neighbours, is told not to check them (and memcpy is not used: its
// interceptor would check them anyway).
__attribute__((no_sanitize("address"))) bool page_is_zero(const uint8_t* p) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
  for (size_t i = 0; i < kPage / 8; ++i)
    if (w[i]) return false;
  return true;
}

__attribute__((no_sanitize("address"))) void copy_page(uint8_t* dst, const uint8_t* src) {
  auto* d = reinterpret_cast<uint64_t*>(dst);
  const auto* s = reinterpret_cast<const uint64_t*>(src);
  for (size_t i = 0; i < kPage / 8; ++i) d[i] = s[i];
}

int prot_of(const Vma& v) {
  return (v.perms[0] == 'r' ? PROT_READ : 0) | (v.perms[1] == 'w' ? PROT_WRITE : 0) |
         (v.perms[2] == 'x' ? PROT_EXEC : 0);
}

/// The segment id a mapping of ours shows in /proc/self/maps, or 0 for any other mapping.
uint32_t segment_id(const Vma& v) {
  if (v.path.rfind(kSegPrefix, 0) != 0) return 0;
  return static_cast<uint32_t>(std::strtoul(v.path.c_str() + sizeof(kSegPrefix) - 1, nullptr, 10));
}

/// Drops the segments no page of which is mapped any more (the application unmapped or
/// remapped them: free() of a large buffer, a shrinking heap). A segment that is only partly
/// mapped stays: /proc/self/maps, not the range it was made for, says where it lives now.
void forget_unmapped_segments() {
  std::vector<uint32_t> live;
  for (const Vma& v : read_maps(0, UINTPTR_MAX)) {
    if (uint32_t id = segment_id(v)) live.push_back(id);
  }
  for (auto it = g_segments.begin(); it != g_segments.end();) {
    if (std::find(live.begin(), live.end(), it->first) == live.end()) it = g_segments.erase(it);
    else ++it;
  }
}

/// Moves the anonymous pages [a, b) into a new segment mapped at the same address.
/// Caveat (documented): a write by another thread to these pages while they are copied is lost.
int make_segment(const Vma& v, uintptr_t a, uintptr_t b, uint32_t& id) {
  id = g_next_segment++;
  auto fd = make_sealed_memfd("vrdma-seg-" + std::to_string(id), b - a);
  if (!fd.is_ok()) {
    VLOG_ERROR("reg_mr: {}", fd.status().message());
    return ENOMEM;
  }
  MappedRegion tmp = MappedRegion::map_shared(fd->get(), b - a);
  if (!tmp.valid()) return ENOMEM;
  const bool readable = v.perms[0] == 'r';
  if (!readable && ::mprotect(reinterpret_cast<void*>(a), b - a, PROT_READ) != 0) return EFAULT;
  for (uintptr_t p = a; p < b; p += kPage) {
    const auto* src = reinterpret_cast<const uint8_t*>(p);
    if (!page_is_zero(src)) copy_page(tmp.data() + (p - a), src);
  }
  void* r = ::mmap(reinterpret_cast<void*>(a), b - a, prot_of(v), MAP_SHARED | MAP_FIXED,
                   fd->get(), 0);
  if (r == MAP_FAILED) {
    VLOG_ERROR("reg_mr: remapping {:#x}+{:#x}: {}", a, b - a, std::strerror(errno));
    return EFAULT;
  }
  g_segments[id] = ProcSegment{a, b, std::move(fd.value())};
  forget_unmapped_segments();
  return 0;
}

// fork(): a child must not share the parent's registered pages, which hold whatever else the
// application keeps in them (malloc's chunks and free lists, for one): two processes writing
// one heap corrupt both (seen: glibc's "malloc(): unaligned tcache chunk detected"). The child
// gets private pages with the contents they had at fork(), the snapshot copy-on-write gives it
// of any other memory (and of registered memory with rdma-core without ibv_fork_init). For the
// copy to be that snapshot, the parent waits in its fork handler until the child has copied:
// otherwise it would be changing the pages (and its heap) under the copy. As with rdma-core,
// the child cannot use the parent's verbs objects; its segments are forgotten.
// Cost: the child copies every registered segment once, while the parent waits.
int g_fork_pipe[2] = {-1, -1};

// The mappings to privatize are read from /proc/self/maps (not taken from the ranges the
// segments were made for: the application may have unmapped or replaced parts of those since),
// by the parent before it forks: the child must not allocate before its heap is private, or it
// writes into pages it still shares with the parent.
struct SegMapping {
  uintptr_t start, end;
  int prot;
};
std::vector<SegMapping> g_fork_maps;

void list_segment_mappings() {
  g_fork_maps.clear();
  for (const Vma& v : read_maps(0, UINTPTR_MAX)) {
    if (segment_id(v) != 0) g_fork_maps.push_back({v.start, v.end, prot_of(v)});
  }
}

__attribute__((no_sanitize("address"))) void privatize_segments_in_child() {
  for (const SegMapping& v : g_fork_maps) {
    const size_t len = v.end - v.start;
    const int prot = v.prot;
    void* tmp = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (tmp == MAP_FAILED) continue;  // no memory for a copy: the pages stay shared
    auto* at = reinterpret_cast<uint8_t*>(v.start);
    if (prot & PROT_READ) {
      for (size_t p = 0; p < len; p += kPage) {
        if (!page_is_zero(at + p)) copy_page(static_cast<uint8_t*>(tmp) + p, at + p);
      }
    }
    // mremap puts the private copy in place of the shared mapping in one step.
    if (::mremap(tmp, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, at) == MAP_FAILED) {
      ::munmap(tmp, len);
      continue;
    }
    ::mprotect(at, len, prot);
  }
  g_segments.clear();
}

struct ForkGuard {
  ForkGuard() {
    ::pthread_atfork(
        [] {
          g_segments_mu.lock();
          if (g_segments.empty()) return;
          list_segment_mappings();
          if (::pipe2(g_fork_pipe, O_CLOEXEC) != 0) g_fork_pipe[0] = g_fork_pipe[1] = -1;
        },
        [] {
          if (g_fork_pipe[0] >= 0) {
            ::close(g_fork_pipe[1]);
            char done;
            ssize_t n;
            do {  // returns when the child wrote, or when it died (EOF)
              n = ::read(g_fork_pipe[0], &done, 1);
            } while (n < 0 && errno == EINTR);
            ::close(g_fork_pipe[0]);
            g_fork_pipe[0] = g_fork_pipe[1] = -1;
          }
          g_segments_mu.unlock();
        },
        [] {
          privatize_segments_in_child();
          if (g_fork_pipe[0] >= 0) {
            ::close(g_fork_pipe[0]);
            ssize_t n = ::write(g_fork_pipe[1], "c", 1);
            (void)n;
            ::close(g_fork_pipe[1]);
            g_fork_pipe[0] = g_fork_pipe[1] = -1;
          }
          g_segments_mu.unlock();
        });
  }
};
ForkGuard g_fork_guard;

}  // namespace

int describe_memory(VContext& ctx, void* addr_p, size_t len, proto::RegMrReq& req,
                    std::vector<uint32_t>& segments) {
  const auto addr = reinterpret_cast<uintptr_t>(addr_p);
  if (len == 0 || addr + len < addr) return EINVAL;
  const uintptr_t lo = addr & ~(kPage - 1);
  const uintptr_t hi = (addr + len + kPage - 1) & ~(kPage - 1);
  std::lock_guard<std::mutex> g(g_segments_mu);
  std::vector<Vma> vmas = read_maps(lo, hi);
  uintptr_t cursor = lo;
  req.num_extents = 0;
  for (const Vma& v : vmas) {
    if (v.start > cursor) break;  // a hole
    const uintptr_t a = std::max(v.start, lo), b = std::min(v.end, hi);
    uint32_t id = 0;
    uint64_t seg_off = 0;
    if (segment_id(v) != 0) {
      id = segment_id(v);
      if (!g_segments.count(id)) {
        VLOG_ERROR("reg_mr: unknown segment {}", id);
        return EFAULT;
      }
      seg_off = v.offset + (a - v.start);
    } else if (v.perms[3] == 'p' && (v.path.empty() || v.path == "[heap]")) {
      if (int rc = make_segment(v, a, b, id)) return rc;
      seg_off = 0;
    } else {
      VLOG_ERROR("reg_mr: memory at {:#x} ({} {}) is not anonymous private memory; vrdma cannot "
                 "register it yet", a, v.perms, v.path);
      return EFAULT;
    }
    if (req.num_extents == proto::kMaxMrExtents) {
      VLOG_ERROR("reg_mr: range spans more than {} mappings", proto::kMaxMrExtents);
      return EINVAL;
    }
    // This context's backend session must know the segment.
    auto known = ctx.segments.find(id);
    if (known == ctx.segments.end()) {
      const ProcSegment& ps = g_segments[id];
      proto::RegSegmentReq sreq{ps.end - ps.start};
      proto::HandleResp sresp{};
      int fd = ps.fd.get();
      if (int rc = ctx.call(proto::Op::kRegSegment, sreq, sresp, std::span<const int>(&fd, 1)))
        return rc;
      known = ctx.segments.emplace(id, VContext::SessionSegment{sresp.handle, 0}).first;
    }
    // Counted before the MR exists: a deregistration on another thread must not release it
    // between here and kRegMr.
    known->second.uses++;
    segments.push_back(id);
    const uintptr_t x = std::max(a, addr), y = std::min(b, addr + len);
    proto::MrExtent& e = req.extents[req.num_extents++];
    e.mr_offset = x - addr;
    e.length = y - x;
    e.seg_offset = seg_off + (x - a);
    e.segment = known->second.handle;
    cursor = b;
  }
  if (cursor < hi) {
    VLOG_ERROR("reg_mr: {:#x}+{:#x} is not fully mapped", addr, len);
    return EFAULT;
  }
  return 0;
}

void release_segments(VContext& ctx, const std::vector<uint32_t>& segments) {
  std::vector<uint32_t> unused;
  {
    std::lock_guard<std::mutex> g(g_segments_mu);
    for (uint32_t id : segments) {
      auto it = ctx.segments.find(id);
      if (it == ctx.segments.end() || --it->second.uses != 0) continue;
      unused.push_back(it->second.handle);
      ctx.segments.erase(it);
    }
  }
  // Outside the lock: another thread registering the same pages meanwhile finds no handle and
  // registers the segment again, under a new one. The pages stay in the process's segment (they
  // are the application's memory); only the session lets go of them.
  for (uint32_t h : unused) {
    proto::HandleReq req{h, 0};
    proto::Empty resp;
    if (int rc = ctx.call(proto::Op::kDeregSegment, &req, sizeof(req), &resp, 0))
      VLOG_WARN("releasing segment {}: {}", h, std::strerror(rc));
  }
}

}  // namespace vrdma::verbs
