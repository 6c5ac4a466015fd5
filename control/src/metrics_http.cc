#include "control/metrics_http.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <exception>
#include <vector>

#include "ibtrs/address.h"

namespace ibnbd::control::metrics {
namespace {

using Clock = std::chrono::steady_clock;

std::string reply(std::string_view status, std::string_view content_type, const std::string& body, bool head,
                  std::string_view extra = {}) {
  std::string r = "HTTP/1.1 ";
  r.append(status);
  r += "\r\nContent-Type: ";
  r.append(content_type);
  r += "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n";
  r.append(extra);
  r += "\r\n";
  if (!head) r += body;
  return r;
}

std::string error_reply(std::string_view status, bool head = false, std::string_view extra = {}) {
  return reply(status, "text/plain; charset=utf-8", std::string(status) + "\n", head, extra);
}

bool is_token(std::string_view s) {
  // RFC 9110's tchar, which methods and header names are made of.
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return std::isalnum(c) || std::string_view("!#$%&'*+-.^_`|~").find(static_cast<char>(c)) != std::string_view::npos;
  });
}

// Where the request's header block ends (after its blank line), or npos.
size_t header_end(std::string_view in) {
  const size_t crlf = in.find("\r\n\r\n");
  const size_t lf = in.find("\n\n");
  if (crlf == std::string_view::npos && lf == std::string_view::npos) return std::string_view::npos;
  return std::min(crlf == std::string_view::npos ? crlf : crlf + 4, lf == std::string_view::npos ? lf : lf + 2);
}

struct Conn {
  base::UniqueFd fd;
  Clock::time_point deadline;
  std::string in;    // the request so far (at most kMaxRequest + one read)
  std::string out;   // the answer, once there is one
  size_t sent = 0;
  enum class Phase { reading, writing, draining } phase = Phase::reading;
};

}  // namespace

Result<sockaddr_storage> parse_listen(std::string_view text) {
  std::string t(text);
  const bool digits_only = !t.empty() && std::all_of(t.begin(), t.end(), [](unsigned char c) { return std::isdigit(c); });
  if (digits_only) t = "127.0.0.1:" + t;
  else if (!t.empty() && t[0] == ':') t = "127.0.0.1" + t;
  // A port is required (ibtrs::Address would default to the transport's): ":PORT" last, after
  // the ']' of an IPv6 address.
  const size_t colon = t.rfind(':');
  if (colon == std::string::npos || colon + 1 == t.size() ||
      !std::all_of(t.begin() + static_cast<std::ptrdiff_t>(colon) + 1, t.end(), [](unsigned char c) { return std::isdigit(c); }) ||
      (t[0] == '[' && t[colon - 1] != ']') || (t[0] != '[' && t.find(':') != colon))
    return errc(EINVAL);
  auto a = ibtrs::Address::parse("tcp:" + t);
  if (!a) return a.error();
  return a->sa;
}

std::string to_string(const sockaddr_storage& sa) {
  ibtrs::Address a;
  a.sa = sa;
  a.port = ntohs(sa.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6&>(sa).sin6_port
                                          : reinterpret_cast<const sockaddr_in&>(sa).sin_port);
  std::string s = a.to_string();
  return s.substr(s.find(':') + 1);  // without the fabric
}

std::string respond(std::string_view request, const HttpServer::Collector& collect) {
  const size_t eol = request.find('\n');
  std::string_view line = request.substr(0, eol);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  // METHOD SP TARGET SP HTTP/1.x, nothing more.
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos)
    return error_reply("400 Bad Request");
  const std::string_view method = line.substr(0, sp1);
  const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = line.substr(sp2 + 1);
  if (!is_token(method) || target.empty() || target[0] != '/' || (version != "HTTP/1.1" && version != "HTTP/1.0"))
    return error_reply("400 Bad Request");
  // Header lines are NAME: VALUE; they are checked, not used.
  for (size_t pos = eol + 1; eol != std::string_view::npos && pos < request.size();) {
    size_t e = request.find('\n', pos);
    std::string_view h = request.substr(pos, e == std::string_view::npos ? e : e - pos);
    pos = e == std::string_view::npos ? request.size() : e + 1;
    if (!h.empty() && h.back() == '\r') h.remove_suffix(1);
    if (h.empty()) break;
    const size_t colon = h.find(':');
    if (colon == std::string_view::npos || !is_token(h.substr(0, colon))) return error_reply("400 Bad Request");
  }
  const bool head = method == "HEAD";
  if (target.substr(0, target.find('?')) != "/metrics") return error_reply("404 Not Found", head);
  if (method != "GET" && !head) return error_reply("405 Method Not Allowed", false, "Allow: GET, HEAD\r\n");
  std::optional<std::string> body;
  try {
    body = collect();
  } catch (const std::exception&) {  // the thread's edge: a failed scrape, not a dead daemon
    return error_reply("500 Internal Server Error", head);
  }
  if (!body) return error_reply("503 Service Unavailable", head);
  return reply("200 OK", "text/plain; version=0.0.4; charset=utf-8", *body, head);
}

Result<std::unique_ptr<HttpServer>> HttpServer::start(const sockaddr_storage& addr, Collector collect) {
  base::UniqueFd fd(::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) return errc(errno);
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const socklen_t len = addr.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0 || ::listen(fd.get(), 128) != 0)
    return errc(errno);
  sockaddr_storage bound{};
  socklen_t blen = sizeof(bound);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &blen) != 0) return errc(errno);
  base::UniqueFd stop(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!stop) return errc(errno);
  std::unique_ptr<HttpServer> s(new HttpServer(std::move(fd), std::move(stop), bound, std::move(collect)));
  s->thread_ = std::thread([p = s.get()] { p->loop(); });
  return s;
}

HttpServer::HttpServer(base::UniqueFd listen, base::UniqueFd stop, sockaddr_storage addr, Collector c)
    : listen_(std::move(listen)), stop_(std::move(stop)), addr_(addr), collect_(std::move(c)) {}

HttpServer::~HttpServer() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t w = ::write(stop_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
}

void HttpServer::loop() {
  std::vector<Conn> conns;
  std::vector<pollfd> pfds;
  char tmp[4096];

  // Sends what the socket takes; at the end, half-closes and waits for the scraper's EOF (a
  // close with its bytes unread would reset the connection and could cut the answer short).
  auto flush = [](Conn& c) {
    while (c.sent < c.out.size()) {
      const ssize_t n = ::send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      c.sent += static_cast<size_t>(n);
    }
    ::shutdown(c.fd.get(), SHUT_WR);
    c.out = std::string();
    c.phase = Conn::Phase::draining;
    return true;
  };
  // Reads what is there; false when the connection is done (EOF, error, drained).
  auto on_readable = [&](Conn& c) {
    for (;;) {
      const ssize_t n = ::recv(c.fd.get(), tmp, sizeof(tmp), MSG_DONTWAIT);
      if (n == 0) return false;
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      if (c.phase != Conn::Phase::reading) continue;  // a body or pipelined bytes: not read
      c.in.append(tmp, static_cast<size_t>(n));
      const size_t end = header_end(c.in);
      if (end != std::string::npos && end <= kMaxRequest) {
        c.out = respond(std::string_view(c.in).substr(0, end), collect_);
      } else if (c.in.size() > kMaxRequest) {
        c.out = error_reply("431 Request Header Fields Too Large");
      } else {
        continue;
      }
      c.in = std::string();
      c.phase = Conn::Phase::writing;
      if (!flush(c)) return false;
    }
  };

  Clock::time_point accept_paused_until{};
  for (;;) {
    const auto now = Clock::now();
    std::erase_if(conns, [&](const Conn& c) { return now >= c.deadline; });
    pfds.clear();
    pfds.push_back({stop_.get(), POLLIN, 0});
    const bool accepting = now >= accept_paused_until;
    pfds.push_back({listen_.get(), static_cast<short>(accepting ? POLLIN : 0), 0});
    auto next = now + std::chrono::seconds(60);
    if (!accepting) next = std::min(next, accept_paused_until);
    for (auto& c : conns) {
      pfds.push_back({c.fd.get(), static_cast<short>(c.phase == Conn::Phase::writing ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
    if (::poll(pfds.data(), pfds.size(), static_cast<int>(std::max<int64_t>(wait, 0))) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (pfds[0].revents != 0) return;
    // Connections first (the new ones below have no pollfd yet); done ones go.
    std::vector<bool> done(conns.size(), false);
    for (size_t i = 0; i < conns.size(); ++i) {
      const short ev = pfds[i + 2].revents;
      if (ev == 0) continue;
      Conn& c = conns[i];
      if (c.phase == Conn::Phase::writing) done[i] = !flush(c) || (ev & (POLLERR | POLLHUP)) != 0;
      else done[i] = !on_readable(c);
    }
    for (size_t i = conns.size(); i-- > 0;)
      if (done[i]) conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
    if ((pfds[1].revents & POLLIN) == 0) continue;
    for (;;) {
      base::UniqueFd fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!fd) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          accept_paused_until = Clock::now() + kAcceptBackoff;
        break;  // EAGAIN: all taken; ECONNABORTED and the like: the next poll retries
      }
      if (conns.size() >= kMaxConnections) {
        // Room for the new one: drop a connection already answered, else the oldest one still
        // sending its request; when every slot is sending an answer, the new one waits no
        // turn and is closed.
        auto victim = std::find_if(conns.begin(), conns.end(), [](const Conn& c) { return c.phase == Conn::Phase::draining; });
        if (victim == conns.end())
          victim = std::find_if(conns.begin(), conns.end(), [](const Conn& c) { return c.phase == Conn::Phase::reading; });
        if (victim == conns.end()) continue;
        conns.erase(victim);
      }
      Conn& c = conns.emplace_back();
      c.fd = std::move(fd);
      c.deadline = Clock::now() + kConnectionTimeout;
    }
  }
}

}  // namespace ibnbd::control::metrics
