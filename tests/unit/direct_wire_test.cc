// The library-to-library wire checks (src/proto/direct_wire.h): what each side accepts from the
// other's library, field by field.
#include "proto/direct_wire.h"

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

namespace vrdma::proto::dwire {
namespace {

Frame request(uint8_t type, uint32_t len) {
  Frame f{};
  f.type = type;
  f.len = len;
  f.rkey = 0x1234;
  f.raddr = 0x1000;
  return f;
}

TEST(DirectWire, EveryKnownFrameOfAPeerPasses) {
  for (uint8_t t : {kSend, kSendImm, kWrite, kWriteImm, kRead, kCas, kFaa, kRewind, kSendInv, kAck,
                    kReadResp, kAtomicResp, kRnr, kResume})
    EXPECT_TRUE(check_frame(request(t, 8)).is_ok()) << int(t);
  Frame nak = request(kNak, 0);
  for (auto st : {IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_OP_ERR}) {
    nak.status = static_cast<uint8_t>(st);
    EXPECT_TRUE(check_frame(nak).is_ok()) << st;
  }
  Frame rnr = request(kRnr, 0);
  rnr.status = 31;  // the longest min_rnr_timer but 0
  EXPECT_TRUE(check_frame(rnr).is_ok());
  EXPECT_TRUE(check_frame(request(kRevoke, 0)).is_ok());
  Frame solicited = request(kSend, 1);
  solicited.flags = IBV_SEND_SOLICITED;
  EXPECT_TRUE(check_frame(solicited).is_ok());
}

TEST(DirectWire, EachMalformedFieldIsRefused) {
  for (uint8_t t : {0, 10, 15, 22, 255})
    EXPECT_EQ(check_frame(request(t, 0)).err(), EPROTO) << int(t);
  Frame f = request(kSend, 8);
  f.pad[15] = 1;
  EXPECT_EQ(check_frame(f).err(), EPROTO);
  f = request(kSend, 8);
  f.flags = IBV_SEND_INLINE;  // nothing but SOLICITED travels
  EXPECT_EQ(check_frame(f).err(), EPROTO);
  EXPECT_EQ(check_frame(request(kWrite, (1u << 31) + 1)).err(), EPROTO);
  f = request(kNak, 0);
  f.status = IBV_WC_SUCCESS;  // a NAK that would complete the WR as if it worked
  EXPECT_EQ(check_frame(f).err(), EPROTO);
  f.status = IBV_WC_WR_FLUSH_ERR;
  EXPECT_EQ(check_frame(f).err(), EPROTO);
  f = request(kRnr, 0);
  f.status = 32;  // min_rnr_timer has 5 bits
  EXPECT_EQ(check_frame(f).err(), EPROTO);
  EXPECT_EQ(check_frame(request(kRevoke, 8)).err(), EPROTO);  // it carries nothing
}

TEST(DirectWire, HelloAndItsAnswerAreChecked) {
  Hello h{kDirectMagic, kDirectVersion, 0x11, 0x12, 3, kTakesRequests};
  EXPECT_TRUE(check_hello(h).is_ok());
  Hello bad = h;
  bad.version = 4;  // no kRevoke
  EXPECT_EQ(check_hello(bad).err(), EPROTONOSUPPORT);
  bad = h;
  bad.magic = 0x4d445256;  // the control protocol's magic
  EXPECT_EQ(check_hello(bad).err(), EPROTONOSUPPORT);
  bad = h;
  bad.to_qpn = 0x1000000;
  EXPECT_EQ(check_hello(bad).err(), EPROTO);
  bad = h;
  bad.flags = 2;
  EXPECT_EQ(check_hello(bad).err(), EPROTO);
  EXPECT_TRUE(check_hello_ack({kDirectMagic, 0, 3, 0}).is_ok());
  EXPECT_TRUE(check_hello_ack({kDirectMagic, EPERM, 0, 0}).is_ok());
  EXPECT_EQ(check_hello_ack({kDirectMagic, -1, 0, 0}).err(), EPROTO);
  EXPECT_EQ(check_hello_ack({0, 0, 3, 0}).err(), EPROTO);
  EXPECT_EQ(check_hello_ack({kDirectMagic, 0, 0x10000, 0}).err(), EPROTO);
}

}  // namespace
}  // namespace vrdma::proto::dwire
