// Connection setup rate through librdmacm's public API (bench/cm_rate.sh runs it): a client keeps
// WINDOW connects in flight, each resolve_addr -> resolve_route -> connect -> (accept on the
// server) -> ESTABLISHED, then tears the connection down (destroy, the server hears
// DISCONNECTED) and starts the next; it prints connections per second over N. With -q each end
// makes an RC QP per connection (rdma_create_qp), as applications do; without, the CM exchange
// only (the client calls rdma_establish on CONNECT_RESPONSE). The same program measures a plain
// TCP connect/accept rate (--tcp-*: nonblocking connects, WINDOW in flight, closed at once) for
// the comparison row.
// Usage: cm_rate --server ADDR PORT [-n N] [-q] | --client ADDR PORT [-n N] [-w WINDOW] [-q]
//        cm_rate --tcp-server ADDR PORT [-n N] | --tcp-client ADDR PORT [-n N] [-w WINDOW]
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <rdma/rdma_cma.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int n_conns = 10000, window = 32, with_qp = 0;

static void die(const char* what) {
  fprintf(stderr, "cm_rate: %s: %s\n", what, strerror(errno));
  exit(1);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

// ADDR PORT as a sockaddr (IPv4 or IPv6, numeric).
static void parse_addr(const char* addr, const char* port, struct sockaddr_storage* ss,
                       socklen_t* len) {
  struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV}, *ai;
  int rc = getaddrinfo(addr, port, &hints, &ai);
  if (rc) {
    fprintf(stderr, "cm_rate: %s: %s\n", addr, gai_strerror(rc));
    exit(1);
  }
  memcpy(ss, ai->ai_addr, ai->ai_addrlen);
  *len = ai->ai_addrlen;
  freeaddrinfo(ai);
}

static void report(const char* what, int n, double secs) {
  printf("%s: %d connections in %.3f s: %.0f conn/s\n", what, n, secs, n / secs);
  fflush(stdout);
}

static void make_qp(struct rdma_cm_id* id) {
  struct ibv_qp_init_attr a = {
      .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1}};
  if (rdma_create_qp(id, NULL, &a)) die("rdma_create_qp");
}

// The next event of `ch`, its fields copied and the event acked (a destroy must not wait for it).
struct event {
  struct rdma_cm_id* id;
  enum rdma_cm_event_type type;
  int status;
};
static struct event next_event(struct rdma_event_channel* ch) {
  struct rdma_cm_event* e;
  if (rdma_get_cm_event(ch, &e)) die("rdma_get_cm_event");
  struct event out = {e->id, e->event, e->status};
  rdma_ack_cm_event(e);
  return out;
}

static void drop(struct rdma_cm_id* id) {
  if (id->qp) rdma_destroy_qp(id);
  if (rdma_destroy_id(id)) die("rdma_destroy_id");
}

static void cm_server(struct sockaddr* sa) {
  struct rdma_event_channel* ch = rdma_create_event_channel();
  struct rdma_cm_id* listen;
  if (!ch) die("rdma_create_event_channel");
  if (rdma_create_id(ch, &listen, NULL, RDMA_PS_TCP)) die("rdma_create_id");
  if (rdma_bind_addr(listen, sa)) die("rdma_bind_addr");
  if (rdma_listen(listen, 1024)) die("rdma_listen");
  printf("listening\n");
  fflush(stdout);
  int gone = 0;
  while (!n_conns || gone < n_conns) {
    const struct event ev = next_event(ch);
    struct rdma_cm_id* id = ev.id;
    switch (ev.type) {
      case RDMA_CM_EVENT_CONNECT_REQUEST: {
        if (with_qp) make_qp(id);
        struct rdma_conn_param p = {.responder_resources = 1, .initiator_depth = 1};
        if (rdma_accept(id, &p)) die("rdma_accept");
        break;
      }
      case RDMA_CM_EVENT_ESTABLISHED:
        break;
      case RDMA_CM_EVENT_DISCONNECTED:
      case RDMA_CM_EVENT_REJECTED:
      case RDMA_CM_EVENT_UNREACHABLE:
        drop(id);
        ++gone;
        break;
      default:
        fprintf(stderr, "cm_rate: server: unexpected %s (%d)\n", rdma_event_str(ev.type),
                ev.status);
        exit(1);
    }
  }
  rdma_destroy_id(listen);
  rdma_destroy_event_channel(ch);
}

static void cm_client(struct sockaddr* sa) {
  struct rdma_event_channel* ch = rdma_create_event_channel();
  if (!ch) die("rdma_create_event_channel");
  int launched = 0, done = 0;
  double start = now_s();
  while (done < n_conns) {
    while (launched < n_conns && launched - done < window) {
      struct rdma_cm_id* id;
      if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) die("rdma_create_id");
      if (rdma_resolve_addr(id, NULL, sa, 2000)) die("rdma_resolve_addr");
      ++launched;
    }
    const struct event ev = next_event(ch);
    struct rdma_cm_id* id = ev.id;
    switch (ev.type) {
      case RDMA_CM_EVENT_ADDR_RESOLVED:
        if (rdma_resolve_route(id, 2000)) die("rdma_resolve_route");
        break;
      case RDMA_CM_EVENT_ROUTE_RESOLVED: {
        if (with_qp) make_qp(id);
        struct rdma_conn_param p = {
            .responder_resources = 1, .initiator_depth = 1, .retry_count = 7, .rnr_retry_count = 7};
        if (rdma_connect(id, &p)) die("rdma_connect");
        break;
      }
      case RDMA_CM_EVENT_CONNECT_RESPONSE:  // no QP: the application confirms
        if (rdma_establish(id)) die("rdma_establish");
        /* fall through */
      case RDMA_CM_EVENT_ESTABLISHED:
        drop(id);
        ++done;
        break;
      default:
        fprintf(stderr, "cm_rate: client: %s (status %d) after %d connections\n",
                rdma_event_str(ev.type), ev.status, done);
        exit(1);
    }
  }
  report(with_qp ? "rdma_cm+qp" : "rdma_cm", n_conns, now_s() - start);
  rdma_destroy_event_channel(ch);
}

static void tcp_server(struct sockaddr* sa, socklen_t len) {
  int l = socket(sa->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
  if (l < 0) die("socket");
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(l, sa, len) || listen(l, 1024)) die("bind/listen");
  printf("listening\n");
  fflush(stdout);
  for (int n = 0; !n_conns || n < n_conns; ++n) {
    int c = accept4(l, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) die("accept");
    close(c);
  }
  close(l);
}

// Closed with a reset (SO_LINGER 0): no TIME_WAIT, so runs of many connections do not run out
// of ephemeral ports.
static void tcp_client(struct sockaddr* sa, socklen_t len) {
  int ep = epoll_create1(EPOLL_CLOEXEC), launched = 0, done = 0;
  if (ep < 0) die("epoll_create1");
  double start = now_s();
  while (done < n_conns) {
    while (launched < n_conns && launched - done < window) {
      int s = socket(sa->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (s < 0) die("socket");
      if (connect(s, sa, len) && errno != EINPROGRESS) die("connect");
      struct epoll_event ev = {.events = EPOLLOUT, .data.fd = s};
      if (epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev)) die("epoll_ctl");
      ++launched;
    }
    struct epoll_event evs[64];
    int n = epoll_wait(ep, evs, 64, -1);
    if (n < 0 && errno != EINTR) die("epoll_wait");
    for (int i = 0; i < n; ++i) {
      int s = evs[i].data.fd, err = 0;
      socklen_t el = sizeof(err);
      getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el);
      if (err) {
        errno = err;
        die("connect");
      }
      struct linger lg = {1, 0};
      setsockopt(s, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
      close(s);
      ++done;
    }
  }
  report("tcp", n_conns, now_s() - start);
  close(ep);
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr,
            "usage: %s --server|--client|--tcp-server|--tcp-client ADDR PORT [-n N] [-w WINDOW] "
            "[-q]\n",
            argv[0]);
    return 2;
  }
  for (int i = 4; i < argc; ++i) {
    if (!strcmp(argv[i], "-n") && i + 1 < argc)
      n_conns = atoi(argv[++i]);
    else if (!strcmp(argv[i], "-w") && i + 1 < argc)
      window = atoi(argv[++i]);
    else if (!strcmp(argv[i], "-q"))
      with_qp = 1;
    else {
      fprintf(stderr, "cm_rate: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (window < 1) window = 1;
  struct sockaddr_storage ss;
  socklen_t len;
  parse_addr(argv[2], argv[3], &ss, &len);
  struct sockaddr* sa = (struct sockaddr*)&ss;
  if (!strcmp(argv[1], "--server"))
    cm_server(sa);
  else if (!strcmp(argv[1], "--client"))
    cm_client(sa);
  else if (!strcmp(argv[1], "--tcp-server"))
    tcp_server(sa, len);
  else if (!strcmp(argv[1], "--tcp-client"))
    tcp_client(sa, len);
  else {
    fprintf(stderr, "cm_rate: unknown mode %s\n", argv[1]);
    return 2;
  }
  return 0;
}
