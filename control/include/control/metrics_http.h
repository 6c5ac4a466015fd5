// The daemons' metrics endpoint (--metrics-listen ADDR:PORT): a small, strict HTTP/1.x server
// that answers GET and HEAD /metrics with the Prometheus text a collector writes, 404 for other
// paths, 405 for other methods, 400 for what is not HTTP, 431 for headers beyond kMaxRequest.
// Every answer closes the connection.
//
// A scraper is a peer like any other: one thread serves every connection with non-blocking
// sockets and poll(2), so a silent or slow scraper holds a slot, never the thread; each
// connection has kConnectionTimeout for its request and its answer; at kMaxConnections the
// oldest connection still sending its request is dropped for the new one (a flood of silent
// connections cannot lock scrapers out); requests are read up to kMaxRequest and never kept.
// The collector runs on that thread, one scrape at a time: daemons read the counters their
// stats commands read (no lock of the IO path).
#pragma once

#include <netinet/in.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "ibnbd/types.h"
#include "base/unique_fd.h"

namespace ibnbd::control::metrics {

// ADDR:PORT with ADDR numeric IPv4 or [IPv6]; ":PORT" and "PORT" are 127.0.0.1:PORT (loopback
// unless an address is named). PORT 0 picks a free one. EINVAL otherwise.
Result<sockaddr_storage> parse_listen(std::string_view text);
// "127.0.0.1:9100", "[::1]:9100".
std::string to_string(const sockaddr_storage& sa);

class HttpServer {
 public:
  // The body of one scrape, or nothing when the daemon cannot answer now (503). Called on the
  // server's thread.
  using Collector = std::function<std::optional<std::string>()>;

  static constexpr size_t kMaxRequest = 8192;        // request line and headers
  static constexpr size_t kMaxConnections = 32;
  static constexpr std::chrono::milliseconds kConnectionTimeout{5000};
  // After accept() fails for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM),
  // the listening socket stays readable: it is left out of the poll this long, not spun on.
  static constexpr std::chrono::milliseconds kAcceptBackoff{100};

  // Binds and listens on `addr`, then serves on a thread of its own until destroyed. Errors:
  // what socket/bind/listen return (EADDRINUSE, EACCES, EADDRNOTAVAIL, ...).
  static Result<std::unique_ptr<HttpServer>> start(const sockaddr_storage& addr, Collector collect);
  ~HttpServer();  // closes every connection, joins the thread
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The bound address (the port picked for PORT 0).
  const sockaddr_storage& address() const { return addr_; }

 private:
  HttpServer(base::UniqueFd listen, base::UniqueFd stop, sockaddr_storage addr, Collector c);
  void loop();

  base::UniqueFd listen_;
  base::UniqueFd stop_;  // eventfd: the destructor's signal to the thread
  sockaddr_storage addr_;
  Collector collect_;
  std::thread thread_;
};

// What the server answers to one request (exposed for the unit test): the whole response with
// status line and headers. `request` holds at least the request line and headers up to the
// blank line.
std::string respond(std::string_view request, const HttpServer::Collector& collect);

}  // namespace ibnbd::control::metrics
