// The device model the backend plays: guests (identifier namespaces), sessions (one per open
// verbs context), and the resources a session owns: PDs, memory segments, MRs, CQs, completion
// channels, QPs. Control-path methods validate every argument a guest sends; the data path
// (datapath.cc) executes WQEs read from shared rings and never trusts what it reads there.
// Concurrency: a Device and everything in it is owned by the backend's single engine thread.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/socket.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "engine/direct_trust.h"
#include "engine/objects.h"
#include "engine/quotas.h"
#include "proto/command.h"
#include "proto/responder_rules.h"
#include "proto/ring.h"
#include "transport/transport.h"

namespace vrdma::engine {

class Device : public transport::Receiver {
 public:
  explicit Device(Quotas quotas = {});
  ~Device() override;

  /// Cross-backend traffic goes through `t` (may be null: single host). Set before sessions.
  void set_transport(transport::Transport* t) { transport_ = t; }
  /// Where the RDMA CM messages of peer backends (wire kCm) go: the backend's connection
  /// service, which checks them. Unset: they are dropped.
  using CmReceiver = std::function<void(const std::string& node, const proto::wire::Cm& m)>;
  void set_cm_receiver(CmReceiver r) { cm_rx_ = std::move(r); }

  /// The user the backend runs as (its euid, by default): like root, an admin, who may join
  /// any guest. Tests set another.
  void set_backend_uid(uint32_t uid) { backend_uid_ = uid; }
  uint32_t backend_uid() const { return backend_uid_; }

  // ---- control path (each validates every field it is given) ----
  /// A session in guest `req.guest` for the process `peer` names (SO_PEERCRED: its pid and uid
  /// are what the backend records; HelloReq::pid is ignored). A new guest belongs to
  /// `peer.uid`; an existing one takes only its owner and the admins (is_admin_uid): anyone
  /// else gets EPERM and one warning per guest and uid.
  Result<Session*> open_session(const proto::HelloReq& req, const PeerCred& peer,
                                proto::HelloResp& resp, FdList& fds);
  /// The LID a new guest `name` gets (its name's hash, probing past LIDs taken here or by a peer
  /// backend's guest), or EADDRINUSE when a peer backend has a guest of that name.
  Result<uint16_t> new_guest_lid(const std::string& name);
  void close_session(Session* s);
  /// Hello's answer and descriptors for session `s` (open_session's; kImportContext gives them
  /// again to another process that shares the session's socket).
  void session_hello(const Session& s, proto::HelloResp& resp, FdList& fds) const;
  /// kImportObject: a PD, MR or device memory of session `s` by handle (ibv_import_pd/mr/dm);
  /// EINVAL when the session has none. A DM's memfd goes into `fds`. (device_import.cc)
  Result<proto::ImportObjectResp> import_object(const Session& s, const proto::ImportObjectReq& req,
                                                FdList& fds);
  Result<uint32_t> alloc_pd(Session& s);
  Status dealloc_pd(Session& s, uint32_t pd);
  /// Maps a guest's sealed tmpfs memfd (hugetlbfs and other filesystems: EINVAL), within the
  /// guest's segment quotas and the backend's max_mapped_bytes (ENOMEM).
  Result<uint32_t> reg_segment(Session& s, const proto::RegSegmentReq& req, UniqueFd fd);
  /// Unmaps and closes a segment no MR of the session uses (EBUSY while one does), and gives
  /// its quota back: the library releases a segment when its last MR is deregistered.
  Status dereg_segment(Session& s, uint32_t handle);
  Result<proto::RegMrResp> reg_mr(Session& s, const proto::RegMrReq& req);
  Status dereg_mr(Session& s, uint32_t handle);
  /// ibv_rereg_mr: changes the MR's translation, PD and/or access (IBV_REREG_MR_CHANGE_*) in
  /// place, keeping its handle and keys; requests executed after it see the new MR. All or
  /// nothing. Not for an MR over device memory (EINVAL).
  /// `fd`: kReregOdpPager's socket (none for the other changes).
  Status rereg_mr(Session& s, const proto::ReregMrReq& req, UniqueFd fd = {});
  /// ibv_alloc_dm: a sealed memfd of whole pages (`mem`, which the guest maps), within the
  /// guest's max_dm_bytes and segment quotas.
  Result<proto::AllocDmResp> alloc_dm(Session& s, const proto::AllocDmReq& req, UniqueFd& mem);
  /// EBUSY while an MR is registered over it.
  Status free_dm(Session& s, uint32_t handle);
  /// ibv_reg_dm_mr: a zero-based MR (addr and iova 0) over part of a device memory.
  Result<proto::RegMrResp> reg_dm_mr(Session& s, const proto::RegDmMrReq& req);
  /// ibv_alloc_mw: an unbound window of PD `req.pd`, within the guest's max_mws.
  Result<proto::AllocMwResp> alloc_mw(Session& s, const proto::AllocMwReq& req);
  /// ibv_dealloc_mw: unbinds (if bound) and frees the window.
  Status dealloc_mw(Session& s, uint32_t handle);
  /// kMwView: a window as responder QP `req.qp` of `s` may use it (its library answers the
  /// QP's peer itself: the direct path across backends); kMwViewInvalidate also invalidates it
  /// when check_invalidate passes.
  Result<proto::MwViewResp> mw_view(Session& s, const proto::MwViewReq& req);
  Result<uint32_t> create_channel(Session& s, UniqueFd& read_end);
  Status destroy_channel(Session& s, uint32_t handle);
  Result<proto::CreateCqResp> create_cq(Session& s, const proto::CreateCqReq& req, UniqueFd& ring);
  Status destroy_cq(Session& s, uint32_t handle);
  /// ibv_resize_cq: a new ring of at least `req.cqe` entries (`ring`), not fewer than the
  /// completions the CQ holds (EINVAL), which move over in order.
  Result<proto::CreateCqResp> resize_cq(Session& s, const proto::ResizeCqReq& req, UniqueFd& ring);
  Result<proto::CreateQpResp> create_qp(Session& s, const proto::CreateQpReq& req, UniqueFd& ring);
  Status modify_qp(Session& s, const proto::ModifyQpReq& req);
  /// Whether QP `handle`'s destination is one no backend this one reaches knows: no guest here,
  /// and no TCP transport to look for it elsewhere (the modify_qp answer's kAnswerDestUnknown).
  bool destination_unknown(Session& s, uint32_t handle);
  Result<proto::QueryQpResp> query_qp(Session& s, uint32_t handle);
  Status destroy_qp(Session& s, uint32_t handle);
  Result<proto::CreateSrqResp> create_srq(Session& s, const proto::CreateSrqReq& req,
                                          UniqueFd& ring);
  Status modify_srq(Session& s, const proto::ModifySrqReq& req);
  Result<proto::SrqAttr> query_srq(Session& s, uint32_t handle);
  Status destroy_srq(Session& s, uint32_t handle);
  // ---- XRC (device_xrc.cc) ----
  /// ibv_open_xrcd: the guest's domain of the inode `file` names (fstat here, so a guest names
  /// only files it opened), made with O_CREAT (ENOENT without, EINVAL with O_EXCL when it
  /// exists); no file: a new private domain (O_CREAT required, EINVAL). A new handle each time.
  Result<uint32_t> open_xrcd(Session& s, const proto::OpenXrcdReq& req, UniqueFd file);
  /// EBUSY while this session has XRC SRQs or receive QPs in the domain through this handle's
  /// domain; the domain goes with its last open and last user.
  Status close_xrcd(Session& s, uint32_t handle);
  /// ibv_create_srq_ex(IBV_SRQT_XRC): an SRQ of PD `pd` in the domain, completing on `cq`,
  /// with a guest-wide number (srq_num) that XRC requests name.
  Result<proto::CreateSrqResp> create_xrc_srq(Session& s, const proto::CreateXrcSrqReq& req,
                                              UniqueFd& ring);
  /// ibv_open_qp: a handle of this session on receive QP `qpn` of the domain (EINVAL: none).
  Result<proto::CreateQpResp> open_qp(Session& s, const proto::OpenQpReq& req);
  /// The guests, their sessions and holdings; `lists`: also each guest's QPs, one row each
  /// (else their number, `qps_omitted`).
  std::string status_json(bool lists = true) const;
  /// Every QP of the backend (of every guest and session).
  size_t qp_total() const { return active_.size(); }

  // ---- direct path between guests of one uid (device_direct.cc) ----
  /// Allows grants ([backend] direct_path). Off: kDirectGrant answers EOPNOTSUPP.
  void set_direct(bool on) { direct_ = on; }
  /// Lets the library of QP `handle` execute its WQEs itself into its peer QP's memory: checks
  /// every condition (RC or UC, RTS, peer on this backend and connected back, same uid, a
  /// peer on an SRQ only with kDirectGrantSrq in `flags` (srq_grantable), nothing in flight),
  /// gives both QPs their own completion rings, and fills `fds` (kDirectGrant's order).
  /// EAGAIN: not now (peer not ready, work in flight).
  Result<proto::DirectGrantResp> direct_grant(Session& s, uint32_t handle,
                                              std::vector<UniqueFd>& fds, uint32_t flags = 0);
  /// Who trusts whom ([datapath] direct_trust): with `uid_enough`, any two guests of one uid;
  /// else guests named together in one of `tenants`, or a session that proved it may write the
  /// peer's memory (kDirectProve). A grant needs one of them, and one uid, always.
  void set_direct_trust(bool uid_enough, std::vector<std::vector<std::string>> tenants) {
    direct_uid_enough_ = uid_enough;
    direct_tenants_ = std::move(tenants);
  }
  /// kDirectCookie: where session `s` keeps its proof cookie.
  Status direct_cookie(Session& s, const proto::DirectCookieReq& req);
  /// kDirectPeer: the pid of QP `handle`'s peer process in the caller's pid namespace.
  Result<proto::DirectPeerResp> direct_peer(Session& s, uint32_t handle);
  /// kDirectProve: `proof` shows that `s` may write the memory of QP `handle`'s peer session.
  Status direct_prove(Session& s, uint32_t handle, UniqueFd proof);
  /// The same three for a UD QP and one destination (kDirectGrantUd, kDirectPeerUd,
  /// kDirectProveUd): the destination QP is the peer. `peer_guest`: its guest's name.
  Result<proto::DirectGrantUdResp> direct_grant_ud(Session& s, const proto::DirectUdReq& req,
                                                   std::vector<UniqueFd>& fds,
                                                   std::string& peer_guest);
  Result<proto::DirectPeerResp> direct_peer_ud(Session& s, const proto::DirectUdReq& req);
  Status direct_prove_ud(Session& s, const proto::DirectUdReq& req, UniqueFd proof);
  /// The own completion rings of QPs of `s` that feed CQ `handle`, with their memfds: a page of
  /// at most kMaxDirectRings, past the first `skip`.
  Result<proto::DirectRingsResp> direct_rings(Session& s, uint32_t handle,
                                              std::vector<UniqueFd>& fds, uint32_t skip = 0);

  // ---- direct path across backends (device_direct.cc; ARCHITECTURE.md "Across hosts") ----
  /// Allows kDirectOffer/kDirectRemote ([datapath] direct_remote). Off: both answer EOPNOTSUPP.
  void set_direct_remote(bool on) { direct_remote_ = on; }
  /// The library of RC QP `req.qp` (peer on another backend, RTR or RTS) listens on
  /// `req.port` for its peer's library: gives the QP its own receive-completion ring (fds[0];
  /// then the receive CQ's channel's kDirectNotifyFds, with kDirectOfferNotify) and sends the
  /// offer to the peer's backend. EAGAIN: not connected yet (state, route, no
  /// connection to the peer backend); EOPNOTSUPP: never for this QP. A QP on an SRQ needs
  /// kDirectOfferSrq: its library feeds the SRQ from then on, under its lock (`lock_tag`: the
  /// session's tag in it).
  Result<proto::DirectOfferResp> direct_offer(Session& s, const proto::DirectOfferReq& req,
                                              std::vector<UniqueFd>& fds,
                                              uint32_t* lock_tag = nullptr);
  /// May the library of QP `handle` send straight to its peer's library? Needs the peer's
  /// offer, RTS, nothing in flight, and kDirectRemoteNotify in `flags` if the send CQ has a
  /// channel. Gives the QP its own send-completion ring (fds[0]; then the channel's
  /// kDirectNotifyFds); from then on the backend executes nothing of its SQ.
  /// EAGAIN: not yet; EOPNOTSUPP: never for this QP.
  Result<proto::DirectRemoteResp> direct_remote(Session& s, uint32_t handle,
                                                std::vector<UniqueFd>& fds, uint32_t flags = 0);
  /// Before a move or a snapshot: takes guest `name`'s QPs off the direct path across backends.
  /// Asks each one's library (RingHeader::direct_revoke; its send queue is held meanwhile) and
  /// answers EINPROGRESS until all have answered: then nothing of theirs is in flight between
  /// the libraries, the backends carry the QPs, and the guest can be exported.
  Status leave_direct_remote(const std::string& name);
  /// keep_state: notes each guest whose direct state across backends changes outside a command
  /// (a peer's offer came, its library's revoke answer was taken), for take_direct_changes.
  void track_direct_changes(bool on) { track_direct_ = on; }
  /// The guests noted since the last call, once each: their state goes to the keeper
  /// (backend/server.cc) before the next command is read, so none acts on a change not kept.
  std::vector<std::string> take_direct_changes() { return std::exchange(direct_changed_, {}); }

  // ---- moving a guest's device between backends (device_state_*.cc, device_moved.cc) ----
  /// Serialises every resource of guest `name`, with the cursors, PSNs, unacknowledged work and
  /// counters, into a blob; `sock_of` gives each session's connection (-1: none, a snapshot).
  /// EBUSY while a QP is on the direct path across backends (it leaves first), unless
  /// `keep_direct`: a keeper's blob, which keeps that state (the libraries' connections outlive
  /// a SIGKILLed backend).
  Result<GuestExport> export_guest(const std::string& name,
                                   const std::function<int(const Session&)>& sock_of,
                                   bool keep_direct = false) const;
  /// Rebuilds a guest from export_guest's blob and descriptors (taken from `fds`), with the same
  /// LID, GID, QPNs, keys and handles, then re-routes its QPs and the local QPs facing it. All
  /// or nothing: a blob that fails any check creates nothing (EINVAL; EEXIST: the guest is here).
  /// `recover`: the blob is the last one a backend that died kept (backend/keeper.cc); the
  /// data path moved on since, so cursors and PSNs are taken from the rings' headers, and what
  /// was in flight is sent again (the responder drops duplicates).
  Result<std::vector<ImportedSession>> import_guest(std::span<const uint8_t> blob,
                                                    std::vector<UniqueFd>& fds,
                                                    bool recover = false);
  /// The guest of the local peer of QP `handle` (the other side of a same-host grant), or "".
  std::string direct_peer_guest(Session& s, uint32_t handle);
  /// Ends every direct grant of guest `name` and of its peers into it (bumps its epoch): before
  /// its state is exported to move, so that no library executes work the target does not know
  /// of for longer than the post it is in. Their next posts go to the send queues.
  void end_direct_grants(const std::string& name);
  /// Forgets a guest whose device moved to another backend: no peer is failed, nothing is
  /// completed; its resources are unmapped here (the guest's descriptors stay open elsewhere).
  void detach_guest(const std::string& name);
  /// Whether this backend serves guest `name`.
  bool has_guest(const std::string& name) const { return guests_.count(name) != 0; }
  /// EOPNOTSUPP while the guest has an ODP MR: its device cannot move (export_guest) yet.
  Status odp_movable(const std::string& name) const;
  /// Every resource with its owner, per-QP counters and per-guest sums (device_report.cc);
  /// without `lists`, the sums only, and the number of each kind per guest in `res_omitted`
  /// (OmittedRows).
  nlohmann::json report(bool lists = true) const;

  // ---- data path (datapath.cc) ----
  /// Runs the rings of every QP that may have work (marked by its library or by the engine)
  /// once. Returns true when any work was done.
  bool poll(uint64_t now_ns);
  /// Earliest retry deadline of a waiting QP, or 0 (waiting QPs stay in the ready lists).
  uint64_t next_deadline() const;
  /// A QP's frames this deep in the connection's queue hold its next WQEs in the send queue:
  /// one bulk QP cannot bury the others' messages (or its own ACK timer) under megabytes.
  static constexpr uint64_t kQpQueuedMax = 1 << 20;
  /// How long a request that the peer's TCP holds on the live connection waits for the peer
  /// backend to answer before its ACK timeouts spend retries (ack_timeout), at least: longer
  /// while the answer may still be in the peer's TCP recovery (Transport::peer_recovery_ns).
  static constexpr uint64_t kSlowPeerNs = 1'500'000'000;
  /// Marks every session's control page: the backend is (not) about to sleep.
  void set_sleeping(bool sleeping);
  /// Tests only (keep_state's exactly-once): a point of the data path between two steps that
  /// a SIGKILL may separate. With kill_at(p) the device stops dead there, leaving the shared
  /// memory as the signal would, and does nothing after it (poll and frames are ignored).
  enum class KillPoint : uint8_t {
    kNone,
    kReceiveTaken,      ///< a receive consumed, its completion not pushed
    kReceiveCompleted,  ///< a receive completed; the send not retired, the PSN not published
    kAtomicExecuted,    ///< an atomic from another backend executed, its answer not sent
    kSendPsnPublished,  ///< over tcp, a send retired: the next PSN stored, the index not
  };
  void kill_at(KillPoint p) { kill_at_ = p; }
  const std::map<uint32_t, std::unique_ptr<Session>>& sessions() const { return sessions_; }

  // ---- UD multicast within this backend (device_mcast.cc) ----
  Status attach_mcast(Session& s, const proto::McastReq& r);
  Status detach_mcast(Session& s, const proto::McastReq& r);

  // ---- frames from other backends (device_remote*.cc) ----
  void on_frame(const std::string& node, const proto::wire::Frame& f,
                transport::RxSink& sink) override;
  void on_frame_done(const std::string& node, const proto::wire::Frame& f,
                     transport::RxSink& sink) override;
  void on_peer_up(const std::string& node) override;
  void on_guest_located(const transport::GuestInfo& g, const std::string& node) override;
  bool uses_peer(const std::string& node) const override;

 private:
  /// Re-chooses the transport of a connected QP whose destination moved, keeping its PSNs and
  /// work: tcp -> shm settles what is in flight locally, tcp -> tcp replays it to the new node.
  void reroute(Qp& qp);
  /// A QP that was on tcp and whose peer QP is now on this backend: completes the in-flight
  /// WQEs the peer executed (by its expected PSN), hands the rest back to the send queue.
  void settle_locally(Qp& qp);
  /// Every connected QP whose destination is guest `g` (by LID or GID).
  template <typename F>
  void for_qps_facing(const Guest& g, F&& f);
  void close_session_impl(Session* s, bool moved);
  Result<std::vector<ImportedSession>> import_guest_impl(std::span<const uint8_t> blob,
                                                         std::vector<UniqueFd>& fds, bool recover);
  /// Stores the QP's requester and responder PSNs in its ring headers (RingHeader::backend_psn).
  static void publish_psns(Qp& qp);
  /// Stores the PSN of the WQE at sq_cons with that index (RingHeader::psn_at); returns it.
  static uint32_t publish_psn_at(Qp& qp);
  /// The backend_psn words of both rings: `sq_psn` (what publish_psn_at returned) and the
  /// expected PSN.
  static void publish_backend_psns(Qp& qp, uint32_t sq_psn);
  /// import_guest(recover): cursors and PSNs from the rings' headers where they are sane.
  static void recover_from_rings(Qp& qp);
  /// A QPN for a new QP of guest `g`, within its max_qps quota and the device's kMaxQp.
  Result<uint32_t> new_qpn(Guest& g);
  /// A QP of the session by handle: its own, or an XRC receive QP it created or opened.
  Qp* find_qp(Session& s, uint32_t handle);
  // XRC (device_xrc.cc).
  Result<proto::CreateQpResp> create_xrc_recv_qp(Session& s, const proto::CreateQpReq& req);
  /// Drops a session's handle on an XRC receive QP; the QP goes with its last handle.
  void close_xrc_qp(Session& s, uint32_t handle);
  /// Session end: its receive-QP handles, XRC SRQs' links and domain opens.
  void close_session_xrc(Session& s);
  /// An XRC SRQ goes: the receive QPs that answered through it forget it.
  void unlink_xrc_srq(Srq& srq);
  /// A domain with no opens and no users goes.
  void maybe_free_xrcd(Guest& g, uint32_t id);
  /// XRC_RECV `to` answers a request for SRQ `srqn`: it must be an XRC SRQ of `to`'s domain
  /// (else false). Points to.srq and to.recv_cq at it for this request.
  bool bind_xrc_srq(Qp& to, uint32_t srqn);
  /// ENOMEM (and one log line per hit) when `n` more of `r` would exceed the guest's quota.
  /// Checked before anything is built; the count moves when the resource exists (`charge`).
  Status check_quota(Guest& g, Res r, uint64_t n = 1);
  static void charge(Guest& g, Res r, uint64_t n = 1) { g.used[static_cast<size_t>(r)] += n; }
  static void release(Guest& g, Res r, uint64_t n = 1);
  /// Charges (or gives back) a segment of `bytes` to guest `g` and to the backend's total.
  void charge_segment(Guest& g, uint64_t bytes);
  void release_segment(Guest& g, uint64_t bytes);
  /// ENOMEM when one queue of `entries` is deeper than the guest's quota allows.
  Status check_depth(Guest& g, const char* what, uint32_t entries);
  /// The verb `call` of session `s` failed with `st`: one warning naming the guest, the call and
  /// the reason (rate-limited per guest). Returns `st`.
  static Status refused(Session& s, const char* call, Status st);
  template <typename T>
  static Result<T> refused(Session& s, const char* call, Result<T> r) {
    if (!r.is_ok()) (void)refused(s, call, r.status());
    return r;
  }
  /// A capability a guest asked for, against the device's limit (create_qp, create_srq).
  struct Cap {
    const char* field;
    uint32_t value, max;
  };
  /// EINVAL naming the first field of `caps` above its limit.
  static Status check_caps(std::initializer_list<Cap> caps);
  // The verbs behind create_qp, modify_qp, create_srq, modify_srq, reg_mr and create_cq, whose
  // refusals those log.
  Result<proto::RegMrResp> reg_mr_checked(Session& s, const proto::RegMrReq& req);
  Status rereg_mr_checked(Session& s, const proto::ReregMrReq& req, UniqueFd fd);
  Result<proto::AllocDmResp> alloc_dm_checked(Session& s, const proto::AllocDmReq& req,
                                              UniqueFd& mem);
  Result<proto::RegMrResp> reg_dm_mr_checked(Session& s, const proto::RegDmMrReq& req);
  Result<proto::CreateCqResp> resize_cq_checked(Session& s, const proto::ResizeCqReq& req,
                                                UniqueFd& ring);
  /// EOPNOTSUPP/EINVAL for MR access bits outside `accepted`, or remote write without local.
  static Status check_mr_access(uint32_t access, uint32_t accepted);
  /// Fills the MR's chunks, segments, addr, iova and length from a request's extents.
  static Status mr_translation(Session& s, const proto::RegMrReq& req, Mr& mr);
  /// kReregOdpMap: adds the pages of `req`'s extents to the ODP MR (those it lacks).
  static Status odp_map(Session& s, Mr& mr, const proto::RegMrReq& req);
  /// Whether [off, off + len) of the MR has all its pages: always, but for an ODP MR's pages
  /// that were never faulted in (which the executors answer as an access out of the MR).
  static bool odp_covers(const Mr& mr, uint64_t off, uint64_t len);
  /// Asks the library's pager of session `s` (proto::ControlPage) to fault [iova, iova + len) of
  /// the ODP MR in: true while that may still come (the requester waits, as for an RNR NAK),
  /// false when it cannot (no pager, or it answered that request with an error).
  static bool odp_page_request(Session& s, const Mr& mr, uint64_t iova, uint64_t len);
  /// Gives a new MR (pd, access and translation set) its handle and key, within the quotas.
  Result<proto::RegMrResp> add_mr(Session& s, std::unique_ptr<Mr> mr);
  /// The device memory whose segment `segment` is (0: none), and whether an MR lies on one.
  static uint32_t dm_of_segment(const Session& s, uint32_t segment);
  static bool on_dm(const Session& s, const Mr& mr);
  Result<proto::CreateCqResp> create_cq_checked(Session& s, const proto::CreateCqReq& req,
                                                UniqueFd& ring);
  Result<proto::CreateQpResp> create_qp_checked(Session& s, const proto::CreateQpReq& req,
                                                UniqueFd& ring);
  Status modify_qp_checked(Session& s, const proto::ModifyQpReq& req);
  Result<proto::CreateSrqResp> create_srq_checked(Session& s, const proto::CreateSrqReq& req,
                                                  UniqueFd& ring);
  Status modify_srq_checked(Session& s, const proto::ModifySrqReq& req);
  /// RC/UC QPs of other sessions connected to a QP of `s` go to ERR, with QP_FATAL to their owner.
  void fail_peers(const Session& s);
  /// One guest's turn in poll(): at most kGuestBudget WQEs, its ready QPs taken round-robin;
  /// those left without work leave the list.
  bool poll_guest(Guest& g, uint64_t now_ns);
  /// Puts a QP in its guest's ready list: poll() looks at it until it has no work left.
  void mark_ready(Qp& qp);
  /// Whether a QP poll() just visited may still have work (else it leaves the ready list).
  bool has_work(const Qp& qp) const;
  /// Reads and clears the sessions' ready bits (proto::ReadyBits) into the ready lists; a
  /// session whose library does not mark has all its QPs marked.
  void harvest_ready();
  Qp* lookup_remote(const Qp& from);
  /// lookup_remote() for a requester on this backend: null unless the responder's route is
  /// local too (a QP connected to a peer on another node hears only that node).
  Qp* local_responder(const Qp& from);
  /// The direct path's trust rule (device_direct.cc): may `s` write `peer`'s memory?
  bool trusts(const Session& s, const Session& peer) const;
  /// The session of QP `handle`'s peer QP on this backend, of the same uid.
  Result<Session*> direct_peer_session(Session& s, uint32_t handle);
  /// The UD QP `req` names on this backend (where execute_ud would deliver), and its session.
  Result<Qp*> ud_destination(Session& s, const proto::DirectUdReq& req);
  Result<Session*> direct_ud_peer_session(Session& s, const proto::DirectUdReq& req);
  /// kDirectPeer's and kDirectProve's work, once the peer session is known.
  Result<proto::DirectPeerResp> peer_pid(Session& s, Session& peer);
  Status prove(Session& s, Session* peer, UniqueFd proof);
  /// The checks and descriptors of a grant from `a` into `b` (kDirectGrant's order).
  Result<proto::DirectGrantResp> grant_into(Session& s, Qp& a, Qp& b, std::vector<UniqueFd>& fds);
  /// A UD QP's receive side with direct producers (RingHeader::rx_lock): taken by the backend
  /// without blocking on a guest; a holder whose session is gone is taken over. False: busy.
  /// Also an SRQ that libraries feed (Srq::direct), whichever QP of it receives.
  bool rx_lock_take(Qp& to);
  void rx_lock_give(Qp& to);
  /// rx_lock_take for a scope (`held`: taken, or none to take); given back at its end.
  struct RxHold {
    RxHold(Device& d, Qp& to) : dev(d), qp(to), held(d.rx_lock_take(to)) {}
    ~RxHold() {
      if (held) dev.rx_lock_give(qp);
    }
    RxHold(const RxHold&) = delete;
    RxHold& operator=(const RxHold&) = delete;
    Device& dev;
    Qp& qp;
    const bool held;
  };
  /// A requester whose responder's SRQ a library holds (RxHold not held): true while that is
  /// a moment (the head WQE waits a little, spending no RNR retry); false once it has lasted
  /// (then it is an RNR NAK, as a responder without receives).
  bool srq_busy(Qp& qp, uint64_t now_ns);
  /// rx_lock_take's tries on one lock word (fewer while `busy`, which it updates).
  bool rx_lock_try(proto::AtomicU32& w, bool& busy);
  /// Arms (or disarms, 0) an SRQ's limit, in its header too (RingHeader::srq_limit).
  void set_srq_limit(Srq& q, uint32_t limit);
  /// Whether a grant may feed responder `b`'s SRQ: the library asked with kDirectGrantSrq, not
  /// XRC, the SRQ in the QP's PD.
  Status srq_grantable(const Qp& b, uint32_t flags) const;
  /// A library takes receives from `q` from now on (a grant into a QP on it, or an offer of one):
  /// every consumer then holds its rx_lock (Srq::direct).
  void feed_srq(Srq& q);
  /// A session's tag in rx_lock: its id plus this backend's random base (below 2^31, so no
  /// tag is 0 or kRxLockBackend), so that a tag left by a session that ended names none of the
  /// live ones but by a 1 in 2^31 chance: such a lock is taken over, not waited on until an
  /// unrelated session ends. A session that came from another backend (keep_state, a move)
  /// keeps the tags it had there (Session::kept_rx_tags): its library outlived that backend
  /// and may be inside a delivery with one (rx_tag_live).
  uint32_t rx_lock_tag(const Session& s) const { return s.id + rx_tag_base_; }
  /// Whether rx_lock value `held` is a live session's tag, this backend's or a kept one.
  bool rx_tag_live(uint32_t held) const;
  /// Whether `to` is connected to the requester (type, QPN and the requester's LID or GID).
  static bool accepts_from(const Qp& to, ibv_qp_type type, uint32_t src_qpn, uint16_t slid,
                           const uint8_t sgid[16]);
  Guest* guest_by_gid(const uint8_t gid[16]);
  // ---- responder, for a local requester and for one on the wire alike ----
  /// Checks and prepares the message: RNR, rkey/PD/access/bounds, receive WQE; resolves the
  /// responder's memory into dst_ (SEND/WRITE) or src_ (READ); executes an atomic.
  Response respond_begin(Qp& to, const Inbound& in);
  /// The data is in place: consumes the receive WQE and posts its completion, with the
  /// responder's commit record before (RingHeader::commit_*; `commit`: kCommitPsn with the PSN
  /// expected after it in `tag`, or kCommitLocal with the requester's SQ index). The caller
  /// retires the message on its side, then calls commit_done.
  void respond_finish(Qp& to, const Inbound& in, const proto::RecvWqe& r, uint32_t commit = 0,
                      uint32_t tag = 0);
  /// `sender`: with kCommitUd, the sending QP's number.
  void begin_commit(Qp& to, const Cq& ring, const proto::Cqe& rc, uint32_t commit, uint32_t tag,
                    uint32_t sender = 0);
  /// The message respond_finish began is retired on both sides: no record any more.
  static void commit_done(Qp& to);
  /// After a restart (Qp::replay_known): whether `qp`'s head WQE is the one the dead backend
  /// delivered into `to`; then it is retired here, undelivered.
  bool replayed_delivery(Qp& qp, Qp& to, const proto::SendWqe& w, uint64_t len);
  /// import_guest(recover): the message a dead backend was delivering into `qp` (its commit
  /// record), delivered (its receive was taken) or never begun. Needs the QP's rings and CQs.
  static void recover_receive(Qp& qp);
  /// Whether the device stops here (kill_at): once there, it stays stopped.
  bool killed_at(KillPoint p) {
    if (kill_at_ == p && p != KillPoint::kNone) killed_ = true;
    return killed_;
  }
  /// RNR wait bookkeeping for the requester; returns false when RNR retries are exhausted.
  /// `fresh`: a new reason to wait, so the counter is reloaded from the QP's rnr_retry.
  bool rnr_wait(Qp& qp, uint8_t rnr_timer, uint64_t now_ns, bool fresh);
  // ---- requester over a transport (device_remote.cc) ----
  /// Picks the QP's transport at RTR from its destination.
  /// `quiet`: the caller logs the outcome (a re-route says only what changed).
  void choose_route(Qp& qp, bool quiet = false);
  /// Warns once per connection when both ends of an RC pair are processes of one default
  /// (`pgrp-N`) guest.
  void warn_one_default_guest(const Qp& qp, const Guest& dest) const;
  /// `hold_new`: its library is leaving the direct path (revoke_holds): what is in flight goes
  /// on (ACK waits, resends), nothing new is taken from the send queue.
  bool process_sq_remote(Qp& qp, uint64_t now_ns, bool hold_new);
  /// Builds and sends the request frame of an outstanding WQE; false when not connected.
  /// Sends (again) and records where it ends in the stream (o.mark).
  bool send_request(Qp& qp, Qp::Outstanding& o);
  /// send_request of a message sent before (counted as a replay).
  bool resend(Qp& qp, Qp::Outstanding& o);
  void resend_all(Qp& qp);
  /// The QP failed, was reset or destroyed: its frames still queued for the peer go.
  void take_back(Qp& qp);
  /// The ACK timer of an RC QP over TCP went off: spend a retry only for time in which the peer
  /// is not answering, and replay only what reached it. True when anything was sent.
  bool ack_timeout(Qp& qp, uint64_t now_ns);
  /// Whether an ACK timeout of `qp` with its head (or its probe) still in the pipe costs
  /// nothing: the connection moved since the timer last looked, or has been still for less than
  /// the path's round trip. The first look of a wait only notes where the connection stands.
  bool conn_moving(Qp& qp, uint64_t now_ns);
  /// How long an ACK timeout waits for a peer backend that has our request (or closed its
  /// window) before it spends retries: kSlowPeerNs, or the peer's TCP recovery if longer.
  uint64_t slow_peer_ns(const Qp& qp);
  /// ack_timeout with the head request still in the pipe: true when this timeout costs nothing
  /// (the connection moves, or the peer's window is closed for less than slow_peer_ns).
  bool pipe_waits(Qp& qp, uint32_t psn, uint64_t now_ns);
  /// The log line (rate-limited) of an ACK timeout that waits for a slow peer backend since
  /// `since_ns`; `what` says why the path counts as delivering.
  void slow_peer_note(const Qp& qp, uint32_t psn, uint64_t now_ns, uint64_t since_ns,
                      const char* what);
  /// Completes outstanding WQEs up to `psn` (inclusive) in order.
  void acked(Qp& qp, uint32_t psn, uint64_t now_ns);
  void on_request(const std::string& node, const proto::wire::Frame& f, transport::RxSink& sink);
  void on_duplicate(const std::string& node, Qp& to, const proto::wire::Request& rq,
                    const Inbound& in);
  /// The QP a request from `node` names on this backend (by the destination LID or GID and
  /// QPN), or null: also when that QP is not connected to the requester through `node`.
  /// `why` (when given) says why a frame is refused when that is worth telling the operator:
  /// it is not from the QP's peer; null for a QP that is merely gone.
  Qp* request_target(const std::string& node, const proto::wire::Request& rq,
                     const char** why = nullptr);
  /// The requester QP a reply from `node` is for, or null when it is gone, not waiting for
  /// replies, or its peer is not on `node`.
  Qp* reply_target(const std::string& node, const proto::wire::Reply& rp);
  void sge_holds(const Qp& qp, const proto::Sge* sge, uint32_t n, uint32_t pd);
  uint64_t ack_ns(const Qp& qp) const;
  void on_reply(const std::string& node, const proto::wire::Frame& f, transport::RxSink& sink);
  void reply(const std::string& node, const proto::wire::Request& rq, proto::wire::Syndrome s,
             uint32_t status = 0, uint8_t rnr_timer = 0, uint64_t atomic_orig = 0,
             std::span<const Span> data = {}, std::span<const transport::Hold> holds = {},
             uint64_t flow = 0);
  /// A NAK from responder `to` (counted).
  void nak(const std::string& node, Qp& to, const proto::wire::Request& rq, proto::wire::Syndrome s,
           uint32_t status = 0, uint8_t rnr_timer = 0);
  /// The responder executed expected_psn: the next one is expected, and a new gap is told.
  void advance_expected(Qp& to);
  /// The guest a request is addressed to (by LID or GID), or null.
  Guest* dest_guest(const proto::wire::Request& rq);
  /// The RC QP a request names when it exists but is not at RTR yet (RESET, INIT), or null.
  Qp* not_ready_target(const proto::wire::Request& rq);
  /// The RNR timer of a "not ready" NAK: 1.28 ms (IB encoding 14).
  static constexpr uint8_t kNotReadyRnrTimer = 14;
  /// ... and of one for an SRQ a library is taking a receive from: 0.01 ms (IB encoding 1).
  static constexpr uint8_t kBusyRnrTimer = 1;
  /// UD over the transport: the datagram to a guest of another backend.
  void send_ud_remote(Qp& qp, const proto::SendWqe& w, const std::string& node, uint64_t len);
  /// The frame of a datagram from `qp` to `dest` (the qkey resolved), its payload in src_.
  static proto::wire::Request ud_request(const Qp& qp, const proto::SendWqe& w,
                                         const proto::UdDest& dest, uint64_t len);
  /// A datagram's source is a guest of the node it came from (the directory's word).
  bool ud_source_ok(const std::string& node, const proto::wire::Request& rq);
  /// Delivers a datagram (local or from the wire) to `to`; payload from `src`. `local_sq`: a
  /// sender on this backend at that SQ index (in.src_qpn), named by the responder's commit record
  /// (kCommitLocal | kCommitUd) so that a restart between the delivery and the sender's
  /// retirement does not deliver it again (replayed_delivery); the caller calls commit_done.
  void deliver_ud(Qp& to, const Inbound& in, bool global, const uint8_t sgid[16],
                  std::span<const Span> src, uint8_t sl,
                  std::optional<uint32_t> local_sq = std::nullopt);
  /// deliver_ud's work, with the receive side's rx_lock held.
  void deliver_ud_held(Qp& to, const Inbound& in, bool global, const uint8_t sgid[16],
                       std::span<const Span> src, uint8_t sl, std::optional<uint32_t> local_sq);
  void holds_of(const Mr& mr, std::vector<transport::Hold>& out) const;
  void enter_error(Qp& qp, const char* why);
  /// Something a direct grant of (or to) guest `g` relies on changed: grants stop.
  void bump_epoch(Guest& g);
  /// The QP's own send / receive completion ring (direct path), made on first use, kept for
  /// the QP's life; the CQ's pollers learn of it by its direct_gen.
  static Status give_own_send(Qp& qp);
  static Status give_own_recv(Qp& qp);
  /// A QP of the direct path across backends whose library was asked to leave it (by us, or by
  /// itself when its peer's was): true while its send queue waits for the library's answer;
  /// with the answer the QP is the backends' again (flags cleared).
  bool revoke_holds(Qp& qp);
  /// Sends QP `b`'s direct offer (offer_port, offer_token) to the backend of its peer.
  bool send_offer(const Qp& b);
  /// QP `b`'s peer moved from `was_node` (reroute): its offer goes to where the peer is now.
  void carry_offer(Qp& b, const std::string& was_node);
  /// A peer backend passed a library's direct offer (wire::DirectOffer) for a guest of ours.
  void on_direct_offer(const std::string& node, const proto::wire::DirectOffer& o);
  /// Notes guest `g` for take_direct_changes (when tracked).
  void note_direct_change(const Guest& g);
  void post_async(Session& s, ibv_event_type type, uint32_t handle);
  bool push_cqe(Cq& cq, const proto::Cqe& e, bool solicited);
  /// Writes `e` at the ring's producer index (and its time stamp) and publishes it; no room
  /// check, no event (push_cqe's core; a recovery that checked the room itself).
  static void put_cqe(Cq& cq, const proto::Cqe& e);
  /// Fires the CQ's channel if it is armed for this completion (after the CQE is published).
  void notify(Cq& cq, bool solicited);
  /// After an import: fires every armed CQ of `s` that holds a completion (device_state_import.cc).
  void fire_owed_events(Session& s);
  void complete_send(Qp& qp, const proto::SendWqe& w, ibv_wc_status st, uint32_t len);
  /// Executes one send-queue WQE (any opcode) on an RC or UC QP.
  Step execute(Qp& qp, const proto::SendWqe& w, uint64_t now_ns);
  /// Executes one UD send: a datagram to the QP its address names, or lost. False: the device
  /// stopped at a kill point inside it (the WQE is not retired).
  bool execute_ud(Qp& qp, const proto::SendWqe& w);
  /// A datagram to a multicast GID or LID (device_mcast.cc): every attached QP here, and once
  /// to every connected peer backend, which delivers it to its own members only.
  static bool is_mcast(const proto::UdDest& d);
  static bool is_mcast(const proto::wire::Request& rq);
  void send_mcast(Qp& qp, const proto::SendWqe& w, const proto::UdDest& dest, uint64_t len);
  /// A datagram to a group from peer backend `node`: its payload lands in the sink's scratch
  /// when a QP here is in the group; on_mcast_done delivers it to the members.
  void on_mcast(const std::string& node, const proto::wire::Request& rq, transport::RxSink& sink);
  void on_mcast_done(const proto::wire::Request& rq, transport::RxSink& sink);
  /// A QP that goes leaves its groups.
  void mcast_forget(Qp& qp);
  using McastKey = std::array<uint8_t, 16>;
  struct McastGroup {
    uint16_t lid = 0;
    std::vector<Qp*> qps;
  };
  std::map<McastKey, McastGroup> mcast_;  ///< by multicast GID
  /// The group a multicast GID (global) or LID names here, or null when no QP here is in it.
  const McastGroup* mcast_group(bool global, const uint8_t gid[16], uint16_t lid) const;
  /// Every member of `grp` whose qkey is `qkey` gets the datagram (the others count a drop).
  void deliver_mcast(const McastGroup& grp, uint32_t qkey, const Inbound& in,
                     const uint8_t sgid[16], std::span<const Span> src, uint8_t sl);
  /// The receive WQE a message to `to` lands in (its own RQ's head; on an SRQ the one the QP
  /// holds, else the SRQ's head), copied out of shared memory. False when none is posted; sets
  /// `corrupt` when the ring's indices are.
  bool peek_recv(Qp& to, proto::RecvWqe& out, bool& corrupt);
  /// A message whose payload comes over several turns (across backends) holds its receive from
  /// its start: on an SRQ, the receive peek_recv returned becomes the QP's own (RingHeader::
  /// srq_taken) and leaves the SRQ (srq_consume). Others: nothing (their RQ has one consumer).
  void take_recv(Qp& to, const proto::RecvWqe& r);
  /// The SRQ's next receive is taken: its cursor moves, and its limit event fires once when the
  /// posted WQEs drop below the armed limit.
  void srq_consume(Srq& q);
  /// The limit event of `q` if its posted WQEs (the consumer at `cons`) are below the armed
  /// limit: from srq_consume, and for an SRQ that libraries feed from a QP of it that a library
  /// marked ready (it took the receive that crossed the limit: kDirectOfferSrq).
  void srq_limit_check(Srq& q, uint32_t cons);
  /// A QP of an SRQ that libraries feed, marked ready: its SRQ's limit (srq_limit_check), and
  /// its rx_lock taken and given back, which frees one a dead process left.
  void tend_fed_srq(Qp& qp);
  /// Consumes the WQE peek_recv returned (the one the QP holds, if it holds one).
  void consume_recv(Qp& to);
  /// Whether `to` holds a receive of its SRQ in its own ring now (RingHeader::srq_taken; only a
  /// QP on an SRQ with rings can: not an XRC receive QP, which has none).
  static bool holds_srq_recv(const Qp& to) {
    return to.srq && to.rq_hdr && proto::srq_recv_held(*to.rq_hdr);
  }
  /// Local side of a send: inline bytes or SGEs into src_. A status other than success (and
  /// `why`) when it fails; nothing is completed here.
  ibv_wc_status gather(const Qp& qp, const proto::SendWqe& w, uint8_t* inline_copy,
                       uint64_t& len, const char*& why);
  /// Local side of any WQE: the source (SEND/WRITE, into src_) or the destination (READ and
  /// atomics, into dst_), validated; nothing is completed here.
  ibv_wc_status local_check(const Qp& qp, const proto::SendWqe& w, uint8_t* inline_copy,
                            uint64_t& len, const char*& why);
  /// local_check, completing the WQE with the error (QP to ERR) when it fails.
  bool local_side(Qp& qp, const proto::SendWqe& w, uint8_t* inline_copy, uint64_t& len);
  static Inbound inbound_of(const Qp& qp, const proto::SendWqe& w, uint64_t len);
  static Inbound inbound_of(const proto::wire::Request& rq);
  /// The MR under an rkey of the responder QP's guest, PD and session, or null. What it allows
  /// is proto::check_remote_request's to say.
  const Mr* rkey_mr(const Qp& to, uint32_t rkey) const;
  /// The window under an rkey of QP `to`'s guest (null when none has its index), and what the
  /// rules see of it (`view`).
  Mw* rkey_mw(const Qp& to, uint32_t rkey, proto::RemoteMwView& view) const;
  /// What an rkey reaches for responder `to`: an MR, or a window through its MR (`mr` set to the
  /// MR the bytes are in); `view` is what check_remote_request is given.
  const Mr* rkey_target(const Qp& to, uint32_t rkey, proto::RemoteMrView& view) const;
  /// Executes a bind or a local invalidation (proto::is_local_mw_op) of QP `qp`; the status of
  /// its completion.
  ibv_wc_status execute_mw_op(Qp& qp, const proto::SendWqe& w, const char*& why);
  /// A new key of the guest's key space: a 20-bit index and 12 random bits, unused by its MRs
  /// and windows (`window`: a window's rkey, whose upper 24 bits no MR key may have either).
  uint32_t new_key(Guest& g, bool window = false);
  static void append_spans(const Mr& mr, uint64_t off, uint64_t len, std::vector<Span>& out);
  /// Executes up to `budget` WQEs of the SQ (decremented per WQE).
  bool process_sq(Qp& qp, uint64_t now_ns, uint32_t& budget);
  bool flush(Qp& qp);
  void destroy_qp_now(Session& s, Qp& qp);
  const Mr* find_mr(const Qp& qp, uint32_t key, uint32_t pd) const;
  /// Resolves SGEs to backend memory spans; false when any SGE fails the checks.
  /// `pd`: the PD the MRs must be in; kNone: the QP's.
  bool resolve_sges(const Qp& qp, const proto::Sge* sge, uint32_t n, uint32_t need_access,
                    std::vector<Span>& out, uint64_t& total, uint32_t pd = proto::kNone) const;
  /// The receive WQE's SGEs into dst_ (checked against the SRQ's limits when it has one).
  bool resolve_recv(const Qp& to, const proto::RecvWqe& r, uint64_t& cap);

  std::map<std::string, std::unique_ptr<Guest>> guests_;
  /// Guests that left (not moved), newest first, at most kDepartedMax: their counters stay in
  /// the report, so a failed run can be examined afterwards.
  struct Departed {
    std::string name;
    uint16_t lid = 0;
    uint32_t owner_uid = 0;
    uint64_t left_unix = 0;
    QpCounters counters;
  };
  static constexpr size_t kDepartedMax = 64;
  std::deque<Departed> departed_;
  QpCounters departed_all_;  ///< every guest that ever left, summed (not bounded)
  /// LIDs by name, for live guests and those that moved away (to come back to the same LID).
  std::map<std::string, uint16_t> lid_of_name_;
  std::unordered_map<uint16_t, Guest*> guests_by_lid_;
  std::map<uint32_t, std::unique_ptr<Session>> sessions_;
  std::vector<Qp*> active_;  ///< every QP (the TCP transport's replay walks them)
  std::vector<Guest*> active_guests_;  ///< guests with a QP: what poll() visits, round-robin
  size_t guest_turn_ = 0;              ///< the guest poll() visits first next time
  uint32_t next_session_ = 1;
  std::mt19937_64 rng_;
  uint32_t rx_tag_base_ = 1;  ///< rx_lock_tag's: random in [1, 2^31), chosen at construction
  Quotas quotas_;
  uint64_t mapped_bytes_ = 0;    ///< segment bytes mapped for all guests (max_mapped_bytes)
  bool mapped_logged_ = false;   ///< reaching max_mapped_bytes was logged (until it falls)
  std::vector<Span> src_, dst_;  ///< reused span lists (no allocation on the data path)
  transport::Transport* transport_ = nullptr;
  CmReceiver cm_rx_;
  uint64_t next_flow_ = 1;
  log::Every ack_log_{1'000'000'000};
  uint64_t pings_sent_ = 0;  ///< kPing probes of a path (ack_timeout)  ///< ACK timeouts: one line
                             ///< a second, the rest counted
  /// The time of the last poll(): frames that arrive between polls use it for their timers.
  uint64_t now_ns_ = 0;
  bool direct_ = false;
  bool direct_remote_ = false;
  bool track_direct_ = false;                             ///< see track_direct_changes
  std::vector<std::string> direct_changed_;               ///< ... the guests noted
  bool direct_uid_enough_ = false;                        ///< see set_direct_trust
  std::vector<std::vector<std::string>> direct_tenants_;  ///< ... by guest name
  uint32_t backend_uid_;                ///< see set_backend_uid
  KillPoint kill_at_ = KillPoint::kNone;  ///< see kill_at
  bool killed_ = false;                   ///< stopped at kill_at_
  std::vector<transport::Hold> holds_;  ///< reused: MR segments a frame's payload uses
};

}  // namespace vrdma::engine
