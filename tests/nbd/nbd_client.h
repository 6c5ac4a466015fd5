// A minimal, blocking NBD client for the server's tests: raw bytes over a socket, every wait
// bounded, so a test sees exactly what the server sent (or that it closed).
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "ibnbd/nbd_proto.h"

namespace ibnbd::nbd::test {

using Bytes = std::vector<unsigned char>;

inline void put16(Bytes& b, uint16_t v) {
  b.push_back(static_cast<unsigned char>(v >> 8));
  b.push_back(static_cast<unsigned char>(v));
}
inline void put32(Bytes& b, uint32_t v) {
  put16(b, static_cast<uint16_t>(v >> 16));
  put16(b, static_cast<uint16_t>(v));
}
inline void put64(Bytes& b, uint64_t v) {
  put32(b, static_cast<uint32_t>(v >> 32));
  put32(b, static_cast<uint32_t>(v));
}
inline uint16_t get16(const unsigned char* p) { return static_cast<uint16_t>(p[0] << 8 | p[1]); }
inline uint32_t get32(const unsigned char* p) { return uint32_t{get16(p)} << 16 | get16(p + 2); }
inline uint64_t get64(const unsigned char* p) { return uint64_t{get32(p)} << 32 | get32(p + 4); }

struct OptReply {
  uint32_t option = 0;
  uint32_t type = 0;
  Bytes data;
};

// A reply of the transmission phase: simple or one structured chunk.
struct Reply {
  bool structured = false;
  uint16_t flags = 0;  // chunk flags
  uint16_t type = 0;   // chunk type
  uint32_t error = 0;  // simple reply error, or the error of an error chunk
  uint64_t handle = 0;
  Bytes payload;       // chunk payload (structured)
};

class Client {
 public:
  explicit Client(int fd) : fd_(fd) {}
  ~Client() {
    if (fd_ >= 0) ::close(fd_);
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  int fd() const { return fd_; }

  bool send(const Bytes& b) {
    size_t off = 0;
    while (off < b.size()) {
      ssize_t n = ::send(fd_, b.data() + off, b.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  // Exactly n bytes, or nullopt on EOF / error / timeout.
  std::optional<Bytes> recv(size_t n, int timeout_ms = 5000) {
    Bytes b(n);
    size_t off = 0;
    while (off < n) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, timeout_ms) <= 0) return std::nullopt;
      ssize_t r = ::recv(fd_, b.data() + off, n - off, 0);
      if (r <= 0) return std::nullopt;
      off += static_cast<size_t>(r);
    }
    return b;
  }
  // True when the server closed the connection (EOF or reset) within the timeout; data that
  // arrives first is skipped.
  bool closed(int timeout_ms = 5000) {
    unsigned char buf[4096];
    for (;;) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, timeout_ms) <= 0) return false;
      ssize_t r = ::recv(fd_, buf, sizeof(buf), 0);
      if (r <= 0) return true;
    }
  }

  // Greeting and client flags. Returns the handshake flags, or -1.
  int handshake(uint32_t client_flags = wire::kClientFixedNewstyle | wire::kClientNoZeroes) {
    auto g = recv(18);
    if (!g || get64(g->data()) != wire::kNbdMagic || get64(g->data() + 8) != wire::kOptMagic) return -1;
    Bytes f;
    put32(f, client_flags);
    if (!send(f)) return -1;
    return get16(g->data() + 16);
  }
  bool option(uint32_t opt, const Bytes& data) {
    Bytes b;
    put64(b, wire::kOptMagic);
    put32(b, opt);
    put32(b, static_cast<uint32_t>(data.size()));
    b.insert(b.end(), data.begin(), data.end());
    return send(b);
  }
  std::optional<OptReply> opt_reply() {
    auto h = recv(20);
    if (!h || get64(h->data()) != wire::kRepMagic) return std::nullopt;
    OptReply r{get32(h->data() + 8), get32(h->data() + 12), {}};
    const uint32_t len = get32(h->data() + 16);
    if (len > 0) {
      auto d = recv(len);
      if (!d) return std::nullopt;
      r.data = *d;
    }
    return r;
  }
  // Replies up to and including the final one (ACK or an error).
  std::vector<OptReply> opt_replies() {
    std::vector<OptReply> v;
    for (;;) {
      auto r = opt_reply();
      if (!r) return v;
      v.push_back(*r);
      if (r->type == wire::kRepAck || (r->type & 0x80000000u)) return v;
    }
  }
  static Bytes info_data(const std::string& name, std::vector<uint16_t> infos) {
    Bytes b;
    put32(b, static_cast<uint32_t>(name.size()));
    b.insert(b.end(), name.begin(), name.end());
    put16(b, static_cast<uint16_t>(infos.size()));
    for (auto i : infos) put16(b, i);
    return b;
  }
  static Bytes meta_data(const std::string& name, std::vector<std::string> queries) {
    Bytes b;
    put32(b, static_cast<uint32_t>(name.size()));
    b.insert(b.end(), name.begin(), name.end());
    put32(b, static_cast<uint32_t>(queries.size()));
    for (auto& q : queries) {
      put32(b, static_cast<uint32_t>(q.size()));
      b.insert(b.end(), q.begin(), q.end());
    }
    return b;
  }
  // Handshake + optional structured replies (+ base:allocation) + GO. Returns the
  // transmission flags (0 on failure) and the size.
  uint16_t go(bool structured, bool meta = false, const std::string& name = "",
              uint64_t* size = nullptr) {
    if (handshake() < 0) return 0;
    if (structured) {
      option(wire::kOptStructuredReply, {});
      auto r = opt_reply();
      if (!r || r->type != wire::kRepAck) return 0;
      structured_ = true;
    }
    if (meta) {
      option(wire::kOptSetMetaContext, meta_data(name, {"base:allocation"}));
      auto rs = opt_replies();
      if (rs.empty() || rs.back().type != wire::kRepAck) return 0;
    }
    option(wire::kOptGo, info_data(name, {wire::kInfoBlockSize}));
    uint16_t flags = 0;
    for (auto& r : opt_replies()) {
      if (r.type == wire::kRepInfo && get16(r.data.data()) == wire::kInfoExport) {
        if (size) *size = get64(r.data.data() + 2);
        flags = get16(r.data.data() + 10);
      }
      if (r.type != wire::kRepInfo && r.type != wire::kRepAck) return 0;
    }
    return flags;
  }

  bool request(uint16_t type, uint16_t flags, uint64_t handle, uint64_t off, uint32_t len,
               const Bytes& data = {}) {
    Bytes b;
    put32(b, wire::kRequestMagic);
    put16(b, flags);
    put16(b, type);
    put64(b, handle);
    put64(b, off);
    put32(b, len);
    b.insert(b.end(), data.begin(), data.end());
    return send(b);
  }
  // One reply; `read_len` is the data length a simple READ reply carries on success.
  std::optional<Reply> reply(uint32_t read_len = 0) {
    auto m = recv(4);
    if (!m) return std::nullopt;
    Reply r;
    const uint32_t magic = get32(m->data());
    if (magic == wire::kSimpleReplyMagic) {
      auto h = recv(12);
      if (!h) return std::nullopt;
      r.error = get32(h->data());
      r.handle = get64(h->data() + 4);
      if (r.error == 0 && read_len > 0) {
        auto d = recv(read_len);
        if (!d) return std::nullopt;
        r.payload = *d;
      }
      return r;
    }
    if (magic != wire::kStructuredReplyMagic) return std::nullopt;
    auto h = recv(16);
    if (!h) return std::nullopt;
    r.structured = true;
    r.flags = get16(h->data());
    r.type = get16(h->data() + 2);
    r.handle = get64(h->data() + 4);
    const uint32_t len = get32(h->data() + 12);
    if (len > 0) {
      auto d = recv(len);
      if (!d) return std::nullopt;
      r.payload = *d;
    }
    if (r.type & 0x8000) r.error = r.payload.size() >= 4 ? get32(r.payload.data()) : ~0u;
    return r;
  }
  bool structured() const { return structured_; }

 private:
  int fd_;
  bool structured_ = false;
};

}  // namespace ibnbd::nbd::test
