// The TCP transport's embedded directory: guests announced over peer connections, claims on
// a LID/GID held by another node, and locate_* (with etcd's answer first when configured).
#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/sockios.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <ctime>

#include "common/guest_fault.h"
#include "common/log.h"

namespace vrdma::transport::tcp {

using namespace vrdma::proto::wire;

namespace {

std::array<uint8_t, 16> gid_key(const uint8_t gid[16]) {
  std::array<uint8_t, 16> k;
  std::memcpy(k.data(), gid, 16);
  return k;
}

}  // namespace

void TcpTransport::send_directory(Conn& c) {
  for (const auto& [name, g] : local_) {
    GuestEntry e{};
    put_name(e.name, g.name);
    std::memcpy(e.gid, g.gid, 16);
    e.lid = g.lid;
    queue(c, Type::kGuestUp, &e, {}, {});
  }
}

void TcpTransport::on_guest(Conn& c, bool up) {
  if (c.node == opt_.node) return;
  const GuestEntry& e = c.frame.guest;
  GuestInfo g{std::string(get_name(e.name)), e.lid, {}};
  std::memcpy(g.gid, e.gid, 16);
  const auto key = gid_key(e.gid);
  if (!up) {
    // Only the holder lets go of an entry; a claim another node waits with may apply now.
    auto l = by_lid_.find(e.lid);
    if (l != by_lid_.end() && l->second.node == c.node && l->second.name == g.name)
      by_lid_.erase(l);
    auto gi = by_gid_.find(key);
    if (gi != by_gid_.end() && gi->second.node == c.node) by_gid_.erase(gi);
    auto cl = claims_.find(e.lid);
    if (cl != claims_.end() && cl->second.node == c.node) claims_.erase(cl);
    VLOG_DEBUG("directory: guest {} left {}", g.name, c.node);
    settle_claims(now_ns_);
    return;
  }
  for (const auto& [lname, lg] : local_) {
    if (lg.lid == e.lid || std::memcmp(lg.gid, e.gid, 16) == 0) {
      refuse(refused_.directory,
             "directory: refused guest {} (lid {:#x}) from {} ({}): guest {} of this backend "
             "holds that LID/GID",
             g.name, e.lid, c.node, c.addr, lname);
      return;
    }
  }
  const std::string holder = holder_against(c.node, g, now_ns_);
  if (!holder.empty()) {
    refuse(refused_.directory,
           "directory: refused guest {} (lid {:#x}) from {} ({}): {} holds that LID/GID; the "
           "claim applies if {} lets it go (a migration) or is gone for {} s",
           g.name, e.lid, c.node, c.addr, holder, holder, kOwnerGoneMs / 1000);
    claims_[e.lid] = Claim{c.node, g};
    return;
  }
  apply_guest(c.node, g);
}

std::string TcpTransport::holder_against(const std::string& node, const GuestInfo& g,
                                         uint64_t now_ns) const {
  auto holds = [&](const Remote& r) {
    if (r.node == node) return false;
    if (connected_to(r.node)) return true;
    auto d = down_since_.find(r.node);
    return d != down_since_.end() && now_ns - d->second < kOwnerGoneMs * 1000000;
  };
  if (auto l = by_lid_.find(g.lid); l != by_lid_.end() && holds(l->second)) return l->second.node;
  if (auto x = by_gid_.find(gid_key(g.gid)); x != by_gid_.end() && holds(x->second))
    return x->second.node;
  return {};
}

void TcpTransport::apply_guest(const std::string& node, const GuestInfo& g) {
  by_lid_[g.lid] = Remote{node, g.name, false};
  by_gid_[gid_key(g.gid)] = Remote{node, g.name, false};
  claims_.erase(g.lid);
  VLOG_DEBUG("directory: guest {} (lid {:#x}) is on {}", g.name, g.lid, node);
  rx_.on_guest_located(g, node);
}

void TcpTransport::settle_claims(uint64_t now_ns) {
  for (auto it = stale_until_.begin(); it != stale_until_.end();) {
    if (now_ns < it->second) {
      ++it;
      continue;
    }
    const std::string& node = it->first;
    std::erase_if(by_lid_, [&](const auto& e) { return e.second.node == node && e.second.stale; });
    std::erase_if(by_gid_, [&](const auto& e) { return e.second.node == node && e.second.stale; });
    it = stale_until_.erase(it);
  }
  std::vector<Claim> ready;
  for (auto it = claims_.begin(); it != claims_.end();) {
    if (!connected_to(it->second.node)) {
      it = claims_.erase(it);  // its node is gone: it announces again when it is back
    } else if (holder_against(it->second.node, it->second.g, now_ns).empty()) {
      ready.push_back(std::move(it->second));
      it = claims_.erase(it);
    } else {
      ++it;
    }
  }
  for (const Claim& cl : ready) {
    VLOG_INFO("directory: guest {} (lid {:#x}) moved to {}", cl.g.name, cl.g.lid, cl.node);
    apply_guest(cl.node, cl.g);
  }
}

void TcpTransport::refused_frame(const std::string& node, const std::string& why) {
  auto it = by_node_.find(node);
  refuse(refused_.frames, "transport tcp: refused a frame from {} ({}): {}", node,
         it == by_node_.end() ? "?" : it->second->addr, why);
}

void TcpTransport::announce(const GuestInfo& g, bool up) {
  if (directory_) directory_->announce(g, up);
  if (up) {
    local_[g.name] = g;
  } else {
    local_.erase(g.name);
  }
  GuestEntry e{};
  put_name(e.name, g.name);
  std::memcpy(e.gid, g.gid, 16);
  e.lid = g.lid;
  for (auto& [node, c] : by_node_) {
    if (node != opt_.node) queue(*c, up ? Type::kGuestUp : Type::kGuestDown, &e, {}, {});
  }
}

// With a directory outside (etcd), its answer decides. What a peer announced over its own
// connection is used only for what that directory does not list yet while it is reachable: a
// guest that just joined there is announced on the connection its first request follows, but
// reaches our copy of etcd a moment later. While etcd is away nothing new is located.
std::string TcpTransport::locate_lid(uint16_t lid) const {
  if (directory_) {
    std::string node = directory_->locate_lid(lid);
    if (!node.empty() || !directory_->unavailable().empty()) return node;
  }
  auto it = by_lid_.find(lid);
  if (it == by_lid_.end()) {
    lookup_missed_ = !directory_;  // the configured peers are asked (poll)
    return {};
  }
  return it->second.node;
}

std::string TcpTransport::locate_gid(const uint8_t gid[16]) const {
  if (directory_) {
    std::string node = directory_->locate_gid(gid);
    if (!node.empty() || !directory_->unavailable().empty()) return node;
  }
  auto it = by_gid_.find(gid_key(gid));
  if (it == by_gid_.end()) {
    lookup_missed_ = !directory_;
    return {};
  }
  return it->second.node;
}

}  // namespace vrdma::transport::tcp
