// Registered memory: makes the pages of an MR reachable by the backend. Anonymous private
// pages, and those of private file mappings that are not code (registrable), are moved into a
// sealed memfd ("segment") mapped at the same address, so the guest
// keeps using the same pointers and the backend maps the same pages: the data path is a plain
// memcpy, with no syscall per message (process_vm_writev costs ~3.5 µs per call). Pages that
// are already in a segment are reused. When no MR names a segment any more, what the
// application still maps of it becomes anonymous private memory again (make_anonymous). See
// docs/ARCHITECTURE.md, "Registered memory".
// long-file: the segment machinery (making, reusing, undoing segments, and the /proc/self/maps
// reading it does with the other threads stopped) shares its invariants; ODP is in odp.cc.
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
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
  /// MR extents of every context that name it (the sum of the contexts' SessionSegment::uses):
  /// at zero its pages become anonymous memory again (make_anonymous).
  uint32_t uses = 0;
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
// application's other data, and the allocator's free chunks there). Those reads are intended, so
// the sanitizers are told not to check them (and memcpy is not used: its interceptor would check
// them anyway): the address sanitizer would see a heap buffer's neighbours, and ThreadSanitizer
// reports every read of a freed chunk as a "heap-use-after-free", even on the thread that freed
// it. These reads never interpret the bytes, and the other threads are stopped (stop_world.h,
// whose atomics order their earlier writes before the copy).
__attribute__((no_sanitize("address", "thread"))) bool page_is_zero(const uint8_t* p) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
  for (size_t i = 0; i < kPage / 8; ++i)
    if (w[i]) return false;
  return true;
}

__attribute__((no_sanitize("address", "thread"))) void copy_page(uint8_t* dst, const uint8_t* src) {
  auto* d = reinterpret_cast<uint64_t*>(dst);
  const auto* s = reinterpret_cast<const uint64_t*>(src);
  for (size_t i = 0; i < kPage / 8; ++i) d[i] = s[i];
}

int prot_of(const Vma& v) {
  return (v.perms[0] == 'r' ? PROT_READ : 0) | (v.perms[1] == 'w' ? PROT_WRITE : 0) |
         (v.perms[2] == 'x' ? PROT_EXEC : 0);
}

/// The segment id in the path of a mapping of /proc/self/maps, or 0.
uint32_t segment_id(std::string_view path) {
  constexpr std::string_view prefix(kSegPrefix);
  if (path.substr(0, prefix.size()) != prefix) return 0;
  uint32_t id = 0;
  for (size_t i = prefix.size(); i < path.size() && path[i] >= '0' && path[i] <= '9'; ++i)
    id = id * 10 + static_cast<uint32_t>(path[i] - '0');
  return id;
}

/// The segment id a mapping of ours shows in /proc/self/maps, or 0 for any other mapping.
uint32_t segment_id(const Vma& v) { return segment_id(std::string_view(v.path)); }

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

/// Reads /proc/self/maps into `buf` without allocating (the threads may be stopped): its length,
/// or -1 when it cannot be read, or buf.size() when it did not fit.
ssize_t read_maps_raw(std::vector<char>& buf) {
  const int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  size_t n = 0;
  for (ssize_t r; n < buf.size() && (r = ::read(fd, buf.data() + n, buf.size() - n)) != 0;) {
    if (r < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      return -1;
    }
    n += static_cast<size_t>(r);
  }
  ::close(fd);
  return static_cast<ssize_t>(n);
}

/// One line of /proc/self/maps, parsed in place (no allocation): "start-end perms offset dev
/// inode   path".
struct MapsLine {
  uintptr_t start, end;
  uint64_t offset;
  const char* perms;  ///< 4 characters
  std::string_view path;
};

MapsLine parse_maps_line(const char* line, size_t len) {
  const char* c = line;
  const char* const eol = line + len;
  auto hex = [&c, eol] {
    uint64_t v = 0;
    for (; c < eol; ++c) {
      const int d = *c >= '0' && *c <= '9' ? *c - '0' : *c >= 'a' && *c <= 'f' ? *c - 'a' + 10 : -1;
      if (d < 0) break;
      v = v << 4 | static_cast<uint64_t>(d);
    }
    return v;
  };
  MapsLine m{};
  m.start = hex();
  ++c;
  m.end = hex();
  ++c;
  m.perms = c;
  c += 5;
  m.offset = c < eol ? hex() : 0;
  // The path is the sixth field; fields are separated by spaces.
  const char* path = m.perms;
  for (int field = 0; field < 4 && path < eol; ++path)
    if (*path == ' ' && path[1] != ' ') ++field;
  while (path < eol && *path == ' ') ++path;
  m.path = std::string_view(path, static_cast<size_t>(eol - std::min(path, eol)));
  return m;
}

/// Reads /proc/self/maps into `buf` again (the threads stopped: no allocation) and checks that
/// each piece still lies in anonymous private mappings with the permissions read before (another
/// thread may have unmapped or replaced them meanwhile), none of which holds a stack pointer in
/// `sps`. `*bad` is the piece that failed, `*bad_sp` the stack pointer.
template <typename Pieces>
Recheck recheck_maps(std::vector<char>& buf, const Pieces& pieces, std::span<const uintptr_t> sps,
                     const Piece** bad, uintptr_t* bad_sp) {
  *bad = pieces.front();
  const ssize_t got = read_maps_raw(buf);
  if (got < 0) return Recheck::kChanged;
  const auto n = static_cast<size_t>(got);
  if (n == buf.size()) return Recheck::kTooBig;
  for (const Piece* p : pieces) {
    *bad = p;
    uintptr_t covered = p->a;
    for (size_t at = 0; at < n;) {
      const char* line = buf.data() + at;
      const char* eol = static_cast<const char*>(std::memchr(line, '\n', n - at));
      const size_t len = eol ? static_cast<size_t>(eol - line) : n - at;
      at += len + 1;
      const MapsLine m = parse_maps_line(line, len);
      if (m.end <= p->a || m.start >= p->b) continue;
      for (uintptr_t sp : sps) {
        if (sp >= m.start && sp < m.end) {
          *bad_sp = sp;
          return Recheck::kOnStack;
        }
      }
      if (m.start > covered || std::memcmp(m.perms, p->v.perms, 4) != 0 || m.path != p->v.path)
        return Recheck::kChanged;
      covered = m.end;
    }
    if (covered < p->b) return Recheck::kChanged;
  }
  return Recheck::kSame;
}

/// Moves the anonymous pieces (id 0) into new segments mapped at the same addresses, with the
/// process's other threads stopped (stop_world.h), so that no write to these pages (the MR's
/// or its neighbours') is lost between the copy and the remap. A piece in a mapping that holds
/// a thread's stack pointer is refused (EFAULT): the thread writes there all the time.
/// Whether a mapping's pages may move into a segment: anonymous private memory (heap, mmap),
/// and private file mappings that are not code (a program's .data and .bss, MAP_PRIVATE of a
/// file): the process only ever sees its own copy of those pages, which the segment keeps (a
/// change to the file no longer shows in pages not yet written, which POSIX leaves unspecified
/// for MAP_PRIVATE anyway). Not shared mappings (their pages are someone else's too), stacks
/// and the kernel's [vdso]/[vvar], huge pages (a segment has 4 KiB pages), nor executable text.
bool registrable(const Vma& v) {
  if (v.perms[3] != 'p') return false;
  if (v.path.empty() || v.path == "[heap]") return true;
  if (v.path[0] == '[' || v.path.starts_with("/anon_hugepage")) return false;
  return v.perms[2] != 'x';
}

/// For a private file mapping: whether every page up to `b` has file behind it. A page past
/// the end of the file faults with SIGBUS when read, and make_segments reads every page with
/// the other threads stopped. A file that cannot be looked at (deleted, renamed) is refused.
bool file_covers(const Vma& v, uintptr_t b) {
  if (v.path.empty() || v.path[0] == '[') return true;  // anonymous
  struct stat st {};
  if (::stat(v.path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  const uint64_t file_pages_end = (static_cast<uint64_t>(st.st_size) + kPage - 1) & ~(kPage - 1);
  return file_pages_end >= v.offset + (b - v.start);
}

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

/// A mapping of a segment that make_anonymous turns back into anonymous memory.
struct SegMapping {
  uintptr_t start, end;
  int prot;
  uint32_t id;      ///< its segment
  uint64_t offset;  ///< in the segment's memfd
  bool moved;
};

/// Lists in `out` (up to its size) the mappings of the segments `ids` that `maps` (the text of
/// /proc/self/maps) shows; no allocation. The number there is, and their bytes, in `*bytes`.
size_t find_segment_mappings(const char* maps, size_t n, const std::vector<uint32_t>& ids,
                             std::vector<SegMapping>& out, size_t* bytes) {
  size_t count = 0;
  *bytes = 0;
  for (size_t at = 0; at < n;) {
    const char* line = maps + at;
    const char* eol = static_cast<const char*>(std::memchr(line, '\n', n - at));
    const size_t len = eol ? static_cast<size_t>(eol - line) : n - at;
    at += len + 1;
    const MapsLine m = parse_maps_line(line, len);
    const uint32_t id = segment_id(m.path);
    if (id == 0 || std::find(ids.begin(), ids.end(), id) == ids.end()) continue;
    if (count < out.size()) {
      const int prot = (m.perms[0] == 'r' ? PROT_READ : 0) | (m.perms[1] == 'w' ? PROT_WRITE : 0) |
                       (m.perms[2] == 'x' ? PROT_EXEC : 0);
      out[count] = SegMapping{m.start, m.end, prot, id, m.offset, false};
    }
    ++count;
    *bytes += m.end - m.start;
  }
  return count;
}

/// The pages of the copy `base` (the mappings `before`, laid out in that order) where the
/// memfds hold data, faulted in while the threads still run (make_anonymous).
/// MADV_POPULATE_WRITE needs Linux 5.14; without it the faults happen during the copy.
void prefault_copy(const std::vector<Vma>& before, uint8_t* base) {
  size_t at = 0;
  for (const Vma& v : before) {
    const size_t len = v.end - v.start;
    const auto ps = g_segments.find(segment_id(v));
    const int fd = ps != g_segments.end() ? ps->second.fd.get() : -1;
    for (size_t off = 0; fd >= 0 && off < len;) {
      const off_t data = ::lseek(fd, static_cast<off_t>(v.offset + off), SEEK_DATA);
      if (data < 0) break;
      const off_t hole = ::lseek(fd, data, SEEK_HOLE);
      off = (static_cast<uint64_t>(data) - v.offset) & ~(kPage - 1);
      if (off >= len) break;
      const size_t end =
          hole > data ? std::min<size_t>(len, static_cast<uint64_t>(hole) - v.offset) : len;
      const size_t n = (end - off + kPage - 1) & ~(kPage - 1);
      ::madvise(base + at + off, std::min(n, len - off), MADV_POPULATE_WRITE);
      off += n;
    }
    at += len;
  }
}

/// Copies the mapping `m` (readable) into `copy`, the memfd's data only: reading a hole through
/// the mapping would allocate a page there (tmpfs has no shared zero page). Pages of zeros stay
/// unpopulated in the copy, as in any anonymous memory. Runs with the other threads stopped:
/// system calls only, no allocation (make_anonymous).
void copy_segment_data(const SegMapping& m, uint8_t* copy) {
  const size_t len = m.end - m.start;
  auto* at = reinterpret_cast<uint8_t*>(m.start);
  const auto ps = g_segments.find(m.id);
  const int fd = ps != g_segments.end() ? ps->second.fd.get() : -1;
  for (size_t off = 0; off < len;) {
    size_t data_end = len;
    if (fd >= 0) {
      const off_t data = ::lseek(fd, static_cast<off_t>(m.offset + off), SEEK_DATA);
      if (data >= 0) {
        const off_t hole = ::lseek(fd, data, SEEK_HOLE);
        off = (static_cast<uint64_t>(data) - m.offset) & ~(kPage - 1);
        if (off >= len) break;
        if (hole > data) data_end = std::min<size_t>(len, static_cast<uint64_t>(hole) - m.offset);
      } else if (errno == ENXIO) {
        break;  // no data from there on (otherwise no answer: every page from here is read)
      }
    }
    for (; off < data_end; off += kPage) {
      if (!page_is_zero(at + off)) copy_page(copy + off, at + off);
    }
  }
}

/// Turns what the application still maps of the segments `ids` (no MR names them any more) back
/// into private anonymous memory with the same contents and protection, and forgets those
/// segments (their memfds go with the backend's descriptors). With the other threads stopped, as
/// for make_segments: each mapping is copied into anonymous memory made before the stop, which
/// mremap then moves over it, so no write to the pages is lost. The mappings are read again from
/// /proc/self/maps while the threads are stopped (the application may have unmapped or remapped
/// some since). A segment whose pages cannot move (the threads did not stop, no memory for the
/// copy) stays as it is: shared memory, reused by the next registration of those pages.
void make_anonymous(const std::vector<uint32_t>& ids) {
  size_t bytes = 0, count = 0;
  std::vector<Vma> before;
  for (const Vma& v : read_maps(0, UINTPTR_MAX)) {
    const uint32_t id = segment_id(v);
    if (id != 0 && std::find(ids.begin(), ids.end(), id) != ids.end()) {
      bytes += v.end - v.start;
      ++count;
      before.push_back(v);
    }
  }
  std::vector<char> maps(size_t{1} << 20);
  std::vector<SegMapping> found;
  std::vector<uint32_t> kept;  ///< segments some mapping of which did not move
  for (int attempt = 0; count != 0; ++attempt) {
    if (attempt == 4) {
      VLOG_WARN(
          "dereg_mr: the mappings of a released segment kept changing; its pages stay "
          "shared memory");
      return;
    }
    // Everything that allocates is prepared before the threads stop. Room for mappings that
    // grow or appear meanwhile, within reason.
    found.assign(count + 16, SegMapping{});
    const size_t room = bytes + 16 * kPage;
    void* spare = ::mmap(nullptr, room, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (spare == MAP_FAILED) {
      VLOG_WARN("dereg_mr: no memory to make {} bytes of released segments anonymous again: {}",
                bytes, std::strerror(errno));
      return;
    }
    auto* base = static_cast<uint8_t*>(spare);
    // The copy's pages where the memfds hold data are faulted in now, while the threads run,
    // not while they are stopped (the mappings are laid out in the copy in the order
    // /proc/self/maps lists them; if that changes meanwhile, the faults just happen later).
    if (attempt == 0) prefault_copy(before, base);
    const uint64_t stop_start = mono_ns();
    WorldStop world;
    if (world.stop("dereg_mr") != 0) {
      ::munmap(spare, room);
      VLOG_WARN("dereg_mr: released segments stay shared memory (the threads did not stop)");
      return;
    }
    // Stopped: system calls and the memory prepared above only (no allocation, no log).
    const ssize_t n = read_maps_raw(maps);
    if (n < 0 || static_cast<size_t>(n) == maps.size()) {
      world.release();
      ::munmap(spare, room);
      if (n < 0 || maps.size() >= (size_t{64} << 20)) {
        VLOG_WARN("dereg_mr: cannot read /proc/self/maps; released segments stay shared memory");
        return;
      }
      maps.resize(maps.size() * 4);
      continue;
    }
    count = find_segment_mappings(maps.data(), static_cast<size_t>(n), ids, found, &bytes);
    if (count > found.size() || bytes > room) {
      world.release();
      ::munmap(spare, room);
      continue;  // with room for what there is now
    }
    size_t used = 0;
    for (size_t i = 0; i < count; ++i) {
      SegMapping& m = found[i];
      const size_t len = m.end - m.start;
      auto* at = reinterpret_cast<uint8_t*>(m.start);
      uint8_t* copy = base + used;
      used += len;
      if (!(m.prot & PROT_READ) && ::mprotect(at, len, m.prot | PROT_READ) != 0) continue;
      copy_segment_data(m, copy);
      if ((m.prot != (PROT_READ | PROT_WRITE) && ::mprotect(copy, len, m.prot) != 0) ||
          ::mremap(copy, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, at) == MAP_FAILED) {
        ::mprotect(at, len, m.prot);
        continue;
      }
      m.moved = true;
    }
    world.release();
    VLOG_DEBUG("dereg_mr: {} bytes in {} mapping(s) made anonymous again; threads stopped {} us",
               bytes, count, (mono_ns() - stop_start) / 1000);
    // What was not moved out of the spare mapping: its tail, and the copies of mappings that
    // did not move. (Never the holes left by those that moved: another thread may map there.)
    used = 0;
    for (size_t i = 0; i < count; ++i) {
      const SegMapping& m = found[i];
      if (!m.moved) {
        ::munmap(base + used, m.end - m.start);
        kept.push_back(m.id);
      }
      used += m.end - m.start;
    }
    if (used < room) ::munmap(base + used, room - used);
    if (!kept.empty()) {
      VLOG_WARN(
          "dereg_mr: {} mapping(s) of released segments could not be made anonymous again; "
          "their pages stay shared memory",
          kept.size());
    }
    break;
  }
  // The others are no longer mapped: their memfds close here, and with the backend's.
  for (uint32_t id : ids) {
    if (std::find(kept.begin(), kept.end(), id) == kept.end()) g_segments.erase(id);
  }
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
// Pages whose last MR is gone are anonymous memory again (make_anonymous), without
// MADV_DONTFORK (as rdma-core's ibv_dereg_mr MADV_DOFORKs them): copy-on-write, no copy here.
int g_fork_pipe[2] = {-1, -1};

// The mappings to privatize are read from /proc/self/maps (not taken from the ranges the
// segments were made for: the application may have unmapped or replaced parts of those since),
// by the parent before it forks: the child must not allocate before its heap is private, or it
// writes into pages it still shares with the parent.
std::vector<SegMapping> g_fork_maps;

void list_segment_mappings() {
  g_fork_maps.clear();
  for (const Vma& v : read_maps(0, UINTPTR_MAX)) {
    const uint32_t id = segment_id(v);
    auto it = g_segments.find(id);
    if (id != 0 && (it == g_segments.end() || !it->second.dontfork))
      g_fork_maps.push_back({v.start, v.end, prot_of(v), id, v.offset, false});
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
    } else if (!registrable(v)) {
      VLOG_ERROR(
          "reg_mr: memory at {:#x} ({} {}) is neither anonymous nor a private file mapping; "
          "vrdma cannot register it yet",
          p.a, v.perms, v.path);
      return EFAULT;
    }
    if (p.id == 0 && !file_covers(v, p.b)) {
      VLOG_ERROR("reg_mr: memory at {:#x} maps {} beyond its end (or it cannot be read)", p.a,
                 v.path);
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
    g_segments[id].uses++;
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

namespace {
/// A mapping an ODP fault may make reachable: readable (and writable, `write`), and either in
/// a segment already or of a kind describe_memory moves into one (not a stack).
bool odp_reachable(const Vma& v, bool write) {
  if (v.perms[0] != 'r' || (write && v.perms[1] != 'w')) return false;
  return segment_id(v) != 0 || (registrable(v) && v.path != "[stack]");
}
}  // namespace

bool pages_accessible(uintptr_t lo, uintptr_t hi, bool write) {
  uintptr_t cursor = lo;
  for (const Vma& v : read_maps(lo, hi)) {
    if (v.start > cursor || !odp_reachable(v, write)) return false;
    cursor = v.end;
  }
  return cursor >= hi;
}

std::vector<std::pair<uintptr_t, uintptr_t>> resident_runs(uintptr_t lo, uintptr_t hi,
                                                           size_t max_runs) {
  constexpr uintptr_t kJoin = uintptr_t{2} << 20;  ///< runs closer than this become one
  constexpr size_t kStep = size_t{1} << 18;        ///< pages per mincore call (1 GiB)
  std::vector<std::pair<uintptr_t, uintptr_t>> runs;
  std::vector<unsigned char> vec(kStep);
  for (const Vma& v : read_maps(lo, hi)) {
    if (!odp_reachable(v, false)) continue;  // PROT_NONE reservations cost one line here
    const uintptr_t a = std::max(v.start, lo), b = std::min(v.end, hi);
    for (uintptr_t at = a; at < b;) {
      const size_t pages = std::min<size_t>(kStep, (b - at) / kPage);
      if (::mincore(reinterpret_cast<void*>(at), pages * kPage, vec.data()) != 0) break;
      for (size_t i = 0; i < pages; ++i) {
        if (!(vec[i] & 1)) continue;
        const uintptr_t p = at + i * kPage;
        if (!runs.empty() && p - runs.back().second < kJoin && runs.back().second >= a)
          runs.back().second = p + kPage;
        else if (runs.size() == max_runs)
          return runs;
        else
          runs.emplace_back(p, p + kPage);
      }
      at += pages * kPage;
    }
  }
  return runs;
}

void release_segments(VContext& ctx, const std::vector<uint32_t>& segments) {
  std::vector<uint32_t> unused;
  {
    std::lock_guard<std::mutex> g(g_segments_mu);
    std::vector<uint32_t> unregistered;  ///< segments no MR of any context names any more
    for (uint32_t id : segments) {
      auto it = ctx.segments.find(id);
      if (it == ctx.segments.end()) continue;
      auto ps = g_segments.find(id);
      if (ps != g_segments.end() && ps->second.uses > 0 && --ps->second.uses == 0)
        unregistered.push_back(id);
      if (--it->second.uses != 0) continue;
      unused.push_back(it->second.handle);
      ctx.segments.erase(it);
    }
    // Under the lock: a registration of the same pages on another thread waits, then finds
    // anonymous memory and makes a new segment of it.
    if (!unregistered.empty()) make_anonymous(unregistered);
  }
  // Outside the lock: another thread registering the same pages meanwhile finds no handle and
  // registers the segment again, under a new one (or, if its pages became anonymous memory, a
  // new segment).
  for (uint32_t h : unused) {
    proto::HandleReq req{h, 0};
    proto::Empty resp;
    if (int rc = ctx.call(proto::Op::kDeregSegment, &req, sizeof(req), &resp, 0))
      VLOG_WARN("releasing segment {}: {}", h, std::strerror(rc));
  }
}

}  // namespace vrdma::verbs
