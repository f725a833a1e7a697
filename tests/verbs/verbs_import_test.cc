// ibv_import_device(3) and ibv_import_pd/mr/dm between two real processes: the test's context
// hands its cmd_fd (the session's socket) to a second copy of this binary by SCM_RIGHTS, with
// the handles of a PD, an MR and device memory; that process imports them, moves data through
// the MR with QPs of its own and through the device memory, while the first keeps issuing
// commands on the same socket. docs/ARCHITECTURE.md, "Imports".
#include <sys/socket.h>
#include <sys/wait.h>

#include <atomic>
#include <thread>

#include "verbs_fixture.h"

namespace {

using vrdma::test::bring_to_rts;
using vrdma::test::QpPath;

/// What the test process sends with the cmd_fd.
struct Handles {
  uint32_t pd, mr, dm;
  uint64_t mr_addr, mr_length;
  uint32_t mr_lkey;
};

constexpr char kChildEnv[] = "VRDMA_TEST_IMPORT_SOCK";
constexpr uint8_t kPattern = 0x5a;

/// A message of `io` with room for one descriptor in `ctl`.
msghdr fd_msg(iovec& io, char (&ctl)[CMSG_SPACE(sizeof(int))]) {
  msghdr m{};
  m.msg_iov = &io;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof(ctl);
  return m;
}

int send_fd(int sock, int fd, const Handles& h) {
  iovec io{const_cast<Handles*>(&h), sizeof(h)};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr m = fd_msg(io, ctl);
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  return ::sendmsg(sock, &m, 0) == sizeof(h) ? 0 : -1;
}

int recv_fd(int sock, Handles& h) {
  iovec io{&h, sizeof(h)};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr m = fd_msg(io, ctl);
  if (::recvmsg(sock, &m, 0) != sizeof(h)) return -1;
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
  int fd;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

/// The second process: exit status 0 when everything it was asked to do worked, else the step
/// that failed.
int run_child(int sock) {
  Handles h{};
  const int cmd_fd = recv_fd(sock, h);
  if (cmd_fd < 0) return 10;
  ibv_context* ctx = ibv_import_device(cmd_fd);
  if (!ctx || ctx->cmd_fd != cmd_fd) return 11;
  ibv_pd* pd = ibv_import_pd(ctx, h.pd);
  if (!pd || pd->handle != h.pd) return 12;
  ibv_mr* mr = ibv_import_mr(pd, h.mr);
  if (!mr || mr->lkey != h.mr_lkey || reinterpret_cast<uintptr_t>(mr->addr) != h.mr_addr ||
      mr->length != h.mr_length || mr->pd != pd)
    return 13;
  ibv_dm* dm = ibv_import_dm(ctx, h.dm);
  if (!dm) return 14;
  // The device memory the first process filled; then our answer into it.
  uint8_t got[64];
  if (ibv_memcpy_from_dm(got, dm, 0, sizeof(got)) != 0) return 15;
  for (uint8_t b : got)
    if (b != kPattern) return 16;
  std::memset(got, kPattern + 1, sizeof(got));
  if (ibv_memcpy_to_dm(dm, 64, got, sizeof(got)) != 0) return 17;

  // QPs of our own on the imported PD: a SEND from the MR's first 4 KiB into its second, bytes
  // of the first process's memory at the first process's addresses.
  ibv_cq* cq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
  if (!cq) return 18;
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = qa.cap.max_recv_wr = 4;
  qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
  ibv_qp* a = ibv_create_qp(pd, &qa);
  ibv_qp* b = ibv_create_qp(pd, &qa);
  if (!a || !b) return 19;
  ibv_port_attr pa{};
  if (ibv_query_port(ctx, 1, &pa)) return 20;
  QpPath pab, pba;
  pab.dlid = pba.dlid = pa.lid;
  pab.dest_qpn = b->qp_num;
  pba.dest_qpn = a->qp_num;
  if (bring_to_rts(a, pab) || bring_to_rts(b, pba)) return 21;
  ibv_sge rs{h.mr_addr + 4096, 256, mr->lkey};
  ibv_recv_wr rwr{};
  rwr.sg_list = &rs;
  rwr.num_sge = 1;
  ibv_recv_wr* rbad = nullptr;
  if (ibv_post_recv(b, &rwr, &rbad)) return 22;
  ibv_sge ss{h.mr_addr, 256, mr->lkey};
  ibv_send_wr swr{};
  swr.sg_list = &ss;
  swr.num_sge = 1;
  swr.opcode = IBV_WR_SEND;
  swr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* sbad = nullptr;
  if (ibv_post_send(a, &swr, &sbad)) return 23;
  int done = 0;
  for (int spins = 0; done < 2 && spins < 5'000'000; ++spins) {
    ibv_wc wc;
    const int n = ibv_poll_cq(cq, 1, &wc);
    if (n < 0) return 24;
    if (n == 1 && wc.status != IBV_WC_SUCCESS) return 25;
    done += n;
    if (!n) ::usleep(1);
  }
  if (done != 2) return 26;
  if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_cq(cq)) return 27;
  ibv_unimport_dm(dm);
  ibv_unimport_mr(mr);
  ibv_unimport_pd(pd);
  if (ibv_close_device(ctx)) return 28;
  return 0;
}

/// Runs in the second process before gtest does: it is this binary, started by the test.
const int g_child = [] {
  const char* e = std::getenv(kChildEnv);
  if (e) ::_exit(run_child(std::atoi(e)));
  return 0;
}();

class VerbsImport : public vrdma::test::VerbsFixture {};

TEST_F(VerbsImport, AnotherProcessImportsTheContextItsPdMrAndDeviceMemory) {
  ibv_alloc_dm_attr da{4096, 0, 0};
  ibv_dm* dm = ibv_alloc_dm(ctx_, &da);
  ASSERT_NE(dm, nullptr) << std::strerror(errno);
  EXPECT_EQ(dm->comp_mask, uint32_t{IBV_DM_MASK_HANDLE});
  uint8_t fill[64];
  std::memset(fill, kPattern, sizeof(fill));
  ASSERT_EQ(ibv_memcpy_to_dm(dm, 0, fill, sizeof(fill)), 0);
  for (int i = 0; i < 256; ++i) buf_[i] = static_cast<uint8_t>(i ^ 0x33);

  int sp[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp), 0);
  // Its end without CLOEXEC (it must survive exec); ours keeps it.
  const int child_end = ::dup(sp[1]);
  ::close(sp[1]);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv(kChildEnv, std::to_string(child_end).c_str(), 1);
    char self[4096] = {};
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) ::execl(self, self, nullptr);
    ::_exit(99);
  }
  ::close(child_end);
  // Meanwhile this context keeps issuing commands on the socket it shares.
  std::atomic<bool> stop{false};
  std::atomic<int> busy_errors{0}, busy_calls{0};
  std::thread busy([&] {
    while (!stop.load()) {
      ibv_pd* p = ibv_alloc_pd(ctx_);
      if (!p || ibv_dealloc_pd(p)) busy_errors++;
      busy_calls++;
    }
  });
  // Busy before the other process starts on the socket: on a loaded machine the thread may not
  // run at all during the import (once under ASan in the CI: busy_calls 0).
  for (int i = 0; i < 10000 && busy_calls.load() == 0; ++i) ::usleep(1000);
  const Handles h{pd_->handle, mr_->handle, dm->handle, reinterpret_cast<uintptr_t>(mr_->addr),
                  mr_->length, mr_->lkey};
  const int dup_cmd = ::dup(ctx_->cmd_fd);  // the importer owns what it is given
  ASSERT_EQ(send_fd(sp[0], dup_cmd, h), 0);
  ::close(dup_cmd);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  stop = true;
  busy.join();
  ::close(sp[0]);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the step of run_child that failed";
  EXPECT_EQ(busy_errors.load(), 0);
  EXPECT_GT(busy_calls.load(), 0);

  // What the other process moved through our MR and device memory.
  for (int i = 0; i < 256; ++i) ASSERT_EQ(buf_[4096 + i], static_cast<uint8_t>(i ^ 0x33)) << i;
  uint8_t back[64];
  ASSERT_EQ(ibv_memcpy_from_dm(back, dm, 64, sizeof(back)), 0);
  for (uint8_t b : back) ASSERT_EQ(b, kPattern + 1);
  // Its unimports destroyed nothing: ours still work, and go.
  EXPECT_EQ(ibv_free_dm(dm), 0);
}

TEST_F(VerbsImport, WhatIsNoObjectOfTheSessionIsRefused) {
  errno = 0;
  EXPECT_EQ(ibv_import_pd(ctx_, 0xfffff), nullptr);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(ibv_import_mr(pd_, 0xfffff), nullptr);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(ibv_import_dm(ctx_, pd_->handle), nullptr) << "a handle of another kind";
  EXPECT_EQ(errno, EINVAL);
  // An MR through a PD it is not in.
  ibv_pd* other = ibv_alloc_pd(ctx_);
  ASSERT_NE(other, nullptr);
  errno = 0;
  EXPECT_EQ(ibv_import_mr(other, mr_->handle), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_dealloc_pd(other), 0);
  // In this very process too: a second context on the same socket, then the PD and MR again.
  ibv_context* again = ibv_import_device(::dup(ctx_->cmd_fd));
  ASSERT_NE(again, nullptr) << std::strerror(errno);
  ibv_pd* pd = ibv_import_pd(again, pd_->handle);
  ASSERT_NE(pd, nullptr);
  ibv_mr* mr = ibv_import_mr(pd, mr_->handle);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(mr->rkey, mr_->rkey);
  EXPECT_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, 0),
            IBV_REREG_MR_ERR_INPUT)
      << "the memory is the registering process's";
  ibv_unimport_mr(mr);
  ibv_unimport_pd(pd);
  EXPECT_EQ(ibv_close_device(again), 0);
  // Not a vrdma context's cmd_fd: refused, and the descriptor stays the caller's.
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  errno = 0;
  EXPECT_EQ(ibv_import_device(p[1]), nullptr);
  EXPECT_NE(errno, 0);
  EXPECT_EQ(::close(p[1]), 0);
  EXPECT_EQ(::close(p[0]), 0);
  EXPECT_EQ(ibv_import_device(-1), nullptr);
  // Our context lives on after the second one closed its descriptor.
  ibv_pd* still = ibv_alloc_pd(ctx_);
  ASSERT_NE(still, nullptr);
  EXPECT_EQ(ibv_dealloc_pd(still), 0);
}

}  // namespace
