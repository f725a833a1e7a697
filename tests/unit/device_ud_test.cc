// UD in the device model: datagrams reach the QP their address names (by LID or GID), carry the
// 40-byte GRH room, check the qkey, and are lost (never duplicated or misdelivered) when there
// is no receive, a wrong qkey, or no such QP. Multicast: a datagram to a group reaches every
// attached QP of the backend (device_mcast.cc).
#include <arpa/inet.h>

#include "device_fixture.h"

namespace vrdma::engine::devtest {
namespace {

class DeviceUdTest : public DeviceTest {
 protected:
  void post_ud(QpV& q, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey,
               const UdDest& d, uint32_t qpn, uint32_t qkey, uint32_t op = IBV_WR_SEND) {
    SendWqe w{};
    w.wr_id = wr_id;
    w.opcode = op;
    w.send_flags = IBV_SEND_SIGNALED;
    w.imm_data = htonl(0x1234);
    w.num_sge = 1;
    w.sge[0] = Sge{addr, len, lkey};
    pack_ud_dest(w, d);
    w.ud_remote_qpn = qpn;
    w.ud_remote_qkey = qkey;
    q.sqe[q.sq_prod & (q.sq_size - 1)] = w;
    q.sq->producer.store(++q.sq_prod, std::memory_order_release);
  }
  UdDest to_lid(const G& g) {
    UdDest d{};
    d.dlid = static_cast<uint16_t>(g.hello.lid);
    return d;
  }
};

TEST_F(DeviceUdTest, DatagramByLidLandsAfterTheGrhRoom) {
  QpV ua = ud_qp(a_, acq_, 0x11), ub = ud_qp(b_, bcq_, 0x11);
  std::memset(ma_.p(), 'x', 100);
  std::memset(mb_.p(), 0, 4096);
  post_recv(ub, 1, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, 2, ma_.addr, 100, ma_.mr.lkey, to_lid(b_), ub.qpn, 0x11, IBV_WR_SEND_WITH_IMM);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].byte_len, 140u) << "byte_len counts the 40 GRH bytes";
  EXPECT_EQ(rx[0].src_qp, ua.qpn);
  EXPECT_EQ(rx[0].slid, a_.hello.lid);
  EXPECT_EQ(rx[0].wc_flags & IBV_WC_GRH, 0u);
  EXPECT_TRUE(rx[0].wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(mb_.p()[39], 0) << "no GRH written without one";
  EXPECT_EQ(mb_.p()[40], 'x');
  EXPECT_EQ(mb_.p()[139], 'x');
  EXPECT_EQ(mb_.p()[140], 0);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
}

TEST_F(DeviceUdTest, DatagramByGidCarriesAGrh) {
  QpV ua = ud_qp(a_, acq_, 7), ub = ud_qp(b_, bcq_, 7);
  post_recv(ub, 1, mb_.addr, 1024, mb_.mr.lkey);
  UdDest d{};
  d.is_global = 1;
  std::memcpy(d.dgid, b_.hello.gid, 16);
  post_ud(ua, 2, ma_.addr, 8, ma_.mr.lkey, d, ub.qpn, 7);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_TRUE(rx[0].wc_flags & IBV_WC_GRH);
  EXPECT_EQ(mb_.p()[0] >> 4, 6) << "IP version 6";
  EXPECT_EQ(std::memcmp(mb_.p() + 8, a_.hello.gid, 16), 0) << "source GID";
  EXPECT_EQ(std::memcmp(mb_.p() + 24, b_.hello.gid, 16), 0) << "destination GID";
}

TEST_F(DeviceUdTest, WrongQkeyNoReceiveOrNoQpLosesTheDatagramOnly) {
  QpV ua = ud_qp(a_, acq_, 5), ub = ud_qp(b_, bcq_, 5);
  post_ud(ua, 1, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 5);  // no receive posted
  dev_.poll(now_);
  post_recv(ub, 9, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, 2, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 6);       // wrong qkey
  post_ud(ua, 3, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn + 99, 5);  // no such QP
  dev_.poll(now_);
  EXPECT_TRUE(drain(bcq_).empty());
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 3u);
  for (const Cqe& c : tx) EXPECT_EQ(c.status, IBV_WC_SUCCESS) << "UD senders are not told";
  // The receive is still there for the next good datagram; the qkey's high bit means "mine".
  post_ud(ua, 4, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 0x80000000u);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 9u);
}

TEST_F(DeviceUdTest, ReceiveTooSmallForGrhAndPayloadIsALengthError) {
  QpV ua = ud_qp(a_, acq_, 1), ub = ud_qp(b_, bcq_, 1);
  post_recv(ub, 1, mb_.addr, 60, mb_.mr.lkey);
  post_ud(ua, 2, ma_.addr, 30, ma_.mr.lkey, to_lid(b_), ub.qpn, 1);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_LEN_ERR);
}

TEST_F(DeviceUdTest, MessageLongerThanTheMtuFailsLocally) {
  QpV ua = ud_qp(a_, acq_, 1), ub = ud_qp(b_, bcq_, 1);
  post_recv(ub, 1, mb_.addr, 8192, mb_.mr.lkey);
  post_ud(ua, 2, ma_.addr, 4097, ma_.mr.lkey, to_lid(b_), ub.qpn, 1);
  dev_.poll(now_);
  EXPECT_TRUE(drain(bcq_).empty());
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_LEN_ERR);
}

TEST_F(DeviceUdTest, UdCannotRdmaWrite) {
  QpV ua = ud_qp(a_, acq_, 1), ub = ud_qp(b_, bcq_, 1);
  post_ud(ua, 2, ma_.addr, 8, ma_.mr.lkey, to_lid(b_), ub.qpn, 1, IBV_WR_RDMA_WRITE);
  dev_.poll(now_);
  auto tx = drain(acq_);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_QP_OP_ERR);
}

TEST_F(DeviceUdTest, MulticastReachesEveryAttachedQpAndNoOther) {
  QpV ua = ud_qp(a_, acq_, 9), ub = ud_qp(b_, bcq_, 9), ub2 = ud_qp(b_, bcq_, 9);
  McastReq m{ub.handle, 0xc001, 0, {0xff, 0x12, 0x40, 0x1b}};
  m.gid[15] = 3;
  ASSERT_TRUE(dev_.attach_mcast(*b_.s, m).is_ok());
  ASSERT_TRUE(dev_.attach_mcast(*b_.s, m).is_ok());  // again: no second delivery
  // Not UD, not a multicast GID, no QP of the session: refused.
  QpV rc = create_qp(b_, qp_req(b_, bcq_, bcq_, IBV_QPT_RC));
  EXPECT_EQ(dev_.attach_mcast(*b_.s, McastReq{rc.handle, 0xc001, 0, {0xff}}).err(), EINVAL);
  EXPECT_EQ(dev_.attach_mcast(*b_.s, McastReq{ub2.handle, 0xc001, 0, {0xfe}}).err(), EINVAL);
  EXPECT_EQ(dev_.attach_mcast(*a_.s, McastReq{0x7777, 0xc001, 0, {0xff}}).err(), EINVAL);
  post_recv(ub, 1, mb_.addr, 1024, mb_.mr.lkey);
  post_recv(ub2, 2, mb_.addr + 1024, 1024, mb_.mr.lkey);
  UdDest d{};
  d.is_global = 1;
  std::memcpy(d.dgid, m.gid, 16);
  post_ud(ua, 3, ma_.addr, 8, ma_.mr.lkey, d, 0xffffff, 9);
  dev_.poll(now_);
  auto rx = drain(bcq_);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].wr_id, 1u);
  EXPECT_TRUE(rx[0].wc_flags & IBV_WC_GRH);
  EXPECT_EQ(drain(acq_).size(), 1u);
  // By its LID too; after a detach, nobody.
  d = {};
  d.dlid = 0xc001;
  post_recv(ub, 4, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, 5, ma_.addr, 8, ma_.mr.lkey, d, 0xffffff, 9);
  dev_.poll(now_);
  EXPECT_EQ(drain(bcq_).size(), 1u);
  ASSERT_TRUE(dev_.detach_mcast(*b_.s, m).is_ok());
  EXPECT_EQ(dev_.detach_mcast(*b_.s, m).err(), EINVAL);
  post_recv(ub, 7, mb_.addr, 1024, mb_.mr.lkey);
  post_ud(ua, 6, ma_.addr, 8, ma_.mr.lkey, d, 0xffffff, 9);
  dev_.poll(now_);
  EXPECT_TRUE(drain(bcq_).empty());
  EXPECT_EQ(drain(acq_).size(), 2u);  // sent, whatever happens
}

}  // namespace
}  // namespace vrdma::engine::devtest
