#include "server_metrics.h"

#include <array>

#include "control/metrics.h"

namespace ibnbd {
namespace {

namespace metrics = control::metrics;
using control::metrics::Exposition;
using control::metrics::Labels;

// A session's or a device's block requests (BlockStats) under ibnbd_server_<what>_*.
void block_stats(Exposition& e, const std::string& what, const Labels& labels, const BlockStats& s) {
  auto with = [&](std::string_view k, std::string_view v) {
    Labels l = labels;
    l.emplace_back(k, v);
    return l;
  };
  const std::string p = "ibnbd_server_" + what;
  e.counter(p + "_bytes_total", "Bytes read and written by the " + what + "'s requests.", with("direction", "read"),
            s.read_bytes);
  e.counter(p + "_bytes_total", "", with("direction", "write"), s.write_bytes);
  const std::pair<const char*, uint64_t> ops[] = {{"read", s.read_ops},   {"write", s.write_ops},
                                                  {"flush", s.flush_ops}, {"discard", s.discard_ops},
                                                  {"write_zeroes", s.write_zeroes_ops}};
  for (auto& [op, n] : ops) e.counter(p + "_ios_total", "Block requests of the " + what + " by operation.", with("op", op), n);
  e.counter(p + "_errors_total", "Block requests of the " + what + " that failed.", labels, s.errors);
  e.gauge(p + "_inflight", "Block requests of the " + what + " in flight.", labels, static_cast<double>(s.inflight));
}

}  // namespace

std::string server_metrics(const BlockServer& srv) {
  Exposition e;
  control::metrics::daemon_info(e, "server");

  static constexpr std::array<std::string_view, 4> kPathStates = {"connecting", "connected", "closing", "closed"};
  const auto sessions = srv.sessions();
  for (const BlockSessionInfo& s : sessions) {
    const Labels sl = {{"session", s.name}};
    block_stats(e, "session", sl, s.stats);
    e.gauge("ibnbd_server_session_open_devices", "Devices the session holds open.", sl,
            static_cast<double>(s.devices.size()));
    e.gauge("ibnbd_server_session_paths", "Paths of the session.", sl, static_cast<double>(s.paths.size()));
    for (const ibtrs::ServerPathInfo& p : s.paths) {
      const Labels pl = {{"session", s.name}, {"path", p.name}};
      control::metrics::path_stats(e, pl, p.stats);
      control::metrics::state_set(e, "ibnbd_path_state", "The path's state (1 for the current one).", pl,
                         ibtrs::to_string(p.state), kPathStates);
    }
  }
  for (const ExportedDeviceInfo& d : srv.devices()) {
    const Labels dl = {{"device", d.name}};
    block_stats(e, "device", dl, d.stats);
    e.gauge("ibnbd_server_device_size_bytes", "Size of the open device.", dl, static_cast<double>(d.size));
    e.gauge("ibnbd_server_device_sessions", "Sessions that hold the device open.", dl,
            static_cast<double>(d.holders.size()));
  }

  const AuthStats a = srv.auth_stats();
  e.counter("ibnbd_server_paths_authenticated_total", "Paths that proved their host's secret.", {},
            a.transport.authenticated);
  e.counter("ibnbd_server_paths_anonymous_total", "Paths admitted without credentials (allow_any_host).", {},
            a.transport.anonymous);
  const std::pair<const char*, uint64_t> auth[] = {{"no_credentials", a.transport.refused_no_credentials},
                                                   {"unknown_host", a.transport.refused_unknown_host},
                                                   {"bad_response", a.transport.refused_bad_response},
                                                   {"host_mismatch", a.transport.refused_host_mismatch},
                                                   {"protocol", a.transport.refused_protocol}};
  for (auto& [reason, n] : auth)
    e.counter("ibnbd_server_auth_failures_total", "Paths refused by host authentication, by reason.",
              {{"reason", reason}}, n);
  e.counter("ibnbd_server_open_refusals_total", "OPENs refused by the hosts' access rules (EACCES: the device, "
            "EPERM: the mode).", {{"reason", "eacces"}}, a.open_refused_eacces);
  e.counter("ibnbd_server_open_refusals_total", "", {{"reason", "eperm"}}, a.open_refused_eperm);
  for (const ibtrs::RefusalCount& r : srv.refusals().snapshot())
    e.counter("ibnbd_server_refusals_total", "Peers refused or cut off by the server's bounds, by reason "
              "(ibnbd server refusals).", {{"reason", r.reason}}, r.count);

  const ibtrs::ServerOptions& t = srv.transport_options();
  const ibtrs::ServerUsage u = srv.usage();
  e.gauge("ibnbd_server_sessions", "Live sessions, half-open ones included.", {}, u.sessions);
  e.gauge("ibnbd_server_handshaking_sessions", "Live sessions with no path connected.", {}, u.handshaking_sessions);
  e.gauge("ibnbd_server_paths", "Paths connecting or connected.", {}, u.paths);
  e.gauge("ibnbd_server_chunk_memory_bytes", "Chunk memory reserved by the sessions.", {},
          static_cast<double>(u.chunk_memory));
  e.gauge("ibnbd_server_chunk_resident_bytes", "Of the chunk memory, the bytes in RAM now.", {},
          static_cast<double>(u.chunk_resident));
  e.gauge("ibnbd_server_response_backlog", "Responses waiting for send-queue room.", {}, static_cast<double>(u.backlog));
  e.gauge("ibnbd_server_held_connects", "Connection requests held until the session they would replace has drained "
          "(--drain-hold-ms).", {}, u.held_connects);
  e.counter("ibnbd_server_path_fences_answered_total",
            "PATH_FENCE messages answered (the failover fence, docs/protocol.md).", {}, u.fences_answered);
  e.counter("ibnbd_server_path_fences_closed_total",
            "Of the PATH_FENCE messages answered, those that closed a live path incarnation.", {}, u.fences_closed);
  e.gauge("ibnbd_server_max_sessions", "The cap on sessions (--max-sessions).", {}, t.max_sessions);
  e.gauge("ibnbd_server_max_chunk_memory_bytes", "The cap on chunk memory (--max-chunk-memory).", {},
          static_cast<double>(t.max_chunk_memory));

  for (const ibtrs::IoThreadWaitStats& w : srv.io_thread_stats()) {
    const std::string thread = std::to_string(w.thread);
    const Labels tl = {{"thread", thread}};
    e.counter("ibnbd_server_io_thread_sleeps_total", "Sleeps of the IO thread waiting for work (epoll_wait).", tl,
              w.sleeps);
    const std::pair<const char*, uint64_t> spins[] = {
        {"caught", w.spins_caught}, {"missed", w.spins_missed}, {"preempted", w.spins_preempted}};
    for (auto& [result, n] : spins)
      e.counter("ibnbd_server_io_thread_spins_total", "Spins of the IO thread (--poll adaptive) by result.",
                {{"thread", thread}, {"result", result}}, n);
  }
  return e.str();
}

}  // namespace ibnbd
