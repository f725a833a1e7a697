// Control path of the device model: protection domains, memory windows, segments, memory
// regions and device memory (the verbs that name guest memory).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <iterator>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "common/guest_fault.h"
#include "common/identity.h"
#include "common/log.h"
#include "common/memfd.h"
#include "engine/datapath_util.h"
#include "engine/device.h"
#include "engine/qp_state.h"
#include "proto/device_caps.h"
#include "proto/wire.h"

namespace vrdma::engine {

using namespace vrdma::proto;

Result<uint32_t> Device::alloc_pd(Session& s) {
  if (s.pds.size() >= kMaxPd) return error(ENOMEM, "PD limit reached");
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kPd));
  charge(*s.guest, Res::kPd);
  uint32_t h = new_handle(s, s.pds);
  s.pds[h] = Pd{h, 0};
  return h;
}

Status Device::dealloc_pd(Session& s, uint32_t pd) {
  auto it = s.pds.find(pd);
  if (it == s.pds.end()) return error(EINVAL, fmt::format("no PD {}", pd));
  if (it->second.users) return error(EBUSY, "PD still has MRs or QPs");
  s.pds.erase(it);
  release(*s.guest, Res::kPd);
  return Status::ok();
}

Result<AllocMwResp> Device::alloc_mw(Session& s, const AllocMwReq& req) {
  auto checked = [&]() -> Result<AllocMwResp> {
    auto pd = s.pds.find(req.pd);
    if (pd == s.pds.end()) return error(EINVAL, fmt::format("no PD {}", req.pd));
    if (req.type != IBV_MW_TYPE_1 && req.type != IBV_MW_TYPE_2)
      return error(EINVAL, fmt::format("window type {}", req.type));
    if (s.guest->mws.size() >= kMaxMw) return error(ENOMEM, "MW limit reached");
    RETURN_IF_ERROR(check_quota(*s.guest, Res::kMw));
    charge(*s.guest, Res::kMw);
    auto mw = std::make_unique<Mw>();
    mw->handle = new_handle(s, s.mws);
    mw->pd = req.pd;
    mw->type = req.type;
    mw->rkey = new_key(*s.guest, true);
    mw->owner = &s;
    pd->second.users++;
    const AllocMwResp resp{mw->handle, mw->rkey};
    s.guest->mws[mw->rkey >> 8] = mw.get();
    s.mws[mw->handle] = std::move(mw);
    return resp;
  };
  return refused(s, "alloc_mw", checked());
}

Status Device::dealloc_mw(Session& s, uint32_t handle) {
  auto it = s.mws.find(handle);
  if (it == s.mws.end())
    return refused(s, "dealloc_mw", error(EINVAL, fmt::format("no MW {}", handle)));
  // Grants never carry windows (they are the backend's alone), but the peer's library may hold
  // a bound rkey's bytes in flight: the epoch moves as for an MR that goes.
  bump_epoch(*s.guest);
  s.guest->mws.erase(it->second->rkey >> 8);
  s.pds[it->second->pd].users--;
  release(*s.guest, Res::kMw);
  s.mws.erase(it);
  return Status::ok();
}

Result<MwViewResp> Device::mw_view(Session& s, const MwViewReq& req) {
  const Qp* qp = find_qp(s, req.qp);
  if (!qp || qp->type != IBV_QPT_RC) return error(EINVAL, fmt::format("no RC QP {}", req.qp));
  if (req.flags & ~kMwViewInvalidate) return error(EINVAL, fmt::format("flags {:#x}", req.flags));
  MwViewResp r{};
  r.status = IBV_WC_SUCCESS;
  if (req.flags & kMwViewInvalidate) {
    // As respond_begin and respond_finish do for a SEND_WITH_INV from a requester of ours.
    RemoteMwView v;
    Mw* mw = rkey_mw(*qp, req.rkey, v);
    r.status = check_invalidate(v, IBV_WC_REM_INV_REQ_ERR);
    if (r.status == IBV_WC_SUCCESS) mw->bound = false;
    return r;
  }
  RemoteMrView view;
  if (const Mr* mr = rkey_target(*qp, req.rkey, view); mr && rkey_mr(*qp, req.rkey) != mr) {
    r.found = 1;
    r.mr_key = mr->key;
    r.access = view.access;
    r.iova = view.iova;
    r.length = view.length;
    r.base = view.base;
  }
  return r;
}

Result<uint32_t> Device::reg_segment(Session& s, const RegSegmentReq& req, UniqueFd fd) {
  Guest& g = *s.guest;
  if (s.segments.size() >= kMaxSegments) return error(ENOMEM, "segment limit reached");
  if (req.size == 0 || req.size % kPage || req.size > kMaxMrSize)
    return error(EINVAL, fmt::format("bad segment size {}", req.size));
  if (!fd.valid()) return error(EBADF, "segment without a descriptor");
  // tmpfs (shmem) memfds only: a hugetlbfs one (MFD_HUGETLB) can lose its page to a hole the
  // guest punches and the free huge page another process takes, and the backend's next access
  // to it is a SIGBUS. Logged once per guest: a guest retrying cannot flood the log.
  if (Status st = check_shmem(fd.get()); !st.is_ok()) {
    if (!g.refused_fs_logged) {
      g.refused_fs_logged = true;
      VLOG_WARN("guest {} pid {}: segment refused: {}", g.name, s.pid, st.message());
    }
    return st;
  }
  RETURN_IF_ERROR(check_sealed_memfd(fd.get(), req.size));
  RETURN_IF_ERROR(check_quota(g, Res::kSegment));
  RETURN_IF_ERROR(check_quota(g, Res::kSegmentBytes, req.size));
  if (req.size > quotas_.max_mapped_bytes - std::min(mapped_bytes_, quotas_.max_mapped_bytes)) {
    if (!mapped_logged_) {
      mapped_logged_ = true;
      VLOG_WARN("guest {}: max_mapped_bytes = {} reached (all guests map {}, asked for {} more)",
                g.name, quotas_.max_mapped_bytes, mapped_bytes_, req.size);
    }
    return error(ENOMEM,
                 fmt::format("backend max_mapped_bytes = {} reached", quotas_.max_mapped_bytes));
  }
  auto seg = std::make_shared<Segment>();
  seg->map = MappedRegion::map_shared(fd.get(), req.size);
  if (!seg->map.valid()) return error(errno, fmt::format("mapping segment: {}", strerror(errno)));
  seg->fd = std::move(fd);
  charge_segment(g, req.size);
  uint32_t h = new_handle(s, s.segments);
  s.segments[h] = std::move(seg);
  return h;
}

Status Device::dereg_segment(Session& s, uint32_t handle) {
  auto it = s.segments.find(handle);
  if (it == s.segments.end()) return error(EINVAL, fmt::format("no segment {}", handle));
  if (dm_of_segment(s, handle))
    return error(EBUSY, fmt::format("segment {} is device memory", handle));
  for (const auto& [h, mr] : s.mrs) {
    for (const auto& seg : mr->segments) {
      if (seg == it->second) return error(EBUSY, fmt::format("segment {} has MR {}", handle, h));
    }
  }
  // A frame of the TCP transport may still hold the mapping (transport::Hold); it goes with the
  // last holder. The quota comes back now.
  release_segment(*s.guest, it->second->map.size());
  s.segments.erase(it);
  return Status::ok();
}

Result<RegMrResp> Device::reg_mr(Session& s, const RegMrReq& req) {
  return refused(s, "reg_mr", reg_mr_checked(s, req));
}

Status Device::check_mr_access(uint32_t access, uint32_t accepted) {
  if (access & kMrAccessUnsupported & ~accepted)
    return error(EOPNOTSUPP, fmt::format("access {:#x}: ZERO_BASED is not supported here", access));
  if (access & ~(accepted | kMrAccessUnsupported))
    return error(EINVAL, fmt::format("access {:#x}: unknown bits {:#x}", access,
                                     access & ~(accepted | kMrAccessUnsupported)));
  // o10-?: remote write or atomic access requires local write.
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE))
    return error(EINVAL, "access: remote write/atomic access without local write");
  return Status::ok();
}

Status Device::mr_translation(Session& s, const RegMrReq& req, Mr& mr) {
  if (req.length == 0 || req.length > kMaxMrSize)
    return error(EINVAL, fmt::format("length {} outside 1..{}", req.length, kMaxMrSize));
  if (req.num_extents == 0 || req.num_extents > kMaxMrExtents)
    return error(EINVAL, fmt::format("{} extents, outside 1..{}", req.num_extents, kMaxMrExtents));
  uint64_t expect = 0;
  for (uint32_t i = 0; i < req.num_extents; ++i) {
    const MrExtent& e = req.extents[i];
    auto seg = s.segments.find(e.segment);
    if (seg == s.segments.end()) return error(EINVAL, fmt::format("no segment {}", e.segment));
    if (dm_of_segment(s, e.segment))
      return error(EINVAL, fmt::format("segment {} is device memory", e.segment));
    const size_t seg_size = seg->second->map.size();
    if (e.mr_offset != expect || e.length == 0 || e.seg_offset > seg_size ||
        e.length > seg_size - e.seg_offset)
      return error(EINVAL, fmt::format("extent {} does not fit", i));
    mr.chunks.push_back({e.mr_offset, e.length, seg->second->map.data() + e.seg_offset});
    mr.segments.push_back(seg->second);
    expect += e.length;
  }
  if (expect != req.length) return error(EINVAL, "extents do not cover the MR");
  mr.addr = req.addr;
  mr.iova = req.iova;
  mr.length = req.length;
  return Status::ok();
}

Result<RegMrResp> Device::reg_mr_checked(Session& s, const RegMrReq& req) {
  auto pd = s.pds.find(req.pd);
  if (pd == s.pds.end()) return error(EINVAL, fmt::format("no PD {}", req.pd));
  RETURN_IF_ERROR(check_mr_access(req.access, kMrAccessAccepted));
  auto mr = std::make_unique<Mr>();
  if (req.access & IBV_ACCESS_ON_DEMAND) {
    // No pages yet: the library faults them in (kReregOdpMap) when a WQE or ibv_advise_mr
    // touches them. O(1), nothing mapped, nothing charged but the MR itself.
    if (req.num_extents != 0) return error(EINVAL, "an ODP MR is registered without extents");
    const bool implicit = req.addr == 0 && req.length == UINT64_MAX;
    if (req.length == 0 || (!implicit && req.addr + req.length < req.addr))
      return error(EINVAL, fmt::format("ODP range {:#x}+{:#x}", req.addr, req.length));
    mr->odp = true;
    mr->addr = req.addr;
    mr->iova = req.iova;
    mr->length = req.length;
    // A grant of the direct path would carry a snapshot of its pages: grants end, and none is
    // given while the PD holds an ODP MR (grant_direct).
    bump_epoch(*s.guest);
  } else {
    RETURN_IF_ERROR(mr_translation(s, req, *mr));
  }
  mr->pd = req.pd;
  mr->access = req.access;
  return add_mr(s, std::move(mr));
}

bool Device::odp_covers(const Mr& mr, uint64_t off, uint64_t len) {
  if (!mr.odp || len == 0) return true;
  auto it = std::upper_bound(mr.chunks.begin(), mr.chunks.end(), off,
                             [](uint64_t o, const MrChunk& c) { return o < c.mr_offset; });
  if (it == mr.chunks.begin()) return false;
  --it;
  for (uint64_t at = off; it != mr.chunks.end() && it->mr_offset <= at; ++it) {
    if (at - it->mr_offset >= it->length) return false;
    const uint64_t end = it->mr_offset + it->length;
    if (end - off >= len) return true;
    at = end;
  }
  return false;
}

Status Device::odp_movable(const std::string& name) const {
  auto g = guests_.find(name);
  if (g == guests_.end()) return Status::ok();
  for (const auto& [key, mr] : g->second->mrs) {
    if (mr->odp)
      return error(EOPNOTSUPP,
                   fmt::format("guest {} has an ODP MR (key {:#x}): a device with on-demand "
                               "paging cannot move yet",
                               name, key));
  }
  return Status::ok();
}

bool Device::odp_page_request(Session& s, const Mr& mr, uint64_t iova, uint64_t len) {
  ControlPage* cp = s.control_page();
  if (!cp || !cp->odp_pager.load(std::memory_order_acquire)) return false;
  const bool answered = cp->odp_done.load(std::memory_order_acquire) == s.odp_req;
  if (!answered) return true;  // one request at a time: this one waits its turn
  if (s.odp_req != 0 && s.odp_mr == mr.handle && s.odp_addr == iova && s.odp_len == len &&
      cp->odp_status != 0) {
    s.odp_mr = 0;  // refused once; a later access asks again
    return false;
  }
  // Data path, but only for a page's first remote touch: stores into the control page, then
  // one send that wakes the pager (MSG_DONTWAIT: a full socket means it is awake already; a
  // descriptor that is no socket fails at once; the pager of an older library polls).
  s.odp_mr = mr.handle;
  s.odp_addr = iova;
  s.odp_len = len;
  cp->odp_mr = mr.handle;
  cp->odp_addr = iova;
  cp->odp_len = len;
  cp->odp_req.store(++s.odp_req, std::memory_order_release);
  if (s.odp_wake.valid()) {
    const char b = 1;
    (void)::send(s.odp_wake.get(), &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  }
  return true;
}

Status Device::odp_map(Session& s, Mr& mr, const RegMrReq& req) {
  if (!mr.odp) return error(EINVAL, "not an ODP MR");
  if (req.length == 0 || req.addr < mr.addr || req.length > mr.length ||
      req.addr - mr.addr > mr.length - req.length)
    return error(EINVAL, fmt::format("{:#x}+{:#x} outside the ODP MR", req.addr, req.length));
  // The extents as for a registration (segments of the session, fitting, covering the range),
  // in MR offsets of this range.
  Mr piece;
  RETURN_IF_ERROR(mr_translation(s, req, piece));
  const uint64_t base = req.addr - mr.addr;
  // Merge: what the MR already has stays; only the parts of each new chunk that fill a gap go
  // in, keeping the chunks sorted and apart (append_spans and odp_covers rely on it).
  std::vector<MrChunk> chunks;
  std::vector<std::shared_ptr<Segment>> segments;
  size_t old = 0;
  for (size_t i = 0; i < piece.chunks.size(); ++i) {
    uint64_t at = base + piece.chunks[i].mr_offset;
    const uint64_t end = at + piece.chunks[i].length;
    while (at < end) {
      while (old < mr.chunks.size() && mr.chunks[old].mr_offset + mr.chunks[old].length <= at) {
        chunks.push_back(mr.chunks[old]);
        segments.push_back(mr.segments[old]);
        ++old;
      }
      const bool inside = old < mr.chunks.size() && mr.chunks[old].mr_offset <= at;
      if (inside) {  // already there: skip to its end
        at = std::min(end, mr.chunks[old].mr_offset + mr.chunks[old].length);
        continue;
      }
      const uint64_t gap_end =
          old < mr.chunks.size() ? std::min(end, mr.chunks[old].mr_offset) : end;
      chunks.push_back(
          {at, gap_end - at, piece.chunks[i].base + (at - base - piece.chunks[i].mr_offset)});
      segments.push_back(piece.segments[i]);
      at = gap_end;
    }
  }
  for (; old < mr.chunks.size(); ++old) {
    chunks.push_back(mr.chunks[old]);
    segments.push_back(mr.segments[old]);
  }
  if (chunks.size() > kMaxOdpChunks)
    return error(ENOMEM, fmt::format("ODP MR of more than {} pieces", kMaxOdpChunks));
  mr.chunks = std::move(chunks);
  mr.segments = std::move(segments);
  return Status::ok();
}

Result<RegMrResp> Device::add_mr(Session& s, std::unique_ptr<Mr> mr) {
  if (s.guest->mrs.size() >= kMaxMr) return error(ENOMEM, "MR limit reached");
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kMr));
  // An ODP MR's pages are charged as segments when they are faulted in, not by its length.
  const uint64_t bytes = mr->odp ? 0 : mr->length;
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kMrBytes, bytes));
  charge(*s.guest, Res::kMr);
  charge(*s.guest, Res::kMrBytes, bytes);
  const uint32_t key = new_key(*s.guest);
  mr->handle = new_handle(s, s.mrs);
  mr->key = key;
  mr->owner = &s;
  s.pds[mr->pd].users++;
  RegMrResp resp{mr->handle, key, key, 0};
  s.guest->mrs[key] = mr.get();
  s.mrs[mr->handle] = std::move(mr);
  return resp;
}

uint32_t Device::new_key(Guest& g, bool window) {
  // An MR's key and a window's rkey share the space: a window is found by its upper 24 bits
  // (the lower 8 change per bind), so no MR key and no window may share those. (The 20-bit
  // index alone keeps them apart until it wraps.)
  auto mr_under = [&](uint32_t index) {
    for (uint32_t k = 0; k < 256; ++k)
      if (g.mrs.count(index << 8 | k)) return true;
    return false;
  };
  uint32_t key;
  do {
    uint32_t idx = g.next_key_index++ & 0xfffff;
    key = (idx << 12) | static_cast<uint32_t>(rng_() & 0xfff);
  } while (key == 0 || g.mrs.count(key) || g.mws.count(key >> 8) || (window && mr_under(key >> 8)));
  return key;
}

/// A window bound to MR `handle` of the session, or null.
static const Mw* window_on(const Session& s, uint32_t handle) {
  for (const auto& [h, mw] : s.mws)
    if (mw->bound && mw->mr == handle) return mw.get();
  return nullptr;
}

Status Device::dereg_mr(Session& s, uint32_t handle) {
  auto it = s.mrs.find(handle);
  if (it == s.mrs.end()) return error(EINVAL, fmt::format("no MR {}", handle));
  // ibv_alloc_mw(3): "ibv_dereg_mr() fails if any memory window is still bound to this MR."
  if (const Mw* mw = window_on(s, handle))
    return error(EBUSY, fmt::format("window {} is bound to MR {}", mw->handle, handle));
  bump_epoch(*s.guest);
  s.guest->mrs.erase(it->second->key);
  s.pds[it->second->pd].users--;
  release(*s.guest, Res::kMr);
  release(*s.guest, Res::kMrBytes, it->second->odp ? 0 : it->second->length);
  s.mrs.erase(it);
  return Status::ok();
}

Status Device::rereg_mr(Session& s, const ReregMrReq& req, UniqueFd fd) {
  return refused(s, "rereg_mr", rereg_mr_checked(s, req, std::move(fd)));
}

Status Device::rereg_mr_checked(Session& s, const ReregMrReq& req, UniqueFd fd) {
  auto it = s.mrs.find(req.handle);
  if (it == s.mrs.end()) return error(EINVAL, fmt::format("no MR {}", req.handle));
  Mr& mr = *it->second;
  if (req.flags == kReregOdpMap) return odp_map(s, mr, req.mr);
  if (req.flags == kReregOdpPager) {
    if (!mr.odp || !fd.valid()) return error(EINVAL, "kReregOdpPager: an ODP MR and a socket");
    s.odp_wake = std::move(fd);  // odp_page_request sends on it, never blocking
    return Status::ok();
  }
  // Re-registering an ODP MR, or into one, is not done (yet): the library would have to move
  // its cache of faulted pages along.
  if (mr.odp ||
      ((req.flags & IBV_REREG_MR_CHANGE_ACCESS) && (req.mr.access & IBV_ACCESS_ON_DEMAND)))
    return error(EOPNOTSUPP, "ibv_rereg_mr of an ODP MR");
  // The kernel's rule (ib_uverbs_rereg_mr): no flag, or one it does not know, is EINVAL.
  constexpr uint32_t kKnown =
      IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_PD | IBV_REREG_MR_CHANGE_ACCESS;
  if (req.flags == 0 || (req.flags & ~kKnown))
    return error(EINVAL, fmt::format("flags {:#x}", req.flags));
  if (on_dm(s, mr)) return error(EINVAL, "a device-memory MR");
  // A bound window holds a range, PD and access of the MR that a change would pull away.
  if (const Mw* mw = window_on(s, req.handle))
    return error(EBUSY, fmt::format("window {} is bound to MR {}", mw->handle, req.handle));
  // Everything is checked on a copy; only then does the MR change, all at once.
  Mr next;
  next.pd = mr.pd;
  next.access = mr.access;
  if (req.flags & IBV_REREG_MR_CHANGE_PD) {
    if (!s.pds.count(req.mr.pd)) return error(EINVAL, fmt::format("no PD {}", req.mr.pd));
    next.pd = req.mr.pd;
  }
  if (req.flags & IBV_REREG_MR_CHANGE_ACCESS) {
    RETURN_IF_ERROR(check_mr_access(req.mr.access, kMrAccessAccepted));
    next.access = req.mr.access;
  }
  if (req.flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    RETURN_IF_ERROR(mr_translation(s, req.mr, next));
    if (next.length > mr.length)
      RETURN_IF_ERROR(check_quota(*s.guest, Res::kMrBytes, next.length - mr.length));
  }
  // Grants carry the peer's view of this MR (its PD, access and pages): they stop.
  bump_epoch(*s.guest);
  if (next.pd != mr.pd) {
    s.pds[mr.pd].users--;
    s.pds[next.pd].users++;
    mr.pd = next.pd;
  }
  mr.access = next.access;
  if (req.flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    release(*s.guest, Res::kMrBytes, mr.length);
    charge(*s.guest, Res::kMrBytes, next.length);
    // Old segments stay mapped while a frame in flight holds them (transport::Hold).
    mr.chunks = std::move(next.chunks);
    mr.segments = std::move(next.segments);
    mr.addr = next.addr;
    mr.iova = next.iova;
    mr.length = next.length;
  }
  return Status::ok();
}

bool Device::on_dm(const Session& s, const Mr& mr) {
  for (const auto& [h, dm] : s.dms) {
    auto seg = s.segments.find(dm.segment);
    if (seg == s.segments.end()) continue;
    for (const auto& used : mr.segments) {
      if (used == seg->second) return true;
    }
  }
  return false;
}

uint32_t Device::dm_of_segment(const Session& s, uint32_t segment) {
  for (const auto& [h, dm] : s.dms) {
    if (dm.segment == segment) return h;
  }
  return 0;
}

Result<AllocDmResp> Device::alloc_dm(Session& s, const AllocDmReq& req, UniqueFd& mem) {
  return refused(s, "alloc_dm", alloc_dm_checked(s, req, mem));
}

Result<AllocDmResp> Device::alloc_dm_checked(Session& s, const AllocDmReq& req, UniqueFd& mem) {
  Guest& g = *s.guest;
  if (req.length == 0 || req.length > kMaxDmSize)
    return error(EINVAL, fmt::format("length {} outside 1..{}", req.length, kMaxDmSize));
  // A page-aligned mapping satisfies any alignment up to a page; more is not offered.
  if (req.log_align_req > 12)
    return error(EINVAL, fmt::format("log_align_req {} above a page (12)", req.log_align_req));
  if (s.dms.size() >= kMaxDm) return error(ENOMEM, "device memory limit reached");
  const uint64_t bytes = page_round(req.length);
  RETURN_IF_ERROR(check_quota(g, Res::kDmBytes, req.length));
  RETURN_IF_ERROR(check_quota(g, Res::kSegment));
  RETURN_IF_ERROR(check_quota(g, Res::kSegmentBytes, bytes));
  if (bytes > quotas_.max_mapped_bytes - std::min(mapped_bytes_, quotas_.max_mapped_bytes))
    return error(ENOMEM,
                 fmt::format("backend max_mapped_bytes = {} reached", quotas_.max_mapped_bytes));
  ASSIGN_OR_RETURN(mem, make_sealed_memfd("vrdma-dm", bytes));
  auto seg = std::make_shared<Segment>();
  seg->map = MappedRegion::map_shared(mem.get(), bytes);
  if (!seg->map.valid())
    return error(errno, fmt::format("mapping device memory: {}", strerror(errno)));
  seg->fd = dup_fd(mem.get());
  if (!seg->fd.valid()) return error(errno, "dup of the device memory's memfd");
  // The memory is a segment of the session (so MRs, grants and device_state name it as any
  // other), which only free_dm releases.
  charge_segment(g, bytes);
  charge(g, Res::kDmBytes, req.length);
  const uint32_t seg_h = new_handle(s, s.segments);
  s.segments[seg_h] = std::move(seg);
  const uint32_t h = new_handle(s, s.dms);
  s.dms[h] = Dm{h, seg_h, req.length};
  return AllocDmResp{h, 0, bytes};
}

Status Device::free_dm(Session& s, uint32_t handle) {
  auto it = s.dms.find(handle);
  if (it == s.dms.end()) return error(EINVAL, fmt::format("no device memory {}", handle));
  const std::shared_ptr<Segment> seg = s.segments.at(it->second.segment);
  for (const auto& [h, mr] : s.mrs) {
    for (const auto& used : mr->segments) {
      if (used == seg) return error(EBUSY, fmt::format("device memory {} has MR {}", handle, h));
    }
  }
  release_segment(*s.guest, seg->map.size());
  release(*s.guest, Res::kDmBytes, it->second.length);
  s.segments.erase(it->second.segment);
  s.dms.erase(it);
  return Status::ok();
}

Result<RegMrResp> Device::reg_dm_mr(Session& s, const RegDmMrReq& req) {
  return refused(s, "reg_dm_mr", reg_dm_mr_checked(s, req));
}

Result<RegMrResp> Device::reg_dm_mr_checked(Session& s, const RegDmMrReq& req) {
  if (!s.pds.count(req.pd)) return error(EINVAL, fmt::format("no PD {}", req.pd));
  auto dm = s.dms.find(req.dm);
  if (dm == s.dms.end()) return error(EINVAL, fmt::format("no device memory {}", req.dm));
  if (!(req.access & IBV_ACCESS_ZERO_BASED))
    return error(EINVAL, "a device-memory MR needs IBV_ACCESS_ZERO_BASED");
  RETURN_IF_ERROR(check_mr_access(req.access, kDmMrAccessAccepted));
  const uint64_t size = dm->second.length;
  if (req.length == 0 || req.offset > size || req.length > size - req.offset)
    return error(EINVAL, fmt::format("[{}, +{}) outside the device memory's {} bytes", req.offset,
                                     req.length, size));
  const std::shared_ptr<Segment>& seg = s.segments.at(dm->second.segment);
  auto mr = std::make_unique<Mr>();
  mr->chunks.push_back({0, req.length, seg->map.data() + req.offset});
  mr->segments.push_back(seg);
  mr->pd = req.pd;
  mr->access = req.access & ~IBV_ACCESS_ZERO_BASED;  // addr and iova 0 say it
  mr->addr = 0;
  mr->iova = 0;
  mr->length = req.length;
  return add_mr(s, std::move(mr));
}

}  // namespace vrdma::engine
