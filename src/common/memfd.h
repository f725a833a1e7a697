// Sealed memfds: shared memory whose size neither side can change once handed over, so a guest
// cannot shrink a mapping under the backend (which would turn its accesses into SIGBUS).
#pragma once

#include <cstddef>
#include <string>

#include "common/status.h"
#include "common/unique_fd.h"

namespace vrdma {

/// A zero-filled memfd of `size` bytes, sealed against shrinking, growing and further seals.
Result<UniqueFd> make_sealed_memfd(const std::string& name, size_t size);

/// Checks that `fd` is a memfd sealed against shrinking and at least `size` bytes long.
Status check_sealed_memfd(int fd, size_t size);

}  // namespace vrdma
