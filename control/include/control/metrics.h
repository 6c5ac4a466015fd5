// The daemons' Prometheus metrics (--metrics-listen): the text exposition format 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/) written by Exposition, and the
// families both daemons share: build info, process start time, and a path's counters
// (ibtrs::PathStatsSnapshot, the numbers of the kernel's stats/ files) with its latency
// histogram. The HTTP side is metrics_http.h; each daemon adds its own families (server/src/server_metrics.cc,
// client/daemon/client_daemon_metrics.cc).
//
// Names follow Prometheus' conventions: the ibnbd_ prefix, base units (bytes, seconds), counters
// ending in _total; labels name the session, path, device and direction. Values from peers
// (session and device names) are label values only: escaped here, never part of a name.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ibtrs/types.h"

namespace ibnbd::control::metrics {

using Label = std::pair<std::string_view, std::string_view>;
using Labels = std::vector<Label>;

// One scrape's text. Samples of a family may be added in any order: each family is written as
// one group (HELP, TYPE, its samples in the order added), as the format requires, families in
// the order of their first sample. Not thread-safe: one per scrape.
class Exposition {
 public:
  // `name` ends in _total. The first call of a name fixes its help and type.
  void counter(std::string_view name, std::string_view help, const Labels& labels, uint64_t v);
  void gauge(std::string_view name, std::string_view help, const Labels& labels, double v);
  // `counts[i]` (not cumulative) counts observations <= bounds[i] and above the bound before;
  // counts has one more element than bounds: the observations above the last bound (+Inf).
  // Written as _bucket{le=...} (cumulative, +Inf last and equal to _count), _sum and _count.
  void histogram(std::string_view name, std::string_view help, const Labels& labels,
                 std::span<const double> bounds, std::span<const uint64_t> counts, double sum);

  std::string str() const;

 private:
  struct Family {
    std::string head;     // # HELP and # TYPE
    std::string samples;  // one line each
  };
  std::string& samples(std::string_view name, std::string_view help, std::string_view type);
  std::vector<Family> families_;
  std::map<std::string, size_t, std::less<>> index_;
};

// The label value as the format escapes it: backslash, double quote and newline; bytes that are
// not UTF-8 become U+FFFD (the format is UTF-8; a peer's name may be anything).
std::string escape_label_value(std::string_view v);

// ibnbd_build_info{daemon=..., version=...} 1 and process_start_time_seconds (the standard
// name of Prometheus' client libraries, so dashboards that compute uptime find it).
void daemon_info(Exposition& e, std::string_view daemon);

// A path's counters under ibnbd_path_* with `labels` (session, path) and a direction label where
// the counter has one: bytes, IOs, inflight, failovers, reconnects, the latency histogram
// (seconds; the transport's power-of-two microsecond buckets as bounds), its maxima, polls and
// sg-list sizes.
void path_stats(Exposition& e, const Labels& labels, const ibtrs::PathStatsSnapshot& s);

// ibnbd_path_state{..., state=S} 1 for the path's state and 0 for every other state name in
// `states`, so that a query can select any state without knowing which ones were seen.
void state_set(Exposition& e, std::string_view name, std::string_view help, const Labels& labels,
               std::string_view current, std::span<const std::string_view> states);

}  // namespace ibnbd::control::metrics
