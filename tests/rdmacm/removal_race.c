// A thread waits in rdma_get_cm_event on a channel while the backend is killed; the main thread
// learns of it first (the channel's socket hangs up) and destroys its id at once. The waiting
// thread must still get that id's RDMA_CM_EVENT_DEVICE_REMOVAL, as with a kernel device, which
// queues the removal on every id before the application can hear of it any other way (rping's
// CQ thread hears of it first here, tools.sh's bad_input). Prints "ready" once waiting, then
// "removal" (exit 0) or what the thread got instead (exit 1).
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <stdio.h>
#include <string.h>

static struct rdma_event_channel* channel;
static int got;  // the event's type, or -errno

static void* wait_event(void* arg) {
  (void)arg;
  struct rdma_cm_event* ev;
  if (rdma_get_cm_event(channel, &ev)) {
    got = -errno;
    return NULL;
  }
  got = (int)ev->event;
  rdma_ack_cm_event(ev);
  return NULL;
}

int main(void) {
  struct rdma_cm_id* id;
  pthread_t t;
  channel = rdma_create_event_channel();
  if (!channel || rdma_create_id(channel, &id, NULL, RDMA_PS_TCP)) {
    perror("rdma_create_event_channel/rdma_create_id");
    return 2;
  }
  if (pthread_create(&t, NULL, wait_event, NULL)) return 2;
  printf("ready\n");
  fflush(stdout);
  struct pollfd p = {channel->fd, POLLRDHUP, 0};
  while (poll(&p, 1, -1) != 1 || !(p.revents & (POLLHUP | POLLRDHUP))) continue;
  rdma_destroy_id(id);
  pthread_join(t, NULL);
  if (got == RDMA_CM_EVENT_DEVICE_REMOVAL) {
    printf("removal\n");
    return 0;
  }
  printf("got %s\n", got < 0 ? strerror(-got) : rdma_event_str((enum rdma_cm_event_type)got));
  return 1;
}
