// A thread blocked in rdma_get_cm_event or ibv_get_cq_event waits in poll (common/wait_readable.h):
// the verbs library's registration stops it (under TSan too, where a thread in recv or read
// could not be stopped and the registration failed after 5 s), the stop signal does not end its
// wait, a signal whose handler lacks SA_RESTART does (EINTR) and one with SA_RESTART does not,
// and a non-blocking channel still fails with EAGAIN. Runs against the backend the library
// starts (labels threads: the tsan preset runs it).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

namespace {

void on_signal(int) {}

/// Installs a handler for `sig` with or without SA_RESTART; the old one comes back at the end.
class ScopedHandler {
 public:
  ScopedHandler(int sig, bool restart) : sig_(sig) {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sa.sa_flags = restart ? SA_RESTART : 0;
    ::sigemptyset(&sa.sa_mask);
    ::sigaction(sig, &sa, &old_);
  }
  ~ScopedHandler() { ::sigaction(sig_, &old_, nullptr); }

 private:
  int sig_;
  struct sigaction old_ {};
};

/// A thread blocked in `wait` (a call that returns -1 with errno when interrupted).
class Waiter {
 public:
  explicit Waiter(std::function<int()> wait)
      : t_([this, wait] {
          tid_.store(::pthread_self());
          started_.store(true);
          rc_ = wait();
          err_ = errno;
          done_.store(true);
        }) {
    while (!started_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    // Long enough to be inside the wait; were it not yet, the checks below only pass early.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ~Waiter() {
    if (!t_.joinable()) return;
    if (!done()) {  // a check failed before the end: interrupt it rather than hang
      ScopedHandler h(SIGUSR1, false);
      signal(SIGUSR1);
      t_.join();
      return;
    }
    t_.join();
  }
  bool done() const { return done_.load(); }
  void signal(int sig) { ::pthread_kill(tid_.load(), sig); }
  /// Joins the thread: the call's result and errno.
  std::pair<int, int> join() {
    t_.join();
    return {rc_, err_};
  }

 private:
  std::atomic<bool> started_{false}, done_{false};
  std::atomic<pthread_t> tid_{};
  int rc_ = 0, err_ = 0;
  std::thread t_;
};

/// Registers fresh anonymous pages (a new segment: the library stops every other thread).
void register_fresh_pages(ibv_pd* pd) {
  constexpr size_t kLen = 64 * 1024;
  void* buf = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(buf, MAP_FAILED);
  std::memset(buf, 0x5a, kLen);
  ibv_mr* mr = ibv_reg_mr(pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr) << "reg_mr with a thread waiting for an event: " << std::strerror(errno);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  ::munmap(buf, kLen);
}

/// The checks of both waits: a registration stops the waiter without ending its wait, as does
/// a signal whose handler restarts calls; one whose handler does not ends it with EINTR.
void stopped_not_woken_then_interrupted(Waiter& w, ibv_pd* pd) {
  register_fresh_pages(pd);
  EXPECT_FALSE(w.done()) << "the registration's stop signal ended the wait";
  {
    ScopedHandler h(SIGUSR2, true);
    w.signal(SIGUSR2);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(w.done()) << "a signal with SA_RESTART ended the wait";
  }
  ScopedHandler h(SIGUSR1, false);
  w.signal(SIGUSR1);
  auto [rc, err] = w.join();
  EXPECT_EQ(rc, -1);
  EXPECT_EQ(err, EINTR);
}

class CmWaitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    ASSERT_TRUE(list && n > 0) << "no vrdma device";
    ctx_ = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    ASSERT_NE(ctx_, nullptr);
    pd_ = ibv_alloc_pd(ctx_);
    ASSERT_NE(pd_, nullptr);
  }
  void TearDown() override {
    if (pd_) ibv_dealloc_pd(pd_);
    if (ctx_) ibv_close_device(ctx_);
  }
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
};

TEST_F(CmWaitTest, AThreadInRdmaGetCmEventIsStoppedAndInterruptedAsInRecv) {
  rdma_event_channel* ch = rdma_create_event_channel();
  ASSERT_NE(ch, nullptr) << std::strerror(errno);
  {
    Waiter w([ch] {
      rdma_cm_event* e = nullptr;
      return rdma_get_cm_event(ch, &e);
    });
    stopped_not_woken_then_interrupted(w, pd_);
  }
  // Non-blocking: EAGAIN at once, as before.
  ASSERT_EQ(::fcntl(ch->fd, F_SETFL, ::fcntl(ch->fd, F_GETFL) | O_NONBLOCK), 0);
  rdma_cm_event* e = nullptr;
  EXPECT_EQ(rdma_get_cm_event(ch, &e), -1);
  EXPECT_EQ(errno, EAGAIN);
  rdma_destroy_event_channel(ch);
}

TEST_F(CmWaitTest, AThreadInIbvGetCqEventIsStoppedAndInterruptedAsInRead) {
  ibv_comp_channel* ch = ibv_create_comp_channel(ctx_);
  ASSERT_NE(ch, nullptr);
  {
    Waiter w([ch] {
      ibv_cq* cq = nullptr;
      void* cq_ctx = nullptr;
      return ibv_get_cq_event(ch, &cq, &cq_ctx);
    });
    stopped_not_woken_then_interrupted(w, pd_);
  }
  ASSERT_EQ(::fcntl(ch->fd, F_SETFL, ::fcntl(ch->fd, F_GETFL) | O_NONBLOCK), 0);
  ibv_cq* cq = nullptr;
  void* cq_ctx = nullptr;
  EXPECT_EQ(ibv_get_cq_event(ch, &cq, &cq_ctx), -1);
  EXPECT_EQ(errno, EAGAIN);
  EXPECT_EQ(ibv_destroy_comp_channel(ch), 0);
}

}  // namespace
