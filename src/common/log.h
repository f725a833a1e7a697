// Logging: one line per event to stderr, with a level and the component. The backend's stderr
// is its log (a file when it was started on first use). VRDMA_LOG=debug|info|warn|error.
// When stderr is journald's stream (systemd's JOURNAL_STREAM names its dev:ino), each line
// carries its syslog priority (<3> error, <4> warn, <6> info, <7> debug) and no time of its
// own: the journal stamps it.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace vrdma::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

Level threshold();
/// Writes one line to stderr, as line() formats it for where stderr goes now (any thread).
void write(Level level, std::string_view text);

/// The line write() puts out: `HH:MM:SS.UUUUUU vrdma[PID] LEVEL: TEXT\n`, or for the journal
/// `<PRIORITY>vrdma[PID] LEVEL: TEXT\n`.
std::string line(Level level, std::string_view text, bool journal);

/// Whether `fd` is the stream that JOURNAL_STREAM (`journal_stream`, "DEV:INO" in decimal, as
/// systemd sets it) names; false when it is unset, malformed or names another file (a program
/// that inherited the variable but whose stderr was redirected).
bool is_journal_stream(const char* journal_stream, int fd);

/// Looks again at where stderr goes (write() looks once): after fd 2 was replaced, and in tests.
void recheck_stderr();

template <typename... Args>
void emit(Level level, fmt::format_string<Args...> f, Args&&... args) {
  if (level < threshold()) return;
  write(level, fmt::format(f, std::forward<Args>(args)...));
}

/// A condition that recurs as fast as someone can cause it (a peer reconnecting, a full
/// descriptor table): at most one line per `every_ns`, saying how many were held back.
/// Not thread-safe: one per owner thread.
class Every {
 public:
  explicit Every(uint64_t every_ns) : every_ns_(every_ns) {}
  /// True when a line may be written now; `held` is then the number held back since the last.
  bool ready(uint64_t now_ns, uint64_t& held) {
    if (now_ns < next_ns_) {
      ++held_;
      return false;
    }
    held = held_;
    held_ = 0;
    next_ns_ = now_ns + every_ns_;
    return true;
  }

 private:
  uint64_t every_ns_;
  uint64_t next_ns_ = 0;
  uint64_t held_ = 0;
};

/// Like Every, but lets a burst through first: up to `burst` lines at once, then one per
/// `every_ns` (each attempt of an attacker is seen, a flood of them is not written out).
class Burst {
 public:
  Burst(uint64_t every_ns, uint64_t burst) : every_ns_(every_ns), burst_(burst), tokens_(burst) {}
  bool ready(uint64_t now_ns, uint64_t& held) {
    if (last_ns_ == 0) last_ns_ = now_ns;
    if (now_ns > last_ns_) {
      const uint64_t add = (now_ns - last_ns_) / every_ns_;
      if (add) {
        tokens_ = std::min(burst_, tokens_ + add);
        last_ns_ += add * every_ns_;
      }
    }
    if (tokens_ == 0) {
      ++held_;
      return false;
    }
    --tokens_;
    held = held_;
    held_ = 0;
    return true;
  }

 private:
  uint64_t every_ns_, burst_, tokens_;
  uint64_t last_ns_ = 0;
  uint64_t held_ = 0;
};

/// " (N more not logged)" for an Every's `held`, or "".
inline std::string held_note(uint64_t held) {
  return held ? fmt::format(" ({} more not logged)", held) : std::string();
}

}  // namespace vrdma::log

#define VLOG_DEBUG(...) ::vrdma::log::emit(::vrdma::log::Level::kDebug, __VA_ARGS__)
#define VLOG_INFO(...) ::vrdma::log::emit(::vrdma::log::Level::kInfo, __VA_ARGS__)
#define VLOG_WARN(...) ::vrdma::log::emit(::vrdma::log::Level::kWarn, __VA_ARGS__)
#define VLOG_ERROR(...) ::vrdma::log::emit(::vrdma::log::Level::kError, __VA_ARGS__)
