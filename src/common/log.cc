#include "common/log.h"

#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cinttypes>
#include <cstdio>
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

namespace {

/// Whether stderr is the journal: -1 not looked at yet, else 0 or 1.
std::atomic<int> g_journal{-1};

bool stderr_is_journal() {
  int j = g_journal.load(std::memory_order_relaxed);
  if (j < 0) {
    j = is_journal_stream(::getenv("JOURNAL_STREAM"), STDERR_FILENO) ? 1 : 0;
    g_journal.store(j, std::memory_order_relaxed);
  }
  return j == 1;
}

}  // namespace

bool is_journal_stream(const char* journal_stream, int fd) {
  if (!journal_stream) return false;
  uintmax_t dev = 0, ino = 0;
  int used = 0;
  if (std::sscanf(journal_stream, "%" SCNuMAX ":%" SCNuMAX "%n", &dev, &ino, &used) != 2 ||
      journal_stream[used] != '\0')
    return false;
  struct stat st {};
  return ::fstat(fd, &st) == 0 && uintmax_t(st.st_dev) == dev && uintmax_t(st.st_ino) == ino;
}

void recheck_stderr() { g_journal.store(-1, std::memory_order_relaxed); }

std::string line(Level level, std::string_view text, bool journal) {
  static constexpr const char* kNames[] = {"debug", "info", "warn", "error"};
  static constexpr const char* kPriorities[] = {"<7>", "<6>", "<4>", "<3>"};
  const int l = static_cast<int>(level);
  if (journal)
    return fmt::format("{}vrdma[{}] {}: {}\n", kPriorities[l], ::getpid(), kNames[l], text);
  timeval tv{};
  ::gettimeofday(&tv, nullptr);
  tm t{};
  ::gmtime_r(&tv.tv_sec, &t);
  return fmt::format("{:02}:{:02}:{:02}.{:06} vrdma[{}] {}: {}\n", t.tm_hour, t.tm_min, t.tm_sec,
                     tv.tv_usec, ::getpid(), kNames[l], text);
}

void write(Level level, std::string_view text) {
  const std::string s = line(level, text, stderr_is_journal());
  // One write(2) per line so concurrent writers do not interleave within a line.
  ssize_t n = ::write(STDERR_FILENO, s.data(), s.size());
  (void)n;
}

}  // namespace vrdma::log
