// The direct path across backends, the library's side (docs/ARCHITECTURE.md, "Across hosts"):
// the libraries of an RC (or UC) QP pair whose QPs live on two backends talk TCP to each other,
// so a message passes two processes (as over UCX's tcp transport or a TCP ping-pong), not four.
// The backends only introduce them: the responder's library listens and offers its port and a
// token through the backends (kDirectOffer); the requester's library, once everything the
// backend took from its send queue is completed, gets that offer (kDirectRemote), dials, and from
// then on sends every WR of the QP itself. Each library checks what reaches its own memory
// (keys, PD, access, bounds, receive WQEs) against its own MRs, so no trust between the two is
// needed. A connection that breaks puts the QP in ERR. One thread per process (the hub) takes
// connections and serves them while the application does not poll.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "proto/command.h"
#include "proto/direct_wire.h"
#include "proto/ring.h"
#include "verbs/direct.h"

namespace vrdma::verbs {

struct VQp;
struct VCq;
struct VSrq;
struct VContext;
struct Conn;
struct Hub;

// The library-to-library protocol is proto/direct_wire.h (proto::dwire).

/// A WR of the requester, from its post to its completion, oldest first. It keeps what it
/// takes to send its request again: a responder that found no receive drops it and what
/// follows (kRnr), and asks for them again once one is posted (kResume).
struct Inflight {
  uint64_t wr_id = 0;
  uint64_t seq = 0;  ///< its request's number on the connection (sent ones only)
  uint32_t opcode = 0;
  uint32_t len = 0;
  bool signaled = false;
  bool sent = false;  ///< false: a WR that failed locally (status) or is to be flushed
  bool inl = false;   ///< its data is in `inl_data` (posted inline: the application may reuse it)
  int status = IBV_WC_SUCCESS;
  uint8_t nl = 0;  ///< spans in `local`: its data (SEND, WRITE), or where the answer goes
  MemSpan local[proto::kMaxSge];
  proto::dwire::Frame f{};  ///< its request, but for the riding ACK
  uint8_t inl_data[proto::kMaxInline];
};

/// A QP's state on the direct path across backends. Control fields under Hub::mu.
struct RemoteQp {
  // Responder: our offer, and the connection the peer's library made to it.
  bool offered = false;
  uint8_t token[proto::kDirectTokenBytes] = {};
  uint32_t peer_qpn = 0, my_lid = 0;
  uint32_t peer_lid = 0;  ///< from the peer's hello (the slid of receive completions)
  /// A QP on an SRQ: our session's tag in the SRQ's rx_lock (kDirectOfferSrq); 0: its own RQ.
  uint32_t srq_tag = 0;
  bool dead = false;      ///< torn down: takes no connection any more
  /// `in` sent kRnr (a request found no receive, or no room for its completion) and owes the
  /// peer a kResume once there is one.
  std::atomic<bool> resume_owed{false};
  OwnRing recv;  ///< the QP's own receive-completion ring (we produce into it)
  /// The connection the peer's requests come on: the one its library dialed, or the one ours
  /// dialed (one connection then carries both directions; see remote_impl.h).
  std::shared_ptr<Conn> in;
  std::atomic<Conn*> in_raw{nullptr};  ///< `in`, for the post path (set once, cleared at teardown)
  // Requester: our connection (often `in` itself), our own send-completion ring, the WRs not
  // yet completed.
  std::shared_ptr<Conn> out;
  OwnRing send;
  std::mutex fl_mu;  ///< inflight, sent, rnr, the send ring's producer side; held while a request
                     ///< is written, so they go in order
  std::deque<Inflight> inflight;
  uint64_t sent = 0;                  ///< requests written to `out`
  uint64_t peer_executed = 0;         ///< of them, executed by the peer (its ACKs, cumulative)
  std::atomic<uint32_t> awaiting{0};  ///< sent WRs in `inflight`: answers expected on `out`
  bool failing = false;               ///< an entry failed locally: no more requests go out
  /// The peer's library went (its connection closed or reset) with WRs of ours in flight: they
  /// fail at this time (Hub::doomed, doom_tick), with `doomed_why`. 0: not doomed.
  uint64_t doomed_at = 0;
  const char* doomed_why = nullptr;
  /// Since when `out`'s path has moved nothing of ours past TCP's own retries (ack_tick; the
  /// hub's thread's, under Hub::qps_mu). 0: it moves.
  uint64_t stalled_since = 0;
  bool send_overrun = false;          ///< `send` overran: IBV_EVENT_CQ_ERR raised (once)
  bool rnr = false;                   ///< the peer dropped requests from `resend_from` on (kRnr)
  uint64_t resend_from = 0;           ///< ... and they go again, in order, at its kResume
  // RNR NAKs counted as the backend counts them (proto/responder_rules.h rnr_may_retry).
  uint32_t rnr_left = 0;
  uint64_t rnr_seq = ~0ull;  ///< the request the last kRnr named (another one reloads rnr_left)
  /// rnr_retry below 7: when the dropped requests go again without a kResume (0: none due).
  /// Atomic: an empty poll looks at it without fl_mu (rnr_retry_due).
  std::atomic<uint64_t> rnr_until{0};
  /// Resent at that time: a kResume the peer sent before it saw our kRewind may still come.
  bool resume_may_cross = false;
  uint32_t ask_wait = 0, backoff = 0;  ///< posts before the next kDirectRemote ...
  uint64_t ask_by_ns = 0;              ///< ... or until then, after a "not yet" (0: posts only)
  bool never = false;               ///< the backend said never for this QP
  std::atomic<bool> failed{false};  ///< in ERR through the direct path: posts go to the ring
  std::atomic<bool> active{false};  ///< `out` is up: every post goes through it
  // Back to the backends (remote_revoke.cc): asked by our backend before a move, or by the
  // peer's library (its kRevoke) before its own.
  std::atomic<bool> revoking{false};      ///< set under fl_mu: no request of ours goes directly
  std::atomic<bool> peer_revoked{false};  ///< the peer's kRevoke came: it sends none either ...
  std::atomic<uint64_t> peer_count{0};    ///< ... past this many requests in all
  bool finished = false;                  ///< answered our backend (kRevokeDone); under Hub::qps_mu
  std::atomic<bool> dialing{false};       ///< connect_out is at it: a revoke waits for it
  // Direct again (remote_revoke.cc, rejoin): once our backend took the answer, the fields above
  // start afresh, and a QP that had offered offers again from the hub's tick.
  std::atomic<bool> reoffer{false};  ///< set under Hub::qps_mu: the tick offers again
  /// Set by the tick with the rest: the next post starts its own fields afresh (ask_wait,
  /// backoff, ask_by_ns, never: the posting thread's, under the SQ lock).
  std::atomic<bool> afresh{false};
  uint32_t reoffer_wait = 0;         ///< ticks before the next try (EAGAIN: not yet); qps_mu
  uint32_t reoffer_backoff = 0;
  /// An offer our backend refused for good (no address of ours toward the peer's backend, say):
  /// tried again only when ControlPage::grant_gen moves (another backend took us in). qps_mu.
  bool reoffer_stuck = false;
  uint32_t reoffer_gen = 0;
  /// The offer the tick makes is the QP's first (its RTR's was not yet possible: no connection
  /// to the peer's backend at that moment), not one again after a revoke: what its log says.
  bool reoffer_first = false;  ///< qps_mu
};

/// Before the ring path of ibv_post_send (under the SQ lock): when this QP talks to its peer's
/// library directly (or now can), sends the chain that way and returns true with `rc`/`bad` set.
/// False: the WRs go to the ring as before.
/// Also false once the QP goes back to the backends (a revoke, mid-chain too): `wr` is then the
/// first WR the ring takes.
bool remote_post(VQp& qp, ibv_send_wr*& wr, int& rc, ibv_send_wr** bad);
/// ibv_modify_qp, before the backend hears of it: leaving RTS ends the connections (ERR flushes
/// the WRs in flight, RESET drops them).
void remote_before_modify(VQp& qp, int mask, const ibv_qp_attr& attr);
/// ibv_modify_qp, after the backend agreed: at RTR (or RTS, if RTR was too early) the QP offers
/// to take its peer's connection.
void remote_after_modify(VQp& qp, int mask, const ibv_qp_attr& attr);
/// ibv_destroy_qp, first: ends the QP's connections.
void remote_destroy(VQp& qp);
/// From an empty poll of `cq`: reads the connections of its QPs. True when it did something.
bool remote_progress(VCq& cq);
/// A poll of `cq` found a completion (CQ lock held). The connections it claimed (read by the
/// application, not the hub, while it polls) that bring what it may now wait for in memory go
/// back to the hub (remote_release). With none claimed (and at most 8 connections), it claims
/// those that have brought no request of the peer's, as an empty poll does: an application
/// whose every poll finds a completion (the hub completing its WRs while it posts:
/// ib_write_bw across hosts) never claimed them, and every post then went out alone, the
/// peer's hub woke for each and ours read the ACKs beside the posts: 64 B WRITEs on 8 QPs ran
/// at 5-6 MB/s in 3 runs of 8 (the others, which claimed at an early empty poll, 60-94), now
/// 83-91 in 8 of 8.
void remote_found(VCq& cq);
/// After a completion is published into an own ring of a QP of `cq` by this library: fires
/// the CQ's channel if it has one and is armed for it (as the backend does; direct.h's fire).
void fire_cq(VCq& cq, bool solicited);
/// Takes the kDirectNotifyFds descriptors of `cq`'s channel from an answer (`fds[at]` on; the
/// ring's is not needed: the CQ's own mapping holds its `armed` word). False if invalid.
bool take_cq_notify(VCq& cq, std::vector<UniqueFd>& fds, size_t at);
/// ibv_req_notify_cq (CQ lock held): the connections the application claimed by polling `cq`
/// go back to the hub, which fires the channel when it completes something.
void remote_armed(VCq& cq);
/// From ibv_post_recv: a connection waiting for a receive may go on.
void remote_receives_posted(VQp& qp);
/// From ibv_post_srq_recv, after a kRnr of a QP on `srq`: those connections may go on.
void remote_srq_posted(VSrq& srq);
/// ibv_close_device: stops the hub's thread and closes everything.
void remote_shutdown(VContext& ctx);

}  // namespace vrdma::verbs
