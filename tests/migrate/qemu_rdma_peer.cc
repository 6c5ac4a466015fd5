// qemu-rdma-peer: a hostile source for QEMU's RDMA migration protocol, against the agent's save
// (`ibnbd-migrate save ... rdma HOST:PORT`). Each case connects, misbehaves in one way and checks
// what the agent does about it; prints "ok - CASE: ..." and exits 0 when the agent answered as
// specified, "not ok - CASE: ..." and 1 otherwise (2: usage). tests/migrate/vm_migrate_qemu_rdma.py
// runs it against a fresh agent per case.
//
//   qemu-rdma-peer CASE HOST:PORT
//   CASE: version   capabilities with version 2             -> the connection is rejected
//         type      a control message of type 0 (NONE)      -> ERROR, then a disconnect
//         length    a header claiming 100 payload bytes, 0 sent -> ERROR, disconnect
//         register  (a stream head, RAM BLOCKS) REGISTER of an address past the block -> ERROR
//         compress  (a stream head, RAM BLOCKS) COMPRESS across two chunks -> ERROR
//         stream    QEMU FILE bytes that are not a migration stream -> ERROR
//         write     (a stream head, RAM BLOCKS, REGISTER of chunk 0) an RDMA WRITE into chunk 1
//                   with chunk 0's key -> the device refuses it (remote access error)
#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "qemu_ram_stream.h"
#include "qemu_rdma_endpoint.h"
#include "qemu_rdma_wire.h"

namespace {

using namespace ibnbd::migrate;
using namespace ibnbd::migrate::qrdma;

constexpr uint64_t kRam = 4ull << 20;  // one RAM block of 4 MiB

std::string name_;

int verdict(bool good, const std::string& what) {
  std::printf("%s - %s: %s\n", good ? "ok" : "not ok", name_.c_str(), what.c_str());
  return good ? 0 : 1;
}

Clock::time_point soon() { return Clock::now() + std::chrono::seconds(20); }

// The stream's first bytes up to the setup round's HOOK: "QEVM", version 3, the configuration
// section, the START section of "ram" with its block list, then the HOOK.
std::vector<std::byte> stream_head() {
  std::vector<std::byte> b;
  auto u8 = [&](uint8_t v) { b.push_back(static_cast<std::byte>(v)); };
  auto be32 = [&](uint32_t v) {
    for (int i = 3; i >= 0; --i) u8(static_cast<uint8_t>(v >> (8 * i)));
  };
  auto be64 = [&](uint64_t v) {
    for (int i = 7; i >= 0; --i) u8(static_cast<uint8_t>(v >> (8 * i)));
  };
  auto raw = [&](std::string_view s) {
    for (char c : s) u8(static_cast<uint8_t>(c));
  };
  raw("QEVM");
  be32(3);
  u8(0x07);  // configuration
  be32(13);
  raw("pc-i440fx-7.2");
  u8(0x01);  // SECTION_START
  be32(2);
  u8(3);
  raw("ram");
  be32(0);
  be32(4);
  be64(kRam | qstream::kFlagMemSize);
  u8(6);
  raw("pc.ram");
  be64(kRam);
  qstream::RecordWriter::hook(b);
  return b;
}

struct Peer {
  std::unique_ptr<Link> link;
  RamLayout layout;

  // rdma.c's exchange_send: the agent's READY first, then our message (and its answer).
  Result<std::span<const std::byte>> exchange(size_t n, bool answer) {
    BASE_TRY(link->wait_recv(Link::kReady, soon()));
    if (answer) BASE_TRY(link->post_recv(Link::kData));
    BASE_TRY(link->post_recv(Link::kReady));
    BASE_TRY(link->send(n, soon()));
    if (!answer) return std::span<const std::byte>();
    return link->wait_recv(Link::kData, soon());
  }
  // After a bad message: the agent's next message must be ERROR, then it disconnects.
  int expect_error_and_close(const std::string& sent) {
    auto got = link->wait_recv(Link::kReady, soon());
    if (!got) return verdict(false, "after " + sent + " no ERROR came: " + got.error().message() + " (" + link->last_error() + ")");
    auto m = decode_control(*got, nullptr);
    if (!m || m->type != MsgType::error)
      return verdict(false, "after " + sent + " the agent sent " + (m ? std::string(to_string(m->type)) : "garbage"));
    auto d = link->wait_disconnect_or_recv(Link::kReady, soon());
    if (!d || !*d) return verdict(false, "the agent sent ERROR but did not close");
    return verdict(true, "the agent answered " + sent + " with ERROR and closed");
  }
  // Up to the registration loop: the stream head (HOOK) and the RAM BLOCKS exchange.
  Result<std::vector<DestBlock>> into_registration() {
    const auto head = stream_head();
    BASE_ASSIGN_OR_RETURN(size_t n, encode_qemu_file(link->send_buffer(), head));
    BASE_TRY(exchange(n, false));
    BASE_ASSIGN_OR_RETURN(n, encode_empty(link->send_buffer(), MsgType::ram_blocks_request));
    BASE_ASSIGN_OR_RETURN(auto got, exchange(n, true));
    BASE_ASSIGN_OR_RETURN(auto m, decode_control(got, &layout));
    if (m.type != MsgType::ram_blocks_result) return ibtrs::errc(EPROTO);
    return m.blocks;
  }
};

// Raw bytes as a control message: header (len, type, repeat) + payload, no checks.
size_t raw_message(std::span<std::byte> out, uint32_t len, uint32_t type, uint32_t repeat, size_t payload) {
  HeaderWire h{};
  h.len.set(len);
  h.type.set(type);
  h.repeat.set(repeat);
  std::memcpy(out.data(), &h, sizeof(h));
  std::memset(out.data() + sizeof(h), 0, payload);
  return sizeof(h) + payload;
}

int run(const std::string& c, const RdmaAddress& to) {
  Peer p;
  p.layout = *RamLayout::make({{"pc.ram", 0, kRam}});
  const Caps caps{c == "version" ? 2u : kVersion, 0};
  const auto pd = encode_caps(caps);
  std::vector<std::byte> answer;
  std::string why;
  auto l = Link::connect(to, pd, 4, soon(), &answer, &why);
  if (c == "version") {
    if (!l && l.error().value() == ECONNREFUSED) return verdict(true, "version 2 was rejected");
    return verdict(false, l ? "version 2 was accepted" : "connect: " + why);
  }
  if (!l) return verdict(false, "connect: " + why);
  p.link = std::move(*l);
  auto send_raw = [&](size_t n) -> Status {
    BASE_TRY(p.link->wait_recv(Link::kReady, soon()));
    BASE_TRY(p.link->post_recv(Link::kReady));
    return p.link->send(n, soon());
  };

  if (c == "type" || c == "length" || c == "stream") {
    size_t n = 0;
    if (c == "type") n = raw_message(p.link->send_buffer(), 0, 0, 1, 0);
    if (c == "length") n = raw_message(p.link->send_buffer(), 100, static_cast<uint32_t>(MsgType::qemu_file), 1, 0);
    if (c == "stream") {
      const std::string junk = "NOT A MIGRATION STREAM, JUST BYTES";
      n = *encode_qemu_file(p.link->send_buffer(), {reinterpret_cast<const std::byte*>(junk.data()), junk.size()});
    }
    if (Status s = send_raw(n); !s) return verdict(false, "sending: " + s.error().message());
    return p.expect_error_and_close(c == "type" ? "type 0" : c == "length" ? "a short message" : "a bad stream");
  }

  auto blocks = p.into_registration();
  if (!blocks) return verdict(false, "reaching the registration loop: " + blocks.error().message());
  RamLayout dst = *RamLayout::make({{"pc.ram", (*blocks)[0].offset, kRam}});
  const uint64_t base = (*blocks)[0].offset;
  if (c == "register") {
    // An address one page past the block: the encoder refuses it, so the bytes are built here.
    RegisterWire w{};
    w.key.set(base + kRam + 4096);
    w.current_index.set(0);
    w.chunks.set(0);
    size_t n = raw_message(p.link->send_buffer(), sizeof(w), static_cast<uint32_t>(MsgType::register_request), 1, sizeof(w));
    std::memcpy(p.link->send_buffer().data() + sizeof(HeaderWire), &w, sizeof(w));
    if (Status s = send_raw(n); !s) return verdict(false, "sending: " + s.error().message());
    return p.expect_error_and_close("a REGISTER past the block");
  }
  if (c == "compress") {
    CompressWire w{};
    w.value.set(0);
    w.block_idx.set(0);
    w.offset.set(base + (1u << 20) - 4096);
    w.length.set(8192);
    size_t n = raw_message(p.link->send_buffer(), sizeof(w), static_cast<uint32_t>(MsgType::compress), 1, sizeof(w));
    std::memcpy(p.link->send_buffer().data() + sizeof(HeaderWire), &w, sizeof(w));
    if (Status s = send_raw(n); !s) return verdict(false, "sending: " + s.error().message());
    return p.expect_error_and_close("a COMPRESS across two chunks");
  }
  if (c == "write") {
    const RegisterArg a{0, 0, 0};
    auto n = encode_register_request(p.link->send_buffer(), dst, {&a, 1});
    auto got = p.exchange(*n, true);
    if (!got) return verdict(false, "REGISTER: " + got.error().message());
    auto m = decode_control(*got, nullptr);
    if (!m || m->type != MsgType::register_result || m->results.size() != 1)
      return verdict(false, "no REGISTER RESULT");
    void* page = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) return verdict(false, "mmap");
    std::memset(page, 0xa5, 4096);
    auto mr = p.link->reg(page, 4096, IBV_ACCESS_LOCAL_WRITE, &why);
    if (!mr) return verdict(false, "reg: " + why);
    // Chunk 1 with chunk 0's key: outside the memory the key covers.
    const uint64_t remote = m->results[0].host_addr + (1u << 20);
    if (Status s = p.link->post_write({static_cast<std::byte*>(page), 4096}, (*mr)->lkey(), remote,
                                      m->results[0].rkey, 7);
        !s)
      return verdict(false, "post_write: " + s.error().message());
    auto w = p.link->wait_write(soon());
    mr->reset();
    ::munmap(page, 4096);
    if (w) return verdict(false, "the write outside the registered chunk completed");
    const int rc = verdict(w.error().value() == EACCES,
                           "the write outside the registered chunk failed: " + p.link->last_error());
    // Staying connected a while, as a hostile peer may: the agent must see its QP fail on its
    // own, not take the failure for a close. 3 s: with 1 s an agent slowed by a loaded host
    // (nested TCG at load 7) found the close already there with the flush, and said "the peer
    // closed the connection".
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return rc;
  }
  return verdict(false, "unknown case");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: qemu-rdma-peer version|type|length|register|compress|stream|write HOST:PORT\n");
    return 2;
  }
  name_ = argv[1];
  std::string why;
  auto to = parse_rdma_address(argv[2], &why);
  if (!to) {
    std::fprintf(stderr, "qemu-rdma-peer: %s\n", why.c_str());
    return 2;
  }
  return run(name_, *to);
}
