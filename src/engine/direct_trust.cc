#include "engine/direct_trust.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <linux/nsfs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "common/unique_fd.h"

namespace vrdma::engine {

namespace {

/// The NSpid line of /proc/PID/status: the pid in this process's namespace first, then in each
/// nested one down to the process's own. Empty when the process is gone.
std::vector<uint32_t> ns_pids(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string line;
  std::vector<uint32_t> out;
  while (std::getline(in, line)) {
    if (!line.starts_with("NSpid:")) continue;
    std::istringstream ss(line.substr(6));
    for (uint32_t p; ss >> p;) out.push_back(p);
    break;
  }
  return out;
}

/// Threads still reading a proof (a read the peer stalls keeps its thread).
std::atomic<int> g_proof_readers{0};
constexpr int kMaxProofReaders = 4;

}  // namespace

Result<uint32_t> pid_as_seen_by(pid_t viewer, pid_t target) {
  const std::vector<uint32_t> v = ns_pids(viewer), t = ns_pids(target);
  if (v.empty() || t.empty()) return error(ESRCH, "the process is gone");
  if (t.size() < v.size()) return error(EPERM, "the peer lives above the caller's pid namespace");
  // The target's namespace, or the ancestor of it at the viewer's depth, must be the viewer's.
  UniqueFd ns(::open(fmt::format("/proc/{}/ns/pid", target).c_str(), O_RDONLY | O_CLOEXEC));
  for (size_t up = t.size() - v.size(); ns.valid() && up > 0; --up)
    ns = UniqueFd(::ioctl(ns.get(), NS_GET_PARENT));
  struct stat a {
  }, b{};
  if (!ns.valid() || ::fstat(ns.get(), &a) != 0 ||
      ::stat(fmt::format("/proc/{}/ns/pid", viewer).c_str(), &b) != 0)
    return error(errno == ENOENT ? ESRCH : errno, "reading pid namespaces");
  if (a.st_dev != b.st_dev || a.st_ino != b.st_ino)
    return error(EPERM, "the peer is in another pid namespace");
  return t[v.size() - 1];
}

struct MemProof::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false, good = false;
};

bool MemProof::wait(int ms) const {
  std::unique_lock lock(st_->mu);
  return st_->cv.wait_for(lock, std::chrono::milliseconds(ms), [&] { return st_->done; });
}

bool MemProof::good() const {
  std::lock_guard lock(st_->mu);
  return st_->done && st_->good;
}

Result<MemProof> start_mem_proof(int proof, uint64_t addr, std::span<const uint8_t> cookie) {
  using Cookie = std::array<uint8_t, 16>;
  if (cookie.size() != sizeof(Cookie)) return error(EINVAL, "a cookie is 16 bytes");
  const int fl = ::fcntl(proof, F_GETFL);
  if (fl < 0 || (fl & O_ACCMODE) != O_RDWR) return error(EPERM, "the proof is not open O_RDWR");
  struct statfs fs {};
  struct stat st {};
  char link[64] = {};
  const ssize_t n =
      ::readlink(fmt::format("/proc/self/fd/{}", proof).c_str(), link, sizeof(link) - 1);
  if (::fstatfs(proof, &fs) != 0 || fs.f_type != PROC_SUPER_MAGIC || ::fstat(proof, &st) != 0 ||
      !S_ISREG(st.st_mode) || n < 4 || std::strcmp(link + n - 4, "/mem") != 0)
    return error(EPERM, "the proof is not a /proc/PID/mem file");
  if (g_proof_readers.fetch_add(1) >= kMaxProofReaders) {
    g_proof_readers.fetch_sub(1);
    return error(EBUSY, "earlier proofs are still being read");
  }
  UniqueFd fd(::fcntl(proof, F_DUPFD_CLOEXEC, 0));
  if (!fd.valid()) {
    g_proof_readers.fetch_sub(1);
    return error(EMFILE, "duplicating the proof");
  }
  MemProof p;
  p.st_ = std::make_shared<MemProof::State>();
  Cookie want;
  std::memcpy(want.data(), cookie.data(), want.size());
  try {
    std::thread([fd = std::move(fd), addr, want, st = p.st_] {
      Cookie got{};
      const bool ok = ::pread(fd.get(), got.data(), got.size(), static_cast<off_t>(addr)) ==
                          static_cast<ssize_t>(got.size()) &&
                      got == want;
      {
        std::lock_guard lock(st->mu);
        st->done = true;
        st->good = ok;
      }
      st->cv.notify_all();
      g_proof_readers.fetch_sub(1);
    }).detach();
  } catch (const std::system_error&) {
    g_proof_readers.fetch_sub(1);
    return error(EAGAIN, "no thread to read the proof");
  }
  return p;
}

}  // namespace vrdma::engine
