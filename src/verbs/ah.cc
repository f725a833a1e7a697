// Address handles (ibv_create_ah and friends) for UD.
#include <cstring>

#include "verbs/ah.h"
#include "verbs/internal.h"

using namespace vrdma::verbs;

#define VERBS_EXPORT extern "C" __attribute__((visibility("default")))

VERBS_EXPORT ibv_ah* ibv_create_ah(ibv_pd* pd, ibv_ah_attr* attr) {
  if (!pd || !attr || attr->port_num != 1 || (attr->is_global && attr->grh.sgid_index != 0) ||
      (!attr->is_global && attr->dlid == 0)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* ah = new VAh{};
  ah->ah.context = pd->context;
  ah->ah.pd = pd;
  ah->dest.dlid = attr->dlid;
  ah->dest.is_global = attr->is_global ? 1 : 0;
  ah->dest.sl = attr->sl & 0xf;
  std::memcpy(ah->dest.dgid, attr->grh.dgid.raw, 16);
  return &ah->ah;
}

VERBS_EXPORT int ibv_destroy_ah(ibv_ah* ah) {
  delete to_vah(ah);
  return 0;
}

VERBS_EXPORT int ibv_init_ah_from_wc(ibv_context*, uint8_t port_num, ibv_wc* wc, ibv_grh* grh,
                                     ibv_ah_attr* ah_attr) {
  if (port_num != 1 || !wc || !ah_attr) return EINVAL;
  std::memset(ah_attr, 0, sizeof(*ah_attr));
  ah_attr->dlid = wc->slid;
  ah_attr->sl = wc->sl;
  ah_attr->src_path_bits = wc->dlid_path_bits;
  ah_attr->port_num = port_num;
  if (wc->wc_flags & IBV_WC_GRH) {
    if (!grh) return EINVAL;
    // Reply to the sender: its source GID becomes our destination.
    ah_attr->is_global = 1;
    std::memcpy(ah_attr->grh.dgid.raw, grh->sgid.raw, 16);
    const uint32_t flow = be32toh(grh->version_tclass_flow);
    ah_attr->grh.flow_label = flow & 0xfffff;
    ah_attr->grh.traffic_class = static_cast<uint8_t>((flow >> 20) & 0xff);
    ah_attr->grh.sgid_index = 0;
    ah_attr->grh.hop_limit = 0xff;
  }
  return 0;
}

VERBS_EXPORT ibv_ah* ibv_create_ah_from_wc(ibv_pd* pd, ibv_wc* wc, ibv_grh* grh, uint8_t port_num) {
  ibv_ah_attr attr;
  if (int rc = ibv_init_ah_from_wc(pd->context, port_num, wc, grh, &attr)) {
    errno = rc;
    return nullptr;
  }
  return ibv_create_ah(pd, &attr);
}
