// Every libibverbs export that is not a core verb: pure helpers (strings, rate tables, kernel ABI
// copies, sysfs reads) done for real, and verbs we do not support, the pre-1.1 compat ABI and the
// IBVERBS_PRIVATE_34 provider interface, all of which fail cleanly and never touch their arguments.

#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/unique_fd.h"

// Everything declared or defined below is visible by default, whatever -fvisibility the build
// uses; libibverbs.map alone decides what leaves the library.
#pragma GCC visibility push(default)
#include <infiniband/sa.h>
#include <infiniband/verbs.h>
#include <rdma/ib_user_sa.h>
#include <rdma/ib_user_verbs.h>

namespace {

// Sets errno for callers that look at it and returns `value`: the shape of every refusal below.
template <typename T>
T fail(int err, T value) {
  errno = err;
  return value;
}

// One IB rate: its enum, its multiple of 2.5 Gb/s (-1: none) and its data rate in Mb/s (FDR
// lanes carry 14.0625 Gb/s, EDR 25.78125). The values are those Debian's libibverbs returns,
// quirks included, so tools print the same with either library: no multiple for FDR nor for
// 25/100/200/300 Gb/s, yet 11 for 28 Gb/s and whole multiples from 50 Gb/s up.
struct RateRow {
  ibv_rate rate;
  int mult;
  int mbps;
};

constexpr RateRow kRates[] = {
    {IBV_RATE_2_5_GBPS, 1, 2500},       {IBV_RATE_5_GBPS, 2, 5000},
    {IBV_RATE_10_GBPS, 4, 10000},       {IBV_RATE_20_GBPS, 8, 20000},
    {IBV_RATE_30_GBPS, 12, 30000},      {IBV_RATE_40_GBPS, 16, 40000},
    {IBV_RATE_60_GBPS, 24, 60000},      {IBV_RATE_80_GBPS, 32, 80000},
    {IBV_RATE_120_GBPS, 48, 120000},    {IBV_RATE_14_GBPS, -1, 14062},
    {IBV_RATE_56_GBPS, -1, 56250},      {IBV_RATE_112_GBPS, -1, 112500},
    {IBV_RATE_168_GBPS, -1, 168750},    {IBV_RATE_25_GBPS, -1, 25781},
    {IBV_RATE_100_GBPS, -1, 103125},    {IBV_RATE_200_GBPS, -1, 206250},
    {IBV_RATE_300_GBPS, -1, 309375},    {IBV_RATE_28_GBPS, 11, 28125},
    {IBV_RATE_50_GBPS, 20, 53125},      {IBV_RATE_400_GBPS, 160, 425000},
    {IBV_RATE_600_GBPS, 240, 637500},   {IBV_RATE_800_GBPS, 320, 850000},
    {IBV_RATE_1200_GBPS, 480, 1275000},
};

void copy_ah_attr(ibv_ah_attr* dst, const ib_uverbs_ah_attr* src) {
  std::memcpy(dst->grh.dgid.raw, src->grh.dgid, sizeof(dst->grh.dgid.raw));
  dst->grh.flow_label = src->grh.flow_label;
  dst->grh.sgid_index = src->grh.sgid_index;
  dst->grh.hop_limit = src->grh.hop_limit;
  dst->grh.traffic_class = src->grh.traffic_class;
  dst->dlid = src->dlid;
  dst->sl = src->sl;
  dst->src_path_bits = src->src_path_bits;
  dst->static_rate = src->static_rate;
  dst->is_global = src->is_global;
  dst->port_num = src->port_num;
}

// The sysfs root, read once: $SYSFS_PATH (not for set-uid programs) without trailing '/', else
// "/sys". Function-local static: initialised thread-safely on first use, then read-only.
const std::string& sysfs_root() {
  static const std::string root = [] {
    std::string path = "/sys";
    if (const char* env = secure_getenv("SYSFS_PATH"); env != nullptr && env[0] != '\0') {
      path = env;
      while (path.size() > 1 && path.back() == '/') {
        path.pop_back();
      }
    }
    return path;
  }();
  return root;
}

}  // namespace

extern "C" {

// ---------------------------------------------------------------------------------------------
// Strings (ibv_*_str(3)): constant, never NULL, "unknown" for values out of range; the same
// text as Debian's libibverbs, since ibv_devinfo and perftest print it.

const char* ibv_wc_status_str(enum ibv_wc_status status) {
  static const char* const kNames[] = {
      "success",                            // IBV_WC_SUCCESS
      "local length error",                 // IBV_WC_LOC_LEN_ERR
      "local QP operation error",           // IBV_WC_LOC_QP_OP_ERR
      "local EE context operation error",   // IBV_WC_LOC_EEC_OP_ERR
      "local protection error",             // IBV_WC_LOC_PROT_ERR
      "Work Request Flushed Error",         // IBV_WC_WR_FLUSH_ERR
      "memory management operation error",  // IBV_WC_MW_BIND_ERR
      "bad response error",                 // IBV_WC_BAD_RESP_ERR
      "local access error",                 // IBV_WC_LOC_ACCESS_ERR
      "remote invalid request error",       // IBV_WC_REM_INV_REQ_ERR
      "remote access error",                // IBV_WC_REM_ACCESS_ERR
      "remote operation error",             // IBV_WC_REM_OP_ERR
      "transport retry counter exceeded",   // IBV_WC_RETRY_EXC_ERR
      "RNR retry counter exceeded",         // IBV_WC_RNR_RETRY_EXC_ERR
      "local RDD violation error",          // IBV_WC_LOC_RDD_VIOL_ERR
      "remote invalid RD request",          // IBV_WC_REM_INV_RD_REQ_ERR
      "aborted error",                      // IBV_WC_REM_ABORT_ERR
      "invalid EE context number",          // IBV_WC_INV_EECN_ERR
      "invalid EE context state",           // IBV_WC_INV_EEC_STATE_ERR
      "fatal error",                        // IBV_WC_FATAL_ERR
      "response timeout error",             // IBV_WC_RESP_TIMEOUT_ERR
      "general error",                      // IBV_WC_GENERAL_ERR
      "TM error",                           // IBV_WC_TM_ERR
      "TM software rendezvous",             // IBV_WC_TM_RNDV_INCOMPLETE
  };
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == IBV_WC_TM_RNDV_INCOMPLETE + 1);
  const auto i = static_cast<unsigned>(status);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "unknown";
}

const char* ibv_event_type_str(enum ibv_event_type event) {
  static const char* const kNames[] = {
      "CQ error",                                 // IBV_EVENT_CQ_ERR
      "local work queue catastrophic error",      // IBV_EVENT_QP_FATAL
      "invalid request local work queue error",   // IBV_EVENT_QP_REQ_ERR
      "local access violation work queue error",  // IBV_EVENT_QP_ACCESS_ERR
      "communication established",                // IBV_EVENT_COMM_EST
      "send queue drained",                       // IBV_EVENT_SQ_DRAINED
      "path migrated",                            // IBV_EVENT_PATH_MIG
      "path migration request error",             // IBV_EVENT_PATH_MIG_ERR
      "local catastrophic error",                 // IBV_EVENT_DEVICE_FATAL
      "port active",                              // IBV_EVENT_PORT_ACTIVE
      "port error",                               // IBV_EVENT_PORT_ERR
      "LID change",                               // IBV_EVENT_LID_CHANGE
      "P_Key change",                             // IBV_EVENT_PKEY_CHANGE
      "SM change",                                // IBV_EVENT_SM_CHANGE
      "SRQ catastrophic error",                   // IBV_EVENT_SRQ_ERR
      "SRQ limit reached",                        // IBV_EVENT_SRQ_LIMIT_REACHED
      "last WQE reached",                         // IBV_EVENT_QP_LAST_WQE_REACHED
      "client reregistration",                    // IBV_EVENT_CLIENT_REREGISTER
      "GID table change",                         // IBV_EVENT_GID_CHANGE
      "WQ fatal",                                 // IBV_EVENT_WQ_FATAL
  };
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == IBV_EVENT_WQ_FATAL + 1);
  const auto i = static_cast<unsigned>(event);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "unknown";
}

const char* ibv_node_type_str(enum ibv_node_type node_type) {
  switch (node_type) {
    case IBV_NODE_CA:
      return "InfiniBand channel adapter";
    case IBV_NODE_SWITCH:
      return "InfiniBand switch";
    case IBV_NODE_ROUTER:
      return "InfiniBand router";
    case IBV_NODE_RNIC:
      return "iWARP NIC";
    case IBV_NODE_USNIC:
      return "usNIC";
    case IBV_NODE_USNIC_UDP:
      return "usNIC UDP";
    case IBV_NODE_UNSPECIFIED:
      return "unspecified";
    case IBV_NODE_UNKNOWN:
      break;
  }
  return "unknown";
}

const char* ibv_port_state_str(enum ibv_port_state port_state) {
  switch (port_state) {
    case IBV_PORT_NOP:
      return "no state change (NOP)";
    case IBV_PORT_DOWN:
      return "down";
    case IBV_PORT_INIT:
      return "init";
    case IBV_PORT_ARMED:
      return "armed";
    case IBV_PORT_ACTIVE:
      return "active";
    case IBV_PORT_ACTIVE_DEFER:
      return "active defer";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// Rates (ibv_rate_to_mult(3), ibv_rate_to_mbps(3)). Unknown input: -1 / IBV_RATE_MAX.

int ibv_rate_to_mult(enum ibv_rate rate) {
  for (const RateRow& r : kRates) {
    if (r.rate == rate) {
      return r.mult;
    }
  }
  return -1;
}

enum ibv_rate mult_to_ibv_rate(int mult) {
  for (const RateRow& r : kRates) {
    if (r.mult > 0 && r.mult == mult) {
      return r.rate;
    }
  }
  return IBV_RATE_MAX;
}

int ibv_rate_to_mbps(enum ibv_rate rate) {
  for (const RateRow& r : kRates) {
    if (r.rate == rate) {
      return r.mbps;
    }
  }
  return -1;
}

enum ibv_rate mbps_to_ibv_rate(int mbps) {
  for (const RateRow& r : kRates) {
    if (r.mbps == mbps) {
      return r.rate;
    }
  }
  return IBV_RATE_MAX;
}

// ---------------------------------------------------------------------------------------------
// Kernel ABI <-> verbs struct copies (rdma-core's marshall.h, not installed: the kernel structs
// come from linux-libc-dev's <rdma/ib_user_*.h>). Field by field; fields absent on one side
// are left as they were.

void ibv_copy_ah_attr_from_kern(struct ibv_ah_attr* dst, struct ib_uverbs_ah_attr* src) {
  copy_ah_attr(dst, src);
}

// qp_state is copied like every other field (Debian's libibverbs leaves dst->qp_state alone).
void ibv_copy_qp_attr_from_kern(struct ibv_qp_attr* dst, struct ib_uverbs_qp_attr* src) {
  dst->qp_state = static_cast<ibv_qp_state>(src->qp_state);
  dst->cur_qp_state = static_cast<ibv_qp_state>(src->cur_qp_state);
  dst->path_mtu = static_cast<ibv_mtu>(src->path_mtu);
  dst->path_mig_state = static_cast<ibv_mig_state>(src->path_mig_state);
  dst->qkey = src->qkey;
  dst->rq_psn = src->rq_psn;
  dst->sq_psn = src->sq_psn;
  dst->dest_qp_num = src->dest_qp_num;
  dst->qp_access_flags = static_cast<unsigned>(src->qp_access_flags);
  dst->cap.max_send_wr = src->max_send_wr;
  dst->cap.max_recv_wr = src->max_recv_wr;
  dst->cap.max_send_sge = src->max_send_sge;
  dst->cap.max_recv_sge = src->max_recv_sge;
  dst->cap.max_inline_data = src->max_inline_data;
  copy_ah_attr(&dst->ah_attr, &src->ah_attr);
  copy_ah_attr(&dst->alt_ah_attr, &src->alt_ah_attr);
  dst->pkey_index = src->pkey_index;
  dst->alt_pkey_index = src->alt_pkey_index;
  dst->en_sqd_async_notify = src->en_sqd_async_notify;
  dst->sq_draining = src->sq_draining;
  dst->max_rd_atomic = src->max_rd_atomic;
  dst->max_dest_rd_atomic = src->max_dest_rd_atomic;
  dst->min_rnr_timer = src->min_rnr_timer;
  dst->port_num = src->port_num;
  dst->timeout = src->timeout;
  dst->retry_cnt = src->retry_cnt;
  dst->rnr_retry = src->rnr_retry;
  dst->alt_port_num = src->alt_port_num;
  dst->alt_timeout = src->alt_timeout;
}

void ibv_copy_path_rec_from_kern(struct ibv_sa_path_rec* dst, struct ib_user_path_rec* src) {
  std::memcpy(dst->dgid.raw, src->dgid, sizeof(dst->dgid.raw));
  std::memcpy(dst->sgid.raw, src->sgid, sizeof(dst->sgid.raw));
  dst->dlid = src->dlid;
  dst->slid = src->slid;
  dst->raw_traffic = static_cast<int>(src->raw_traffic);
  dst->flow_label = src->flow_label;
  dst->reversible = static_cast<int>(src->reversible);
  dst->mtu = static_cast<uint8_t>(src->mtu);
  dst->pkey = src->pkey;
  dst->hop_limit = src->hop_limit;
  dst->traffic_class = src->traffic_class;
  dst->numb_path = src->numb_path;
  dst->sl = src->sl;
  dst->mtu_selector = src->mtu_selector;
  dst->rate_selector = src->rate_selector;
  dst->rate = src->rate;
  dst->packet_life_time_selector = src->packet_life_time_selector;
  dst->packet_life_time = src->packet_life_time;
  dst->preference = src->preference;
}

void ibv_copy_path_rec_to_kern(struct ib_user_path_rec* dst, struct ibv_sa_path_rec* src) {
  std::memcpy(dst->dgid, src->dgid.raw, sizeof(dst->dgid));
  std::memcpy(dst->sgid, src->sgid.raw, sizeof(dst->sgid));
  dst->dlid = src->dlid;
  dst->slid = src->slid;
  dst->raw_traffic = static_cast<__u32>(src->raw_traffic);
  dst->flow_label = src->flow_label;
  dst->reversible = static_cast<__u32>(src->reversible);
  dst->mtu = src->mtu;
  dst->pkey = src->pkey;
  dst->hop_limit = src->hop_limit;
  dst->traffic_class = src->traffic_class;
  dst->numb_path = src->numb_path;
  dst->sl = src->sl;
  dst->mtu_selector = src->mtu_selector;
  dst->rate_selector = src->rate_selector;
  dst->rate = src->rate;
  dst->packet_life_time_selector = src->packet_life_time_selector;
  dst->packet_life_time = src->packet_life_time;
  dst->preference = src->preference;
}

// ---------------------------------------------------------------------------------------------
// sysfs (old driver.h API, still exported at IBVERBS_1.0).

const char* ibv_get_sysfs_path(void) { return sysfs_root().c_str(); }

// Reads "<dir>/<file>" into buf as a NUL-terminated string, a trailing newline giving its place
// to the NUL. Returns the string's length, or -1 with errno set, also (EOVERFLOW) when the whole
// file does not fit: a truncated sysfs value would be wrong, not short.
int ibv_read_sysfs_file(const char* dir, const char* file, char* buf, size_t size) {
  if (dir == nullptr || file == nullptr || buf == nullptr || size == 0) {
    return fail(EINVAL, -1);
  }
  char path[PATH_MAX];
  const int n = std::snprintf(path, sizeof(path), "%s/%s", dir, file);
  if (n < 0 || static_cast<size_t>(n) >= sizeof(path)) {
    return fail(ENAMETOOLONG, -1);
  }
  const vrdma::UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    return -1;
  }
  // Reads into buf, then one byte past it: it must find the end of the file.
  size_t len = 0;
  for (;;) {
    char probe;
    char* const dst = len < size ? buf + len : &probe;
    const ssize_t got = ::read(fd.get(), dst, len < size ? size - len : 1);
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got < 0) {
      return -1;
    }
    if (got == 0) {
      break;
    }
    if (dst == &probe) {
      return fail(EOVERFLOW, -1);
    }
    len += static_cast<size_t>(got);
  }
  if (len > 0 && buf[len - 1] == '\n') {
    --len;
  } else if (len == size) {
    return fail(EOVERFLOW, -1);  // no room for the NUL
  }
  buf[len] = '\0';
  return static_cast<int>(len);
}

// ---------------------------------------------------------------------------------------------
// Public verbs this device does not offer. Conventions follow each man page.

int ibv_resolve_eth_l2_from_gid(struct ibv_context*, struct ibv_ah_attr*, uint8_t[ETHERNET_LL_SIZE],
                                uint16_t*) {
  return fail(EOPNOTSUPP, EOPNOTSUPP);  // no Ethernet link layer: there is no MAC to resolve
}

int ibv_query_ece(struct ibv_qp*, struct ibv_ece*) { return fail(EOPNOTSUPP, EOPNOTSUPP); }

int ibv_set_ece(struct ibv_qp*, struct ibv_ece*) { return fail(EOPNOTSUPP, EOPNOTSUPP); }

struct ibv_mr* ibv_reg_dmabuf_mr(struct ibv_pd*, uint64_t, size_t, uint64_t, int, int) {
  return fail<ibv_mr*>(EOPNOTSUPP, nullptr);
}

// 0 means "in-order placement not guaranteed", which is always a true answer.
int ibv_query_qp_data_in_order(struct ibv_qp*, enum ibv_wr_opcode, uint32_t) { return 0; }

// ---------------------------------------------------------------------------------------------
// Compat symbols. C symbols carry no type, and in the SysV x86-64 / AArch64 calling conventions
// a callee that declares fewer parameters than the caller passes is safe (arguments travel in
// registers, the caller pops the stack), so every refusal below is declared without parameters
// and only its return type, whose width matters, is spelt out.

// ibv_register_driver@IBVERBS_1.1 (non-default only): the pre-rdma-core provider hook. No
// provider can work against this library, so the registration is dropped, silently.
__attribute__((symver("ibv_register_driver@IBVERBS_1.1"))) void vrdma_compat_ibv_register_driver() {
}

// The pre-1.1 ABI (ibv_xxx@IBVERBS_1.0, next to the default ibv_xxx@@IBVERBS_1.1): struct layouts
// from before 2006 that nothing built since can call. Refused with ENOSYS.
#define VRDMA_COMPAT_1_0(ret, name, value)                                        \
  __attribute__((symver(#name "@IBVERBS_1.0"))) ret vrdma_compat_##name##_1_0() { \
    return fail<ret>(ENOSYS, value);                                              \
  }
#define VRDMA_COMPAT_1_0_VOID(name) \
  __attribute__((symver(#name "@IBVERBS_1.0"))) void vrdma_compat_##name##_1_0() {}

// Pointer results: NULL.
VRDMA_COMPAT_1_0(void*, ibv_get_device_list, nullptr)
VRDMA_COMPAT_1_0(const char*, ibv_get_device_name, nullptr)
VRDMA_COMPAT_1_0(void*, ibv_open_device, nullptr)
VRDMA_COMPAT_1_0(void*, ibv_alloc_pd, nullptr)
VRDMA_COMPAT_1_0(void*, ibv_reg_mr, nullptr)
VRDMA_COMPAT_1_0(void*, ibv_create_cq, nullptr)
VRDMA_COMPAT_1_0(void*, ibv_create_srq, nullptr)
VRDMA_COMPAT_1_0(void*, ibv_create_qp, nullptr)
VRDMA_COMPAT_1_0(void*, ibv_create_ah, nullptr)
// __be64 GUID: 0 is no valid GUID.
VRDMA_COMPAT_1_0(uint64_t, ibv_get_device_guid, 0)
// "0 on success, -1 on error".
VRDMA_COMPAT_1_0(int, ibv_close_device, -1)
VRDMA_COMPAT_1_0(int, ibv_get_async_event, -1)
VRDMA_COMPAT_1_0(int, ibv_get_cq_event, -1)
VRDMA_COMPAT_1_0(int, ibv_query_gid, -1)
VRDMA_COMPAT_1_0(int, ibv_query_pkey, -1)
// "0 on success, or the value of errno on failure".
VRDMA_COMPAT_1_0(int, ibv_query_device, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_query_port, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_dealloc_pd, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_dereg_mr, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_resize_cq, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_destroy_cq, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_modify_srq, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_query_srq, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_destroy_srq, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_modify_qp, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_query_qp, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_destroy_qp, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_destroy_ah, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_attach_mcast, ENOSYS)
VRDMA_COMPAT_1_0(int, ibv_detach_mcast, ENOSYS)
// No result: nothing was ever handed out to free or acknowledge.
VRDMA_COMPAT_1_0_VOID(ibv_free_device_list)
VRDMA_COMPAT_1_0_VOID(ibv_ack_async_event)
VRDMA_COMPAT_1_0_VOID(ibv_ack_cq_events)

#undef VRDMA_COMPAT_1_0
#undef VRDMA_COMPAT_1_0_VOID

// ---------------------------------------------------------------------------------------------
// IBVERBS_PRIVATE_34: rdma-core's provider interface (driver.h, not installed). Debian's
// providers (libmlx5.so.1, libefa.so.1, ...) import these, and their constructors call
// verbs_register_driver_34() when a program such as perftest links them, so all must resolve
// and registration must be a harmless no-op. No provider can drive this device: everything
// else refuses. Same parameterless-callee rule as above.

// Provider constructors run this at load time: accept and ignore.
void verbs_register_driver_34() {}

// Read by providers' destroy paths after a device disassociation, which never happens here.
// One byte (C bool), like the original: executables may copy-relocate it.
bool verbs_allow_disassociate_destroy = false;
static_assert(sizeof(bool) == 1);

// Sizes the caller's on-stack attribute array: hand its own count back so the buffer is never
// undersized; `link` is not followed.
unsigned int __ioctl_final_num_attrs(unsigned int num_attrs, void* /*link*/) { return num_attrs; }

void __verbs_log() {}
void verbs_set_ops() {}
void verbs_uninit_context() {}

void* _verbs_init_and_alloc_context() { return fail<void*>(EOPNOTSUPP, nullptr); }
void* verbs_open_device() { return fail<void*>(EOPNOTSUPP, nullptr); }

// -1 with errno, as read(2).
int ibv_read_ibdev_sysfs_file() { return fail(EOPNOTSUPP, -1); }

// These return an errno value (and 0 on success).
#define VRDMA_PRIVATE_ERRNO(name) \
  int name() { return fail(EOPNOTSUPP, EOPNOTSUPP); }

VRDMA_PRIVATE_ERRNO(execute_ioctl)
VRDMA_PRIVATE_ERRNO(verbs_init_cq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_advise_mr)
VRDMA_PRIVATE_ERRNO(ibv_cmd_alloc_dm)
VRDMA_PRIVATE_ERRNO(ibv_cmd_alloc_mw)
VRDMA_PRIVATE_ERRNO(ibv_cmd_alloc_pd)
VRDMA_PRIVATE_ERRNO(ibv_cmd_attach_mcast)
VRDMA_PRIVATE_ERRNO(ibv_cmd_close_xrcd)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_ah)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_counters)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_cq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_cq_ex)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_flow)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_flow_action_esp)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_qp)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_qp_ex)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_qp_ex2)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_rwq_ind_table)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_srq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_srq_ex)
VRDMA_PRIVATE_ERRNO(ibv_cmd_create_wq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_dealloc_mw)
VRDMA_PRIVATE_ERRNO(ibv_cmd_dealloc_pd)
VRDMA_PRIVATE_ERRNO(ibv_cmd_dereg_mr)
VRDMA_PRIVATE_ERRNO(ibv_cmd_destroy_ah)
VRDMA_PRIVATE_ERRNO(ibv_cmd_destroy_counters)
VRDMA_PRIVATE_ERRNO(ibv_cmd_destroy_cq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_destroy_flow)
VRDMA_PRIVATE_ERRNO(ibv_cmd_destroy_flow_action)
VRDMA_PRIVATE_ERRNO(ibv_cmd_destroy_qp)
VRDMA_PRIVATE_ERRNO(ibv_cmd_destroy_rwq_ind_table)
VRDMA_PRIVATE_ERRNO(ibv_cmd_destroy_srq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_destroy_wq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_detach_mcast)
VRDMA_PRIVATE_ERRNO(ibv_cmd_free_dm)
VRDMA_PRIVATE_ERRNO(ibv_cmd_get_context)
VRDMA_PRIVATE_ERRNO(ibv_cmd_modify_cq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_modify_flow_action_esp)
VRDMA_PRIVATE_ERRNO(ibv_cmd_modify_qp)
VRDMA_PRIVATE_ERRNO(ibv_cmd_modify_qp_ex)
VRDMA_PRIVATE_ERRNO(ibv_cmd_modify_srq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_modify_wq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_open_qp)
VRDMA_PRIVATE_ERRNO(ibv_cmd_open_xrcd)
VRDMA_PRIVATE_ERRNO(ibv_cmd_poll_cq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_post_recv)
VRDMA_PRIVATE_ERRNO(ibv_cmd_post_send)
VRDMA_PRIVATE_ERRNO(ibv_cmd_post_srq_recv)
VRDMA_PRIVATE_ERRNO(ibv_cmd_query_context)
VRDMA_PRIVATE_ERRNO(ibv_cmd_query_device_any)
VRDMA_PRIVATE_ERRNO(ibv_cmd_query_mr)
VRDMA_PRIVATE_ERRNO(ibv_cmd_query_port)
VRDMA_PRIVATE_ERRNO(ibv_cmd_query_qp)
VRDMA_PRIVATE_ERRNO(ibv_cmd_query_srq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_read_counters)
VRDMA_PRIVATE_ERRNO(ibv_cmd_reg_dm_mr)
VRDMA_PRIVATE_ERRNO(ibv_cmd_reg_dmabuf_mr)
VRDMA_PRIVATE_ERRNO(ibv_cmd_reg_mr)
VRDMA_PRIVATE_ERRNO(ibv_cmd_req_notify_cq)
VRDMA_PRIVATE_ERRNO(ibv_cmd_rereg_mr)
VRDMA_PRIVATE_ERRNO(ibv_cmd_resize_cq)

#undef VRDMA_PRIVATE_ERRNO

}  // extern "C"

#pragma GCC visibility pop
