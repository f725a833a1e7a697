// The drop-in librdmacm's private objects: the process's connection to the backend's connection
// service, event channels, ids and events. An rdma_cm_id is the first member of a VId, an
// rdma_event_channel of a VChannel, an rdma_cm_event of a VEvent (the public pointer is ours).
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <ctime>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/answer_spin.h"
#include "proto/command.h"

#define CM_EXPORT extern "C" __attribute__((visibility("default")))

namespace vrdma::rdmacm {

struct VChannel {
  rdma_event_channel ch;  ///< first: the public object
  uint32_t handle = 0;
  std::atomic<uint32_t> readers{0};  ///< threads inside rdma_get_cm_event on it
  std::atomic<bool> closed{false};   ///< rdma_destroy_event_channel was called
  std::atomic<bool> fd_closed{false};
};

/// A group the id joined (rdma_join_multicast): the JOIN event gives its GID and LID.
struct VMc {
  proto::CmAddr addr{};
  void* context = nullptr;
  ibv_gid mgid{};
  uint16_t mlid = 0;
};

struct VId {
  rdma_cm_id id;  ///< first: the public object
  uint32_t handle = 0;
  VChannel* own = nullptr;  ///< a synchronous id's private channel (rdma_create_id(NULL, ...))
  uint32_t reported = 0, acked = 0;  ///< its events handed out and acked (Cm::mu)
  proto::CmQpInfo mine{};            ///< what this end said of its QP (REQ or REP)
  proto::CmQpInfo peer{};            ///< what the other end said of its QP
  bool have_peer = false;
  bool addr_resolved = false;  ///< ADDR_RESOLVED seen (Cm::mu): resolve_route is posted
  bool active = false;  ///< this end connected (rdma_connect), the other accepted
  /// rdma_connect's private data and when it was first sent: a connect that finds no listener
  /// is sent again for a while (kListenerGraceMs, cma.cc) before the application hears.
  std::vector<uint8_t> connect_pdata;
  uint64_t connect_ms = 0;
  rdma_conn_param param{};  ///< what this end asked for (private data not kept)
  /// rdma_create_ep on a passive id: the QP each of its requests gets (rdma_get_request).
  ibv_qp_init_attr ep_qp{};
  bool ep_has_qp = false;
  bool own_cqs = false;  ///< rdma_create_qp made the CQs and completion channels
  /// rdma_create_srq made recv_cq and its channel for the id's XRC SRQ (rdma_destroy_srq's).
  bool srq_cq = false;
  bool removed = false;  ///< DEVICE_REMOVAL handed out (the backend went away; Cm::mu)
  ibv_sa_path_rec path{};
  std::vector<VMc> mcs;  ///< groups joined (Cm::mu)
};

struct VEvent {
  rdma_cm_event ev;  ///< first: the public object
  VId* owner = nullptr;
  uint8_t pdata[proto::kCmPrivateMax];
};

/// The process's side of the connection service. `mu` guards ids, events and counters; calls to
/// the backend are serialised by `rpc_mu` (never taken while holding `mu`).
struct Cm {
  std::mutex mu;
  std::condition_variable acked;  ///< an event was acked (rdma_destroy_id waits)
  std::unordered_map<uint32_t, VId*> ids;
  std::unordered_set<VEvent*> live;  ///< events not acked yet (a second ack fails)
  std::mutex rpc_mu;
  int sock = -1;
  uint32_t seq = 0;
  uint32_t unanswered = 0;     ///< posted commands whose answers are not read yet (rpc_mu)
  AnswerSpin answer_spin;      ///< how long a call spins for its answer (rpc_mu)
  bool no_answer = false;      ///< the backend sends no answer to posted commands
  ibv_context* ctx = nullptr;  ///< vrdma0, opened on first use and kept
  ibv_pd* pd = nullptr;        ///< the PD of rdma_create_qp(id, NULL, ...)
  /// The XRC domain of XRC_RECV ids' QPs and SRQs (a private one, opened on first use and kept,
  /// as rdma-core keeps one per device).
  ibv_xrcd* xrcd = nullptr;
  ibv_port_attr port{};
  ibv_device_attr dev{};
  ibv_gid gid{};
};
Cm& cm();

/// Opens vrdma0 and the connection to the backend if not yet done: 0, or -1 with errno.
int ensure_open();
/// One command to the backend's connection service: 0, or -1 with errno (the backend's).
int call(proto::Op op, const void* body, size_t body_len, void* resp = nullptr, size_t resp_len = 0,
         int* fd_out = nullptr);
template <typename Req>
int call(proto::Op op, const Req& req) {
  return call(op, &req, sizeof(req));
}
/// Sends a command whose answer nobody waits for: one whose failure the caller could not act on
/// (kCmDestroyId). Flagged kRequestNoAnswer where the backend offers it (no answer is sent);
/// otherwise its answer is read and dropped by a later call. The backend takes the process's
/// commands in order, so the next call sees its effect.
void post(proto::Op op, const void* body, size_t body_len);
template <typename Req>
void post(proto::Op op, const Req& req) {
  post(op, &req, sizeof(req));
}
/// The RTU (kCmEstablish): posted once the id has its CONNECT_RESPONSE, else a call.
int establish(VId* v);
/// The QP type the connection service and the wire know an id by: an XRC QP connects as RC (the
/// IB CM's REQ names XRC as an extended transport of a reliable connection), and the QPs of the
/// two ends are what the REQ and REP say.
inline uint8_t service_qp_type(ibv_qp_type t) {
  return static_cast<uint8_t>(t == IBV_QPT_XRC_SEND || t == IBV_QPT_XRC_RECV ? IBV_QPT_RC : t);
}
/// Sets errno to `err` and returns -1: the failure of an rdma_cma.h call.
inline int fail(int err) {
  errno = err;
  return -1;
}
inline VId* to_vid(rdma_cm_id* id) { return reinterpret_cast<VId*>(id); }
inline uint64_t mono_ms() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000 + uint64_t(ts.tv_nsec) / 1000000;
}

/// The id is on vrdma0 port 1 (an address of this host was bound or resolved).
void attach_device(VId* v);
/// Sets the id's addresses (those given with a family) and, with `attach`, its device. Under
/// Cm::mu: the application's thread (bind, resolve) and its event thread both write them.
void set_addrs(VId* v, const proto::CmAddr* src, const proto::CmAddr* dst, bool attach);
/// The path record of a route: this end's GID and LID, the peer's once it is known.
void set_path(VId* v);
/// REQ, REP or REJ with the id's QP and the caller's private data.
int send_conn(VId* v, proto::Op op, const proto::CmQpInfo& qp, const void* pdata, size_t len);

/// The attributes that take the id's QP to `state` (INIT, RTR or RTS) by what the two ends
/// said; 0, or -1 with errno (EINVAL: no peer yet for RTR/RTS).
int qp_attr_for(VId* v, ibv_qp_state state, ibv_qp_attr* attr, int* mask);
/// Takes the id's QP through `states` in order.
int move_qp(VId* v, std::initializer_list<ibv_qp_state> states);
/// What this end tells the other of its QP, with the caller's connection parameters.
proto::CmQpInfo local_qp_info(VId* v, const rdma_conn_param* p);
/// The largest private data `op` (kCmConnect, kCmAccept, kCmReject) may carry on this id.
size_t private_data_limit(const VId* v, proto::Op op);
/// rdma_create_id with a private channel (synchronous) when `channel` is null.
int create_id(rdma_event_channel* channel, rdma_cm_id** id, void* context, rdma_port_space ps,
              ibv_qp_type qp_type);

}  // namespace vrdma::rdmacm
