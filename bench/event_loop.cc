// event-loop: measures the receive/respond loop styles the tcp provider could be built on, on
// loopback, so the choice is made on numbers (docs/benchmarks.md):
//   blocking  read()/write() on a blocking socket (the floor; no event loop at all)
//   epoll     epoll_wait + readv/sendmsg on a non-blocking socket (what the tcp provider does)
//   uring     io_uring: RECV and SEND SQEs, one io_uring_enter per step (liburing)
//   asio      Boost.Asio async_read_some / async_write on an io_context
// The server runs the style under test; the client is always blocking.
//
//   event-loop server STYLE PORT
//   event-loop client PORT rtt [--iters N]        8-byte round trips
//   event-loop client PORT stream [--seconds S]   1 MiB writes, the server reports MiB/s
#include <arpa/inet.h>
#include <liburing.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <utility>  // Boost 1.74 asio uses std::exchange without including it
#include <boost/asio.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kStreamChunk = 1 << 20;

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::exit(1);
}

void nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// The first byte from the client says what it wants: 'r' round trips, 's' a stream.
struct Session {
  char mode = 0;
  uint64_t bytes = 0;
  Clock::time_point start;
  void report() const {
    if (mode != 's') return;
    double secs = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("{\"stream_mib_s\":%.1f}\n", static_cast<double>(bytes) / (1 << 20) / secs);
    std::fflush(stdout);
  }
};

// Consumes bytes read; returns how many to echo back now (8 per completed round-trip message).
size_t consume(Session& s, const char* data, size_t n, size_t& pending) {
  size_t i = 0;
  if (s.mode == 0 && n > 0) {
    s.mode = data[0];
    s.start = Clock::now();
    i = 1;
  }
  s.bytes += n - i;
  if (s.mode != 'r') return 0;
  pending += n - i;
  size_t echo = (pending / 8) * 8;
  pending -= echo;
  return echo;
}

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

void serve_blocking(int fd) {
  std::vector<char> buf(kStreamChunk);
  Session s;
  size_t pending = 0;
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n <= 0) break;
    size_t echo = consume(s, buf.data(), static_cast<size_t>(n), pending);
    if (echo > 0 && !write_all(fd, buf.data(), echo)) break;
  }
  s.report();
}

void serve_epoll(int fd) {
  int one = 1;
  ::ioctl(fd, FIONBIO, &one);
  int ep = ::epoll_create1(0);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  std::vector<char> buf(kStreamChunk);
  Session s;
  size_t pending = 0;
  for (;;) {
    if (::epoll_wait(ep, &ev, 1, -1) < 0 && errno != EINTR) break;
    iovec iov{buf.data(), buf.size()};
    ssize_t n = ::readv(fd, &iov, 1);
    if (n < 0 && errno == EAGAIN) continue;
    if (n <= 0) break;
    size_t echo = consume(s, buf.data(), static_cast<size_t>(n), pending);
    if (echo > 0) {
      iovec out{buf.data(), echo};
      msghdr m{};
      m.msg_iov = &out;
      m.msg_iovlen = 1;
      if (::sendmsg(fd, &m, MSG_NOSIGNAL) != static_cast<ssize_t>(echo)) break;
    }
  }
  ::close(ep);
  s.report();
}

void serve_uring(int fd) {
  io_uring ring;
  if (io_uring_queue_init(8, &ring, 0) != 0) die("io_uring_queue_init");
  std::vector<char> buf(kStreamChunk);
  Session s;
  size_t pending = 0;
  for (;;) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_recv(sqe, fd, buf.data(), buf.size(), 0);
    io_uring_submit_and_wait(&ring, 1);
    io_uring_cqe* cqe;
    io_uring_wait_cqe(&ring, &cqe);
    int n = cqe->res;
    io_uring_cqe_seen(&ring, cqe);
    if (n <= 0) break;
    size_t echo = consume(s, buf.data(), static_cast<size_t>(n), pending);
    if (echo > 0) {
      sqe = io_uring_get_sqe(&ring);
      io_uring_prep_send(sqe, fd, buf.data(), echo, MSG_NOSIGNAL);
      io_uring_submit_and_wait(&ring, 1);
      io_uring_wait_cqe(&ring, &cqe);
      bool ok = cqe->res == static_cast<int>(echo);
      io_uring_cqe_seen(&ring, cqe);
      if (!ok) break;
    }
  }
  io_uring_queue_exit(&ring);
  s.report();
}

void serve_asio(int fd) {
  boost::asio::io_context io;
  boost::asio::ip::tcp::socket sock(io, boost::asio::ip::tcp::v4(), fd);
  std::vector<char> buf(kStreamChunk);
  Session s;
  size_t pending = 0;
  std::function<void()> read_more;
  read_more = [&] {
    sock.async_read_some(boost::asio::buffer(buf), [&](boost::system::error_code ec, size_t n) {
      if (ec) return;
      size_t echo = consume(s, buf.data(), n, pending);
      if (echo == 0) return read_more();
      boost::asio::async_write(sock, boost::asio::buffer(buf.data(), echo),
                               [&](boost::system::error_code wec, size_t) {
                                 if (!wec) read_more();
                               });
    });
  };
  read_more();
  io.run();
  s.report();
}

int connect_to(int port) {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) die("connect");
  nodelay(s);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: event-loop server blocking|epoll|uring|asio PORT | client PORT rtt|stream [--iters N] [--seconds S]\n");
    return 2;
  }
  std::string role = argv[1];
  if (role == "server") {
    std::string style = argv[2];
    int l = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(std::atoi(argv[3])));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(l, 4) != 0) die("listen");
    std::printf("event-loop: listening (%s)\n", style.c_str());
    std::fflush(stdout);
    for (;;) {
      int c = ::accept(l, nullptr, nullptr);
      if (c < 0) die("accept");
      nodelay(c);
      if (style == "blocking") serve_blocking(c);
      else if (style == "epoll") serve_epoll(c);
      else if (style == "uring") serve_uring(c);
      else if (style == "asio") { serve_asio(c); continue; }  // asio closes the socket
      else die("style");
      ::close(c);
    }
  }
  int port = std::atoi(argv[2]);
  std::string test = argv[3];
  int iters = 20000;
  double seconds = 2;
  for (int i = 4; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--iters") iters = std::atoi(argv[i + 1]);
    if (std::string(argv[i]) == "--seconds") seconds = std::atof(argv[i + 1]);
  }
  int s = connect_to(port);
  if (test == "rtt") {
    char m = 'r';
    write_all(s, &m, 1);
    char buf[8] = {};
    std::vector<double> us;
    for (int i = 0; i < iters + 1000; ++i) {
      auto t0 = Clock::now();
      if (!write_all(s, buf, 8)) die("write");
      size_t got = 0;
      while (got < 8) {
        ssize_t n = ::read(s, buf + got, 8 - got);
        if (n <= 0) die("read");
        got += static_cast<size_t>(n);
      }
      if (i >= 1000) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    double avg = 0;
    for (double v : us) avg += v;
    std::printf("{\"rtt_p50_us\":%.2f,\"rtt_avg_us\":%.2f}\n", us[us.size() / 2], avg / static_cast<double>(us.size()));
  } else {
    char m = 's';
    write_all(s, &m, 1);
    std::vector<char> buf(kStreamChunk, 'x');
    auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    while (Clock::now() < until) {
      if (!write_all(s, buf.data(), buf.size())) die("write");
    }
  }
  ::close(s);
  return 0;
}
