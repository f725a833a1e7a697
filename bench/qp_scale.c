// QP scale on one backend (bench/qp_scale.sh runs it): creates N RC QPs on one context (one
// PD, one shared CQ, depth 1 each), connects them in pairs to each other (QP 2i <-> 2i+1, same
// port LID) through INIT -> RTR -> RTS, and prints the creation rate and the connect rate (QPs
// brought to RTS per second). Then it prints "holding" and waits until the file HOLD exists
// (the script reads vrdmad's RSS meanwhile), destroys them all and prints that rate.
// Usage: qp_scale N HOLD_FILE
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char* what, int i) {
  fprintf(stderr, "qp_scale: %s (QP %d): %s\n", what, i, strerror(errno));
  exit(1);
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: qp_scale N HOLD_FILE\n");
    return 2;
  }
  const int n = atoi(argv[1]) & ~1;
  struct ibv_device** devs = ibv_get_device_list(NULL);
  if (!devs || !devs[0]) die("no device", -1);
  struct ibv_context* ctx = ibv_open_device(devs[0]);
  if (!ctx) die("ibv_open_device", -1);
  struct ibv_port_attr port;
  if (ibv_query_port(ctx, 1, &port)) die("ibv_query_port", -1);
  struct ibv_pd* pd = ibv_alloc_pd(ctx);
  struct ibv_cq* cq = ibv_create_cq(ctx, 4096, NULL, NULL, 0);
  if (!pd || !cq) die("pd/cq", -1);
  struct ibv_qp** qp = calloc((size_t)n, sizeof(*qp));

  double t0 = now_s();
  for (int i = 0; i < n; ++i) {
    struct ibv_qp_init_attr a = {
        .send_cq = cq,
        .recv_cq = cq,
        .cap = {.max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC};
    qp[i] = ibv_create_qp(pd, &a);
    if (!qp[i]) die("ibv_create_qp", i);
  }
  const double create_s = now_s() - t0;

  t0 = now_s();
  for (int i = 0; i < n; ++i) {
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT,
                            .port_num = 1,
                            .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ};
    if (ibv_modify_qp(qp[i], &a,
                      IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
      die("INIT", i);
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = qp[i ^ 1]->qp_num;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = port.lid;
    a.ah_attr.port_num = 1;
    if (ibv_modify_qp(qp[i], &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      die("RTR", i);
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    if (ibv_modify_qp(qp[i], &a,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                          IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
      die("RTS", i);
  }
  const double connect_s = now_s() - t0;
  printf("qps %d create_per_s %.0f connect_per_s %.0f\n", n, n / create_s, n / connect_s);
  printf("holding\n");
  fflush(stdout);
  while (access(argv[2], F_OK) != 0) usleep(10000);

  t0 = now_s();
  for (int i = 0; i < n; ++i) {
    if (ibv_destroy_qp(qp[i])) die("ibv_destroy_qp", i);
  }
  printf("destroy_per_s %.0f\n", n / (now_s() - t0));
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(devs);
  free(qp);
  return 0;
}
