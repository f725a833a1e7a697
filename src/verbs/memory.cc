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
#include <string_view>
#include <vector>

#include "common/log.h"
#include "common/memfd.h"
#include "verbs/internal.h"
#include "verbs/stop_world.h"

namespace vrdma::verbs {
namespace {

constexpr uintptr_t kPage = 4096;
constexpr char kSegPrefix[] = "/memfd:vrdma-seg-";

struct ProcSegment {
  uintptr_t start, end;  ///< where it was made; parts may have been unmapped since
  UniqueFd fd;
  bool dontfork = false;  ///< MADV_DONTFORK (fork_safe()): a child gets none of it
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

/// A piece of an MR's page range inside one mapping of /proc/self/maps.
struct Piece {
  Vma v;
  uintptr_t a, b;  ///< the part of v the MR's pages cover
  uint32_t id;     ///< its segment; 0 while it is anonymous memory still to be moved into one
};

enum class Recheck { kSame, kChanged, kOnStack, kTooBig };

/// Reads /proc/self/maps into `buf` again (the threads stopped: no allocation) and checks that
/// each piece still lies in anonymous private mappings with the permissions read before (another
/// thread may have unmapped or replaced them meanwhile), none of which holds a stack pointer in
/// `sps`. `*bad` is the piece that failed, `*bad_sp` the stack pointer.
template <typename Pieces>
Recheck recheck_maps(std::vector<char>& buf, const Pieces& pieces, std::span<const uintptr_t> sps,
                     const Piece** bad, uintptr_t* bad_sp) {
  *bad = pieces.front();
  const int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Recheck::kChanged;
  size_t n = 0;
  for (ssize_t r; n < buf.size() && (r = ::read(fd, buf.data() + n, buf.size() - n)) != 0;) {
    if (r < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      return Recheck::kChanged;
    }
    n += static_cast<size_t>(r);
  }
  ::close(fd);
  if (n == buf.size()) return Recheck::kTooBig;
  for (const Piece* p : pieces) {
    *bad = p;
    uintptr_t covered = p->a;
    for (size_t at = 0; at < n;) {
      const char* line = buf.data() + at;
      const char* eol = static_cast<const char*>(std::memchr(line, '\n', n - at));
      const size_t len = eol ? static_cast<size_t>(eol - line) : n - at;
      at += len + 1;
      // "start-end perms offset dev inode   path"
      const char* c = line;
      auto hex = [&c] {
        uintptr_t v = 0;
        for (;; ++c) {
          const int d = *c >= '0' && *c <= '9'   ? *c - '0'
                        : *c >= 'a' && *c <= 'f' ? *c - 'a' + 10
                                                 : -1;
          if (d < 0) return v;
          v = v << 4 | static_cast<uintptr_t>(d);
        }
      };
      const uintptr_t start = hex();
      ++c;
      const uintptr_t end = hex();
      if (end <= p->a || start >= p->b) continue;
      for (uintptr_t sp : sps) {
        if (sp >= start && sp < end) {
          *bad_sp = sp;
          return Recheck::kOnStack;
        }
      }
      const char* perms = c + 1;
      // The path is the sixth field; fields are separated by spaces.
      const char* path = perms;
      for (int field = 0; field < 4 && path < line + len; ++path)
        if (*path == ' ' && path[1] != ' ') ++field;
      while (path < line + len && *path == ' ') ++path;
      const std::string_view name(path, static_cast<size_t>(line + len - path));
      if (start > covered || std::memcmp(perms, p->v.perms, 4) != 0 || name != p->v.path)
        return Recheck::kChanged;
      covered = end;
    }
    if (covered < p->b) return Recheck::kChanged;
  }
  return Recheck::kSame;
}

/// Moves the anonymous pieces (id 0) into new segments mapped at the same addresses, with the
/// process's other threads stopped (stop_world.h), so that no write to these pages (the MR's
/// or its neighbours') is lost between the copy and the remap. A piece in a mapping that holds
/// a thread's stack pointer is refused (EFAULT): the thread writes there all the time.
int make_segments(std::vector<Piece>& pieces) {
  struct Fresh {
    Piece* piece;
    uint32_t id;
    UniqueFd fd;
    MappedRegion copy;  ///< the memfd, mapped here for the copy
  };
  std::vector<Fresh> fresh;
  // Everything that allocates is prepared before the threads stop (one may hold malloc's lock).
  for (Piece& p : pieces) {
    if (p.id != 0) continue;
    const uint32_t id = g_next_segment++;
    auto fd = make_sealed_memfd("vrdma-seg-" + std::to_string(id), p.b - p.a);
    if (!fd.is_ok()) {
      VLOG_ERROR("reg_mr: {}", fd.status().message());
      return ENOMEM;
    }
    MappedRegion copy = MappedRegion::map_shared(fd->get(), p.b - p.a);
    if (!copy.valid()) return ENOMEM;
    fresh.push_back(Fresh{&p, id, std::move(fd.value()), std::move(copy)});
  }
  if (fresh.empty()) return 0;
  std::vector<const Piece*> checked;
  for (const Fresh& f : fresh) checked.push_back(f.piece);
  std::vector<char> maps(size_t{1} << 20);
  WorldStop world;
  Recheck now = Recheck::kTooBig;
  const Piece* bad = nullptr;
  uintptr_t stack_sp = 0;
  for (;;) {
    if (int rc = world.stop()) return rc;
    // Stopped: system calls and the memory prepared above only (no allocation, no log).
    now = recheck_maps(maps, checked, world.stack_pointers(), &bad, &stack_sp);
    if (now != Recheck::kTooBig || maps.size() >= (size_t{64} << 20)) break;
    world.release();
    maps.resize(maps.size() * 4);
  }
  const Piece* on_stack = now == Recheck::kOnStack ? bad : nullptr;
  if (now == Recheck::kTooBig) {
    world.release();
    VLOG_ERROR("reg_mr: /proc/self/maps is larger than {} bytes; cannot check it", maps.size());
    return ENOMEM;
  }
  if (now == Recheck::kChanged) {
    world.release();
    VLOG_ERROR(
        "reg_mr: the mappings of {:#x}+{:#x} changed during the registration (another "
        "thread unmapped or replaced them)",
        bad->a, bad->b - bad->a);
    return EFAULT;
  }
  size_t done = 0;
  int failed_errno = 0;
  for (; !on_stack && done < fresh.size(); ++done) {
    const Piece& p = *fresh[done].piece;
    if (p.v.perms[0] != 'r' &&
        ::mprotect(reinterpret_cast<void*>(p.a), p.b - p.a, PROT_READ) != 0) {
      failed_errno = errno;
      break;
    }
    for (uintptr_t at = p.a; at < p.b; at += kPage) {
      const auto* src = reinterpret_cast<const uint8_t*>(at);
      if (!page_is_zero(src)) copy_page(fresh[done].copy.data() + (at - p.a), src);
    }
    if (::mmap(reinterpret_cast<void*>(p.a), p.b - p.a, prot_of(p.v), MAP_SHARED | MAP_FIXED,
               fresh[done].fd.get(), 0) == MAP_FAILED) {
      failed_errno = errno;
      ::mprotect(reinterpret_cast<void*>(p.a), p.b - p.a, prot_of(p.v));
      break;
    }
  }
  world.release();
  for (size_t i = 0; i < done; ++i) {
    Piece& p = *fresh[i].piece;
    p.id = fresh[i].id;
    // As rdma-core's ibv_fork_init: a child does not get registered pages (nor a copy of them).
    const bool dontfork =
        fork_safe() && ::madvise(reinterpret_cast<void*>(p.a), p.b - p.a, MADV_DONTFORK) == 0;
    g_segments[p.id] = ProcSegment{p.a, p.b, std::move(fresh[i].fd), dontfork};
  }
  if (on_stack) {
    VLOG_ERROR(
        "reg_mr: {:#x}+{:#x} is in the mapping {:#x}-{:#x} that holds a thread's stack "
        "(stack pointer {:#x}); stacks cannot be registered",
        on_stack->a, on_stack->b - on_stack->a, on_stack->v.start, on_stack->v.end, stack_sp);
    return EFAULT;
  }
  if (done < fresh.size()) {
    const Piece& p = *fresh[done].piece;
    VLOG_ERROR("reg_mr: remapping {:#x}+{:#x}: {}", p.a, p.b - p.a, std::strerror(failed_errno));
    return EFAULT;
  }
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
// Cost: the child copies every registered segment once, while the parent waits. Not with
// fork_safe() (ibv_fork_init, RDMAV_FORK_SAFE): segments made then are MADV_DONTFORK, the child
// gets no mapping there at all (as with rdma-core, which MADV_DONTFORKs an MR's pages), and
// nothing is copied; the bytes beside an MR in its pages vanish from the child with them.
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
    const uint32_t id = segment_id(v);
    auto it = g_segments.find(id);
    if (id != 0 && (it == g_segments.end() || !it->second.dontfork))
      g_fork_maps.push_back({v.start, v.end, prot_of(v)});
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
          if (g_fork_maps.empty()) return;  // all MADV_DONTFORK: nothing to copy
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
  // First what the range is made of, then new segments for its anonymous pieces (all at once,
  // one stop of the other threads), then each extent.
  std::vector<Piece> pieces;
  uintptr_t cursor = lo;
  for (const Vma& v : read_maps(lo, hi)) {
    if (v.start > cursor) break;  // a hole
    Piece p{v, std::max(v.start, lo), std::min(v.end, hi), segment_id(v)};
    if (p.id != 0) {
      if (!g_segments.count(p.id)) {
        VLOG_ERROR("reg_mr: unknown segment {}", p.id);
        return EFAULT;
      }
    } else if (v.path == "[stack]") {
      VLOG_ERROR("reg_mr: {:#x} is on the main thread's stack; stacks cannot be registered", p.a);
      return EFAULT;
    } else if (v.perms[3] != 'p' || !(v.path.empty() || v.path == "[heap]")) {
      VLOG_ERROR(
          "reg_mr: memory at {:#x} ({} {}) is not anonymous private memory; vrdma cannot "
          "register it yet",
          p.a, v.perms, v.path);
      return EFAULT;
    }
    if (pieces.size() == proto::kMaxMrExtents) {
      VLOG_ERROR("reg_mr: range spans more than {} mappings", proto::kMaxMrExtents);
      return EINVAL;
    }
    pieces.push_back(p);
    cursor = p.b;
  }
  if (cursor < hi) {
    VLOG_ERROR("reg_mr: {:#x}+{:#x} is not fully mapped", addr, len);
    return EFAULT;
  }
  if (int rc = make_segments(pieces)) return rc;
  req.num_extents = 0;
  for (const Piece& p : pieces) {
    // A new segment starts at p.a; in an existing one, the mapping says where p.a is.
    const uint64_t seg_off = segment_id(p.v) != 0 ? p.v.offset + (p.a - p.v.start) : 0;
    const uint32_t id = p.id;
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
    const uintptr_t x = std::max(p.a, addr), y = std::min(p.b, addr + len);
    proto::MrExtent& e = req.extents[req.num_extents++];
    e.mr_offset = x - addr;
    e.length = y - x;
    e.seg_offset = seg_off + (x - p.a);
    e.segment = known->second.handle;
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
