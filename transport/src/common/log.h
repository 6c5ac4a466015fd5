// Minimal logging to stderr for the session layer: path state changes, closed paths and the
// reason a peer's message was refused. Level from $IBTRS_LOG (error, warn, info, debug; default
// warn). printf-style, one line per call (a single write, so lines from threads do not mix).
#pragma once

#include <cstdarg>

namespace ibtrs {

enum class LogLevel : int { error = 0, warn = 1, info = 2, debug = 3 };

bool log_enabled(LogLevel level);
[[gnu::format(printf, 2, 3)]] void log_msg(LogLevel level, const char* fmt, ...);

}  // namespace ibtrs

#define IBTRS_LOG(level, ...)                                              \
  do {                                                                     \
    if (::ibtrs::log_enabled(::ibtrs::LogLevel::level))                    \
      ::ibtrs::log_msg(::ibtrs::LogLevel::level, __VA_ARGS__);             \
  } while (0)
