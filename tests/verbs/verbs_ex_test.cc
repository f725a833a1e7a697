// The extended verbs through our libibverbs.so.1 and a real backend: ibv_create_cq_ex's
// start/next/end_poll iterator and read_* accessors, and ibv_create_qp_ex's wr_* builders
// (batches, abort, overflow), including that the extended objects still work with the ordinary
// verbs (ibv_poll_cq, completion channels, ibv_post_recv) and refuse what the device cannot do.
#include "verbs_fixture.h"

namespace {

/// One completion as read through the ibv_cq_ex accessors.
struct ExWc {
  uint64_t wr_id;
  ibv_wc_status status;
  ibv_wc_opcode opcode;
  uint32_t byte_len;
  uint32_t imm;  ///< host order
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned wc_flags;
  uint32_t slid;
};

class VerbsEx : public vrdma::test::VerbsFixture {
 protected:
  ibv_cq_ex* make_cq_ex(uint64_t wc_flags = IBV_WC_STANDARD_FLAGS, ibv_comp_channel* ch = nullptr) {
    ibv_cq_init_attr_ex a{};
    a.cqe = 256;
    a.cq_context = this;
    a.channel = ch;
    a.wc_flags = wc_flags;
    ibv_cq_ex* cq = ibv_create_cq_ex(ctx_, &a);
    EXPECT_NE(cq, nullptr) << std::strerror(errno);
    if (cq) cqs_.push_back(ibv_cq_ex_to_cq(cq));
    return cq;
  }

  ibv_qp_init_attr_ex qp_attr(ibv_cq* cq, uint32_t depth, uint64_t send_ops) {
    ibv_qp_init_attr_ex a{};
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = depth;
    a.cap.max_recv_wr = depth;
    a.cap.max_send_sge = 2;
    a.cap.max_recv_sge = 2;
    a.cap.max_inline_data = 64;
    a.comp_mask = IBV_QP_INIT_ATTR_PD | (send_ops ? IBV_QP_INIT_ATTR_SEND_OPS_FLAGS : 0);
    a.pd = pd_;
    a.send_ops_flags = send_ops;
    return a;
  }

  /// An RC QP made with ibv_create_qp_ex; with `send_ops`, its ibv_qp_ex is usable.
  ibv_qp* make_qp(ibv_cq* cq, uint32_t depth = 64, uint64_t send_ops = 0) {
    ibv_qp_init_attr_ex a = qp_attr(cq, depth, send_ops);
    ibv_qp* qp = ibv_create_qp_ex(ctx_, &a);
    EXPECT_NE(qp, nullptr) << std::strerror(errno);
    if (qp) qps_.push_back(qp);
    return qp;
  }

  /// Reads the iterator's current completion through every accessor.
  static ExWc read(ibv_cq_ex* cq) {
    return ExWc{cq->wr_id,
                cq->status,
                ibv_wc_read_opcode(cq),
                ibv_wc_read_byte_len(cq),
                ntohl(ibv_wc_read_imm_data(cq)),
                ibv_wc_read_qp_num(cq),
                ibv_wc_read_src_qp(cq),
                ibv_wc_read_wc_flags(cq),
                ibv_wc_read_slid(cq)};
  }

  /// Polls with start/next/end_poll until `n` completions arrived or 5 s passed.
  std::vector<ExWc> poll_ex(ibv_cq_ex* cq, size_t n) {
    std::vector<ExWc> out;
    for (int spins = 0; out.size() < n && spins < 5'000'000; ++spins) {
      int rc = ibv_start_poll(cq, nullptr);
      if (rc == ENOENT) {
        ::usleep(1);
        continue;
      }
      EXPECT_EQ(rc, 0);
      if (rc) break;
      do out.push_back(read(cq));
      while (ibv_next_poll(cq) == 0);
      ibv_end_poll(cq);
    }
    return out;
  }

  /// True if nothing arrives on `cq` within ~50 ms.
  bool stays_empty(ibv_cq* cq) {
    for (int i = 0; i < 50; ++i) {
      ibv_wc wc;
      if (ibv_poll_cq(cq, 1, &wc) != 0) return false;
      ::usleep(1000);
    }
    return true;
  }

};

constexpr uint64_t kAllOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
                             IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
                             IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
                             IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;

TEST_F(VerbsEx, CqExIteratesCompletionsWithEveryField) {
  ibv_cq_ex* cqx = make_cq_ex();
  ASSERT_NE(cqx, nullptr);
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  // Empty: ENOENT, many times over (through the yield and liveness paths), and no lock kept.
  for (int i = 0; i < 3000; ++i) ASSERT_EQ(ibv_start_poll(cqx, nullptr), ENOENT);
  ibv_poll_cq_attr bad_attr{1};
  EXPECT_EQ(ibv_start_poll(cqx, &bad_attr), EINVAL);

  auto [a, b] = connected_pair([&] { return make_qp(cq); });
  constexpr int kMsgs = 5;
  for (int i = 0; i < kMsgs; ++i) ASSERT_EQ(post_recv(b, 100 + i, 4096 * (i + 1), 4096), 0);
  for (int i = 0; i < kMsgs; ++i) {
    std::memset(buf_.data() + 65536 + 128 * i, 'a' + i, 128);
    ibv_sge s{addr(65536 + 128 * i), 10u + i, mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = i;
    wr.sg_list = &s;
    wr.num_sge = 1;
    wr.opcode = i % 2 ? IBV_WR_SEND : IBV_WR_SEND_WITH_IMM;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(0xabc0 + i);
    ibv_send_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  }
  auto wcs = poll_ex(cqx, 2 * kMsgs);
  ASSERT_EQ(wcs.size(), size_t{2 * kMsgs});
  int sends = 0, recvs = 0;
  for (const ExWc& wc : wcs) {
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    if (wc.opcode == IBV_WC_SEND) {
      EXPECT_EQ(wc.wr_id, uint64_t(sends)) << "sends complete in order";
      EXPECT_EQ(wc.qp_num, a->qp_num);
      ++sends;
      continue;
    }
    ASSERT_EQ(wc.opcode, IBV_WC_RECV);
    EXPECT_EQ(wc.wr_id, uint64_t(100 + recvs)) << "receives complete in order";
    EXPECT_EQ(wc.byte_len, 10u + recvs);
    EXPECT_EQ(wc.qp_num, b->qp_num);
    EXPECT_EQ(wc.src_qp, a->qp_num);
    EXPECT_EQ(wc.slid, lid_);
    if (recvs % 2 == 0) {
      EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
      EXPECT_EQ(wc.imm, 0xabc0u + recvs);
    } else {
      EXPECT_FALSE(wc.wc_flags & IBV_WC_WITH_IMM);
    }
    EXPECT_EQ(buf_[4096 * (recvs + 1)], 'a' + recvs);
    ++recvs;
  }
  EXPECT_EQ(sends, kMsgs);
  EXPECT_EQ(recvs, kMsgs);
  EXPECT_EQ(ibv_start_poll(cqx, nullptr), ENOENT);

  // The same CQ through the ordinary verbs: ibv_poll_cq sees what the iterator left.
  ASSERT_EQ(post_recv(b, 200, 0, 64), 0);
  ibv_sge s{addr(128), 8, mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 201;
  wr.sg_list = &s;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  auto plain = poll(cq, 2);
  ASSERT_EQ(plain.size(), 2u);
  EXPECT_EQ(plain[0].wr_id + plain[1].wr_id, 401u);
  EXPECT_EQ(ibv_start_poll(cqx, nullptr), ENOENT);
}

TEST_F(VerbsEx, CqExWorksWithACompletionChannel) {
  channel_ = ibv_create_comp_channel(ctx_);
  ASSERT_NE(channel_, nullptr);
  ibv_cq_ex* cqx = make_cq_ex(IBV_WC_EX_WITH_BYTE_LEN, channel_);
  ASSERT_NE(cqx, nullptr);
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  EXPECT_EQ(cq->cq_context, this);
  EXPECT_EQ(cq->channel, channel_);
  auto [a, b] = connected_pair([&] { return make_qp(cq); });
  ASSERT_EQ(ibv_req_notify_cq(cq, 0), 0);
  ASSERT_EQ(post_recv(b, 1, 0, 64), 0);
  ibv_sge s{addr(128), 16, mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 2;
  wr.sg_list = &s;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  ASSERT_EQ(ibv_get_cq_event(channel_, &ev_cq, &ev_ctx), 0);
  EXPECT_EQ(ev_cq, cq);
  EXPECT_EQ(ev_ctx, this);
  ibv_ack_cq_events(cq, 1);
  auto wcs = poll_ex(cqx, 1);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].wr_id, 1u);
  EXPECT_EQ(wcs[0].byte_len, 16u);
}

/// ns of `id` now.
uint64_t now_ns(clockid_t id) {
  timespec t{};
  ::clock_gettime(id, &t);
  return uint64_t(t.tv_sec) * 1'000'000'000u + uint64_t(t.tv_nsec);
}

// Completion timestamps: one clock (CLOCK_MONOTONIC_RAW ns, hca_core_clock 1 GHz) for the
// backend's completions and the library's own (the direct. run), the one ibv_query_rt_values_ex
// reads; the wallclock is CLOCK_REALTIME. Stamps survive a resize of the CQ that holds them.
TEST_F(VerbsEx, CqExStampsCompletionsWithTheDeviceClock) {
  ibv_device_attr_ex dx{};
  ASSERT_EQ(ibv_query_device_ex(ctx_, nullptr, &dx), 0);
  EXPECT_EQ(dx.hca_core_clock, 1'000'000u) << "kHz: one tick per ns";
  EXPECT_EQ(dx.completion_timestamp_mask, ~uint64_t{0});
  ibv_values_ex rt{};
  rt.comp_mask = IBV_VALUES_MASK_RAW_CLOCK | IBV_VALUES_MASK_RESERVED;
  ASSERT_EQ(ibv_query_rt_values_ex(ctx_, &rt), 0);
  EXPECT_EQ(rt.comp_mask, uint32_t{IBV_VALUES_MASK_RAW_CLOCK}) << "unknown bits come back clear";
  const uint64_t t0 =
      uint64_t(rt.raw_clock.tv_sec) * 1'000'000'000u + uint64_t(rt.raw_clock.tv_nsec);
  const uint64_t w0 = now_ns(CLOCK_REALTIME);
  EXPECT_LE(t0, now_ns(CLOCK_MONOTONIC_RAW));

  ibv_cq_ex* cqx =
      make_cq_ex(uint64_t{IBV_WC_STANDARD_FLAGS} | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP |
                 IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK);
  ASSERT_NE(cqx, nullptr);
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  auto [a, b] = connected_pair([&] { return make_qp(cq); });
  // Rounds of sends: the first go through the backend, later ones (direct. run) through the
  // library once it holds a grant. Half of each round is resized over before it is polled.
  std::vector<uint64_t> ts, wall;
  for (int round = 0; round < 4; ++round) {
    constexpr int kMsgs = 4;
    for (int i = 0; i < kMsgs; ++i) ASSERT_EQ(post_recv(b, 100 + i, 4096, 64), 0);
    for (int i = 0; i < kMsgs; ++i)
      ASSERT_EQ(post(a, Wr{IBV_WR_SEND, {sge(128, 8)}, IBV_SEND_SIGNALED, uint64_t(i)}), 0);
    size_t got = 0;
    if (round % 2) {
      // Until every completion is in, then a resize moves them (and their stamps) over.
      for (int spins = 0; spins < 5'000'000; ++spins) {
        if (ibv_start_poll(cqx, nullptr) == 0) {
          ts.push_back(ibv_wc_read_completion_ts(cqx));
          wall.push_back(ibv_wc_read_completion_wallclock_ns(cqx));
          ibv_end_poll(cqx);
          break;
        }
      }
      got = 1;
      ::usleep(20'000);
      ASSERT_EQ(ibv_resize_cq(cq, 512 + 64 * round), 0);
    }
    for (int spins = 0; got < 2 * kMsgs && spins < 5'000'000; ++spins) {
      if (ibv_start_poll(cqx, nullptr) != 0) continue;
      do {
        ASSERT_EQ(cqx->status, IBV_WC_SUCCESS);
        ts.push_back(ibv_wc_read_completion_ts(cqx));
        wall.push_back(ibv_wc_read_completion_wallclock_ns(cqx));
        ++got;
      } while (ibv_next_poll(cqx) == 0);
      ibv_end_poll(cqx);
    }
    ASSERT_EQ(got, size_t{2 * kMsgs});
  }
  rt.comp_mask = IBV_VALUES_MASK_RAW_CLOCK;
  ASSERT_EQ(ibv_query_rt_values_ex(ctx_, &rt), 0);
  const uint64_t t1 =
      uint64_t(rt.raw_clock.tv_sec) * 1'000'000'000u + uint64_t(rt.raw_clock.tv_nsec);
  const uint64_t w1 = now_ns(CLOCK_REALTIME);
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_GE(ts[i], t0) << i;
    EXPECT_LE(ts[i], t1) << i;
    EXPECT_GE(wall[i], w0) << i;
    EXPECT_LE(wall[i], w1) << i;
  }
  // Only what was asked for is written: a CQ with the raw clock only reads wallclock 0.
  ibv_cq_ex* raw_only =
      make_cq_ex(uint64_t{IBV_WC_STANDARD_FLAGS} | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP);
  ASSERT_NE(raw_only, nullptr);
  auto [c, d] = connected_pair([&] { return make_qp(ibv_cq_ex_to_cq(raw_only)); });
  ASSERT_EQ(post_recv(d, 7, 4096, 64), 0);
  ASSERT_EQ(post(c, Wr{IBV_WR_SEND, {sge(128, 8)}, 0}), 0);
  int rc = ENOENT;
  for (int spins = 0; rc == ENOENT && spins < 5'000'000; ++spins)
    rc = ibv_start_poll(raw_only, nullptr);
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(raw_only->wr_id, 7u);
  EXPECT_GE(ibv_wc_read_completion_ts(raw_only), t1);
  EXPECT_EQ(ibv_wc_read_completion_wallclock_ns(raw_only), 0u);
  ibv_end_poll(raw_only);
}

TEST_F(VerbsEx, CqExRefusesWhatTheDeviceCannotDo) {
  const uint64_t unsupported[] = {IBV_WC_EX_WITH_CVLAN, IBV_WC_EX_WITH_FLOW_TAG,
                                  IBV_WC_EX_WITH_TM_INFO};
  for (uint64_t f : unsupported) {
    ibv_cq_init_attr_ex a{};
    a.cqe = 4;
    a.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | f;
    errno = 0;
    EXPECT_EQ(ibv_create_cq_ex(ctx_, &a), nullptr) << f;
    EXPECT_EQ(errno, EOPNOTSUPP) << f;
  }
  ibv_cq_init_attr_ex a{};
  a.cqe = 4;
  a.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
  a.flags = IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP) << "the backend drops on overrun, never overwrites";
  a.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
  a.parent_domain = pd_;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP) << "no parent domains";
  a.comp_mask = 1u << 7;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL) << "unknown comp_mask bit";
  // A single-threaded hint is fine.
  a = {};
  a.cqe = 4;
  a.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
  a.flags = IBV_CREATE_CQ_ATTR_SINGLE_THREADED;
  ibv_cq_ex* cq = ibv_create_cq_ex(ctx_, &a);
  ASSERT_NE(cq, nullptr);
  EXPECT_GE(cq->cqe, 4);
  EXPECT_EQ(ibv_destroy_cq(ibv_cq_ex_to_cq(cq)), 0);
}

TEST_F(VerbsEx, QpExBatchDeliversDataAndCompletions) {
  ibv_cq_ex* cqx = make_cq_ex();
  ASSERT_NE(cqx, nullptr);
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  ibv_qp* a = make_qp(cq, 64, kAllOps);
  ibv_qp* b = make_qp(cq);
  connect(a, b->qp_num);
  connect(b, a->qp_num);
  ibv_qp_ex* qx = ibv_qp_to_qp_ex(a);
  ASSERT_NE(qx, nullptr);
  EXPECT_EQ(&qx->qp_base, a);

  // Layout of buf_: [0, 4096) send source, [4096, 8192) receive, [8192, 12288) write source,
  // [16384, 20480) write target, 32768 the atomic counter, 32776 the fetched old value.
  for (int i = 0; i < 4096; ++i) {
    buf_[i] = static_cast<uint8_t>(i * 3);
    buf_[8192 + i] = static_cast<uint8_t>(i * 5 + 1);
  }
  const uint64_t counter0 = 1000;
  std::memcpy(buf_.data() + 32768, &counter0, 8);
  ASSERT_EQ(post_recv(b, 50, 4096, 4096), 0);

  ibv_wr_start(qx);
  qx->wr_id = 1;
  qx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send(qx);
  ibv_wr_set_sge(qx, mr_->lkey, addr(0), 4096);
  qx->wr_id = 2;
  ibv_wr_rdma_write(qx, mr_->rkey, addr(16384));
  ibv_wr_set_sge(qx, mr_->lkey, addr(8192), 4096);
  qx->wr_id = 3;
  ibv_wr_atomic_fetch_add(qx, mr_->rkey, addr(32768), 7);
  ibv_wr_set_sge(qx, mr_->lkey, addr(32776), 8);
  ASSERT_EQ(ibv_wr_complete(qx), 0);

  auto wcs = poll_ex(cqx, 4);
  ASSERT_EQ(wcs.size(), 4u);
  std::vector<uint64_t> send_ids;
  for (const ExWc& wc : wcs) {
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status) << " wr " << wc.wr_id;
    if (wc.opcode == IBV_WC_RECV) {
      EXPECT_EQ(wc.wr_id, 50u);
      EXPECT_EQ(wc.byte_len, 4096u);
      EXPECT_EQ(wc.qp_num, b->qp_num);
      EXPECT_EQ(wc.src_qp, a->qp_num);
      continue;
    }
    send_ids.push_back(wc.wr_id);
    EXPECT_EQ(wc.qp_num, a->qp_num);
    const ibv_wc_opcode want[] = {IBV_WC_SEND, IBV_WC_RDMA_WRITE, IBV_WC_FETCH_ADD};
    EXPECT_EQ(wc.opcode, want[wc.wr_id - 1]) << "wr " << wc.wr_id;
  }
  EXPECT_EQ(send_ids, (std::vector<uint64_t>{1, 2, 3})) << "in posting order";
  EXPECT_EQ(std::memcmp(buf_.data() + 4096, buf_.data(), 4096), 0);
  EXPECT_EQ(std::memcmp(buf_.data() + 16384, buf_.data() + 8192, 4096), 0);
  uint64_t counter, fetched;
  std::memcpy(&counter, buf_.data() + 32768, 8);
  std::memcpy(&fetched, buf_.data() + 32776, 8);
  EXPECT_EQ(counter, counter0 + 7);
  EXPECT_EQ(fetched, counter0);

  // The other builders, and wr_flags read per WR: only the signaled ones complete.
  const char msg[] = "inline!";
  ASSERT_EQ(post_recv(b, 60, 4096, 64), 0);
  ASSERT_EQ(post_recv(b, 61, 4096 + 64, 64), 0);
  std::memset(buf_.data() + 40960, 0, 4096);
  ibv_wr_start(qx);
  qx->wr_id = 10;
  qx->wr_flags = 0;  // unsignaled
  ibv_wr_send_imm(qx, htonl(0x1234));
  ibv_wr_set_inline_data(qx, const_cast<char*>(msg), sizeof(msg));
  qx->wr_id = 11;
  qx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_rdma_read(qx, mr_->rkey, addr(8192));
  ibv_wr_set_sge(qx, mr_->lkey, addr(40960), 100);
  qx->wr_id = 12;
  ibv_wr_atomic_cmp_swp(qx, mr_->rkey, addr(32768), counter0 + 7, 42);
  ibv_wr_set_sge(qx, mr_->lkey, addr(32776), 8);
  qx->wr_id = 13;
  ibv_wr_rdma_write_imm(qx, mr_->rkey, addr(20480), htonl(0x5678));
  const ibv_sge two[] = {{addr(0), 10, mr_->lkey}, {addr(100), 6, mr_->lkey}};
  ibv_wr_set_sge_list(qx, 2, two);
  ASSERT_EQ(ibv_wr_complete(qx), 0);
  wcs = poll_ex(cqx, 5);
  ASSERT_EQ(wcs.size(), 5u);
  send_ids.clear();
  for (const ExWc& wc : wcs) {
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status) << " wr " << wc.wr_id;
    if (wc.wr_id == 60) {
      EXPECT_EQ(wc.opcode, IBV_WC_RECV);
      EXPECT_EQ(wc.byte_len, sizeof(msg));
      EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
      EXPECT_EQ(wc.imm, 0x1234u);
    } else if (wc.wr_id == 61) {
      EXPECT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
      EXPECT_EQ(wc.byte_len, 16u);
      EXPECT_EQ(wc.imm, 0x5678u);
    } else {
      send_ids.push_back(wc.wr_id);
    }
  }
  EXPECT_EQ(send_ids, (std::vector<uint64_t>{11, 12, 13}));
  EXPECT_STREQ(reinterpret_cast<const char*>(buf_.data() + 4096), msg);
  EXPECT_EQ(std::memcmp(buf_.data() + 40960, buf_.data() + 8192, 100), 0);
  EXPECT_EQ(buf_[40960 + 100], 0);
  std::memcpy(&counter, buf_.data() + 32768, 8);
  std::memcpy(&fetched, buf_.data() + 32776, 8);
  EXPECT_EQ(counter, 42u);
  EXPECT_EQ(fetched, counter0 + 7);
  EXPECT_EQ(std::memcmp(buf_.data() + 20480, buf_.data(), 10), 0);
  EXPECT_EQ(std::memcmp(buf_.data() + 20490, buf_.data() + 100, 6), 0);
}

TEST_F(VerbsEx, WrAbortPostsNothing) {
  ibv_cq* cq = ibv_cq_ex_to_cq(make_cq_ex());
  ibv_qp* a = make_qp(cq, 16, IBV_QP_EX_WITH_SEND);
  ibv_qp* b = make_qp(cq);
  connect(a, b->qp_num);
  connect(b, a->qp_num);
  ASSERT_EQ(post_recv(b, 1, 0, 64), 0);
  ibv_qp_ex* qx = ibv_qp_to_qp_ex(a);
  ASSERT_NE(qx, nullptr);
  ibv_wr_start(qx);
  qx->wr_id = 99;
  qx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send(qx);
  ibv_wr_set_sge(qx, mr_->lkey, addr(128), 8);
  ibv_wr_abort(qx);
  EXPECT_TRUE(stays_empty(cq));
  // The slot the aborted WR used is free again and the QP still works.
  ibv_wr_start(qx);
  qx->wr_id = 7;
  ibv_wr_send(qx);
  ibv_wr_set_sge(qx, mr_->lkey, addr(128), 8);
  ASSERT_EQ(ibv_wr_complete(qx), 0);
  auto wcs = poll(cq, 2);
  ASSERT_EQ(wcs.size(), 2u);
  for (const ibv_wc& wc : wcs) EXPECT_TRUE(wc.wr_id == 7 || wc.wr_id == 1) << wc.wr_id;
}

TEST_F(VerbsEx, QpExBindsALocalInvalidatesAndSendsWithInvalidate) {
  constexpr uint64_t kOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_BIND_MW |
                            IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_SEND_WITH_INV;
  ibv_cq* cq = ibv_cq_ex_to_cq(make_cq_ex());
  ibv_qp* a = make_qp(cq, 16, kOps);
  ibv_qp* b = make_qp(cq, 16, kOps);
  vrdma::test::QpPath p;
  p.dlid = lid_;
  p.access = vrdma::test::kAllAccess | IBV_ACCESS_MW_BIND;
  p.dest_qpn = b->qp_num;
  ASSERT_EQ(vrdma::test::bring_to_rts(a, p), 0);
  p.dest_qpn = a->qp_num;
  ASSERT_EQ(vrdma::test::bring_to_rts(b, p), 0);
  rmr_ = ibv_reg_mr(pd_, buf_.data() + 65536, 65536,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_MW_BIND);
  ASSERT_NE(rmr_, nullptr) << std::strerror(errno);
  ibv_mw* mw = ibv_alloc_mw(pd_, IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr) << std::strerror(errno);
  ibv_qp_ex* qb = ibv_qp_to_qp_ex(b);
  ibv_qp_ex* qa = ibv_qp_to_qp_ex(a);
  // b binds the window (on b: its peer a may use it), then a invalidates it with a SEND.
  const ibv_mw_bind_info info{rmr_, addr(65536), 4096, IBV_ACCESS_REMOTE_WRITE};
  const uint32_t rkey = ibv_inc_rkey(mw->rkey);
  ibv_wr_start(qb);
  qb->wr_id = 1;
  qb->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_bind_mw(qb, mw, rkey, &info);
  ASSERT_EQ(ibv_wr_complete(qb), 0);
  auto wcs = poll(cq, 1);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(wcs[0].status);
  EXPECT_EQ(wcs[0].opcode, IBV_WC_BIND_MW);
  ASSERT_EQ(post_recv(b, 2, 0, 64), 0);
  ibv_wr_start(qa);
  qa->wr_id = 3;
  qa->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send_inv(qa, rkey);
  ibv_wr_set_sge(qa, mr_->lkey, addr(128), 8);
  ASSERT_EQ(ibv_wr_complete(qa), 0);
  wcs = poll(cq, 2);
  ASSERT_EQ(wcs.size(), 2u);
  for (const ibv_wc& wc : wcs) {
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc.wr_id << ": " << ibv_wc_status_str(wc.status);
    if (wc.wr_id != 2) continue;
    EXPECT_NE(wc.wc_flags & IBV_WC_WITH_INV, 0u);
    EXPECT_EQ(wc.invalidated_rkey, rkey);
  }
  // Invalidated already: b's LOCAL_INV of it fails (LOC_QP_OP_ERR).
  ibv_wr_start(qb);
  qb->wr_id = 4;
  qb->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_local_inv(qb, rkey);
  ASSERT_EQ(ibv_wr_complete(qb), 0);
  wcs = poll(cq, 1);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_LOC_QP_OP_ERR);
  EXPECT_EQ(wcs[0].opcode, IBV_WC_LOCAL_INV);
  EXPECT_EQ(ibv_dealloc_mw(mw), 0);
}

TEST_F(VerbsEx, BatchLargerThanTheQueueIsEnomemAndPostsNothing) {
  ibv_cq* cq = ibv_cq_ex_to_cq(make_cq_ex());
  ibv_qp* a = make_qp(cq, 8, IBV_QP_EX_WITH_SEND);
  ibv_qp* b = make_qp(cq, 64);
  connect(a, b->qp_num);
  connect(b, a->qp_num);
  ibv_qp_attr qa{};
  ibv_qp_init_attr qi{};
  ASSERT_EQ(ibv_query_qp(a, &qa, IBV_QP_CAP, &qi), 0);
  const uint32_t depth = qa.cap.max_send_wr;
  ASSERT_GE(depth, 8u);
  ASSERT_LT(depth, 64u);
  for (uint32_t i = 0; i <= depth; ++i) ASSERT_EQ(post_recv(b, 1000 + i, 0, 64), 0);
  ibv_qp_ex* qx = ibv_qp_to_qp_ex(a);
  ASSERT_NE(qx, nullptr);
  ibv_wr_start(qx);
  qx->wr_flags = IBV_SEND_SIGNALED;
  for (uint32_t i = 0; i <= depth; ++i) {
    qx->wr_id = i;
    ibv_wr_send(qx);
    ibv_wr_set_sge(qx, mr_->lkey, addr(128), 8);
  }
  EXPECT_EQ(ibv_wr_complete(qx), ENOMEM);
  EXPECT_TRUE(stays_empty(cq)) << "no WR of a failed batch is posted";
  // Other errors of a batch fail it the same way.
  ibv_wr_start(qx);
  ibv_wr_set_sge(qx, mr_->lkey, addr(128), 8);  // no WR opened yet
  EXPECT_EQ(ibv_wr_complete(qx), EINVAL);
  ibv_wr_start(qx);
  ibv_wr_send(qx);
  const ibv_sge many[3] = {
      {addr(0), 1, mr_->lkey}, {addr(8), 1, mr_->lkey}, {addr(16), 1, mr_->lkey}};
  ibv_wr_set_sge_list(qx, 3, many);  // the QP has 2 send SGEs
  EXPECT_EQ(ibv_wr_complete(qx), EINVAL);
  ibv_wr_start(qx);
  ibv_wr_send(qx);
  std::vector<char> big(4096, 'x');
  ibv_wr_set_inline_data(qx, big.data(), big.size());
  EXPECT_EQ(ibv_wr_complete(qx), EINVAL) << "more inline data than max_inline_data";
  EXPECT_TRUE(stays_empty(cq));
  // A full queue's worth still fits: the failed batches left nothing behind.
  ibv_wr_start(qx);
  for (uint32_t i = 0; i < depth; ++i) {
    qx->wr_id = 100 + i;
    ibv_wr_send(qx);
    ibv_wr_set_sge(qx, mr_->lkey, addr(128), 8);
  }
  ASSERT_EQ(ibv_wr_complete(qx), 0);
  auto wcs = poll(cq, 2 * depth);
  ASSERT_EQ(wcs.size(), 2u * depth);
  uint32_t sends = 0;
  for (const ibv_wc& wc : wcs) {
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
    if (wc.opcode == IBV_WC_SEND) {
      EXPECT_EQ(wc.wr_id, 100u + sends++);
    } else {
      EXPECT_LT(wc.wr_id - 1000, depth) << "the receives are the first ones posted";
    }
  }
  EXPECT_EQ(sends, depth);
}

TEST_F(VerbsEx, QpExRefusesWhatTheDeviceCannotDo) {
  ibv_cq* cq = ibv_cq_ex_to_cq(make_cq_ex());
  // A QP made without SEND_OPS_FLAGS has no ibv_qp_ex; neither has one from ibv_create_qp.
  ibv_qp* plain = make_qp(cq);
  errno = 0;
  EXPECT_EQ(ibv_qp_to_qp_ex(plain), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  ibv_qp_init_attr ia{};
  ia.send_cq = cq;
  ia.recv_cq = cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap = {4, 4, 1, 1, 0};
  ibv_qp* old = ibv_create_qp(pd_, &ia);
  ASSERT_NE(old, nullptr);
  qps_.push_back(old);
  EXPECT_EQ(ibv_qp_to_qp_ex(old), nullptr);

  auto refused = [&](ibv_qp_init_attr_ex a, int err, const char* what) {
    errno = 0;
    ibv_qp* qp = ibv_create_qp_ex(ctx_, &a);
    EXPECT_EQ(qp, nullptr) << what;
    if (qp) qps_.push_back(qp);
    EXPECT_EQ(errno, err) << what;
  };
  ibv_qp_init_attr_ex uc_inv = qp_attr(cq, 4, IBV_QP_EX_WITH_SEND_WITH_INV);
  uc_inv.qp_type = IBV_QPT_UC;
  refused(uc_inv, EOPNOTSUPP, "UC has no SEND_WITH_INV");
  refused(qp_attr(cq, 4, IBV_QP_EX_WITH_TSO), EOPNOTSUPP, "TSO");
  ibv_qp_init_attr_ex uc = qp_attr(cq, 4, IBV_QP_EX_WITH_RDMA_READ);
  uc.qp_type = IBV_QPT_UC;
  refused(uc, EOPNOTSUPP, "UC has no RDMA READ");
  ibv_qp_init_attr_ex nopd = qp_attr(cq, 4, IBV_QP_EX_WITH_SEND);
  nopd.comp_mask &= ~IBV_QP_INIT_ATTR_PD;
  refused(nopd, EINVAL, "no PD");
  ibv_qp_init_attr_ex xrcd = qp_attr(cq, 4, IBV_QP_EX_WITH_SEND);
  xrcd.comp_mask |= IBV_QP_INIT_ATTR_XRCD;
  refused(xrcd, EINVAL, "an XRC domain on an RC QP");

  // UC with what UC can do works; a batch on a QP that cannot send yet fails like post_send.
  uc.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE;
  ibv_qp* ucqp = ibv_create_qp_ex(ctx_, &uc);
  ASSERT_NE(ucqp, nullptr) << std::strerror(errno);
  qps_.push_back(ucqp);
  ibv_qp_ex* qx = ibv_qp_to_qp_ex(ucqp);
  ASSERT_NE(qx, nullptr);
  ibv_wr_start(qx);
  ibv_wr_send(qx);
  ibv_wr_set_sge(qx, mr_->lkey, addr(0), 8);
  EXPECT_EQ(ibv_wr_complete(qx), EINVAL) << "RESET QP";
}

TEST_F(VerbsEx, QpExUdSendsWithSetUdAddr) {
  ibv_cq_ex* cqx = make_cq_ex();
  ASSERT_NE(cqx, nullptr);
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  constexpr uint32_t kQkey = vrdma::test::kTestQkey;
  std::vector<ibv_qp*> ud;
  for (uint64_t ops : {uint64_t{IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM}, uint64_t{0}}) {
    ibv_qp_init_attr_ex a = qp_attr(cq, 16, ops);
    a.qp_type = IBV_QPT_UD;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    ibv_qp* qp = ibv_create_qp_ex(ctx_, &a);
    ASSERT_NE(qp, nullptr) << std::strerror(errno);
    qps_.push_back(qp);
    ud.push_back(qp);
    ASSERT_EQ(vrdma::test::bring_to_rts(qp, vrdma::test::QpPath{}), 0);
  }
  ibv_ah_attr aa{};
  aa.dlid = lid_;
  aa.port_num = 1;
  ibv_ah* ah = ibv_create_ah(pd_, &aa);
  ASSERT_NE(ah, nullptr) << std::strerror(errno);
  // A UD receive gets the 40-byte GRH area first.
  ASSERT_EQ(post_recv(ud[1], 5, 4096, 40 + 64), 0);
  std::memcpy(buf_.data(), "ud via qp_ex", 13);
  ibv_qp_ex* qx = ibv_qp_to_qp_ex(ud[0]);
  ASSERT_NE(qx, nullptr);
  ibv_wr_start(qx);
  qx->wr_id = 4;
  qx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send_imm(qx, htonl(77));
  ibv_wr_set_ud_addr(qx, ah, ud[1]->qp_num, kQkey);
  ibv_wr_set_sge(qx, mr_->lkey, addr(0), 13);
  ASSERT_EQ(ibv_wr_complete(qx), 0);
  auto wcs = poll_ex(cqx, 2);
  ASSERT_EQ(wcs.size(), 2u);
  for (const ExWc& wc : wcs) {
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    if (wc.wr_id == 5) {
      EXPECT_EQ(wc.opcode, IBV_WC_RECV);
      EXPECT_EQ(wc.byte_len, 40u + 13);
      EXPECT_EQ(wc.imm, 77u);
      EXPECT_EQ(wc.src_qp, ud[0]->qp_num);
      EXPECT_EQ(wc.qp_num, ud[1]->qp_num);
    } else {
      EXPECT_EQ(wc.wr_id, 4u);
      EXPECT_EQ(wc.opcode, IBV_WC_SEND);
    }
  }
  EXPECT_STREQ(reinterpret_cast<const char*>(buf_.data() + 4096 + 40), "ud via qp_ex");
  // UD has no RDMA: refused at creation.
  ibv_qp_init_attr_ex bad = qp_attr(cq, 4, IBV_QP_EX_WITH_RDMA_WRITE);
  bad.qp_type = IBV_QPT_UD;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &bad), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  for (ibv_qp* q : ud) EXPECT_EQ(ibv_destroy_qp(q), 0);
  qps_.clear();
  EXPECT_EQ(ibv_destroy_ah(ah), 0);
}

}  // namespace
