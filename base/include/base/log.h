// Minimal logging to stderr for the session layer: path state changes, closed paths and the
// reason a peer's message was refused. Level from $BASE_LOG (error, warn, info, debug; default
// warn). printf-style, one line per call (a single write, so lines from threads do not mix).
#pragma once

#include <cstdarg>

namespace base {

enum class LogLevel : int { error = 0, warn = 1, info = 2, debug = 3 };

bool log_enabled(LogLevel level);
[[gnu::format(printf, 2, 3)]] void log_msg(LogLevel level, const char* fmt, ...);

}  // namespace base

#define BASE_LOG(level, ...)                                              \
  do {                                                                     \
    if (::base::log_enabled(::base::LogLevel::level))                    \
      ::base::log_msg(::base::LogLevel::level, __VA_ARGS__);             \
  } while (0)
