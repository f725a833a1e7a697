// Sharing a session between processes (ibv_import_device(3), ibv_import_pd/mr/dm): a process
// that holds the session's socket (the ibv_context's cmd_fd, passed by SCM_RIGHTS) asks for the
// session's descriptors again and looks its objects up by handle. The session stays one: its
// quotas, its handles, its end when the last holder of the socket closes it.
// docs/ARCHITECTURE.md, "Imports". Owned by the engine thread.
#include <fmt/format.h>

#include <cstring>

#include "engine/datapath_util.h"
#include "engine/device.h"

namespace vrdma::engine {

using namespace vrdma::proto;

void Device::session_hello(const Session& s, HelloResp& resp, FdList& fds) const {
  const Guest& g = *s.guest;
  resp.guest_id = g.id;
  resp.port_guid = g.port_guid;
  std::memcpy(resp.gid, g.gid, 16);
  resp.lid = g.lid;
  resp.session_id = s.id;
  resp.control_bytes = kPage;
  fds = {s.control_fd.get(), s.doorbell.get(), s.async_read.get()};
}

Result<ImportObjectResp> Device::import_object(const Session& s, const ImportObjectReq& req,
                                               FdList& fds) {
  ImportObjectResp resp{};
  switch (static_cast<ImportKind>(req.kind)) {
    case ImportKind::kPd:
      if (!s.pds.count(req.handle)) return error(EINVAL, fmt::format("no PD {}", req.handle));
      return resp;
    case ImportKind::kMr: {
      auto it = s.mrs.find(req.handle);
      if (it == s.mrs.end()) return error(EINVAL, fmt::format("no MR {}", req.handle));
      const Mr& mr = *it->second;
      resp.pd = mr.pd;
      resp.key = mr.key;
      resp.access = mr.access;
      resp.addr = mr.addr;
      resp.length = mr.length;
      return resp;
    }
    case ImportKind::kDm: {
      auto it = s.dms.find(req.handle);
      if (it == s.dms.end()) return error(EINVAL, fmt::format("no DM {}", req.handle));
      auto seg = s.segments.find(it->second.segment);
      if (seg == s.segments.end()) return error(EIO, "a DM without its segment");
      resp.length = it->second.length;
      resp.bytes = seg->second->map.size();
      fds = {seg->second->fd.get()};
      return resp;
    }
  }
  return error(EINVAL, fmt::format("import of kind {}", req.kind));
}

}  // namespace vrdma::engine
