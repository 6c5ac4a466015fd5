// The daemons' Prometheus metrics (control/include/control/metrics.h, metrics_http.h): the exposition
// encoder, the path counters' families, the listen address forms and the HTTP answers. The
// daemons' real scrapes (promtool, hostile scrapers) are tests/cli/daemons.sh's.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "control/metrics.h"
#include "control/metrics_http.h"

namespace {

using namespace ibnbd::control::metrics;

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// The sample lines of `text` that start with `prefix` (name and labels).
std::vector<std::string> grep(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  for (auto& l : lines(text))
    if (l.rfind(prefix, 0) == 0) out.push_back(l);
  return out;
}

// Case: two families whose samples are added interleaved. Expect: each family is one group with
// one HELP and one TYPE line, first-added family first; a value per line.
TEST(Exposition, GroupsFamiliesAndWritesOneValuePerLine) {
  Exposition e;
  e.counter("ibnbd_a_total", "A things.", {{"x", "1"}}, 5);
  e.gauge("ibnbd_b", "B now.", {}, 2.5);
  e.counter("ibnbd_a_total", "ignored", {{"x", "2"}}, 18446744073709551615ull);
  EXPECT_EQ(e.str(),
            "# HELP ibnbd_a_total A things.\n"
            "# TYPE ibnbd_a_total counter\n"
            "ibnbd_a_total{x=\"1\"} 5\n"
            "ibnbd_a_total{x=\"2\"} 18446744073709551615\n"
            "# HELP ibnbd_b B now.\n"
            "# TYPE ibnbd_b gauge\n"
            "ibnbd_b 2.5\n");
}

// Case: label values with a backslash, a double quote, a newline and bytes that are not UTF-8
// (a peer's session name). Expect: \\, \", \n escapes; U+FFFD for each bad byte; valid UTF-8 kept.
TEST(Exposition, EscapesLabelValues) {
  EXPECT_EQ(escape_label_value("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(escape_label_value("caf\xc3\xa9"), "caf\xc3\xa9");
  EXPECT_EQ(escape_label_value("x\xff" "y"), "x\xef\xbf\xbdy");
  EXPECT_EQ(escape_label_value("\xc0\xaf"), "\xef\xbf\xbd\xef\xbf\xbd") << "an overlong '/' is not UTF-8";
  EXPECT_EQ(escape_label_value("\xed\xa0\x80").substr(0, 3), "\xef\xbf\xbd") << "a surrogate is not UTF-8";
  Exposition e;
  e.gauge("ibnbd_g", "Help with \\ and\nnewline.", {{"session", "s\"1\n"}}, 1);
  const auto l = lines(e.str());
  ASSERT_EQ(l.size(), 3u) << e.str();
  EXPECT_EQ(l[0], "# HELP ibnbd_g Help with \\\\ and\\nnewline.");
  EXPECT_EQ(l[2], "ibnbd_g{session=\"s\\\"1\\n\"} 1");
}

// Case: a histogram from per-bucket counts. Expect: cumulative buckets with increasing le, the
// +Inf bucket equal to _count, then _sum and _count with the same labels.
TEST(Exposition, HistogramIsCumulativeWithInfEqualToCount) {
  Exposition e;
  const double bounds[] = {0.001, 0.01};
  const uint64_t counts[] = {3, 0, 2};
  e.histogram("ibnbd_lat_seconds", "Latency.", {{"d", "r"}}, bounds, counts, 0.5);
  const auto l = lines(e.str());
  ASSERT_EQ(l.size(), 7u) << e.str();
  EXPECT_EQ(l[1], "# TYPE ibnbd_lat_seconds histogram");
  EXPECT_EQ(l[2], "ibnbd_lat_seconds_bucket{d=\"r\",le=\"0.001\"} 3");
  EXPECT_EQ(l[3], "ibnbd_lat_seconds_bucket{d=\"r\",le=\"0.01\"} 3");
  EXPECT_EQ(l[4], "ibnbd_lat_seconds_bucket{d=\"r\",le=\"+Inf\"} 5");
  EXPECT_EQ(l[5], "ibnbd_lat_seconds_sum{d=\"r\"} 0.5");
  EXPECT_EQ(l[6], "ibnbd_lat_seconds_count{d=\"r\"} 5");
}

// Case: a path's counters (PathStatsSnapshot) with reads in two latency buckets and one beyond
// the last bound. Expect: bytes and IOs per direction, the latency histogram in seconds with the
// transport's bounds (2 us .. 2^26 us) and +Inf == _count == reads, the sum in seconds.
TEST(PathStats, AreNamedThePrometheusWay) {
  ibtrs::PathStatsSnapshot s;
  s.read_cnt = 7;
  s.read_bytes = 7 * 4096;
  s.write_cnt = 1;
  s.write_bytes = 512;
  s.inflight = 2;
  s.lat_read[0] = 4;                        // < 2 us
  s.lat_read[10] = 2;                       // [1024, 2048) us
  s.lat_read[ibtrs::kLatBuckets - 1] = 1;   // beyond every bound
  s.lat_sum_read_ns = 1'500'000'000;
  Exposition e;
  path_stats(e, {{"session", "s"}, {"path", "p"}}, s);
  const std::string t = e.str();
  EXPECT_EQ(grep(t, "ibnbd_path_bytes_total{session=\"s\",path=\"p\",direction=\"read\"}"),
            std::vector<std::string>{"ibnbd_path_bytes_total{session=\"s\",path=\"p\",direction=\"read\"} 28672"});
  EXPECT_EQ(grep(t, "ibnbd_path_ios_total{session=\"s\",path=\"p\",direction=\"write\"}"),
            std::vector<std::string>{"ibnbd_path_ios_total{session=\"s\",path=\"p\",direction=\"write\"} 1"});
  EXPECT_EQ(grep(t, "ibnbd_path_inflight{"), std::vector<std::string>{"ibnbd_path_inflight{session=\"s\",path=\"p\"} 2"});
  const auto buckets = grep(t, "ibnbd_path_latency_seconds_bucket{session=\"s\",path=\"p\",direction=\"read\"");
  ASSERT_EQ(buckets.size(), ibtrs::kLatBuckets);
  EXPECT_EQ(buckets.front(), "ibnbd_path_latency_seconds_bucket{session=\"s\",path=\"p\",direction=\"read\",le=\"2e-06\"} 4");
  EXPECT_EQ(buckets[10], "ibnbd_path_latency_seconds_bucket{session=\"s\",path=\"p\",direction=\"read\",le=\"0.002048\"} 6");
  EXPECT_EQ(buckets[ibtrs::kLatBuckets - 2],
            "ibnbd_path_latency_seconds_bucket{session=\"s\",path=\"p\",direction=\"read\",le=\"67.108864\"} 6");
  EXPECT_EQ(buckets.back(), "ibnbd_path_latency_seconds_bucket{session=\"s\",path=\"p\",direction=\"read\",le=\"+Inf\"} 7");
  EXPECT_EQ(grep(t, "ibnbd_path_latency_seconds_count{session=\"s\",path=\"p\",direction=\"read\"}"),
            std::vector<std::string>{"ibnbd_path_latency_seconds_count{session=\"s\",path=\"p\",direction=\"read\"} 7"});
  EXPECT_EQ(grep(t, "ibnbd_path_latency_seconds_sum{session=\"s\",path=\"p\",direction=\"read\"}"),
            std::vector<std::string>{"ibnbd_path_latency_seconds_sum{session=\"s\",path=\"p\",direction=\"read\"} 1.5"});
  // Every counter family's name ends in _total, every sample line is NAME[{...}] VALUE.
  for (auto& l : lines(t)) {
    if (l.rfind("# TYPE ", 0) == 0 && l.size() > 8 && l.substr(l.size() - 8) == " counter") {
      const std::string name = l.substr(7, l.size() - 15);
      EXPECT_EQ(name.substr(name.size() - 6), "_total") << l;
    }
    if (l[0] == '#') continue;
    EXPECT_EQ(l.find(' '), l.rfind(' ')) << "one value per line: " << l;
  }
}

// Case: the listen forms. Expect: a bare port and ":PORT" are loopback; an address is taken only
// as given; IPv6 in brackets; no port, a name, junk are EINVAL.
TEST(Listen, LoopbackUnlessAnAddressIsNamed) {
  auto text = [](std::string_view s) {
    auto a = parse_listen(s);
    return a ? to_string(*a) : std::string("EINVAL");
  };
  EXPECT_EQ(text("9100"), "127.0.0.1:9100");
  EXPECT_EQ(text(":9100"), "127.0.0.1:9100");
  EXPECT_EQ(text("0.0.0.0:9100"), "0.0.0.0:9100");
  EXPECT_EQ(text("[::1]:9100"), "[::1]:9100");
  EXPECT_EQ(text("10.1.2.3:0"), "10.1.2.3:0");
  for (const char* bad : {"", ":", "127.0.0.1", "localhost:9100", "::1:9100", "[::1]", "1.2.3.4:65536", "9100x",
                          "tcp:1.2.3.4:1"})
    EXPECT_EQ(text(bad), "EINVAL") << bad;
}

std::string status_of(const std::string& response) { return response.substr(0, response.find("\r\n")); }

// Case: what a scraper may send. Expect: GET /metrics (with a query, HTTP/1.0 too) 200 with the
// 0.0.4 content type; HEAD the same headers without a body; another path 404; another method
// 405; what is not HTTP 400; a collector that cannot answer 503.
TEST(Http, AnswersOnlyGetAndHeadOfMetrics) {
  int calls = 0;
  HttpServer::Collector c = [&calls]() -> std::optional<std::string> {
    ++calls;
    return std::string("ibnbd_x 1\n");
  };
  const std::string ok = respond("GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n", c);
  EXPECT_EQ(status_of(ok), "HTTP/1.1 200 OK");
  EXPECT_NE(ok.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(ok.find("Content-Length: 10\r\n"), std::string::npos);
  EXPECT_EQ(ok.substr(ok.size() - 14), "\r\n\r\nibnbd_x 1\n");
  EXPECT_EQ(status_of(respond("GET /metrics?x=1 HTTP/1.0\n\n", c)), "HTTP/1.1 200 OK");
  const std::string head = respond("HEAD /metrics HTTP/1.1\r\n\r\n", c);
  EXPECT_EQ(status_of(head), "HTTP/1.1 200 OK");
  EXPECT_EQ(head.substr(head.size() - 4), "\r\n\r\n") << "no body";
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(status_of(respond("GET / HTTP/1.1\r\n\r\n", c)), "HTTP/1.1 404 Not Found");
  EXPECT_EQ(status_of(respond("GET /metricsx HTTP/1.1\r\n\r\n", c)), "HTTP/1.1 404 Not Found");
  const std::string post = respond("POST /metrics HTTP/1.1\r\n\r\n", c);
  EXPECT_EQ(status_of(post), "HTTP/1.1 405 Method Not Allowed");
  EXPECT_NE(post.find("Allow: GET, HEAD\r\n"), std::string::npos);
  for (const char* bad : {"GET /metrics\r\n\r\n", "GET  /metrics HTTP/1.1\r\n\r\n", "GET metrics HTTP/1.1\r\n\r\n",
                          "GET /metrics HTTP/2\r\n\r\n", "\x16\x03\x01\x02\x00\r\n\r\n", "GET /metrics HTTP/1.1 x\r\n\r\n",
                          "GET /metrics HTTP/1.1\r\nno colon\r\n\r\n", "GET /metrics HTTP/1.1\r\n: empty\r\n\r\n"})
    EXPECT_EQ(status_of(respond(bad, c)), "HTTP/1.1 400 Bad Request") << bad;
  EXPECT_EQ(calls, 3) << "nothing collected for what is refused";
  EXPECT_EQ(status_of(respond("GET /metrics HTTP/1.1\r\n\r\n", [] { return std::optional<std::string>(); })),
            "HTTP/1.1 503 Service Unavailable");
}

// Sends `request` to `port` on loopback and returns all it reads until the server closes.
std::string send_request(uint16_t port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
    for (size_t off = 0; off < request.size();) {
      const ssize_t n = ::send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::shutdown(fd, SHUT_WR);
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

// Case: the server on a free loopback port; a scrape, headers over the limit, more connections
// than the limit that stay silent, then a scrape. Expect: 200 with the body; 431; the silent
// ones are dropped for newer connections, so the last scrape is answered.
TEST(Http, ServesAndShedsSilentConnections) {
  auto addr = parse_listen("0");
  ASSERT_TRUE(addr);
  auto srv = HttpServer::start(*addr, [] { return std::optional<std::string>("ibnbd_x 1\n"); });
  ASSERT_TRUE(srv) << srv.error().message();
  const auto& bound = reinterpret_cast<const sockaddr_in&>((*srv)->address());
  const uint16_t port = ntohs(bound.sin_port);
  ASSERT_NE(port, 0);
  std::string r = send_request(port, "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(status_of(r), "HTTP/1.1 200 OK");
  EXPECT_EQ(r.substr(r.size() - 10), "ibnbd_x 1\n");
  r = send_request(port, "GET /metrics HTTP/1.1\r\nX: " + std::string(HttpServer::kMaxRequest, 'a') + "\r\n\r\n");
  EXPECT_EQ(status_of(r), "HTTP/1.1 431 Request Header Fields Too Large");
  std::vector<int> silent;
  for (size_t i = 0; i < HttpServer::kMaxConnections + 8; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa = bound;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    silent.push_back(fd);
  }
  EXPECT_EQ(status_of(send_request(port, "GET /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 200 OK");
  for (int fd : silent) ::close(fd);
}

// Case: the daemon is out of descriptors (RLIMIT_NOFILE reached) while a scraper connects, so
// accept() fails with EMFILE and the listening socket stays readable; then descriptors free up.
// Expect: the metrics thread backs off instead of spinning on poll + accept (the process's CPU
// over 400 ms stays far below 400 ms: a spin would take all of it), and the waiting scraper is
// served once descriptors are back.
TEST(Http, BacksOffWhenOutOfDescriptors) {
  auto addr = parse_listen("0");
  ASSERT_TRUE(addr);
  auto srv = HttpServer::start(*addr, [] { return std::optional<std::string>("ibnbd_x 1\n"); });
  ASSERT_TRUE(srv) << srv.error().message();
  sockaddr_in sa = reinterpret_cast<const sockaddr_in&>((*srv)->address());
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(client, 0);

  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = 256;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> fill;
  for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) fill.push_back(fd);
  ASSERT_EQ(errno, EMFILE);
  ASSERT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);  // queued by the kernel

  auto cpu_ms = [] {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000.0 + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1000.0;
  };
  const double before = cpu_ms();
  ::usleep(400 * 1000);
  const double spent = cpu_ms() - before;

  for (int fd : fill) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_LT(spent, 150.0) << "the metrics thread spun on a listening socket it could not accept from";

  const std::string req = "GET /metrics HTTP/1.1\r\n\r\n";
  ASSERT_EQ(::send(client, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  std::string r;
  char buf[4096];
  for (ssize_t n; (n = ::recv(client, buf, sizeof(buf), 0)) > 0;) r.append(buf, static_cast<size_t>(n));
  ::close(client);
  EXPECT_EQ(status_of(r), "HTTP/1.1 200 OK");
}

}  // namespace
