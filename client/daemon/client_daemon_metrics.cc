// ClientDaemon::metrics: the daemon's stats commands (device_list, session_list, path_stats,
// nbd_list) as Prometheus metrics (client/README.md, "Metrics"), read from the same snapshots.
#include <array>

#include "client_daemon.h"
#include "control/metrics.h"

namespace ibnbd {

std::optional<std::string> ClientDaemon::metrics() {
  // Commands hold mu_ while they run; a long one (a map waiting out its connect timeout, device
  // io) makes the scrape fail (503) rather than queue the exporter behind it.
  std::unique_lock l(mu_, kMetricsWait);
  if (!l.owns_lock()) return std::nullopt;
  namespace metrics = control::metrics;
  using control::metrics::Labels;
  control::metrics::Exposition e;
  control::metrics::daemon_info(e, "client");

  static constexpr std::array<std::string_view, 7> kPathStates = {
      "connecting", "connecting_err", "reconnecting", "connected", "closing", "closed", "dead"};
  for (auto& [name, s] : sessions_) {
    const Labels sl = {{"session", name}};
    const auto paths = s.s->transport().paths();
    e.gauge("ibnbd_client_session_paths", "Paths of the session.", sl, static_cast<double>(paths.size()));
    e.gauge("ibnbd_client_session_devices", "Devices mapped through the session.", sl,
            static_cast<double>(s.s->devices().size()));
    for (const ibtrs::ClientPathInfo& p : paths) {
      const Labels pl = {{"session", name}, {"path", p.name}};
      control::metrics::path_stats(e, pl, p.stats);
      control::metrics::state_set(e, "ibnbd_path_state", "The path's state (1 for the current one).", pl,
                         ibtrs::to_string(p.state), kPathStates);
      if (p.latency)
        e.gauge("ibnbd_path_heartbeat_rtt_seconds", "The path's last heartbeat round trip.", pl,
                static_cast<double>(p.latency->count()) / 1e9);
      // The failover fence (docs/protocol.md; stats/fence): reset with the path's other counters.
      e.counter("ibnbd_path_fence_waited_total",
                "Requests failed over from a broken incarnation of the path that waited for its fence.", pl,
                p.fence.waited);
      e.counter("ibnbd_path_fences_total", "Incarnations of the path confirmed fenced.", pl, p.fence.fenced);
      e.gauge("ibnbd_path_fence_rtt_seconds",
              "The last fence's round trip, from the first waiting request to the confirmation.", pl,
              static_cast<double>(p.fence.last_rtt.count()) / 1e9);
      e.gauge("ibnbd_path_fence_rtt_max_seconds", "The longest fence round trip since the last reset.", pl,
              static_cast<double>(p.fence.max_rtt.count()) / 1e9);
    }
  }

  // One series per device: a failover device's legs are in both sessions' lists and counted
  // once, under the failover device.
  auto device = [&](const std::string& session, const RemoteDevice& d) {
    const auto fi = d.failover();
    const std::string& sess = fi ? fi->active : session;
    const Labels dl = {{"device", d.name()}, {"session", sess}};
    auto with = [&](std::string_view k, std::string_view v) {
      Labels x = dl;
      x.emplace_back(k, v);
      return x;
    };
    const DeviceStats st = d.stats();
    e.counter("ibnbd_client_device_bytes_total", "Bytes of the device's requests.", with("direction", "read"),
              st.read_bytes);
    e.counter("ibnbd_client_device_bytes_total", "", with("direction", "write"), st.write_bytes);
    const std::pair<const char*, uint64_t> ops[] = {{"read", st.reads}, {"write", st.writes}, {"flush", st.flushes},
                                                    {"discard", st.discards}, {"write_zeroes", st.write_zeroes}};
    for (auto& [op, n] : ops)
      e.counter("ibnbd_client_device_ios_total", "Requests to the device by operation.", with("op", op), n);
    e.counter("ibnbd_client_device_errors_total", "Requests to the device completed with an error.", dl, st.errors);
    e.counter("ibnbd_client_device_remaps_total", "Successful re-opens of the device.", dl, st.remaps);
    e.counter("ibnbd_client_device_enodev_retries_total", "Parts sent again after an ENODEV and a remap.", dl,
              st.enodev_retries);
    e.counter("ibnbd_client_device_resizes_total", "New sizes announced by the server.", dl, st.resizes);
    e.gauge("ibnbd_client_device_inflight", "Requests to the device in flight.", dl, st.inflight);
    e.gauge("ibnbd_client_device_size_bytes", "Size of the device.", dl, static_cast<double>(d.size_bytes()));
    if (fi) e.counter("ibnbd_client_device_failovers_total", "Failovers of the device to its standby.", dl, fi->failovers);
  };
  for (auto& [n, s] : sessions_)
    for (auto& d : s.s->devices())
      if (!failover_.count(d->name())) device(n, *d);
  for (auto& [n, f] : failover_) device("", *f.dev);

  for (auto& [dev, x] : exports_) {
    const Labels xl = {{"device", dev}, {"export", x.name}};
    const nbd::NbdServerStats st = x.server->stats();
    e.gauge("ibnbd_client_nbd_connections", "NBD connections to the export open now.", xl, st.connections);
    e.counter("ibnbd_client_nbd_requests_total", "NBD requests the export answered.", xl, st.requests);
    e.counter("ibnbd_client_nbd_errors_total", "NBD requests answered with an error.", xl, st.errors);
    Labels rd = xl, wr = xl;
    rd.emplace_back("direction", "read");
    wr.emplace_back("direction", "write");
    e.counter("ibnbd_client_nbd_bytes_total", "NBD data read and written.", rd, st.read_bytes);
    e.counter("ibnbd_client_nbd_bytes_total", "", wr, st.write_bytes);
  }
  return e.str();
}

}  // namespace ibnbd
