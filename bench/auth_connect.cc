// auth-connect: the time a client session takes to open (ClientSession::open: every connection
// of one path, INFO_REQ / INFO_RSP) without authentication, with DH-HMAC-CHAP, and with the
// server proving its key too (bidirectional), against one in-process server on loopback tcp;
// and the cost of the exchange's cryptography alone. A benchmark, not a test: it asserts
// nothing (bench/auth_connect.sh runs it; figures in docs/security.d/auth-bench.md).
//
//   auth-connect [--count N] [--io-threads T] [--fabric tcp|loopback]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "auth/chap.h"
#include "ibtrs/auth.h"
#include "ibtrs/client.h"
#include "ibtrs/server.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Nothing final : ibtrs::ServerHandler {
  void on_request(ibtrs::ServerRequest& r) override { r.complete(0); }
};

struct Stats {
  double min, median, p90, p99, mean;
};

Stats stats_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))]; };
  return {v.front(), at(0.5), at(0.9), at(0.99), sum / static_cast<double>(v.size())};
}

[[noreturn]] void die(const std::string& m) {
  std::fprintf(stderr, "auth-connect: %s\n", m.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  int count = 200;
  uint32_t io_threads = 2;
  std::string fabric = "tcp";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) die("usage: auth-connect [--count N] [--io-threads T] [--fabric tcp|loopback]");
    if (a == "--count") count = std::max(1, std::atoi(argv[++i]));
    else if (a == "--io-threads") io_threads = static_cast<uint32_t>(std::max(1, std::atoi(argv[++i])));
    else if (a == "--fabric") fabric = argv[++i];
    else die("unknown option " + a);
  }
  const std::string host = "nqn.2014-08.org.nvmexpress:uuid:be000000-0000-4000-8000-000000000001";
  const ibtrs::Secret key = *ibtrs::Secret::generate();
  const ibtrs::Secret server_key = *ibtrs::Secret::generate();
  ibtrs::KeyTable keys;
  (void)keys.set(host, ibtrs::HostKeys{{key}, server_key});
  Nothing handler;
  ibtrs::ServerOptions so;
  auto listen = ibtrs::Address::parse(fabric == "tcp" ? "tcp:127.0.0.1:0" : "loopback:bench:0");
  if (!listen) die("--fabric: tcp or loopback");
  so.listen.push_back(*listen);
  so.io_threads = io_threads;
  so.handler = &handler;
  so.authenticator = &keys;
  so.allow_any_host = true;  // the anonymous row
  auto srv = ibtrs::Server::start(so);
  if (!srv) die("server: " + srv.error().message());
  const ibtrs::Address addr = (*srv)->addresses()[0];

  struct Mode {
    const char* name;
    bool auth, bidi;
  };
  const Mode modes[] = {{"none (allow_any_host)", false, false},
                        {"DH-HMAC-CHAP", true, false},
                        {"DH-HMAC-CHAP, bidirectional", true, true}};
  // The modes take turns, open by open, so that a change of the host's load touches all alike.
  std::vector<std::vector<double>> ms(std::size(modes));
  for (int i = 0; i < count + 5; ++i) {
    for (size_t k = 0; k < std::size(modes); ++k) {
      const Mode& m = modes[k];
      ibtrs::ClientOptions co;
      co.session_name = "bench-" + std::to_string(k) + "-" + std::to_string(i);
      co.paths.push_back(ibtrs::PathSpec{std::nullopt, addr});
      co.io_threads = io_threads;
      if (m.auth) {
        co.auth.host_id = host;
        co.auth.key = key;
        if (m.bidi) co.auth.server_key = server_key;
      }
      const auto t0 = Clock::now();
      auto c = ibtrs::ClientSession::open(std::move(co));
      const auto t1 = Clock::now();
      if (!c) die(std::string(m.name) + ": open: " + c.error().message());
      if (i >= 5) ms[k].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());  // 5 warm-up rounds
    }
  }
  std::printf("| authentication | opens | min ms | median ms | p90 ms | p99 ms | mean ms |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (size_t k = 0; k < std::size(modes); ++k) {
    const Stats s = stats_of(ms[k]);
    std::printf("| %s | %d | %.3f | %.3f | %.3f | %.3f | %.3f |\n", modes[k].name, count, s.min, s.median,
                s.p90, s.p99, s.mean);
  }
  // The exchange's cryptography alone, both sides of one bidirectional exchange: two X25519
  // key pairs and derivations, the augmented challenges, R1 and R2 computed by the client and
  // checked by the server (each side computes both).
  {
    std::vector<double> us;
    ibtrs::auth::Transcript t;
    t.host = host;
    t.sessname = "bench";
    t.pathname = "a@b";
    ibtrs::auth::Nonce c1{}, c2{};
    for (int i = 0; i < count * 10; ++i) {
      const auto t0 = Clock::now();
      auto x = ibtrs::auth::X25519::generate();
      auto y = ibtrs::auth::X25519::generate();
      auto zs = x->derive(y->public_key());
      auto zc = y->derive(x->public_key());
      for (const auto* z : {&*zc, &*zs}) {
        (void)ibtrs::auth::response(ibtrs::auth::Role::host, key, *z, c1, 1, t);
        (void)ibtrs::auth::response(ibtrs::auth::Role::server, server_key, *z, c2, 2, t);
      }
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    const Stats s = stats_of(us);
    std::printf("\ncryptography of one bidirectional exchange, both sides (%d runs): median %.1f us, "
                "p99 %.1f us\n", count * 10, s.median, s.p99);
  }
  const auto c = (*srv)->auth_counters();
  std::printf("\nserver: %llu paths authenticated, %llu anonymous, %llu refused\n",
              static_cast<unsigned long long>(c.authenticated), static_cast<unsigned long long>(c.anonymous),
              static_cast<unsigned long long>(c.refused_bad_response + c.refused_unknown_host + c.refused_protocol));
  return 0;
}
