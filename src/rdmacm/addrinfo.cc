// rdma_getaddrinfo and the endpoint calls built on it (rdma_create_ep, rdma_destroy_ep): names
// and numbers resolved by the system's getaddrinfo; every address of this host is vrdma0.
#include <netdb.h>

#include <cstdlib>
#include <cstring>

#include "rdmacm/internal.h"

using namespace vrdma::rdmacm;

namespace {

sockaddr* copy_addr(const sockaddr* sa, socklen_t len) {
  auto* out = static_cast<sockaddr*>(std::malloc(len));
  if (out) std::memcpy(out, sa, len);
  return out;
}

}  // namespace

CM_EXPORT void rdma_freeaddrinfo(rdma_addrinfo* res) {
  while (res) {
    rdma_addrinfo* next = res->ai_next;
    std::free(res->ai_src_addr);
    std::free(res->ai_dst_addr);
    std::free(res->ai_src_canonname);
    std::free(res->ai_dst_canonname);
    std::free(res->ai_route);
    std::free(res->ai_connect);
    std::free(res);
    res = next;
  }
}

// Returns 0, or getaddrinfo's EAI_* code (as rdma-core does; errno is set too).
CM_EXPORT int rdma_getaddrinfo(const char* node, const char* service, const rdma_addrinfo* hints,
                               rdma_addrinfo** res) {
  if (!res || (!node && !service)) {
    errno = EINVAL;
    return EAI_NONAME;
  }
  const int flags = hints ? hints->ai_flags : 0;
  addrinfo h{};
  h.ai_family = hints ? hints->ai_family : AF_UNSPEC;
  if (h.ai_family != AF_UNSPEC && h.ai_family != AF_INET && h.ai_family != AF_INET6) {
    errno = EAFNOSUPPORT;
    return EAI_FAMILY;
  }
  if (flags & RAI_PASSIVE) h.ai_flags |= AI_PASSIVE;
  if (flags & RAI_NUMERICHOST) h.ai_flags |= AI_NUMERICHOST;
  h.ai_socktype = SOCK_STREAM;
  addrinfo* ai = nullptr;
  if (const int rc = ::getaddrinfo(node, service, &h, &ai)) {
    errno = rc == EAI_SYSTEM ? errno : ENOENT;
    return rc;
  }
  auto* r = static_cast<rdma_addrinfo*>(std::calloc(1, sizeof(rdma_addrinfo)));
  if (!r) {
    ::freeaddrinfo(ai);
    errno = ENOMEM;
    return EAI_MEMORY;
  }
  r->ai_flags = flags;
  r->ai_family = ai->ai_family;
  r->ai_port_space = hints && hints->ai_port_space ? hints->ai_port_space : RDMA_PS_TCP;
  r->ai_qp_type = hints && hints->ai_qp_type
                      ? hints->ai_qp_type
                      : (r->ai_port_space == RDMA_PS_UDP ? IBV_QPT_UD : IBV_QPT_RC);
  if (flags & RAI_PASSIVE) {
    r->ai_src_addr = copy_addr(ai->ai_addr, ai->ai_addrlen);
    r->ai_src_len = ai->ai_addrlen;
  } else {
    r->ai_dst_addr = copy_addr(ai->ai_addr, ai->ai_addrlen);
    r->ai_dst_len = ai->ai_addrlen;
    if (hints && hints->ai_src_addr && hints->ai_src_len) {
      r->ai_src_addr = copy_addr(hints->ai_src_addr, hints->ai_src_len);
      r->ai_src_len = hints->ai_src_len;
    }
  }
  ::freeaddrinfo(ai);
  if ((r->ai_src_len && !r->ai_src_addr) || (r->ai_dst_len && !r->ai_dst_addr)) {
    rdma_freeaddrinfo(r);
    errno = ENOMEM;
    return EAI_MEMORY;
  }
  *res = r;
  return 0;
}

CM_EXPORT int rdma_create_ep(rdma_cm_id** id, rdma_addrinfo* res, ibv_pd* pd,
                             ibv_qp_init_attr* qp_init_attr) {
  if (!id || !res) {
    errno = EINVAL;
    return -1;
  }
  rdma_cm_id* cid;
  if (create_id(nullptr, &cid, nullptr, static_cast<rdma_port_space>(res->ai_port_space),
                static_cast<ibv_qp_type>(res->ai_qp_type)))
    return -1;
  VId* v = to_vid(cid);
  cid->pd = pd;
  int rc;
  if (res->ai_flags & RAI_PASSIVE) {
    rc = rdma_bind_addr(cid, res->ai_src_addr);
    // Each request's id gets this QP (rdma_get_request).
    if (rc == 0 && qp_init_attr) {
      v->ep_qp = *qp_init_attr;
      v->ep_has_qp = true;
    }
  } else {
    rc = rdma_resolve_addr(cid, res->ai_src_addr, res->ai_dst_addr, 2000);
    if (rc == 0) rc = rdma_resolve_route(cid, 2000);
    if (rc == 0 && qp_init_attr) rc = rdma_create_qp(cid, pd, qp_init_attr);
  }
  if (rc) {
    const int err = errno;
    rdma_destroy_id(cid);
    errno = err;
    return -1;
  }
  *id = cid;
  return 0;
}

CM_EXPORT void rdma_destroy_ep(rdma_cm_id* id) {
  if (!id) return;
  if (id->qp) rdma_destroy_qp(id);
  if (id->srq) rdma_destroy_srq(id);
  rdma_destroy_id(id);
}
