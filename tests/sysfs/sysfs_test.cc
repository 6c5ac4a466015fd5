// sysfs-emu without FUSE: the node tree, the kernel's syntaxes (map_device, paths, policies,
// resets), the stats formats, and the trees over a fake daemon that records the commands.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <random>

#include "control/command.h"
#include "control/stats.h"
#include "sysfs/format.h"
#include "sysfs/node.h"
#include "sysfs/parse.h"
#include "sysfs/trees.h"

namespace sysfs {
namespace {

using nlohmann::json;

// ---- node tree ----

TEST(Node, StaticAndDynamicDirectoriesResolve) {
  std::vector<std::string> live{"a", "b"};
  auto root = Node::dir();
  root->add("file", Node::read_only([]() -> Result<std::string> { return std::string("x\n"); }));
  root->add("dyn", Node::dynamic_dir([&] { return Result<std::vector<std::string>>(live); },
                                     [](const std::string& n) -> Result<NodePtr> {
                                       auto d = Node::dir();
                                       d->add("name", Node::read_only([n]() -> Result<std::string> { return n; }));
                                       return NodePtr(d);
                                     }));
  NodePtr r = root;
  EXPECT_EQ(*(*resolve(r, "/file"))->read(), "x\n");
  EXPECT_EQ(*(*resolve(r, "dyn/b/name"))->read(), "b");
  EXPECT_EQ(*(*resolve(r, "/"))->list(), (std::vector<std::string>{"dyn", "file"}));
  // Case: an entry goes away. Expect: lookups of it fail at once (no stale node).
  live = {"a"};
  EXPECT_EQ(resolve(r, "/dyn/b/name").error(), std::errc::no_such_file_or_directory);
  EXPECT_EQ(resolve(r, "/file/x").error(), std::errc::not_a_directory);
  EXPECT_EQ(resolve(r, "/dyn/..").error(), std::errc::no_such_file_or_directory);
}

TEST(Node, MissingCallbacksAreEaccesAndDirsEisdir) {
  auto w = Node::attr(0200, nullptr, [](std::string_view) -> Status { return errc(EBUSY); });
  EXPECT_EQ(w->read().error(), std::errc::permission_denied);
  EXPECT_EQ(w->write("1").error(), std::errc::device_or_resource_busy) << "the callback's errno passes through";
  auto r = Node::read_only([]() -> Result<std::string> { return std::string(); });
  EXPECT_EQ(r->write("1").error(), std::errc::permission_denied);
  EXPECT_EQ(Node::dir()->read().error(), std::errc::is_a_directory);
}

// ---- parsers ----

TEST(Parse, MapDeviceTakesTheKernelSyntax) {
  auto o = parse_map_device("sessname=s1 path=ip:10.0.0.1 path=tcp:127.0.0.1:4000@tcp:127.0.0.1:5000 "
                            "device_path=vol/a.img access_mode=ro nr_poll_queues=-1\n");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->sessname, "s1");
  EXPECT_EQ(o->paths, (std::vector<std::string>{"ip:10.0.0.1", "tcp:127.0.0.1:4000@tcp:127.0.0.1:5000"}));
  EXPECT_EQ(o->device_path, "vol/a.img");
  EXPECT_EQ(o->access_mode, "ro");
  json req = map_device_request(*o);
  EXPECT_EQ(req["cmd"], "device_map");
  EXPECT_EQ(req["exclusive"], true);
  EXPECT_EQ(req["session"], "s1");
  EXPECT_EQ(req["ublk"], true) << "the kernel's map_device makes a block device";
  // dest_port applies to the kernel's address forms, in any order of the options.
  auto p = parse_map_device("path=ip:10.0.0.1,ip:10.0.0.2 dest_port=4321 sessname=s device_path=d");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->paths[0], "tcp:10.0.0.1:0@tcp:10.0.0.2:4321");
  EXPECT_EQ(parse_map_device("sessname=s path=tcp:127.0.0.1:9 device_path=d")->access_mode, "rw");
}

TEST(Parse, MapDeviceRefusesWhatTheKernelRefuses) {
  for (const char* bad : {"", "bogus", "sessname=s device_path=d", "path=ip:1.2.3.4 device_path=d",
                          "sessname=s path=ip:1.2.3.4", "sessname=s path=ip:1.2.3.4 device_path=d colour=red",
                          "sessname=s path=ip:1.2.3.4 device_path=d access_mode=rx",
                          "sessname=s path=nowhere device_path=d", "sessname= path=ip:1.2.3.4 device_path=d",
                          "sessname=s sessname=t path=ip:1.2.3.4 device_path=d",
                          "sessname=a/b path=ip:1.2.3.4 device_path=d",
                          "sessname=s path=ip:1.2.3.4 device_path=d dest_port=70000",
                          "sessname=s path=ip:1.2.3.4 device_path=d nr_poll_queues=-2"}) {
    EXPECT_EQ(parse_map_device(bad).error(), std::errc::invalid_argument) << bad;
  }
  std::string seven = "sessname=s device_path=d";
  for (int i = 0; i < 7; ++i) seven += " path=ip:10.0.0." + std::to_string(i + 1);
  EXPECT_EQ(parse_map_device(seven).error(), std::errc::invalid_argument) << "at most 6 paths";
}

TEST(Parse, PathsAndActionWrites) {
  EXPECT_EQ(*parse_path("ip:10.0.0.1\n"), "ip:10.0.0.1");
  EXPECT_EQ(*parse_path("ip:10.0.0.1,ip:10.0.0.2"), "ip:10.0.0.1,ip:10.0.0.2");
  EXPECT_EQ(*parse_path("tcp:127.0.0.1:1234"), "tcp:127.0.0.1:1234");
  EXPECT_TRUE(parse_path("gid:fe80::1").ok());
  for (const char* bad : {"", "\n", "ip:1.2.3.4 ip:5.6.7.8", "ip:nowhere", "tcp:127.0.0.1@rdma:127.0.0.1"})
    EXPECT_FALSE(parse_path(bad).ok()) << bad;
  EXPECT_TRUE(parse_one("1\n").ok());
  EXPECT_FALSE(parse_one("0").ok());
  EXPECT_FALSE(parse_one("11").ok());
  EXPECT_TRUE(parse_reset("0\n").ok());
  EXPECT_TRUE(parse_reset(" 1 ").ok());
  EXPECT_FALSE(parse_reset("2").ok());
  EXPECT_EQ(*parse_unmap_mode("force\n"), true);
  EXPECT_EQ(*parse_unmap_mode("normal"), false);
  EXPECT_FALSE(parse_unmap_mode("now").ok());
  EXPECT_EQ(*parse_sectors("131072\n"), 131072u);
  EXPECT_FALSE(parse_sectors("0").ok());
  EXPECT_FALSE(parse_sectors("12k").ok());
  EXPECT_EQ(escape_name("sub/b.img"), "sub!b.img");
  EXPECT_EQ(unescape_name(escape_name("/srv/x/y")), "/srv/x/y");
}

TEST(Parse, PoliciesInEveryKernelSpelling) {
  for (auto [text, want] : std::vector<std::pair<const char*, ibtrs::MpPolicy>>{
           {"round-robin\n", ibtrs::MpPolicy::round_robin}, {"rr", ibtrs::MpPolicy::round_robin},
           {"0", ibtrs::MpPolicy::round_robin}, {"min-inflight", ibtrs::MpPolicy::min_inflight},
           {"1\n", ibtrs::MpPolicy::min_inflight}, {"min-latency", ibtrs::MpPolicy::min_latency},
           {"ml", ibtrs::MpPolicy::min_latency}}) {
    EXPECT_EQ(*ibtrs::parse_mp_policy(text), want) << text;
  }
  EXPECT_FALSE(ibtrs::parse_mp_policy("3").ok());
  EXPECT_EQ(format_policy(ibtrs::MpPolicy::min_inflight), "min-inflight (MI: 1)\n");
  EXPECT_EQ(format_policy(ibtrs::MpPolicy::round_robin), "round-robin (RR: 0)\n");
}

// ---- formats ----

TEST(Format, StatsFilesInTheKernelFormats) {
  PathStatsSnapshot s;
  s.read_cnt = 1;
  s.read_bytes = 4096;
  s.write_cnt = 2;
  s.write_bytes = 8192;
  s.inflight = 3;
  s.failovered = 4;
  s.reconnects_ok = 5;
  s.reconnects_failed = 6;
  s.polls = 4;
  s.polled_completions = 10;
  s.poll_max = 7;
  s.lat_read[0] = 1;   // < 2 us
  s.lat_read[9] = 2;   // [512, 1024) us: still the 1 ms row (1.024 ms)
  s.lat_write[10] = 3; // [1024, 2048) us: the 2 ms row
  s.lat_write[26] = 1; // >= 67 s
  s.lat_max_read_ns = 900'000;
  s.lat_max_write_ns = 70'000'000'000;
  s.sg_entries[1] = 9;
  s.sg_entries[16] = 1;
  s.migrated_from = {1, 0};
  s.migrated_to = {0, 1};
  EXPECT_EQ(format_client_rdma(s), "1 4096 2 8192 3 4\n");
  EXPECT_EQ(format_server_rdma(s), "1 4096 2 8192 3\n");
  EXPECT_EQ(format_client_wc_completion(s), "7 2\n");
  EXPECT_EQ(format_server_wc_completion(s), "7 10 4\n");
  EXPECT_EQ(format_reconnects(s), "5 6\n");
  const std::string lat = format_rdma_lat(s);
  EXPECT_NE(lat.find("1 ms: 3 0\n2 ms: 0 3\n4 ms: 0 0\n"), std::string::npos) << lat;
  EXPECT_NE(lat.find("65536 ms: 0 0\n>= 65536 ms: 0 1\nmaximum ms: 0 70000\n"), std::string::npos) << lat;
  EXPECT_EQ(std::count(lat.begin(), lat.end(), '\n'), 19);
  const std::string sg = format_sg_entries(s);
  EXPECT_EQ(sg.rfind("n\\thread: count\n0: 0\n1: 9\n", 0), 0u) << sg;
  EXPECT_NE(sg.find("16+: 1\ntotal: 10\n"), std::string::npos) << sg;
  EXPECT_EQ(format_cpu_migration(s), "     CPU0 CPU1\nfrom:    1    0\nto  :    0    1\n");
  ibtrs::ClientPathInfo::Fence f;
  f.waited = 7;
  f.fenced = 2;
  f.last_rtt = std::chrono::nanoseconds(1500);
  f.max_rtt = std::chrono::nanoseconds(90'000'000'000);  // past 32 bits
  EXPECT_EQ(format_fence(f), "7 2 1500 90000000000\n");
  EXPECT_EQ(format_fence({}), "0 0 0 0\n");
}

// ---- the trees over a fake daemon ----

// Answers the commands the trees send with canned state and records them.
struct FakeDaemon {
  std::mutex mu;
  std::vector<json> seen;
  std::string policy = "min-inflight";
  bool has_path2 = true;
  bool ublk_drv = true;            // device_map: false answers as a daemon without ublk_drv
  std::string ublk = "/dev/ublkb3";  // the device's block device ("" for none)

  json operator()(const json& req) {
    std::lock_guard l(mu);
    seen.push_back(req);
    const std::string cmd = req.at("cmd");
    auto listing = [](json cols, json rows) {
      json c = json::array();
      for (auto& n : cols) c.push_back({{"name", n}});
      return json{{"ok", true}, {"columns", c}, {"rows", rows}};
    };
    if (cmd == "session_list" || cmd == "session_show")
      return listing({"sessname", "mp"}, json::array({json::array({"s1", policy})}));
    if (cmd == "device_list" || cmd == "device_show")
      return listing({"device", "session", "access_mode", "state", "standby", "standby_state", "failovers", "size", "ublk"},
                     json::array({json::array({"sub/b.img", "s1", "ro", "open", "s2", "ready", 1,
                                               json{{"bytes", 8u << 20}}, ublk})}));
    if (cmd == "device_map" && !ublk_drv)
      return {{"ok", false}, {"errno", ENODEV}, {"error", "ublk: ublk_drv not loaded (no /dev/ublk-control): modprobe ublk_drv"}};
    if (cmd == "path_stats") {
      ibtrs::PathStatsSnapshot st;
      st.write_cnt = 3;
      json p1{{"name", "ip:0.0.0.0@ip:10.0.0.1"}, {"state", "reconnecting"}, {"fabric", "rdma"},
              {"hca_name", "rxe0"}, {"hca_port", 1}, {"src_host", "ip:0.0.0.0"}, {"dst_host", "ip:10.0.0.1"},
              {"dst_port", 1234}, {"cur_latency_ns", 1500}, {"auth", "authenticated"},
              {"auth_host", "nqn.2014-08.org.example:h"}, {"auth_bidirectional", true},
              {"stats", ibnbd::control::stats_to_json(st)}};
      ibtrs::ClientPathInfo::Fence f;
      f.waited = 4;
      f.fenced = 1;
      f.last_rtt = f.max_rtt = std::chrono::nanoseconds(2500);
      p1["fence"] = ibnbd::control::fence_to_json(f);
      json p2 = p1;
      p2.erase("fence");  // a daemon that does not send it: zeros
      p2["name"] = "tcp:0.0.0.0@tcp:127.0.0.1:4000";
      p2["tls"] = "kTLS TLS_AES_128_GCM_SHA256";
      p2["fabric"] = "tcp";
      p2["hca_name"] = "tcp";
      p2["dst_port"] = 4000;
      p2["state"] = "connected";
      json all = json::array({p1});
      if (has_path2) all.push_back(p2);
      if (req.contains("path")) {
        for (auto& p : all)
          if (p["name"] == req["path"]) return {{"ok", true}, {"paths", json::array({p})}};
        return {{"ok", false}, {"errno", ENOENT}};
      }
      return {{"ok", true}, {"paths", all}};
    }
    if (cmd == "session_policy") {
      policy = req.at("policy");
      return {{"ok", true}};
    }
    if (cmd == "path_add") return {{"ok", false}, {"errno", EEXIST}, {"error", "exists"}};
    return {{"ok", true}};
  }
};

std::string read_at(const NodePtr& root, const char* path) {
  auto n = resolve(root, path);
  if (!n) return "ENOENT";
  auto r = (*n)->read();
  return r ? *r : "E" + std::to_string(r.error().value());
}
int write_at(const NodePtr& root, const char* path, std::string_view data) {
  auto n = resolve(root, path);
  if (!n) return n.error().value();
  return (*n)->write(data).error().value();
}

TEST(Trees, ClientFilesMapOntoTheDaemonsCommands) {
  auto fake = std::make_shared<FakeDaemon>();
  auto logged = std::make_shared<std::vector<std::string>>();
  NodePtr root = client_tree([fake](const json& r) { return (*fake)(r); },
                             [logged](const std::string& l) { logged->push_back(l); });
  EXPECT_EQ(*(*resolve(root, "/ibtrs-client"))->list(), std::vector<std::string>{"s1"});
  EXPECT_EQ(read_at(root, "/ibtrs-client/s1/mp_policy"), "min-inflight (MI: 1)\n");
  EXPECT_EQ(write_at(root, "/ibtrs-client/s1/mpath_policy", "rr\n"), 0);
  EXPECT_EQ(fake->seen.back()["policy"], "round-robin");
  EXPECT_EQ(read_at(root, "/ibtrs-client/s1/mp_policy"), "round-robin (RR: 0)\n");
  // Lookups ask the daemon for its sessions; the writes themselves must send nothing.
  NodePtr policy = *resolve(root, "/ibtrs-client/s1/mp_policy");
  NodePtr add = *resolve(root, "/ibtrs-client/s1/add_path");
  const size_t before = fake->seen.size();
  EXPECT_EQ(policy->write("fastest").error().value(), EINVAL);
  EXPECT_EQ(add->write("ip:nowhere").error().value(), EINVAL);
  EXPECT_EQ(fake->seen.size(), before) << "malformed writes never reach the daemon";
  EXPECT_EQ(write_at(root, "/ibtrs-client/s1/add_path", "ip:10.0.0.9\n"), EEXIST) << "the daemon's errno";
  EXPECT_EQ(fake->seen.back()["path"], "ip:10.0.0.9");

  const char* rdma_path = "/ibtrs-client/s1/paths/ip:0.0.0.0@ip:10.0.0.1";
  EXPECT_EQ(read_at(root, (std::string(rdma_path) + "/state").c_str()), "disconnected\n");
  EXPECT_EQ(read_at(root, (std::string(rdma_path) + "/hca_port").c_str()), "1\n");
  EXPECT_EQ(read_at(root, (std::string(rdma_path) + "/cur_latency").c_str()), "1500 ns\n");
  EXPECT_EQ(read_at(root, (std::string(rdma_path) + "/auth").c_str()),
            "authenticated nqn.2014-08.org.example:h bidirectional\n");
  EXPECT_EQ(read_at(root, (std::string(rdma_path) + "/stats/rdma").c_str()), "0 0 3 0 0 0\n");
  EXPECT_EQ(read_at(root, (std::string(rdma_path) + "/tls").c_str()), "-\n") << "no tls field: none";
  const char* tcp_path = "/ibtrs-client/s1/paths/tcp:0.0.0.0@tcp:127.0.0.1:4000";
  EXPECT_EQ(read_at(root, (std::string(tcp_path) + "/tls").c_str()), "kTLS TLS_AES_128_GCM_SHA256\n");
  EXPECT_EQ(read_at(root, (std::string(tcp_path) + "/hca_name").c_str()), "tcp\n");
  EXPECT_EQ(read_at(root, (std::string(tcp_path) + "/hca_port").c_str()), "4000\n") << "tcp: the port";
  EXPECT_EQ(write_at(root, (std::string(tcp_path) + "/stats/rdma_lat").c_str(), "0\n"), 0);
  EXPECT_EQ(fake->seen.back()["cmd"], "path_reset_stats");
  EXPECT_EQ(fake->seen.back()["stats"], "rdma_lat");
  // Case: stats/fence, our extension. Expect: the daemon's fence counters in one line (zeros
  // when it sends none); "1" resets the fence group of that path, "2" is EINVAL and sends
  // nothing; reset_all resets "all" (which the daemon applies to the fence's too).
  EXPECT_EQ(read_at(root, (std::string(rdma_path) + "/stats/fence").c_str()), "4 1 2500 2500\n");
  EXPECT_EQ(read_at(root, (std::string(tcp_path) + "/stats/fence").c_str()), "0 0 0 0\n");
  EXPECT_EQ(write_at(root, (std::string(rdma_path) + "/stats/fence").c_str(), "1\n"), 0);
  EXPECT_EQ(fake->seen.back()["cmd"], "path_reset_stats");
  EXPECT_EQ(fake->seen.back()["stats"], "fence");
  EXPECT_EQ(fake->seen.back()["path"], "ip:0.0.0.0@ip:10.0.0.1");
  NodePtr fence = *resolve(root, std::string(rdma_path) + "/stats/fence");  // lookups ask the daemon
  const size_t seen_fence = fake->seen.size();
  EXPECT_EQ(fence->write("2\n").error().value(), EINVAL);
  EXPECT_EQ(fake->seen.size(), seen_fence);
  EXPECT_EQ(write_at(root, (std::string(rdma_path) + "/stats/reset_all").c_str(), "1\n"), 0);
  EXPECT_EQ(fake->seen.back()["stats"], "all");
  EXPECT_EQ(write_at(root, (std::string(tcp_path) + "/remove_path").c_str(), "1"), 0);
  EXPECT_EQ(fake->seen.back()["cmd"], "path_delete");
  EXPECT_EQ(fake->seen.back()["path"], "tcp:0.0.0.0@tcp:127.0.0.1:4000");
  // Case: the path goes. Expect: its directory with it.
  fake->has_path2 = false;
  EXPECT_EQ(read_at(root, (std::string(tcp_path) + "/state").c_str()), "ENOENT");

  EXPECT_EQ(*(*resolve(root, "/ibnbd-client/ctl/devices"))->list(), std::vector<std::string>{"sub!b.img"});
  EXPECT_EQ(read_at(root, "/ibnbd-client/ctl/devices/sub!b.img/mapping_path"), "sub/b.img\n");
  EXPECT_EQ(read_at(root, "/ibnbd-client/ctl/devices/sub!b.img/access_mode"), "ro\n");
  // Case: the device's size file. Expect: 512-byte sectors of the listing's size (the gendisk's
  // /sys/block/<dev>/size), what the server last said.
  EXPECT_EQ(read_at(root, "/ibnbd-client/ctl/devices/sub!b.img/size"), "16384\n");
  // Case: a device with a standby server. Expect: its standby, its state and the failovers so
  // far as files; `failover` switches (device_failover), and takes "1" only.
  EXPECT_EQ(read_at(root, "/ibnbd-client/ctl/devices/sub!b.img/standby"), "s2\n");
  EXPECT_EQ(read_at(root, "/ibnbd-client/ctl/devices/sub!b.img/standby_state"), "ready\n");
  EXPECT_EQ(read_at(root, "/ibnbd-client/ctl/devices/sub!b.img/failovers"), "1\n");
  EXPECT_EQ(write_at(root, "/ibnbd-client/ctl/devices/sub!b.img/failover", "1\n"), 0);
  EXPECT_EQ(fake->seen.back()["cmd"], "device_failover");
  EXPECT_EQ(fake->seen.back()["device"], "sub/b.img");
  EXPECT_EQ(write_at(root, "/ibnbd-client/ctl/devices/sub!b.img/failover", "2\n"), EINVAL);
  EXPECT_EQ(write_at(root, "/ibnbd-client/ctl/devices/sub!b.img/unmap_device", "force\n"), 0);
  EXPECT_EQ(fake->seen.back()["force"], true);
  EXPECT_EQ(write_at(root, "/ibnbd-client/ctl/map_device", "sessname=s1 path=ip:10.0.0.1 device_path=x"), 0);
  EXPECT_EQ(fake->seen.back()["cmd"], "device_map");
  EXPECT_EQ(fake->seen.back()["device"], "x");
  // Case: map_device with poll queues. Expect: 0 maps; any other count is EOPNOTSUPP and
  // reaches no daemon (never parsed and ignored).
  EXPECT_EQ(write_at(root, "/ibnbd-client/ctl/map_device", "sessname=s1 path=ip:10.0.0.1 device_path=y nr_poll_queues=0"), 0);
  EXPECT_EQ(fake->seen.back()["device"], "y");
  const size_t calls = fake->seen.size();
  EXPECT_EQ(write_at(root, "/ibnbd-client/ctl/map_device", "sessname=s1 path=ip:10.0.0.1 device_path=z nr_poll_queues=2"), EOPNOTSUPP);
  EXPECT_EQ(write_at(root, "/ibnbd-client/ctl/map_device", "sessname=s1 path=ip:10.0.0.1 device_path=z nr_poll_queues=-1"), EOPNOTSUPP);
  EXPECT_EQ(fake->seen.size(), calls);
  EXPECT_NE(logged->back().find("nr_poll_queues=-1"), std::string::npos) << logged->back();
  // Case: the device's block device. Expect: `block` names it as /sys/block does; "-" for a
  // device mapped in the library only (the CLI without --ublk).
  EXPECT_EQ(read_at(root, "/ibnbd-client/ctl/devices/sub!b.img/block"), "ublkb3\n");
  fake->ublk = "";
  EXPECT_EQ(read_at(root, "/ibnbd-client/ctl/devices/sub!b.img/block"), "-\n");
  // Case: map_device on a daemon without ublk_drv. Expect: the daemon's ENODEV, and its reason
  // (naming the module) in the log, since the writer sees only the errno.
  fake->ublk_drv = false;
  logged->clear();
  EXPECT_EQ(write_at(root, "/ibnbd-client/ctl/map_device", "sessname=s1 path=ip:10.0.0.1 device_path=w"), ENODEV);
  ASSERT_EQ(logged->size(), 1u);
  EXPECT_EQ(logged->front(), "sysfs: device_map: ublk: ublk_drv not loaded (no /dev/ublk-control): modprobe ublk_drv");
}

TEST(Trees, ServerFilesMapOntoTheDaemonsCommands) {
  std::vector<json> seen;
  NodePtr root = server_tree([&](const json& req) -> json {
    seen.push_back(req);
    const std::string cmd = req.at("cmd");
    if (cmd == "sessions") return {{"ok", true}, {"sessions", json::array({{{"name", "s1"}}})}};
    if (cmd == "devices")
      return {{"ok", true},
              {"devices", json::array({{{"name", "/srv/a.img"},
                                        {"sessions", json::array({{{"session", "s1"}, {"access_mode", "ro"}}})}}})}};
    if (cmd == "path_stats")
      return {{"ok", true},
              {"paths", json::array({{{"name", "ip:1.1.1.1@ip:2.2.2.2"}, {"fabric", "rdma"}, {"hca_name", "rxe0"},
                                      {"hca_port", 1}, {"src_host", "ip:1.1.1.1"}, {"dst_host", "ip:2.2.2.2"},
                                      {"dst_port", 1234}, {"stats", ibnbd::control::stats_to_json({})}}})}};
    return {{"ok", true}};
  });
  EXPECT_EQ(read_at(root, "/ibtrs-server/s1/paths/ip:1.1.1.1@ip:2.2.2.2/stats/rdma"), "0 0 0 0 0\n");
  EXPECT_EQ(read_at(root, "/ibtrs-server/s1/paths/ip:1.1.1.1@ip:2.2.2.2/auth"), "none\n") << "anonymous";
  EXPECT_EQ(read_at(root, "/ibtrs-server/s1/paths/ip:1.1.1.1@ip:2.2.2.2/stats/wc_completion"), "0 0 0\n");
  EXPECT_EQ(read_at(root, "/ibtrs-server/s1/paths/ip:1.1.1.1@ip:2.2.2.2/stats/fence"), "ENOENT") << "the client's";
  EXPECT_EQ(write_at(root, "/ibtrs-server/s1/paths/ip:1.1.1.1@ip:2.2.2.2/disconnect", "1\n"), 0);
  EXPECT_EQ(seen.back()["cmd"], "disconnect_path");
  const char* h = "/ibnbd-server/ctl/devices/!srv!a.img/sessions/s1";
  EXPECT_EQ(read_at(root, (std::string(h) + "/read_only").c_str()), "1\n");
  EXPECT_EQ(read_at(root, (std::string(h) + "/mapping_path").c_str()), "/srv/a.img\n");
  EXPECT_EQ(write_at(root, (std::string(h) + "/force_close").c_str(), "0"), EINVAL);
  EXPECT_EQ(write_at(root, (std::string(h) + "/force_close").c_str(), "1"), 0);
  EXPECT_EQ(seen.back()["cmd"], "force_close");
  EXPECT_EQ(seen.back()["device"], "/srv/a.img");
}

// Case: the server's refusals in ibtrs-server/ctl. Expect: one file per reason with its count,
// beside the sessions; reset_refusals sends reset_refusals on "1" and refuses "2" (EINVAL, no
// command sent); a reason the daemon does not list is ENOENT.
TEST(Trees, ServerRefusalsAreFilesUnderCtl) {
  std::vector<json> seen;
  NodePtr root = server_tree([&](const json& req) -> json {
    seen.push_back(req);
    const std::string cmd = req.at("cmd");
    if (cmd == "sessions") return {{"ok", true}, {"sessions", json::array({{{"name", "s1"}}})}};
    if (cmd == "refusals")
      return {{"ok", true},
              {"refusals", json::array({{{"reason", "ack_timeout"}, {"count", 0}},
                                        {{"reason", "session_limit"}, {"count", 7}, {"last", "x"}}})}};
    return {{"ok", true}};
  });
  EXPECT_EQ(*(*resolve(root, "/ibtrs-server"))->list(), (std::vector<std::string>{"ctl", "s1"}));
  EXPECT_EQ(*(*resolve(root, "/ibtrs-server/ctl/refusals"))->list(),
            (std::vector<std::string>{"ack_timeout", "session_limit"}));
  EXPECT_EQ(read_at(root, "/ibtrs-server/ctl/refusals/session_limit"), "7\n");
  EXPECT_EQ(read_at(root, "/ibtrs-server/ctl/refusals/ack_timeout"), "0\n");
  EXPECT_EQ(resolve(root, "/ibtrs-server/ctl/refusals/nothing").error(), std::errc::no_such_file_or_directory);
  EXPECT_EQ(write_at(root, "/ibtrs-server/ctl/reset_refusals", "2\n"), EINVAL);
  EXPECT_NE(seen.back()["cmd"], "reset_refusals") << "a malformed write sends nothing";
  EXPECT_EQ(write_at(root, "/ibtrs-server/ctl/reset_refusals", "1\n"), 0);
  EXPECT_EQ(seen.back()["cmd"], "reset_refusals");
}

// Case: a daemon known only by its JSON answers devices, refusals and max_reconnect_attempts in
// the wrong shape (a nameless device, a reasonless refusal, a number that is text or out of
// range), or refuses them. Expect: the listings and files read EIO (FUSE's answer to an answer
// it cannot read), never a throw; the daemon's own errno passes through.
TEST(Trees, AnswersOfTheWrongShapeReadAsEio) {
  json devices, refusals, attempts;
  Backend daemon = [&](const json& req) -> json {
    const std::string cmd = req.at("cmd");
    if (cmd == "sessions") return {{"ok", true}, {"sessions", json::array({{{"name", "s1"}}})}};
    if (cmd == "session_list")
      return {{"ok", true}, {"columns", json::array({{{"name", "sessname"}}})}, {"rows", json::array({json::array({"s1"})})}};
    if (cmd == "devices") return devices;
    if (cmd == "refusals") return refusals;
    if (cmd == "session_max_reconnect_attempts") return attempts;
    return {{"ok", false}, {"errno", EINVAL}};
  };
  NodePtr srv = server_tree(daemon);
  NodePtr cl = client_tree(daemon);
  auto listed = [](const NodePtr& root, const char* dir) -> std::string {
    auto n = resolve(root, dir);
    if (!n) return "E" + std::to_string(n.error().value());
    auto l = (*n)->list();
    return l ? std::to_string(l->size()) + " entries" : "E" + std::to_string(l.error().value());
  };
  const json good_dev = {{"name", "/srv/a.img"}, {"sessions", json::array({{{"session", "s1"}, {"access_mode", "rw"}}})}};
  devices = {{"ok", true}, {"devices", json::array({good_dev})}};
  refusals = {{"ok", true}, {"refusals", json::array({{{"reason", "ack_timeout"}, {"count", 2}}})}};
  attempts = {{"ok", true}, {"max_reconnect_attempts", -1}};
  EXPECT_EQ(read_at(srv, "/ibnbd-server/ctl/devices/!srv!a.img/sessions/s1/access_mode"), "rw\n");
  EXPECT_EQ(read_at(srv, "/ibtrs-server/ctl/refusals/ack_timeout"), "2\n");
  EXPECT_EQ(read_at(cl, "/ibtrs-client/s1/max_reconnect_attempts"), "-1\n");
  // A file's errno (0: it read).
  auto err = [](const NodePtr& n) {
    auto r = n->read();
    return r ? 0 : r.error().value();
  };
  NodePtr mode = *resolve(srv, "/ibnbd-server/ctl/devices/!srv!a.img/sessions/s1/access_mode");
  NodePtr count = *resolve(srv, "/ibtrs-server/ctl/refusals/ack_timeout");
  NodePtr tries = *resolve(cl, "/ibtrs-client/s1/max_reconnect_attempts");
  for (const json& bad : {json{{"ok", true}}, json{{"ok", true}, {"devices", json::array({{{"name", 1}}})}},
                          json{{"ok", true}, {"devices", json::array({{{"name", "/srv/a.img"}, {"sessions", 1}}})}}}) {
    devices = bad;
    EXPECT_EQ(listed(srv, "/ibnbd-server/ctl/devices"), "E5") << bad.dump();
    EXPECT_EQ(err(mode), EIO) << bad.dump();
  }
  devices = {{"ok", false}, {"errno", EPERM}};
  EXPECT_EQ(err(mode), EPERM) << "the daemon's errno";
  for (const json& bad : {json{{"ok", true}}, json{{"ok", true}, {"refusals", json::array({{{"count", 2}}})}},
                          json{{"ok", true}, {"refusals", json::array({{{"reason", "ack_timeout"}, {"count", "2"}}})}}}) {
    refusals = bad;
    EXPECT_EQ(listed(srv, "/ibtrs-server/ctl/refusals"), "E5") << bad.dump();
    EXPECT_EQ(err(count), EIO) << bad.dump();
  }
  for (const json& bad : {json{{"ok", true}}, json{{"ok", true}, {"max_reconnect_attempts", "3"}},
                          json{{"ok", true}, {"max_reconnect_attempts", 1ll << 32}},
                          json{{"ok", true}, {"max_reconnect_attempts", -(1ll << 32)}},
                          json{{"ok", true}, {"max_reconnect_attempts", 3.5}}}) {
    attempts = bad;
    EXPECT_EQ(err(tries), EIO) << bad.dump();
  }
  attempts = {{"ok", false}, {"errno", ENOENT}};
  EXPECT_EQ(err(tries), ENOENT) << "the daemon's errno";
}

// The report whose `key` is `name`, or ENOENT.
template <typename R>
ibnbd::Result<R> find(const std::vector<R>& all, const std::string& name, std::string R::*key) {
  for (const R& r : all)
    if (r.*key == name) return r;
  return errc(ENOENT);
}

// Every file of a tree that reads (path -> content, or its errno; "throws" for an answer the
// tree could not read, which FUSE turns into EIO), walking the directories.
void read_all(const NodePtr& root, const std::string& dir, std::map<std::string, std::string>& out) {
  auto n = resolve(root, dir.empty() ? "/" : dir);
  ASSERT_TRUE(n.ok()) << dir;
  auto names = (*n)->list();
  if (!names) {
    try {
      auto r = (*n)->read();
      out[dir] = r ? *r : "E" + std::to_string(r.error().value());
    } catch (const std::exception&) {
      out[dir] = "throws";
    }
    return;
  }
  for (const std::string& e : *names) read_all(root, dir + "/" + e, out);
}

// Case: the same sessions, paths, devices, a session's max_reconnect_attempts, the server's
// exported devices with their holders and its refusals (drawn at random) bound typed, as the
// daemons bind them, and answered as JSON by a backend, as the trees read them before the
// daemons had types. Expect: every file of both trees reads the same bytes; the typed trees
// send no command to the backend (reading sends no write).
TEST(Trees, TypedBindingsReadTheSameFilesAsTheJsonAnswers) {
  using namespace ibnbd::control;
  std::mt19937_64 rng(0x7e55);
  size_t holders_seen = 0;
  for (int round = 0; round < 20; ++round) {
    std::vector<SessionReport> sessions;
    std::vector<PathReport> paths;
    std::vector<DeviceReport> devices;
    std::map<std::string, int32_t> attempts;  // max_reconnect_attempts by session
    std::vector<ExportedDeviceReport> exports;
    std::vector<RefusalReport> refusals;
    static const char* kModes[] = {"ro", "rw", "migration"};
    static const char* kPolicies[] = {"round-robin", "min-inflight", "min-latency"};
    static const char* kStates[] = {"connected", "reconnecting", "closed"};
    static const char* kAuth[] = {"none", "pending", "authenticated", "failed"};
    for (int i = 0; i < 2; ++i) {
      SessionReport s;
      s.name = "s" + std::to_string(i) + (i ? "/x" : "");
      s.mp = kPolicies[rng() % 3];
      sessions.push_back(s);
      for (int k = 0; k < 2; ++k) {
        PathReport p;
        p.session = s.name;
        p.name = "tcp:0.0.0.0@tcp:127.0.0." + std::to_string(k + 1) + ":" + std::to_string(rng() % 65536);
        p.state = kStates[rng() % 3];
        p.fabric = rng() % 2 ? "tcp" : "rdma";
        p.hca_name = p.fabric == "tcp" ? "tcp" : "rxe0";
        p.hca_port = static_cast<uint8_t>(rng());
        p.src_host = "ip:0.0.0.0";
        p.dst_host = "ip:127.0.0." + std::to_string(k + 1);
        p.dst_port = static_cast<uint16_t>(rng());
        if (rng() % 2) p.latency = std::chrono::nanoseconds(static_cast<int64_t>(rng() >> 1));
        p.auth = kAuth[rng() % 4];
        p.auth_host = rng() % 2 ? "nqn.2014-08.org.example:h" : "";
        p.auth_bidirectional = rng() % 2;
        p.tls = rng() % 2 ? "-" : "kTLS TLS_AES_128_GCM_SHA256";
        p.stats.read_cnt = rng() >> (rng() % 64);
        p.stats.write_bytes = rng() >> (rng() % 64);
        p.stats.inflight = static_cast<int64_t>(rng() >> 2);
        p.stats.reconnects_failed = rng() >> (rng() % 64);
        p.stats.lat_write[rng() % p.stats.lat_write.size()] = rng() >> (rng() % 64);
        p.stats.lat_max_read_ns = rng() >> (rng() % 64);
        p.stats.sg_entries[rng() % p.stats.sg_entries.size()] = rng() >> (rng() % 64);
        p.stats.polls = rng() >> (rng() % 64);
        p.stats.migrated_from.assign(rng() % 3, rng() >> 40);
        p.stats.migrated_to.assign(p.stats.migrated_from.size(), rng() >> 40);
        p.fence.waited = rng() >> (rng() % 64);
        p.fence.max_rtt = std::chrono::nanoseconds(static_cast<int64_t>(rng() >> 1));
        paths.push_back(p);
      }
      DeviceReport d;
      d.device = "dev" + std::to_string(i);
      d.session = s.name;
      d.size = rng() >> (rng() % 64);
      d.state = "open";
      d.ublk = rng() % 2 ? "/dev/ublkb" + std::to_string(i) : "";
      d.failovers = rng() >> (rng() % 64);
      devices.push_back(d);
      attempts[s.name] = static_cast<int32_t>(rng() % 10001) - 1;
      // The server's side: a device under a subdirectory (escaped in its directory's name), held
      // by up to three sessions, one of them with a '/' in its name.
      ExportedDeviceReport e;
      e.name = "/srv/sub/img" + std::to_string(i);
      e.kind = "file";
      e.size = rng() >> (rng() % 64);
      for (int k = 0, n = static_cast<int>(rng() % 4); k < n; ++k)
        e.holders.push_back({k ? "h" + std::to_string(k) : s.name, static_cast<uint32_t>(rng()), kModes[rng() % 3]});
      exports.push_back(e);
      refusals.push_back({i ? "session_limit" : "ack_timeout", rng() >> (rng() % 64), "x", 1});
    }
    auto paths_of = [&](const std::string& sess, const std::string& path) -> ibnbd::Result<std::vector<PathReport>> {
      std::vector<PathReport> out;
      bool known = false;
      for (auto& p : paths) {
        known |= p.session == sess;
        if (p.session == sess && (path.empty() || p.name == path)) out.push_back(p);
      }
      if (!known || (!path.empty() && out.empty())) return errc(ENOENT);
      return out;
    };
    Backend json_daemon = [&](const json& req) -> json {
      const std::string cmd = req.at("cmd");
      if (cmd == "session_list") return session_listing(sessions);
      if (cmd == "device_list") return device_listing(devices, false);
      if (cmd == "sessions") {
        json out = json::array();
        for (auto& s : sessions) out.push_back({{"name", s.name}});
        return {{"ok", true}, {"sessions", out}};
      }
      if (cmd == "session_show") {
        auto s = find(sessions, req.at("session").get<std::string>(), &SessionReport::name);
        return s ? session_listing({*s}) : error(ENOENT);
      }
      if (cmd == "device_show") {
        auto d = find(devices, req.at("device").get<std::string>(), &DeviceReport::device);
        return d ? device_listing({*d}, false) : error(ENOENT);
      }
      if (cmd == "path_stats") {
        auto ps = paths_of(req.at("session"), req.value("path", ""));
        return ps ? path_stats_answer(*ps) : error(ENOENT);
      }
      if (cmd == "session_max_reconnect_attempts") {
        auto it = attempts.find(req.at("session").get<std::string>());
        return it != attempts.end() ? json{{"ok", true}, {"max_reconnect_attempts", it->second}} : error(ENOENT);
      }
      if (cmd == "devices") return devices_answer(exports);
      if (cmd == "refusals") return refusals_answer(refusals);
      return error(EINVAL, "unknown command");
    };
    size_t typed_reads = 0;
    Backend write_only = [&](const json& req) -> json {
      ++typed_reads;
      return json_daemon(req);
    };
    ClientBinding typed{
        .backend = write_only,
        .device = [&](const std::string& n) { return find(devices, n, &DeviceReport::device); },
        .log = {},
        .devices = [&]() -> ibnbd::Result<std::vector<DeviceReport>> { return devices; },
        .sessions = [&]() -> ibnbd::Result<std::vector<SessionReport>> { return sessions; },
        .session = [&](const std::string& n) { return find(sessions, n, &SessionReport::name); },
        .paths = paths_of,
        .max_reconnect_attempts = [&](const std::string& n) -> ibnbd::Result<int32_t> {
          auto it = attempts.find(n);
          if (it == attempts.end()) return errc(ENOENT);
          return it->second;
        }};
    std::map<std::string, std::string> over_json, over_types;
    read_all(client_tree(json_daemon), "", over_json);
    read_all(client_tree(std::move(typed)), "", over_types);
    EXPECT_GT(over_json.size(), 60u);
    for (auto& [f, c] : over_json) EXPECT_TRUE(c != "throws" && c != "E5") << f << " reads nothing to compare";
    EXPECT_EQ(over_types, over_json) << "round " << round;
    EXPECT_EQ(typed_reads, 0u) << "the typed client tree read through JSON";
    EXPECT_EQ(over_types["/ibtrs-client/s0/max_reconnect_attempts"], std::to_string(attempts["s0"]) + "\n");

    std::map<std::string, std::string> srv_json, srv_types;
    read_all(server_tree(json_daemon), "", srv_json);
    read_all(server_tree(ServerBinding{.backend = write_only,
                                       .log = {},
                                       .sessions = [&]() -> ibnbd::Result<std::vector<std::string>> {
                                         std::vector<std::string> n;
                                         for (auto& s : sessions) n.push_back(s.name);
                                         return n;
                                       },
                                       .paths = paths_of,
                                       .devices = [&]() -> ibnbd::Result<std::vector<ExportedDeviceReport>> {
                                         return exports;
                                       },
                                       .refusals = [&]() -> ibnbd::Result<std::vector<RefusalReport>> {
                                         return refusals;
                                       }}),
             "", srv_types);
    EXPECT_GT(srv_json.size(), 20u);
    for (auto& [f, c] : srv_json) EXPECT_TRUE(c != "throws" && c != "E5") << f << " reads nothing to compare";
    EXPECT_EQ(srv_types, srv_json) << "round " << round;
    EXPECT_EQ(typed_reads, 0u) << "the typed server tree read through JSON";
    EXPECT_EQ(srv_types["/ibtrs-server/ctl/refusals/session_limit"], std::to_string(refusals[1].count) + "\n");
    for (const HolderReport& h : exports[0].holders) {
      const std::string dir = "/ibnbd-server/ctl/devices/!srv!sub!img0/sessions/" + escape_name(h.session);
      EXPECT_EQ(srv_types[dir + "/access_mode"], h.access_mode + "\n") << dir;
      EXPECT_EQ(srv_types[dir + "/read_only"], h.access_mode == "ro" ? "1\n" : "0\n") << dir;
      ++holders_seen;
    }
  }
  EXPECT_GT(holders_seen, 10u) << "the rounds compared holders' files";
}

}  // namespace
}  // namespace sysfs
