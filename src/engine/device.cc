// Control path of the device model: sessions, namespaces and resource lifetimes.
#include "engine/device.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/eventfd.h>
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
#include "engine/qp_state.h"
#include "proto/device_caps.h"
#include "proto/wire.h"

namespace vrdma::engine {

using namespace vrdma::proto;

namespace {

template <typename Map>
uint32_t new_handle(Session& s, const Map&) {
  return s.next_handle++;
}

const char* res_name(Res r) {
  static constexpr const char* kNames[] = {
      "max_pds",      "max_qps",      "max_cqs",           "max_srqs",     "max_mrs",
      "max_mr_bytes", "max_segments", "max_segment_bytes", "max_dm_bytes", "max_mws"};
  static_assert(std::size(kNames) == static_cast<size_t>(Res::kCount));
  return kNames[static_cast<size_t>(r)];
}

}  // namespace

// Quotas fail with ENOMEM: the errno the verbs man pages give for "not enough resources" on
// every create/alloc/reg call. EDQUOT would say it better, but no verbs program expects it.
Status Device::check_quota(Guest& g, Res r, uint64_t n) {
  const uint64_t limits[] = {quotas_.max_pds,      quotas_.max_qps,           quotas_.max_cqs,
                             quotas_.max_srqs,     quotas_.max_mrs,           quotas_.max_mr_bytes,
                             quotas_.max_segments, quotas_.max_segment_bytes, quotas_.max_dm_bytes,
                             quotas_.max_mws};
  static_assert(std::size(limits) == static_cast<size_t>(Res::kCount));
  const uint64_t limit = limits[static_cast<size_t>(r)];
  const uint64_t used = g.used[static_cast<size_t>(r)];
  if (limit && (n > limit || used > limit - n)) {
    // One line per quota until the guest frees one: a guest retrying in a loop cannot flood the log.
    const uint32_t bit = 1u << static_cast<unsigned>(r);
    if (!(g.quota_logged & bit)) {
      g.quota_logged |= bit;
      VLOG_WARN("guest {}: quota {} = {} reached (holds {}, asked for {} more)", g.name,
                res_name(r), limit, used, n);
    }
    return error(ENOMEM, fmt::format("guest quota {} = {} reached", res_name(r), limit));
  }
  return Status::ok();
}

void Device::release(Guest& g, Res r, uint64_t n) {
  if (n == 0) return;
  g.used[static_cast<size_t>(r)] -= n;
  g.quota_logged &= ~(1u << static_cast<unsigned>(r));
}

void Device::charge_segment(Guest& g, uint64_t bytes) {
  charge(g, Res::kSegment);
  charge(g, Res::kSegmentBytes, bytes);
  mapped_bytes_ += bytes;
}

void Device::release_segment(Guest& g, uint64_t bytes) {
  release(g, Res::kSegment);
  release(g, Res::kSegmentBytes, bytes);
  mapped_bytes_ -= bytes;
  if (mapped_bytes_ < quotas_.max_mapped_bytes) mapped_logged_ = false;
}

Status Device::check_depth(Guest& g, const char* what, uint32_t entries) {
  const uint32_t limit = quotas_.max_queue_depth;
  if (limit == 0 || entries <= limit) return Status::ok();
  // Logged once per guest: nothing is held that could be freed to re-arm it.
  const uint32_t bit = 1u << static_cast<unsigned>(Res::kCount);
  if (!(g.quota_logged & bit)) {
    g.quota_logged |= bit;
    VLOG_WARN("guest {}: quota max_queue_depth = {} reached ({} of {} entries)", g.name, limit,
              what, entries);
  }
  return error(ENOMEM, fmt::format("{} of {} entries: guest quota max_queue_depth = {}", what,
                                   entries, limit));
}

Status Device::refused(Session& s, const char* call, Status st) {
  if (st.is_ok()) return st;
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  const uint64_t now = uint64_t(t.tv_sec) * 1'000'000'000ull + uint64_t(t.tv_nsec);
  uint64_t held = 0;
  if (s.guest->refusals.ready(now, held)) {
    const char* name = ::strerrorname_np(st.err());
    VLOG_WARN("guest {} (pid {}): {} refused with {}: {}{}", s.guest->name, s.pid, call,
              name ? name : std::to_string(st.err()), st.message(), log::held_note(held));
  }
  return st;
}

Status Device::check_caps(std::initializer_list<Cap> caps) {
  for (const Cap& c : caps) {
    if (c.value > c.max)
      return error(EINVAL, fmt::format("{} = {} exceeds the device's {}", c.field, c.value, c.max));
  }
  return Status::ok();
}

Device::Device(Quotas quotas)
    : rng_(std::random_device{}()), quotas_(quotas), backend_uid_(::geteuid()) {
  // Copies to and from guest memory fail their WQE on a fault instead of killing the process.
  install_guest_fault_handler();
}
Device::~Device() {
  while (!sessions_.empty()) close_session(sessions_.begin()->second.get());
}

Result<uint16_t> Device::new_guest_lid(const std::string& name) {
  if (transport_) {
    // The GID comes from the name: a guest of that name on a peer backend has it, and its
    // peers' QPs would hear ours. One name, one place (a guest that moves keeps its name through
    // the migration handshake, not through a Hello).
    const auto gid = gid_of(name);
    const std::string there = transport_->locate_gid(gid.data());
    if (!there.empty() && there != transport_->self()) {
      VLOG_WARN(
          "guest {}: refused: backend {} has a guest of that name (its GID and LID are the "
          "name's), and its peers' QPs would hear this one",
          name, there);
      return error(EADDRINUSE,
                   fmt::format("guest {} lives on backend {}; choose another name", name, there));
    }
  }
  // The LID comes from the name too, so it is the same on every backend (a guest that moves
  // keeps it, and peers see no clash in practice), and stays with the name here. A LID taken
  // here or by a peer backend's guest (the directory) probes to the next one: a local guest
  // never gets a LID that a peer's QPs are connected to.
  auto elsewhere = [&](uint16_t l) { return transport_ && !transport_->locate_lid(l).empty(); };
  if (auto it = lid_of_name_.find(name); it != lid_of_name_.end() && !elsewhere(it->second))
    return it->second;
  std::unordered_set<uint16_t> here;
  for (const auto& [n, l] : lid_of_name_) {
    if (n != name) here.insert(l);
  }
  uint16_t lid = lid_of_name(name);
  for (uint32_t tries = 0; tries < 0xbfff; ++tries, lid = static_cast<uint16_t>(lid % 0xbfff + 1)) {
    if (!here.contains(lid) && !elsewhere(lid)) return lid;
  }
  return error(ENOSPC, "no unicast LIDs left");
}

Result<Session*> Device::open_session(const HelloReq& req, const PeerCred& peer, HelloResp& resp,
                                      FdList& fds) {
  size_t len = strnlen(req.guest, kGuestNameMax);
  if (len == 0 || len == kGuestNameMax)
    return error(EINVAL, "guest name must be 1..63 bytes, NUL-terminated");
  std::string name(req.guest, len);
  for (char c : name) {
    if (c < 0x21 || c > 0x7e) return error(EINVAL, "guest name has non-printable characters");
  }
  // The pid in the request is the guest's word; the kernel's is the one recorded.
  if (req.pid != peer.pid)
    VLOG_DEBUG("guest {}: hello claims pid {}, the socket's peer is pid {}", name, req.pid,
               peer.pid);
  // A guest belongs to the uid that created it: another uid sharing its QPN space, epoch page and
  // quotas could exhaust them, or take its QPs' peers' messages.
  auto found = guests_.find(name);
  if (found != guests_.end()) {
    Guest& owned = *found->second;
    if (peer.uid != owned.owner_uid && !is_admin_uid(peer.uid, backend_uid_)) {
      // Once per guest and uid: an attacker retrying in a loop cannot flood the log.
      auto& seen = owned.refused_logged;
      const bool logged = std::find(seen.begin(), seen.end(), peer.uid) != seen.end();
      if (!logged && seen.size() < kMaxRefusalsLogged) {
        seen.push_back(peer.uid);
        VLOG_WARN(
            "guest {}: uid {} (pid {}) refused a session (EPERM): the guest belongs to uid {}",
            name, peer.uid, peer.pid, owned.owner_uid);
      } else {
        VLOG_DEBUG("guest {}: uid {} (pid {}) refused a session again", name, peer.uid, peer.pid);
      }
      return error(EPERM, fmt::format("guest {} belongs to another user", name));
    }
  }
  const bool fresh = found == guests_.end();
  if (fresh) {
    ASSIGN_OR_RETURN(const uint16_t lid, new_guest_lid(name));
    auto ng = std::make_unique<Guest>();
    ng->name = name;
    ng->owner_uid = peer.uid;
    ng->id = fnv1a64(name);
    ng->port_guid = port_guid_of(name);
    auto gid = gid_of(name);
    std::memcpy(ng->gid, gid.data(), 16);
    ng->lid = lid;
    lid_of_name_[name] = lid;
    guests_by_lid_[lid] = ng.get();
    VLOG_INFO("guest {} joined: lid {:#x}, owner uid {}", name, lid, ng->owner_uid);
    if (transport_) {
      transport::GuestInfo info{name, lid, {}};
      std::memcpy(info.gid, ng->gid, 16);
      transport_->announce(info, true);
    }
    found = guests_.emplace(name, std::move(ng)).first;
  }
  Guest* g = found->second.get();
  // A guest made for this hello goes again if its first session cannot be made (no descriptors):
  // left behind, it would hold its name and LID for its owner with no session to end it.
  struct ForgetIfFailed {
    Device& dev;
    Guest* fresh;
    ~ForgetIfFailed() {
      if (!fresh) return;
      dev.guests_by_lid_.erase(fresh->lid);
      dev.lid_of_name_.erase(fresh->name);
      if (dev.transport_) {
        transport::GuestInfo info{fresh->name, fresh->lid, {}};
        std::memcpy(info.gid, fresh->gid, 16);
        dev.transport_->announce(info, false);
      }
      const std::string name = fresh->name;  // a copy: the entry erased owns `fresh`
      dev.guests_.erase(name);
    }
  } undo{*this, fresh ? g : nullptr};
  auto s = std::make_unique<Session>();
  s->id = next_session_++;
  s->pid = peer.pid;
  s->uid = peer.uid;
  s->guest = g;

  ASSIGN_OR_RETURN(s->control_fd, make_sealed_memfd("vrdma-control", kPage));
  s->control = MappedRegion::map_shared(s->control_fd.get(), kPage);
  if (!s->control.valid()) return error(errno, "mapping control page");
  ControlPage* cp = s->control_page();
  cp->magic = kRingMagic;
  cp->version = kRingVersion;
  cp->features =
      (direct_ ? kFeatureDirect : 0) | (direct_remote_ ? kFeatureDirectRemote : 0) | kFeatureLimits;
  cp->limits = GuestLimits{quotas_.max_queue_depth,
                           quotas_.max_qps,
                           quotas_.max_cqs,
                           quotas_.max_srqs,
                           quotas_.max_mrs,
                           quotas_.max_pds,
                           static_cast<uint32_t>(quotas_.max_mr_bytes),
                           static_cast<uint32_t>(quotas_.max_mr_bytes >> 32)};
  cp->max_dm_bytes_lo = static_cast<uint32_t>(quotas_.max_dm_bytes);
  cp->max_dm_bytes_hi = static_cast<uint32_t>(quotas_.max_dm_bytes >> 32);
  cp->max_mws = quotas_.max_mws;
  cp->backend_sleeping.store(0);
  s->doorbell = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!s->doorbell.valid()) return error(errno, "eventfd");
  int p[2];
  if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) < 0) return error(errno, "pipe2");
  s->async_read = UniqueFd(p[0]);
  s->async_write = UniqueFd(p[1]);

  g->sessions++;
  resp.guest_id = g->id;
  resp.port_guid = g->port_guid;
  std::memcpy(resp.gid, g->gid, 16);
  resp.lid = g->lid;
  resp.session_id = s->id;
  resp.control_bytes = kPage;
  fds = {s->control_fd.get(), s->doorbell.get(), s->async_read.get()};
  s->comm = read_comm(s->pid);
  Session* raw = s.get();
  sessions_[raw->id] = std::move(s);
  undo.fresh = nullptr;
  // The port is up: say so, as a device does when its link becomes active.
  post_async(*raw, IBV_EVENT_PORT_ACTIVE, 1);
  VLOG_INFO("session {} opened: guest {} pid {} uid {}", raw->id, name, raw->pid, raw->uid);
  return raw;
}

void Device::close_session(Session* s) { close_session_impl(s, false); }

void Device::close_session_impl(Session* s, bool moved) {
  size_t nqp = s->qps.size(), nmr = s->mrs.size();
  Guest* g = s->guest;
  bump_epoch(*g);
  // A peer's QP connected to one of ours would otherwise wait for ACKs that never come. A
  // session whose device moved to another backend is still alive there: its peers follow it.
  if (!moved) fail_peers(*s);
  // Tear down in dependency order: QPs, then CQs and channels, MRs, segments, PDs.
  while (!s->qps.empty()) destroy_qp_now(*s, *s->qps.begin()->second);
  release(*g, Res::kSrq, s->srqs.size());
  s->srqs.clear();
  release(*g, Res::kCq, s->cqs.size());
  s->cqs.clear();
  s->channels.clear();
  for (auto& [h, mr] : s->mrs) {
    g->mrs.erase(mr->key);
    release(*g, Res::kMrBytes, mr->length);
  }
  release(*g, Res::kMr, s->mrs.size());
  s->mrs.clear();
  for (const auto& [h, seg] : s->segments) release_segment(*g, seg->map.size());
  s->segments.clear();
  for (const auto& [h, dm] : s->dms) release(*g, Res::kDmBytes, dm.length);
  s->dms.clear();
  for (const auto& [h, mw] : s->mws) g->mws.erase(mw->rkey >> 8);
  release(*g, Res::kMw, s->mws.size());
  s->mws.clear();
  release(*g, Res::kPd, s->pds.size());
  s->pds.clear();
  if (moved) {
    VLOG_INFO("session {} (guest {} pid {}) moved away with {} QPs, {} MRs", s->id, g->name,
              s->pid, nqp, nmr);
  } else {
    VLOG_INFO("session {} closed (guest {} pid {}): reclaimed {} QPs, {} MRs", s->id, g->name,
              s->pid, nqp, nmr);
  }
  sessions_.erase(s->id);
  if (--g->sessions == 0) {
    VLOG_INFO("guest {} {}", g->name, moved ? "moved to another backend" : "left");
    if (transport_) {
      transport::GuestInfo info{g->name, g->lid, {}};
      std::memcpy(info.gid, g->gid, 16);
      transport_->announce(info, false);
    }
    guests_by_lid_.erase(g->lid);
    // A guest that moved away keeps its LID reserved here, to come back to; one that left frees
    // it (else every name ever seen would hold a LID until 0xbfff names locked everyone out).
    if (!moved) {
      lid_of_name_.erase(g->name);
      departed_.push_front(
          {g->name, g->lid, g->owner_uid, static_cast<uint64_t>(::time(nullptr)), g->retired});
      if (departed_.size() > kDepartedMax) departed_.pop_back();
      departed_all_ += g->retired;
    }
    guests_.erase(g->name);
  }
}

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
    return error(EOPNOTSUPP,
                 fmt::format("access {:#x}: ZERO_BASED and ON_DEMAND are not supported", access));
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
  RETURN_IF_ERROR(mr_translation(s, req, *mr));
  mr->pd = req.pd;
  mr->access = req.access;
  return add_mr(s, std::move(mr));
}

Result<RegMrResp> Device::add_mr(Session& s, std::unique_ptr<Mr> mr) {
  if (s.guest->mrs.size() >= kMaxMr) return error(ENOMEM, "MR limit reached");
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kMr));
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kMrBytes, mr->length));
  charge(*s.guest, Res::kMr);
  charge(*s.guest, Res::kMrBytes, mr->length);
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
  release(*s.guest, Res::kMrBytes, it->second->length);
  s.mrs.erase(it);
  return Status::ok();
}

Status Device::rereg_mr(Session& s, const ReregMrReq& req) {
  return refused(s, "rereg_mr", rereg_mr_checked(s, req));
}

Status Device::rereg_mr_checked(Session& s, const ReregMrReq& req) {
  auto it = s.mrs.find(req.handle);
  if (it == s.mrs.end()) return error(EINVAL, fmt::format("no MR {}", req.handle));
  Mr& mr = *it->second;
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

Result<uint32_t> Device::create_channel(Session& s, UniqueFd& read_end) {
  if (s.channels.size() >= kMaxChannels) return error(EMFILE, "channel limit reached");
  int p[2];
  if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) < 0) return error(errno, "pipe2");
  read_end = UniqueFd(p[0]);
  // The guest may set O_NONBLOCK on its end itself; ours stays non-blocking so a guest that
  // never reads cannot stall the engine.
  ::fcntl(p[0], F_SETFL, 0);
  uint32_t h = new_handle(s, s.channels);
  Channel& c = s.channels[h];
  c.handle = h;
  c.write_end = UniqueFd(p[1]);
  return h;
}

Status Device::destroy_channel(Session& s, uint32_t handle) {
  auto it = s.channels.find(handle);
  if (it == s.channels.end()) return error(EINVAL, fmt::format("no channel {}", handle));
  if (it->second.users) return error(EBUSY, "channel still has CQs");
  s.channels.erase(it);
  return Status::ok();
}

Result<CreateCqResp> Device::create_cq(Session& s, const CreateCqReq& req, UniqueFd& ring) {
  return refused(s, "create_cq", create_cq_checked(s, req, ring));
}

Result<CreateCqResp> Device::create_cq_checked(Session& s, const CreateCqReq& req, UniqueFd& ring) {
  if (req.cqe == 0 || req.cqe > kMaxCqe)
    return error(EINVAL, fmt::format("cqe {} outside 1..{}", req.cqe, kMaxCqe));
  if (s.cqs.size() >= kMaxCq) return error(ENOMEM, "CQ limit reached");
  RETURN_IF_ERROR(check_depth(*s.guest, "CQ", req.cqe));
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kCq));
  Channel* ch = nullptr;
  if (req.channel != kNone) {
    auto it = s.channels.find(req.channel);
    if (it == s.channels.end()) return error(EINVAL, fmt::format("no channel {}", req.channel));
    ch = &it->second;
  }
  auto cq = std::make_unique<Cq>();
  cq->size = std::bit_ceil(req.cqe + 1);
  size_t bytes = page_round(ring_bytes(cq->size, sizeof(Cqe)));
  ASSIGN_OR_RETURN(ring, make_sealed_memfd("vrdma-cq", bytes));
  cq->ring = MappedRegion::map_shared(ring.get(), bytes);
  if (!cq->ring.valid()) return error(errno, "mapping CQ ring");
  cq->ring_fd = dup_fd(ring.get());
  charge(*s.guest, Res::kCq);
  cq->hdr = reinterpret_cast<RingHeader*>(cq->ring.data());
  init_ring(cq->hdr, RingKind::kCq, sizeof(Cqe), cq->size);
  cq->entries = ring_entries<Cqe>(cq->hdr);
  cq->owner = &s;
  cq->handle = new_handle(s, s.cqs);
  if (ch) {
    cq->channel = ch->handle;
    ch->users++;
  }
  CreateCqResp resp{cq->handle, cq->size - 1, bytes};
  s.cqs[cq->handle] = std::move(cq);
  return resp;
}

Status Device::destroy_cq(Session& s, uint32_t handle) {
  auto it = s.cqs.find(handle);
  if (it == s.cqs.end()) return error(EINVAL, fmt::format("no CQ {}", handle));
  if (it->second->users) return error(EBUSY, "CQ still used by a QP");
  if (it->second->channel != kNone) s.channels[it->second->channel].users--;
  s.cqs.erase(it);
  release(*s.guest, Res::kCq);
  return Status::ok();
}

Result<CreateCqResp> Device::resize_cq(Session& s, const ResizeCqReq& req, UniqueFd& ring) {
  return refused(s, "resize_cq", resize_cq_checked(s, req, ring));
}

Result<CreateCqResp> Device::resize_cq_checked(Session& s, const ResizeCqReq& req, UniqueFd& ring) {
  auto it = s.cqs.find(req.handle);
  if (it == s.cqs.end()) return error(EINVAL, fmt::format("no CQ {}", req.handle));
  Cq& cq = *it->second;
  if (req.cqe == 0 || req.cqe > kMaxCqe)
    return error(EINVAL, fmt::format("cqe {} outside 1..{}", req.cqe, kMaxCqe));
  // The library published its consumer cursor before asking, and polls nothing meanwhile.
  const uint32_t cons = cq.hdr->consumer.load(std::memory_order_acquire);
  const uint32_t held = cq.prod - cons;
  if (held > cq.size) return error(EINVAL, "the CQ's consumer index is corrupt");
  // Completions of this CQ waiting in its QPs' own rings (direct path) are outstanding too;
  // a resize leaves those rings alone. Their cursors are the guest's: each is capped.
  uint64_t outstanding = held;
  for (const auto& [h, qp] : s.qps) {
    for (const Cq* own : {qp->send_cq == &cq ? qp->own_send.get() : nullptr,
                          qp->recv_cq == &cq ? qp->own_recv.get() : nullptr}) {
      if (own)
        outstanding += std::min(own->hdr->producer.load(std::memory_order_acquire) -
                                    own->hdr->consumer.load(std::memory_order_acquire),
                                own->size);
    }
  }
  if (req.cqe < outstanding)
    return error(EINVAL,
                 fmt::format("cqe {} below the {} completions it holds", req.cqe, outstanding));
  RETURN_IF_ERROR(check_depth(*s.guest, "CQ", req.cqe));
  const uint32_t size = std::bit_ceil(req.cqe + 1);
  const size_t bytes = page_round(ring_bytes(size, sizeof(Cqe)));
  UniqueFd fd;
  ASSIGN_OR_RETURN(fd, make_sealed_memfd("vrdma-cq", bytes));
  MappedRegion map = MappedRegion::map_shared(fd.get(), bytes);
  if (!map.valid()) return error(errno, "mapping CQ ring");
  auto* hdr = reinterpret_cast<RingHeader*>(map.data());
  init_ring(hdr, RingKind::kCq, sizeof(Cqe), size);
  Cqe* entries = ring_entries<Cqe>(hdr);
  // Same free-running cursors, so the library's own consumer cursor stays valid; completions
  // keep their order.
  for (uint32_t i = cons; i != cq.prod; ++i)
    entries[i & (size - 1)] = cq.entries[i & (cq.size - 1)];
  hdr->direct_gen.store(cq.hdr->direct_gen.load(std::memory_order_relaxed));
  hdr->armed.store(cq.hdr->armed.load(std::memory_order_acquire));
  hdr->consumer.store(cons, std::memory_order_relaxed);
  hdr->producer.store(cq.prod, std::memory_order_release);
  ring = dup_fd(fd.get());
  if (!ring.valid()) return error(errno, "dup of the CQ ring's memfd");
  cq.ring = std::move(map);
  cq.ring_fd = std::move(fd);
  cq.hdr = hdr;
  cq.entries = entries;
  cq.size = size;
  cq.overrun = false;
  return CreateCqResp{cq.handle, size - 1, bytes};
}

Result<CreateQpResp> Device::create_qp(Session& s, const CreateQpReq& req, UniqueFd& ring) {
  return refused(s, "create_qp", create_qp_checked(s, req, ring));
}

Result<CreateQpResp> Device::create_qp_checked(Session& s, const CreateQpReq& req, UniqueFd& ring) {
  auto pd = s.pds.find(req.pd);
  if (pd == s.pds.end()) return error(EINVAL, fmt::format("no PD {}", req.pd));
  auto scq = s.cqs.find(req.send_cq), rcq = s.cqs.find(req.recv_cq);
  if (scq == s.cqs.end() || rcq == s.cqs.end()) return error(EINVAL, "no such CQ");
  Srq* srq = nullptr;
  if (req.srq != kNone) {
    auto it = s.srqs.find(req.srq);
    if (it == s.srqs.end()) return error(EINVAL, fmt::format("no SRQ {}", req.srq));
    srq = it->second.get();
  }
  if (req.qp_type != IBV_QPT_RC && req.qp_type != IBV_QPT_UC && req.qp_type != IBV_QPT_UD)
    return error(EOPNOTSUPP, fmt::format("QP type {} is not supported yet", req.qp_type));
  QpCaps c = req.caps;
  if (srq) {  // receives come from the SRQ: the QP's own receive queue is unused (ignored caps)
    c.max_recv_wr = 0;
    c.max_recv_sge = 0;
  }
  // 0 work requests is valid: a QP that only sends or only receives (qperf's one-way tests).
  // Its ring keeps one slot, which the library never posts to (ENOMEM, as on hardware).
  RETURN_IF_ERROR(check_caps({{"max_send_wr", c.max_send_wr, kMaxQpWr},
                              {"max_recv_wr", c.max_recv_wr, kMaxQpWr},
                              {"max_send_sge", c.max_send_sge, kMaxSge},
                              {"max_recv_sge", c.max_recv_sge, kMaxSge},
                              {"max_inline_data", c.max_inline_data, kMaxInline}}));
  RETURN_IF_ERROR(check_depth(*s.guest, "send queue", c.max_send_wr));
  RETURN_IF_ERROR(check_depth(*s.guest, "receive queue", c.max_recv_wr));
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kQp));
  size_t nqp = 0;
  for (auto& [id, ss] : sessions_) nqp += ss->qps.size();
  if (nqp >= kMaxQp) return error(ENOMEM, "QP limit reached");
  Guest& g = *s.guest;
  uint32_t qpn;
  do {
    qpn = g.next_qpn++ & 0xffffff;
    if (qpn < 0x11) continue;
  } while (qpn < 0x11 || g.qps.count(qpn));

  auto qp = std::make_unique<Qp>();
  qp->sq_size = std::bit_ceil(std::max<uint32_t>(c.max_send_wr, 1));
  qp->rq_size = std::bit_ceil(std::max<uint32_t>(c.max_recv_wr, 1));
  size_t sq_bytes = page_round(ring_bytes(qp->sq_size, sizeof(SendWqe)));
  size_t rq_bytes = page_round(ring_bytes(qp->rq_size, sizeof(RecvWqe)));
  ASSIGN_OR_RETURN(ring, make_sealed_memfd("vrdma-qp", sq_bytes + rq_bytes));
  qp->ring = MappedRegion::map_shared(ring.get(), sq_bytes + rq_bytes);
  if (!qp->ring.valid()) return error(errno, "mapping QP rings");
  qp->ring_fd = dup_fd(ring.get());
  charge(g, Res::kQp);
  qp->sq_hdr = reinterpret_cast<RingHeader*>(qp->ring.data());
  qp->rq_hdr = reinterpret_cast<RingHeader*>(qp->ring.data() + sq_bytes);
  init_ring(qp->sq_hdr, RingKind::kSq, sizeof(SendWqe), qp->sq_size);
  init_ring(qp->rq_hdr, RingKind::kRq, sizeof(RecvWqe), qp->rq_size);
  qp->sq = ring_entries<SendWqe>(qp->sq_hdr);
  qp->rq = ring_entries<RecvWqe>(qp->rq_hdr);
  qp->handle = new_handle(s, s.qps);
  qp->qpn = qpn;
  qp->owner = &s;
  qp->guest = &g;
  qp->type = static_cast<ibv_qp_type>(req.qp_type);
  qp->pd = req.pd;
  qp->send_cq = scq->second.get();
  qp->recv_cq = rcq->second.get();
  qp->srq = srq;
  if (srq) srq->users++;
  qp->sq_sig_all = req.sq_sig_all != 0;
  qp->caps = c;
  // Report what the rings really hold (none for a queue of 0: its slot is never posted to).
  qp->caps.max_send_wr = c.max_send_wr ? qp->sq_size : 0;
  qp->caps.max_recv_wr = c.max_recv_wr ? qp->rq_size : 0;
  qp->caps.max_send_sge = std::max<uint32_t>(c.max_send_sge, 1);
  qp->caps.max_recv_sge = std::max<uint32_t>(c.max_recv_sge, 1);
  qp->attr.qp_state = IBV_QPS_RESET;
  qp->attr.port_num = 1;
  qp->attr.path_mtu = IBV_MTU_4096;
  pd->second.users++;
  qp->send_cq->users++;
  qp->recv_cq->users++;
  CreateQpResp resp{qp->handle, qpn, qp->caps, sq_bytes + rq_bytes, sq_bytes};
  qp->flow = next_flow_++;
  g.qps[qpn] = qp.get();
  active_.push_back(qp.get());
  if (g.active.empty()) active_guests_.push_back(&g);
  g.active.push_back(qp.get());
  s.qps[qp->handle] = std::move(qp);
  return resp;
}

Qp* Device::find_qp(Session& s, uint32_t handle) {
  auto it = s.qps.find(handle);
  return it == s.qps.end() ? nullptr : it->second.get();
}

Status Device::modify_qp(Session& s, const ModifyQpReq& req) {
  return refused(s, "modify_qp", modify_qp_checked(s, req));
}

Status Device::modify_qp_checked(Session& s, const ModifyQpReq& req) {
  Qp* qp = find_qp(s, req.handle);
  if (!qp) return error(EINVAL, fmt::format("no QP {}", req.handle));
  bump_epoch(*s.guest);
  const QpAttr& a = req.attr;
  const uint32_t m = req.mask;
  // Range-check before the cast: an ibv_qp_state outside the enum's values is undefined
  // behaviour (found by fuzz_ring).
  if ((m & IBV_QP_STATE) && a.qp_state > IBV_QPS_ERR)
    return error(EINVAL, fmt::format("unknown QP state {}", a.qp_state));
  const auto next = (m & IBV_QP_STATE) ? static_cast<ibv_qp_state>(a.qp_state) : qp->state;
  if ((m & IBV_QP_CUR_STATE) && a.cur_qp_state != static_cast<uint32_t>(qp->state))
    return error(EINVAL, "cur_qp_state does not match the QP's state");
  RETURN_IF_ERROR(check_modify_qp(qp->type, qp->state, next, m));
  if ((m & IBV_QP_PORT) && a.port_num != 1) return error(EINVAL, "port_num must be 1");
  if ((m & IBV_QP_PKEY_INDEX) && a.pkey_index != 0) return error(EINVAL, "pkey_index must be 0");
  if ((m & IBV_QP_PATH_MTU) && (a.path_mtu < IBV_MTU_256 || a.path_mtu > kPortMaxMtu))
    return error(EINVAL, "path_mtu out of range");
  if ((m & IBV_QP_AV) && a.ah_port_num > 1) return error(EINVAL, "AV port_num must be 1");
  if ((m & IBV_QP_ACCESS_FLAGS) && (a.qp_access_flags & ~kQpAccessAccepted))
    return error(EINVAL, fmt::format("qp_access_flags {:#x}: unknown bits {:#x}", a.qp_access_flags,
                                     a.qp_access_flags & ~kQpAccessAccepted));
  if ((m & IBV_QP_MAX_QP_RD_ATOMIC) && a.max_rd_atomic > kMaxRdAtomic) return error(EINVAL, "max_rd_atomic");
  if ((m & IBV_QP_MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic > kMaxRdAtomic)
    return error(EINVAL, "max_dest_rd_atomic");
  if ((m & IBV_QP_MIN_RNR_TIMER) && a.min_rnr_timer > 31) return error(EINVAL, "min_rnr_timer");
  if ((m & IBV_QP_TIMEOUT) && a.timeout > 31) return error(EINVAL, "timeout");
  if ((m & IBV_QP_RETRY_CNT) && a.retry_cnt > 7) return error(EINVAL, "retry_cnt");
  if ((m & IBV_QP_RNR_RETRY) && a.rnr_retry > 7) return error(EINVAL, "rnr_retry");

  QpAttr& q = qp->attr;
  if (m & IBV_QP_ACCESS_FLAGS) q.qp_access_flags = a.qp_access_flags;
  if (m & IBV_QP_PKEY_INDEX) q.pkey_index = a.pkey_index;
  if (m & IBV_QP_PORT) q.port_num = a.port_num;
  if (m & IBV_QP_QKEY) q.qkey = a.qkey;
  if (m & IBV_QP_AV) {
    q.dlid = a.dlid;
    q.sl = a.sl;
    q.src_path_bits = a.src_path_bits;
    q.static_rate = a.static_rate;
    q.is_global = a.is_global;
    q.ah_port_num = a.ah_port_num;
    q.sgid_index = a.sgid_index;
    q.hop_limit = a.hop_limit;
    q.traffic_class = a.traffic_class;
    q.flow_label = a.flow_label;
    std::memcpy(q.dgid, a.dgid, 16);
  }
  if (m & IBV_QP_PATH_MTU) q.path_mtu = a.path_mtu;
  if (m & IBV_QP_TIMEOUT) q.timeout = a.timeout;
  if (m & IBV_QP_RETRY_CNT) q.retry_cnt = a.retry_cnt;
  if (m & IBV_QP_RNR_RETRY) q.rnr_retry = a.rnr_retry;
  if (m & IBV_QP_RQ_PSN) q.rq_psn = qp->expected_psn = a.rq_psn & 0xffffff;
  if (m & IBV_QP_SQ_PSN) q.sq_psn = qp->next_psn = a.sq_psn & 0xffffff;
  if (m & (IBV_QP_RQ_PSN | IBV_QP_SQ_PSN)) publish_psns(*qp);
  if (m & IBV_QP_MAX_QP_RD_ATOMIC) q.max_rd_atomic = a.max_rd_atomic;
  if (m & IBV_QP_MAX_DEST_RD_ATOMIC) q.max_dest_rd_atomic = a.max_dest_rd_atomic;
  if (m & IBV_QP_MIN_RNR_TIMER) q.min_rnr_timer = a.min_rnr_timer;
  if (m & IBV_QP_DEST_QPN) q.dest_qp_num = a.dest_qp_num & 0xffffff;
  if (m & IBV_QP_EN_SQD_ASYNC_NOTIFY) q.en_sqd_async_notify = a.en_sqd_async_notify;
  if (m & IBV_QP_STATE) {
    ibv_qp_state prev = qp->state;
    qp->state = next;
    q.qp_state = next;
    // Connecting: the destination decides the transport (a local guest or a peer's).
    if (next == IBV_QPS_RTR && prev != IBV_QPS_RTR) choose_route(*qp);
    if (next == IBV_QPS_RTS) {
      qp->retry_left = q.retry_cnt;
      qp->rnr_left = q.rnr_retry;
    }
    if (next == IBV_QPS_ERR || next == IBV_QPS_RESET) take_back(*qp);
    if (next == IBV_QPS_RESET) {
      // RESET discards all outstanding work without completions.
      qp->unacked.clear();
      qp->sq_cons = qp->sq_hdr->producer.load(std::memory_order_acquire);
      qp->rq_cons = qp->rq_hdr->producer.load(std::memory_order_acquire);
      qp->sq_hdr->consumer.store(qp->sq_cons, std::memory_order_release);
      qp->rq_hdr->consumer.store(qp->rq_cons, std::memory_order_release);
      qp->sq_hdr->retired.store(qp->sq_cons, std::memory_order_release);
      qp->sq_sent = qp->sq_cons;
      // A direct connection across backends ends with it: its peer's offer was for this
      // connection, and the backend executes its send queue again.
      qp->direct_remote = false;
      qp->direct = false;
      s.guest->direct_offers.erase(qp->qpn);
    }
    // Leaving RTS (to ERR, RESET, SQD) or entering it ends any retry wait: in ERR the head WQE
    // is flushed, and a pending deadline must not keep the backend from sleeping.
    if (next != prev) {
      qp->wait = Wait::kNone;
      qp->probe = false;
    }
    VLOG_DEBUG("qp {:#x} (guest {}): {} -> {}", qp->qpn, s.guest->name, qp_state_name(prev),
               qp_state_name(next));
  }
  return Status::ok();
}

Result<QueryQpResp> Device::query_qp(Session& s, uint32_t handle) {
  Qp* qp = find_qp(s, handle);
  if (!qp) return error(EINVAL, fmt::format("no QP {}", handle));
  QueryQpResp r{};
  r.attr = qp->attr;
  r.attr.qp_state = qp->state;
  r.attr.cur_qp_state = qp->state;
  r.caps = qp->caps;
  return r;
}

void Device::fail_peers(const Session& s) {
  if (s.qps.empty()) return;
  for (Guest* g : active_guests_) {
    for (Qp* peer : g->active) {
      if (peer->owner == &s || peer->type == IBV_QPT_UD || peer->remote) continue;
      if (peer->state != IBV_QPS_RTR && peer->state != IBV_QPS_RTS && peer->state != IBV_QPS_SQD)
        continue;
      const Qp* to = lookup_remote(*peer);
      if (!to || to->owner != &s) continue;
      enter_error(*peer, "its connected peer's session ended");
      post_async(*peer->owner, IBV_EVENT_QP_FATAL, peer->handle);
    }
  }
}

void Device::destroy_qp_now(Session& s, Qp& qp) {
  Guest& g = *qp.guest;
  bump_epoch(g);
  take_back(qp);
  mcast_forget(qp);
  g.retired += counters_of(qp);
  g.qps.erase(qp.qpn);
  g.direct_offers.erase(qp.qpn);
  active_.erase(std::remove(active_.begin(), active_.end(), &qp), active_.end());
  g.active.erase(std::remove(g.active.begin(), g.active.end(), &qp), g.active.end());
  if (g.active.empty()) {
    active_guests_.erase(std::remove(active_guests_.begin(), active_guests_.end(), &g),
                         active_guests_.end());
  }
  // Type 2 windows bound through it are reachable through nothing now: they are invalidated,
  // or they would hold their MR (dereg_mr is EBUSY while bound) until deallocated.
  for (auto& [h, mw] : s.mws)
    if (mw->type == IBV_MW_TYPE_2 && mw->bound && mw->qpn == qp.qpn) mw->bound = false;
  release(g, Res::kQp);
  s.pds[qp.pd].users--;
  qp.send_cq->users--;
  qp.recv_cq->users--;
  if (qp.srq) qp.srq->users--;
  s.qps.erase(qp.handle);
}

Status Device::destroy_qp(Session& s, uint32_t handle) {
  Qp* qp = find_qp(s, handle);
  if (!qp) return error(EINVAL, fmt::format("no QP {}", handle));
  destroy_qp_now(s, *qp);
  return Status::ok();
}

Result<CreateSrqResp> Device::create_srq(Session& s, const CreateSrqReq& req, UniqueFd& ring) {
  return refused(s, "create_srq", create_srq_checked(s, req, ring));
}

Result<CreateSrqResp> Device::create_srq_checked(Session& s, const CreateSrqReq& req,
                                                 UniqueFd& ring) {
  auto pd = s.pds.find(req.pd);
  if (pd == s.pds.end()) return error(EINVAL, fmt::format("no PD {}", req.pd));
  const SrqAttr& a = req.attr;
  // An SRQ of 0 receives could never be used (rxe refuses it too); 0 SGEs means 1, as for QPs.
  if (a.max_wr == 0) return error(EINVAL, "max_wr = 0: an SRQ holds at least one receive");
  RETURN_IF_ERROR(check_caps({{"max_wr", a.max_wr, kMaxQpWr}, {"max_sge", a.max_sge, kMaxSge}}));
  if (a.srq_limit > a.max_wr)
    return error(EINVAL, fmt::format("srq_limit {} above max_wr {}", a.srq_limit, a.max_wr));
  if (s.srqs.size() >= kMaxSrq) return error(ENOMEM, "SRQ limit reached");
  RETURN_IF_ERROR(check_depth(*s.guest, "SRQ", a.max_wr));
  RETURN_IF_ERROR(check_quota(*s.guest, Res::kSrq));
  auto srq = std::make_unique<Srq>();
  srq->size = std::bit_ceil(a.max_wr);
  const size_t bytes = page_round(ring_bytes(srq->size, sizeof(RecvWqe)));
  ASSIGN_OR_RETURN(ring, make_sealed_memfd("vrdma-srq", bytes));
  srq->ring = MappedRegion::map_shared(ring.get(), bytes);
  if (!srq->ring.valid()) return error(errno, "mapping SRQ ring");
  srq->ring_fd = dup_fd(ring.get());
  charge(*s.guest, Res::kSrq);
  srq->hdr = reinterpret_cast<RingHeader*>(srq->ring.data());
  init_ring(srq->hdr, RingKind::kRq, sizeof(RecvWqe), srq->size);
  srq->entries = ring_entries<RecvWqe>(srq->hdr);
  srq->handle = new_handle(s, s.srqs);
  srq->owner = &s;
  srq->pd = req.pd;
  srq->max_sge = std::max<uint32_t>(a.max_sge, 1);
  srq->limit = a.srq_limit;
  pd->second.users++;
  CreateSrqResp resp{srq->handle, 0, SrqAttr{srq->size, srq->max_sge, srq->limit, 0}, bytes};
  s.srqs[srq->handle] = std::move(srq);
  return resp;
}

Status Device::modify_srq(Session& s, const ModifySrqReq& req) {
  return refused(s, "modify_srq", modify_srq_checked(s, req));
}

Status Device::modify_srq_checked(Session& s, const ModifySrqReq& req) {
  auto it = s.srqs.find(req.handle);
  if (it == s.srqs.end()) return error(EINVAL, fmt::format("no SRQ {}", req.handle));
  if (req.mask & ~uint32_t{IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT}) return error(EINVAL, "SRQ attr mask");
  // Resizing is an optional capability (IBV_DEVICE_SRQ_RESIZE) the device does not have.
  if (req.mask & IBV_SRQ_MAX_WR) return error(EINVAL, "SRQ resize is not supported");
  if (req.mask & IBV_SRQ_LIMIT) {
    if (req.attr.srq_limit > it->second->size) return error(EINVAL, "srq_limit above max_wr");
    it->second->limit = req.attr.srq_limit;
  }
  return Status::ok();
}

Result<SrqAttr> Device::query_srq(Session& s, uint32_t handle) {
  auto it = s.srqs.find(handle);
  if (it == s.srqs.end()) return error(EINVAL, fmt::format("no SRQ {}", handle));
  const Srq& q = *it->second;
  return SrqAttr{q.size, q.max_sge, q.limit, 0};
}

Status Device::destroy_srq(Session& s, uint32_t handle) {
  auto it = s.srqs.find(handle);
  if (it == s.srqs.end()) return error(EINVAL, fmt::format("no SRQ {}", handle));
  if (it->second->users) return error(EBUSY, "SRQ still used by a QP");
  s.pds[it->second->pd].users--;
  s.srqs.erase(it);
  release(*s.guest, Res::kSrq);
  return Status::ok();
}

void Device::post_async(Session& s, ibv_event_type type, uint32_t handle) {
  uint32_t ev[2] = {static_cast<uint32_t>(type), handle};
  if (::write(s.async_write.get(), ev, sizeof(ev)) != sizeof(ev))
    VLOG_WARN("guest {} session {}: async event queue full, event {} dropped", s.guest->name, s.id,
              int(type));
}

std::string Device::status_json() const {
  nlohmann::json guests = nlohmann::json::array();
  // What a guest holds, by kind: each guest's `resources` and the totals count the same keys.
  auto holdings = [](uint64_t mr_bytes, uint64_t seg_bytes) {
    return nlohmann::json{{"pd", 0},
                          {"mr", 0},
                          {"cq", 0},
                          {"qp", 0},
                          {"srq", 0},
                          {"channel", 0},
                          {"segment", 0},
                          {"mr_bytes", mr_bytes},
                          {"segment_bytes", seg_bytes}};
  };
  nlohmann::json totals = holdings(0, 0);
  totals["guests"] = guests_.size();
  totals["sessions"] = sessions_.size();
  for (const auto& [name, g] : guests_) {
    nlohmann::json sess = nlohmann::json::array();
    // Bytes as the quotas count them (summed over the guest's sessions). Over all guests,
    // segment_bytes is what the backend maps, against [backend] max_mapped_bytes.
    const uint64_t mr_bytes = g->used[static_cast<size_t>(Res::kMrBytes)];
    const uint64_t seg_bytes = g->used[static_cast<size_t>(Res::kSegmentBytes)];
    nlohmann::json res = holdings(mr_bytes, seg_bytes);
    totals["mr_bytes"] = totals["mr_bytes"].get<uint64_t>() + mr_bytes;
    totals["segment_bytes"] = totals["segment_bytes"].get<uint64_t>() + seg_bytes;
    nlohmann::json qps = nlohmann::json::array();
    for (const auto& [id, s] : sessions_) {
      if (s->guest != g.get()) continue;
      sess.push_back({{"id", id}, {"pid", s->pid}, {"uid", s->uid}});
      const std::pair<const char*, size_t> counts[] = {
          {"pd", s->pds.size()}, {"mr", s->mrs.size()}, {"cq", s->cqs.size()},
          {"qp", s->qps.size()}, {"srq", s->srqs.size()}, {"channel", s->channels.size()},
          {"segment", s->segments.size()}};
      for (auto [k, n] : counts) {
        res[k] = res[k].get<size_t>() + n;
        totals[k] = totals[k].get<size_t>() + n;
      }
      for (const auto& [h, qp] : s->qps) {
        const QpCounters cnt = counters_of(*qp);
        qps.push_back({{"qpn", qp->qpn}, {"pid", s->pid}, {"type", qp->type == IBV_QPT_RC ? "RC" : qp->type == IBV_QPT_UC ? "UC" : "UD"},
                       {"state", qp_state_name(qp->state)}, {"dlid", qp->attr.dlid},
                       {"dest_qpn", qp->attr.dest_qp_num}, {"transport", qp->transport},
                       {"transport_why", qp->transport_why}, {"peer_node", qp->peer_node},
                       {"msgs_sent", cnt.msgs_sent}, {"bytes_sent", cnt.bytes_sent},
                       {"msgs_received", cnt.msgs_received},
                       {"bytes_received", cnt.bytes_received}});
      }
    }
    char gid[40];
    std::snprintf(gid, sizeof(gid), "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x",
                  g->gid[0], g->gid[1], g->gid[2], g->gid[3], g->gid[4], g->gid[5], g->gid[6],
                  g->gid[7], g->gid[8], g->gid[9], g->gid[10], g->gid[11], g->gid[12],
                  g->gid[13], g->gid[14], g->gid[15]);
    // `uid`: the owner; backend/report.cc shows a guest only to it and the admins.
    guests.push_back({{"name", name},
                      {"uid", g->owner_uid},
                      {"lid", g->lid},
                      {"gid", gid},
                      {"sessions", sess},
                      {"resources", res},
                      {"qps", qps}});
  }
  return nlohmann::json{{"guests", guests}, {"totals", totals}}.dump();
}

}  // namespace vrdma::engine
