// Shared receive queues, guest side: the ring the backend hands out, and post_srq_recv.
#pragma once

#include <infiniband/verbs.h>

#include "common/unique_fd.h"
#include "proto/ring.h"
#include "verbs/internal.h"

namespace vrdma::verbs {

struct VSrq {
  ibv_srq srq;  ///< first: ibv_srq* and VSrq* are the same address
  uint32_t handle;
  MappedRegion ring;
  proto::RingHeader* hdr;
  proto::RecvWqe* entries;
  uint32_t size;
  uint32_t max_sge;
  uint32_t prod = 0;  ///< guest-private producer cursor
  uint32_t cons_seen = 0;  ///< the consumer cursor last read (ring_full)
  PathLock lock;
  bool xrc = false;      ///< IBV_SRQT_XRC (xrc.cc)
  uint32_t srq_num = 0;  ///< XRC: the number requests name it by (ibv_get_srq_num)
  /// A QP on it that talks to its peer's library sent kRnr (no receive): the next post looks
  /// for the QPs that owe a kResume (remote_srq_posted).
  std::atomic<bool> resume_owed{false};
};

inline VSrq* to_vsrq(ibv_srq* s) { return reinterpret_cast<VSrq*>(s); }

int post_srq_recv(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad);

/// The rest of creating an SRQ once the backend answered `op` (kCreateSrq, kCreateXrcSrq):
/// maps its ring, fills the ibv_srq and `attr` (what it holds), and lists it for async events.
/// Null with errno when the ring cannot be mapped (the backend's SRQ is destroyed).
VSrq* finish_srq(ibv_context* c, ibv_pd* pd, void* srq_context, ibv_srq_attr& attr,
                 const proto::CreateSrqResp& resp, std::vector<UniqueFd>& fds);

/// The SRQ of `ctx` with this backend handle, for async events; null when it is gone.
ibv_srq* find_srq(ibv_context* ctx, uint32_t handle);

}  // namespace vrdma::verbs
