// Private objects of the drop-in libibverbs: each public verbs object (ibv_context, ibv_cq,
// ibv_qp, ...) is the first member of ours, and to_vxx() gets back to ours (the provider
// pattern). The guest talks to the backend over one control socket per context (commands under
// the context's lock) and through shared rings mapped from the backend (no syscall per op).
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/answer_spin.h"
#include "common/clock.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "proto/command.h"
#include "proto/post_rules.h"
#include "proto/ring.h"
#include "verbs/direct.h"
#include "verbs/path_lock.h"
#include "verbs/remote.h"

namespace vrdma::verbs {

struct OdpMr;  ///< an ODP MR's pages, as the library knows them (odp.cc)

struct VContext {
  verbs_context vctx;  ///< must stay first: ibv_context is its last member
  std::mutex rpc_mu;   ///< one command in flight per context
  UniqueFd sock;
  /// Our own open file description of the session's control page: its OFD lock is the
  /// session's command lock, which every context sharing the socket (ibv_import_device, in this
  /// process or another) holds from sending a command to reading its answer.
  UniqueFd call_lock;
  uint32_t seq = 0;
  AnswerSpin answer_spin;  ///< how long call() spins for an answer (under rpc_mu)
  proto::HelloResp hello{};
  MappedRegion control;
  UniqueFd doorbell;
  std::string guest;
  /// The direct path's proof cookie (kDirectCookie): random, told only to the backend; a process
  /// that shows the backend these bytes through our /proc/PID/mem may write our memory.
  alignas(16) uint8_t direct_cookie[proto::kDirectCookieBytes] = {};
  std::mutex objs_mu;  ///< guards the handle maps below
  std::map<uint32_t, struct VCq*> cqs;
  std::map<uint32_t, struct VQp*> qps;
  /// A process segment this context's session knows: its handle there, and how many MR extents
  /// (registered, or being registered) name it. At zero uses the library releases it
  /// (kDeregSegment), so the backend holds no memory nobody registers. Under memory.cc's lock.
  struct SessionSegment {
    uint32_t handle = 0;
    uint32_t uses = 0;
  };
  std::map<uint32_t, SessionSegment> segments;  ///< by process segment id
  /// This process's MRs by key, for the direct path's local checks; mr_gen moves on every
  /// deregistration, so a QP's one-entry cache of this map knows when it is stale.
  std::mutex mr_mu;
  std::unordered_map<uint32_t, LocalMr> local_mrs;
  std::atomic<uint32_t> mr_gen{0};
  /// ODP MRs of this context by lkey (odp.cc). `odp_mrs` counts them: a post in a context
  /// without any pays one relaxed load for ODP.
  std::mutex odp_mu;
  std::unordered_map<uint32_t, std::shared_ptr<OdpMr>> odp;
  std::atomic<uint32_t> odp_mrs{0};
  /// The pager (odp.cc): faults in the pages of ODP MRs that peers reach first; started with
  /// the first ODP MR with remote access, stopped at ibv_close_device.
  std::thread odp_pager;
  std::atomic<bool> odp_pager_stop{false};
  /// A socket pair that wakes the pager: the backend holds a copy of `odp_kick` and sends a
  /// byte on it after each request; ibv_close_device sends one to stop it. Invalid with a
  /// backend that does not know kReregOdpPager: the pager then polls every millisecond.
  UniqueFd odp_wake, odp_kick;

  proto::ControlPage* control_page() const {
    return reinterpret_cast<proto::ControlPage*>(control.data());
  }
  /// Sends one command and waits for its response; fills `fds_out` with any descriptors and
  /// `answer_flags` with the answer's proto::kAnswer* bits.
  /// Returns the errno the backend answered (0 on success), with errno also set.
  int call(proto::Op op, const void* body, size_t body_len, void* resp, size_t resp_len,
           std::span<const int> fds_in = {}, std::vector<UniqueFd>* fds_out = nullptr,
           uint32_t* answer_flags = nullptr);
  template <typename Req, typename Resp>
  int call(proto::Op op, const Req& req, Resp& resp, std::span<const int> fds_in = {},
           std::vector<UniqueFd>* fds_out = nullptr) {
    return call(op, &req, sizeof(Req), &resp, sizeof(Resp), fds_in, fds_out);
  }
  /// Tells the backend that rings have new work: marks QP `qp_handle` (proto::mark_ready; none
  /// for an SRQ), then rings the doorbell if the backend sleeps.
  void ring_doorbell(uint32_t qp_handle = proto::kNone) const;
  /// The control page's ready bits, when the backend reads them (kFeatureReadyBits).
  proto::ReadyBits* ready = nullptr;
  /// True once the backend's end of the control socket has closed (the device is gone): posts
  /// then fail with EIO and polls with -1, instead of waiting for completions that never come.
  bool backend_gone();
  std::atomic<bool> dead{false};
  std::atomic<bool> fatal_reported{false};  ///< IBV_EVENT_DEVICE_FATAL was handed out
  /// ring_doorbell() woke the backend and no poll has seen it awake since (should_yield).
  mutable std::atomic<bool> woke_backend{false};
  /// The direct path across backends (remote_conn.cc): this process's hub, made on first use.
  std::mutex hub_make;
  std::shared_ptr<Hub> hub;
  std::atomic<Hub*> hub_raw{nullptr};
  /// ibv_import_mr was called: another process's memory, which this library cannot reach, may
  /// be named by this context's WRs and keys, so no QP of it goes direct across backends from
  /// then on (the backends reach every MR of the session).
  std::atomic<bool> mr_imports{false};
};

inline VContext* to_vctx(ibv_context* c) {
  return reinterpret_cast<VContext*>(reinterpret_cast<uint8_t*>(c) -
                                     offsetof(verbs_context, context));
}

struct VPd {
  ibv_pd pd;
  uint32_t handle;
};

struct VMr {
  ibv_mr mr;
  uint32_t handle;
  std::vector<uint32_t> segments;  ///< process segment id of each extent (release_segments)
  bool on_dm = false;              ///< ibv_reg_dm_mr's (zero-based: LocalMr::host)
  bool imported = false;  ///< ibv_import_mr's: another context's memory, no local_mrs entry
  bool odp = false;       ///< IBV_ACCESS_ON_DEMAND: its pages are in VContext::odp, not here
};

struct VChannel {
  ibv_comp_channel ch;
  uint32_t handle;
};

struct VCq {
  /// `cq` and `cq_ex` share their first members (ibv_cq_ex_to_cq() is a cast); the extended
  /// part is filled only by ibv_create_cq_ex (extended.cc) and zero otherwise.
  union {
    ibv_cq cq;
    ibv_cq_ex cq_ex{};
  };
  uint32_t handle;
  MappedRegion ring;
  proto::RingHeader* hdr;
  proto::Cqe* entries;
  uint32_t size;
  uint32_t cons;  ///< guest-private consumer cursor
  PathLock lock;
  uint32_t events_reported = 0;        ///< completion events handed out by ibv_get_cq_event
  uint32_t empty_polls = 0;            ///< consecutive polls that found nothing
  uint32_t polls_unchecked = 0;        ///< polls (of any outcome) since the backend was looked at
  const proto::Cqe* ex_cur = nullptr;  ///< cq_ex: the completion start/next_poll stand on
  /// Completion timestamps (ring.h's CqeStamp): those of this CQ's ring (null without), and
  /// the one of the completion next_cqe() last stepped past (null: that ring has none).
  const proto::CqeStamp* stamps = nullptr;
  const proto::CqeStamp* cur_stamp = nullptr;
  uint32_t seen = 0;                   ///< producer index last read
  // Direct path: QPs' own completion rings that feed this CQ (direct.cc), learned by direct_gen.
  std::vector<std::unique_ptr<OwnRing>> own;
  uint32_t direct_gen = 0;
  size_t own_turn = 0;
  // Direct path across backends: the connections of this CQ's QPs, as of the hub's gen.
  uint32_t rgen = 0;
  std::vector<std::shared_ptr<Conn>> rconns;
  bool rclaimed = false;  ///< an empty poll claimed rconns (remote.h)
  uint64_t rpoll_ns = 0;  ///< when an empty poll last looked at rconns (remote_progress)
  /// Its channel, for the completions this library produces across backends (remote.h's
  /// fire_cq): `notify.hdr` is `hdr`, and both are read under notify_mu, which ibv_resize_cq
  /// holds while it maps the new ring (a hub thread may fire meanwhile).
  std::mutex notify_mu;
  Notify notify;
};

struct VQp {
  /// `qp_ex` begins with `qp` (qp_base); its wr_* part is filled only by ibv_create_qp_ex with
  /// IBV_QP_INIT_ATTR_SEND_OPS_FLAGS (extended.cc) and zero otherwise.
  union {
    ibv_qp qp;
    ibv_qp_ex qp_ex{};
  };
  uint32_t handle;
  MappedRegion ring;
  proto::RingHeader* sq_hdr;
  proto::RingHeader* rq_hdr;
  proto::SendWqe* sq;
  proto::RecvWqe* rq;
  uint32_t sq_size, rq_size;
  uint32_t sq_prod = 0, rq_prod = 0;  ///< guest-private producer cursors
  /// The last consumer cursors read from the rings (they only move forward); see ring_full().
  uint32_t sq_cons_seen = 0, rq_cons_seen = 0;
  proto::QpCaps caps;
  PathLock sq_lock, rq_lock;
  uint32_t ex_batch_start = 0;  ///< qp_ex: sq_prod at wr_start (under sq_lock until complete)
  int ex_batch_err = 0;         ///< qp_ex: first error of the batch; wr_complete returns it
  // Direct path (direct.cc), under sq_lock: the grant in force, when to ask for one again.
  std::unique_ptr<Grant> grant;
  /// `grant` is set: read without the lock by drop_grant (ibv_modify_qp), so that a thread that
  /// only sets the QP up never takes sq_lock (and its bias, path_lock.h) from the one that posts.
  std::atomic<bool> granted{false};
  Asking asking;  ///< when to ask for `grant` again
  /// UD: grants by destination (direct_ud.cc), the most recently made last.
  std::vector<std::unique_ptr<UdGrant>> ud_grants;
  uint32_t pd = 0;             ///< the PD handle (local SGE checks)
  bool sig_all = false;
  uint32_t mr_gen = ~0u;  ///< one-entry cache of VContext::local_mrs
  uint32_t mr_key = 0;
  LocalMr mr{};
  uint32_t access = 0;  ///< qp_access_flags, as last set
  /// IBV_ACCESS_MW_BIND was in them once: windows may be bound through this QP, so it stays
  /// on the backends across hosts (remote.cc).
  bool mw_bind = false;
  /// rnr_retry and min_rnr_timer, as last set: the direct path across backends counts the one
  /// and asks its peer to wait the other (remote_datapath.cc).
  uint8_t rnr_retry = 0, min_rnr_timer = 0;
  /// timeout and retry_cnt, as last set: a peer library that goes, or a path that moves nothing,
  /// fails what is in flight after that budget (remote_timeout.cc), as a fabric's retries would.
  uint8_t ack_timeout = 14, retry_cnt = 7;
  /// The direct path across backends (remote.cc); made at the first offer or connection.
  std::unique_ptr<RemoteQp> remote;
};

/// The limits every post path checks a send WR against (proto/post_rules.h).
inline proto::SendQueueCaps send_caps(const VQp& qp) {
  return {qp.caps.max_send_sge, qp.caps.max_inline_data};
}

/// Whether a ring we produce into (`prod`, `size`) has no free slot. The consumer's cursor is a
/// cache line the other side writes on every entry it takes: it is read only when the copy in
/// `seen` says full, not once per post.
inline bool ring_full(const proto::RingHeader* h, uint32_t prod, uint32_t size, uint32_t& seen) {
  if (prod - seen < size) return false;
  seen = h->consumer.load(std::memory_order_acquire);
  return prod - seen >= size;
}

/// The library's side of a registered MR (resources.cc): its ibv_mr, and its entry in the
/// context's local_mrs (what the direct paths check SGEs and rkeys against).
VMr* new_vmr(ibv_pd* pd, void* addr, size_t length, const proto::RegMrResp& resp,
             const LocalMr& local);

/// A verb that returns a pointer fails with NULL and errno.
template <typename T>
T* fail_ptr(int err) {
  errno = err;
  return nullptr;
}

inline VCq* to_vcq(ibv_cq* c) { return reinterpret_cast<VCq*>(c); }
inline VQp* to_vqp(ibv_qp* q) { return reinterpret_cast<VQp*>(q); }

// Data path (datapath.cc).
inline constexpr uint32_t kYieldEvery = 16;  ///< empty polls of one CQ between two sched_yield()s
inline constexpr uint32_t kLivenessEvery = 1024;  ///< polls between two looks at the backend
int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad);
int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad);
int poll_cq(ibv_cq* cq, int n, ibv_wc* wc);
/// A poll of this thread found a completion (poll_cq, start_poll).
void poll_found();
/// A poll of this thread found nothing, CQ lock released: after VRDMA_POLL_IDLE_US (1 ms by
/// default) of such polls with none that found something, each 64th naps ~20 µs while the
/// machine has more runnable threads than CPUs (datapath.cc).
void poll_empty();
/// Whether an empty poll of `cq` should give the CPU away (sched_yield) to let the backend run.
bool should_yield(const VCq& cq);
/// Called on an empty poll, under cq.lock: whether the backend is gone (then the poll fails with
/// EIO: nothing will ever arrive from it). It is looked at once per kLivenessEvery polls of any
/// outcome, not only after that many empty ones in a row: on the direct paths completions keep
/// coming from the peer's library with the backend dead, and the device must still say so.
bool dead_on_empty_poll(VCq& cq);
int req_notify_cq(ibv_cq* cq, int solicited_only);

// Registered memory (memory.cc): makes [addr, addr+len) reachable by the backend and fills the
// extents of a kRegMr request.
// `segments` receives the process segment id of each extent as it is counted as a use; the
// caller gives them back with release_segments when the registration fails or the MR goes.
int describe_memory(VContext& ctx, void* addr, size_t len, proto::RegMrReq& req,
                    std::vector<uint32_t>& segments);
/// Queues an async event that this library, not the backend, raises (a CQ overrun on the direct
/// path across backends), behind the backend's on the context's async fd (context.cc). Any
/// thread; false when it could not be queued.
bool raise_async_event(ibv_context* c, ibv_event_type type, uint32_t handle);
/// Whether ibv_fork_init() was called or RDMAV_FORK_SAFE/IBV_FORK_SAFE is set (context.cc):
/// new segments are then MADV_DONTFORK and fork() does not copy them.
bool fork_safe();
/// Gives back one use per entry of `segments`; a segment of the context's session that no MR
/// uses any more is released there (kDeregSegment).
void release_segments(VContext& ctx, const std::vector<uint32_t>& segments);
/// Whether every page of [lo, hi) is mapped, readable (and writable, `write`), and of a kind
/// describe_memory can make reachable: an ODP fault that may go ahead.
bool pages_accessible(uintptr_t lo, uintptr_t hi, bool write);
/// The runs of resident pages (mincore) of [lo, hi) in mappings pages_accessible accepts, runs
/// less than 2 MiB apart joined, at most `max_runs` of them: what an ODP MR maps at once.
std::vector<std::pair<uintptr_t, uintptr_t>> resident_runs(uintptr_t lo, uintptr_t hi,
                                                           size_t max_runs);

// On-demand paging (odp.cc): ODP MRs (ibv_reg_mr with IBV_ACCESS_ON_DEMAND, implicit ones with
// NULL and SIZE_MAX), their fault-in on post and ibv_advise_mr.
ibv_mr* reg_odp_mr(ibv_pd* pd, void* addr, size_t length, uint64_t iova, unsigned access);
/// Stops the context's pager, if it runs (ibv_close_device).
void stop_odp_pager(VContext& ctx);
/// Forgets an ODP MR the backend deregistered; its segments join `segments` to be released.
void forget_odp_mr(VContext& ctx, VMr& mr, std::vector<uint32_t>& segments);
/// Faults in the pages of the SGEs that name ODP MRs of the context (before a post); a page it
/// cannot reach is left out, and the WQE then completes with a protection error.
void odp_fault_sges(VContext& ctx, const ibv_sge* sg, int num_sge, bool write);
/// One SGE of them: odp_reach, its failure only a debug line.
void odp_fault_sge(VContext& ctx, uint32_t lkey, uint64_t addr, uint64_t length, bool write);
/// The library's own responder (the path between libraries across hosts) about to touch
/// [addr, addr + length) of MR `key`: faults its pages in when it is an ODP MR. 0, or EFAULT
/// where a page is not mapped with that access (the requester gets REM_ACCESS_ERR).
int odp_reach(VContext& ctx, uint32_t key, uint64_t addr, uint64_t length, bool write);
int advise_mr(ibv_pd* pd, ibv_advise_mr_advice advice, uint32_t flags, ibv_sge* sg_list,
              uint32_t num_sge);

// Device memory (device_memory.cc): the verbs_context ops, and the largest allocation the
// guest may make (the device's cap, or its max_dm_bytes quota where lower).
ibv_dm* alloc_dm(ibv_context* c, ibv_alloc_dm_attr* attr);
// Memory windows (memory_window.cc).
ibv_mw* alloc_mw(ibv_pd* pd, ibv_mw_type type);
int dealloc_mw(ibv_mw* mw);
int bind_mw(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* mb);
/// A bind WQE's fields (proto/ring.h) from a bind WR's window, new rkey and bind_info.
void fill_bind(proto::SendWqe& w, const ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info& info);
int free_dm(ibv_dm* dm);
// XRC (xrc.cc): the verbs_context ops, and create_qp_ex's IBV_QPT_XRC_RECV.
ibv_xrcd* open_xrcd(ibv_context* c, ibv_xrcd_init_attr* attr);
int close_xrcd(ibv_xrcd* xrcd);
ibv_srq* create_srq_ex(ibv_context* c, ibv_srq_init_attr_ex* attr);
int get_srq_num(ibv_srq* srq, uint32_t* srq_num);
ibv_qp* open_qp(ibv_context* c, ibv_qp_open_attr* attr);
ibv_qp* create_xrc_recv_qp(ibv_context* c, ibv_qp_init_attr_ex* attr);
ibv_mr* reg_dm_mr(ibv_pd* pd, ibv_dm* dm, uint64_t offset, size_t length, unsigned int access);
uint64_t max_dm_size(const VContext& ctx);

/// ibv_create_cq with completion timestamps (proto::kStamp*; 0: none), as ibv_create_cq_ex
/// asks (resources.cc).
ibv_cq* create_cq(ibv_context* c, int cqe, void* cq_context, ibv_comp_channel* channel,
                  int comp_vector, uint32_t stamps);

// Device attributes (context.cc).
void fill_device_attr(const VContext& ctx, ibv_device_attr& a);
/// The modify_qp of `qp` to RTR was answered kAnswerDestUnknown: says so on the program's
/// stderr, once per destination (`attr`'s address when `mask` has IBV_QP_AV).
void say_destination_unknown(const ibv_qp& qp, const ibv_qp_attr& attr, int mask);

/// An environment variable of the library in microseconds (secure_getenv: nothing from the
/// environment of a set-uid program): its value, or `default_us` when it is unset or empty, or
/// not a number up to `max_us` (with a warning line saying so).
uint64_t env_us(const char* name, uint64_t default_us, uint64_t max_us);
/// The same for a count of `unit`s (the warning names them).
uint64_t env_num(const char* name, uint64_t dflt, uint64_t max, const char* unit);

}  // namespace vrdma::verbs
