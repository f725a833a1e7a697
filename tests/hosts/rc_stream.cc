// A verifying RC stream for the fault tests: the client SENDs N messages of SIZE bytes (message i
// holds i in its first 8 bytes, then bytes from a PRNG seeded with i) with up to 32 in flight;
// the server checks that message i arrives i-th with the right length, and both print an FNV-1a
// checksum of every byte they moved. Equal checksums and no complaint: nothing lost, nothing
// duplicated, nothing reordered or corrupted. Plain verbs, no vrdma headers.
// N = 0 (on both sides): open-ended; the client runs until SIGUSR1, then stops posting, waits for
// its messages in flight and tells the server how many it sent (over the exchange socket).
// Usage: rc_stream server PORT N SIZE | rc_stream client HOST PORT N SIZE
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

constexpr int kDepth = 32;

volatile std::sig_atomic_t g_stop = 0;
void on_stop(int) { g_stop = 1; }

struct Dest {
  uint32_t lid, qpn, psn;
};

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

}  // namespace

int main(int argc, char** argv) {
  const bool server = argc == 5 && std::strcmp(argv[1], "server") == 0;
  if (!server && !(argc == 6 && std::strcmp(argv[1], "client") == 0))
    die("usage: rc_stream server PORT N SIZE | client HOST PORT N SIZE");
  const char* host = server ? nullptr : argv[2];
  const int port = std::atoi(argv[server ? 2 : 3]);
  uint64_t n = std::strtoull(argv[server ? 3 : 4], nullptr, 10);
  const bool open_ended = n == 0;
  if (open_ended) {
    n = std::numeric_limits<uint64_t>::max();
    if (!server) std::signal(SIGUSR1, on_stop);
  }
  const uint32_t size = static_cast<uint32_t>(std::strtoul(argv[server ? 4 : 5], nullptr, 10));
  if (size < 8) die("SIZE must be at least 8");

  int nd = 0;
  ibv_device** list = ibv_get_device_list(&nd);
  if (!list || nd < 1) die("no device");
  ibv_context* ctx = ibv_open_device(list[0]);
  ibv_pd* pd = ctx ? ibv_alloc_pd(ctx) : nullptr;
  ibv_cq* cq = pd ? ibv_create_cq(ctx, 2 * kDepth, nullptr, nullptr, 0) : nullptr;
  std::vector<uint8_t> buf(size_t{size} * kDepth);
  ibv_mr* mr = cq ? ibv_reg_mr(pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE) : nullptr;
  if (!mr) die("setting up PD/CQ/MR");
  ibv_qp_init_attr qa{};
  qa.send_cq = cq;
  qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap = {kDepth, kDepth, 1, 1, 0};
  ibv_qp* qp = ibv_create_qp(pd, &qa);
  ibv_port_attr pa{};
  if (!qp || ibv_query_port(ctx, 1, &pa)) die("creating QP");
  Dest me{pa.lid, qp->qp_num, static_cast<uint32_t>(std::random_device{}() & 0xffffff)}, peer{};

  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    die("INIT");
  // Receives first, so the first SEND finds one.
  auto post_recv = [&](uint64_t slot) {
    ibv_sge s{reinterpret_cast<uintptr_t>(&buf[slot * size]), size, mr->lkey};
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = slot;
    wr.sg_list = &s;
    wr.num_sge = 1;
    if (ibv_post_recv(qp, &wr, &bad)) die("post_recv");
  };
  if (server) {
    for (int k = 0; k < kDepth; ++k) post_recv(k);
  }
  const int sock = exchange(server, host, port, me, peer);
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = peer.qpn;
  a.rq_psn = peer.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = static_cast<uint16_t>(peer.lid);
  a.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    die("RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = me.psn;
  a.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    die("RTS");
  // Both sides are ready before the first message.
  char go = 'g';
  if (::write(sock, &go, 1) != 1 || ::read(sock, &go, 1) != 1) die("sync");

  auto teardown = [&](int rc) {
    ::close(sock);
    ibv_destroy_qp(qp);
    ibv_dereg_mr(mr);
    ibv_destroy_cq(cq);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    ibv_free_device_list(list);
    return rc;
  };
  uint64_t sum = 0xcbf29ce484222325ull, done = 0, posted = 0;
  int inflight = 0;
  uint64_t idle = 0;
  ibv_wc wc[16];
  while (done < n) {
    if (!server && open_ended && g_stop && n != posted) n = posted;  // drain what is in flight
    if (done >= n) break;
    while (!server && inflight < kDepth && posted < n) {
      const uint64_t slot = posted % kDepth;
      uint8_t* p = &buf[slot * size];
      fill(p, size, posted);
      sum = fnv(sum, p, size);
      ibv_sge s{reinterpret_cast<uintptr_t>(p), size, mr->lkey};
      ibv_send_wr wr{}, *bad = nullptr;
      wr.wr_id = posted;
      wr.sg_list = &s;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_SEND;
      wr.send_flags = IBV_SEND_SIGNALED;
      if (ibv_post_send(qp, &wr, &bad)) die("post_send");
      ++posted;
      ++inflight;
    }
    const int got = ibv_poll_cq(cq, 16, wc);
    if (got < 0) die("poll_cq");
    if (server && open_ended && got == 0 && ++idle % 64 == 0) {
      // Has the client said how many it sent?
      uint64_t total;
      if (::recv(sock, &total, sizeof(total), MSG_PEEK | MSG_DONTWAIT) == sizeof(total)) {
        if (::recv(sock, &total, sizeof(total), MSG_WAITALL) != sizeof(total)) die("count");
        if (total < done) {
          std::fprintf(stderr, "rc_stream: received %" PRIu64 " messages, %" PRIu64 " sent\n", done,
                       total);
          return teardown(1);
        }
        n = total;
      }
    }
    for (int k = 0; k < got; ++k) {
      if (wc[k].status != IBV_WC_SUCCESS) {
        std::fprintf(stderr, "rc_stream: completion %" PRIu64 " failed: %s\n", done,
                     ibv_wc_status_str(wc[k].status));
        return teardown(1);
      }
      if (server) {
        const uint8_t* p = &buf[wc[k].wr_id * size];
        uint64_t seq;
        std::memcpy(&seq, p, 8);
        if (wc[k].byte_len != size || seq != done) {
          std::fprintf(stderr, "rc_stream: message %" PRIu64 " carries #%" PRIu64 " (%u bytes)\n",
                       done, seq, wc[k].byte_len);
          return teardown(1);
        }
        sum = fnv(sum, p, size);
        post_recv(wc[k].wr_id);
      } else {
        if (wc[k].wr_id != done) die("send completions out of order");
        --inflight;
      }
      ++done;
    }
  }
  if (!server && open_ended && ::write(sock, &n, sizeof(n)) != sizeof(n)) die("sending the count");
  std::printf("%s %" PRIu64 " messages of %u bytes, checksum %016" PRIx64 "\n",
              server ? "received" : "sent", n, size, sum);
  std::fflush(stdout);
  // The server's last receive may complete after the client's last send completion: wait.
  if (::write(sock, &go, 1) != 1 || ::read(sock, &go, 1) != 1) die("final sync");
  return teardown(0);
}
