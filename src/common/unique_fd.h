// UniqueFd and MappedRegion: RAII owners of a file descriptor and of an mmap'ed range.
// Move-only; destructors only release and never fail loudly.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <utility>

namespace vrdma {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) { reset(o.release());
}
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) { ::close(fd_);
}
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

class MappedRegion {
 public:
  MappedRegion() = default;
  MappedRegion(void* addr, size_t len) : addr_(addr), len_(len) {}
  MappedRegion(MappedRegion&& o) noexcept
      : addr_(std::exchange(o.addr_, nullptr)), len_(std::exchange(o.len_, 0)) {}
  MappedRegion& operator=(MappedRegion&& o) noexcept {
    if (this != &o) {
      reset();
      addr_ = std::exchange(o.addr_, nullptr);
      len_ = std::exchange(o.len_, 0);
    }
    return *this;
  }
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion() { reset(); }

  /// Maps `len` bytes of `fd` shared, read-write. Returns an empty region on failure (errno set).
  static MappedRegion map_shared(int fd, size_t len, off_t off = 0) {
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, off);
    if (p == MAP_FAILED) { return {};
}
    return {p, len};
  }

  /// Maps `len` bytes of `fd` shared, read-only (a descriptor opened read-only allows no more).
  static MappedRegion map_readonly(int fd, size_t len) {
    void* p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return {};
    return {p, len};
  }

  uint8_t* data() const { return static_cast<uint8_t*>(addr_); }
  size_t size() const { return len_; }
  bool valid() const { return addr_ != nullptr; }
  void reset() {
    if (addr_) { ::munmap(addr_, len_);
}
    addr_ = nullptr;
    len_ = 0;
  }

 private:
  void* addr_ = nullptr;
  size_t len_ = 0;
};

}  // namespace vrdma
