// A thread waits in rdma_get_cm_event on a channel while the backend is killed; the main thread
// learns of it first (the channel's socket hangs up) and destroys its id at once. The waiting
// thread must still get that id's RDMA_CM_EVENT_DEVICE_REMOVAL, as with a kernel device, which
// queues the removal on every id before the application can hear of it any other way (rping's
// CQ thread hears of it first here, tools.sh's bad_input). Prints "ready" once the thread sleeps
// inside the call (its state in /proc), then "removal" (exit 0) or what it got instead (exit 1).
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static struct rdma_event_channel* channel;
static int got;  // the event's type, or -errno
static atomic_long waiter;  // the waiting thread's id, once it is about to call

/// Whether thread `tid` of this process sleeps (its state in /proc is S).
static int sleeping(long tid) {
  char path[64], buf[512];
  snprintf(path, sizeof(path), "/proc/self/task/%ld/stat", tid);
  FILE* f = fopen(path, "r");
  if (!f) return 0;
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* p = strrchr(buf, ')');
  return p && p[1] == ' ' && p[2] == 'S';
}

static void* wait_event(void* arg) {
  (void)arg;
  struct rdma_cm_event* ev;
  atomic_store(&waiter, (long)syscall(SYS_gettid));
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
  // However slow the machine: the thread is inside rdma_get_cm_event, asleep, before the
  // backend may be killed.
  long tid;
  while (!(tid = atomic_load(&waiter))) usleep(1000);
  while (!sleeping(tid)) usleep(1000);
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
