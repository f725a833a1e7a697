// Completion channels across a move (docs/ARCHITECTURE.md, "Moving a guest's device"): a
// backend SIGKILLed (keep_state) between writing a completion and firing its CQ's channel must
// not cost the event. Whoever takes a guest's state in (a keeper's restart, a migration, a
// restore) fires every armed CQ that holds a completion: a spurious event is allowed, a lost one
// is not.
#include <fcntl.h>
#include <sys/stat.h>

#include <set>

#include "device_fixture.h"

namespace vrdma::engine::devtest {
namespace {

/// A completion written into `c` the way push_cqe writes it, without the channel's event that
/// push_cqe's notify would write next: what a backend killed between the two leaves behind.
void write_unfired(CqV& c, uint64_t wr_id, uint32_t opcode, ibv_wc_status status = IBV_WC_SUCCESS) {
  const uint32_t p = c.hdr->producer.load(std::memory_order_relaxed);
  Cqe e{};
  e.wr_id = wr_id;
  e.status = status;
  e.opcode = opcode;
  c.e[p & (c.size - 1)] = e;
  c.hdr->producer.store(p + 1, std::memory_order_release);
}

/// The CQ handles waiting in a (non-blocking) channel.
std::multiset<uint32_t> events(int fd) {
  std::multiset<uint32_t> out;
  uint32_t h = 0;
  while (::read(fd, &h, sizeof(h)) == sizeof(h)) out.insert(h);
  return out;
}

class ChannelMoveTest : public DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    auto ch = dev_.create_channel(*a_.s, chan_);
    ASSERT_TRUE(ch.is_ok()) << ch.status().message();
    ASSERT_EQ(::fcntl(chan_.get(), F_SETFL, O_NONBLOCK), 0);
    for (CqV* c : {&c1_, &c2_, &c3_, &c4_}) *c = cq(a_, 64, 0, ch.value());
  }
  /// Guest a's state as export_guest gives it, with duplicates of its descriptors (what a
  /// keeper holds, or the target of a move receives).
  struct Kept {
    GuestExport ex;
    std::vector<UniqueFd> fds;
  };
  Kept keep() {
    auto ex = dev_.export_guest("a", [](const Session&) { return -1; });
    EXPECT_TRUE(ex.is_ok()) << ex.status().message();
    if (!ex.is_ok()) return {};
    std::vector<UniqueFd> fds = dup_all(ex->fds);
    return {std::move(ex.value()), std::move(fds)};
  }
  /// Guest a's state taken in by `into` (recover: as a keeper's restart and a restore do).
  static void take_in(Device& into, Kept& k, bool recover) {
    auto r = into.import_guest(k.ex.blob, k.fds, recover);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
  }

  /// A QP of b granted the direct path to one of a whose receive CQ is c1_ (same uid, trusted):
  /// `own` maps a's own receive ring, which stands for c1_ (what b's library writes).
  void grant_b_to_a(CqV& own) {
    dev_.set_direct(true);
    dev_.set_direct_trust(true, {});
    a_.s->uid = b_.s->uid = ::getuid();
    QpV qb = qp(b_, bcq_, bcq_), qa = qp(a_, acq_, c1_);
    connect(b_, qb, a_, qa);
    connect(a_, qa, b_, qb);
    std::vector<UniqueFd> fds;
    auto g = dev_.direct_grant(*b_.s, qb.handle, fds);  // b -> a: a's own receive ring
    ASSERT_TRUE(g.is_ok()) << g.status().message();
    struct stat st {};
    ASSERT_EQ(::fstat(fds[2].get(), &st), 0);
    own.map = MappedRegion::map_shared(fds[2].get(), static_cast<size_t>(st.st_size));
    own.hdr = reinterpret_cast<RingHeader*>(own.map.data());
    own.e = ring_entries<Cqe>(own.hdr);
    own.size = g->recv_ring_entries;
  }

  UniqueFd chan_;          ///< a's channel, the end its library reads
  CqV c1_, c2_, c3_, c4_;  ///< a's CQs on it
};

// The keeper holds the state of the last control command; the backend then wrote completions
// and died before firing. The restarted backend fires what the dead one owed, and only that.
TEST_F(ChannelMoveTest, AKeptStateFiresEveryArmedCqThatHoldsACompletion) {
  Kept kept = keep();
  c1_.hdr->armed.store(1);  // armed, a completion written, no event: owed one
  write_unfired(c1_, 1, IBV_WC_RECV);
  c2_.hdr->armed.store(1);             // armed and empty: nothing owed
  write_unfired(c3_, 3, IBV_WC_RECV);  // not armed: nothing owed
  c4_.hdr->armed.store(2);             // solicited only, holding only a send completion
  write_unfired(c4_, 4, IBV_WC_SEND);
  ASSERT_TRUE(events(chan_.get()).empty());

  Device restarted{next_quotas_};
  take_in(restarted, kept, true);
  EXPECT_EQ(events(chan_.get()), (std::multiset<uint32_t>{c1_.handle}));
  EXPECT_EQ(c1_.hdr->armed.load(), 0u);  // the arm is used up, as by any event
  EXPECT_EQ(c2_.hdr->armed.load(), 1u);
  EXPECT_EQ(c4_.hdr->armed.load(), 2u);
  EXPECT_EQ(drain(c1_).size(), 1u);  // and the completion is there to poll
}

// Killed inside notify: the arm taken back (armed 0, `firing` says which it was), the event not
// written yet. The restarted backend arms the CQ again with it and fires; a CQ whose arm the
// guest has set again meanwhile (c2) keeps it, and gets the one event.
TEST_F(ChannelMoveTest, AKeptStateFiresACqWhoseArmTheDeadBackendTookBackWithoutItsEvent) {
  Kept kept = keep();
  write_unfired(c1_, 1, IBV_WC_RECV);
  c1_.hdr->firing.store(1);  // armed was 1; notify took it back and died before the write
  write_unfired(c2_, 2, IBV_WC_SEND);
  c2_.hdr->firing.store(2);
  c2_.hdr->armed.store(1);   // the guest armed again since
  c3_.hdr->firing.store(1);  // empty: nothing owed, the arm stays for the next completion
  ASSERT_TRUE(events(chan_.get()).empty());

  Device restarted{next_quotas_};
  take_in(restarted, kept, true);
  EXPECT_EQ(events(chan_.get()), (std::multiset<uint32_t>{c1_.handle, c2_.handle}));
  for (CqV* c : {&c1_, &c2_, &c3_}) EXPECT_EQ(c->hdr->firing.load(), 0u);
  EXPECT_EQ(c3_.hdr->armed.load(), 1u);
  EXPECT_EQ(drain(c1_).size(), 1u);
}

// notify notes the arm it takes back only while it writes the event: after it, nothing is owed.
TEST_F(ChannelMoveTest, AFiredEventLeavesNothingOwed) {
  QpV qa = qp(a_, acq_, c1_), qb = qp(b_, bcq_, bcq_);
  connect(a_, qa, b_, qb);
  connect(b_, qb, a_, qa);
  c1_.hdr->armed.store(1);
  post_recv(qa, 1, ma_.addr, 64, ma_.mr.lkey);
  post_send(qb, 2, mb_.addr, 8, mb_.mr.lkey);
  dev_.poll(now_);
  EXPECT_EQ(events(chan_.get()), (std::multiset<uint32_t>{c1_.handle}));
  EXPECT_EQ(c1_.hdr->firing.load(), 0u);
  EXPECT_EQ(c1_.hdr->armed.load(), 0u);
  Kept kept = keep();  // so a restart owes nothing: the guest did not arm again
  Device restarted{next_quotas_};
  take_in(restarted, kept, true);
  EXPECT_TRUE(events(chan_.get()).empty());
}

// Solicited-only arming: the completion may have been a solicited receive (the CQE does not
// say), so a receive completion gets the event (at worst a spurious one, which the verbs allow).
TEST_F(ChannelMoveTest, ASolicitedArmGetsTheEventForAReceiveCompletion) {
  Kept kept = keep();
  c1_.hdr->armed.store(2);
  write_unfired(c1_, 1, IBV_WC_SEND);
  write_unfired(c1_, 2, IBV_WC_RECV_RDMA_WITH_IMM);
  Device restarted{next_quotas_};
  take_in(restarted, kept, true);
  EXPECT_EQ(events(chan_.get()), (std::multiset<uint32_t>{c1_.handle}));
}

// A completion in error counts as solicited (ibv_req_notify_cq(3)): a send that failed fires a
// solicited-only arm; a successful one (c2) does not.
TEST_F(ChannelMoveTest, ASolicitedArmGetsTheEventForACompletionInError) {
  Kept kept = keep();
  c1_.hdr->armed.store(2);
  write_unfired(c1_, 1, IBV_WC_SEND, IBV_WC_RETRY_EXC_ERR);
  c2_.hdr->armed.store(2);
  write_unfired(c2_, 2, IBV_WC_SEND);
  Device restarted{next_quotas_};
  take_in(restarted, kept, true);
  EXPECT_EQ(events(chan_.get()), (std::multiset<uint32_t>{c1_.handle}));
}

// The same rule on the other imports: a guest that armed a CQ holding a completion it has not
// polled yet, then moved (live migration) or restored from a snapshot, gets its event.
TEST_F(ChannelMoveTest, AMigrationAndARestoreFireAnArmedCqThatHoldsACompletion) {
  CqV& rcq = c1_;
  QpV qa = qp(a_, acq_, rcq), qb = qp(b_, bcq_, bcq_);
  connect(a_, qa, b_, qb);
  connect(b_, qb, a_, qa);
  post_recv(qa, 1, ma_.addr, 64, ma_.mr.lkey);
  post_send(qb, 2, mb_.addr, 8, mb_.mr.lkey);
  dev_.poll(now_);
  ASSERT_EQ(rcq.hdr->producer.load(), 1u);
  rcq.hdr->armed.store(1);  // armed after the completion: the guest's next poll would find it

  Kept ex = keep();  // migration: the source forgets, the target takes in
  dev_.detach_guest("a");
  take_in(dev_, ex, false);
  EXPECT_EQ(events(chan_.get()), (std::multiset<uint32_t>{rcq.handle}));

  rcq.hdr->armed.store(1);  // armed again, still unpolled; a snapshot, then its restore
  Kept snap = keep();
  dev_.detach_guest("a");
  take_in(dev_, snap, true);
  EXPECT_EQ(events(chan_.get()), (std::multiset<uint32_t>{rcq.handle}));
  EXPECT_EQ(drain(rcq).size(), 1u);
}

// Direct path: a QP's own receive ring stands for its CQ. A completion the backend wrote there
// before it died, with the CQ armed, gets the CQ's event after the restart.
TEST_F(ChannelMoveTest, AKeptStateFiresAnArmedCqWhoseOwnRingHoldsACompletion) {
  CqV own;
  ASSERT_NO_FATAL_FAILURE(grant_b_to_a(own));

  Kept kept = keep();
  c1_.hdr->armed.store(1);
  write_unfired(own, 7, IBV_WC_RECV);
  ASSERT_EQ(c1_.hdr->producer.load(), 0u);  // the CQ's own ring is empty: only the QP's holds it
  Device restarted{next_quotas_};
  take_in(restarted, kept, true);
  EXPECT_EQ(events(chan_.get()), (std::multiset<uint32_t>{c1_.handle}));
}

// Direct path: the peer's library wrote a completion into a's own receive ring, took the CQ's
// arm to fire it and died (SIGKILL) before it wrote the event. The end of its session arms the
// CQ again and fires it: a's waiter wakes to the completion and the flush.
TEST_F(ChannelMoveTest, APeerLibraryThatDiedInsideItsFireLeavesTheEventOwedToTheSessionsEnd) {
  CqV own;
  ASSERT_NO_FATAL_FAILURE(grant_b_to_a(own));
  write_unfired(own, 7, IBV_WC_RECV);
  c1_.hdr->firing.store(1);  // what fire() left: the arm taken back, no event written
  ASSERT_TRUE(events(chan_.get()).empty());

  dev_.close_session(b_.s);
  EXPECT_EQ(events(chan_.get()), (std::multiset<uint32_t>{c1_.handle}));
  EXPECT_EQ(c1_.hdr->firing.load(), 0u);
}

}  // namespace
}  // namespace vrdma::engine::devtest
