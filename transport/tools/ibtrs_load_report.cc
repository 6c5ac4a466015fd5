// ibtrs-load's report: the --interval-ms lines while the client runs and what it prints at the
// end (text, then the --json line that bench/ and tests/netns read).
#include <cinttypes>
#include <cstdio>

#include "ibtrs_load.h"

namespace ibtrs_load {

void print_interval(uint64_t inflight, ibtrs::ClientSession& s, double elapsed, uint64_t dops, double dt) {
  std::string line;
  char buf[128];
  std::snprintf(buf, sizeof(buf), "interval %.3fs iops %.0f inflight %" PRIu64, elapsed,
                dt > 0 ? static_cast<double>(dops) / dt : 0.0, inflight);
  line = buf;
  for (const auto& p : s.paths()) {
    std::snprintf(buf, sizeof(buf), " | %s %s ops %" PRIu64, p.name.c_str(),
                  std::string(ibtrs::to_string(p.state)).c_str(), p.stats.read_cnt + p.stats.write_cnt);
    line += buf;
  }
  say("%s", line.c_str());
}

void print_report(const ClientConfig& c, const RunResult& r) {
  const uint64_t ops = r.ops;
  const double secs = r.secs;
  const LatHist& lat = r.lat;
  const std::vector<ibtrs::ClientPathInfo>& paths = r.paths;
  const double iops = static_cast<double>(ops) / secs;
  const double mibs = mib(r.bytes) / secs;
  auto us = [](uint64_t ns) { return static_cast<double>(ns) / 1000.0; };
  say("%s bs %" PRIu64 " qd %u: %" PRIu64 " ops in %.3f s: %.0f IOPS, %.1f MiB/s", c.rw_name.c_str(), c.bs, c.qd, ops,
      secs, iops, mibs);
  say("latency us: p50 %.1f p99 %.1f p99.9 %.1f max %.1f; longest pause between completions %.3f ms",
      us(lat.percentile(0.5)), us(lat.percentile(0.99)), us(lat.percentile(0.999)), us(lat.max()),
      static_cast<double>(r.max_pause_ns) / 1e6);
  say("errors %" PRIu64 ", verify errors %" PRIu64, r.errors, r.verify_errors);
  for (const auto& p : paths)
    say("path %s %s: %s, failovered %" PRIu64 ", reconnects %" PRIu64 " ok %" PRIu64 " failed", p.name.c_str(),
        std::string(ibtrs::to_string(p.state)).c_str(), stats_text(p.stats).c_str(), p.stats.failovered,
        p.stats.reconnects_ok, p.stats.reconnects_failed);

  if (c.json) {
    std::string j;
    char buf2[512];
    std::snprintf(buf2, sizeof(buf2),
                  "{\"rw\":%s,\"bs\":%" PRIu64 ",\"qd\":%u,\"seconds\":%.3f,\"ops\":%" PRIu64 ",\"iops\":%.1f,"
                  "\"mib_s\":%.2f,\"errors\":%" PRIu64 ",\"verify_errors\":%" PRIu64 ",\"lat_p50_us\":%.1f,"
                  "\"lat_p99_us\":%.1f,\"lat_p999_us\":%.1f,\"lat_max_us\":%.1f,\"max_pause_ms\":%.3f,"
                  "\"open_ms\":%.3f,\"paths\":[",
                  json_str(c.rw_name).c_str(), c.bs, c.qd, secs, ops, iops, mibs, r.errors, r.verify_errors,
                  us(lat.percentile(0.5)), us(lat.percentile(0.99)), us(lat.percentile(0.999)), us(lat.max()),
                  static_cast<double>(r.max_pause_ns) / 1e6, r.open_ms);
    j = buf2;
    for (size_t i = 0; i < paths.size(); ++i) {
      const auto& p = paths[i];
      std::snprintf(buf2, sizeof(buf2),
                    "%s{\"name\":%s,\"state\":%s,\"reads\":%" PRIu64 ",\"writes\":%" PRIu64 ",\"failovered\":%" PRIu64
                    ",\"reconnects_ok\":%" PRIu64 ",\"tls\":%s}",
                    i ? "," : "", json_str(p.name).c_str(), json_str(ibtrs::to_string(p.state)).c_str(),
                    p.stats.read_cnt, p.stats.write_cnt, p.stats.failovered, p.stats.reconnects_ok,
                    json_str(ibtrs::tls::describe(p.tls)).c_str());
      j += buf2;
    }
    j += "]}";
    say("%s", j.c_str());
  }
}

}  // namespace ibtrs_load
