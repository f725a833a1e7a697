// The connection service's tests (cm_service_test.cc, cm_keep_test.cc): a stand-in session that
// sends CM commands to a CmService in-process and reads its events from its channel's socket,
// and a fixture with a listener on 127.0.0.1:7000.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/cm.h"
#include "engine/device.h"

namespace vrdma::backend {
namespace {

using namespace vrdma::proto;

CmAddr v4(const char* a, uint16_t port) {
  CmAddr r{};
  r.family = AF_INET;
  r.port = port;
  in_addr in;
  inet_pton(AF_INET, a, &in);
  std::memcpy(r.addr, &in, 4);
  return r;
}

/// One guest process's view: its session, an event channel, commands, events.
struct End {
  CmService& cm;
  engine::Session s;
  UniqueFd events;
  uint32_t channel = 0;
  uint32_t seq = 0;

  /// A session already in `c` (one whose CM state was imported there): its id, its channel and
  /// the guest's end of that channel.
  End(CmService& c, uint32_t session, uint32_t ch, UniqueFd ev)
      : cm(c), events(std::move(ev)), channel(ch) {
    s.id = session;
  }
  explicit End(CmService& c) : cm(c) {
    static uint32_t next_session = 1;
    s.id = next_session++;
    UniqueFd give;
    auto [st, out] = cmd(Op::kCmCreateChannel, Empty{}, &give);
    EXPECT_EQ(st, 0);
    channel = body_of<HandleResp>(out).value().handle;
    events = std::move(give);
  }
  /// The command's status (0 or -errno) and response bytes.
  template <typename B>
  std::pair<int32_t, std::vector<uint8_t>> cmd(Op op, const B& b, UniqueFd* give = nullptr) {
    UniqueFd fd;
    auto m = encode(op, ++seq, 0, b);
    auto h = decode_request(m);
    EXPECT_TRUE(h.is_ok());
    auto out = cm.handle(s, h.value(), m, give ? *give : fd);
    return {decode_header(out).value().status, out};
  }
  uint32_t create_id(uint16_t ps = 0x0106) {
    auto [st, out] = cmd(Op::kCmCreateId, CmCreateIdReq{channel, ps, 2, 0});
    EXPECT_EQ(st, 0);
    return body_of<HandleResp>(out).value().handle;
  }
  int32_t bind(uint32_t id, CmAddr a) { return cmd(Op::kCmBind, CmAddrReq{id, 0, a}).first; }
  int32_t listen(uint32_t id, uint32_t backlog = 8) {
    return cmd(Op::kCmListen, CmListenReq{id, backlog}).first;
  }
  int32_t conn(Op op, uint32_t id, uint32_t qpn, const std::string& pdata = {}) {
    CmConnReq r{};
    r.id = id;
    r.qp.qpn = qpn;
    r.qp.psn = qpn * 7;
    r.qp.qp_type = 2;  // IBV_QPT_RC
    r.private_len = static_cast<uint32_t>(pdata.size());
    std::memcpy(r.private_data, pdata.data(), pdata.size());
    return cmd(op, r).first;
  }
  int32_t handle_cmd(Op op, uint32_t id) { return cmd(op, HandleReq{id, 0}).first; }
  /// The next event, which must be there already.
  CmEvent next() {
    std::vector<uint8_t> buf(4096);
    ssize_t n = ::recv(events.get(), buf.data(), buf.size(), MSG_DONTWAIT);
    EXPECT_GT(n, 0) << "no event";
    if (n <= 0) {
      CmEvent none{};
      none.event = 0xdead;
      return none;
    }
    buf.resize(static_cast<size_t>(n));
    return body_of<CmEvent>(buf).value();
  }
  bool quiet() {
    char b;
    return ::recv(events.get(), &b, 1, MSG_DONTWAIT | MSG_PEEK) < 0 && errno == EAGAIN;
  }
  /// An id with its route resolved to `dst`.
  uint32_t resolved(CmAddr dst) {
    const uint32_t id = create_id();
    EXPECT_EQ(cmd(Op::kCmResolveAddr, CmResolveReq{id, 1000, {}, dst}).first, 0);
    EXPECT_EQ(next().event, uint32_t(CmEventType::kAddrResolved));
    EXPECT_EQ(cmd(Op::kCmResolveRoute, CmResolveReq{id, 1000, {}, {}}).first, 0);
    EXPECT_EQ(next().event, uint32_t(CmEventType::kRouteResolved));
    return id;
  }
};

uint32_t ev(CmEventType t) { return static_cast<uint32_t>(t); }

struct CmServiceTest : ::testing::Test {
  CmService cm;
  End srv{cm}, cli{cm};
  uint32_t listener = 0;
  void SetUp() override {
    listener = srv.create_id();
    ASSERT_EQ(srv.bind(listener, v4("127.0.0.1", 7000)), 0);
    ASSERT_EQ(srv.listen(listener), 0);
  }
  /// cli connects to the listener: the CONNECT_REQUEST's new id on srv's side.
  uint32_t request(uint32_t* cli_id, const std::string& pdata = "hi") {
    *cli_id = cli.resolved(v4("127.0.0.1", 7000));
    EXPECT_EQ(cli.conn(Op::kCmConnect, *cli_id, 0x12, pdata), 0);
    CmEvent e = srv.next();
    EXPECT_EQ(e.event, ev(CmEventType::kConnectRequest));
    EXPECT_EQ(e.listen_id, listener);
    EXPECT_EQ(e.peer.qpn, 0x12u);
    EXPECT_EQ(e.peer.psn, 0x12u * 7);
    EXPECT_EQ(std::string(reinterpret_cast<char*>(e.private_data), e.private_len), pdata);
    EXPECT_EQ(e.src.port, 7000);
    return e.id;
  }
  /// cli and srv connected and established: (cli's id, srv's id).
  std::pair<uint32_t, uint32_t> established() {
    uint32_t c;
    const uint32_t s = request(&c);
    EXPECT_EQ(srv.conn(Op::kCmAccept, s, 0x34), 0);
    EXPECT_EQ(cli.next().event, ev(CmEventType::kConnectResponse));
    EXPECT_EQ(cli.handle_cmd(Op::kCmEstablish, c), 0);
    EXPECT_EQ(srv.next().event, ev(CmEventType::kEstablished));
    return {c, s};
  }
  /// cli's id `c` of an established pair disconnects: DISCONNECTED on both ends, then cli's
  /// TIMEWAIT_EXIT once its timewait is over.
  void cli_disconnects(uint32_t c) {
    ASSERT_EQ(cli.handle_cmd(Op::kCmDisconnect, c), 0);
    EXPECT_EQ(cli.next().event, ev(CmEventType::kDisconnected));
    EXPECT_EQ(srv.next().event, ev(CmEventType::kDisconnected));
    std::this_thread::sleep_for(std::chrono::milliseconds(80));
    cm.on_timer();
    EXPECT_EQ(cli.next().event, ev(CmEventType::kTimewaitExit));
  }
};

}  // namespace
}  // namespace vrdma::backend
