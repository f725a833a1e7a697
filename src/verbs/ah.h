// Address handles: where a UD send goes. Purely a guest-side object: the backend learns the
// destination from each WQE (proto::UdDest), as an HCA reads it from the AH the WQE names.
#pragma once

#include <infiniband/verbs.h>

#include "proto/ring.h"

namespace vrdma::verbs {

struct VAh {
  ibv_ah ah;  ///< first: ibv_ah* and VAh* are the same address
  proto::UdDest dest;
};

inline VAh* to_vah(ibv_ah* ah) { return reinterpret_cast<VAh*>(ah); }

}  // namespace vrdma::verbs
