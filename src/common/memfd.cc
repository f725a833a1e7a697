#include "common/memfd.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <cstring>

#include <fmt/format.h>

namespace vrdma {

Result<UniqueFd> make_sealed_memfd(const std::string& name, size_t size) {
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return error(errno, fmt::format("memfd_create: {}", std::strerror(errno)));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) < 0)
    return error(errno, fmt::format("ftruncate memfd to {}: {}", size, std::strerror(errno)));
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
    return error(errno, fmt::format("sealing memfd: {}", std::strerror(errno)));
  return fd;
}

Result<UniqueFd> make_write_sealed_memfd(const std::string& name, size_t size,
                                         MappedRegion& writer) {
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return error(errno, fmt::format("memfd_create: {}", std::strerror(errno)));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) < 0)
    return error(errno, fmt::format("ftruncate memfd to {}: {}", size, std::strerror(errno)));
  // The writer's mapping first: F_SEAL_FUTURE_WRITE leaves existing mappings writable and
  // refuses every later one.
  MappedRegion map = MappedRegion::map_shared(fd.get(), size);
  if (!map.valid()) return error(errno, fmt::format("mapping memfd: {}", std::strerror(errno)));
  if (::fcntl(fd.get(), F_ADD_SEALS,
              F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) < 0)
    return error(errno, fmt::format("sealing memfd: {}", std::strerror(errno)));
  writer = std::move(map);
  return fd;
}

Status check_shmem(int fd) {
  struct statfs fs {};
  if (::fstatfs(fd, &fs) < 0) return error(errno, fmt::format("fstatfs: {}", std::strerror(errno)));
  if (static_cast<uint64_t>(fs.f_type) == TMPFS_MAGIC) return Status::ok();
  if (static_cast<uint64_t>(fs.f_type) == HUGETLBFS_MAGIC)
    return error(EINVAL, "hugetlbfs memfd (MFD_HUGETLB): only tmpfs memfds can be segments");
  return error(EINVAL, fmt::format("not a tmpfs memfd (filesystem magic {:#x})",
                                   static_cast<uint64_t>(fs.f_type)));
}

Status check_sealed_memfd(int fd, size_t size) {
  RETURN_IF_ERROR(check_shmem(fd));
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return error(EINVAL, "descriptor is not a sealable memfd");
  if (!(seals & F_SEAL_SHRINK)) return error(EINVAL, "memfd is not sealed against shrinking");
  struct stat st{};
  if (::fstat(fd, &st) < 0) return error(errno, "fstat");
  if (static_cast<uint64_t>(st.st_size) < size)
    return error(EINVAL, fmt::format("memfd holds {} bytes, {} claimed", st.st_size, size));
  return Status::ok();
}

}  // namespace vrdma
