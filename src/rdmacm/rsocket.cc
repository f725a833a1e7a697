// rsockets (rsocket.h) are not implemented: every call fails with ENOSYS, so a program that
// tries them (riostream, rstream, the rsocket preload) says so at once instead of misbehaving.
#include <rdma/rsocket.h>

#include <cerrno>

#include "rdmacm/internal.h"

namespace {

template <typename T = int>
T nosys() {
  errno = ENOSYS;
  return static_cast<T>(-1);
}

}  // namespace

CM_EXPORT int rsocket(int, int, int) { return nosys(); }
CM_EXPORT int rbind(int, const sockaddr*, socklen_t) { return nosys(); }
CM_EXPORT int rlisten(int, int) { return nosys(); }
CM_EXPORT int raccept(int, sockaddr*, socklen_t*) { return nosys(); }
CM_EXPORT int rconnect(int, const sockaddr*, socklen_t) { return nosys(); }
CM_EXPORT int rshutdown(int, int) { return nosys(); }
CM_EXPORT int rclose(int) { return nosys(); }
CM_EXPORT ssize_t rrecv(int, void*, size_t, int) { return nosys<ssize_t>(); }
CM_EXPORT ssize_t rrecvfrom(int, void*, size_t, int, sockaddr*, socklen_t*) {
  return nosys<ssize_t>();
}
CM_EXPORT ssize_t rrecvmsg(int, msghdr*, int) { return nosys<ssize_t>(); }
CM_EXPORT ssize_t rsend(int, const void*, size_t, int) { return nosys<ssize_t>(); }
CM_EXPORT ssize_t rsendto(int, const void*, size_t, int, const sockaddr*, socklen_t) {
  return nosys<ssize_t>();
}
CM_EXPORT ssize_t rsendmsg(int, const msghdr*, int) { return nosys<ssize_t>(); }
CM_EXPORT ssize_t rread(int, void*, size_t) { return nosys<ssize_t>(); }
CM_EXPORT ssize_t rreadv(int, const iovec*, int) { return nosys<ssize_t>(); }
CM_EXPORT ssize_t rwrite(int, const void*, size_t) { return nosys<ssize_t>(); }
CM_EXPORT ssize_t rwritev(int, const iovec*, int) { return nosys<ssize_t>(); }
CM_EXPORT int rpoll(pollfd*, nfds_t, int) { return nosys(); }
CM_EXPORT int rselect(int, fd_set*, fd_set*, fd_set*, timeval*) { return nosys(); }
CM_EXPORT int rgetpeername(int, sockaddr*, socklen_t*) { return nosys(); }
CM_EXPORT int rgetsockname(int, sockaddr*, socklen_t*) { return nosys(); }
CM_EXPORT int rsetsockopt(int, int, int, const void*, socklen_t) { return nosys(); }
CM_EXPORT int rgetsockopt(int, int, int, void*, socklen_t*) { return nosys(); }
CM_EXPORT int rfcntl(int, int, ...) { return nosys(); }
CM_EXPORT off_t riomap(int, void*, size_t, int, int, off_t) { return nosys<off_t>(); }
CM_EXPORT int riounmap(int, void*, size_t) { return nosys(); }
CM_EXPORT size_t riowrite(int, const void*, size_t, off_t, int) { return nosys<size_t>(); }
