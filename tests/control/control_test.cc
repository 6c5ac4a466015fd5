// control/ (library ibnbd_control): the client daemon's devices, sessions and paths and the
// server daemon's devices and refusals as types and their JSON (byte for byte what the sockets
// answered before the types existed), the command codec, and the control socket's two sides
// talking over a real unix socket.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "control/client.h"
#include "control/client_devices.h"
#include "control/client_sessions.h"
#include "control/command.h"
#include "control/daemon.h"
#include "control/server_reports.h"
#include "control/socket.h"
#include "base/unique_fd.h"
#include "control/stats.h"
#include "ibtrs/tls.h"

namespace ibnbd::control {
namespace {

using nlohmann::json;

DeviceReport sample() {
  DeviceReport d;
  d.device = "sub/b.img";
  d.session = "s1";
  d.access_mode = "rw";
  d.size = 8u << 20;
  d.state = "open";
  d.device_id = 3;
  d.rx_bytes = 4096;
  d.tx_bytes = 512;
  d.inflight = 2;
  d.errors = 1;
  d.remaps = 4;
  d.ublk = "/dev/ublkb0";
  d.failovers = 5;
  return d;
}

// Case: one device, listed and shown (a ublk device of known size). Expect: the JSON the daemon
// wrote before its answers were typed, to the byte (the CLI and scripts read it).
TEST(DeviceListing, IsTheSocketsAnswerByteForByte) {
  DeviceReport d = sample();
  EXPECT_EQ(device_listing({d}, false).dump(),
            R"({"columns":[{"name":"device","right":false},{"name":"session","right":false},)"
            R"({"name":"access_mode","right":false},{"name":"size","right":true},{"name":"state","right":false},)"
            R"({"name":"device_id","right":true},{"name":"rx_bytes","right":true},{"name":"tx_bytes","right":true},)"
            R"({"name":"inflights","right":true},{"name":"errors","right":true},{"name":"remaps","right":true},)"
            R"({"name":"nbd","right":false},{"name":"ublk","right":false},{"name":"standby","right":false},)"
            R"({"name":"standby_state","right":false},{"name":"failovers","right":true}],"ok":true,)"
            R"("rows":[["sub/b.img","s1","rw",{"bytes":8388608},"open",3,{"bytes":4096},{"bytes":512},2,1,4,"",)"
            R"("/dev/ublkb0","-","-",5]]})");
  d.detail = DeviceReport::Detail{7, 6, 1, 2, std::nullopt, 250, 9, 1};
  const json shown = device_listing({d}, true);
  EXPECT_EQ(shown["columns"].size(), 24u);
  EXPECT_EQ(shown["columns"][20].dump(), R"({"name":"ublk_size","right":true})");
  EXPECT_EQ(shown["rows"][0].dump(),
            R"(["sub/b.img","s1","rw",{"bytes":8388608},"open",3,{"bytes":4096},{"bytes":512},2,1,4,"",)"
            R"("/dev/ublkb0","-","-",5,7,6,1,2,"-",250,9,1])");
  d.detail->ublk_size = 4096;
  EXPECT_EQ(device_listing({d}, true)["rows"][0][20].dump(), R"({"bytes":4096})");
  // No devices: an empty list of rows, not null.
  EXPECT_EQ(device_listing({}, false)["rows"].dump(), "[]");
}

// Case: the listing read back, from the daemon's JSON and from a hand-written answer with fewer
// columns in another order and signed numbers (sysfs-emu's tests' fake daemon). Expect: the same
// reports; a missing column keeps its default.
TEST(DeviceListing, ReadsBackByColumnName) {
  DeviceReport d = sample();
  d.standby = "s2";
  d.standby_state = "ready";
  d.detail = DeviceReport::Detail{7, 6, 1, 2, 4096, 250, 9, 1};
  auto back = devices_from_listing(device_listing({d, d}, true));
  ASSERT_TRUE(back.ok());
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ(device_listing(*back, true).dump(), device_listing({d, d}, true).dump());

  const json hand = {{"ok", true},
                     {"columns", json::array({{{"name", "ublk"}}, {{"name", "failovers"}}, {{"name", "device"}},
                                              {{"name", "size"}}})},
                     {"rows", json::array({json::array({"/dev/ublkb3", 1, "x", {{"bytes", 1024}}})})}};
  auto h = devices_from_listing(hand);
  ASSERT_TRUE(h.ok());
  ASSERT_EQ(h->size(), 1u);
  EXPECT_EQ((*h)[0].device, "x");
  EXPECT_EQ((*h)[0].ublk, "/dev/ublkb3");
  EXPECT_EQ((*h)[0].failovers, 1u);
  EXPECT_EQ((*h)[0].size, 1024u);
  EXPECT_EQ((*h)[0].state, "");
  EXPECT_EQ((*h)[0].standby, "-");
  EXPECT_FALSE((*h)[0].detail.has_value());
}

// Case: answers that are not listings, and cells of the wrong type. Expect: EINVAL each, no throw.
TEST(DeviceListing, RefusesTheWrongShape) {
  const json cols = json::array({{{"name", "device"}}, {{"name", "errors"}}, {{"name", "size"}}});
  for (const json& bad : {json("x"), json{{"ok", true}}, json{{"columns", 1}, {"rows", json::array()}},
                          json{{"columns", json::array({1})}, {"rows", json::array()}},
                          json{{"columns", cols}, {"rows", json::array({1})}},
                          json{{"columns", cols}, {"rows", json::array({json::array({"d", -1})})}},
                          json{{"columns", cols}, {"rows", json::array({json::array({"d", "many"})})}},
                          json{{"columns", cols}, {"rows", json::array({json::array({"d", 0, {{"bytes", "x"}}})})}},
                          json{{"columns", cols}, {"rows", json::array({json::array({"d", 0, json::object()})})}}}) {
    auto r = devices_from_listing(bad);
    ASSERT_FALSE(r.ok()) << bad.dump();
    EXPECT_EQ(r.error(), std::errc::invalid_argument) << bad.dump();
  }
}

// ---- sessions and paths ----

SessionReport sample_session() {
  SessionReport s;
  s.name = "s1";
  s.path_cnt = 2;
  s.act_path_cnt = 1;
  s.state = "connected";
  s.path_uu = "U_";
  s.mp = "min-inflight";
  s.rx_bytes = 4096;
  s.tx_bytes = 512;
  s.inflight = 3;
  s.reconnects = 4;
  s.devices = 1;
  return s;
}

PathReport sample_path() {
  PathReport p;
  p.session = "s1";
  p.name = "ip:0.0.0.0@ip:10.0.0.1";
  p.state = "connected";
  p.fabric = "rdma";
  p.hca_name = "rxe0";
  p.hca_port = 1;
  p.src_addr = "";
  p.dst_addr = "rdma:10.0.0.1:1234";
  p.src_host = "ip:0.0.0.0";
  p.dst_host = "ip:10.0.0.1";
  p.dst_port = 1234;
  p.latency = std::chrono::nanoseconds(1500);
  p.auth = "authenticated";
  p.auth_host = "h";
  p.auth_bidirectional = true;
  p.auth_method = "dhchap-sha256-x25519";
  p.inflight = 2;
  p.stats.read_bytes = 8192;
  p.stats.write_bytes = 4096;
  p.stats.reconnects_ok = 5;
  p.fence.waited = 7;
  p.fence.fenced = 1;
  p.fence.last_rtt = std::chrono::nanoseconds(2'500'000);
  return p;
}

// Case: a session listed, a path listed, a path's stats. Expect: the JSON the daemon wrote
// before its answers were typed, to the byte (the CLI, scripts and sysfs-emu read it).
TEST(SessionListing, IsTheSocketsAnswerByteForByte) {
  EXPECT_EQ(session_listing({sample_session()}).dump(),
            R"({"columns":[{"name":"sessname","right":false},{"name":"path_cnt","right":true},)"
            R"({"name":"act_path_cnt","right":true},{"name":"state","right":false},{"name":"path_uu","right":false},)"
            R"({"name":"mp","right":false},{"name":"rx_bytes","right":true},{"name":"tx_bytes","right":true},)"
            R"({"name":"inflights","right":true},{"name":"reconnects","right":true},{"name":"devices","right":true}],)"
            R"("ok":true,"rows":[["s1",2,1,"connected","U_","min-inflight",{"bytes":4096},{"bytes":512},3,4,1]]})");
  EXPECT_EQ(session_listing({})["rows"].dump(), "[]");
  EXPECT_EQ(path_listing({sample_path()}).dump(),
            R"({"columns":[{"name":"sessname","right":false},{"name":"pathname","right":false},)"
            R"({"name":"src_addr","right":false},{"name":"dst_addr","right":false},{"name":"hca_name","right":false},)"
            R"({"name":"hca_port","right":true},{"name":"state","right":false},{"name":"auth","right":false},)"
            R"({"name":"host","right":false},{"name":"tls","right":false},{"name":"rx_bytes","right":true},)"
            R"({"name":"tx_bytes","right":true},{"name":"inflights","right":true},{"name":"reconnects","right":true},)"
            R"({"name":"cur_latency_ns","right":true},{"name":"last_error","right":false},)"
            R"({"name":"fence_waited","right":true},{"name":"fenced","right":true},{"name":"fence_rtt_us","right":true}],)"
            R"("ok":true,"rows":[["s1","ip:0.0.0.0@ip:10.0.0.1","","rdma:10.0.0.1:1234","rxe0",1,"connected",)"
            R"("authenticated+server","h","-",{"bytes":8192},{"bytes":4096},2,5,1500,"",7,1,2500]]})");
  PathReport none = sample_path();
  none.latency.reset();
  EXPECT_EQ(path_listing({none})["rows"][0][14].dump(), "-1") << "no heartbeat yet";
  const json st = path_stats_answer({sample_path()});
  json entry = st["paths"][0];
  EXPECT_EQ(entry["stats"].dump(), stats_to_json(sample_path().stats).dump());
  EXPECT_EQ(entry["fence"].dump(), R"({"fenced":1,"last_rtt_ns":2500000,"max_rtt_ns":0,"waited":7})");
  entry.erase("stats");
  entry.erase("fence");
  EXPECT_EQ(entry.dump(),
            R"({"auth":"authenticated","auth_bidirectional":true,"auth_host":"h","auth_method":"dhchap-sha256-x25519",)"
            R"("cur_latency_ns":1500,"dst_host":"ip:10.0.0.1","dst_port":1234,"fabric":"rdma","hca_name":"rxe0",)"
            R"("hca_port":1,"inflight":2,"last_error":"","name":"ip:0.0.0.0@ip:10.0.0.1","src_host":"ip:0.0.0.0",)"
            R"("state":"connected","tls":"-"})");
  EXPECT_EQ(path_stats_answer({none})["paths"][0]["cur_latency_ns"].dump(), "0");
  EXPECT_EQ(path_stats_answer({}).dump(), R"({"ok":true,"paths":[]})");
}

// The daemon's encoders before the answers were typed (client_daemon.cc's session_list and
// path_row, client_daemon_paths.cc's path_stats), kept here verbatim over the same inputs as
// the reference the typed encoders must match byte for byte.
namespace before {
struct Sess {
  std::string name;
  std::vector<ibtrs::ClientPathInfo> ps;
  std::string state;
  ibtrs::MpPolicy policy;
  uint64_t read_bytes, write_bytes;
  size_t devices;
};

json session_row(const Sess& s) {
  std::string uu;
  uint32_t up = 0, inflight = 0;
  uint64_t reconnects = 0;
  for (auto& p : s.ps) {
    const bool u = p.state == ibtrs::ClientPathState::connected;
    uu += u ? 'U' : '_';
    up += u;
    inflight += p.inflight;
    reconnects += p.stats.reconnects_ok;
  }
  return json::array({s.name, s.ps.size(), up, s.state, uu, std::string(ibtrs::to_string(s.policy)),
                      bytes_cell(s.read_bytes), bytes_cell(s.write_bytes), inflight, reconnects, s.devices});
}

std::string auth_word(const ibtrs::PathAuthInfo& a) {
  return std::string(ibtrs::to_string(a.state)) + (a.bidirectional ? "+server" : "");
}

json path_row(const std::string& sess, const ibtrs::ClientPathInfo& p) {
  return json::array({sess, p.name, p.spec.source ? p.spec.source->to_string() : "",
                      p.spec.destination.to_string(), p.hca_name, p.hca_port,
                      std::string(ibtrs::to_string(p.state)), auth_word(p.auth), p.auth.host,
                      ibtrs::tls::describe(p.tls),
                      bytes_cell(p.stats.read_bytes), bytes_cell(p.stats.write_bytes), p.inflight,
                      p.stats.reconnects_ok, p.latency ? static_cast<int64_t>(p.latency->count()) : -1,
                      p.last_error ? p.last_error.message() : "", p.fence.waited, p.fence.fenced,
                      std::chrono::duration_cast<std::chrono::microseconds>(p.fence.last_rtt).count()});
}

json path_stats_entry(const ibtrs::ClientPathInfo& p) {
  const ibtrs::Address& dst = p.spec.destination;
  return {{"name", p.name},
          {"state", std::string(ibtrs::to_string(p.state))},
          {"fabric", std::string(ibtrs::to_string(p.fabric))},
          {"hca_name", p.hca_name},
          {"hca_port", p.hca_port},
          {"src_host", p.spec.source ? p.spec.source->host_string()
                                     : (dst.family() == AF_INET6 ? "ip:::" : "ip:0.0.0.0")},
          {"dst_host", dst.host_string()},
          {"dst_port", dst.port},
          {"cur_latency_ns", p.latency ? p.latency->count() : 0},
          {"auth", std::string(ibtrs::to_string(p.auth.state))},
          {"auth_host", p.auth.host},
          {"auth_bidirectional", p.auth.bidirectional},
          {"auth_method", p.auth.method},
          {"tls", ibtrs::tls::describe(p.tls)},
          {"last_error", p.last_error ? p.last_error.message() : ""},
          {"inflight", p.inflight},
          {"stats", stats_to_json(p.stats)},
          {"fence", fence_to_json(p.fence)}};
}
}  // namespace before

// A path with every field drawn at random (addresses of both families and fabrics, with and
// without a source; strings with quotes and non-ASCII bytes; counters up to 64 bits).
ibtrs::ClientPathInfo random_path(std::mt19937_64& rng) {
  auto pick = [&](uint64_t n) { return rng() % n; };
  auto text = [&] {
    static const char* kWords[] = {"", "h", "nqn.2014-08.org.example:\"x\"", "caf\xc3\xa9", "a b\tc", "\\n"};
    return std::string(kWords[pick(6)]);
  };
  static const char* kSpecs[] = {"tcp:127.0.0.1:4000",      "tcp:10.0.0.1:1@tcp:10.0.0.2:2",
                                 "rdma:[fe80::1]:4791",     "ip:10.0.0.1",
                                 "ip:10.0.0.2@ip:10.0.0.3", "rdma:[::1]:1@rdma:[::2]:65535",
                                 "ip:fe80::2",              "tcp:[2001:db8::1]:0"};
  ibtrs::ClientPathInfo p;
  auto spec = ibtrs::PathSpec::parse(kSpecs[pick(8)]);
  EXPECT_TRUE(spec.ok());
  if (spec.ok()) p.spec = *spec;
  p.name = pick(2) ? p.spec.name() : text();
  p.state = static_cast<ibtrs::ClientPathState>(pick(7));
  p.fabric = static_cast<ibtrs::FabricKind>(pick(3));
  p.hca_name = text();
  p.hca_port = static_cast<uint8_t>(rng());
  if (pick(2)) p.latency = std::chrono::nanoseconds(static_cast<int64_t>(rng() >> pick(64)));
  p.inflight = static_cast<uint32_t>(rng());
  p.auth.state = static_cast<ibtrs::AuthState>(pick(4));
  p.auth.host = text();
  p.auth.bidirectional = pick(2);
  p.auth.method = text();
  p.tls.on = pick(2);
  p.tls.kernel_tx = pick(2);
  p.tls.kernel_rx = pick(2);
  p.tls.cipher = text();
  if (pick(2)) p.last_error = std::error_code(static_cast<int>(pick(140)), std::generic_category());
  p.stats.read_bytes = rng() >> pick(64);
  p.stats.write_bytes = rng() >> pick(64);
  p.stats.reconnects_ok = rng() >> pick(64);
  p.stats.inflight = static_cast<int64_t>(rng() >> 1);
  p.stats.lat_read[pick(p.stats.lat_read.size())] = rng();
  p.stats.migrated_to.assign(pick(4), rng());
  p.fence.waited = rng() >> pick(64);
  p.fence.fenced = rng() >> pick(64);
  p.fence.last_rtt = std::chrono::nanoseconds(static_cast<int64_t>(rng() >> pick(64)));
  p.fence.max_rtt = std::chrono::nanoseconds(static_cast<int64_t>(rng() >> 1));
  return p;
}

// Case: 2000 random sessions of up to 4 random paths, each listed, its paths listed and their
// stats answered by the typed encoders (the reports filled as the daemon fills them) and by the
// encoders from before. Expect: the same bytes, every time; and the reports read back from the
// JSON encode to the same bytes again.
TEST(SessionListing, MatchesTheOldEncodersOnRandomSessions) {
  std::mt19937_64 rng(0x5e55107);
  for (int i = 0; i < 2000; ++i) {
    before::Sess s{"s" + std::to_string(rng() % 100), {}, i % 3 ? "connected" : "closed",
                   static_cast<ibtrs::MpPolicy>(rng() % 3), rng() >> (rng() % 64), rng() >> (rng() % 64), rng() % 5};
    const size_t n = rng() % 5;
    for (size_t k = 0; k < n; ++k) s.ps.push_back(random_path(rng));
    // The daemon's session_reports and path_reports over the same session.
    SessionReport r;
    r.name = s.name;
    r.path_cnt = s.ps.size();
    std::vector<PathReport> paths;
    uint32_t up = 0, inflight = 0;
    for (auto& p : s.ps) {
      const bool u = p.state == ibtrs::ClientPathState::connected;
      r.path_uu += u ? 'U' : '_';
      up += u;
      inflight += p.inflight;
      r.reconnects += p.stats.reconnects_ok;
      paths.push_back(client_path_report(s.name, p));
    }
    r.act_path_cnt = up;
    r.inflight = inflight;
    r.state = s.state;
    r.mp = std::string(ibtrs::to_string(s.policy));
    r.rx_bytes = s.read_bytes;
    r.tx_bytes = s.write_bytes;
    r.devices = s.devices;

    const json rows_before = json::array({before::session_row(s)});
    ASSERT_EQ(session_listing({r})["rows"].dump(), rows_before.dump()) << "session " << i;
    json path_rows = json::array(), stats = json::array();
    for (auto& p : s.ps) {
      path_rows.push_back(before::path_row(s.name, p));
      stats.push_back(before::path_stats_entry(p));
    }
    ASSERT_EQ(path_listing(paths)["rows"].dump(), path_rows.dump()) << "session " << i;
    ASSERT_EQ(path_stats_answer(paths).dump(), json({{"ok", true}, {"paths", stats}}).dump()) << "session " << i;

    auto sb = sessions_from_listing(session_listing({r}));
    ASSERT_TRUE(sb.ok());
    EXPECT_EQ(session_listing(*sb).dump(), session_listing({r}).dump());
    auto pb = paths_from_stats(path_stats_answer(paths));
    ASSERT_TRUE(pb.ok());
    EXPECT_EQ(path_stats_answer(*pb).dump(), path_stats_answer(paths).dump());
  }
}

// Case: answers read back from a hand-written daemon (fewer fields, signed numbers), and answers
// of the wrong shape. Expect: defaults for what is missing; EINVAL for the wrong shape, no throw.
TEST(SessionListing, ReadsBackAndRefusesTheWrongShape) {
  const json hand = {{"ok", true},
                     {"columns", json::array({{{"name", "mp"}}, {{"name", "sessname"}}})},
                     {"rows", json::array({json::array({"round-robin", "s1"})})}};
  auto h = sessions_from_listing(hand);
  ASSERT_TRUE(h.ok());
  ASSERT_EQ(h->size(), 1u);
  EXPECT_EQ((*h)[0].name, "s1");
  EXPECT_EQ((*h)[0].mp, "round-robin");
  EXPECT_EQ((*h)[0].path_cnt, 0u);
  const json cols = json::array({{{"name", "sessname"}}, {{"name", "path_cnt"}}});
  for (const json& bad : {json("x"), json{{"columns", cols}, {"rows", json::array({json::array({"s", -1})})}},
                          json{{"columns", cols}, {"rows", json::array({1})}}})
    EXPECT_EQ(sessions_from_listing(bad).error(), std::errc::invalid_argument) << bad.dump();

  // The server's path_stats entry (no latency, fence, last_error; its addresses in full).
  const json srv = {{"ok", true},
                    {"paths", json::array({{{"name", "p"}, {"src_addr", "tcp:1.1.1.1:5"}, {"hca_port", 1},
                                            {"dst_port", 4000}, {"fabric", "tcp"}, {"inflight", 0},
                                            {"stats", stats_to_json({})}}})}};
  auto ps = paths_from_stats(srv);
  ASSERT_TRUE(ps.ok());
  ASSERT_EQ(ps->size(), 1u);
  EXPECT_EQ((*ps)[0].src_addr, "tcp:1.1.1.1:5");
  EXPECT_EQ((*ps)[0].dst_port, 4000u);
  EXPECT_EQ((*ps)[0].auth, "none");
  EXPECT_EQ((*ps)[0].tls, "-");
  EXPECT_FALSE((*ps)[0].latency.has_value());
  EXPECT_EQ((*ps)[0].fence.waited, 0u);
  for (const json& bad :
       {json{{"ok", true}}, json{{"paths", 1}}, json{{"paths", json::array({1})}},
        json{{"paths", json::array({{{"hca_port", 256}}})}}, json{{"paths", json::array({{{"dst_port", -1}}})}},
        json{{"paths", json::array({{{"cur_latency_ns", "soon"}}})}},
        json{{"paths", json::array({{{"auth_bidirectional", 1}}})}},
        json{{"paths", json::array({{{"stats", {{"read_cnt", "many"}}}}})}},
        json{{"paths", json::array({{{"fence", {{"waited", "x"}}}}})}}})
    EXPECT_EQ(paths_from_stats(bad).error(), std::errc::invalid_argument) << bad.dump();
}

// ---- the server's devices and refusals ----

ExportedDeviceReport sample_export() {
  ExportedDeviceReport d;
  d.name = "/srv/sub/a.img";
  d.kind = "file";
  d.size = 8u << 20;
  d.direct = true;
  d.holders = {{"s1", 3, "rw"}, {"s2", 0, "ro"}};
  d.stats.read_ops = 2;
  d.stats.read_bytes = 8192;
  d.stats.write_ops = 1;
  d.stats.write_bytes = 4096;
  d.stats.status_ops = 5;
  d.stats.inflight = -1;  // a counter that raced its decrement: shown as the server has it
  return d;
}

// Case: a device with two holders and a refusal, answered. Expect: the JSON the server wrote
// before its answers were typed, to the byte (the CLI and scripts read it); empty lists as [].
TEST(ServerReports, AreTheSocketsAnswersByteForByte) {
  EXPECT_EQ(devices_answer({sample_export()}).dump(),
            R"({"devices":[{"direct":true,"kind":"file","name":"/srv/sub/a.img","read_only":false,)"
            R"("sessions":[{"access_mode":"rw","device_id":3,"session":"s1"},{"access_mode":"ro","device_id":0,"session":"s2"}],)"
            R"("size":8388608,"stats":{"discard_ops":0,"errors":0,"flush_ops":0,"inflight":-1,"read_bytes":8192,)"
            R"("read_ops":2,"status_ops":5,"write_bytes":4096,"write_ops":1,"write_zeroes_ops":0}}],"ok":true})");
  EXPECT_EQ(devices_answer({}).dump(), R"({"devices":[],"ok":true})");
  ExportedDeviceReport idle = sample_export();
  idle.holders.clear();
  EXPECT_EQ(devices_answer({idle})["devices"][0]["sessions"].dump(), "[]");
  EXPECT_EQ(refusals_answer({{"session_limit", 7, "peer 10.0.0.1: Too many users", 1700000000123}}).dump(),
            R"({"ok":true,"refusals":[{"count":7,"last":"peer 10.0.0.1: Too many users",)"
            R"("last_unix_ms":1700000000123,"reason":"session_limit"}]})");
  EXPECT_EQ(refusals_answer({}).dump(), R"({"ok":true,"refusals":[]})");
}

// The server's encoders before the answers were typed (server_commands.cc's devices, refusals
// and stats_json), kept here verbatim over the server's own structs (Device and Holder as
// BlockServer's ExportedDeviceInfo and DeviceHolderInfo) as the reference the typed encoders
// must match byte for byte.
namespace before {
struct Holder {
  std::string session;
  uint32_t device_id = 0;
  AccessMode mode = AccessMode::ro;
};
struct Device {
  std::string name, kind;
  uint64_t size = 0;
  bool direct = false, read_only = false;
  std::vector<Holder> holders;
  BlockStats stats;
};

json stats_json(const BlockStats& s) {
  return {{"read_ops", s.read_ops}, {"read_bytes", s.read_bytes}, {"write_ops", s.write_ops},
          {"write_bytes", s.write_bytes}, {"flush_ops", s.flush_ops}, {"discard_ops", s.discard_ops},
          {"write_zeroes_ops", s.write_zeroes_ops}, {"status_ops", s.status_ops}, {"errors", s.errors}, {"inflight", s.inflight}};
}

json devices(const std::vector<Device>& devs) {
  json out = json::array();
  for (auto& d : devs) {
    json holders = json::array();
    for (auto& h : d.holders)
      holders.push_back({{"session", h.session}, {"device_id", h.device_id},
                         {"access_mode", std::string(to_string(h.mode))}});
    out.push_back({{"name", d.name}, {"kind", d.kind}, {"size", d.size}, {"direct", d.direct},
                   {"read_only", d.read_only}, {"sessions", holders}, {"stats", stats_json(d.stats)}});
  }
  return {{"ok", true}, {"devices", out}};
}

json refusals(const std::vector<ibtrs::RefusalCount>& rs) {
  json out = json::array();
  for (auto& r : rs)
    out.push_back({{"reason", r.reason}, {"count", r.count}, {"last", r.last},
                   {"last_unix_ms", r.last_unix_ms}});
  return {{"ok", true}, {"refusals", out}};
}
}  // namespace before

// Case: 2000 random sets of devices (up to 3 holders each, names with quotes and non-ASCII bytes,
// counters up to 64 bits, signed in-flight counts) and of refusals, answered by the typed
// encoders (the reports filled as server_devices fills them) and by the encoders from before.
// Expect: the same bytes every time; the reports read back from the JSON are the same reports.
TEST(ServerReports, MatchTheOldEncodersOnRandomReports) {
  std::mt19937_64 rng(0x5e7de5);
  auto text = [&] {
    static const char* kWords[] = {"", "s1", "/srv/a \"b\".img", "caf\xc3\xa9", "a b\tc", "rbd:pool/img@snap"};
    return std::string(kWords[rng() % 6]);
  };
  auto big = [&] { return rng() >> (rng() % 64); };
  for (int i = 0; i < 2000; ++i) {
    std::vector<before::Device> devs(rng() % 4);
    std::vector<ExportedDeviceReport> reports;
    for (before::Device& d : devs) {
      d.name = text();
      d.kind = text();
      d.size = big();
      d.direct = rng() % 2;
      d.read_only = rng() % 2;
      d.holders.resize(rng() % 4);
      for (before::Holder& h : d.holders) h = {text(), static_cast<uint32_t>(rng()), static_cast<AccessMode>(rng() % 3)};
      d.stats = {big(), big(), big(), big(), big(), big(), big(), big(), big(), static_cast<int64_t>(rng())};
      ExportedDeviceReport r{d.name, d.kind, d.size, d.direct, d.read_only, {}, d.stats};
      for (const before::Holder& h : d.holders) r.holders.push_back({h.session, h.device_id, std::string(to_string(h.mode))});
      reports.push_back(std::move(r));
    }
    std::vector<RefusalReport> refusals(rng() % 4);
    for (RefusalReport& r : refusals) r = {text(), big(), text(), static_cast<int64_t>(rng())};

    ASSERT_EQ(devices_answer(reports).dump(), before::devices(devs).dump()) << "round " << i;
    ASSERT_EQ(refusals_answer(refusals).dump(), before::refusals(refusals).dump()) << "round " << i;
    auto db = devices_from_answer(devices_answer(reports));
    ASSERT_TRUE(db.ok()) << "round " << i;
    EXPECT_EQ(*db, reports) << "round " << i;
    auto rb = refusals_from_answer(refusals_answer(refusals));
    ASSERT_TRUE(rb.ok()) << "round " << i;
    EXPECT_EQ(refusals_answer(*rb).dump(), refusals_answer(refusals).dump()) << "round " << i;
  }
}

// Case: answers from a hand-written daemon (only the fields sysfs-emu reads, signed numbers), and
// answers of the wrong shape. Expect: defaults for what is missing, access_mode shown as written;
// EINVAL for the wrong shape (a nameless device or holder, a reasonless refusal, a count that is
// not one), no throw.
TEST(ServerReports, ReadBackAndRefuseTheWrongShape) {
  const json hand = {{"ok", true},
                     {"devices", json::array({{{"name", "/srv/a.img"},
                                               {"sessions", json::array({{{"session", "s1"}, {"access_mode", "ro"}},
                                                                         {{"session", "s2"}, {"access_mode", 1}}})}},
                                              {{"name", "/srv/idle.img"}, {"size", 4096}}})}};
  auto d = devices_from_answer(hand);
  ASSERT_TRUE(d.ok());
  ASSERT_EQ(d->size(), 2u);
  EXPECT_EQ((*d)[0].name, "/srv/a.img");
  ASSERT_EQ((*d)[0].holders.size(), 2u);
  EXPECT_EQ((*d)[0].holders[0], (HolderReport{"s1", 0, "ro"}));
  EXPECT_EQ((*d)[0].holders[1].access_mode, "1") << "shown as the CLI shows it";
  EXPECT_EQ((*d)[0].kind, "");
  EXPECT_EQ((*d)[0].stats, BlockStats{});
  EXPECT_TRUE((*d)[1].holders.empty());
  EXPECT_EQ((*d)[1].size, 4096u);
  auto r = refusals_from_answer(json{{"refusals", json::array({{{"reason", "ack_timeout"}, {"count", 0}},
                                                               {{"reason", "session_limit"}, {"count", 7}}})}});
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[1].reason, "session_limit");
  EXPECT_EQ((*r)[1].count, 7u);
  EXPECT_EQ((*r)[1].last, "");
  EXPECT_EQ((*r)[1].last_unix_ms, 0);

  auto dev = [](json one) { return json{{"ok", true}, {"devices", json::array({std::move(one)})}}; };
  for (const json& bad :
       {json("x"), json{{"ok", true}}, json{{"devices", 1}}, json{{"devices", json::array({1})}},
        dev(json::object()), dev({{"name", 1}}), dev({{"name", "d"}, {"size", -1}}),
        dev({{"name", "d"}, {"direct", 1}}), dev({{"name", "d"}, {"sessions", "s1"}}),
        dev({{"name", "d"}, {"sessions", json::array({{{"access_mode", "ro"}}})}}),
        dev({{"name", "d"}, {"sessions", json::array({{{"session", "s"}, {"device_id", 1ull << 32}}})}}),
        dev({{"name", "d"}, {"stats", 1}}), dev({{"name", "d"}, {"stats", {{"read_ops", "many"}}}}),
        dev({{"name", "d"}, {"stats", {{"inflight", 1.5}}}})})
    EXPECT_EQ(devices_from_answer(bad).error(), std::errc::invalid_argument) << bad.dump();
  for (const json& bad : {json{{"refusals", json::object()}}, json{{"refusals", json::array({{{"count", 1}}})}},
                          json{{"refusals", json::array({{{"reason", "r"}, {"count", "1"}}})}},
                          json{{"refusals", json::array({{{"reason", "r"}, {"last_unix_ms", UINT64_MAX}}})}}})
    EXPECT_EQ(refusals_from_answer(bad).error(), std::errc::invalid_argument) << bad.dump();
}

// Case: the codec's answers and arguments. Expect: the shapes command.h names.
TEST(Command, AnswersAndArguments) {
  EXPECT_EQ(error(ENOENT).dump(), R"({"errno":2,"error":"No such file or directory","ok":false})");
  EXPECT_EQ(error(errc(EBUSY), "close d").dump(), R"({"errno":16,"error":"close d: Device or resource busy","ok":false})");
  EXPECT_EQ(answer(Status{}, "x").dump(), R"({"ok":true})");
  EXPECT_EQ(answer(errc(EPERM), "host h")["error"], "host h: Operation not permitted");
  EXPECT_EQ(string_arg(json{{"device", "d"}}, "device"), "d");
  EXPECT_THROW(string_arg(json{{"device", 1}}, "device"), std::invalid_argument);
  EXPECT_THROW(string_arg(json::object(), "device"), std::invalid_argument);
  const Listing l = listing_from_json(json{{"columns", json::array({column("n"), column("size", true)})},
                                           {"rows", json::array({json::array({"a", bytes_cell(3), "extra"})})}});
  ASSERT_EQ(l.columns.size(), 2u);
  EXPECT_TRUE(l.columns[1].right);
  ASSERT_EQ(l.rows.size(), 1u);
  ASSERT_EQ(l.rows[0].size(), 2u);  // the cell beyond the columns dropped
  EXPECT_EQ(l.rows[0][1].kind, Cell::Kind::bytes);
  EXPECT_EQ(l.rows[0][1].u, 3u);
}

std::string temp_dir() {
  char t[] = "/tmp/ibnbd-control-test-XXXXXX";
  const char* d = ::mkdtemp(t);
  return d ? d : "";
}

// Case: the CLI's side against a daemon's socket: a command with progress lines, an error
// answer, bad JSON, a second daemon on the same path, no daemon. Expect: progress in order,
// then the answer line; the daemon's errno in its answer; EADDRINUSE for the second lock;
// ENOENT with the CLI's hint once the daemon is gone.
TEST(Socket, ServesTheClientSide) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string path = dir + "/d.sock";
  {
    auto lock = SocketLock::acquire(path);
    ASSERT_TRUE(lock.ok());
    std::string why;
    auto second = SocketLock::acquire(path, &why);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.error(), std::errc::address_in_use);
    EXPECT_NE(why.find("another daemon (pid "), std::string::npos) << why;
    auto s = Socket::start(std::move(*lock), [](const json& req, const Emit& emit) -> json {
      if (req["cmd"] == "long") {
        for (int i = 1; i <= 2; ++i) emit(json{{"progress", {{"phase", "write"}, {"done", i}}}});
        return {{"ok", true}, {"n", 2}};
      }
      return error(EINVAL, "unknown command");
    });
    ASSERT_TRUE(s.ok());
    std::vector<int> seen;
    auto r = call(path, json{{"cmd", "long"}}, [&](const json& p) { seen.push_back(p["done"].get<int>()); }, nullptr);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(*r, (json{{"ok", true}, {"n", 2}}));
    EXPECT_EQ(seen, (std::vector<int>{1, 2}));
    auto e = call(path, json{{"cmd", "other"}}, {}, nullptr);
    ASSERT_TRUE(e.ok());
    EXPECT_EQ((*e)["errno"], EINVAL);
    auto nocmd = call(path, json{{"x", 1}}, {}, nullptr);
    ASSERT_TRUE(nocmd.ok());
    EXPECT_EQ((*nocmd)["errno"], EINVAL);
  }
  std::string why;
  auto gone = call(path, json{{"cmd", "long"}}, {}, &why);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.error(), std::errc::no_such_file_or_directory);
  EXPECT_NE(why.find("(is it running? --socket PATH)"), std::string::npos) << why;
  auto longp = call(std::string(200, 'x'), json{{"cmd", "x"}}, {}, &why);
  ASSERT_FALSE(longp.ok());
  EXPECT_EQ(longp.error(), std::errc::filename_too_long);
  ::unlink((path + ".lock").c_str());
  ::rmdir(dir.c_str());
}

// Case: a peer on the socket that answers with what is not JSON, or hangs up. Expect: EBADMSG
// and ECONNRESET with the CLI's messages, at once (no wait for the answer timeout).
TEST(Socket, ClientRefusesBadAnswers) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string path = dir + "/raw.sock";
  base::UniqueFd l(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(l.valid());
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(l.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(::listen(l.get(), 4), 0);
  std::thread peer([&] {
    for (const char* reply : {"not json\n", ""}) {
      base::UniqueFd c(::accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!c) return;
      char buf[256];
      [[maybe_unused]] ssize_t n = ::recv(c.get(), buf, sizeof(buf), 0);
      [[maybe_unused]] ssize_t w = ::send(c.get(), reply, std::strlen(reply), MSG_NOSIGNAL);
    }
  });
  std::string why;
  const auto t0 = std::chrono::steady_clock::now();
  auto bad = call(path, json{{"cmd", "x"}}, {}, &why);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error(), std::errc::bad_message);
  EXPECT_EQ(why.rfind("bad answer from the daemon: ", 0), 0u) << why;
  auto closed = call(path, json{{"cmd", "x"}}, {}, &why);
  ASSERT_FALSE(closed.ok());
  EXPECT_EQ(closed.error(), std::errc::connection_reset);
  EXPECT_EQ(why, "the daemon closed the connection");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  peer.join();
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}

// Case: --config files: a JSON object, a missing file, a parse error, an array; and the ready
// file written whole. Expect: the object; the daemons' messages for the others.
TEST(Daemon, ConfigAndReadyFile) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  auto write = [&](const char* name, const char* text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  std::string why;
  auto ok = read_config(write("a.json", R"({"io_threads": 4})"), &why);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)["io_threads"], 4);
  auto missing = read_config(dir + "/none.json", &why);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error(), std::errc::no_such_file_or_directory);
  EXPECT_EQ(why, "cannot read " + dir + "/none.json: No such file or directory");
  auto broken = read_config(write("b.json", "{"), &why);
  ASSERT_FALSE(broken.ok());
  EXPECT_EQ(broken.error(), std::errc::invalid_argument);
  EXPECT_EQ(why.rfind(dir + "/b.json: ", 0), 0u) << why;
  auto array = read_config(write("c.json", "[1]"), &why);
  ASSERT_FALSE(array.ok());
  EXPECT_EQ(why, dir + "/c.json: expected a JSON object");

  const std::string ready = dir + "/ready";
  write_ready_file(ready, "listening tcp:127.0.0.1:1\nmetrics http://127.0.0.1:2/metrics\n");
  std::ifstream in(ready);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(all, "listening tcp:127.0.0.1:1\nmetrics http://127.0.0.1:2/metrics\n");
  EXPECT_NE(::access((ready + ".tmp").c_str(), F_OK), 0);
  remove_ready_file(ready);
  EXPECT_NE(::access(ready.c_str(), F_OK), 0);
  for (const char* f : {"a.json", "b.json", "c.json"}) ::unlink((dir + "/" + f).c_str());
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace ibnbd::control
