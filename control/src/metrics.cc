#include "control/metrics.h"

#include <unistd.h>

#include <charconv>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <cstdlib>

#ifndef IBNBD_VERSION
#error "IBNBD_VERSION is set by control/CMakeLists.txt (the project's version)"
#endif

namespace ibnbd::control::metrics {
namespace {

void append_number(std::string& out, uint64_t v) {
  char buf[24];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  out.append(buf, r.ptr);
}

// The shortest text that reads back as `v` (Go's ParseFloat, which Prometheus uses, takes it).
void append_number(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "NaN";
  } else if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
  } else {
    char buf[32];
    auto r = std::to_chars(buf, buf + sizeof(buf), v);
    out.append(buf, r.ptr);
  }
}

// Bytes [p, end) start a valid UTF-8 sequence of the returned length, or 0.
size_t utf8_length(const unsigned char* p, const unsigned char* end) {
  const unsigned char c = p[0];
  size_t n;
  uint32_t min;
  if (c < 0x80) return 1;
  if ((c & 0xe0) == 0xc0) n = 2, min = 0x80;
  else if ((c & 0xf0) == 0xe0) n = 3, min = 0x800;
  else if ((c & 0xf8) == 0xf0) n = 4, min = 0x10000;
  else return 0;
  if (static_cast<size_t>(end - p) < n) return 0;
  uint32_t cp = c & (0x7f >> n);
  for (size_t i = 1; i < n; ++i) {
    if ((p[i] & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (p[i] & 0x3f);
  }
  // Overlong forms, surrogates and code points beyond Unicode are not UTF-8.
  if (cp < min || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return 0;
  return n;
}

void append_labels(std::string& out, const Labels& labels, std::string_view le = {}) {
  if (labels.empty() && le.empty()) return;
  out += '{';
  bool first = true;
  for (auto& [k, v] : labels) {
    if (!first) out += ',';
    first = false;
    out.append(k);
    out += "=\"";
    out += escape_label_value(v);
    out += '"';
  }
  if (!le.empty()) {
    if (!first) out += ',';
    out += "le=\"";
    out.append(le);
    out += '"';
  }
  out += '}';
}

// One sample line: NAME[SUFFIX]{LABELS[,le]} VALUE.
template <typename V>
void append_sample(std::string& out, std::string_view name, std::string_view suffix, const Labels& labels, V v,
                   std::string_view le = {}) {
  out.append(name);
  out.append(suffix);
  append_labels(out, labels, le);
  out += ' ';
  append_number(out, v);
  out += '\n';
}

// HELP text escapes backslash and newline only.
std::string escape_help(std::string_view h) {
  std::string out;
  for (char c : h) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

// A small /proc file's text ("" when it cannot be read).
std::string read_proc(const char* path) {
  std::string out;
  if (std::FILE* f = std::fopen(path, "re")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0 && out.size() < (1u << 20)) out.append(buf, n);
    std::fclose(f);
  }
  return out;
}

// The kernel's process start, in seconds since the epoch: /proc/self/stat's starttime (clock
// ticks since boot, field 22) plus /proc/stat's btime. 0 when /proc says nothing (the sample is
// then left out).
double process_start_time() {
  static const double t = [] {
    const std::string stat = read_proc("/proc/self/stat");
    // Field 2 (comm) may hold spaces and parentheses: count the fields after its last ')'.
    size_t pos = stat.rfind(')');
    if (pos == std::string::npos) return 0.0;
    ++pos;  // the space before field 3; then the one before each next field, up to 22
    for (int field = 3; field < 22 && pos != std::string::npos; ++field) pos = stat.find(' ', pos + 1);
    if (pos == std::string::npos) return 0.0;
    const unsigned long long start_ticks = std::strtoull(stat.c_str() + pos + 1, nullptr, 10);
    const std::string proc = read_proc("/proc/stat");
    const size_t b = proc.find("\nbtime ");
    if (b == std::string::npos) return 0.0;
    const unsigned long long btime = std::strtoull(proc.c_str() + b + 7, nullptr, 10);
    const long hz = ::sysconf(_SC_CLK_TCK);
    if (btime == 0 || start_ticks == 0 || hz <= 0) return 0.0;
    return static_cast<double>(btime) + static_cast<double>(start_ticks) / static_cast<double>(hz);
  }();
  return t;
}

}  // namespace

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  auto* p = reinterpret_cast<const unsigned char*>(v.data());
  auto* end = p + v.size();
  while (p < end) {
    const size_t n = utf8_length(p, end);
    if (n == 0) {
      out += "\xef\xbf\xbd";  // U+FFFD
      ++p;
      continue;
    }
    if (*p == '\\') out += "\\\\";
    else if (*p == '"') out += "\\\"";
    else if (*p == '\n') out += "\\n";
    else out.append(reinterpret_cast<const char*>(p), n);
    p += n;
  }
  return out;
}

std::string& Exposition::samples(std::string_view name, std::string_view help, std::string_view type) {
  auto it = index_.find(name);
  if (it != index_.end()) return families_[it->second].samples;
  index_.emplace(std::string(name), families_.size());
  Family& f = families_.emplace_back();
  f.head = "# HELP " + std::string(name) + " " + escape_help(help) + "\n# TYPE " + std::string(name) + " " +
           std::string(type) + "\n";
  return f.samples;
}

void Exposition::counter(std::string_view name, std::string_view help, const Labels& labels, uint64_t v) {
  append_sample(samples(name, help, "counter"), name, "", labels, v);
}

void Exposition::gauge(std::string_view name, std::string_view help, const Labels& labels, double v) {
  append_sample(samples(name, help, "gauge"), name, "", labels, v);
}

void Exposition::histogram(std::string_view name, std::string_view help, const Labels& labels,
                           std::span<const double> bounds, std::span<const uint64_t> counts, double sum) {
  std::string& out = samples(name, help, "histogram");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    cumulative += counts[i];
    std::string le;
    if (i < bounds.size()) append_number(le, bounds[i]);
    else le = "+Inf";
    append_sample(out, name, "_bucket", labels, cumulative, le);
    if (i >= bounds.size()) break;  // one +Inf bucket, whatever counts holds beyond it
  }
  append_sample(out, name, "_sum", labels, sum);
  append_sample(out, name, "_count", labels, cumulative);
}

std::string Exposition::str() const {
  std::string out;
  size_t n = 0;
  for (auto& f : families_) n += f.head.size() + f.samples.size();
  out.reserve(n);
  for (auto& f : families_) {
    out += f.head;
    out += f.samples;
  }
  return out;
}

void daemon_info(Exposition& e, std::string_view daemon) {
  e.gauge("ibnbd_build_info", "The daemon and its version (always 1).",
          {{"daemon", daemon}, {"version", IBNBD_VERSION}}, 1);
  if (const double t = process_start_time(); t > 0)
    e.gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", {}, t);
}

void path_stats(Exposition& e, const Labels& labels, const ibtrs::PathStatsSnapshot& s) {
  auto with = [&](std::string_view k, std::string_view v) {
    Labels l = labels;
    l.emplace_back(k, v);
    return l;
  };
  const Labels rd = with("direction", "read"), wr = with("direction", "write");
  e.counter("ibnbd_path_bytes_total", "Bytes of the requests sent over the path (stats/rdma).", rd, s.read_bytes);
  e.counter("ibnbd_path_bytes_total", "", wr, s.write_bytes);
  e.counter("ibnbd_path_ios_total", "Requests sent over the path (stats/rdma).", rd, s.read_cnt);
  e.counter("ibnbd_path_ios_total", "", wr, s.write_cnt);
  e.gauge("ibnbd_path_inflight", "Requests in flight on the path.", labels, static_cast<double>(s.inflight));
  e.counter("ibnbd_path_failovers_total", "Requests the path handed to another path.", labels, s.failovered);
  e.counter("ibnbd_path_reconnects_total", "Reconnections of the path by result (stats/reconnects).",
            with("result", "ok"), s.reconnects_ok);
  e.counter("ibnbd_path_reconnects_total", "", with("result", "failed"), s.reconnects_failed);

  // Bucket b holds [2^b, 2^(b+1)) microseconds (bucket 0 from 0), the last one the rest: the
  // bounds are 2^(b+1) us for every bucket but the last, which is +Inf.
  static const auto bounds = [] {
    std::array<double, ibtrs::kLatBuckets - 1> b{};
    for (size_t i = 0; i < b.size(); ++i) b[i] = std::ldexp(1e-6, static_cast<int>(i + 1));
    return b;
  }();
  const char* lat_help = "Request latency on the path (stats/rdma_lat): submission to completion.";
  e.histogram("ibnbd_path_latency_seconds", lat_help, rd, bounds, s.lat_read,
              static_cast<double>(s.lat_sum_read_ns) / 1e9);
  e.histogram("ibnbd_path_latency_seconds", lat_help, wr, bounds, s.lat_write,
              static_cast<double>(s.lat_sum_write_ns) / 1e9);
  e.gauge("ibnbd_path_latency_max_seconds", "The longest request latency since the last reset.", rd,
          static_cast<double>(s.lat_max_read_ns) / 1e9);
  e.gauge("ibnbd_path_latency_max_seconds", "", wr, static_cast<double>(s.lat_max_write_ns) / 1e9);
  e.counter("ibnbd_path_polls_total", "Completion-queue polls that returned completions (stats/wc_completion).",
            labels, s.polls);
  e.counter("ibnbd_path_polled_completions_total", "Completions those polls returned.", labels,
            s.polled_completions);
  e.counter("ibnbd_path_thread_migrations_total",
            "Requests completed on another IO thread than the one that submitted them (stats/cpu_migration).",
            labels, s.thread_migrations);
  for (size_t i = 0; i < s.sg_entries.size(); ++i) {
    const std::string n = std::to_string(i) + (i + 1 == s.sg_entries.size() ? "+" : "");
    e.counter("ibnbd_path_sg_requests_total", "Requests by the length of their scatter-gather list (stats/sg_entries).",
              with("entries", n), s.sg_entries[i]);
  }
}

void state_set(Exposition& e, std::string_view name, std::string_view help, const Labels& labels,
               std::string_view current, std::span<const std::string_view> states) {
  for (std::string_view st : states) {
    Labels l = labels;
    l.emplace_back("state", st);
    e.gauge(name, help, l, st == current ? 1 : 0);
  }
}

}  // namespace ibnbd::control::metrics
