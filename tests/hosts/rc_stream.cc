// A verifying RC stream for the fault tests: the client SENDs N messages of SIZE bytes (message i
// holds i in its first 8 bytes, then bytes from a PRNG seeded with i) with up to 32 in flight;
// the server checks that message i arrives i-th with the right length, and both print an FNV-1a
// checksum of every byte they moved. Equal checksums and no complaint: nothing lost, nothing
// duplicated, nothing reordered or corrupted. Plain verbs, no vrdma headers.
// N = 0 (on both sides): open-ended; the client runs until SIGUSR1, then stops posting, waits for
// its messages in flight and tells the server how many it sent (over the exchange socket).
// Usage: rc_stream server PORT N SIZE | rc_stream client HOST PORT N SIZE
// Options (anywhere after the mode): --timeout N, the QP's ACK timeout exponent (default 14, as
// Debian's tools); --stall-ms MS: a line "rc_stream: stall of S s ended at EPOCH" whenever
// completions resume after MS or more without one (the impaired tests time a link flap with it).
// A failed completion also prints "rc_stream: failed at EPOCH" (CLOCK_REALTIME seconds).
// --depth N: the client keeps at most N (1 to 32) messages in flight (default 32).
// --events: the stream sleeps in a completion channel whenever its CQ is empty (arm, poll once,
// block); a completion found in the armed CQ with no event for it a second later is a lost event
// ("rc_stream: lost event", exit 1).
// --srq: the QP's receives come from an SRQ of its own (the stream modes).
//
// rnr-server PORT | rnr-client HOST PORT: a SEND that finds no receive must not hold up what
// comes behind it. After a ping-pong warm-up (which puts the pair on whatever path vrdma takes),
// the client SENDs A (inline, its buffer overwritten at once) and A2 to the server, which has no
// receive posted; the server then SENDs B and waits for B's completion before it posts its
// receives. B's ACK travels behind A and A2: a responder that stopped reading at A would never
// let B complete (real RC: A is RNR-NAKed and retried, B completes). Then A and A2 must arrive,
// in order, with the bytes they had when posted. Prints "rnr: ok". With RC_STREAM_GATE=FILE
// the client sends A only once FILE exists (the test opens it when the path it tests is up).
//
// ud-server PORT SIZE | ud-client HOST PORT SIZE: a verifying UD stream, open-ended (the client
// stops at SIGUSR1 and sends the server its count over the exchange socket). UD may lose a
// datagram, never duplicate or corrupt one: the client sends datagram i (i in its first 8
// bytes, then the PRNG bytes of i) and waits up to 200 ms for the server's echo of i (a lost one
// is counted and the stream goes on, never resent); the server checks each datagram's length
// and bytes and that its number is above the last one's. Prints "ud: received R" every 1000,
// and at the end "ud: received R of N sent (L lost), each once, in order, intact".
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kDepth = 32;

volatile std::sig_atomic_t g_stop = 0;
uint8_t g_timeout = 14;  ///< --timeout
long g_stall_ms = 0;     ///< --stall-ms (0: no stall lines)
bool g_events = false;   ///< --events
bool g_srq = false;      ///< --srq
int g_depth = kDepth;    ///< --depth
bool g_ud = false;       ///< the ud-* modes: UD QPs
constexpr uint32_t kQkey = 0x11111111;
constexpr uint32_t kGrh = 40;  ///< a UD receive's first bytes
void on_stop(int) { g_stop = 1; }

struct Dest {
  uint32_t lid, qpn, psn;
};

constexpr int kWarmup = 300;  ///< rnr mode: round trips before the test

/// CLOCK_REALTIME as "SECONDS.MICROS", for lines the tests compare with other processes' times.
std::string epoch_now() {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%ld.%06ld", static_cast<long>(ts.tv_sec), ts.tv_nsec / 1000);
  return buf;
}
double mono_s() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

/// Called after each empty poll: after 256 in a row, the stream naps 20 µs per poll instead of
/// spinning. A stream that completes messages never naps; one that waits (a backend moving, a
/// link down, a peer stopped) leaves the CPU to the backends it waits for, which on a 2-core
/// machine running tests side by side is most of what a spinning stream cost. Busy polls the
/// first 256 times, so the library's poll path runs as an application's does.
void idle_nap(unsigned& empty) {
  if (++empty < 256) return;
  const timespec ts{0, 20 * 1000};
  ::nanosleep(&ts, nullptr);
}
/// Reports a failed completion: what failed and when.
void report_failure(uint64_t which, ibv_wc_status st) {
  std::fprintf(stderr, "rc_stream: completion %" PRIu64 " failed: %s\n", which,
               ibv_wc_status_str(st));
  std::fprintf(stderr, "rc_stream: failed at %s\n", epoch_now().c_str());
}

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "rc_stream: %s\n", what);
  std::exit(1);
}

void fill(uint8_t* p, uint32_t size, uint64_t i) {
  std::mt19937_64 rng(i * 0x9e3779b97f4a7c15ull + 1);
  for (uint32_t o = 0; o < size; o += 8) {
    uint64_t v = o == 0 ? i : rng();
    std::memcpy(p + o, &v, std::min<uint32_t>(8, size - o));
  }
}

uint64_t fnv(uint64_t h, const uint8_t* p, size_t n) {
  for (size_t k = 0; k < n; ++k) h = (h ^ p[k]) * 0x100000001b3ull;
  return h;
}

int exchange(bool server, const char* host, int port, const Dest& me, Dest& peer) {
  int fd;
  if (server) {
    int ls = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a)) || ::listen(ls, 1)) die("listen");
    fd = ::accept(ls, nullptr, nullptr);
    ::close(ls);
  } else {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (::getaddrinfo(host, std::to_string(port).c_str(), &hints, &res)) die("resolve");
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(fd, res->ai_addr, res->ai_addrlen)) die("connect");
    ::freeaddrinfo(res);
  }
  if (::write(fd, &me, sizeof(me)) != sizeof(me) || ::read(fd, &peer, sizeof(peer)) != sizeof(peer))
    die("exchange");
  return fd;
}

/// One RC QP, connected to the peer's over the exchange socket.
struct Link {
  ibv_device** list = nullptr;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* ch = nullptr;  ///< --events
  ibv_cq* cq = nullptr;
  ibv_mr* mr = nullptr;
  ibv_qp* qp = nullptr;
  ibv_srq* srq = nullptr;  ///< --srq: the QP's receives come from it
  ibv_ah* ah = nullptr;   ///< UD: the peer's address
  uint32_t peer_qpn = 0;  ///< UD
  int sock = -1;
  std::vector<uint8_t> buf;

  void post_recv(uint64_t slot, uint32_t size) {
    ibv_sge s{reinterpret_cast<uintptr_t>(&buf[slot * size]), size, mr->lkey};
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = slot;
    wr.sg_list = &s;
    wr.num_sge = 1;
    if (srq ? ibv_post_srq_recv(srq, &wr, &bad) : ibv_post_recv(qp, &wr, &bad)) die("post_recv");
  }
  void post_send(uint64_t id, const uint8_t* p, uint32_t len, unsigned flags) {
    ibv_sge s{reinterpret_cast<uintptr_t>(p), len, mr->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = id;
    wr.sg_list = &s;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED | flags;
    if (ah) wr.wr.ud = {ah, peer_qpn, kQkey};
    if (ibv_post_send(qp, &wr, &bad)) die("post_send");
  }
  /// --events: one completion event, if it comes within `ms`; true if it came.
  bool event(int ms) {
    pollfd p{ch->fd, POLLIN, 0};
    if (::poll(&p, 1, ms) != 1) return false;
    ibv_cq* ev_cq = nullptr;
    void* ev_ctx = nullptr;
    if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx)) die("get_cq_event");
    ibv_ack_cq_events(ev_cq, 1);
    return true;
  }
  /// --events, with the CQ found empty: arms it, polls once more, then sleeps until an event
  /// (at most 2 s); returns what a poll then finds.
  int sleep_poll(ibv_wc* wc, int n) {
    if (ibv_req_notify_cq(cq, 0)) die("req_notify_cq");
    int got = ibv_poll_cq(cq, n, wc);
    if (got != 0) return got;
    if (event(2000)) return ibv_poll_cq(cq, n, wc);
    got = ibv_poll_cq(cq, n, wc);
    if (got > 0 && !event(1000)) {
      std::fprintf(stderr, "rc_stream: lost event (a completion in the armed CQ, no event)\n");
      std::exit(1);
    }
    return got;
  }
  /// Polls until one completion, which must be a success.
  ibv_wc wait() {
    ibv_wc wc{};
    int got;
    unsigned empty = 0;
    while ((got = ibv_poll_cq(cq, 1, &wc)) == 0) idle_nap(empty);
    if (got < 0) die("poll_cq");
    if (wc.status != IBV_WC_SUCCESS) {
      report_failure(wc.wr_id, wc.status);
      std::exit(1);
    }
    return wc;
  }
  void sync(const char* what) {
    char go = 'g';
    if (::write(sock, &go, 1) != 1 || ::read(sock, &go, 1) != 1) die(what);
  }
  int close(int rc) {
    ::close(sock);
    ibv_destroy_qp(qp);
    if (srq) ibv_destroy_srq(srq);
    if (ah) ibv_destroy_ah(ah);
    ibv_dereg_mr(mr);
    ibv_destroy_cq(cq);
    if (ch) ibv_destroy_comp_channel(ch);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    ibv_free_device_list(list);
    return rc;
  }
};

/// Opens the device, makes the QP (with `recvs` receives of `size` bytes posted before the
/// peer can send) and connects it to the peer's through the exchange.
void connect(Link& l, bool server, const char* host, int port, uint32_t size, int recvs,
             uint32_t max_inline) {
  int nd = 0;
  l.list = ibv_get_device_list(&nd);
  if (!l.list || nd < 1) die("no device");
  l.ctx = ibv_open_device(l.list[0]);
  l.pd = l.ctx ? ibv_alloc_pd(l.ctx) : nullptr;
  if (g_events && l.pd && !(l.ch = ibv_create_comp_channel(l.ctx))) die("creating a channel");
  l.cq = l.pd ? ibv_create_cq(l.ctx, 2 * kDepth, nullptr, l.ch, 0) : nullptr;
  l.buf.resize(std::max(l.buf.size(), size_t{size} * kDepth));  // (ud_stream's is larger)
  l.mr = l.cq ? ibv_reg_mr(l.pd, l.buf.data(), l.buf.size(), IBV_ACCESS_LOCAL_WRITE) : nullptr;
  if (!l.mr) die("setting up PD/CQ/MR");
  ibv_qp_init_attr qa{};
  qa.send_cq = l.cq;
  qa.recv_cq = l.cq;
  qa.qp_type = g_ud ? IBV_QPT_UD : IBV_QPT_RC;
  qa.cap = {kDepth, kDepth, 1, 1, max_inline};
  if (g_srq) {
    ibv_srq_init_attr sa{};
    sa.attr.max_wr = kDepth;
    sa.attr.max_sge = 1;
    if (!(l.srq = ibv_create_srq(l.pd, &sa))) die("creating the SRQ");
    qa.srq = l.srq;
  }
  l.qp = ibv_create_qp(l.pd, &qa);
  ibv_port_attr pa{};
  if (!l.qp || ibv_query_port(l.ctx, 1, &pa)) die("creating QP");
  Dest me{pa.lid, l.qp->qp_num, static_cast<uint32_t>(std::random_device{}() & 0xffffff)}, peer{};

  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qkey = kQkey;
  if (ibv_modify_qp(l.qp, &a,
                    IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                        (g_ud ? IBV_QP_QKEY : IBV_QP_ACCESS_FLAGS)))
    die("INIT");
  for (int k = 0; k < recvs; ++k) l.post_recv(k, size);  // so the first SEND finds one
  l.sock = exchange(server, host, port, me, peer);
  if (g_ud) {
    ibv_ah_attr ah{};
    ah.dlid = static_cast<uint16_t>(peer.lid);
    ah.port_num = 1;
    l.ah = ibv_create_ah(l.pd, &ah);
    l.peer_qpn = peer.qpn;
    a = {};
    a.qp_state = IBV_QPS_RTR;
    if (!l.ah || ibv_modify_qp(l.qp, &a, IBV_QP_STATE)) die("UD RTR");
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = me.psn;
    if (ibv_modify_qp(l.qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN)) die("UD RTS");
    l.sync("sync");
    return;
  }
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = peer.qpn;
  a.rq_psn = peer.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = static_cast<uint16_t>(peer.lid);
  a.ah_attr.port_num = 1;
  if (ibv_modify_qp(l.qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    die("RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = g_timeout;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = me.psn;
  a.max_rd_atomic = 1;
  if (ibv_modify_qp(l.qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    die("RTS");
  l.sync("sync");  // both sides are ready before the first message
}

/// The stream (see the top).
int stream(bool server, const char* host, int port, uint64_t n, uint32_t size) {
  if (size < 8) die("SIZE must be at least 8");
  const bool open_ended = n == 0;
  if (open_ended) {
    n = std::numeric_limits<uint64_t>::max();
    if (!server) std::signal(SIGUSR1, on_stop);
  }
  Link l;
  connect(l, server, host, port, size, server ? kDepth : 0, 0);
  uint64_t sum = 0xcbf29ce484222325ull, done = 0, posted = 0;
  int inflight = 0;
  uint64_t idle = 0;
  unsigned empty_polls = 0;
  double last = 0;  // when the last completion came (--stall-ms)
  ibv_wc wc[16];
  while (done < n) {
    if (!server && open_ended && g_stop && n != posted) n = posted;  // drain what is in flight
    if (done >= n) break;
    while (!server && inflight < g_depth && posted < n) {
      uint8_t* p = &l.buf[(posted % kDepth) * size];
      fill(p, size, posted);
      sum = fnv(sum, p, size);
      l.post_send(posted, p, size, 0);
      ++posted;
      ++inflight;
    }
    int got = ibv_poll_cq(l.cq, 16, wc);
    if (got == 0 && g_events) got = l.sleep_poll(wc, 16);
    if (got < 0) die("poll_cq");
    if (got == 0 && !g_events) idle_nap(empty_polls);
    if (got > 0) empty_polls = 0;
    if (got > 0 && g_stall_ms > 0) {
      const double now = mono_s();
      if (last > 0 && (now - last) * 1000 >= static_cast<double>(g_stall_ms))
        std::fprintf(stderr, "rc_stream: stall of %.3f s ended at %s\n", now - last,
                     epoch_now().c_str());
      last = now;
    }
    if (server && open_ended && got == 0 && (g_events || ++idle % 64 == 0)) {
      // Has the client said how many it sent?
      uint64_t total;
      if (::recv(l.sock, &total, sizeof(total), MSG_PEEK | MSG_DONTWAIT) == sizeof(total)) {
        if (::recv(l.sock, &total, sizeof(total), MSG_WAITALL) != sizeof(total)) die("count");
        if (total < done) {
          std::fprintf(stderr, "rc_stream: received %" PRIu64 " messages, %" PRIu64 " sent\n", done,
                       total);
          return l.close(1);
        }
        n = total;
      }
    }
    for (int k = 0; k < got; ++k) {
      if (wc[k].status != IBV_WC_SUCCESS) {
        report_failure(done, wc[k].status);
        return l.close(1);
      }
      if (server) {
        const uint8_t* p = &l.buf[wc[k].wr_id * size];
        uint64_t seq;
        std::memcpy(&seq, p, 8);
        if (wc[k].byte_len != size || seq != done) {
          std::fprintf(stderr, "rc_stream: message %" PRIu64 " carries #%" PRIu64 " (%u bytes)\n",
                       done, seq, wc[k].byte_len);
          return l.close(1);
        }
        sum = fnv(sum, p, size);
        l.post_recv(wc[k].wr_id, size);
      } else {
        if (wc[k].wr_id != done) die("send completions out of order");
        --inflight;
      }
      ++done;
    }
  }
  if (!server && open_ended && ::write(l.sock, &n, sizeof(n)) != sizeof(n))
    die("sending the count");
  std::printf("%s %" PRIu64 " messages of %u bytes, checksum %016" PRIx64 "\n",
              server ? "received" : "sent", n, size, sum);
  std::fflush(stdout);
  // The server's last receive may complete after the client's last send completion: wait.
  l.sync("final sync");
  return l.close(0);
}

/// The RNR test (see the top). Slots: 0 and 1 receive, 2 and 3 send.
int rnr(bool server, const char* host, int port) {
  constexpr uint32_t kSize = 64;
  constexpr uint64_t kA = 0xa1a1a1a1a1a1a1a1ull, kB = 0xb2b2b2b2b2b2b2b2ull;
  Link l;
  connect(l, server, host, port, kSize, 1, 16);
  uint8_t* out = &l.buf[2 * kSize];
  uint8_t* out2 = &l.buf[3 * kSize];
  // Warm-up: each side keeps one receive posted while a message is to come, and none after
  // (counted by receives: a send completion and the next receive come in either order).
  int recvd = 0, sends = 0;
  if (!server) l.post_send(2, out, kSize, 0);
  while (recvd < kWarmup || sends < kWarmup) {
    if (l.wait().opcode != IBV_WC_RECV) {
      ++sends;
      continue;
    }
    ++recvd;
    if (recvd < kWarmup) l.post_recv(0, kSize);
    // The server answers every ping; the client pings again until it has sent kWarmup.
    if (server || recvd < kWarmup) l.post_send(2, out, kSize, 0);
  }
  if (!server) {
    // A test that needs a path in force (the direct one) opens this gate once it is.
    if (const char* gate = std::getenv("RC_STREAM_GATE")) {
      int waited_ms = 0;
      for (; ::access(gate, F_OK) != 0 && waited_ms < 30000; waited_ms += 10) ::usleep(10000);
      if (waited_ms >= 30000) die("the gate never opened");
    }
    std::memcpy(out, &kA, 8);
    l.post_send(10, out, 8, IBV_SEND_INLINE);
    std::memset(out, 0xee, 8);  // inline: the WR took the bytes at its post
    fill(out2, kSize, 2);
    l.post_send(11, out2, kSize, 0);
    char sent = 's';
    if (::write(l.sock, &sent, 1) != 1) die("sync");
    l.post_recv(1, kSize);
    uint64_t b = 0;
    for (int got = 0; got < 3; ++got) {
      const ibv_wc wc = l.wait();
      if (wc.opcode == IBV_WC_RECV) std::memcpy(&b, &l.buf[1 * kSize], 8);
    }
    if (b != kB) die("B arrived wrong");
  } else {
    char sent;
    if (::read(l.sock, &sent, 1) != 1) die("sync");
    ::usleep(100 * 1000);  // A and A2 are there, and find no receive
    std::memcpy(out, &kB, 8);
    l.post_send(20, out, kSize, 0);
    if (l.wait().wr_id != 20) die("B's completion is not the first");
    l.post_recv(0, 8);
    l.post_recv(1, kSize);
    const ibv_wc a = l.wait(), a2 = l.wait();
    uint64_t va = 0;
    std::memcpy(&va, &l.buf[0], 8);
    std::vector<uint8_t> want(kSize);
    fill(want.data(), kSize, 2);
    if (a.wr_id != 0 || a.byte_len != 8 || va != kA) die("A arrived wrong (or not first)");
    if (a2.wr_id != 1 || a2.byte_len != kSize || std::memcmp(&l.buf[kSize], want.data(), kSize))
      die("A2 arrived wrong");
  }
  std::printf("rnr: ok\n");
  std::fflush(stdout);
  l.sync("final sync");
  return l.close(0);
}

/// The UD stream (see the top). Slots: 0 to kDepth-1 receive (GRH + SIZE), kDepth sends.
int ud_stream(bool server, const char* host, int port, uint32_t size) {
  if (size < 8 || size > 4096) die("SIZE: 8 to 4096");
  g_ud = true;
  if (!server) std::signal(SIGUSR1, on_stop);
  const uint32_t slot = kGrh + size;
  Link l;
  l.buf.resize(size_t{slot} * (kDepth + 1));  // connect keeps it
  connect(l, server, host, port, slot, kDepth, 0);
  uint8_t* out = &l.buf[size_t{slot} * kDepth];
  std::vector<uint8_t> want(size);
  uint64_t sent = 0, echoed = 0, received = 0, next = 0, total = UINT64_MAX;
  ibv_wc wc[16];
  // One completion pass: receives checked (server) or matched with `wanted` (client); true
  // when the client's echo of `wanted` came.
  auto pass = [&](uint64_t wanted) {
    bool got_it = false;
    const int got = ibv_poll_cq(l.cq, 16, wc);
    if (got < 0) die("poll_cq");
    for (int k = 0; k < got; ++k) {
      if (wc[k].status != IBV_WC_SUCCESS) {
        report_failure(wc[k].wr_id, wc[k].status);
        std::exit(1);
      }
      if (wc[k].opcode != IBV_WC_RECV) continue;  // a send's completion
      const uint8_t* p = &l.buf[wc[k].wr_id * slot + kGrh];
      uint64_t seq;
      std::memcpy(&seq, p, 8);
      if (server) {
        fill(want.data(), size, seq);
        if (wc[k].byte_len != slot || (received > 0 && seq < next) ||
            std::memcmp(p, want.data(), size) != 0) {
          std::fprintf(stderr, "ud: datagram #%" PRIu64 " after #%" PRIu64 " (%u bytes)%s\n", seq,
                       next - 1, wc[k].byte_len,
                       received > 0 && seq < next ? ": duplicated or reordered" : ": corrupt");
          std::exit(1);
        }
        next = seq + 1;
        if (++received % 1000 == 0) {
          std::printf("ud: received %" PRIu64 "\n", received);
          std::fflush(stdout);
        }
        std::memcpy(out, &seq, 8);
        l.post_send(seq, out, 8, IBV_SEND_INLINE);
      } else if (seq == wanted) {
        got_it = true;
      }
      l.post_recv(wc[k].wr_id, slot);
    }
    return got_it;
  };
  if (server) {
    for (uint64_t idle = 1;; ++idle) {
      pass(0);
      uint64_t n;
      if (idle % 256 == 0 && ::recv(l.sock, &n, sizeof(n), MSG_PEEK | MSG_DONTWAIT) == sizeof(n)) {
        if (::recv(l.sock, &n, sizeof(n), MSG_WAITALL) != sizeof(n)) die("count");
        total = n;
        const double until = mono_s() + 0.2;  // the last echoes' receives
        while (mono_s() < until) pass(0);
        break;
      }
    }
    if (received > total || received == 0) {
      std::fprintf(stderr, "ud: received %" PRIu64 " of %" PRIu64 " sent\n", received, total);
      return l.close(1);
    }
    std::printf("ud: received %" PRIu64 " of %" PRIu64 " sent (%" PRIu64
                " lost), each once, in order, intact\n",
                received, total, total - received);
  } else {
    for (; !g_stop; ++sent) {
      fill(out, size, sent);
      l.post_send(sent, out, size, 0);
      const double until = mono_s() + 0.2;
      bool ok = false;
      while (!ok && mono_s() < until) ok = pass(sent);
      echoed += ok;
    }
    if (::write(l.sock, &sent, sizeof(sent)) != sizeof(sent)) die("sending the count");
    std::printf("ud: sent %" PRIu64 ", %" PRIu64 " echoed\n", sent, echoed);
  }
  std::fflush(stdout);
  l.sync("final sync");
  return l.close(0);
}

}  // namespace

int main(int argc, char** argv) {
  // The options go; the positional arguments stay, in order, for the modes below.
  int kept = 1;
  for (int k = 1; k < argc; ++k) {
    const std::string arg = argv[k];
    if (arg == "--events") {
      g_events = true;
      continue;
    }
    if (arg == "--srq") {
      g_srq = true;
      continue;
    }
    if ((arg == "--timeout" || arg == "--stall-ms" || arg == "--depth") && k + 1 < argc) {
      const long v = std::strtol(argv[++k], nullptr, 10);
      if (arg == "--timeout") {
        if (v < 0 || v > 31) die("--timeout: 0 to 31");
        g_timeout = static_cast<uint8_t>(v);
      } else if (arg == "--depth") {
        if (v < 1 || v > kDepth) die("--depth: 1 to 32");
        g_depth = static_cast<int>(v);
      } else {
        g_stall_ms = v;
      }
      continue;
    }
    argv[kept++] = argv[k];
  }
  argc = kept;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "server" && argc == 5)
    return stream(true, nullptr, std::atoi(argv[2]), std::strtoull(argv[3], nullptr, 10),
                  static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 10)));
  if (mode == "client" && argc == 6)
    return stream(false, argv[2], std::atoi(argv[3]), std::strtoull(argv[4], nullptr, 10),
                  static_cast<uint32_t>(std::strtoul(argv[5], nullptr, 10)));
  if (mode == "rnr-server" && argc == 3) return rnr(true, nullptr, std::atoi(argv[2]));
  if (mode == "ud-server" && argc == 4)
    return ud_stream(true, nullptr, std::atoi(argv[2]),
                     static_cast<uint32_t>(std::strtoul(argv[3], nullptr, 10)));
  if (mode == "ud-client" && argc == 5)
    return ud_stream(false, argv[2], std::atoi(argv[3]),
                     static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 10)));
  if (mode == "rnr-client" && argc == 4) return rnr(false, argv[2], std::atoi(argv[3]));
  die("usage: rc_stream server PORT N SIZE | client HOST PORT N SIZE | rnr-server PORT |"
      " rnr-client HOST PORT | ud-server PORT SIZE | ud-client HOST PORT SIZE; options:"
      " --timeout N, --stall-ms MS, --depth N, --events");
}
