// First remote touch of an ODP page (issue 24): the latency of a peer's RDMA WRITE of 8 bytes
// into a page of an ODP MR that nothing faulted in yet (the backend asks the library's pager,
// the requester waits as for an RNR NAK, min_rnr_timer 0.01 ms), against the same WRITE into a
// page already in. Two RC QPs of one context, connected to each other. Run through `vrdma run`
// (bench/odp.sh, once as is and once with VRDMA_ODP_WAKE=0: the pager polls every ms).
#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../tests/verbs/qp_setup.h"
#include "verbs_bench.h"

namespace {
using vrdma::bench::Clock;
using vrdma::bench::ms_since;

/// One signaled WRITE of 8 bytes to `raddr`, waited for: its latency in µs, or -1.
double write_us(ibv_qp* qp, ibv_cq* cq, ibv_mr* src, uint64_t raddr, uint32_t rkey) {
  ibv_sge sg{reinterpret_cast<uintptr_t>(src->addr), 8, src->lkey};
  ibv_send_wr wr{};
  ibv_send_wr* bad = nullptr;
  wr.sg_list = &sg;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  const auto t = Clock::now();
  if (ibv_post_send(qp, &wr, &bad)) return -1;
  ibv_wc wc{};
  int n = 0;
  while ((n = ibv_poll_cq(cq, 1, &wc)) == 0) {
  }
  if (n < 0 || wc.status != IBV_WC_SUCCESS) {
    std::fprintf(stderr, "WRITE: %s\n", n < 0 ? "poll failed" : ibv_wc_status_str(wc.status));
    return -1;
  }
  return ms_since(t) * 1000;
}

void report(const char* what, std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::printf("%s: %zu WRITEs, median %.1f us, p90 %.1f us, max %.1f us\n", what, v.size(),
              v[v.size() / 2], v[v.size() * 9 / 10], v.back());
}
}  // namespace

int main() {
  vrdma::bench::OpenDevice dev;
  if (!dev.pd) return 1;
  ibv_port_attr port{};
  if (ibv_query_port(dev.ctx, 1, &port)) return std::perror("ibv_query_port"), 1;
  ibv_cq* cq = ibv_create_cq(dev.ctx, 16, nullptr, nullptr, 0);
  if (!cq) return std::perror("ibv_create_cq"), 1;
  ibv_qp_init_attr ia{};
  ia.send_cq = ia.recv_cq = cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = ia.cap.max_recv_wr = 4;
  ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
  ibv_qp* a = ibv_create_qp(dev.pd, &ia);
  ibv_qp* b = ibv_create_qp(dev.pd, &ia);
  if (!a || !b) return std::perror("ibv_create_qp"), 1;
  vrdma::test::QpPath p;
  p.dlid = port.lid;
  p.dest_qpn = b->qp_num;
  if (int rc = vrdma::test::bring_to_rts(a, p)) return std::printf("RTS: %s\n", strerror(rc)), 1;
  p.dest_qpn = a->qp_num;
  if (int rc = vrdma::test::bring_to_rts(b, p)) return std::printf("RTS: %s\n", strerror(rc)), 1;
  constexpr int kPages = 200;
  constexpr size_t kPage = 4096, kStride = 4 * kPage;  // apart: one fault per WRITE
  const size_t len = kPages * kStride;
  void* target = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (target == MAP_FAILED) return std::perror("mmap"), 1;
  std::memset(target, 1, len);  // resident: the fault costs the pager, not the kernel
  static char src_buf[kPage];
  ibv_mr* src = ibv_reg_mr(dev.pd, src_buf, sizeof(src_buf), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* odp = ibv_reg_mr(dev.pd, target, len,
                           IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_ON_DEMAND);
  if (!src || !odp) return std::perror("ibv_reg_mr"), 1;
  const char* env = std::getenv("VRDMA_ODP_WAKE");
  std::printf("pager: %s\n", env && !std::strcmp(env, "0") ? "polls every ms (VRDMA_ODP_WAKE=0)"
                                                           : "woken by the backend");
  std::vector<double> first, again;
  const auto base = reinterpret_cast<uintptr_t>(target);
  for (int i = 0; i < kPages; ++i) {
    const double f = write_us(a, cq, src, base + i * kStride, odp->rkey);
    const double g = write_us(a, cq, src, base + i * kStride + 64, odp->rkey);
    if (f < 0 || g < 0) return 1;
    first.push_back(f);
    again.push_back(g);
  }
  report("first touch of a page", first);
  report("page already in", again);
  ibv_destroy_qp(a);
  ibv_destroy_qp(b);
  ibv_dereg_mr(odp);
  ibv_dereg_mr(src);
  ibv_destroy_cq(cq);
  ::munmap(target, len);
  return 0;
}
