// The TLS 1.3 record layer of common/tls_record.h as the libraries' direct path uses it: records
// sealed from a frame's pieces, opened only into memory of its own until they pass their check,
// a hello read without a byte past its record, KeyUpdate both ways, and the reading and the
// writing side on two threads at once. (That its records are standard TLS 1.3 an OpenSSL session
// checks in tcp_transport_test: TlsStream.ItsRecordsAreStandardTls13.)
#include "common/tls_record.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common/unique_fd.h"

namespace vrdma::tls {
namespace {

constexpr uint16_t kAes128Gcm = 0x1301;
const std::vector<uint8_t> kClientSecret(32, 0x11), kServerSecret(32, 0x22);

/// Two streams on the two ends of a socket pair, `a` the client, `b` the server.
struct Pair {
  UniqueFd fa, fb;
  RecordStream a, b;
  explicit Pair(size_t buf = 4 * kTlsMaxRecord) {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
    fa = UniqueFd(sv[0]);
    fb = UniqueFd(sv[1]);
    EXPECT_TRUE(a.start(kAes128Gcm, kClientSecret, kServerSecret, buf));
    EXPECT_TRUE(b.start(kAes128Gcm, kServerSecret, kClientSecret, buf));
  }
};

/// Reads n bytes from `s` on `fd` (into memory of its own or not), pulling as needed.
std::vector<uint8_t> read_all(RecordStream& s, int fd, size_t n, bool ours = true) {
  std::vector<uint8_t> got(n);
  size_t have = 0;
  std::string why;
  for (int idle = 0; have < n && idle < 1000;) {
    const ssize_t r = s.read(got.data() + have, n - have, why, ours);
    EXPECT_GE(r, 0) << why;
    if (r < 0) break;
    have += static_cast<size_t>(r);
    if (r == 0 && s.pull(fd) <= 0) {
      pollfd p{fd, POLLIN, 0};
      ::poll(&p, 1, 10);
      ++idle;
    }
  }
  got.resize(have);
  return got;
}

TEST(RecordStream, RecordsSealedFromAFramesPiecesOpenAsItsBytesInOrder) {
  Pair p(2 * kTlsMaxRecord);  // room for two records: the writes are taken in parts
  std::vector<uint8_t> header(64), payload(40000), tail(7);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7);
  std::memset(header.data(), 0xA5, header.size());
  std::memset(tail.data(), 0x5A, tail.size());
  const iovec iov[] = {{header.data(), header.size()}, {payload.data(), payload.size()},
                       {tail.data(), tail.size()}};
  const size_t total = header.size() + payload.size() + tail.size();
  std::vector<uint8_t> want(header);
  want.insert(want.end(), payload.begin(), payload.end());
  want.insert(want.end(), tail.begin(), tail.end());
  std::vector<uint8_t> got;
  std::string why;
  size_t sent = 0;
  for (int i = 0; i < 100 && got.size() < total; ++i) {
    if (sent < total) {
      const ssize_t w = p.a.write(iov, 3, sent, why);
      ASSERT_GE(w, 0) << why;
      sent += static_cast<size_t>(w);
      ASSERT_GE(p.a.push(p.fa.get()), 0);
    }
    // What has come so far.
    uint8_t buf[65536];
    ssize_t r;
    while (p.b.pull(p.fb.get()) > 0 || p.b.has_buffered()) {
      while ((r = p.b.read(buf, sizeof(buf), why)) > 0) got.insert(got.end(), buf, buf + r);
      ASSERT_GE(r, 0) << why;
    }
  }
  ASSERT_EQ(sent, total);
  EXPECT_EQ(got, want);
  // Each record carries at most kTlsMaxPlain bytes: 40071 bytes are 3 records.
  EXPECT_EQ(p.a.produced(), total + 3 * (kTlsHeader + 1 + kTlsTag));
}

// A small record and a large one, a bit flipped in the first record's ciphertext or in its
// tag.
// A record sealed from a frame's pieces (the header, the payload, split anywhere: inside a
// 16-byte block or across one) is the record sealed from the same bytes in one buffer, in each
// suite; and it opens.
TEST(RecordCipher, PiecesSealTheSameRecordAsOneBuffer) {
  for (const uint16_t suite : {uint16_t{0x1301}, uint16_t{0x1302}, uint16_t{0x1303}}) {
    for (const size_t n : {size_t{1}, size_t{64}, size_t{100}, size_t{1000}, kTlsMaxPlain}) {
      std::vector<uint8_t> msg(n);
      for (size_t i = 0; i < n; ++i) msg[i] = static_cast<uint8_t>(i * 7 + n);
      RecordCipher whole, split, opener;
      ASSERT_TRUE(whole.init(suite, kClientSecret, true));
      ASSERT_TRUE(split.init(suite, kClientSecret, true));
      ASSERT_TRUE(opener.init(suite, kClientSecret, false));
      std::vector<uint8_t> a(kTlsMaxRecord), b(kTlsMaxRecord), back(kTlsMaxRecord);
      for (const size_t cut : {size_t{0}, size_t{1}, size_t{15}, size_t{17}, n / 2, n}) {
        SCOPED_TRACE(testing::Message() << "suite " << suite << ", " << n << " bytes cut at "
                                        << std::min(cut, n));
        const size_t c1 = std::min(cut, n), c2 = std::min(c1 + 3, n);
        const iovec pieces[] = {{msg.data(), c1}, {msg.data() + c1, c2 - c1},
                                {msg.data() + c2, n - c2}};
        const size_t la = whole.seal(kTlsAppData, msg.data(), n, a.data());
        const size_t lb = split.seal(kTlsAppData, pieces, b.data());
        ASSERT_EQ(la, kTlsHeader + n + 1 + kTlsTag);
        ASSERT_EQ(la, lb);
        EXPECT_TRUE(std::equal(a.begin(), a.begin() + la, b.begin()));
        uint8_t type = 0;
        ASSERT_EQ(opener.open(b.data(), lb, back.data(), type), static_cast<ssize_t>(n));
        EXPECT_EQ(type, kTlsAppData);
        EXPECT_TRUE(std::equal(msg.begin(), msg.end(), back.begin()));
      }
    }
  }
}

TEST(RecordStream, AForgedRecordNeverReachesAnApplicationsMemory) {
  for (const size_t size : {size_t{100}, size_t{20000}}) {
    const size_t body = std::min(size, kTlsMaxPlain);
    for (const size_t flip : {kTlsHeader + 50, kTlsHeader + body + 1 + 3}) {
      SCOPED_TRACE(testing::Message() << size << " bytes, byte " << flip << " altered");
      Pair p;
      std::vector<uint8_t> msg(size, 0x42);
      std::string why;
      ASSERT_EQ(p.a.write(msg.data(), msg.size(), why), static_cast<ssize_t>(msg.size()));
      // The first record's ciphertext, one bit flipped on the way.
      std::vector<uint8_t> wire(p.a.produced());
      ASSERT_EQ(p.a.push(p.fa.get()), 1);
      ASSERT_EQ(::recv(p.fb.get(), wire.data(), wire.size(), 0), static_cast<ssize_t>(wire.size()));
      wire[flip] ^= 0x01;
      int relay[2];
      ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, relay), 0);
      const UniqueFd r0(relay[0]), r1(relay[1]);
      ASSERT_EQ(::send(r0.get(), wire.data(), wire.size(), 0), static_cast<ssize_t>(wire.size()));
      ASSERT_GT(p.b.pull(r1.get()), 0);
      std::vector<uint8_t> app(msg.size(), 0xEE);
      EXPECT_EQ(p.b.read(app.data(), app.size(), why, false), -1);
      EXPECT_NE(why.find("forged or altered"), std::string::npos) << why;
      EXPECT_EQ(app, std::vector<uint8_t>(msg.size(), 0xEE)) << "a forged record's bytes reached it";
    }
  }
}

TEST(RecordStream, AHelloIsReadWithoutAByteOfTheSocketPastItsRecord) {
  Pair p;
  std::string why;
  const char hello[] = "hello", next[] = "what follows";
  ASSERT_EQ(p.a.write(hello, sizeof(hello), why), static_cast<ssize_t>(sizeof(hello)));
  ASSERT_EQ(p.a.write(next, sizeof(next), why), static_cast<ssize_t>(sizeof(next)));
  ASSERT_EQ(p.a.push(p.fa.get()), 1);
  char got[sizeof(hello)] = {};
  size_t have = 0;
  for (int i = 0; i < 10 && have < sizeof(got); ++i) {
    const ssize_t r = p.b.read(got + have, sizeof(got) - have, why);
    ASSERT_GE(r, 0) << why;
    have += static_cast<size_t>(r);
    if (have < sizeof(got)) {
      ASSERT_GT(p.b.pull(p.fb.get(), nullptr, p.b.record_need()), 0);
    }
  }
  EXPECT_STREQ(got, hello);
  EXPECT_FALSE(p.b.has_buffered());
  // The next record is still in the socket, whole, where epoll sees it.
  uint8_t peek[256];
  EXPECT_EQ(::recv(p.fb.get(), peek, sizeof(peek), MSG_PEEK),
            static_cast<ssize_t>(kTlsHeader + sizeof(next) + 1 + kTlsTag));
}

TEST(RecordStream, APeersKeyUpdateIsTakenAndAnsweredWhenItAsks) {
  Pair p;
  // The peer (a RecordCipher with the client's secret) asks for an update, updates its own
  // keys, and sends data under them.
  RecordCipher peer_tx, peer_rx;
  ASSERT_TRUE(peer_tx.init(kAes128Gcm, kClientSecret, true));
  ASSERT_TRUE(peer_rx.init(kAes128Gcm, kServerSecret, false));
  const uint8_t update_requested[] = {24, 0, 0, 1, 1};
  const char data[] = "after the update";
  uint8_t wire[2 * kTlsMaxRecord];
  size_t n = peer_tx.seal(kTlsHandshake, update_requested, sizeof(update_requested), wire);
  ASSERT_TRUE(peer_tx.update());
  n += peer_tx.seal(kTlsAppData, reinterpret_cast<const uint8_t*>(data), sizeof(data), wire + n);
  ASSERT_EQ(::send(p.fa.get(), wire, n, 0), static_cast<ssize_t>(n));
  const std::vector<uint8_t> got = read_all(p.b, p.fb.get(), sizeof(data));
  EXPECT_EQ(std::memcmp(got.data(), data, sizeof(data)), 0);
  // b's next write goes after its own KeyUpdate (not requested back), under the new keys.
  std::string why;
  const char reply[] = "reply";
  ASSERT_EQ(p.b.write(reply, sizeof(reply), why), static_cast<ssize_t>(sizeof(reply)));
  ASSERT_EQ(p.b.push(p.fb.get()), 1);
  const ssize_t len = ::recv(p.fa.get(), wire, sizeof(wire), 0);
  ASSERT_GT(len, 0);
  size_t at = 0;
  uint8_t type = 0, plain[kTlsMaxRecord];
  auto next = [&] {
    const size_t rec = kTlsHeader + (size_t{wire[at + 3]} << 8 | wire[at + 4]);
    const ssize_t r = peer_rx.open(wire + at, rec, plain, type);
    at += rec;
    return r;
  };
  ASSERT_EQ(next(), 5);
  EXPECT_EQ(type, kTlsHandshake);
  EXPECT_EQ(std::memcmp(plain, "\x18\x00\x00\x01\x00", 5), 0);
  ASSERT_TRUE(peer_rx.update());
  ASSERT_EQ(next(), static_cast<ssize_t>(sizeof(reply)));
  EXPECT_EQ(type, kTlsAppData);
  EXPECT_STREQ(reinterpret_cast<char*>(plain), reply);
  EXPECT_EQ(at, static_cast<size_t>(len));
}

TEST(RecordStream, ItsReadingAndWritingSidesRunOnTwoThreadsAtOnce) {
  Pair p;
  constexpr size_t kBytes = 4 << 20;
  // Each end writes kBytes on one thread while another reads what the other end writes.
  auto writer = [](RecordStream& s, int fd, uint8_t seed) {
    std::vector<uint8_t> chunk(50000);
    std::string why;
    for (size_t sent = 0; sent < kBytes;) {
      for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<uint8_t>(seed + sent + i);
      const size_t n = std::min(chunk.size(), kBytes - sent);
      size_t took = 0;
      while (took < n) {
        const ssize_t w = s.write(chunk.data() + took, n - took, why);
        ASSERT_GE(w, 0) << why;
        took += static_cast<size_t>(w);
        if (s.push(fd) == 0) {
          pollfd pf{fd, POLLOUT, 0};
          ::poll(&pf, 1, 10);
        }
      }
      sent += n;
    }
    while (s.push(fd) == 0) {
      pollfd pf{fd, POLLOUT, 0};
      ::poll(&pf, 1, 10);
    }
  };
  auto reader = [](RecordStream& s, int fd, uint8_t seed, size_t& bad) {
    std::vector<uint8_t> buf(30000);
    std::string why;
    for (size_t got = 0; got < kBytes;) {
      const ssize_t r = s.read(buf.data(), buf.size(), why);
      ASSERT_GE(r, 0) << why;
      for (ssize_t i = 0; i < r; ++i)
        bad += buf[static_cast<size_t>(i)] != static_cast<uint8_t>(seed + got + static_cast<size_t>(i));
      got += static_cast<size_t>(r);
      if (r == 0 && s.pull(fd) == 0) {
        pollfd pf{fd, POLLIN, 0};
        ::poll(&pf, 1, 10);
      }
    }
  };
  size_t bad_a = 0, bad_b = 0;
  std::thread t[] = {std::thread(writer, std::ref(p.a), p.fa.get(), 1),
                     std::thread(reader, std::ref(p.a), p.fa.get(), 2, std::ref(bad_a)),
                     std::thread(writer, std::ref(p.b), p.fb.get(), 2),
                     std::thread(reader, std::ref(p.b), p.fb.get(), 1, std::ref(bad_b))};
  for (auto& th : t) th.join();
  EXPECT_EQ(bad_a, 0u);
  EXPECT_EQ(bad_b, 0u);
}

}  // namespace
}  // namespace vrdma::tls
