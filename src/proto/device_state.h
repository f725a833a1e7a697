// The device-state blob (a guest's device, as live migration, snapshots and keep_state move it):
// its magic and version. The blob itself is CBOR built and checked by engine/device_state_*.cc;
// fixed-layout structs pinned elsewhere in proto/ (QpAttr, QpCaps, SendWqe) and the engine's
// QpCounters travel in it as byte strings of their exact size.
// History: 1 = the first; 2 = the guest's owner_uid and each session's uid (a version 1 blob
// imports with the owner unknown: backend/migrate.cc takes it from the guest's connection);
// 3 = QpCounters grew the transport's counters at its end (a version 2 blob's are its prefix);
// 4 = each session's device memory ("dms": handle, segment, length; a version 3 blob has none,
// and its MRs and CQ rings, resized or re-registered or not, read as before);
// 5 = each session's memory windows ("mws": handle, PD, type, rkey, and while bound the MR's
// handle, range, access and type 2's QPN; a version 4 blob has none);
// 6 = each CQ's completion timestamps ("stamps", proto::kStamp*: its ring carries a CqeStamp
// per entry after the entries; a version 5 blob's CQs have none).
// 7 = each QP's own completion rings of the direct path ("own_send", "own_recv": descriptor,
// entries, stamps; their descriptors follow every session's, so the rest of the layout is a
// version 6 blob's), and each session's direct-path cookie ("cookie": address and bytes, so a
// peer proves again after the move); a version 6 blob has neither (it was refused for such a
// guest).
// 8 = XRC: the guest's domains ("xrcds": id, inode) and receive QPs ("xrc_qps": QP entries
// with their domain, bound SRQ number and the index of the session they are reported under),
// "next_xrcd", "next_srqn"; per session its domain opens and receive-QP handles ("xrcds",
// "xrc_qps": [handle, id or QPN]) and its XRC SRQs' "xrcd", "srqn" and "cq"; XRC_SEND QPs in
// "qps". A version 7 blob has none (it was refused for a guest holding a domain).
// 9 = the direct path across backends, in a keeper's blob only (keep_state): "direct_qps" (QPN,
// whether it went direct and whether it offered, its offer's port, address and token, the
// token of the peer's offer it used) and "direct_offers" (the peers' offers held, by the QPN
// they are for); a move's or a snapshot's blob has neither (its QPs left the direct path first),
// nor has a version 8 blob (keep_state turned direct_remote off then).
// 10 = what a QP has in flight is one byte string, "in_flight": per WQE its PSN, length and
// whether its READ data or atomic result arrived (proto::InFlight), oldest first; the WQEs are
// the send queue's slots from "sq_cons" on, which the guest may not reuse before they complete.
// A version 9 blob carried each WQE's copy ("unacked": 320 bytes each, two thirds of a move's
// state under perftest's default depth, and most of the importer's time).
// 11 = a QP's atomic cache ("acache") is one byte string: per entry its PSN and the original
// value (proto::AtomicCacheEntry), up to the last entry that is not empty (the rest are).
// Before, an array of [PSN, value] arrays: 16 per QP, 58 % of the nodes of a 64-QP move's
// state, each allocated by the reader. An importer takes either form whatever the version says.
// An importer takes every version from kStateVersionOldest to kStateVersion.
#pragma once

#include <cstdint>

namespace vrdma::proto {

inline constexpr uint32_t kStateMagic = 0x54535256;  // "VRST"
inline constexpr uint32_t kStateVersion = 11;
inline constexpr uint32_t kStateVersionOldest = 1;

/// One WQE in flight (version 10's "in_flight"), in the exporter's byte order: migration,
/// snapshots and keep_state stay on one machine.
struct InFlight {
  uint32_t psn;
  uint32_t len;
  uint32_t has_result;  ///< 0 or 1
};
static_assert(sizeof(InFlight) == 12);

/// One entry of a QP's atomic cache (version 11's "acache"), in the exporter's byte order.
struct AtomicCacheEntry {
  uint32_t psn;
  uint32_t value_lo, value_hi;  ///< the value before the atomic (12 bytes, no padding)
};
static_assert(sizeof(AtomicCacheEntry) == 12);

}  // namespace vrdma::proto
