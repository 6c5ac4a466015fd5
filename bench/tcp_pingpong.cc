// tcp-pingpong: the plain-TCP limit for the fabric latency benchmark. Two processes bounce an
// N-byte message over one TCP connection (TCP_NODELAY), with blocking reads (or busy-polling
// non-blocking reads with --busy-poll), and the client prints the round-trip time.
//
//   tcp-pingpong server PORT
//   tcp-pingpong client HOST PORT [--iters N] [--size B] [--busy-poll] [--json]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::exit(1);
}

bool io(int fd, char* buf, size_t len, bool sending, bool busy) {
  while (len > 0) {
    ssize_t n = sending ? ::send(fd, buf, len, MSG_NOSIGNAL)
                        : ::recv(fd, buf, len, busy ? MSG_DONTWAIT : 0);
    if (n > 0) {
      buf += n;
      len -= static_cast<size_t>(n);
    } else if (n == 0) {
      return false;
    } else if (errno != EINTR && errno != EAGAIN) {
      return false;
    }
  }
  return true;
}

void nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: tcp-pingpong server PORT | client HOST PORT [--iters N] [--size B] [--busy-poll] [--json]\n");
    return 2;
  }
  std::string mode = argv[1];
  if (mode == "server") {
    int l = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(std::atoi(argv[2])));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(l, 4) != 0) die("listen");
    std::printf("tcp-pingpong: listening\n");
    std::fflush(stdout);
    for (;;) {
      int c = ::accept(l, nullptr, nullptr);
      if (c < 0) die("accept");
      nodelay(c);
      uint32_t hdr[2];  // size, busy
      if (!io(c, reinterpret_cast<char*>(hdr), sizeof(hdr), false, false)) { ::close(c); continue; }
      std::vector<char> buf(hdr[0]);
      while (io(c, buf.data(), buf.size(), false, hdr[1] != 0) && io(c, buf.data(), buf.size(), true, false)) {
      }
      ::close(c);
    }
  }
  if (argc < 4) return 2;
  int iters = 20000;
  uint32_t size = 8;
  bool busy = false, json = false;
  for (int i = 4; i < argc; ++i) {
    std::string o = argv[i];
    if (o == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (o == "--size" && i + 1 < argc) size = static_cast<uint32_t>(std::atoi(argv[++i]));
    else if (o == "--busy-poll") busy = true;
    else if (o == "--json") json = true;
  }
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::atoi(argv[3])));
  if (::inet_pton(AF_INET, argv[2], &a.sin_addr) != 1) die("address");
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) die("connect");
  nodelay(s);
  uint32_t hdr[2] = {size, busy ? 1u : 0u};
  if (!io(s, reinterpret_cast<char*>(hdr), sizeof(hdr), true, false)) die("send");
  std::vector<char> buf(size, 'x');
  std::vector<double> us;
  const int warmup = std::min(1000, iters / 10);
  for (int i = 0; i < iters + warmup; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    if (!io(s, buf.data(), size, true, false) || !io(s, buf.data(), size, false, busy)) die("io");
    if (i >= warmup)
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  double avg = 0;
  for (double v : us) avg += v;
  avg /= static_cast<double>(us.size());
  std::sort(us.begin(), us.end());
  double p50 = us[us.size() / 2], p99 = us[us.size() * 99 / 100];
  if (json) {
    std::printf("{\"test\":\"tcp_pingpong\",\"size\":%u,\"avg_us\":%.3f,\"p50_us\":%.3f,\"p99_us\":%.3f}\n", size, avg, p50, p99);
  } else {
    std::printf("tcp ping-pong  size %u B: avg %.2f us  p50 %.2f us  p99 %.2f us\n", size, avg, p50, p99);
  }
  return 0;
}
