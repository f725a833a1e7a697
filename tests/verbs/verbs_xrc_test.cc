// XRC through our libibverbs (docs/ARCHITECTURE.md, "XRC"): domains opened by a file and shared
// with a second process of the guest (a copy of this binary), XRC SRQs and their numbers, send
// and receive QPs, the SRQ number of each WR choosing where a message lands and completes, the
// remote invalid request of a number no SRQ of the target's domain has, ibv_open_qp from the
// other process. Run on the ring (mediated shm) and, as tcp.*, through the backend's TCP path.
#include <fcntl.h>
#include <sys/wait.h>

#include <chrono>

#include "verbs_fixture.h"

namespace {

using vrdma::test::bring_to_rts;
using vrdma::test::post_srq_recv;
using vrdma::test::QpPath;

constexpr char kChildEnv[] = "VRDMA_TEST_XRC_CHILD";

/// A file that names a domain, in a directory of its own, removed at the end.
class DomainFile {
 public:
  DomainFile() {
    char dir[] = "/tmp/vrdma-xrc-XXXXXX";
    if (::mkdtemp(dir)) dir_ = dir;
    path_ = dir_ + "/domain";
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0600);
  }
  ~DomainFile() {
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  std::string dir_, path_;
  int fd_ = -1;
};

ibv_xrcd* open_xrcd(ibv_context* ctx, int fd, int oflags) {
  ibv_xrcd_init_attr a{};
  a.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
  a.fd = fd;
  a.oflags = oflags;
  return ibv_open_xrcd(ctx, &a);
}

ibv_srq* xrc_srq(ibv_context* ctx, ibv_pd* pd, ibv_xrcd* x, ibv_cq* cq, uint32_t depth = 8) {
  ibv_srq_init_attr_ex a{};
  a.attr.max_wr = depth;
  a.attr.max_sge = 1;
  a.comp_mask =
      IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ | IBV_SRQ_INIT_ATTR_PD;
  a.srq_type = IBV_SRQT_XRC;
  a.xrcd = x;
  a.cq = cq;
  a.pd = pd;
  return ibv_create_srq_ex(ctx, &a);
}

ibv_qp* recv_qp(ibv_context* ctx, ibv_xrcd* x) {
  ibv_qp_init_attr_ex a{};
  a.qp_type = IBV_QPT_XRC_RECV;
  a.comp_mask = IBV_QP_INIT_ATTR_XRCD;
  a.xrcd = x;
  return ibv_create_qp_ex(ctx, &a);
}

ibv_qp* send_qp(ibv_context* ctx, ibv_pd* pd, ibv_cq* cq, bool ex = false) {
  ibv_qp_init_attr_ex a{};
  a.qp_type = IBV_QPT_XRC_SEND;
  a.send_cq = cq;
  a.cap.max_send_wr = 16;
  a.cap.max_send_sge = 1;
  a.comp_mask = IBV_QP_INIT_ATTR_PD;
  a.pd = pd;
  if (ex) {
    a.comp_mask |= IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    a.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE;
  }
  return ibv_create_qp_ex(ctx, &a);
}

/// One completion of `cq` within `ms` (a deadline, not a spin count: a loaded host may not
/// run the backend for a while); 0 when none came.
int poll_within(ibv_cq* cq, ibv_wc& wc, int ms) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  do {
    if (int got = ibv_poll_cq(cq, 1, &wc)) return got;
  } while (std::chrono::steady_clock::now() < end);
  return 0;
}

/// Connects send QP `s` to receive QP `r` (and `r` back to `s`) on LID `lid`.
void connect_xrc(ibv_qp* s, ibv_qp* r, uint16_t lid) {
  QpPath p;
  p.dlid = lid;
  p.dest_qpn = r->qp_num;
  ASSERT_EQ(bring_to_rts(s, p), 0);
  p.dest_qpn = s->qp_num;
  ASSERT_EQ(bring_to_rts(r, p), 0);
}

class Xrc : public vrdma::test::VerbsFixture {
 protected:
  ibv_cq* cq(int n = 16) {
    ibv_cq* c = ibv_create_cq(ctx_, n, nullptr, nullptr, 0);
    EXPECT_NE(c, nullptr);
    return c;
  }
};

TEST_F(Xrc, IsAdvertised) {
  ibv_device_attr a{};
  ASSERT_EQ(ibv_query_device(ctx_, &a), 0);
  EXPECT_TRUE(a.device_cap_flags & IBV_DEVICE_XRC);
}

TEST_F(Xrc, DomainsOpenAndCloseAsTheManPageSays) {
  DomainFile f;
  ASSERT_GE(f.fd(), 0);
  errno = 0;
  EXPECT_EQ(open_xrcd(ctx_, -1, 0), nullptr);  // no file: O_CREAT required
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(open_xrcd(ctx_, f.fd(), 0), nullptr);  // no domain for the file yet
  EXPECT_EQ(errno, ENOENT);
  ibv_xrcd* a = open_xrcd(ctx_, f.fd(), O_CREAT);
  ASSERT_NE(a, nullptr) << std::strerror(errno);
  errno = 0;
  EXPECT_EQ(open_xrcd(ctx_, f.fd(), O_CREAT | O_EXCL), nullptr);
  EXPECT_EQ(errno, EINVAL);
  // The same inode through another descriptor is the same domain: a receive QP of one handle
  // opens through the other.
  const int fd2 = ::open(f.path().c_str(), O_RDONLY | O_CLOEXEC);
  ibv_xrcd* b = open_xrcd(ctx_, fd2, 0);
  ::close(fd2);
  ASSERT_NE(b, nullptr) << std::strerror(errno);
  ibv_qp* r = recv_qp(ctx_, a);
  ASSERT_NE(r, nullptr) << std::strerror(errno);
  ibv_qp_open_attr oa{};
  oa.comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
  oa.qp_num = r->qp_num;
  oa.xrcd = b;
  oa.qp_type = IBV_QPT_XRC_RECV;
  ibv_qp* r2 = ibv_open_qp(ctx_, &oa);
  ASSERT_NE(r2, nullptr) << std::strerror(errno);
  EXPECT_EQ(r2->qp_num, r->qp_num);
  // A private domain is another domain: the QP is not in it.
  ibv_xrcd* p = open_xrcd(ctx_, -1, O_CREAT);
  ASSERT_NE(p, nullptr);
  oa.xrcd = p;
  errno = 0;
  EXPECT_EQ(ibv_open_qp(ctx_, &oa), nullptr);
  EXPECT_EQ(errno, EINVAL);
  // A domain with an SRQ of this process in it does not close.
  ibv_cq* c = cq();
  ibv_srq* srq = xrc_srq(ctx_, pd_, p, c);
  ASSERT_NE(srq, nullptr) << std::strerror(errno);
  uint32_t n = 0;
  ASSERT_EQ(ibv_get_srq_num(srq, &n), 0);
  EXPECT_NE(n, 0u);
  EXPECT_EQ(ibv_close_xrcd(p), EBUSY);
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
  EXPECT_EQ(ibv_close_xrcd(p), 0);
  EXPECT_EQ(ibv_destroy_cq(c), 0);
  EXPECT_EQ(ibv_destroy_qp(r2), 0);
  EXPECT_EQ(ibv_destroy_qp(r), 0);
  EXPECT_EQ(ibv_close_xrcd(b), 0);
  EXPECT_EQ(ibv_close_xrcd(a), 0);
  // Its last close ended the domain.
  errno = 0;
  EXPECT_EQ(open_xrcd(ctx_, f.fd(), 0), nullptr);
  EXPECT_EQ(errno, ENOENT);
  // A domain belongs to XRC receive QPs only.
  ibv_qp_init_attr_ex rc{};
  rc.qp_type = IBV_QPT_RC;
  rc.send_cq = rc.recv_cq = cq();
  rc.cap.max_send_wr = rc.cap.max_recv_wr = 1;
  rc.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_XRCD;
  rc.pd = pd_;
  rc.xrcd = a;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &rc), nullptr);
  EXPECT_EQ(errno, EINVAL);
  cqs_.push_back(rc.send_cq);
}

/// Two SRQs of one domain, each with its own CQ, one receive QP: each message lands in the SRQ
/// its WR names and completes on that SRQ's CQ, with the receive QP's number.
TEST_F(Xrc, TheSrqNumberOfEachWrChoosesTheSrqAndItsCq) {
  ibv_xrcd* x = open_xrcd(ctx_, -1, O_CREAT);
  ASSERT_NE(x, nullptr);
  ibv_cq *scq = cq(), *ca = cq(), *cb = cq();
  cqs_.insert(cqs_.end(), {scq, ca, cb});
  ibv_srq* sa = xrc_srq(ctx_, pd_, x, ca);
  ibv_srq* sb = xrc_srq(ctx_, pd_, x, cb);
  ASSERT_TRUE(sa && sb);
  uint32_t na = 0, nb = 0;
  ASSERT_EQ(ibv_get_srq_num(sa, &na), 0);
  ASSERT_EQ(ibv_get_srq_num(sb, &nb), 0);
  EXPECT_NE(na, nb);
  ibv_qp* r = recv_qp(ctx_, x);
  ibv_qp* s = send_qp(ctx_, pd_, scq, true);
  ASSERT_TRUE(r && s) << std::strerror(errno);
  EXPECT_EQ(s->recv_cq, nullptr);
  connect_xrc(s, r, lid_);
  ASSERT_EQ(post_srq_recv(sa, 1, addr(0x1000), 64, mr_->lkey), 0);
  ASSERT_EQ(post_srq_recv(sb, 2, addr(0x2000), 64, mr_->lkey), 0);
  std::memcpy(&buf_[0], "to-b", 4);
  std::memcpy(&buf_[64], "to-a", 4);
  ASSERT_EQ(post(s, {.sges = {sge(0, 4)}, .wr_id = 10, .remote_srqn = nb}), 0);
  // The same through ibv_qp_ex: wr_set_xrc_srqn.
  ibv_qp_ex* qx = ibv_qp_to_qp_ex(s);
  ASSERT_NE(qx, nullptr);
  ibv_wr_start(qx);
  qx->wr_id = 11;
  qx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send(qx);
  ibv_wr_set_xrc_srqn(qx, na);
  ibv_wr_set_sge(qx, mr_->lkey, addr(64), 4);
  ASSERT_EQ(ibv_wr_complete(qx), 0);
  auto sent = poll(scq, 2);
  ASSERT_EQ(sent.size(), 2u);
  for (const ibv_wc& w : sent) EXPECT_EQ(w.status, IBV_WC_SUCCESS) << ibv_wc_status_str(w.status);
  auto wa = poll(ca, 1), wb = poll(cb, 1);
  ASSERT_EQ(wa.size(), 1u);
  ASSERT_EQ(wb.size(), 1u);
  EXPECT_EQ(wa[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(wa[0].wr_id, 1u);
  EXPECT_EQ(wa[0].qp_num, r->qp_num);
  EXPECT_EQ(wa[0].src_qp, s->qp_num);
  EXPECT_EQ(wa[0].byte_len, 4u);
  EXPECT_EQ(wb[0].wr_id, 2u);
  EXPECT_EQ(wb[0].qp_num, r->qp_num);
  EXPECT_EQ(std::memcmp(&buf_[0x1000], "to-a", 4), 0);
  EXPECT_EQ(std::memcmp(&buf_[0x2000], "to-b", 4), 0);
  // An RDMA WRITE reaches MRs of the named SRQ's PD.
  std::memcpy(&buf_[128], "wrote", 5);
  ASSERT_EQ(post(s, {.op = IBV_WR_RDMA_WRITE,
                     .sges = {sge(128, 5)},
                     .wr_id = 12,
                     .raddr = addr(0x3000),
                     .rkey = mr_->rkey,
                     .remote_srqn = na}),
            0);
  auto w = poll(scq, 1);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(w[0].status);
  EXPECT_EQ(std::memcmp(&buf_[0x3000], "wrote", 5), 0);
  // Posting to a receive QP, or a receive to a send QP, is refused.
  ibv_sge g = sge(0, 4);
  ibv_send_wr sw{};
  sw.sg_list = &g;
  sw.num_sge = 1;
  ibv_send_wr* bad = nullptr;
  EXPECT_NE(ibv_post_send(r, &sw, &bad), 0);
  EXPECT_NE(post_recv(s, 1, 0, 4), 0);
  EXPECT_EQ(ibv_destroy_qp(s), 0);
  EXPECT_EQ(ibv_destroy_qp(r), 0);
  EXPECT_EQ(ibv_destroy_srq(sa), 0);
  EXPECT_EQ(ibv_destroy_srq(sb), 0);
  EXPECT_EQ(ibv_close_xrcd(x), 0);
}

/// A number no SRQ has, or an SRQ of another domain: the requester completes with a remote
/// invalid request error (its QP goes to ERR); nothing lands anywhere.
TEST_F(Xrc, AnSrqNumberOutsideTheTargetsDomainIsARemoteInvalidRequest) {
  ibv_xrcd* x = open_xrcd(ctx_, -1, O_CREAT);
  ibv_xrcd* other = open_xrcd(ctx_, -1, O_CREAT);
  ASSERT_TRUE(x && other);
  ibv_cq *scq = cq(), *rcq = cq();
  cqs_.insert(cqs_.end(), {scq, rcq});
  ibv_srq* mine = xrc_srq(ctx_, pd_, x, rcq);
  ibv_srq* theirs = xrc_srq(ctx_, pd_, other, rcq);
  ASSERT_TRUE(mine && theirs);
  uint32_t n_theirs = 0;
  ASSERT_EQ(ibv_get_srq_num(theirs, &n_theirs), 0);
  ASSERT_EQ(post_srq_recv(theirs, 7, addr(0x1000), 64, mr_->lkey), 0);
  for (uint32_t srqn : {0xabcdeu, n_theirs}) {
    ibv_qp* r = recv_qp(ctx_, x);
    ibv_qp* s = send_qp(ctx_, pd_, scq);
    ASSERT_TRUE(r && s);
    connect_xrc(s, r, lid_);
    ASSERT_EQ(post(s, {.sges = {sge(0, 4)}, .wr_id = 20, .remote_srqn = srqn}), 0);
    auto w = poll(scq, 1);
    ASSERT_EQ(w.size(), 1u);
    EXPECT_EQ(w[0].status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(w[0].status);
    EXPECT_EQ(state(s), IBV_QPS_ERR);
    EXPECT_EQ(ibv_destroy_qp(s), 0);
    EXPECT_EQ(ibv_destroy_qp(r), 0);
  }
  ibv_wc none{};
  EXPECT_EQ(poll_within(rcq, none, 100), 0);  // the other domain's SRQ kept its receive
  EXPECT_EQ(ibv_destroy_srq(mine), 0);
  EXPECT_EQ(ibv_destroy_srq(theirs), 0);
  EXPECT_EQ(ibv_close_xrcd(x), 0);
  EXPECT_EQ(ibv_close_xrcd(other), 0);
}

/// The second process: opens the domain by the file's path (it exists: no O_CREAT), opens the
/// receive QP `qpn` there, makes an SRQ of its own, tells the first its number on `out` and
/// waits for one message in it. Exit status 0 when all of it held, else the step that failed.
int run_child(int out, uint32_t qpn, const char* path) {
  ibv_device** list = ibv_get_device_list(nullptr);
  ibv_context* ctx = list && list[0] ? ibv_open_device(list[0]) : nullptr;
  if (!ctx) return 10;
  ibv_pd* pd = ibv_alloc_pd(ctx);
  static char buf[4096];
  ibv_mr* mr = pd ? ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE) : nullptr;
  if (!mr) return 11;
  const int fd = ::open(path, O_RDONLY);
  ibv_xrcd* x = open_xrcd(ctx, fd, 0);
  if (!x) return 12;
  ibv_qp_open_attr oa{};
  oa.comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
  oa.qp_num = qpn;
  oa.xrcd = x;
  oa.qp_type = IBV_QPT_XRC_RECV;
  ibv_qp* r = ibv_open_qp(ctx, &oa);
  if (!r || r->qp_num != qpn || r->state != IBV_QPS_RTS) return 13;
  ibv_cq* cq = ibv_create_cq(ctx, 4, nullptr, nullptr, 0);
  ibv_srq* srq = cq ? xrc_srq(ctx, pd, x, cq) : nullptr;
  uint32_t n = 0;
  if (!srq || ibv_get_srq_num(srq, &n)) return 14;
  if (post_srq_recv(srq, 42, reinterpret_cast<uintptr_t>(buf), 64, mr->lkey)) return 15;
  if (::write(out, &n, sizeof(n)) != sizeof(n)) return 16;
  ibv_wc wc{};
  const int got = poll_within(cq, wc, 20'000);
  if (got != 1 || wc.status != IBV_WC_SUCCESS || wc.wr_id != 42 || wc.qp_num != qpn) return 17;
  if (std::memcmp(buf, "hello", 5) != 0) return 18;
  // Its handle on the QP goes (the QP stays the first process's); its SRQ and its open of the
  // domain go with the process, as a process that dies leaves them.
  if (ibv_destroy_qp(r)) return 19;
  (void)x;
  ::close(fd);
  return 0;
}

[[maybe_unused]] const int kChild = [] {
  const char* e = std::getenv(kChildEnv);
  if (!e) return 0;
  unsigned out = 0, qpn = 0;
  char path[256] = {};
  if (std::sscanf(e, "%u:%u:%255s", &out, &qpn, path) != 3) ::_exit(98);
  ::_exit(run_child(static_cast<int>(out), qpn, path));
}();

/// ibv_open_qp from another process of the guest, through the domain of a file both opened: a
/// message for the SRQ that process made lands there, on the receive QP the first one created.
TEST_F(Xrc, AnotherProcessOpensTheDomainAndTheReceiveQp) {
  DomainFile f;
  ibv_xrcd* x = open_xrcd(ctx_, f.fd(), O_CREAT);
  ASSERT_NE(x, nullptr);
  ibv_cq* scq = cq();
  cqs_.push_back(scq);
  ibv_qp* r = recv_qp(ctx_, x);
  ibv_qp* s = send_qp(ctx_, pd_, scq);
  ASSERT_TRUE(r && s);
  connect_xrc(s, r, lid_);
  int p[2];
  ASSERT_EQ(::pipe(p), 0);  // the child's end survives exec
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(p[0]);
    const std::string arg = std::to_string(p[1]) + ":" + std::to_string(r->qp_num) + ":" + f.path();
    ::setenv(kChildEnv, arg.c_str(), 1);
    char self[4096] = {};
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) ::execl(self, self, nullptr);
    ::_exit(99);
  }
  ::close(p[1]);
  uint32_t srqn = 0;
  const bool told = ::read(p[0], &srqn, sizeof(srqn)) == sizeof(srqn);
  ::close(p[0]);
  if (told) {
    std::memcpy(&buf_[0], "hello", 5);
    EXPECT_EQ(post(s, {.sges = {sge(0, 5)}, .wr_id = 30, .remote_srqn = srqn}), 0);
    auto w = poll(scq, 1);
    ASSERT_EQ(w.size(), 1u);
    EXPECT_EQ(w[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(w[0].status);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the step of run_child that failed";
  EXPECT_TRUE(told);
  // Still ours after the other process's handle went; the SRQ it named went with that process.
  EXPECT_EQ(state(r), IBV_QPS_RTS);
  EXPECT_EQ(post(s, {.sges = {sge(0, 5)}, .wr_id = 31, .remote_srqn = srqn}), 0);
  auto w = poll(scq, 1);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(w[0].status);
  EXPECT_EQ(ibv_destroy_qp(s), 0);
  EXPECT_EQ(ibv_destroy_qp(r), 0);
  EXPECT_EQ(ibv_close_xrcd(x), 0);
}

}  // namespace
