/* The synchronous rdma_cm API (ids without a channel): rdma_getaddrinfo, rdma_create_ep,
 * rdma_get_request, rdma_accept/rdma_connect with private data, the rdma_verbs.h inlines
 * (rdma_reg_msgs, rdma_post_send/recv, rdma_get_send/recv_comp), rdma_disconnect and
 * rdma_destroy_ep; bad input: private data over the limit, an event acked twice; 200 ids destroyed
 * in a row (their commands posted, the answers read past later), then a call that must get its own
 * answer. Buffers are on
 * the heap (Debian's rdma_server/rdma_client, case sync_tools, use static ones).
 * Usage: cm_sync_ep server PORT | cm_sync_ep client HOST PORT. Exit 0 when the echo came back. */
#include <arpa/inet.h>
#include <errno.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int die(const char* what) {
  perror(what);
  return 1;
}

/* rdma_destroy_id does not wait for the backend's answer: after many in a row, a bind (whose
 * answer carries the address) still reads its own. 0 when it did. */
static int many_destroyed(void) {
  struct rdma_event_channel* ch = rdma_create_event_channel();
  struct rdma_cm_id* ids[200];
  if (!ch) return die("rdma_create_event_channel");
  for (int i = 0; i < 200; ++i)
    if (rdma_create_id(ch, &ids[i], NULL, RDMA_PS_TCP)) return die("rdma_create_id");
  for (int i = 0; i < 200; ++i)
    if (rdma_destroy_id(ids[i])) return die("rdma_destroy_id");
  struct rdma_cm_id* id;
  struct sockaddr_in sin;
  memset(&sin, 0, sizeof(sin));
  sin.sin_family = AF_INET;
  sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) return die("rdma_create_id");
  if (rdma_bind_addr(id, (struct sockaddr*)&sin)) return die("rdma_bind_addr after 200 destroys");
  if (rdma_get_src_port(id) == 0) {
    fprintf(stderr, "bound without a port\n");
    return 1;
  }
  rdma_destroy_id(id);
  rdma_destroy_event_channel(ch);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const int server = strcmp(argv[1], "server") == 0;
  if (!server && many_destroyed()) return 1;
  struct rdma_addrinfo hints, *res;
  memset(&hints, 0, sizeof(hints));
  hints.ai_port_space = RDMA_PS_TCP;
  if (server) hints.ai_flags = RAI_PASSIVE;
  if (rdma_getaddrinfo(server ? NULL : argv[2], argv[server ? 2 : 3], &hints, &res))
    return die("rdma_getaddrinfo");
  struct ibv_qp_init_attr attr;
  memset(&attr, 0, sizeof(attr));
  attr.cap.max_send_wr = attr.cap.max_recv_wr = 1;
  attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
  attr.sq_sig_all = 1;
  struct rdma_cm_id *listen_id = NULL, *id;
  if (server) {
    if (rdma_create_ep(&listen_id, res, NULL, &attr)) return die("rdma_create_ep");
    if (rdma_listen(listen_id, 0)) return die("rdma_listen");
    if (rdma_get_request(listen_id, &id)) return die("rdma_get_request");
    const struct rdma_conn_param* p = &id->event->param.conn;
    if (p->private_data_len < 5 || memcmp(p->private_data, "knock", 5) != 0) {
      fprintf(stderr, "no private data in the request\n");
      return 1;
    }
  } else if (rdma_create_ep(&id, res, NULL, &attr)) {
    return die("rdma_create_ep");
  }
  rdma_freeaddrinfo(res);
  if (!id->qp || !id->send_cq || !id->recv_cq_channel) {
    fprintf(stderr, "the endpoint has no QP or CQs\n");
    return 1;
  }
  char* buf = calloc(1, 64);
  struct ibv_mr* mr = rdma_reg_msgs(id, buf, 64);
  if (!mr) return die("rdma_reg_msgs");
  if (rdma_post_recv(id, NULL, buf, 64, mr)) return die("rdma_post_recv");
  struct ibv_wc wc;
  if (server) {
    if (rdma_accept(id, NULL)) return die("rdma_accept");
    if (rdma_get_recv_comp(id, &wc) <= 0 || wc.status) return die("rdma_get_recv_comp");
    memcpy(buf, "echo", 4); /* "hello" comes back as "echoo" */
    if (rdma_post_send(id, NULL, buf, wc.byte_len, mr, 0)) return die("rdma_post_send");
    if (rdma_get_send_comp(id, &wc) <= 0 || wc.status) return die("rdma_get_send_comp");
  } else {
    struct rdma_conn_param cp;
    memset(&cp, 0, sizeof(cp));
    /* Over the REQ's 56 bytes of an IP port space: refused, nothing sent. */
    char big[57] = "knock";
    cp.private_data = big;
    cp.private_data_len = sizeof(big);
    if (rdma_connect(id, &cp) == 0 || errno != EINVAL) {
      fprintf(stderr, "57 bytes of private data were not refused with EINVAL\n");
      return 1;
    }
    cp.private_data_len = 5;
    cp.retry_count = 7;
    cp.rnr_retry_count = 7;
    if (rdma_connect(id, &cp)) {
      perror("rdma_connect");
      if (id->event && id->event->event == RDMA_CM_EVENT_REJECTED)
        fprintf(stderr, "%s\n", rdma_event_str(id->event->event));
      return 1;
    }
    /* The ESTABLISHED event kept in id->event, acked twice: the second ack is EINVAL. */
    struct rdma_cm_event* e = id->event;
    id->event = NULL;
    if (!e || e->event != RDMA_CM_EVENT_ESTABLISHED || rdma_ack_cm_event(e) != 0 ||
        rdma_ack_cm_event(e) == 0 || errno != EINVAL) {
      fprintf(stderr, "the event was not ESTABLISHED, or a second ack was not EINVAL\n");
      return 1;
    }
    char* out = calloc(1, 64);
    struct ibv_mr* omr = rdma_reg_msgs(id, out, 64);
    if (!omr) return die("rdma_reg_msgs");
    memcpy(out, "hello", 6);
    if (rdma_post_send(id, NULL, out, 6, omr, 0)) return die("rdma_post_send");
    if (rdma_get_send_comp(id, &wc) <= 0 || wc.status) return die("rdma_get_send_comp");
    if (rdma_get_recv_comp(id, &wc) <= 0 || wc.status) return die("rdma_get_recv_comp");
    if (wc.byte_len != 6 || strcmp(buf, "echoo") != 0) {
      fprintf(stderr, "got '%s' (%u bytes)\n", buf, wc.byte_len);
      return 1;
    }
    rdma_dereg_mr(omr);
    free(out);
  }
  rdma_disconnect(id);
  rdma_dereg_mr(mr);
  free(buf);
  rdma_destroy_ep(id);
  if (listen_id) rdma_destroy_ep(listen_id);
  printf("%s: ok\n", argv[1]);
  return 0;
}
