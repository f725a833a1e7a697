// The device and its context: device list, open/close (connecting to the backend, starting one
// on first use), device/port/GID queries, async events, and the command RPC.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/auxv.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "common/answer_spin.h"
#include "common/identity.h"
#include "common/log.h"
#include "common/paths.h"
#include "common/socket.h"
#include "proto/device_caps.h"
#include "verbs/extended.h"
#include "verbs/internal.h"
#include "verbs/srq.h"

using namespace vrdma;
using namespace vrdma::verbs;
using namespace vrdma::proto;

#define VERBS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

ibv_device g_device = [] {
  ibv_device d{};
  d.node_type = IBV_NODE_CA;
  d.transport_type = IBV_TRANSPORT_IB;
  std::strcpy(d.name, "vrdma0");
  std::strcpy(d.dev_name, "uverbs0");
  std::strcpy(d.dev_path, "/sys/class/infiniband_verbs/uverbs0");
  std::strcpy(d.ibdev_path, "/sys/class/infiniband/vrdma0");
  return d;
}();

std::atomic<bool> g_fork_init{false};

constexpr int kIdleExitOnDemand = 60;      ///< seconds a backend we start lingers unused
constexpr int kBackendStartWaitMs = 5000;  ///< how long it may take to listen

/// Directory of this library, to find ../bin/vrdmad next to it.
std::string library_dir() {
  Dl_info info{};
  if (!::dladdr(reinterpret_cast<void*>(&library_dir), &info) || !info.dli_fname) return ".";
  std::string p = info.dli_fname;
  auto slash = p.rfind('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

std::string backend_binary() {
  if (const char* e = ::secure_getenv("VRDMA_BACKEND"); e && *e) return e;
  // Build tree: <build>/lib/libibverbs.so.1 and <build>/bin/vrdmad. Installed: the library has
  // a directory of its own, <libdir>/vrdma, and vrdmad is in <bindir> (CMakeLists.txt).
  const std::string build = library_dir() + "/../bin/vrdmad";
  const std::string installed = library_dir() + "/" VRDMA_LIB_TO_BIN "/vrdmad";
  return ::access(build.c_str(), X_OK) != 0 && ::access(installed.c_str(), X_OK) == 0 ? installed
                                                                                      : build;
}

/// Starts a detached backend (start_backend) and returns what it started, or nothing after
/// saying why it cannot. Two guests that race here both start one; the backend's lock lets only
/// the first one serve, and the other leaves quietly (--on-demand).
std::optional<StartedBackend> spawn_backend(const std::string& sock) {
  // A setuid (AT_SECURE) program never starts one: the backend would run with its privileges.
  if (::getauxval(AT_SECURE)) {
    VLOG_ERROR(
        "no vrdma backend answers on {}, and a setuid program does not start one; start "
        "one yourself (`vrdma backend`, `systemctl start vrdmad.socket`)",
        sock);
    return std::nullopt;
  }
  auto started = start_backend(backend_binary(), sock, kIdleExitOnDemand);
  if (!started.is_ok()) {
    VLOG_ERROR("cannot start the vrdma backend: {}{}", started.status().message(),
               started.err() == ENOENT ? "; set VRDMA_BACKEND to vrdmad's path, or start one "
                                         "yourself (`vrdma backend`)"
                                       : "");
    return std::nullopt;
  }
  VLOG_INFO(
      "started a vrdma backend (pid {}) on {}, its log {}; it exits after {} s without "
      "guests",
      started.value().pid, sock, started.value().log, kIdleExitOnDemand);
  return std::move(started).value();
}

/// How long a control call waits for the backend (VRDMA_TIMEOUT_MS; 0: for ever).
int control_timeout_ms() {
  static const int ms = [] {
    const char* e = ::secure_getenv("VRDMA_TIMEOUT_MS");
    if (!e || !*e) return 30000;
    char* end = nullptr;
    const long v = std::strtol(e, &end, 10);
    if (*end != '\0' || v < 0 || v > 86400000) {
      VLOG_WARN("VRDMA_TIMEOUT_MS={} is not a number of milliseconds; using 30000", e);
      return 30000;
    }
    return static_cast<int>(v);
  }();
  return ms;
}

uint64_t mono_ms() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000 + uint64_t(ts.tv_nsec) / 1000000;
}

Result<UniqueFd> connect_backend() {
  const std::string path = socket_path();
  auto r = connect_backend_socket(path, control_timeout_ms());
  if (r.is_ok()) return r;
  if (!no_backend_there(r.err())) return r;
  // Nothing to wait for when none could be started: the reason was said.
  auto started = spawn_backend(path);
  if (!started) return r;
  auto a = await_backend(path, *started, kBackendStartWaitMs, control_timeout_ms());
  if (!a.is_ok()) VLOG_ERROR("{}", a.status().message());
  return a;
}

}  // namespace

namespace vrdma::verbs {

namespace {

/// The session's command lock (VContext::call_lock), held for one command; none before the
/// control page is mapped (Hello: nobody else has the socket yet).
class SessionCallLock {
 public:
  explicit SessionCallLock(int fd) : fd_(fd) {
    if (fd_ >= 0) set(F_WRLCK);
  }
  ~SessionCallLock() {
    if (fd_ >= 0) set(F_UNLCK);
  }
  SessionCallLock(const SessionCallLock&) = delete;
  SessionCallLock& operator=(const SessionCallLock&) = delete;

 private:
  void set(short type) {
    struct flock fl {};
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_len = 1;
    while (::fcntl(fd_, F_OFD_SETLKW, &fl) < 0 && errno == EINTR) {
    }
  }
  int fd_;
};

/// Whether the program's stderr has not had the line `key` names yet (then it has now).
/// Bounded: a program hits few distinct quotas and destinations.
bool first_time(const std::string& key) {
  static std::mutex mu;
  static std::set<std::string> said;
  std::lock_guard<std::mutex> g(mu);
  return said.size() < 64 && said.insert(key).second;
}

/// A command the backend refused for a quota (kAnswerQuota) says so once on the program's
/// stderr, with the backend's reason (its log has the same line): a program only shows what the
/// verb's errno makes it say ("QP size too big", ENOMEM). Other refusals stay at debug level.
void say_refusal(uint16_t op, const std::string& why, bool quota) {
  if (!quota) {
    VLOG_DEBUG("{} refused: {}", op_name(op), why);
    return;
  }
  if (!first_time("quota " + why)) return;
  VLOG_WARN("{} refused: {} (the backend's [quotas]; vrdma status shows them)", op_name(op), why);
}

}  // namespace

void say_destination_unknown(const ibv_qp& qp, const ibv_qp_attr& attr, int mask) {
  // The address came with an earlier modify: the QP names it.
  std::string dest = fmt::format("LID {:#x}", attr.ah_attr.dlid);
  if (!(mask & IBV_QP_AV)) {
    dest = fmt::format("of QP {:#x}", qp.qp_num);
  } else if (attr.ah_attr.is_global) {
    char text[INET6_ADDRSTRLEN] = "?";
    ::inet_ntop(AF_INET6, attr.ah_attr.grh.dgid.raw, text, sizeof(text));
    dest = fmt::format("GID {}", text);
  }
  if (!first_time("destination " + dest)) return;
  VLOG_WARN(
      "modify_qp to RTR: destination {} unknown to the backend on {} (tcp off): are both "
      "programs on the same VRDMA_SOCKET? (sends to it end in transport retry counter exceeded)",
      dest, socket_path());
}

int VContext::call(Op op, const void* body, size_t body_len, void* resp, size_t resp_len,
                   std::span<const int> fds_in, std::vector<UniqueFd>* fds_out,
                   uint32_t* answer_flags) {
  std::lock_guard<std::mutex> g(rpc_mu);
  SessionCallLock session_lock(call_lock.get());
  std::vector<uint8_t> msg(sizeof(MsgHeader) + body_len);
  MsgHeader h{kMagic, kVersion, static_cast<uint16_t>(op), static_cast<uint32_t>(msg.size()),
              ++seq, 0, 0};
  std::memcpy(msg.data(), &h, sizeof(h));
  if (body_len) std::memcpy(msg.data() + sizeof(h), body, body_len);
  Status st = send_msg(sock.get(), msg, fds_in);
  std::vector<UniqueFd> fds;
  // Room for this call's answer or an error's reason, no more: recv_msg zero-fills its buffer
  // to the cap, and kMaxResponse's 1 MiB cost more than the command.
  const size_t cap = sizeof(MsgHeader) + std::max(resp_len, kMaxReason);
  const uint64_t sent_ns = mono_ns();
  uint64_t spin_ns = st.is_ok() ? answer_spin.budget_ns() : 0;
  const uint64_t spun_ns = spin_ns;
  // A backend that does not answer (hung, or its descriptor table full) must not hang the
  // application: the verb fails with ETIMEDOUT. A late answer is skipped by the next call (its
  // sequence number is older), and what the backend made for it goes with the context.
  const int timeout_ms = control_timeout_ms();
  const uint64_t deadline = mono_ms() + static_cast<uint64_t>(timeout_ms);
  for (;;) {
    if (st.err() == EAGAIN) st = error(ETIMEDOUT, "sendmsg timed out");
    bool received = false;
    if (st.is_ok() && spin_ns) {  // the first answer only
      Status r = spin_recv(sock.get(), msg, cap, fds, spin_ns);
      spin_ns = 0;
      if (r.err() != EAGAIN) {
        st = std::move(r);
        received = true;
      }
    }
    if (!received && st.is_ok() && timeout_ms > 0) {
      pollfd p{sock.get(), POLLIN, 0};
      int n;
      do {
        const uint64_t now = mono_ms();
        n = ::poll(&p, 1, now >= deadline ? 0 : static_cast<int>(deadline - now));
      } while (n < 0 && errno == EINTR);
      if (n == 0) st = error(ETIMEDOUT, "no answer");
    }
    if (st.err() == ETIMEDOUT) {
      VLOG_ERROR("{}: the backend did not answer within {} ms (VRDMA_TIMEOUT_MS); failing it",
                 op_name(h.op), timeout_ms);
      errno = ETIMEDOUT;
      return ETIMEDOUT;
    }
    if (!received && st.is_ok()) st = recv_msg(sock.get(), msg, cap, fds);
    // The answer to a call that timed out earlier, ours or (a shared socket) another
    // context's: not ours (it may be longer than ours: EMSGSIZE). Contexts sharing a socket
    // count from far apart (import_device).
    if ((st.is_ok() || st.err() == EMFILE || st.err() == EMSGSIZE) &&
        msg.size() >= sizeof(MsgHeader)) {
      MsgHeader rh;
      std::memcpy(&rh, msg.data(), sizeof(rh));
      if (rh.seq != h.seq) {
        VLOG_DEBUG("skipping the late answer to call {} ({})", rh.seq, op_name(rh.op));
        continue;
      }
    }
    break;
  }
  answer_spin.note(spun_ns, mono_ns() - sent_ns);
  if (st.err() == EMSGSIZE) {  // ours, longer than this call's answer: the device is fine
    VLOG_ERROR("response of op {} is longer than the {} bytes expected", h.op, cap);
    errno = EIO;
    return EIO;
  }
  if (st.err() == EMFILE) {
    // The response came, but this process had no room for its descriptors: the verb fails; the
    // device is fine (what the backend made for it goes with the context).
    VLOG_ERROR("op {}: {}", h.op, st.message());
    errno = EMFILE;
    return EMFILE;
  }
  if (!st.is_ok()) {
    if (!dead.exchange(true)) VLOG_ERROR("lost the backend: {}", st.message());
    errno = EIO;
    return EIO;
  }
  auto rh = decode_header(msg);
  if (!rh.is_ok() || rh->seq != h.seq || rh->op != h.op) {
    VLOG_ERROR("bad response from the backend");
    errno = EIO;
    return EIO;
  }
  if (answer_flags) *answer_flags = rh->flags;
  if (rh->status != 0) {
    if (msg.size() > sizeof(MsgHeader)) say_refusal(h.op, reason_of(msg), rh->flags & kAnswerQuota);
    errno = -rh->status;
    return errno;
  }
  if (msg.size() != sizeof(MsgHeader) + resp_len) {
    VLOG_ERROR("response of op {} has {} bytes, expected {}", h.op, msg.size(),
               sizeof(MsgHeader) + resp_len);
    errno = EIO;
    return EIO;
  }
  if (resp_len) std::memcpy(resp, msg.data() + sizeof(MsgHeader), resp_len);
  if (fds_out) *fds_out = std::move(fds);
  return 0;
}

void VContext::ring_doorbell(uint32_t qp_handle) const {
  // Pairs with the backend's seq_cst store of backend_sleeping before its last look, and with
  // its clearing of the ready bits before it reads a ring (proto::ReadyBits).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (ready && qp_handle != proto::kNone) proto::mark_ready(*ready, qp_handle);
  if (control_page()->backend_sleeping.load(std::memory_order_seq_cst)) {
    uint64_t one = 1;
    woke_backend.store(true, std::memory_order_relaxed);
    ssize_t n = ::write(doorbell.get(), &one, sizeof(one));
    (void)n;
  }
}

bool VContext::backend_gone() {
  if (dead.load(std::memory_order_relaxed)) return true;
  pollfd p{sock.get(), POLLRDHUP, 0};
  if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
    if (!dead.exchange(true)) VLOG_ERROR("the vrdma backend is gone; device vrdma0 is dead");
  }
  return dead.load(std::memory_order_relaxed);
}

void fill_device_attr(const VContext& ctx, ibv_device_attr& a) {
  std::memset(&a, 0, sizeof(a));
  std::snprintf(a.fw_ver, sizeof(a.fw_ver), "0.1.0");
  a.node_guid = htobe64(ctx.hello.port_guid);
  a.sys_image_guid = htobe64(ctx.hello.port_guid);
  a.max_mr_size = kMaxMrSize;
  a.page_size_cap = 4096;
  a.vendor_id = kVendorId;
  a.vendor_part_id = kVendorPartId;
  a.hw_ver = kHwVer;
  a.max_qp = kMaxQp;
  a.max_qp_wr = kMaxQpWr;
  // Memory windows, type 1 and 2B (bound to a PD and a QP: proto/responder_rules.h), with
  // local and remote invalidation: the memory management extensions. XRC (xrc.cc).
  a.device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_PORT_ACTIVE_EVENT |
                       IBV_DEVICE_MEM_WINDOW | IBV_DEVICE_MEM_WINDOW_TYPE_2B |
                       IBV_DEVICE_MEM_MGT_EXTENSIONS | IBV_DEVICE_XRC;
  a.max_sge = kMaxSge;
  a.max_sge_rd = kMaxSge;
  a.max_cq = kMaxCq;
  a.max_cqe = kMaxCqe;
  a.max_mr = kMaxMr;
  a.max_mw = kMaxMw;
  a.max_pd = kMaxPd;
  a.max_qp_rd_atom = kMaxRdAtomic;
  a.max_ee_rd_atom = 0;
  a.max_res_rd_atom = kMaxRdAtomic * kMaxQp;
  a.max_qp_init_rd_atom = kMaxRdAtomic;
  // Every atomic of a host runs on the backend's engine thread as a CPU atomic: atomic across
  // all QPs of the device (HCA-wide), not only within one QP.
  a.atomic_cap = IBV_ATOMIC_HCA;
  a.max_srq = kMaxSrq;
  a.max_srq_wr = kMaxQpWr;
  a.max_srq_sge = kMaxSge;
  a.max_ah = 1 << 20;  // address handles live in the guest
  a.max_mcast_grp = kMaxMcastGroups;
  a.max_mcast_qp_attach = kMaxMcastQpAttach;
  a.max_total_mcast_qp_attach = kMaxMcastGroups * kMaxMcastQpAttach;
  a.max_pkeys = 1;
  a.local_ca_ack_delay = 0;
  a.phys_port_cnt = 1;
  // What this guest may really create: the device's caps, or its quotas where lower (a CQ of
  // the advertised max_cqe must be created, not refused with ENOMEM).
  const ControlPage* cp = ctx.control_page();
  if (!cp || !(cp->features & kFeatureLimits)) return;
  const GuestLimits& l = cp->limits;
  auto cap = [](auto& field, uint64_t quota) {
    if (quota != 0 && quota < static_cast<uint64_t>(field))
      field = static_cast<std::remove_reference_t<decltype(field)>>(quota);
  };
  cap(a.max_qp_wr, l.max_queue_depth);
  cap(a.max_cqe, l.max_queue_depth);
  cap(a.max_srq_wr, l.max_queue_depth);
  cap(a.max_qp, l.max_qps);
  cap(a.max_cq, l.max_cqs);
  cap(a.max_srq, l.max_srqs);
  cap(a.max_mr, l.max_mrs);
  cap(a.max_mw, cp->max_mws);
  cap(a.max_pd, l.max_pds);
  cap(a.max_mr_size, uint64_t{l.max_mr_bytes_hi} << 32 | l.max_mr_bytes_lo);
}

}  // namespace vrdma::verbs

namespace {

int vrdma_query_port(ibv_context* c, uint8_t port, ibv_port_attr* a, size_t len) {
  if (port != 1) return EINVAL;
  ibv_port_attr p{};
  p.state = IBV_PORT_ACTIVE;
  p.max_mtu = IBV_MTU_4096;
  p.active_mtu = IBV_MTU_4096;
  p.gid_tbl_len = 1;
  p.port_cap_flags = 0;
  p.max_msg_sz = kMaxMsgSize;
  p.bad_pkey_cntr = 0;
  p.qkey_viol_cntr = 0;
  p.pkey_tbl_len = 1;
  p.lid = static_cast<uint16_t>(to_vctx(c)->hello.lid);
  p.sm_lid = 1;
  p.lmc = 0;
  p.max_vl_num = 1;
  p.sm_sl = 0;
  p.subnet_timeout = 18;
  p.init_type_reply = 0;
  p.active_width = 2;   // 4X
  p.active_speed = 32;  // EDR (25 Gb/s per lane)
  p.phys_state = 5;     // LinkUp
  p.link_layer = IBV_LINK_LAYER_INFINIBAND;
  std::memcpy(a, &p, std::min(len, sizeof(p)));
  return 0;
}

int vrdma_query_device_ex(ibv_context* c, const ibv_query_device_ex_input* input,
                          ibv_device_attr_ex* attr, size_t attr_size) {
  if (input && input->comp_mask) return EINVAL;
  if (attr_size < sizeof(ibv_device_attr)) return EINVAL;
  std::memset(attr, 0, attr_size);
  fill_device_attr(*to_vctx(c), attr->orig_attr);
  if (attr_size >= offsetof(ibv_device_attr_ex, phys_port_cnt_ex) + sizeof(uint32_t))
    attr->phys_port_cnt_ex = attr->orig_attr.phys_port_cnt;
  // On-demand paging (odp.cc, proto/device_caps.h).
  if (attr_size >= offsetof(ibv_device_attr_ex, odp_caps) + sizeof(ibv_odp_caps)) {
    attr->odp_caps.general_caps = kOdpGeneralCaps;
    attr->odp_caps.per_transport_caps.rc_odp_caps = kOdpRcCaps;
    attr->odp_caps.per_transport_caps.uc_odp_caps = kOdpUcCaps;
    attr->odp_caps.per_transport_caps.ud_odp_caps = kOdpUdCaps;
  }
  if (attr_size >= offsetof(ibv_device_attr_ex, xrc_odp_caps) + sizeof(uint32_t))
    attr->xrc_odp_caps = kOdpRcCaps;
  if (attr_size >= offsetof(ibv_device_attr_ex, max_dm_size) + sizeof(uint64_t))
    attr->max_dm_size = max_dm_size(*to_vctx(c));
  // Completion timestamps: ns of CLOCK_MONOTONIC_RAW (proto/ring.h), a 64-bit counter at 1 GHz.
  if (attr_size >= offsetof(ibv_device_attr_ex, hca_core_clock) + sizeof(uint64_t)) {
    attr->completion_timestamp_mask = ~uint64_t{0};
    attr->hca_core_clock = kStampClockKhz;
  }
  return 0;
}

/// ibv_query_rt_values_ex: the clock completions are stamped with, now. As mlx5 gives its raw
/// clock: all of it in tv_nsec, tv_sec 0 (so tv_sec * 1e9 + tv_nsec reads the same). Bits
/// asked for that it does not know come back cleared, as mlx5 answers.
int vrdma_query_rt_values(ibv_context*, ibv_values_ex* values) {
  const uint32_t asked = values->comp_mask;
  values->comp_mask = 0;
  if (asked & IBV_VALUES_MASK_RAW_CLOCK) {
    values->raw_clock.tv_sec = 0;
    values->raw_clock.tv_nsec = static_cast<long>(clock_ns(CLOCK_MONOTONIC_RAW));
    values->comp_mask = IBV_VALUES_MASK_RAW_CLOCK;
  }
  return 0;
}

template <typename... A>
int unsupported_int(A...) {
  return EOPNOTSUPP;
}

}  // namespace

VERBS_EXPORT ibv_device** ibv_get_device_list(int* num) {
  auto** list = static_cast<ibv_device**>(std::calloc(2, sizeof(ibv_device*)));
  if (!list) {
    errno = ENOMEM;
    return nullptr;
  }
  list[0] = &g_device;
  if (num) *num = 1;
  return list;
}

VERBS_EXPORT void ibv_free_device_list(ibv_device** list) { std::free(list); }

VERBS_EXPORT const char* ibv_get_device_name(ibv_device* d) { return d ? d->name : nullptr; }

VERBS_EXPORT int ibv_get_device_index(ibv_device* d) { return d == &g_device ? 0 : -1; }

VERBS_EXPORT __be64 ibv_get_device_guid(ibv_device*) {
  // A bad VRDMA_GUEST is reported when the device is opened.
  auto name = guest_name();
  return htobe64(port_guid_of(name.is_ok() ? name.value() : std::string()));
}

namespace {
ibv_context* start_context(VContext* ctx, std::vector<UniqueFd>& fds);
}  // namespace

VERBS_EXPORT ibv_context* ibv_open_device(ibv_device* dev) {
  if (dev != &g_device) {
    errno = ENODEV;
    return nullptr;
  }
  auto guest = guest_name();
  if (!guest.is_ok()) {
    VLOG_ERROR("{}", guest.status().message());
    errno = EINVAL;
    return nullptr;
  }
  asymmetric_barrier_available();  // registers now, before our threads (path_lock.h)
  auto sock = connect_backend();
  if (!sock.is_ok()) {
    VLOG_ERROR("cannot reach the vrdma backend: {}",
               backend_unreachable_hint(socket_path(), sock.status().err()));
    // EAGAIN: the connect timed out (a backend whose queue of new connections is full).
    errno = sock.status().err() == EAGAIN ? ETIMEDOUT : ENODEV;
    return nullptr;
  }
  auto* ctx = new VContext();
  ctx->sock = std::move(sock.value());
  ctx->guest = std::move(guest).value();
  HelloReq req{};
  std::snprintf(req.guest, sizeof(req.guest), "%s", ctx->guest.c_str());
  req.pid = static_cast<uint32_t>(::getpid());
  std::vector<UniqueFd> fds;
  if (ctx->call(Op::kHello, req, ctx->hello, {}, &fds) != 0 || fds.size() != 3) {
    int err = errno ? errno : EIO;
    if (err == EPERM) {
      // The name is another user's guest (the backend does not say whose).
      VLOG_ERROR(
          "guest {} belongs to another user (not to uid {}); choose another name with "
          "VRDMA_GUEST (vrdma run --guest NAME)",
          ctx->guest, ::geteuid());
    } else {
      VLOG_ERROR("backend refused guest '{}': {}", ctx->guest, std::strerror(err));
    }
    delete ctx;
    errno = err;
    return nullptr;
  }
  return start_context(ctx, fds);
}

namespace {

/// The rest of opening a context once the backend said hello (`fds`: the control page, the
/// doorbell, the async pipe's read end): maps, fills the ops. Null (ctx deleted) on failure.
ibv_context* start_context(VContext* ctx, std::vector<UniqueFd>& fds) {
  ctx->control = MappedRegion::map_shared(fds[0].get(), ctx->hello.control_bytes);
  ctx->call_lock =
      UniqueFd(::open(fmt::format("/proc/self/fd/{}", fds[0].get()).c_str(), O_RDWR | O_CLOEXEC));
  ctx->doorbell = std::move(fds[1]);
  if (!ctx->control.valid() || !ctx->call_lock.valid()) {
    delete ctx;
    errno = ENOMEM;
    return nullptr;
  }
  if (ctx->control_page()->features & proto::kFeatureReadyBits) {
    ctx->ready = proto::ready_bits(ctx->control_page());
    ctx->ready->marks.store(1, std::memory_order_relaxed);
  }
  send_direct_cookie(*ctx);
  verbs_context& v = ctx->vctx;
  ibv_context& c = v.context;
  c.device = &g_device;
  c.cmd_fd = ctx->sock.get();
  c.async_fd = fds[2].release();
  c.num_comp_vectors = 1;
  pthread_mutex_init(&c.mutex, nullptr);
  c.abi_compat = __VERBS_ABI_IS_EXTENDED;
  c.ops.post_send = post_send;
  c.ops.post_recv = post_recv;
  c.ops.poll_cq = poll_cq;
  c.ops.req_notify_cq = req_notify_cq;
  c.ops.post_srq_recv = post_srq_recv;
  c.ops.alloc_mw = alloc_mw;
  c.ops.bind_mw = bind_mw;
  c.ops.dealloc_mw = dealloc_mw;
  v.sz = sizeof(verbs_context);
  v.query_port = vrdma_query_port;
  v.query_device_ex = vrdma_query_device_ex;
  v.query_rt_values = vrdma_query_rt_values;
  v.create_cq_ex = create_cq_ex;
  v.create_qp_ex = create_qp_ex;
  v.alloc_dm = alloc_dm;
  v.free_dm = free_dm;
  v.reg_dm_mr = reg_dm_mr;
  v.open_xrcd = open_xrcd;
  v.close_xrcd = close_xrcd;
  v.create_srq_ex = create_srq_ex;
  v.get_srq_num = get_srq_num;
  v.open_qp = open_qp;
  v.advise_mr = advise_mr;
  return &c;
}

}  // namespace

// ibv_import_device(3): another process's context, by its cmd_fd (dup'ed and passed here, e.g.
// by SCM_RIGHTS), which is the session's socket: this context shares the session (its objects,
// handles and quotas) and owns the descriptor from now on. The backend answers on a socket of
// our own (see kImportContext); from then on the session's command lock keeps the two apart.
VERBS_EXPORT ibv_context* ibv_import_device(int cmd_fd) {
  int sp[2];
  if (cmd_fd < 0 || ::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) < 0)
    return fail_ptr<ibv_context>(cmd_fd < 0 ? EBADF : errno);
  UniqueFd mine(sp[0]), theirs(sp[1]);
  const MsgHeader h{
      kMagic, kVersion, static_cast<uint16_t>(Op::kImportContext), sizeof(MsgHeader), 1, 0, 0};
  std::vector<uint8_t> msg(sizeof(h));
  std::memcpy(msg.data(), &h, sizeof(h));
  const int give[] = {theirs.get()};
  std::vector<UniqueFd> fds;
  Status st = send_msg(cmd_fd, msg, give);
  theirs.reset();  // the backend holds it now (or never will: recv ends with ECONNRESET)
  if (st.is_ok()) {
    pollfd p{mine.get(), POLLIN, 0};
    const int n = ::poll(&p, 1, control_timeout_ms() > 0 ? control_timeout_ms() : -1);
    st = n == 1 ? recv_msg(mine.get(), msg, kMaxResponse, fds) : error(ETIMEDOUT, "no answer");
  }
  auto rh = st.is_ok() ? decode_header(msg) : Result<MsgHeader>(st);
  if (!rh.is_ok() || rh->op != h.op || rh->status != 0 ||
      msg.size() != sizeof(MsgHeader) + sizeof(HelloResp) || fds.size() != 3) {
    // Not a vrdma context's cmd_fd, or a backend without imports: the descriptor stays the
    // caller's.
    VLOG_ERROR("ibv_import_device: fd {} is no vrdma context's cmd_fd, or its backend refused: {}",
               cmd_fd, rh.is_ok() ? std::strerror(-rh->status) : rh.status().message());
    return fail_ptr<ibv_context>(rh.is_ok() && rh->status ? -rh->status : EOPNOTSUPP);
  }
  auto* ctx = new VContext();
  std::memcpy(&ctx->hello, msg.data() + sizeof(MsgHeader), sizeof(HelloResp));
  ctx->sock = UniqueFd(cmd_fd);
  // Far from the other context's count, so neither takes the other's late answer for its own.
  ctx->seq = static_cast<uint32_t>(mono_ms() * 2654435761u) ^ static_cast<uint32_t>(::getpid());
  return start_context(ctx, fds);
}

VERBS_EXPORT int ibv_close_device(ibv_context* c) {
  VContext* ctx = to_vctx(c);
  stop_odp_pager(*ctx);
  remote_shutdown(*ctx);
  ::close(c->async_fd);
  pthread_mutex_destroy(&c->mutex);
  delete ctx;  // closing the socket makes the backend reclaim anything left
  return 0;
}

VERBS_EXPORT int ibv_query_device(ibv_context* c, ibv_device_attr* a) {
  fill_device_attr(*to_vctx(c), *a);
  return 0;
}

#undef ibv_query_port
VERBS_EXPORT int ibv_query_port(ibv_context* c, uint8_t port, struct _compat_ibv_port_attr* a) {
  // Old binaries pass the smaller pre-1.1 struct; its layout is a prefix of ibv_port_attr.
  return vrdma_query_port(c, port, reinterpret_cast<ibv_port_attr*>(a),
                          offsetof(ibv_port_attr, link_layer) + 1);
}

VERBS_EXPORT int ibv_query_gid(ibv_context* c, uint8_t port, int index, union ibv_gid* gid) {
  if (port != 1 || index != 0) {
    errno = EINVAL;
    return -1;
  }
  std::memcpy(gid->raw, to_vctx(c)->hello.gid, 16);
  return 0;
}

VERBS_EXPORT int ibv_query_pkey(ibv_context*, uint8_t port, int index, __be16* pkey) {
  if (port != 1 || index != 0) {
    errno = EINVAL;
    return -1;
  }
  *pkey = htobe16(0xffff);
  return 0;
}

VERBS_EXPORT int ibv_get_pkey_index(ibv_context*, uint8_t port, __be16 pkey) {
  if (port != 1) return -EINVAL;
  return be16toh(pkey) == 0xffff ? 0 : -ENOENT;
}

// Declared in rdma-core's private driver.h; the enum is 32 bits, 0 meaning "IB/RoCE v1".
VERBS_EXPORT int ibv_query_gid_type(ibv_context*, uint8_t port, unsigned int index,
                                    uint32_t* type) {
  if (port != 1 || index != 0) {
    errno = EINVAL;
    return -1;
  }
  *type = 0;
  return 0;
}

VERBS_EXPORT int _ibv_query_gid_ex(ibv_context* c, uint32_t port, uint32_t index,
                                   ibv_gid_entry* entry, uint32_t flags, size_t entry_size) {
  if (flags) return EINVAL;
  if (port != 1) return EINVAL;
  if (index != 0) return ENODATA;
  if (entry_size < sizeof(ibv_gid_entry)) return EINVAL;
  std::memset(entry, 0, sizeof(*entry));
  std::memcpy(entry->gid.raw, to_vctx(c)->hello.gid, 16);
  entry->gid_index = 0;
  entry->port_num = 1;
  entry->gid_type = IBV_GID_TYPE_IB;
  entry->ndev_ifindex = 0;
  return 0;
}

VERBS_EXPORT ssize_t _ibv_query_gid_table(ibv_context* c, ibv_gid_entry* entries,
                                          size_t max_entries, uint32_t flags, size_t entry_size) {
  if (flags || entry_size < sizeof(ibv_gid_entry)) return -EINVAL;
  if (max_entries < 1) return -EINVAL;
  int rc = _ibv_query_gid_ex(c, 1, 0, entries, 0, entry_size);
  return rc ? -rc : 1;
}

VERBS_EXPORT int ibv_get_async_event(ibv_context* c, ibv_async_event* ev) {
  uint32_t raw[2];
  VContext* ctx = to_vctx(c);
  ssize_t n = ::read(c->async_fd, raw, sizeof(raw));
  if (n == 0) {
    // The backend closed its end: the device is gone. Report that once, as a fatal event.
    if (ctx->fatal_reported.exchange(true)) {
      errno = EIO;
      return -1;
    }
    ctx->dead = true;
    ev->event_type = IBV_EVENT_DEVICE_FATAL;
    ev->element.port_num = 0;
    return 0;
  }
  if (n != sizeof(raw)) return -1;
  ev->event_type = static_cast<ibv_event_type>(raw[0]);
  std::lock_guard<std::mutex> g(ctx->objs_mu);
  switch (ev->event_type) {
    case IBV_EVENT_CQ_ERR: {
      auto it = ctx->cqs.find(raw[1]);
      ev->element.cq = it == ctx->cqs.end() ? nullptr : &it->second->cq;
      break;
    }
    case IBV_EVENT_SRQ_LIMIT_REACHED:
    case IBV_EVENT_SRQ_ERR:
      ev->element.srq = find_srq(c, raw[1]);
      break;
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_PORT_ERR:
      ev->element.port_num = static_cast<int>(raw[1]);
      break;
    default: {
      auto it = ctx->qps.find(raw[1]);
      ev->element.qp = it == ctx->qps.end() ? nullptr : &it->second->qp;
      break;
    }
  }
  return 0;
}

VERBS_EXPORT void ibv_ack_async_event(ibv_async_event*) {}

namespace vrdma::verbs {
bool raise_async_event(ibv_context* c, ibv_event_type type, uint32_t handle) {
  // The async fd is the read end of the session's pipe; the backend holds the only write end.
  // Another one, opened through /proc for this one write and closed at once (one held would keep
  // the pipe from reading EOF when the backend dies: the device-fatal event above). 8 bytes, as
  // the backend writes them: below PIPE_BUF, so never mixed with one of its events.
  UniqueFd w(::open(fmt::format("/proc/self/fd/{}", c->async_fd).c_str(),
                    O_WRONLY | O_NONBLOCK | O_CLOEXEC));
  const uint32_t ev[2] = {static_cast<uint32_t>(type), handle};
  return w.valid() && ::write(w.get(), ev, sizeof(ev)) == sizeof(ev);
}
}  // namespace vrdma::verbs

VERBS_EXPORT int ibv_fork_init(void) {
  // From now on registered pages are MADV_DONTFORK (memory.cc), as with rdma-core: a child
  // does not get them, and fork() no longer copies them.
  g_fork_init = true;
  return 0;
}

namespace vrdma::verbs {
bool fork_safe() {
  // rdma-core reads these at ibv_get_device_list; read at the first registration here.
  static const bool env = ::getenv("RDMAV_FORK_SAFE") || ::getenv("IBV_FORK_SAFE");
  return env || g_fork_init.load();
}
}  // namespace vrdma::verbs

VERBS_EXPORT enum ibv_fork_status ibv_is_fork_initialized(void) {
  return vrdma::verbs::fork_safe() ? IBV_FORK_ENABLED : IBV_FORK_DISABLED;
}

VERBS_EXPORT int ibv_dontfork_range(void*, size_t) { return 0; }
VERBS_EXPORT int ibv_dofork_range(void*, size_t) { return 0; }
