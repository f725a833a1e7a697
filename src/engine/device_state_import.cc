// A guest's device state from a blob: the importer (live migration and snapshots; the exporter
// is device_state_export.cc). The blob is CBOR (nlohmann::json), versioned by kStateVersion
// (proto/device_state.h); fixed-layout structs the wire format already pins (QpAttr, QpCaps,
// SendWqe, QpCounters) travel as byte strings of their exact size. Descriptors (memfds of segments, rings and control pages, the doorbell, pipe ends, the
// guest's socket) are named by their index in a list sent beside the blob (SCM_RIGHTS).
// Import trusts nothing: every index, size, handle and reference is checked, use counts are
// recounted from the references, and nothing is created unless all of it is valid.
#include <fcntl.h>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "common/identity.h"
#include "common/log.h"
#include "common/memfd.h"
#include "engine/datapath_util.h"
#include "engine/device_state_reader.h"
#include "proto/device_caps.h"
#include "proto/device_state.h"
namespace vrdma::engine {

using namespace vrdma::proto;
using json = nlohmann::json;

namespace {

/// sizeof(QpCounters) in a version 2 blob (proto/device_state.h: version 3 grew it at its end).
constexpr size_t kCountersV2 = offsetof(QpCounters, replays);

using state::Importer;
using state::QpRefs;
using state::Reader;

// ---- import: one function per kind of resource (read and check, map, build, link) ----
// Each reads its list of session `s` and adds what it built to `s` (and to the guest's tables of
// keys and QPNs). After the first fault nothing more is added, and the import fails as a whole.

void import_pds(Importer& im, const json& js, Session& s) {
  Reader& rd = im.rd;
  for (const json& h : rd.arr(js, "pds")) {
    if (!h.is_number_unsigned()) rd.fail("PD handle");
    if (!rd.st.is_ok()) break;
    const uint32_t ph = h.get<uint32_t>();
    im.handle_ok(s, ph, "PD");
    if (!s.pds.emplace(ph, Pd{ph, 0}).second) rd.fail("PD handle twice");
  }
}

void import_segments(Importer& im, const json& js, Session& s) {
  Reader& rd = im.rd;
  for (const json& e : rd.arr(js, "segs")) {
    if (!e.is_array() || e.size() != 3 || !e[0].is_number_unsigned() || !e[2].is_number_unsigned())
      rd.fail("segment entry");
    if (!rd.st.is_ok()) break;
    const uint32_t h = e[0].get<uint32_t>();
    const uint64_t size = e[2].get<uint64_t>();
    im.handle_ok(s, h, "segment");
    if (size == 0 || size % kPage || size > kMaxMrSize) rd.fail("segment size");
    auto seg = std::make_shared<Segment>();
    const json holder = {{"fd", e[1]}};
    seg->fd = im.take(holder, "fd");
    seg->map = im.map_memfd(seg->fd, size, "segment");
    if (rd.st.is_ok() && !s.segments.emplace(h, std::move(seg)).second)
      rd.fail("segment handle twice");
  }
}

void import_mrs(Importer& im, const json& js, Session& s, Guest& g) {
  Reader& rd = im.rd;
  for (const json& jm : rd.arr(js, "mrs")) {
    if (!rd.st.is_ok()) break;
    auto mr = std::make_unique<Mr>();
    mr->handle = rd.num<uint32_t>(jm, "h");
    mr->key = rd.num<uint32_t>(jm, "key");
    mr->pd = rd.num<uint32_t>(jm, "pd");
    mr->access = rd.num<uint32_t>(jm, "access");
    mr->addr = rd.num<uint64_t>(jm, "addr");
    mr->iova = rd.num<uint64_t>(jm, "iova");
    mr->length = rd.num<uint64_t>(jm, "length");
    mr->owner = &s;
    im.handle_ok(s, mr->handle, "MR");
    auto pd = s.pds.find(mr->pd);
    if (pd == s.pds.end()) rd.fail("MR in an unknown PD");
    if (mr->key == 0 || g.mrs.count(mr->key)) rd.fail("MR key zero or twice");
    if (mr->length == 0 || mr->length > kMaxMrSize) rd.fail("MR length");
    uint64_t expect = 0;
    for (const json& x : rd.arr(jm, "ext")) {
      if (!x.is_array() || x.size() != 4) rd.fail("MR extent");
      for (const json& v : x) {
        if (!v.is_number_unsigned()) rd.fail("MR extent field");
      }
      if (!rd.st.is_ok()) break;
      auto seg = s.segments.find(x[0].get<uint32_t>());
      const uint64_t seg_off = x[1].get<uint64_t>(), mr_off = x[2].get<uint64_t>(),
                     len = x[3].get<uint64_t>();
      if (seg == s.segments.end() || mr_off != expect || len == 0 ||
          seg_off > seg->second->map.size() || len > seg->second->map.size() - seg_off) {
        rd.fail("MR extent does not fit its segment");
        break;
      }
      mr->chunks.push_back({mr_off, len, seg->second->map.data() + seg_off});
      mr->segments.push_back(seg->second);
      expect += len;
    }
    if (rd.st.is_ok() && expect != mr->length) rd.fail("MR extents do not cover the MR");
    if (!rd.st.is_ok()) break;
    pd->second.users++;
    g.mrs[mr->key] = mr.get();
    if (!s.mrs.emplace(mr->handle, std::move(mr)).second) rd.fail("MR handle twice");
  }
}

void import_channels(Importer& im, const json& js, Session& s) {
  Reader& rd = im.rd;
  for (const json& e : rd.arr(js, "chans")) {
    if (!e.is_array() || e.size() != 2 || !e[0].is_number_unsigned()) rd.fail("channel entry");
    if (!rd.st.is_ok()) break;
    const uint32_t h = e[0].get<uint32_t>();
    im.handle_ok(s, h, "channel");
    Channel c;
    c.handle = h;
    const json holder = {{"fd", e[1]}};
    c.write_end = im.take(holder, "fd");
    if (rd.st.is_ok() && !s.channels.emplace(h, std::move(c)).second) rd.fail("channel twice");
  }
}

void import_cqs(Importer& im, const json& js, Session& s, bool recover, uint32_t version) {
  Reader& rd = im.rd;
  for (const json& jc : rd.arr(js, "cqs")) {
    if (!rd.st.is_ok()) break;
    auto cq = std::make_unique<Cq>();
    cq->handle = rd.num<uint32_t>(jc, "h");
    cq->size = rd.num<uint32_t>(jc, "size");
    cq->prod = rd.num<uint32_t>(jc, "prod");
    cq->channel = rd.num<uint32_t>(jc, "channel");
    cq->overrun = jc.value("overrun", false);
    if (version >= 6) cq->stamps = rd.num<uint32_t>(jc, "stamps");
    cq->owner = &s;
    im.handle_ok(s, cq->handle, "CQ");
    if (!std::has_single_bit(cq->size) || cq->size < 2 || cq->size > 2 * kMaxCqe)
      rd.fail("CQ size");
    if (cq->stamps & ~kStampAll) rd.fail("CQ stamps");
    cq->ring_fd = im.take(jc, "fd");
    const size_t bytes = page_round(cq_ring_bytes(cq->size, cq->stamps));
    cq->ring = im.map_memfd(cq->ring_fd, bytes, "CQ ring");
    if (cq->channel != kNone) {
      auto ch = s.channels.find(cq->channel);
      if (ch == s.channels.end())
        rd.fail("CQ on an unknown channel");
      else
        ch->second.users++;
    }
    if (!rd.st.is_ok()) break;
    cq->attach();
    if (recover) {
      const uint32_t p = cq->hdr->producer.load(std::memory_order_acquire);
      const uint32_t c = cq->hdr->consumer.load(std::memory_order_acquire);
      if (p - c <= cq->size) cq->prod = p;
    }
    if (!s.cqs.emplace(cq->handle, std::move(cq)).second) rd.fail("CQ handle twice");
  }
}

void import_srqs(Importer& im, const json& js, Session& s, Guest& g, bool recover) {
  Reader& rd = im.rd;
  for (const json& jq : rd.arr(js, "srqs")) {
    if (!rd.st.is_ok()) break;
    auto q = std::make_unique<Srq>();
    q->handle = rd.num<uint32_t>(jq, "h");
    q->pd = rd.num<uint32_t>(jq, "pd");
    q->size = rd.num<uint32_t>(jq, "size");
    q->cons = rd.num<uint32_t>(jq, "cons");
    q->max_sge = rd.num<uint32_t>(jq, "max_sge");
    q->limit = rd.num<uint32_t>(jq, "limit");
    q->owner = &s;
    im.handle_ok(s, q->handle, "SRQ");
    auto pd = s.pds.find(q->pd);
    if (pd == s.pds.end()) rd.fail("SRQ in an unknown PD");
    if (!std::has_single_bit(q->size) || q->size > kMaxQpWr * 2 || q->max_sge == 0 ||
        q->max_sge > kMaxSge || q->limit > q->size)
      rd.fail("SRQ geometry");
    q->ring_fd = im.take(jq, "fd");
    q->ring =
        im.map_memfd(q->ring_fd, page_round(ring_bytes(q->size, sizeof(RecvWqe))), "SRQ ring");
    if (!rd.st.is_ok()) break;
    pd->second.users++;
    q->hdr = reinterpret_cast<RingHeader*>(q->ring.data());
    q->entries = ring_entries<RecvWqe>(q->hdr);
    // Fed by libraries (direct path) where it was: its consumers take turns through its
    // rx_lock, which a library of the old backend's may still hold (taken over: rx_lock_try),
    // and the cursor is the shared one. A guest that sets the word only makes us lock.
    q->direct = q->hdr->armed.load(std::memory_order_acquire) != 0;
    q->hdr->srq_limit.store(q->limit, std::memory_order_release);
    if (recover || q->direct) {
      const uint32_t p = q->hdr->producer.load(std::memory_order_acquire);
      const uint32_t c = q->hdr->consumer.load(std::memory_order_acquire);
      if (p - c <= q->size) q->cons = c;
    }
    if (s.srqs.count(q->handle)) return rd.fail("SRQ handle twice");
    state::import_xrc_srq(im, jq, *q, s, g);
    s.srqs.emplace(q->handle, std::move(q));
  }
}

}  // namespace

namespace {
/// A QP's atomic cache: one byte string (version 11), or an array of [PSN, value] arrays (before;
/// either is taken whatever the version says).
void read_atomic_cache(Reader& rd, const json& jq, Qp& qp) {
  auto& cache = qp.atomic_cache;
  if (auto it = jq.find("acache"); it != jq.end() && it->is_binary()) {
    // Its entries up to the last one that is not empty; the rest are.
    const auto& b = it->get_binary();
    if (b.size() % sizeof(AtomicCacheEntry) || b.size() > cache.size() * sizeof(AtomicCacheEntry))
      return rd.fail("atomic cache size");
    cache = {};
    for (size_t i = 0; i < b.size() / sizeof(AtomicCacheEntry); ++i) {
      AtomicCacheEntry e;
      std::memcpy(&e, b.data() + i * sizeof(e), sizeof(e));
      cache[i] = {e.psn, uint64_t{e.value_hi} << 32 | e.value_lo};
    }
    return;
  }
  const json& ac = rd.arr(jq, "acache");
  if (rd.st.is_ok() && ac.size() != cache.size()) return rd.fail("atomic cache size");
  for (size_t i = 0; rd.st.is_ok() && i < ac.size(); ++i) {
    if (!ac[i].is_array() || ac[i].size() != 2 || !ac[i][0].is_number_unsigned() ||
        !ac[i][1].is_number_unsigned())
      return rd.fail("atomic cache entry");
    cache[i] = {ac[i][0].get<uint32_t>(), ac[i][1].get<uint64_t>()};
  }
}
}  // namespace

std::unique_ptr<Qp> state::read_qp(Importer& im, const json& jq, QpRefs& refs) {
  Reader& rd = im.rd;
  auto qp = std::make_unique<Qp>();
  qp->handle = rd.num<uint32_t>(jq, "h");
  qp->qpn = rd.num<uint32_t>(jq, "qpn");
  refs.type = rd.num<uint32_t>(jq, "type");
  refs.state = rd.num<uint32_t>(jq, "state");
  qp->pd = rd.num<uint32_t>(jq, "pd");
  refs.scq = rd.num<uint32_t>(jq, "scq");
  refs.rcq = rd.num<uint32_t>(jq, "rcq");
  refs.srq = rd.num<uint32_t>(jq, "srq");
  qp->sq_sig_all = jq.value("sig_all", false);
  qp->caps = rd.pod<QpCaps>(jq, "caps");
  qp->attr = rd.pod<QpAttr>(jq, "attr");
  qp->sq_size = rd.num<uint32_t>(jq, "sq_size");
  qp->rq_size = rd.num<uint32_t>(jq, "rq_size");
  qp->sq_cons = rd.num<uint32_t>(jq, "sq_cons");
  qp->rq_cons = rd.num<uint32_t>(jq, "rq_cons");
  refs.wait = rd.num<uint32_t>(jq, "wait");
  qp->rnr_left = rd.num<uint32_t>(jq, "rnr_left");
  qp->retry_left = rd.num<uint32_t>(jq, "retry_left");
  qp->wait_until_ns = rd.num<uint64_t>(jq, "wait_until");
  qp->cnt = rd.pod<QpCounters>(jq, "cnt", im.counters_size);
  qp->sq_sent = rd.num<uint32_t>(jq, "sq_sent");
  qp->next_psn = rd.num<uint32_t>(jq, "next_psn") & 0xffffff;
  qp->expected_psn = rd.num<uint32_t>(jq, "expected_psn") & 0xffffff;
  read_atomic_cache(rd, jq, *qp);
  qp->atomic_cache_next = rd.num<uint32_t>(jq, "acache_next");
  // The route it had, so reroute() below knows what is in flight: over tcp, unacknowledged
  // messages are replayed (or settled against a responder here now); from shm nothing is.
  if (auto r = jq.find("remote"); r != jq.end() && r->is_boolean() && r->get<bool>()) {
    auto pn = jq.find("peer_node");
    if (pn == jq.end() || !pn->is_string() || pn->get_ref<const std::string&>().size() > 255)
      rd.fail("QP peer node");
    else {
      qp->remote = true;
      qp->transport = "tcp";
      qp->peer_node = pn->get<std::string>();
    }
  }
  // sq_sent runs ahead of sq_cons only on tcp (what is in flight); shm leaves it behind.
  if (!qp->remote) qp->sq_sent = qp->sq_cons;
  if (qp->sq_sent - qp->sq_cons > qp->sq_size) rd.fail("QP send cursors");
  return qp;
}

namespace {

/// A QP's fields against the device's limits, and what it names against its session.
void check_qp(Importer& im, const Qp& q, const QpRefs& refs, const Session& s, const Guest& g) {
  Reader& rd = im.rd;
  const Qp* qp = &q;
  const uint32_t type = refs.type, state = refs.state, wait = refs.wait;
  const uint32_t scq = refs.scq, rcq = refs.rcq, srq = refs.srq;
  im.handle_ok(s, qp->handle, "QP");
  if (qp->qpn < 0x11 || qp->qpn > 0xffffff || g.qps.count(qp->qpn)) rd.fail("QPN");
  if (type != IBV_QPT_RC && type != IBV_QPT_UC && type != IBV_QPT_UD && type != IBV_QPT_XRC_SEND)
    rd.fail("QP type");
  if (state > IBV_QPS_ERR) rd.fail("QP state");
  if (wait > static_cast<uint32_t>(Wait::kAck)) rd.fail("QP wait");
  if (!std::has_single_bit(qp->sq_size) || qp->sq_size > 2 * kMaxQpWr ||
      !std::has_single_bit(qp->rq_size) || qp->rq_size > 2 * kMaxQpWr ||
      qp->caps.max_send_sge > kMaxSge || qp->caps.max_recv_sge > kMaxSge ||
      qp->caps.max_inline_data > kMaxInline)
    rd.fail("QP geometry");

  if (!s.pds.count(qp->pd) || !s.cqs.count(scq) || !s.cqs.count(rcq))
    rd.fail("QP names an unknown PD or CQ");
  if (srq != kNone && !s.srqs.count(srq)) rd.fail("QP names an unknown SRQ");
}

/// One WQE in flight, as checked on every path: an inline payload fits the WQE (the resend
/// copies o.len bytes from it); other payloads are gathered through the MRs again at each send.
void add_in_flight(Reader& rd, Qp& qp, Qp::Outstanding o) {
  if (o.w.num_sge > kMaxSge) rd.fail("unacknowledged WQE's SGE count");
  if ((o.w.send_flags & IBV_SEND_INLINE) && o.len > sizeof(o.w.inline_data))
    rd.fail("unacknowledged WQE's inline length");
  if (rd.st.is_ok()) qp.unacked.push_back(o);
}

constexpr const char* kNotTheCursors = "WQEs in flight do not match the QP's send cursors";

/// The WQEs a QP had sent over tcp and not seen acknowledged, to send again; its rings are
/// mapped (version 10 takes the WQEs from its SQ).
void read_unacked(Importer& im, const json& jq, Qp& q, uint32_t version) {
  Reader& rd = im.rd;
  if (version >= 10) {
    auto it = jq.find("in_flight");
    if (it == jq.end() || !it->is_binary() || it->get_binary().size() % sizeof(InFlight) != 0) {
      rd.fail("field 'in_flight' missing or of the wrong size");
      return;
    }
    const auto& b = it->get_binary();
    const size_t n = b.size() / sizeof(InFlight);
    // The SQ's slots from sq_cons on, one each, in order (complete_send retires them so).
    if (n > q.sq_sent - q.sq_cons) return rd.fail(kNotTheCursors);
    for (size_t i = 0; i < n && rd.st.is_ok(); ++i) {
      InFlight f;
      std::memcpy(&f, b.data() + i * sizeof(InFlight), sizeof(f));
      if (f.has_result > 1) rd.fail("WQE in flight: bad result flag");
      const SendWqe& w = q.sq[(q.sq_cons + static_cast<uint32_t>(i)) & (q.sq_size - 1)];
      add_in_flight(rd, q, Qp::Outstanding{w, f.psn & 0xffffff, f.len, f.has_result != 0, {}});
    }
    return;
  }
  for (const json& u : rd.arr(jq, "unacked")) {
    if (!u.is_array() || u.size() != 4 || !u[0].is_binary() ||
        u[0].get_binary().size() != sizeof(SendWqe) || !u[1].is_number_unsigned() ||
        !u[2].is_number_unsigned() || !u[3].is_boolean()) {
      rd.fail("unacknowledged WQE");
      break;
    }
    Qp::Outstanding o{};
    std::memcpy(&o.w, u[0].get_binary().data(), sizeof(SendWqe));
    o.psn = u[1].get<uint32_t>() & 0xffffff;
    o.len = u[2].get<uint32_t>();
    o.has_result = u[3].get<bool>();
    add_in_flight(rd, q, o);
    if (!rd.st.is_ok()) break;
  }
  if (q.unacked.size() > q.sq_sent - q.sq_cons) rd.fail(kNotTheCursors);
}

/// A QP's rings, mapped; false when they cannot be.
bool map_qp(Importer& im, const json& jq, Qp& q) {
  Reader& rd = im.rd;
  Qp* qp = &q;
  const size_t sq_bytes = page_round(ring_bytes(qp->sq_size, sizeof(SendWqe)));
  const size_t rq_bytes = page_round(ring_bytes(qp->rq_size, sizeof(RecvWqe)));
  qp->ring_fd = im.take(jq, "fd");
  qp->ring = im.map_memfd(qp->ring_fd, sq_bytes + rq_bytes, "QP rings");
  if (!rd.st.is_ok()) return false;
  qp->sq_hdr = reinterpret_cast<RingHeader*>(qp->ring.data());
  qp->rq_hdr = reinterpret_cast<RingHeader*>(qp->ring.data() + sq_bytes);
  qp->sq = ring_entries<SendWqe>(qp->sq_hdr);
  qp->rq = ring_entries<RecvWqe>(qp->rq_hdr);
  return true;
}

/// A QP into its session and guest, holding a use of what it names.
void link_qp(Importer& im, std::unique_ptr<Qp> qp, const QpRefs& refs, Session& s, Guest& g) {
  Reader& rd = im.rd;
  const uint32_t srq = refs.srq;
  qp->owner = &s;
  qp->guest = &g;
  qp->send_cq = s.cqs[refs.scq].get();
  qp->recv_cq = s.cqs[refs.rcq].get();
  qp->srq = srq == kNone ? nullptr : s.srqs[srq].get();
  s.pds.find(qp->pd)->second.users++;
  qp->send_cq->users++;
  qp->recv_cq->users++;
  if (qp->srq) qp->srq->users++;
  g.qps[qp->qpn] = qp.get();
  if (!s.qps.emplace(qp->handle, std::move(qp)).second) rd.fail("QP handle twice");
}

/// Version 7: a QP's own completion rings (direct path), as large as `size` and stamped as
/// `stamps` say, whatever its CQs are now (a resize leaves them). Their producer is shared with
/// the libraries (Cq::shared_producer): it is the header's, however the blob was made.
void read_own_rings(Importer& im, const json& jq, Qp& qp) {
  Reader& rd = im.rd;
  for (const auto& [slot, key, of] : {std::tuple{&qp.own_send, "own_send", qp.send_cq},
                                      std::tuple{&qp.own_recv, "own_recv", qp.recv_cq}}) {
    auto it = jq.find(key);
    if (it == jq.end() || !rd.st.is_ok()) continue;
    if (!it->is_object()) return rd.fail(fmt::format("QP's {} entry", key));
    auto r = std::make_unique<Cq>();
    r->handle = of->handle;
    r->owner = of->owner;
    r->size = rd.num<uint32_t>(*it, "size");
    r->stamps = rd.num<uint32_t>(*it, "stamps");
    if (!std::has_single_bit(r->size) || r->size < 2 || r->size > 2 * kMaxCqe ||
        (r->stamps & ~kStampAll))
      rd.fail(fmt::format("QP's {} geometry", key));
    r->ring_fd = im.take(*it, "fd");
    r->ring = im.map_memfd(r->ring_fd, page_round(cq_ring_bytes(r->size, r->stamps)), key);
    if (!rd.st.is_ok()) return;
    r->attach();
    r->shared_producer = true;
    r->prod = r->hdr->producer.load(std::memory_order_acquire);
    *slot = std::move(r);
  }
}

/// `recover`: the device's recover_from_rings, when the QPs resume from their rings.
void import_qps(Importer& im, const json& js, Session& s, Guest& g, void (*recover)(Qp&),
                uint32_t version) {
  Reader& rd = im.rd;
  for (const json& jq : rd.arr(js, "qps")) {
    if (!rd.st.is_ok()) break;
    QpRefs refs;
    std::unique_ptr<Qp> qp = read_qp(im, jq, refs);
    if (!rd.st.is_ok()) break;
    check_qp(im, *qp, refs, s, g);
    if (!rd.st.is_ok()) break;
    qp->type = static_cast<ibv_qp_type>(refs.type);
    qp->state = static_cast<ibv_qp_state>(refs.state);
    qp->attr.qp_state = refs.state;
    qp->wait = static_cast<Wait>(refs.wait);
    if (!map_qp(im, jq, *qp)) break;
    read_unacked(im, jq, *qp, version);
    qp->send_cq = s.cqs[refs.scq].get();
    qp->recv_cq = s.cqs[refs.rcq].get();
    qp->srq = refs.srq == kNone ? nullptr : s.srqs[refs.srq].get();
    if (version >= 7) read_own_rings(im, jq, *qp);
    if (!rd.st.is_ok()) break;
    if (recover) recover(*qp);  // with its rings, CQs and SRQ (recover_receive)
    link_qp(im, std::move(qp), refs, s, g);
  }
}

/// Version 4: a session's device memory, each a segment of the session that no other device
/// memory names. Nothing is read from an older blob (it has none).
void import_dms(Reader& rd, const json& js, Session& s, uint32_t version) {
  if (version < 4) return;
  for (const json& e : rd.arr(js, "dms")) {
    if (!rd.st.is_ok()) return;
    Dm dm{rd.num<uint32_t>(e, "h"), rd.num<uint32_t>(e, "seg"), rd.num<uint64_t>(e, "length")};
    if (!rd.st.is_ok()) return;
    auto seg = s.segments.find(dm.segment);
    if (dm.handle == 0 || dm.handle >= s.next_handle)
      rd.fail("device memory handle out of range");
    else if (seg == s.segments.end() || dm.length == 0 || dm.length > kMaxDmSize ||
             dm.length > seg->second->map.size())
      rd.fail("device memory does not fit its segment");
    else if (std::any_of(s.dms.begin(), s.dms.end(),
                         [&](const auto& d) { return d.second.segment == dm.segment; }))
      rd.fail("device memory segment twice");
    else if (!s.dms.emplace(dm.handle, dm).second)
      rd.fail("device memory handle twice");
  }
}

/// Version 5: a session's memory windows, in its PDs, with rkeys no MR or other window of the
/// guest has the index of; a bound one names an MR of the session and lies in it (bind rules,
/// proto/post_rules.h). Nothing is read from an older blob (it has none).
void import_mws(Importer& im, const json& js, Session& s, Guest& g, uint32_t version) {
  Reader& rd = im.rd;
  if (version < 5) return;
  for (const json& e : rd.arr(js, "mws")) {
    if (!rd.st.is_ok()) return;
    auto mw = std::make_unique<Mw>();
    mw->handle = rd.num<uint32_t>(e, "h");
    mw->pd = rd.num<uint32_t>(e, "pd");
    mw->type = rd.num<uint32_t>(e, "type");
    mw->rkey = rd.num<uint32_t>(e, "rkey");
    mw->bound = rd.num<uint32_t>(e, "bound") != 0;
    mw->mr = rd.num<uint32_t>(e, "mr");
    mw->qpn = rd.num<uint32_t>(e, "qpn");
    mw->access = rd.num<uint32_t>(e, "access");
    mw->addr = rd.num<uint64_t>(e, "addr");
    mw->length = rd.num<uint64_t>(e, "length");
    mw->owner = &s;
    if (!rd.st.is_ok()) return;
    im.handle_ok(s, mw->handle, "MW");
    auto pd = s.pds.find(mw->pd);
    if (pd == s.pds.end()) return rd.fail("MW in an unknown PD");
    if (mw->type != IBV_MW_TYPE_1 && mw->type != IBV_MW_TYPE_2) return rd.fail("MW type");
    if (mw->rkey == 0 || g.mws.count(mw->rkey >> 8) ||
        std::any_of(g.mrs.begin(), g.mrs.end(),
                    [&](const auto& m) { return m.first >> 8 == mw->rkey >> 8; }))
      return rd.fail("MW rkey zero or its index twice");
    if (mw->bound) {
      auto mr = s.mrs.find(mw->mr);
      if (mr == s.mrs.end() || mr->second->pd != mw->pd) return rd.fail("MW bound to no MR");
      const Mr& m = *mr->second;
      if (mw->addr < m.iova || mw->length > m.length || mw->addr - m.iova > m.length - mw->length)
        return rd.fail("MW outside its MR");
    }
    pd->second.users++;
    g.mws[mw->rkey >> 8] = mw.get();
    if (!s.mws.emplace(mw->handle, std::move(mw)).second) return rd.fail("MW handle twice");
  }
}

/// One session of guest `g`: its own fields and descriptors (its socket into `socks`), then
/// each kind of resource, in the order they name each other.
std::unique_ptr<Session> import_session(Importer& im, const json& js, Guest& g, uint32_t version,
                                        std::vector<UniqueFd>& socks, void (*recover_qp)(Qp&)) {
  Reader& rd = im.rd;
  auto s = std::make_unique<Session>();
  s->guest = &g;
  s->pid = rd.num<uint32_t>(js, "pid");
  if (version >= 2) s->uid = rd.num<uint32_t>(js, "uid");
  s->comm = rd.str(js, "comm");
  s->next_handle = rd.num<uint32_t>(js, "next_handle");
  state::import_rx_tags(rd, js, *s);
  s->control_fd = im.take(js, "control");
  s->control = im.map_memfd(s->control_fd, kPage, "control page");
  s->doorbell = im.take(js, "doorbell");
  s->async_read = im.take(js, "async_r");
  s->async_write = im.take(js, "async_w");
  socks.push_back(im.take(js, "sock", true));
  import_pds(im, js, *s);
  import_segments(im, js, *s);
  import_mrs(im, js, *s, g);
  import_dms(im.rd, js, *s, version);
  import_mws(im, js, *s, g, version);
  if (auto c = js.find("cookie"); version >= 7 && c != js.end() && rd.st.is_ok()) {
    s->cookie_addr = rd.num<uint64_t>(*c, "addr");
    s->cookie = rd.pod<decltype(s->cookie)>(*c, "bytes");
    if (s->cookie_addr == 0) rd.fail("direct cookie at address 0");
  }
  import_channels(im, js, *s);
  import_cqs(im, js, *s, recover_qp != nullptr, version);
  import_srqs(im, js, *s, g, recover_qp != nullptr);
  import_qps(im, js, *s, g, recover_qp, version);
  return s;
}

}  // namespace

// ---- import ----

void Device::recover_from_rings(Qp& qp) {
  // The backend published these; the guest may have scribbled on them, so only sane values count.
  const uint32_t sprod = qp.sq_hdr->producer.load(std::memory_order_acquire);
  const uint32_t scons = qp.sq_hdr->consumer.load(std::memory_order_acquire);
  if (sprod - scons <= qp.sq_size) qp.sq_cons = scons;
  const uint32_t rprod = qp.rq_hdr->producer.load(std::memory_order_acquire);
  const uint32_t rcons = qp.rq_hdr->consumer.load(std::memory_order_acquire);
  if (rprod - rcons <= qp.rq_size) qp.rq_cons = rcons;
  // What was in flight is sent again from the send queue; the responder drops duplicates.
  qp.unacked.clear();
  qp.sq_sent = qp.sq_cons;
  qp.wait = Wait::kNone;
  if (is_reliable(qp.type)) {  // RC and XRC_SEND (an XRC_RECV has no rings)
    // The PSN stored with this very index (RingHeader::psn_at), else the one published after
    // the index moved (a ring of an older backend, or a QP that never published).
    const uint64_t at = qp.sq_hdr->psn_at.load(std::memory_order_acquire);
    qp.next_psn = (at & kPsnAtValid) && static_cast<uint32_t>(at >> 32) == qp.sq_cons
                      ? static_cast<uint32_t>(at) & 0xffffff
                      : qp.sq_hdr->backend_psn.load(std::memory_order_relaxed) & 0xffffff;
    qp.expected_psn = qp.rq_hdr->backend_psn.load(std::memory_order_relaxed) & 0xffffff;
  }
  recover_receive(qp);  // the message it was taking when the backend died, if any
}

Result<std::vector<ImportedSession>> Device::import_guest(std::span<const uint8_t> blob,
                                                          std::vector<UniqueFd>& fds,
                                                          bool recover) {
  // A field of an unexpected type throws inside nlohmann::json: a malformed blob, not a crash.
  try {
    return import_guest_impl(blob, fds, recover);
  } catch (const json::exception& e) {
    return error(EINVAL, fmt::format("state: {}", e.what()));
  }
}

Result<std::vector<ImportedSession>> Device::import_guest_impl(std::span<const uint8_t> blob,
                                                               std::vector<UniqueFd>& fds,
                                                               bool recover) {
  json doc = json::from_cbor(blob.begin(), blob.end(), true, false);
  if (doc.is_discarded() || !doc.is_object()) return error(EINVAL, "state: not a CBOR document");
  Importer im(fds);
  Reader& rd = im.rd;
  if (rd.num<uint32_t>(doc, "magic") != kStateMagic) rd.fail("bad magic");
  const uint32_t version = rd.num<uint32_t>(doc, "version");
  RETURN_IF_ERROR(rd.st);
  if (version < kStateVersionOldest || version > kStateVersion)
    return error(EPROTONOSUPPORT, fmt::format("state version {} (this backend reads {} to {})",
                                              version, kStateVersionOldest, kStateVersion));
  const std::string name = rd.str(doc, "name");
  RETURN_IF_ERROR(rd.st);
  if (name.empty() || name.size() >= kGuestNameMax) return error(EINVAL, "state: bad guest name");
  for (char c : name) {
    if (c < 0x21 || c > 0x7e) return error(EINVAL, "state: guest name has non-printable characters");
  }
  if (guests_.count(name)) return error(EEXIST, fmt::format("guest {} is already here", name));
  const uint16_t lid = rd.num<uint16_t>(doc, "lid");
  RETURN_IF_ERROR(rd.st);
  if (lid == 0 || lid > 0xbfff) return error(EINVAL, "state: LID outside the unicast range");
  if (auto it = guests_by_lid_.find(lid); it != guests_by_lid_.end())
    return error(EADDRINUSE, fmt::format("LID {:#x} of guest {} is taken here by guest {}", lid,
                                         name, it->second->name));
  for (const auto& [n, l] : lid_of_name_) {
    if (l == lid && n != name)
      return error(EADDRINUSE, fmt::format("LID {:#x} of guest {} is reserved here for {}", lid,
                                           name, n));
  }

  auto g = std::make_unique<Guest>();
  g->name = name;
  g->id = fnv1a64(name);
  g->port_guid = port_guid_of(name);
  const auto gid = gid_of(name);
  std::memcpy(g->gid, gid.data(), 16);
  g->lid = lid;
  if (version >= 2) g->owner_uid = rd.num<uint32_t>(doc, "owner_uid");
  g->next_qpn = rd.num<uint32_t>(doc, "next_qpn");
  g->next_key_index = rd.num<uint32_t>(doc, "next_key_index");
  im.counters_size = version >= 3 ? sizeof(QpCounters) : kCountersV2;
  g->retired = rd.pod<QpCounters>(doc, "retired", im.counters_size);

  state::import_xrcds(im, doc, *g, version);
  std::vector<std::unique_ptr<Session>> made;
  std::vector<UniqueFd> socks;
  const json& jsessions = rd.arr(doc, "sessions");
  if (rd.st.is_ok() && jsessions.empty()) rd.fail("a guest without sessions");
  for (const json& js : jsessions) {
    if (!rd.st.is_ok()) break;
    made.push_back(
        import_session(im, js, *g, version, socks, recover ? &recover_from_rings : nullptr));
  }
  state::import_xrc_holds(im, doc, made, *g, version);
  state::import_direct(im, doc, *g, version, recover);
  RETURN_IF_ERROR(rd.st);

  // All valid: count, insert, and connect.
  Guest* gp = g.get();
  std::vector<ImportedSession> out;
  for (size_t i = 0; i < made.size(); ++i) {
    Session& s = *made[i];
    s.id = next_session_++;
    charge(*gp, Res::kPd, s.pds.size());
    charge(*gp, Res::kCq, s.cqs.size());
    charge(*gp, Res::kSrq, s.srqs.size());
    charge(*gp, Res::kQp, s.qps.size());
    charge(*gp, Res::kMr, s.mrs.size());
    for (const auto& [h, mr] : s.mrs) charge(*gp, Res::kMrBytes, mr->length);
    for (const auto& [h, seg] : s.segments) charge_segment(*gp, seg->map.size());
    for (const auto& [h, dm] : s.dms) charge(*gp, Res::kDmBytes, dm.length);
    charge(*gp, Res::kMw, s.mws.size());
    for (const auto& [h, qp] : s.qps) {
      qp->flow = next_flow_++;
      active_.push_back(qp.get());
      gp->active.push_back(qp.get());
    }
    gp->sessions++;
    // Grants its library holds were made by the backend it comes from: they end (that one's
    // epoch pages may be gone with it, a keeper's restore) and are asked for again here.
    s.control_page()->grant_gen.fetch_add(1, std::memory_order_acq_rel);
    out.push_back({made[i].get(), std::move(socks[i])});
    sessions_[s.id] = std::move(made[i]);
  }
  // XRC receive QPs are the guest's (no session's, never polled).
  charge(*gp, Res::kQp, gp->xrc_qps.size());
  for (const auto& [qpn, qp] : gp->xrc_qps) qp->flow = next_flow_++;
  if (!gp->active.empty()) active_guests_.push_back(gp);
  lid_of_name_[name] = lid;
  guests_by_lid_[lid] = gp;
  guests_[name] = std::move(g);
  VLOG_INFO("guest {} {}: lid {:#x}, {} session(s), {} QPs", name,
            recover ? "restored from its kept state" : "arrived", lid, out.size(), gp->qps.size());
  if (transport_) {
    transport::GuestInfo info{name, lid, {}};
    std::memcpy(info.gid, gp->gid, 16);
    transport_->announce(info, true);
  }
  // Its QPs choose their transport again from here, and so do ours that face it.
  for (Qp* qp : gp->active) reroute(*qp);
  for (const auto& [qpn, qp] : gp->xrc_qps) reroute(*qp);
  for_qps_facing(*gp, [&](Qp& qp) {
    if (qp.guest != gp) reroute(qp);
  });
  for (const ImportedSession& is : out) fire_owed_events(*is.session);
  return out;
}

// The backend that served the guest may have died (keep_state) between publishing a completion
// and firing its CQ's channel (push_cqe, then notify), or inside notify after it took the arm
// back and before it wrote the event (RingHeader::firing): a waiter in ibv_get_cq_event would
// sleep for ever beside a CQ that holds a completion. So whoever takes the state in (a restart, a
// migration, a restore) fires every armed CQ that holds one, in its own ring or in a QP's own
// ring (direct path) that stands for it. A spurious event is allowed, a lost one is not; the CQE
// does not say whether it was solicited, so a solicited-only arm fires for any receive (and,
// as always, for any completion in error).
void Device::fire_owed_events(Session& s) {
  struct Owed {
    bool held = false, recv = false;  // recv: a receive completion or one in error
  };
  std::unordered_map<const Cq*, Owed> owed;  // the armed CQs with a channel
  auto scan = [](Owed& o, const Cq& r, uint32_t prod) {
    const uint32_t cons = r.hdr->consumer.load(std::memory_order_acquire);
    if (prod == cons || prod - cons > r.size) return;  // empty, or cursors the guest scribbled
    o.held = true;
    for (uint32_t i = cons; i != prod && !o.recv; ++i)
      o.recv = (r.entries[i & (r.size - 1)].opcode & IBV_WC_RECV) != 0 ||
               r.entries[i & (r.size - 1)].status != IBV_WC_SUCCESS;
  };
  for (auto& [h, cq] : s.cqs) {
    if (cq->channel == kNone) continue;
    proto::rearm_unfired(*cq->hdr);  // killed inside notify (RingHeader::firing)
    if (cq->hdr->armed.load(std::memory_order_acquire) != 0) scan(owed[cq.get()], *cq, cq->prod);
  }
  if (owed.empty()) return;
  // One pass over the QPs: each own ring counts for the CQ it stands for.
  for (const auto& [qh, qp] : s.qps) {
    for (auto [own, cq] : {std::pair<const Cq*, const Cq*>{qp->own_send.get(), qp->send_cq},
                           std::pair<const Cq*, const Cq*>{qp->own_recv.get(), qp->recv_cq}}) {
      auto it = own ? owed.find(cq) : owed.end();
      if (it != owed.end())
        scan(it->second, *own, own->hdr->producer.load(std::memory_order_acquire));
    }
  }
  for (auto& [h, cq] : s.cqs) {
    auto it = owed.find(cq.get());
    if (it != owed.end() && it->second.held) notify(*cq, it->second.recv);
  }
}

}  // namespace vrdma::engine
