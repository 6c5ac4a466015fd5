// control/ (library ibnbd_control): the client daemon's device listing as a type and its JSON
// (byte for byte what the socket answered before the type existed), the command codec, and the
// control socket's two sides talking over a real unix socket.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "control/client.h"
#include "control/client_devices.h"
#include "control/command.h"
#include "control/daemon.h"
#include "control/socket.h"
#include "base/unique_fd.h"

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
