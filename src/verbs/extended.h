// The extended verbs (ibv_create_cq_ex, ibv_create_qp_ex, ibv_qp_to_qp_ex) on top of the
// ordinary CQ and QP: the same objects and rings, with ibv_cq_ex / ibv_qp_ex as a second view
// of VCq / VQp (internal.h). Creation in extended.cc, the data path in extended_datapath.cc.
#pragma once

#include <infiniband/verbs.h>

namespace vrdma::verbs {

/// verbs_context ops.
ibv_cq_ex* create_cq_ex(ibv_context* c, ibv_cq_init_attr_ex* attr);
ibv_qp* create_qp_ex(ibv_context* c, ibv_qp_init_attr_ex* attr);

/// Fill the iterator and builder callbacks of a CQ/QP created by the ops above.
void install_cq_ex_ops(ibv_cq_ex& cq);
void install_qp_ex_ops(ibv_qp_ex& qp);

}  // namespace vrdma::verbs
