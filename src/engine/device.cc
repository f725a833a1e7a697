// Control path of the device model: sessions, namespaces, quotas and the status report.
// Resources: device_mr.cc (PDs, MWs, segments, MRs, DM), device_qp.cc (channels, CQs, QPs, SRQs).
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

const char* res_name(Res r) {
  static constexpr const char* kNames[] = {
      "max_pds",      "max_qps",      "max_cqs",           "max_srqs",     "max_mrs",
      "max_mr_bytes", "max_segments", "max_segment_bytes", "max_dm_bytes", "max_mws"};
  static_assert(std::size(kNames) == static_cast<size_t>(Res::kCount));
  return kNames[static_cast<size_t>(r)];
}

/// A session's control page as the library first reads it: this protocol's magic and version,
/// the features the backend offers and the guest's quotas.
void init_control_page(ControlPage* cp, const Quotas& q, uint32_t features) {
  cp->magic = kRingMagic;
  cp->version = kRingVersion;
  cp->features = features | kFeatureLimits | kFeatureReadyBits | kFeatureNoAnswer;
  cp->limits = GuestLimits{q.max_queue_depth,
                           q.max_qps,
                           q.max_cqs,
                           q.max_srqs,
                           q.max_mrs,
                           q.max_pds,
                           static_cast<uint32_t>(q.max_mr_bytes),
                           static_cast<uint32_t>(q.max_mr_bytes >> 32)};
  cp->max_dm_bytes_lo = static_cast<uint32_t>(q.max_dm_bytes);
  cp->max_dm_bytes_hi = static_cast<uint32_t>(q.max_dm_bytes >> 32);
  cp->max_mws = q.max_mws;
  cp->backend_sleeping.store(0);
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
    return quota_error(ENOMEM, fmt::format("guest quota {} = {} reached", res_name(r), limit));
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
  return quota_error(ENOMEM, fmt::format("{} of {} entries: guest quota max_queue_depth = {}", what,
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
  rx_tag_base_ = 1 + static_cast<uint32_t>(rng_() % 0x7fffffffu);
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
  init_control_page(s->control_page(), quotas_,
                    (direct_ ? kFeatureDirect : 0) | (direct_remote_ ? kFeatureDirectRemote : 0));
  s->doorbell = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!s->doorbell.valid()) return error(errno, "eventfd");
  int p[2];
  if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) < 0) return error(errno, "pipe2");
  s->async_read = UniqueFd(p[0]);
  s->async_write = UniqueFd(p[1]);

  g->sessions++;
  session_hello(*s, resp, fds);
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
  close_session_xrc(*s);  // XRC receive-QP handles, XRC SRQs' links, domain opens
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

void Device::post_async(Session& s, ibv_event_type type, uint32_t handle) {
  uint32_t ev[2] = {static_cast<uint32_t>(type), handle};
  if (::write(s.async_write.get(), ev, sizeof(ev)) != sizeof(ev))
    VLOG_WARN("guest {} session {}: async event queue full, event {} dropped", s.guest->name, s.id,
              int(type));
}

std::string Device::status_json(bool lists) const {
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
        if (!lists) break;
        const QpCounters cnt = counters_of(*qp);
        qps.push_back({{"qpn", qp->qpn},
                       {"pid", s->pid},
                       {"type", qp_type_name(qp->type)},
                       {"state", qp_state_name(qp->state)},
                       {"dlid", qp->attr.dlid},
                       {"dest_qpn", qp->attr.dest_qp_num},
                       {"transport", qp->transport},
                       {"transport_why", qp->transport_why},
                       {"peer_node", qp->peer_node},
                       {"msgs_sent", cnt.msgs_sent},
                       {"bytes_sent", cnt.bytes_sent},
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
    if (!lists) guests.back()["qps_omitted"] = res["qp"];
  }
  return nlohmann::json{{"guests", guests}, {"totals", totals}}.dump();
}

}  // namespace vrdma::engine
