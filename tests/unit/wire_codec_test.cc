// The backend-to-backend wire codec (proto/wire.h): valid frames round-trip; every malformed
// header, body or length is refused with an error; random and mutated input never crashes and
// never decodes into something that breaks the codec's promises (it faces the network).
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/socket.h>

#include <cstring>
#include <random>

#include "proto/wire.h"

namespace vrdma::proto::wire {
namespace {

using Bytes = std::vector<uint8_t>;

Status decode_bytes(const Bytes& m, Frame& f) {
  if (m.size() < sizeof(FrameHeader)) return error(EPROTO, "short");
  FrameHeader h;
  std::memcpy(&h, m.data(), sizeof(h));
  RETURN_IF_ERROR(check_header(h));
  if (m.size() - sizeof(h) < h.body) return error(EPROTO, "short body");
  return decode(h, {m.data() + sizeof(h), h.body}, f);
}

Request send_req(uint32_t len) {
  Request r{};
  r.qp_type = IBV_QPT_RC;
  r.opcode = IBV_WR_SEND;
  r.src_qpn = 0x11;
  r.dst_qpn = 0x12;
  r.psn = 0xabcdef;
  r.length = len;
  return r;
}

DirectOffer offer() {
  DirectOffer o{};
  o.slid = 0x21;
  o.dlid = 0x42;
  o.port = 40000;
  o.src_qpn = 0xabcdef;
  o.dst_qpn = 0x11;
  for (uint8_t i = 0; i < 16; ++i) o.token[i] = static_cast<uint8_t>(0xa0 + i);
  return o;
}

Cm cm_req() {
  Cm m{};
  m.kind = static_cast<uint8_t>(CmKind::kReq);
  m.qp_type = IBV_QPT_RC;
  m.ps = kCmPsTcp;
  m.src_id = 5;
  m.src.family = AF_INET;
  m.dst.family = AF_INET;
  m.dst.port = 7174;
  m.qp.qpn = 0x12;
  m.qp.psn = 0xabcdef;
  m.private_len = 56;
  return m;
}

TEST(WireCodec, SizesArePinned) {
  EXPECT_EQ(sizeof(FrameHeader), 16u);
  EXPECT_EQ(body_size(Type::kHello), 72u);
  EXPECT_EQ(body_size(Type::kGuestUp), 88u);
  EXPECT_EQ(body_size(Type::kRequest), 104u);
  EXPECT_EQ(body_size(Type::kReply), 48u);
  EXPECT_EQ(body_size(Type::kDirectOffer), 64u);
  EXPECT_EQ(body_size(Type::kCm), 336u);
  EXPECT_EQ(body_size(Type::kClose), 8u);
  EXPECT_EQ(body_size(Type::kMax), 0u);
}

TEST(WireCodec, RoundTrips) {
  Bytes m;
  Hello h{};
  ASSERT_TRUE(put_name(h.node, "host-a"));
  h.wire_version = kWireVersion;
  encode(Type::kHello, &h, 0, m);
  Frame f;
  ASSERT_TRUE(decode_bytes(m, f).is_ok());
  EXPECT_EQ(f.type(), Type::kHello);
  EXPECT_EQ(get_name(f.hello.node), "host-a");

  m.clear();
  Request r = send_req(5000);
  encode(Type::kRequest, &r, 5000, m);
  ASSERT_TRUE(decode_bytes(m, f).is_ok());
  EXPECT_EQ(f.req.psn, 0xabcdefu);
  EXPECT_EQ(f.h.payload, 5000u);

  m.clear();
  GuestEntry g{};
  put_name(g.name, "tenant");
  g.lid = 0x1234;
  encode(Type::kGuestUp, &g, 0, m);
  ASSERT_TRUE(decode_bytes(m, f).is_ok());
  EXPECT_EQ(f.guest.lid, 0x1234);

  m.clear();
  DirectOffer o = offer();
  o.is_global = 1;
  o.dgid[15] = 9;
  encode(Type::kDirectOffer, &o, 0, m);
  ASSERT_EQ(m.size(), sizeof(FrameHeader) + 64);
  ASSERT_TRUE(decode_bytes(m, f).is_ok());
  EXPECT_EQ(f.type(), Type::kDirectOffer);
  EXPECT_EQ(f.offer.slid, 0x21);
  EXPECT_EQ(f.offer.dlid, 0x42);
  EXPECT_EQ(f.offer.is_global, 1);
  EXPECT_EQ(f.offer.dgid[15], 9);
  EXPECT_EQ(f.offer.port, 40000);
  EXPECT_EQ(f.offer.src_qpn, 0xabcdefu);
  EXPECT_EQ(f.offer.dst_qpn, 0x11u);
  EXPECT_EQ(std::memcmp(f.offer.token, o.token, sizeof(o.token)), 0);
}

/// decode's error for body `b` of type `t` changed by `mutate`, with `payload` bytes announced.
template <typename Body, typename Mutate>
int mutated_err(Type t, Body b, Mutate mutate, uint32_t payload) {
  mutate(b);
  Bytes m;
  encode(t, &b, payload, m);
  Frame f;
  return decode_bytes(m, f).err();
}

// kClose (version 7): ask, accept, refuse; any other kind, or a payload, is refused.
TEST(WireCodec, CloseKinds) {
  auto err = [](uint8_t kind, uint32_t payload = 0) {
    Close c{};
    c.kind = kind;
    return mutated_err(
        Type::kClose, c, [](Close&) {}, payload);
  };
  for (CloseKind k : {CloseKind::kAsk, CloseKind::kAccept, CloseKind::kRefuse})
    EXPECT_EQ(err(static_cast<uint8_t>(k)), 0);
  EXPECT_EQ(err(3), EPROTO);
  EXPECT_NE(err(0, 8), 0);
}

TEST(WireCodec, RefusesMalformedDirectOffer) {
  auto err = [](auto mutate, uint32_t payload = 0) {
    return mutated_err(Type::kDirectOffer, offer(), mutate, payload);
  };
  EXPECT_EQ(err([](DirectOffer&) {}), 0);
  EXPECT_EQ(err([](DirectOffer& o) { o.is_global = 2; }), EPROTO);
  EXPECT_EQ(err([](DirectOffer& o) { o.src_qpn = 1u << 24; }), EPROTO);
  EXPECT_EQ(err([](DirectOffer& o) { o.dst_qpn = 1u << 24; }), EPROTO);
  EXPECT_EQ(err([](DirectOffer& o) { o.port = 0; }), EPROTO);
  EXPECT_EQ(err([](DirectOffer&) {}, 8), EPROTO);  // no payload on an offer
}

TEST(WireCodec, CmRoundTrips) {
  Cm m = cm_req();
  std::memset(m.private_data, 0x5a, m.private_len);
  Bytes b;
  encode(Type::kCm, &m, 0, b);
  Frame f;
  ASSERT_TRUE(decode_bytes(b, f).is_ok());
  EXPECT_EQ(f.type(), Type::kCm);
  EXPECT_EQ(std::memcmp(&f.cm, &m, sizeof(m)), 0);
}

// What a hostile peer backend may forward: every field a guest's command could not set.
TEST(WireCodec, RefusesMalformedCm) {
  auto err = [](auto mutate, uint32_t payload = 0) {
    return mutated_err(Type::kCm, cm_req(), mutate, payload);
  };
  auto as = [](CmKind k) { return static_cast<uint8_t>(k); };
  EXPECT_EQ(err([](Cm&) {}), 0);
  EXPECT_EQ(err([](Cm&) {}, 4), EPROTO);  // everything is in the body
  EXPECT_EQ(err([](Cm& m) { m.kind = 0; }), EPROTO);
  EXPECT_EQ(err([&](Cm& m) { m.kind = as(CmKind::kMax); }), EPROTO);
  // A move names both ids and the node it left (a node name, at most 63 bytes).
  auto moved = [&](uint32_t dst, uint32_t len) {
    return [=](Cm& m) { m.kind = as(CmKind::kMoved), m.dst_id = dst, m.private_len = len; };
  };
  EXPECT_EQ(err(moved(3, 2)), 0);
  EXPECT_EQ(err(moved(0, 2)), EPROTO);
  EXPECT_EQ(err(moved(3, 0)), EPROTO);
  EXPECT_EQ(err(moved(3, 64)), EPROTO);
  EXPECT_EQ(err([](Cm& m) { m.src_id = 0; }), EPROTO);
  EXPECT_EQ(err([](Cm& m) { m.dst_id = 3; }), EPROTO);  // a REQ names no id of the receiver
  EXPECT_EQ(err([&](Cm& m) { m.kind = as(CmKind::kRep); }), EPROTO);  // ... every other does
  EXPECT_EQ(err([](Cm& m) { m.private_len = 57; }), EPROTO);          // an IP port space's REQ: 56
  EXPECT_EQ(err([](Cm& m) { m.ps = kCmPsIb, m.private_len = 92; }), 0);
  EXPECT_EQ(err([](Cm& m) { m.private_len = 0xffffffff; }), EPROTO);
  EXPECT_EQ(err([](Cm& m) { m.ps = 0x4242; }), EPROTO);
  EXPECT_EQ(err([](Cm& m) { m.qp_type = 9; }), EPROTO);
  EXPECT_EQ(err([](Cm& m) { m.dst.family = 1; }), EPROTO);
  EXPECT_EQ(err([](Cm& m) { m.dst.port = 0; }), EPROTO);
  EXPECT_EQ(err([](Cm& m) { m.qp.qpn = 1u << 24; }), EPROTO);
  EXPECT_EQ(err([](Cm& m) { m.qp.psn = 1u << 24; }), EPROTO);
  EXPECT_EQ(err([](Cm& m) { m.status = 28; }), EPROTO);  // a status outside a REJ
  auto rej = [&](int32_t reason, uint32_t len) {
    return err([&](Cm& m) {
      m.kind = as(CmKind::kRej);
      m.dst_id = 9;
      m.status = reason;
      m.private_len = len;
    });
  };
  EXPECT_EQ(rej(kCmRejConsumer, 148), 0);
  EXPECT_EQ(rej(kCmRejConsumer, 149), EPROTO);
  EXPECT_EQ(rej(12345, 0), EPROTO);
  auto other = [&](CmKind k, uint32_t len) {
    return err([&](Cm& m) {
      m.kind = as(k);
      m.dst_id = 9;
      m.private_len = len;
    });
  };
  EXPECT_EQ(other(CmKind::kRep, 196), 0);
  EXPECT_EQ(other(CmKind::kRep, 197), EPROTO);
  EXPECT_EQ(other(CmKind::kSidrRep, 137), EPROTO);
  EXPECT_EQ(other(CmKind::kRtu, 0), 0);
  EXPECT_EQ(other(CmKind::kDreq, 1), EPROTO);
  EXPECT_EQ(other(CmKind::kGone, 1), EPROTO);
  // Address resolution: a query names no id, its answer one; both an IP address, nothing else.
  auto addr = [&](CmKind k, uint32_t dst_id, uint16_t family, uint32_t len) {
    return err([&](Cm& m) {
      m.kind = as(k);
      m.dst_id = dst_id;
      m.dst.family = family;
      m.private_len = len;
    });
  };
  EXPECT_EQ(addr(CmKind::kAddrQuery, 0, AF_INET6, 0), 0);
  EXPECT_EQ(addr(CmKind::kAddrQuery, 9, AF_INET6, 0), EPROTO);
  EXPECT_EQ(addr(CmKind::kAddrReply, 9, AF_INET, 0), 0);
  EXPECT_EQ(addr(CmKind::kAddrReply, 0, AF_INET, 0), EPROTO);
  EXPECT_EQ(addr(CmKind::kAddrReply, 9, 1, 0), EPROTO);
  EXPECT_EQ(addr(CmKind::kAddrQuery, 0, AF_INET, 1), EPROTO);
}

TEST(WireCodec, RefusesMalformed) {
  Frame f;
  auto bad = [&](auto mutate, int err = EPROTO) {
    Request r = send_req(100);
    mutate(r);
    Bytes m;
    encode(Type::kRequest, &r, r.opcode == IBV_WR_RDMA_READ ? 0 : 100, m);
    return decode_bytes(m, f).err() == err;
  };
  EXPECT_TRUE(bad([](Request& r) { r.opcode = 99; }));
  EXPECT_TRUE(bad([](Request& r) { r.qp_type = 7; }));
  EXPECT_TRUE(bad([](Request& r) { r.psn = 1u << 24; }));
  EXPECT_TRUE(bad([](Request& r) { r.dst_qpn = 1u << 24; }));
  EXPECT_TRUE(bad([](Request& r) { r.is_global = 2; }));
  EXPECT_TRUE(bad([](Request& r) { r.length = 99; }));  // payload != length
  EXPECT_TRUE(bad([](Request& r) { r.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD; }));  // payload, len
  EXPECT_TRUE(bad([](Request& r) {
    r.qp_type = IBV_QPT_UC;
    r.opcode = IBV_WR_RDMA_READ;
  }));
  EXPECT_TRUE(bad([](Request& r) {
    r.qp_type = IBV_QPT_UD;
    r.opcode = IBV_WR_RDMA_WRITE;
  }));

  // Header: magic, version, type, body size, payload on a type without data.
  Bytes m;
  Hello h{};
  put_name(h.node, "n");
  h.wire_version = kWireVersion;
  encode(Type::kHello, &h, 0, m);
  auto hdr_bad = [&](auto mutate, int err = EPROTO) {
    Bytes c = m;
    FrameHeader fh;
    std::memcpy(&fh, c.data(), sizeof(fh));
    mutate(fh);
    std::memcpy(c.data(), &fh, sizeof(fh));
    return decode_bytes(c, f).err() == err;
  };
  EXPECT_TRUE(hdr_bad([](FrameHeader& x) { x.magic ^= 1; }));
  EXPECT_TRUE(hdr_bad([](FrameHeader& x) { x.version = kWireVersion + 1; }, EPROTONOSUPPORT));
  EXPECT_TRUE(hdr_bad([](FrameHeader& x) { x.version = 1; }, EPROTONOSUPPORT));  // before offers
  EXPECT_TRUE(hdr_bad([](FrameHeader& x) { x.type = 0; }));
  EXPECT_TRUE(hdr_bad([](FrameHeader& x) { x.type = static_cast<uint16_t>(Type::kMax); }));
  EXPECT_TRUE(hdr_bad([](FrameHeader& x) { x.body = 71; }));
  EXPECT_TRUE(hdr_bad([](FrameHeader& x) { x.payload = 1; }));
  // Names must be NUL-terminated printable ASCII.
  Hello h2{};
  std::memset(h2.node, 'x', sizeof(h2.node));
  h2.wire_version = kWireVersion;
  Bytes m2;
  encode(Type::kHello, &h2, 0, m2);
  EXPECT_EQ(decode_bytes(m2, f).err(), EPROTO);
  GuestEntry g{};
  put_name(g.name, "g");
  g.lid = 0xc000;  // multicast range: not a guest's LID
  Bytes m3;
  encode(Type::kGuestUp, &g, 0, m3);
  EXPECT_EQ(decode_bytes(m3, f).err(), EPROTO);
  Reply rp{};
  rp.syndrome = static_cast<uint8_t>(Syndrome::kErrNak);
  rp.status = IBV_WC_SUCCESS;  // a NAK must carry a remote error status
  Bytes m4;
  encode(Type::kReply, &rp, 0, m4);
  EXPECT_EQ(decode_bytes(m4, f).err(), EPROTO);
  rp.status = IBV_WC_REM_ACCESS_ERR;
  m4.clear();
  encode(Type::kReply, &rp, 0, m4);
  EXPECT_TRUE(decode_bytes(m4, f).is_ok());
}

TEST(WireCodec, PsnArithmeticWraps) {
  EXPECT_EQ(psn_diff(0, 0xffffff), 1);
  EXPECT_EQ(psn_diff(0xffffff, 0), -1);
  EXPECT_EQ(psn_diff(5, 3), 2);
  EXPECT_EQ(psn_add(0xffffff, 1), 0u);
}

// What a successful decode promises.
void expect_valid(const Frame& f) {
  EXPECT_EQ(f.h.magic, kWireMagic);
  EXPECT_EQ(f.h.version, kWireVersion);
  ASSERT_GT(f.h.type, 0);
  ASSERT_LT(f.h.type, static_cast<uint16_t>(Type::kMax));
  EXPECT_EQ(f.h.body, body_size(f.type()));
  EXPECT_LE(f.h.payload, kMaxPayload);
  if (f.type() == Type::kRequest) {
    EXPECT_LE(f.req.psn, 0xffffffu);
    if (f.req.qp_type == IBV_QPT_UD) {
      EXPECT_LE(f.req.length, kMaxUdPayload);
    }
  }
  if (f.type() == Type::kHello) {
    EXPECT_FALSE(get_name(f.hello.node).empty());
  }
  if (f.type() == Type::kDirectOffer) {
    EXPECT_EQ(f.h.payload, 0u);
    EXPECT_LE(f.offer.is_global, 1);
    EXPECT_LE(f.offer.src_qpn, 0xffffffu);
    EXPECT_LE(f.offer.dst_qpn, 0xffffffu);
    EXPECT_NE(f.offer.port, 0);
  }
  if (f.type() == Type::kCm) {
    EXPECT_EQ(f.h.payload, 0u);
    EXPECT_LE(f.cm.private_len, kCmPrivateMax);
    EXPECT_NE(f.cm.src_id, 0u);
  }
}

TEST(WireCodec, MutatedFramesNeverCrash) {
  std::mt19937_64 rng(7);
  std::vector<Bytes> seeds(6);
  Hello h{};
  put_name(h.node, "node");
  h.wire_version = kWireVersion;
  encode(Type::kHello, &h, 0, seeds[0]);
  GuestEntry g{};
  put_name(g.name, "guest");
  g.lid = 7;
  encode(Type::kGuestUp, &g, 0, seeds[1]);
  Request r = send_req(64);
  encode(Type::kRequest, &r, 64, seeds[2]);
  Reply rp{};
  encode(Type::kReply, &rp, 0, seeds[3]);
  const DirectOffer o = offer();
  encode(Type::kDirectOffer, &o, 0, seeds[4]);
  const Cm c = cm_req();
  encode(Type::kCm, &c, 0, seeds[5]);
  int ok = 0, bad = 0;
  for (int i = 0; i < 200000; ++i) {
    Bytes m = seeds[rng() % seeds.size()];
    for (int e = 1 + static_cast<int>(rng() % 3); e; --e) {
      switch (rng() % 4) {
        case 0:
          m[rng() % m.size()] ^= uint8_t(1u << (rng() % 8));
          break;
        case 1:
          m[rng() % m.size()] = uint8_t(rng());
          break;
        case 2:
          m.resize(1 + rng() % m.size());
          break;
        case 3:
          m.resize(m.size() + rng() % 32, uint8_t(rng()));
          break;
      }
    }
    Frame f;
    if (decode_bytes(m, f).is_ok()) {
      ++ok;
      expect_valid(f);
    } else {
      ++bad;
    }
  }
  EXPECT_GT(ok, 1000);
  EXPECT_GT(bad, 1000);
}

}  // namespace
}  // namespace vrdma::proto::wire
