#include "common/log.h"

#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <ctime>

namespace vrdma::log {

Level threshold() {
  static const Level level = [] {
    const char* e = ::secure_getenv("VRDMA_LOG");
    if (!e) return Level::kInfo;
    if (!std::strcmp(e, "debug")) return Level::kDebug;
    if (!std::strcmp(e, "warn")) return Level::kWarn;
    if (!std::strcmp(e, "error")) return Level::kError;
    return Level::kInfo;
  }();
  return level;
}

void write(Level level, std::string_view text) {
  static constexpr const char* kNames[] = {"debug", "info", "warn", "error"};
  timeval tv{};
  ::gettimeofday(&tv, nullptr);
  tm t{};
  ::gmtime_r(&tv.tv_sec, &t);
  std::string line = fmt::format("{:02}:{:02}:{:02}.{:06} vrdma[{}] {}: {}\n", t.tm_hour, t.tm_min,
                                 t.tm_sec, tv.tv_usec, ::getpid(),
                                 kNames[static_cast<int>(level)], text);
  // One write(2) per line so concurrent writers do not interleave within a line.
  ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
  (void)n;
}

}  // namespace vrdma::log
