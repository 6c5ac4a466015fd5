#include "base/log.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace base {

namespace {
int level_from_env() {
  const char* v = std::getenv("IBTRS_LOG");
  if (v == nullptr) return static_cast<int>(LogLevel::warn);
  if (std::strcmp(v, "error") == 0) return 0;
  if (std::strcmp(v, "warn") == 0) return 1;
  if (std::strcmp(v, "info") == 0) return 2;
  if (std::strcmp(v, "debug") == 0) return 3;
  return static_cast<int>(LogLevel::warn);
}
const char* name(LogLevel l) {
  switch (l) {
    case LogLevel::error: return "error";
    case LogLevel::warn: return "warn";
    case LogLevel::info: return "info";
    case LogLevel::debug: return "debug";
  }
  return "?";
}
}  // namespace

bool log_enabled(LogLevel level) {
  static const int max = level_from_env();
  return static_cast<int>(level) <= max;
}

void log_msg(LogLevel level, const char* fmt, ...) {
  char buf[1024];
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now).count();
  int n = std::snprintf(buf, sizeof(buf), "ibtrs %lld.%03lld %s: ", static_cast<long long>(ms / 1000),
                        static_cast<long long>(ms % 1000), name(level));
  va_list ap;
  va_start(ap, fmt);
  int m = std::vsnprintf(buf + n, sizeof(buf) - static_cast<size_t>(n) - 1, fmt, ap);
  va_end(ap);
  size_t len = static_cast<size_t>(n) + static_cast<size_t>(m < 0 ? 0 : m);
  if (len > sizeof(buf) - 2) len = sizeof(buf) - 2;
  buf[len++] = '\n';
  [[maybe_unused]] ssize_t r = ::write(2, buf, len);
}

}  // namespace base
