// Device memory (ibv_alloc_dm(3)): memory "on the device" that WQEs reach through a zero-based
// MR (ibv_reg_dm_mr) and the application only through ibv_memcpy_to_dm/from_dm. On vrdma it is
// a memfd the backend makes (counted against the guest's max_dm_bytes) and both sides map: the
// copies are plain memcpy, and the backend executes WQEs on it like on any registered memory.
#include <cstring>
#include <memory>

#include "proto/device_caps.h"
#include "verbs/internal.h"

using namespace vrdma;
using namespace vrdma::verbs;
using namespace vrdma::proto;

#define VERBS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

struct VDm {
  ibv_dm dm;  ///< must stay first (to_vdm)
  uint32_t handle = 0;
  uint64_t length = 0;  ///< what was asked for; the mapping is whole pages
  MappedRegion map;
};

VDm* to_vdm(ibv_dm* dm) { return reinterpret_cast<VDm*>(dm); }

/// ibv_memcpy_to_dm/from_dm: EINVAL outside [0, length), as a range the device does not have.
bool dm_range_ok(const VDm& v, uint64_t offset, size_t length) {
  return offset <= v.length && length <= v.length - offset;
}

int memcpy_to_dm(ibv_dm* dm, uint64_t offset, const void* host, size_t length) {
  VDm* v = to_vdm(dm);
  if (!dm_range_ok(*v, offset, length)) return EINVAL;
  std::memcpy(v->map.data() + offset, host, length);
  return 0;
}

int memcpy_from_dm(void* host, ibv_dm* dm, uint64_t offset, size_t length) {
  VDm* v = to_vdm(dm);
  if (!dm_range_ok(*v, offset, length)) return EINVAL;
  std::memcpy(host, v->map.data() + offset, length);
  return 0;
}

void fill_vdm(VDm& v, ibv_context* c, uint32_t handle, uint64_t length) {
  v.handle = handle;
  v.length = length;
  v.dm.context = c;
  v.dm.memcpy_to_dm = memcpy_to_dm;
  v.dm.memcpy_from_dm = memcpy_from_dm;
  v.dm.comp_mask = IBV_DM_MASK_HANDLE;  // dm.handle is valid: ibv_import_dm takes it
  v.dm.handle = handle;
}

}  // namespace

namespace vrdma::verbs {

uint64_t max_dm_size(const VContext& ctx) {
  const ControlPage* cp = ctx.control_page();
  uint64_t quota = 0;
  if (cp && (cp->features & kFeatureLimits))
    quota = uint64_t{cp->max_dm_bytes_hi} << 32 | cp->max_dm_bytes_lo;
  return quota != 0 && quota < kMaxDmSize ? quota : kMaxDmSize;
}

ibv_dm* alloc_dm(ibv_context* c, ibv_alloc_dm_attr* attr) {
  if (!attr || attr->length == 0) return fail_ptr<ibv_dm>(EINVAL);
  // No comp_mask bit of ibv_alloc_dm_attr is defined.
  if (attr->comp_mask) return fail_ptr<ibv_dm>(EOPNOTSUPP);
  VContext* ctx = to_vctx(c);
  AllocDmReq req{attr->length, attr->log_align_req, 0};
  AllocDmResp resp{};
  std::vector<UniqueFd> fds;
  if (int rc = ctx->call(Op::kAllocDm, req, resp, {}, &fds)) return fail_ptr<ibv_dm>(rc);
  auto v = std::make_unique<VDm>();
  v->map = MappedRegion::map_shared(fds.empty() ? -1 : fds[0].get(), resp.bytes);
  if (!v->map.valid() || resp.bytes < attr->length) {
    HandleReq freq{resp.handle, 0};
    Empty none;
    ctx->call(Op::kFreeDm, &freq, sizeof(freq), &none, 0);
    return fail_ptr<ibv_dm>(ENOMEM);
  }
  fill_vdm(*v, c, resp.handle, attr->length);
  return &v.release()->dm;
}

int free_dm(ibv_dm* dm) {
  VDm* v = to_vdm(dm);
  HandleReq req{v->handle, 0};
  Empty resp;
  if (int rc = to_vctx(dm->context)->call(Op::kFreeDm, &req, sizeof(req), &resp, 0)) return rc;
  delete v;
  return 0;
}

}  // namespace vrdma::verbs

// ibv_import_dm(3): device memory of a context this one shares (ibv_import_device), mapped here
// from its memfd; ibv_unimport_dm forgets it here only, ibv_free_dm frees it for every sharer.
VERBS_EXPORT ibv_dm* ibv_import_dm(ibv_context* c, uint32_t dm_handle) {
  if (!c) return fail_ptr<ibv_dm>(EINVAL);
  const ImportObjectReq req{static_cast<uint32_t>(ImportKind::kDm), dm_handle};
  ImportObjectResp resp{};
  std::vector<UniqueFd> fds;
  if (int rc = to_vctx(c)->call(Op::kImportObject, req, resp, {}, &fds))
    return fail_ptr<ibv_dm>(rc);
  auto v = std::make_unique<VDm>();
  v->map = MappedRegion::map_shared(fds.empty() ? -1 : fds[0].get(), resp.bytes);
  if (!v->map.valid() || resp.bytes < resp.length) return fail_ptr<ibv_dm>(ENOMEM);
  fill_vdm(*v, c, dm_handle, resp.length);
  return &v.release()->dm;
}

VERBS_EXPORT void ibv_unimport_dm(ibv_dm* dm) { delete to_vdm(dm); }

namespace vrdma::verbs {

ibv_mr* reg_dm_mr(ibv_pd* pd, ibv_dm* dm, uint64_t offset, size_t length, unsigned int access) {
  if (!pd || !dm || pd->context != dm->context) return fail_ptr<ibv_mr>(EINVAL);
  RegDmMrReq req{reinterpret_cast<VPd*>(pd)->handle,
                 to_vdm(dm)->handle,
                 access & ~IBV_ACCESS_OPTIONAL_RANGE,
                 0,
                 offset,
                 length};
  RegMrResp resp{};
  if (int rc = to_vctx(pd->context)->call(Op::kRegDmMr, req, resp)) return fail_ptr<ibv_mr>(rc);
  // Checked by the backend: [offset, offset + length) lies in the allocation.
  // The direct paths find it in local_mrs, with where its byte 0 is here (LocalMr::host).
  VMr* mr = new_vmr(pd, nullptr, length, resp,
                    LocalMr{0, length, 0, req.access & ~IBV_ACCESS_ZERO_BASED, req.pd,
                            to_vdm(dm)->map.data() + offset});
  mr->on_dm = true;
  return &mr->mr;
}

}  // namespace vrdma::verbs
