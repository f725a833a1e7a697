// An RDMA atomic executed on this host's memory: a CPU atomic, so it is atomic against other
// RDMA atomics (whoever executes them: the backend, or a library on the direct path) and against
// programs touching the word themselves.
#pragma once

#include <cstdint>

namespace vrdma {

/// FETCH_AND_ADD (`fetch_add`) or COMPARE_AND_SWAP on an aligned word; returns the value before.
inline uint64_t rdma_atomic(uint64_t* word, bool fetch_add, uint64_t compare_add, uint64_t swap) {
  if (fetch_add) return __atomic_fetch_add(word, compare_add, __ATOMIC_SEQ_CST);
  uint64_t old = compare_add;
  __atomic_compare_exchange_n(word, &old, swap, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return old;
}

}  // namespace vrdma
