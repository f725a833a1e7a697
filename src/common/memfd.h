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

/// A zero-filled memfd of `size` bytes that only `writer` (its one writable mapping, made here)
/// may change: sealed like make_sealed_memfd's and with F_SEAL_FUTURE_WRITE, so no new writable
/// shared mapping and no write() succeed on it, even through a descriptor reopened read-write via
/// /proc/PID/fd from a read-only one handed to a guest.
Result<UniqueFd> make_write_sealed_memfd(const std::string& name, size_t size,
                                         MappedRegion& writer);

/// Checks that `fd` is a file of tmpfs (shmem, where memfds live by default). EINVAL, saying
/// which, for anything else: hugetlbfs (MFD_HUGETLB), whose pages a guest can take away from
/// under a mapping, or any other filesystem.
Status check_shmem(int fd);

/// Checks that `fd` is a tmpfs memfd sealed against shrinking and at least `size` bytes long.
Status check_sealed_memfd(int fd, size_t size);

}  // namespace vrdma
