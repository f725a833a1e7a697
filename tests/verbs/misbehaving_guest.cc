// A misbehaving but live guest, for tests/e2e/misbehave.sh (no Debian tool misbehaves on
// purpose). Modes, each for SECONDS:
//   no-poll       posts signaled UD sends to itself and never polls its CQ: the CQ overruns;
//                 prints "CQ_ERR" when the async event arrives (exit 0 only if it did)
//   post-forever  8 UD QPs posting in a tight loop (polling just enough to keep posting)
//   doorbells     writes to every eventfd it holds (the backend's doorbell) in a tight loop
// Usage: vrdma_misbehave MODE SECONDS   (run through `vrdma run`)
#include <dirent.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "qp_setup.h"

namespace {

using Clock = std::chrono::steady_clock;

struct UdLoop {
  ibv_qp* qp = nullptr;
  ibv_ah* ah = nullptr;
};

UdLoop make_ud(ibv_pd* pd, ibv_cq* cq, uint16_t lid) {
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_UD;
  qa.cap = {64, 1, 1, 1, 64};
  UdLoop u;
  u.qp = ibv_create_qp(pd, &qa);
  if (!u.qp) return u;
  if (vrdma::test::bring_to_rts(u.qp, vrdma::test::QpPath{})) return {};
  ibv_ah_attr ah{};
  ah.dlid = lid;
  ah.port_num = 1;
  u.ah = ibv_create_ah(pd, &ah);
  return u;
}

/// One inline, signaled datagram to the QP itself (nobody receives: it is dropped).
int post_one(const UdLoop& u, uint32_t qpn) {
  static char payload[16] = "misbehave";
  ibv_sge s{reinterpret_cast<uintptr_t>(payload), sizeof(payload), 0};
  ibv_send_wr wr{};
  wr.sg_list = &s;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  wr.wr.ud = {u.ah, qpn, vrdma::test::kTestQkey};
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(u.qp, &wr, &bad);
}

bool cq_err_seen(ibv_context* ctx) {
  pollfd p{ctx->async_fd, POLLIN, 0};
  while (::poll(&p, 1, 0) == 1) {
    ibv_async_event ev{};
    if (ibv_get_async_event(ctx, &ev)) return false;
    const bool hit = ev.event_type == IBV_EVENT_CQ_ERR;
    ibv_ack_async_event(&ev);
    if (hit) return true;
  }
  return false;
}

void flood_doorbells(Clock::time_point end) {
  std::vector<int> fds;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) {
      char link[64] = {};
      const std::string path = std::string("/proc/self/fd/") + e->d_name;
      if (::readlink(path.c_str(), link, sizeof(link) - 1) > 0 &&
          std::strcmp(link, "anon_inode:[eventfd]") == 0)
        fds.push_back(std::atoi(e->d_name));
    }
    ::closedir(d);
  }
  std::printf("flooding %zu eventfd(s)\n", fds.size());
  uint64_t writes = 0, one = 1;
  while (Clock::now() < end) {
    for (int fd : fds) writes += ::write(fd, &one, sizeof(one)) == sizeof(one);
  }
  std::printf("doorbell writes: %lu\n", static_cast<unsigned long>(writes));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s no-poll|post-forever|doorbells SECONDS\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const auto end = Clock::now() + std::chrono::seconds(std::atoi(argv[2]));
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ibv_context* ctx = list && n == 1 ? ibv_open_device(list[0]) : nullptr;
  if (!ctx) return 3;
  ibv_port_attr pa{};
  ibv_pd* pd = ibv_alloc_pd(ctx);
  if (!pd || ibv_query_port(ctx, 1, &pa)) return 4;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  if (mode == "doorbells") {
    flood_doorbells(end);
    return 0;
  }
  const bool poll_cq = mode == "post-forever";
  ibv_cq* cq = ibv_create_cq(ctx, poll_cq ? 1024 : 16, nullptr, nullptr, 0);
  if (!cq) return 5;
  std::vector<UdLoop> qps(poll_cq ? 8 : 1);
  for (UdLoop& u : qps) {
    u = make_ud(pd, cq, pa.lid);
    if (!u.qp || !u.ah) return 6;
  }
  uint64_t posted = 0;
  bool cq_err = false;
  while (Clock::now() < end) {
    for (UdLoop& u : qps) posted += post_one(u, u.qp->qp_num) == 0;
    if (poll_cq) {
      ibv_wc wc[64];
      while (ibv_poll_cq(cq, 64, wc) > 0) {
      }
    } else if (!cq_err && cq_err_seen(ctx)) {
      cq_err = true;
      std::printf("CQ_ERR after %lu posts\n", static_cast<unsigned long>(posted));
    }
  }
  std::printf("%s: %lu sends posted\n", mode.c_str(), static_cast<unsigned long>(posted));
  return poll_cq || cq_err ? 0 : 1;
}
