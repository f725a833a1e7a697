// The two-process harness of the verbs tests: a Peer is a second copy of the test binary
// (fork + exec, so a fresh process with its own copy of our libibverbs) in a guest of its own,
// on the same backend. It opens the device, registers a 1 MiB buffer with every access, and then
// drives its own QPs on the test's orders, sent over a pair of pipes: create and connect QPs,
// post receives, poll its CQ, read or write its buffer, (de)register a second MR, run a storm of
// fetch-and-adds. The test process asserts on what the peer reports; the peer asserts nothing.
#pragma once

#include <infiniband/verbs.h>
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "qp_setup.h"

namespace vrdma::test {

/// A QP the peer owns: `index` names it in later orders.
struct PeerQp {
  uint32_t index;
  uint32_t qpn;
};

/// Memory of the peer as a remote side addresses it.
struct PeerMem {
  uint64_t addr;
  uint32_t rkey;
  uint32_t size;
};

/// A piece of the peer's main buffer, for scatter lists.
struct Piece {
  uint64_t off;
  uint32_t len;
  uint32_t reserved = 0;
};

/// The peer's XRC target: a receive QP and the numbers of two XRC SRQs of its domain.
struct XrcTarget {
  PeerQp qp;
  uint32_t srqn[2];
};

inline constexpr size_t kPeerBufSize = 1 << 20;

class Peer {
 public:
  Peer() = default;
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;
  ~Peer();

  /// Starts the peer in guest `guest` and waits until its device and buffer are ready.
  /// Returns false (with a gtest failure) if it could not.
  bool start(const std::string& guest);
  /// Tells the peer to clean up and exit; returns its exit status (0: it cleaned up).
  int finish();

  uint16_t lid() const { return lid_; }
  const PeerMem& mem() const { return mem_; }

  PeerQp create_qp(ibv_qp_type type, uint32_t depth = 16, uint32_t max_sge = 1,
                   uint32_t max_inline = 0);
  int connect(const PeerQp& qp, const QpPath& path);
  /// Posts one receive scattering into `pieces` of the peer's buffer.
  int post_recv(const PeerQp& qp, uint64_t wr_id, const std::vector<Piece>& pieces);
  int post_recv(const PeerQp& qp, uint64_t wr_id, uint64_t off, uint32_t len) {
    return post_recv(qp, wr_id, {Piece{off, len}});
  }
  /// Up to `n` completions of the peer's CQ, waiting at most `timeout_ms` for them.
  std::vector<ibv_wc> poll(size_t n, int timeout_ms = 5000);
  std::vector<uint8_t> read(uint64_t off, uint32_t len);
  void write(uint64_t off, const void* p, uint32_t len);
  /// Registers a second 64 KiB buffer with `access` (one at a time). With
  /// IBV_ACCESS_ON_DEMAND: fresh pages, never touched, its last 4 KiB not accessible (PROT_NONE).
  PeerMem reg_mr(unsigned access);
  int dereg_mr();
  /// A new XRC receive QP (connect() takes it to RTS) in the peer's private XRC domain, which
  /// has two XRC SRQs, made at the first call (their receives complete on the peer's CQ).
  XrcTarget xrc_open();
  /// Posts one receive on XRC SRQ `srq` (0 or 1) scattering into `pieces` of the peer's buffer.
  int post_srq_recv(uint32_t srq, uint64_t wr_id, const std::vector<Piece>& pieces);
  /// Posts one signaled `op` (SEND or WRITE_WITH_IMM, immediate data `wr_id`) of [off, off +
  /// len) of the peer's buffer on `qp`.
  int send(const PeerQp& qp, ibv_wr_opcode op, uint64_t off, uint32_t len, uint64_t wr_id);
  /// ibv_modify_qp of the QP's qp_access_flags alone (at RTS).
  int set_access(const PeerQp& qp, unsigned access);
  ibv_qp_state qp_state(const PeerQp& qp);
  /// A memory window of the peer's PD: `index` names it in later orders.
  struct Window {
    uint32_t index;
    uint32_t rkey;  ///< as allocated
  };
  Window alloc_mw(ibv_mw_type type);
  /// Binds `w` through QP `qp` over [off, off + len) of the second MR (reg_mr; or of the main
  /// buffer's MR, `main_mr`) with `access`, signaled with `wr_id` (type 1: ibv_bind_mw; type 2:
  /// IBV_WR_BIND_MW with the next key). Returns the post's errno; `rkey`: the window's new one.
  int bind_mw(const PeerQp& qp, const Window& w, uint64_t off, uint64_t len, unsigned access,
              uint64_t wr_id, uint32_t* rkey, bool main_mr = false);
  /// Posts a signaled IBV_WR_LOCAL_INV of `rkey` on `qp`.
  int local_inv(const PeerQp& qp, uint32_t rkey, uint64_t wr_id);
  int dealloc_mw(const Window& w);
  /// Each of `qps` posts `per_qp` FETCH_AND_ADDs of 1 on (raddr, rkey); returns how many
  /// completed successfully (all or the count before the first error).
  uint64_t fetch_add_storm(const std::vector<PeerQp>& qps, uint64_t raddr, uint32_t rkey,
                           uint32_t per_qp);

 private:
  /// Sends one order and reads its answer; returns the peer's errno (0: done), or -1 with a
  /// gtest failure if the peer is gone.
  int call(uint32_t op, uint32_t qp, std::initializer_list<uint64_t> args, const void* payload,
           size_t payload_len, std::vector<uint8_t>* out = nullptr);

  pid_t pid_ = -1;
  int to_peer_ = -1, from_peer_ = -1;
  uint16_t lid_ = 0;
  PeerMem mem_{};
};

}  // namespace vrdma::test
