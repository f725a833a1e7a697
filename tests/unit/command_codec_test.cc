// Control-protocol codec: every opcode round-trips through encode/decode_request/body_of, and
// every malformed message (short, bad magic/version/opcode/length, oversized, random) is an error.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "proto/command.h"

namespace vrdma::proto {
namespace {

using Bytes = std::vector<uint8_t>;

template <typename T>
T random_body(std::mt19937_64& rng) {
  T t;
  if constexpr (!std::is_empty_v<T>) {
    uint8_t raw[sizeof(T)];
    for (auto& b : raw) b = static_cast<uint8_t>(rng());
    std::memcpy(&t, raw, sizeof(T));
  }
  return t;
}

MsgHeader header_of(const Bytes& m) {
  MsgHeader h;
  std::memcpy(&h, m.data(), sizeof(h));
  return h;
}
void set_header(Bytes& m, const MsgHeader& h) { std::memcpy(m.data(), &h, sizeof(h)); }
void fix_length(Bytes& m) {
  MsgHeader h = header_of(m);
  h.length = static_cast<uint32_t>(m.size());
  set_header(m, h);
}

template <typename Body>
void round_trip(Op op, std::mt19937_64& rng) {
  SCOPED_TRACE(static_cast<int>(op));
  const Body body = random_body<Body>(rng);
  const uint32_t seq = static_cast<uint32_t>(rng());
  Bytes m = encode(op, seq, 0, body);
  ASSERT_EQ(m.size(), sizeof(MsgHeader) + request_body_size(op));
  auto h = decode_request(m);
  ASSERT_TRUE(h.is_ok()) << h.status().message();
  EXPECT_EQ(h->magic, kMagic);
  EXPECT_EQ(h->version, kVersion);
  EXPECT_EQ(h->op, static_cast<uint16_t>(op));
  EXPECT_EQ(h->length, m.size());
  EXPECT_EQ(h->seq, seq);
  EXPECT_EQ(h->status, 0);
  if constexpr (!std::is_empty_v<Body>) {
    auto b = body_of<Body>(m);
    ASSERT_TRUE(b.is_ok());
    EXPECT_EQ(std::memcmp(&b.value(), &body, sizeof(Body)), 0);
  }
  // One byte short and one byte long, with the header's length kept consistent.
  Bytes shorter(m.begin(), m.end() - 1), longer = m;
  longer.push_back(0);
  if (shorter.size() >= sizeof(MsgHeader)) {
    fix_length(shorter);
    EXPECT_TRUE(decode_header(shorter).is_ok());
    EXPECT_EQ(decode_request(shorter).err(), EPROTO);
  }
  fix_length(longer);
  EXPECT_TRUE(decode_header(longer).is_ok());
  EXPECT_EQ(decode_request(longer).err(), EPROTO);
  if constexpr (!std::is_empty_v<Body>) {
    EXPECT_EQ(body_of<Body>(shorter).err(), EPROTO);
    EXPECT_EQ(body_of<Body>(longer).err(), EPROTO);
  }
}

TEST(CommandCodec, EveryOpcodeRoundTrips) {
  std::mt19937_64 rng(1);
  round_trip<HelloReq>(Op::kHello, rng);
  round_trip<Empty>(Op::kAllocPd, rng);
  round_trip<HandleReq>(Op::kDeallocPd, rng);
  round_trip<RegSegmentReq>(Op::kRegSegment, rng);
  round_trip<RegMrReq>(Op::kRegMr, rng);
  round_trip<HandleReq>(Op::kDeregMr, rng);
  round_trip<HandleReq>(Op::kDeregSegment, rng);
  round_trip<Empty>(Op::kCreateChannel, rng);
  round_trip<HandleReq>(Op::kDestroyChannel, rng);
  round_trip<CreateCqReq>(Op::kCreateCq, rng);
  round_trip<HandleReq>(Op::kDestroyCq, rng);
  round_trip<CreateQpReq>(Op::kCreateQp, rng);
  round_trip<ModifyQpReq>(Op::kModifyQp, rng);
  round_trip<HandleReq>(Op::kQueryQp, rng);
  round_trip<HandleReq>(Op::kDestroyQp, rng);
  round_trip<StatusReq>(Op::kStatus, rng);
  round_trip<ReregMrReq>(Op::kReregMr, rng);
  round_trip<ResizeCqReq>(Op::kResizeCq, rng);
  round_trip<AllocDmReq>(Op::kAllocDm, rng);
  round_trip<HandleReq>(Op::kFreeDm, rng);
  round_trip<RegDmMrReq>(Op::kRegDmMr, rng);
  round_trip<DirectCookieReq>(Op::kDirectCookie, rng);
  round_trip<HandleReq>(Op::kDirectPeer, rng);
  round_trip<HandleReq>(Op::kDirectProve, rng);
  round_trip<MwViewReq>(Op::kMwView, rng);
  EXPECT_EQ(request_body_size(Op::kMax), SIZE_MAX);
  EXPECT_EQ(op_name(static_cast<uint16_t>(Op::kDirectProve)), "direct_prove");
  EXPECT_EQ(op_name(static_cast<uint16_t>(Op::kImportCm)), "import_cm");
  EXPECT_EQ(request_body_size(Op::kImportCm), kVariableBody);
  EXPECT_EQ(op_name(static_cast<uint16_t>(Op::kMwView)), "mw_view");
  EXPECT_EQ(op_name(63), "op 63");  // a number kept free: no name, no body
}

TEST(CommandCodec, ResponsesRoundTripThroughDecodeHeader) {
  std::mt19937_64 rng(2);
  auto check = [&](Op op, auto resp) {
    using T = decltype(resp);
    resp = random_body<T>(rng);
    Bytes m = encode(op, 77, -EINVAL, resp);
    auto h = decode_header(m);
    ASSERT_TRUE(h.is_ok());
    EXPECT_EQ(h->status, -EINVAL);
    EXPECT_EQ(h->seq, 77u);
    auto b = body_of<T>(m);
    ASSERT_TRUE(b.is_ok());
    EXPECT_EQ(std::memcmp(&b.value(), &resp, sizeof(T)), 0);
  };
  check(Op::kHello, HelloResp{});
  check(Op::kAllocPd, HandleResp{});
  check(Op::kRegMr, RegMrResp{});
  check(Op::kCreateCq, CreateCqResp{});
  check(Op::kCreateQp, CreateQpResp{});
  check(Op::kQueryQp, QueryQpResp{});
  check(Op::kResizeCq, CreateCqResp{});
  check(Op::kAllocDm, AllocDmResp{});
  check(Op::kDirectPeer, DirectPeerResp{});
  Bytes empty_resp = encode(Op::kDestroyQp, 1, 0, Empty{});
  EXPECT_EQ(empty_resp.size(), sizeof(MsgHeader));
  EXPECT_TRUE(decode_header(empty_resp).is_ok());
}

TEST(CommandCodec, EmptyAndTruncatedMessagesAreErrors) {
  EXPECT_EQ(decode_header({}).err(), EPROTO);
  EXPECT_EQ(decode_request({}).err(), EPROTO);
  Bytes m = encode(Op::kAllocPd, 1, 0, Empty{});
  for (size_t n = 1; n < sizeof(MsgHeader); ++n) {
    std::span<const uint8_t> part(m.data(), n);
    EXPECT_EQ(decode_header(part).err(), EPROTO) << n;
    EXPECT_EQ(decode_request(part).err(), EPROTO) << n;
  }
  Bytes hello = encode(Op::kHello, 1, 0, HelloReq{});
  // Truncated body with the original (now wrong) declared length.
  std::span<const uint8_t> cut(hello.data(), hello.size() - 10);
  EXPECT_EQ(decode_header(cut).err(), EPROTO);
  EXPECT_EQ(decode_request(cut).err(), EPROTO);
}

TEST(CommandCodec, HeaderFieldErrors) {
  const Bytes good = encode(Op::kQueryQp, 5, 0, HandleReq{3, 0});
  auto with = [&](auto mutate) {
    Bytes m = good;
    MsgHeader h = header_of(m);
    mutate(h);
    set_header(m, h);
    return m;
  };
  EXPECT_EQ(decode_request(with([](MsgHeader& h) { h.magic ^= 1; })).err(), EPROTO);
  EXPECT_EQ(decode_request(with([](MsgHeader& h) { h.magic = 0; })).err(), EPROTO);
  EXPECT_EQ(decode_request(with([](MsgHeader& h) { h.version = 0; })).err(), EPROTONOSUPPORT);
  EXPECT_EQ(decode_request(with([](MsgHeader& h) { h.version = kVersion + 1; })).err(),
            EPROTONOSUPPORT);
  EXPECT_EQ(decode_header(with([](MsgHeader& h) { h.version = 0xffff; })).err(),
            EPROTONOSUPPORT);
  for (uint16_t op : {uint16_t{0}, static_cast<uint16_t>(Op::kMax),
                      static_cast<uint16_t>(static_cast<uint16_t>(Op::kMax) + 1),
                      uint16_t{0xffff}}) {
    EXPECT_EQ(decode_request(with([&](MsgHeader& h) { h.op = op; })).err(), EOPNOTSUPP) << op;
    EXPECT_EQ(decode_header(with([&](MsgHeader& h) { h.op = op; })).err(), EOPNOTSUPP) << op;
  }
  for (uint32_t len : {0u, 1u, 24u, 31u, 33u, 0xffffffffu}) {
    EXPECT_EQ(decode_request(with([&](MsgHeader& h) { h.length = len; })).err(), EPROTO) << len;
  }
  // The body size is checked against the opcode: a HandleReq-sized body is not a Hello.
  EXPECT_EQ(decode_request(with([](MsgHeader& h) { h.op = uint16_t(Op::kHello); })).err(),
            EPROTO);
  EXPECT_EQ(decode_request(with([](MsgHeader& h) { h.op = uint16_t(Op::kAllocPd); })).err(),
            EPROTO);
}

TEST(CommandCodec, OversizedRequestIsEmsgsize) {
  Bytes m(kMaxRequest + 1, 0);
  MsgHeader h{kMagic, kVersion, static_cast<uint16_t>(Op::kHello),
              static_cast<uint32_t>(m.size()), 1, 0, 0};
  set_header(m, h);
  EXPECT_EQ(decode_request(m).err(), EMSGSIZE);
  m.resize(1u << 20);
  fix_length(m);
  EXPECT_EQ(decode_request(m).err(), EMSGSIZE);
  // At exactly the limit the size is fine; the body just does not match the opcode.
  m.resize(kMaxRequest);
  fix_length(m);
  EXPECT_EQ(decode_request(m).err(), EPROTO);
}

// What a successful decode_request promises about the message.
void expect_valid(const Result<MsgHeader>& r, std::span<const uint8_t> m) {
  ASSERT_TRUE(r.is_ok());
  ASSERT_GE(m.size(), sizeof(MsgHeader));
  const size_t want = request_body_size(static_cast<Op>(r.value().op));
  if (want == kVariableBody) {
    ASSERT_LE(m.size() - sizeof(MsgHeader), kMaxImportChunk);
    return;
  }
  ASSERT_LE(m.size(), kMaxRequest);
  EXPECT_EQ(r.value().magic, kMagic);
  EXPECT_EQ(r.value().version, kVersion);
  ASSERT_GT(r.value().op, 0);
  ASSERT_LT(r.value().op, static_cast<uint16_t>(Op::kMax));
  EXPECT_EQ(r.value().length, m.size());
  EXPECT_EQ(m.size() - sizeof(MsgHeader), request_body_size(static_cast<Op>(r.value().op)));
}

TEST(CommandCodec, RandomBytesNeverCrash) {
  std::mt19937_64 rng(3);
  Bytes m;
  int ok = 0;
  for (int i = 0; i < 100000; ++i) {
    m.resize(rng() % 5001);
    for (size_t j = 0; j < m.size(); j += 8) {
      uint64_t v = rng();
      std::memcpy(m.data() + j, &v, std::min<size_t>(8, m.size() - j));
    }
    // Half of them start with a plausible header so the later checks are reached too.
    if (i % 2 && m.size() >= sizeof(MsgHeader)) {
      MsgHeader h{kMagic, kVersion, static_cast<uint16_t>(rng() % 18),
                  rng() % 4 ? static_cast<uint32_t>(m.size()) : static_cast<uint32_t>(rng()),
                  0, 0, 0};
      set_header(m, h);
    }
    auto r = decode_request(m);
    if (r.is_ok()) {
      ++ok;
      expect_valid(r, m);
    } else {
      EXPECT_NE(r.err(), 0);
    }
    (void)decode_header(m);
  }
}

TEST(CommandCodec, MutatedValidMessagesNeverCrash) {
  std::mt19937_64 rng(4);
  const std::vector<Bytes> seeds = {
      encode(Op::kHello, 1, 0, HelloReq{}),         encode(Op::kAllocPd, 2, 0, Empty{}),
      encode(Op::kDeallocPd, 3, 0, HandleReq{}),    encode(Op::kRegSegment, 4, 0, RegSegmentReq{}),
      encode(Op::kRegMr, 5, 0, RegMrReq{}),         encode(Op::kCreateChannel, 6, 0, Empty{}),
      encode(Op::kCreateCq, 7, 0, CreateCqReq{}),   encode(Op::kCreateQp, 8, 0, CreateQpReq{}),
      encode(Op::kModifyQp, 9, 0, ModifyQpReq{}),   encode(Op::kStatus, 10, 0, StatusReq{})};
  int ok = 0, bad = 0;
  for (int i = 0; i < 100000; ++i) {
    Bytes m = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (rng() % 5) {
        case 0: if (!m.empty()) m[rng() % m.size()] ^= uint8_t(1u << (rng() % 8)); break;
        case 1: if (!m.empty()) m[rng() % std::min<size_t>(m.size(), 24)] = uint8_t(rng()); break;
        case 2: m.resize(rng() % (m.size() + 1)); break;
        case 3: m.resize(m.size() + rng() % 64, uint8_t(rng())); break;
        case 4: if (m.size() >= sizeof(MsgHeader)) fix_length(m); break;
      }
    }
    auto r = decode_request(m);
    if (r.is_ok()) {
      ++ok;
      expect_valid(r, m);
    } else {
      ++bad;
    }
  }
  // Both outcomes must have been exercised for the test to mean anything.
  EXPECT_GT(ok, 1000);
  EXPECT_GT(bad, 1000);
}

// A refused operator command carries its reason; an older backend's answer (no body) has none,
// and an older client, which reads only the header of an error answer, still sees the errno.
TEST(CommandCodec, ErrorAnswerCarriesTheReason) {
  const Bytes m = encode_error(Op::kMigrate, 7, ENOENT, "no guest g3 here (guests: g1, g2)");
  auto h = decode_header(m);
  ASSERT_TRUE(h.is_ok()) << h.status().message();
  EXPECT_EQ(h.value().status, -ENOENT);
  EXPECT_EQ(h.value().seq, 7u);
  EXPECT_EQ(reason_of(m), "no guest g3 here (guests: g1, g2)");
  EXPECT_EQ(reason_of(encode(Op::kMigrate, 7, -ENOENT, Empty{})), "");
  // Cut to kMaxReason; anything but printable ASCII shown as '?'.
  const Bytes big = encode_error(Op::kSnapshot, 1, EIO, std::string(5000, 'x'));
  ASSERT_TRUE(decode_header(big).is_ok());
  EXPECT_EQ(reason_of(big).size(), kMaxReason);
  EXPECT_EQ(reason_of(encode_error(Op::kRestore, 1, EIO, std::string("a\nb\0c\x80", 6))), "a?b?c?");
}

// Answer flags ride in the header's former reserved word: an older client reads the same
// errno, body and length; an older backend's answers have none.
TEST(CommandCodec, AnswerFlagsLeaveErrnoBodyAndLengthAlone) {
  const Bytes q =
      encode_error(Op::kCreateCq, 3, ENOMEM, "guest quota max_cqs = 2 reached", kAnswerQuota);
  auto h = decode_header(q);
  ASSERT_TRUE(h.is_ok()) << h.status().message();
  EXPECT_EQ(h.value().flags, kAnswerQuota);
  EXPECT_EQ(h.value().status, -ENOMEM);
  EXPECT_EQ(reason_of(q), "guest quota max_cqs = 2 reached");
  EXPECT_EQ(decode_header(encode_error(Op::kCreateCq, 3, ENOMEM, "x")).value().flags, 0u);
  Bytes ok = encode(Op::kModifyQp, 4, 0, Empty{});
  EXPECT_EQ(decode_header(ok).value().flags, 0u);
  add_answer_flags(ok, kAnswerDestUnknown);
  add_answer_flags(ok, kAnswerQuota);
  ASSERT_EQ(ok.size(), sizeof(MsgHeader));
  h = decode_header(ok);
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ(h.value().flags, kAnswerDestUnknown | kAnswerQuota);
  EXPECT_EQ(h.value().status, 0);
}

}  // namespace
}  // namespace vrdma::proto
