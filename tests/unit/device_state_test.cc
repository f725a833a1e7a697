// A guest's device state leaving a Device and coming back (what `vrdma migrate` and the keeper
// do): identity, handles and connections survive; a malformed or mutated blob never crashes the
// importer and never leaves half a guest behind.
#include <fcntl.h>

#include <functional>
#include <random>

#include "device_fixture.h"

namespace vrdma::engine::devtest {
namespace {

/// The export `ex` as an older version wrote it (its `key` in no session), imported into
/// `into`.
Result<std::vector<ImportedSession>> import_as_version(Device& into, const GuestExport& ex,
                                                       int version, const char* key) {
  auto doc = nlohmann::json::from_cbor(ex.blob);
  doc["version"] = version;
  for (auto& js : doc["sessions"]) js.erase(key);
  in_flight_as_version_9(doc, [](const nlohmann::json&) { return nullptr; });
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  return into.import_guest(nlohmann::json::to_cbor(doc), fds);
}

GuestExport export_a(Device& dev) {
  auto ex = dev.export_guest("a", [](const Session&) { return -1; });
  EXPECT_TRUE(ex.is_ok()) << ex.status().message();
  return std::move(ex.value());
}

/// Guest a leaves this device and comes back from its exported state; a_.s is its new session
/// (null, with a failure, if the import failed).
Session* move_a(Device& dev, G& a) {
  GuestExport ex = export_a(dev);
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  dev.detach_guest("a");
  auto r = dev.import_guest(ex.blob, fds);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  a.s = r.is_ok() ? r.value()[0].session : nullptr;
  return a.s;
}

TEST_F(DeviceTest, ExportedGuestComesBackWithItsIdentityAndItsConnectionWorks) {
  connect_both();
  post_recv(qb_, 1, mb_.addr, 64, mb_.mr.lkey);
  post_send(qa_, 2, ma_.addr, 8, ma_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(drain(bcq_).size(), 1u);
  ASSERT_EQ(drain(acq_).size(), 1u);

  GuestExport ex = export_a(dev_);
  EXPECT_EQ(ex.qps, 1u);
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  dev_.detach_guest("a");
  EXPECT_FALSE(dev_.has_guest("a"));
  EXPECT_EQ(state(b_, qb_), IBV_QPS_RTS);  // moving is not dying: the peer is not failed

  auto r = dev_.import_guest(ex.blob, fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_EQ(r.value().size(), 1u);
  a_.s = r.value()[0].session;
  a_.async_fd = a_.s->async_read.get();
  EXPECT_EQ(a_.s->guest->lid, a_.hello.lid);
  EXPECT_EQ(a_.s->guest->qps.count(qa_.qpn), 1u);
  EXPECT_EQ(a_.s->guest->mrs.count(ma_.mr.lkey), 1u);
  EXPECT_EQ(state(a_, qa_), IBV_QPS_RTS);

  // The rings and memory the guest mapped are the ones the device uses again: both ways work.
  for (int i = 0; i < 32; ++i) ma_.p()[i] = static_cast<uint8_t>(0x40 + i);
  post_recv(qb_, 3, mb_.addr + 100, 64, mb_.mr.lkey);
  post_send(qa_, 4, ma_.addr, 32, ma_.mr.lkey);
  post_recv(qa_, 5, ma_.addr + 1000, 64, ma_.mr.lkey);
  post_send(qb_, 6, mb_.addr + 100, 32, mb_.mr.lkey);
  dev_.poll(now_);
  dev_.poll(now_);
  auto rb = drain(bcq_), ra = drain(arcq_);  // b's CQ: its receive and its send
  ASSERT_EQ(rb.size(), 2u);
  ASSERT_EQ(ra.size(), 1u);
  for (const Cqe& e : rb) EXPECT_EQ(e.status, IBV_WC_SUCCESS);
  EXPECT_EQ(ra[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(ra[0].wr_id, 5u);
  EXPECT_EQ(std::memcmp(ma_.p() + 1000, ma_.p(), 32), 0);
  EXPECT_EQ(drain(acq_).size(), 1u);
  // Cursors moved with it: the send queue resumed at the second slot, not the first.
  EXPECT_EQ(qa_.sq->consumer.load(), 2u);
}

TEST_F(DeviceTest, DeviceMemoryAndAResizedCqMoveWithTheGuest) {
  connect_both();
  UniqueFd mem_fd;
  auto dm = dev_.alloc_dm(*a_.s, AllocDmReq{5000, 0, 0}, mem_fd);
  ASSERT_TRUE(dm.is_ok()) << dm.status().message();
  MappedRegion mem = MappedRegion::map_shared(mem_fd.get(), dm->bytes);
  ASSERT_TRUE(mem.valid());
  auto dmr = dev_.reg_dm_mr(
      *a_.s, RegDmMrReq{a_.pd, dm->handle, IBV_ACCESS_ZERO_BASED | kAccess, 0, 1000, 4000});
  ASSERT_TRUE(dmr.is_ok()) << dmr.status().message();
  UniqueFd ring;
  auto resized = dev_.resize_cq(*a_.s, ResizeCqReq{arcq_.handle, 500}, ring);
  ASSERT_TRUE(resized.is_ok()) << resized.status().message();
  arcq_.map = MappedRegion::map_shared(ring.get(), resized->ring_bytes);
  arcq_.hdr = reinterpret_cast<RingHeader*>(arcq_.map.data());
  arcq_.e = ring_entries<Cqe>(arcq_.hdr);
  arcq_.size = resized->cqe + 1;

  ASSERT_NE(move_a(dev_, a_), nullptr);
  ASSERT_EQ(a_.s->dms.size(), 1u);
  EXPECT_EQ(a_.s->dms.begin()->second.length, 5000u);

  // b writes through the DM MR's rkey at zero-based address 8, then sends into a's resized CQ.
  for (int i = 0; i < 16; ++i) mb_.p()[i] = static_cast<uint8_t>(0x60 + i);
  post_rdma(qb_, 1, IBV_WR_RDMA_WRITE, mb_.addr, 16, mb_.mr.lkey, 8, dmr->rkey);
  post_recv(qa_, 2, ma_.addr, 64, ma_.mr.lkey);
  post_send(qb_, 3, mb_.addr, 16, mb_.mr.lkey);
  dev_.poll(now_);
  dev_.poll(now_);
  for (const Cqe& e : drain(bcq_)) EXPECT_EQ(e.status, IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(mem.data() + 1000 + 8, mb_.p(), 16), 0);
  auto ra = drain(arcq_);
  ASSERT_EQ(ra.size(), 1u);
  EXPECT_EQ(ra[0].wr_id, 2u);
  // Freed only once its MR is gone; the quota comes back.
  EXPECT_EQ(dev_.free_dm(*a_.s, dm->handle).err(), EBUSY);
  ASSERT_TRUE(dev_.dereg_mr(*a_.s, dmr->handle).is_ok());
  EXPECT_TRUE(dev_.free_dm(*a_.s, dm->handle).is_ok());
  EXPECT_EQ(a_.s->guest->used[static_cast<size_t>(Res::kDmBytes)], 0u);
}

TEST_F(DeviceTest, AVersionThreeBlobWithoutDeviceMemoryImports) {
  connect_both();
  GuestExport ex = export_a(dev_);
  Device other;
  auto r = import_as_version(other, ex, 3, "dms");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_TRUE(r.value()[0].session->dms.empty());
}

// Completion timestamps: a stamped CQ's ring carries a CqeStamp per entry (the engine stamps
// each completion it writes), the CQ keeps them when it moves, and a version 5 blob (before
// stamps) imports its CQs without.
TEST_F(DeviceTest, CompletionStampsMoveWithTheGuestAndAVersionFiveBlobHasNone) {
  UniqueFd bad;
  EXPECT_EQ(dev_.create_cq(*a_.s, CreateCqReq{16, kNone, 0, 4}, bad).err(), EINVAL);
  CqV st = cq(a_, 16, kStampAll);
  EXPECT_EQ(st.hdr->stamps, kStampAll);
  EXPECT_GE(st.map.size(), cq_ring_bytes(st.size, kStampAll));
  // Completions of qa_'s own CQ carry none: its ring has no room for them.
  EXPECT_EQ(acq_.hdr->stamps, 0u);
  EXPECT_EQ(acq_.map.size(), 4096u * ((cq_ring_bytes(acq_.size, 0) + 4095) / 4096));
  // A connection whose sends and receives complete into it: each completion is stamped with
  // the raw clock and the wallclock when the engine writes it.
  QpV qc = qp(a_, st, st), qd = qp(b_, bcq_, bcq_);
  connect(a_, qc, b_, qd);
  connect(b_, qd, a_, qc);
  post_recv(qc, 1, ma_.addr, 64, ma_.mr.lkey);
  post_recv(qd, 2, mb_.addr, 64, mb_.mr.lkey);
  const uint64_t t0 = clock_ns(CLOCK_MONOTONIC_RAW), w0 = clock_ns(CLOCK_REALTIME);
  post_send(qc, 3, ma_.addr + 64, 8, ma_.mr.lkey);
  post_send(qd, 4, mb_.addr + 64, 8, mb_.mr.lkey);
  dev_.poll(now_);
  dev_.poll(now_);
  const uint64_t t1 = clock_ns(CLOCK_MONOTONIC_RAW), w1 = clock_ns(CLOCK_REALTIME);
  ASSERT_EQ(drain(st).size(), 2u);
  for (uint32_t i = 0; i < 2; ++i) {
    EXPECT_GE(st.st[i].ns, t0);
    EXPECT_LE(st.st[i].ns, t1);
    EXPECT_GE(st.st[i].wallclock_ns, w0);
    EXPECT_LE(st.st[i].wallclock_ns, w1);
  }
  drain(bcq_);

  ASSERT_NE(move_a(dev_, a_), nullptr);
  Cq& moved = *a_.s->cqs.at(st.handle);
  EXPECT_EQ(moved.stamps, kStampAll);
  EXPECT_EQ(moved.stamp, cq_stamps(moved.hdr, moved.size));
  EXPECT_EQ(a_.s->cqs.at(acq_.handle)->stamp, nullptr);

  GuestExport ex = export_a(dev_);
  auto doc = nlohmann::json::from_cbor(ex.blob);
  doc["version"] = 5;
  in_flight_as_version_9(doc, [](const nlohmann::json&) { return nullptr; });
  for (auto& js : doc["sessions"])
    for (auto& jc : js["cqs"]) jc.erase("stamps");
  {
    std::vector<UniqueFd> fds = dup_all(ex.fds);
    Device other;
    auto r = other.import_guest(nlohmann::json::to_cbor(doc), fds);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    EXPECT_EQ(r.value()[0].session->cqs.at(st.handle)->stamp, nullptr);
  }
  // Stamp bits nobody knows: nothing is imported.
  doc = nlohmann::json::from_cbor(ex.blob);
  for (auto& jc : doc["sessions"][0]["cqs"]) jc["stamps"] = 8;
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  Device other;
  EXPECT_EQ(other.import_guest(nlohmann::json::to_cbor(doc), fds).err(), EINVAL);
  EXPECT_FALSE(other.has_guest("a"));
}

TEST_F(DeviceTest, MemoryWindowsMoveWithTheGuestBoundOrNot) {
  qp_access_ = kAccess | IBV_ACCESS_MW_BIND;
  connect_both();
  MemV m = mem(a_, kAccess | IBV_ACCESS_MW_BIND);
  auto idle = dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd, IBV_MW_TYPE_1});
  ASSERT_TRUE(idle.is_ok());
  const auto [bound, rkey] = type2_window(a_, qa_, m, 512, 1024, IBV_ACCESS_REMOTE_WRITE);
  ASSERT_NE(rkey, 0u);
  Cqe b = poll_one(acq_);
  ASSERT_EQ(b.status, IBV_WC_SUCCESS);

  ASSERT_NE(move_a(dev_, a_), nullptr);
  ASSERT_EQ(a_.s->mws.size(), 2u);
  EXPECT_EQ(a_.s->guest->used[static_cast<size_t>(Res::kMw)], 2u);

  // b writes through the window's rkey (bound through qa_, b's peer): it still reaches.
  std::memset(mb_.p(), 0x3c, 32);
  post_rdma(qb_, 2, IBV_WR_RDMA_WRITE, mb_.addr, 32, mb_.mr.lkey, m.addr + 512, rkey);
  Cqe w = poll_one(bcq_);
  EXPECT_EQ(w.status, IBV_WC_SUCCESS);
  EXPECT_EQ(m.p()[512], 0x3c);
  EXPECT_EQ(dev_.dereg_mr(*a_.s, m.mr.handle).err(), EBUSY) << "still bound";
  EXPECT_TRUE(dev_.dealloc_mw(*a_.s, bound.handle).is_ok());
  EXPECT_TRUE(dev_.dealloc_mw(*a_.s, idle->handle).is_ok());
}

// XRC moves with the guest (version 8): a's domain (opened by a file in two sessions), its XRC
// SRQ (number, CQ, a receive posted before the move) and receive QP (created by one session,
// opened by the other) keep their ids and use counts; b's XRC_SEND QP goes on sending to the
// SRQ's number, and everything closes as before. A blob whose receive QP names an SRQ number
// it cannot have, or that no session holds, imports nothing.
TEST_F(DeviceTest, XrcObjectsMoveWithTheGuest) {
  char path[] = "/tmp/vrdma-xrc-state-XXXXXX";
  UniqueFd file(::mkstemp(path));
  ASSERT_TRUE(file.valid());
  ::unlink(path);
  G a2 = open("a");
  auto x = dev_.open_xrcd(*a_.s, OpenXrcdReq{O_CREAT, 0}, UniqueFd(::dup(file.get())));
  auto x2 = dev_.open_xrcd(*a2.s, OpenXrcdReq{0, 0}, UniqueFd(::dup(file.get())));
  ASSERT_TRUE(x.is_ok() && x2.is_ok());
  CqV c = cq(a_);
  UniqueFd ring;
  auto srq = dev_.create_xrc_srq(
      *a_.s, CreateXrcSrqReq{a_.pd, x.value(), c.handle, 0, {8, 1, 0, 0}}, ring);
  ASSERT_TRUE(srq.is_ok()) << srq.status().message();
  MappedRegion srq_map = MappedRegion::map_shared(ring.get(), srq->ring_bytes);
  auto* srq_hdr = reinterpret_cast<RingHeader*>(srq_map.data());
  for (uint32_t i = 0; i < 2; ++i) {
    ring_entries<RecvWqe>(srq_hdr)[i] =
        RecvWqe{i + 1, 1, 0, {Sge{ma_.addr + 64 * i, 64, ma_.mr.lkey}}};
    srq_hdr->producer.store(i + 1, std::memory_order_release);
  }
  CreateQpReq rq{};
  rq.qp_type = IBV_QPT_XRC_RECV;
  rq.xrcd = x.value();
  QpV tgt = create_qp(a_, rq);
  auto opened = dev_.open_qp(*a2.s, OpenQpReq{x2.value(), tgt.qpn, IBV_QPT_XRC_RECV, 0});
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  QpV snd = create_qp(b_, qp_req(b_, bcq_, bcq_, IBV_QPT_XRC_SEND));
  connect(a_, tgt, b_, snd);
  connect(b_, snd, a_, tgt);
  const auto send_to_srq = [&](uint64_t wr_id, char fill) {
    std::memset(mb_.p(), fill, 8);
    post_send(snd, wr_id, mb_.addr, 8, mb_.mr.lkey);
    snd.sqe[(snd.sq_prod - 1) & (snd.sq_size - 1)].ud_remote_qkey = srq->srq_num;
    dev_.poll(now_);
    EXPECT_EQ(poll_one(bcq_).status, IBV_WC_SUCCESS);
  };
  send_to_srq(7, 'x');
  ASSERT_EQ(drain(c).size(), 1u);

  GuestExport ex = export_a(dev_);
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  dev_.detach_guest("a");
  auto r = dev_.import_guest(ex.blob, fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_EQ(r.value().size(), 2u);
  Session& s1 = *r.value()[0].session;
  Session& s2 = *r.value()[1].session;
  Guest& g = *s1.guest;
  ASSERT_EQ(g.xrcds.size(), 1u);
  const Xrcd& d = *g.xrcds.begin()->second;
  EXPECT_EQ(d.opens, 2u);
  EXPECT_EQ(d.users, 2u);  // the SRQ and the receive QP
  EXPECT_EQ(s1.srqs.at(srq->handle)->srqn, srq->srq_num);
  EXPECT_EQ(g.xrc_srqs.at(srq->srq_num), s1.srqs.at(srq->handle).get());
  ASSERT_EQ(g.xrc_qps.count(tgt.qpn), 1u);
  EXPECT_EQ(g.xrc_qps.at(tgt.qpn)->opens, 2u);
  EXPECT_EQ(s2.xrc_qps.at(opened->handle), tgt.qpn);
  EXPECT_EQ(g.used[static_cast<size_t>(Res::kQp)], 2u);  // qa_ and the receive QP

  // The receive posted before the move takes the next message, completing on the SRQ's CQ.
  send_to_srq(8, 'y');
  Cqe got = poll_one(c);
  EXPECT_EQ(got.status, IBV_WC_SUCCESS);
  EXPECT_EQ(got.wr_id, 2u);
  EXPECT_EQ(got.qp_num, tgt.qpn);
  EXPECT_EQ(ma_.p()[64], 'y');

  // Broken blobs: nothing is imported.
  GuestExport ex2 = export_a(dev_);
  auto doc = nlohmann::json::from_cbor(ex2.blob);
  for (const auto& mutate : std::vector<std::function<void(nlohmann::json&)>>{
           [](nlohmann::json& j) { j["xrc_qps"][0]["srqn"] = 0xabcdef; },
           [](nlohmann::json& j) { j["sessions"][0]["xrc_qps"] = nlohmann::json::array(); },
           [](nlohmann::json& j) { j["next_xrcd"] = 1; },
           [](nlohmann::json& j) { j["sessions"][0]["srqs"][0]["cq"] = 999; }}) {
    auto bad = doc;
    mutate(bad);
    std::vector<UniqueFd> bfds = dup_all(ex2.fds);
    Device other;
    EXPECT_EQ(other.import_guest(nlohmann::json::to_cbor(bad), bfds).err(), EINVAL);
    EXPECT_FALSE(other.has_guest("a"));
  }

  // Everything closes as before the move: the domain goes with its last user.
  ASSERT_TRUE(dev_.destroy_qp(s1, tgt.handle).is_ok());
  ASSERT_TRUE(dev_.destroy_qp(s2, opened->handle).is_ok());
  ASSERT_TRUE(dev_.destroy_srq(s1, srq->handle).is_ok());
  ASSERT_TRUE(dev_.close_xrcd(s1, x.value()).is_ok());
  ASSERT_TRUE(dev_.close_xrcd(s2, x2.value()).is_ok());
  EXPECT_TRUE(g.xrcds.empty());
  EXPECT_TRUE(g.xrc_qps.empty());
}

// A version 7 blob (no XRC fields anywhere) still imports.
TEST_F(DeviceTest, AVersionSevenBlobWithoutXrcImports) {
  connect_both();
  GuestExport ex = export_a(dev_);
  auto doc = nlohmann::json::from_cbor(ex.blob);
  doc["version"] = 7;
  in_flight_as_version_9(doc, [](const nlohmann::json&) { return nullptr; });
  for (const char* k : {"xrcds", "xrc_qps", "next_xrcd", "next_srqn"}) doc.erase(k);
  for (auto& js : doc["sessions"]) {
    js.erase("xrcds");
    js.erase("xrc_qps");
  }
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  Device other;
  auto r = other.import_guest(nlohmann::json::to_cbor(doc), fds);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_TRUE(r.value()[0].session->guest->xrcds.empty());
}

TEST_F(DeviceTest, AVersionFourBlobWithoutWindowsImportsAndABadWindowIsRefused) {
  connect_both();
  auto mw = dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd, IBV_MW_TYPE_1});
  ASSERT_TRUE(mw.is_ok());
  GuestExport ex = export_a(dev_);
  auto doc = nlohmann::json::from_cbor(ex.blob);
  {
    Device other;
    auto r = import_as_version(other, ex, 4, "mws");
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    EXPECT_TRUE(r.value()[0].session->mws.empty());
  }
  // A window bound to an MR the session does not have: nothing is imported.
  auto bad = doc;
  bad["sessions"][0]["mws"][0]["bound"] = 1;
  bad["sessions"][0]["mws"][0]["mr"] = 999;
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  Device other;
  auto r = other.import_guest(nlohmann::json::to_cbor(bad), fds);
  EXPECT_EQ(r.err(), EINVAL);
  EXPECT_FALSE(other.has_guest("a"));
}

TEST_F(DeviceTest, ImportRefusesAGuestAlreadyHereAndMissingDescriptors) {
  connect_both();
  GuestExport ex = export_a(dev_);
  std::vector<UniqueFd> fds = dup_all(ex.fds);
  EXPECT_EQ(dev_.import_guest(ex.blob, fds).err(), EEXIST);
  Device other;
  std::vector<UniqueFd> none;
  EXPECT_EQ(other.import_guest(ex.blob, none).err(), EINVAL);
  std::vector<UniqueFd> fewer = dup_all(ex.fds);
  fewer.pop_back();
  EXPECT_EQ(other.import_guest(ex.blob, fewer).err(), EINVAL);
  EXPECT_TRUE(other.sessions().empty());
  // A descriptor of the wrong kind where a memfd belongs: refused, not mapped.
  std::vector<UniqueFd> wrong = dup_all(ex.fds);
  wrong[0] = UniqueFd(::open("/dev/null", O_RDWR | O_CLOEXEC));
  EXPECT_EQ(other.import_guest(ex.blob, wrong).err(), EINVAL);
  EXPECT_TRUE(other.sessions().empty());
}

TEST_F(DeviceTest, MutatedStateNeverCrashesTheImporterNorLeavesHalfAGuest) {
  connect_both();
  post_send(qa_, 1, ma_.addr, 8, ma_.mr.lkey);  // RNR: something in the QP's retry state
  dev_.poll(now_);
  // XRC (version 8): a domain, an XRC SRQ and a receive QP in it.
  auto x = dev_.open_xrcd(*a_.s, OpenXrcdReq{O_CREAT, 0}, UniqueFd());
  ASSERT_TRUE(x.is_ok());
  UniqueFd ring;
  ASSERT_TRUE(dev_.create_xrc_srq(
                      *a_.s, CreateXrcSrqReq{a_.pd, x.value(), acq_.handle, 0, {4, 1, 0, 0}}, ring)
                  .is_ok());
  CreateQpReq rq{};
  rq.qp_type = IBV_QPT_XRC_RECV;
  rq.xrcd = x.value();
  UniqueFd none;
  ASSERT_TRUE(dev_.create_qp(*a_.s, rq, none).is_ok());
  GuestExport ex = export_a(dev_);
  std::mt19937 rng(12345);
  Device other;
  int accepted = 0;
  for (int i = 0; i < 3000; ++i) {
    std::vector<uint8_t> b = ex.blob;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n; ++k) b[rng() % b.size()] = static_cast<uint8_t>(rng());
    if (rng() % 8 == 0) b.resize(rng() % b.size());
    std::vector<UniqueFd> fds = dup_all(ex.fds);
    auto r = other.import_guest(b, fds);
    if (!r.is_ok()) {
      EXPECT_TRUE(other.sessions().empty());
      continue;
    }
    ++accepted;  // a mutation that still describes a valid guest: it must run and go cleanly
    const std::string name = r.value()[0].session->guest->name;
    for (int k = 0; k < 3; ++k) other.poll(now_ += 1'000'000);
    other.detach_guest(name);
    EXPECT_TRUE(other.sessions().empty());
  }
  RecordProperty("accepted_mutations", accepted);
}

}  // namespace
}  // namespace vrdma::engine::devtest
