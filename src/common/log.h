// Logging: one line per event to stderr, with a level and the component. The backend's stderr
// is its log (a file when it was started on first use). VRDMA_LOG=debug|info|warn|error.
#pragma once

#include <fmt/format.h>

namespace vrdma::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

Level threshold();
void write(Level level, std::string_view text);

template <typename... Args>
void emit(Level level, fmt::format_string<Args...> f, Args&&... args) {
  if (level < threshold()) return;
  write(level, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace vrdma::log

#define VLOG_DEBUG(...) ::vrdma::log::emit(::vrdma::log::Level::kDebug, __VA_ARGS__)
#define VLOG_INFO(...) ::vrdma::log::emit(::vrdma::log::Level::kInfo, __VA_ARGS__)
#define VLOG_WARN(...) ::vrdma::log::emit(::vrdma::log::Level::kWarn, __VA_ARGS__)
#define VLOG_ERROR(...) ::vrdma::log::emit(::vrdma::log::Level::kError, __VA_ARGS__)
