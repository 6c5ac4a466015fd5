#include "qemu_rdma_target.h"

#include <cstdlib>
#include <cstring>
#include <span>

#include "qemu_rdma_wire.h"

namespace ibnbd::fuzz {
namespace {

using namespace ibnbd::migrate::qrdma;
constexpr uint64_t MiB = 1ull << 20;

// A pc guest's blocks at QEMU-like destination offsets: a 1 MiB multiple, a block shorter than a
// chunk, one ending in the middle of a chunk.
const RamLayout& the_layout() {
  static const RamLayout l = *RamLayout::make(
      {{"pc.ram", 0, 32 * MiB}, {"/rom@etc/acpi/tables", 64 * MiB, 128 * 1024}, {"odd", 128 * MiB, 3 * MiB / 2}});
  return l;
}

bool inside(std::span<const std::byte> part, std::span<const std::byte> whole) {
  return part.empty() ||
         (part.data() >= whole.data() && part.data() + part.size() <= whole.data() + whole.size());
}

void check_register(const RamLayout& l, const RegisterRequest& r) {
  if (r.block >= l.size()) std::abort();
  const uint64_t len = l.block(r.block).length;
  if (!(r.begin <= r.offset && r.offset < r.end && r.end <= len)) std::abort();
  if (r.first_chunk >= l.chunks(r.block) || r.first_chunk + r.chunks >= l.chunks(r.block)) std::abort();
  if (r.addr != l.block(r.block).offset + r.offset) std::abort();
}

void check_compress(const RamLayout& l, const Compress& c) {
  if (c.block >= l.size() || c.length == 0) std::abort();
  if (c.offset + c.length > l.block(c.block).length) std::abort();
  if ((c.offset >> kChunkShift) != ((c.offset + c.length - 1) >> kChunkShift)) std::abort();
}

// The decoded fields, encoded again, decode to the same fields.
void reencode(const ControlMessage& m, const RamLayout* l) {
  static std::byte out[kControlMaxBuffer];
  Result<size_t> n = ibtrs::errc(EINVAL);
  switch (m.type) {
    case MsgType::register_request: {
      std::vector<RegisterArg> a;
      for (const auto& r : m.registers) a.push_back({r.block, r.offset, r.chunks});
      n = encode_register_request(out, *l, a);
      break;
    }
    case MsgType::unregister_request:
      n = encode_unregister_request(out, *l, m.unregisters);
      break;
    case MsgType::register_result:
      n = encode_register_result(out, m.results);
      break;
    case MsgType::compress:
      n = encode_compress(out, *l, m.compress.block, m.compress.offset, m.compress.length, m.compress.value);
      break;
    case MsgType::qemu_file:
      n = encode_qemu_file(out, m.file);
      break;
    case MsgType::ram_blocks_result: {
      std::vector<RamBlockLayout> dl;
      std::vector<uint64_t> addrs;
      std::vector<uint32_t> rkeys;
      for (size_t i = 0; i < m.blocks.size(); ++i) {
        dl.push_back({l->block(i).name, m.blocks[i].offset, m.blocks[i].length});
        addrs.push_back(m.blocks[i].host_addr);
        rkeys.push_back(m.blocks[i].rkey);
      }
      auto dst = RamLayout::make(dl);
      if (!dst.ok()) std::abort();  // the decoder checked the destination's offsets
      n = encode_ram_blocks_result(out, *dst, addrs, rkeys);
      break;
    }
    default:
      n = encode_empty(out, m.type);
      break;
  }
  if (!n.ok()) std::abort();
  auto again = decode_control(std::span<const std::byte>(out, *n), l);
  if (!again.ok() || again->type != m.type) std::abort();
  const ControlMessage& b = *again;
  if (b.registers.size() != m.registers.size() || b.unregisters.size() != m.unregisters.size() ||
      b.results.size() != m.results.size() || b.blocks.size() != m.blocks.size() || b.file.size() != m.file.size())
    std::abort();
  for (size_t i = 0; i < b.registers.size(); ++i)
    if (b.registers[i].addr != m.registers[i].addr || b.registers[i].end != m.registers[i].end) std::abort();
  for (size_t i = 0; i < b.results.size(); ++i)
    if (b.results[i].rkey != m.results[i].rkey || b.results[i].host_addr != m.results[i].host_addr) std::abort();
  for (size_t i = 0; i < b.blocks.size(); ++i)
    if (b.blocks[i].offset != m.blocks[i].offset || b.blocks[i].host_addr != m.blocks[i].host_addr) std::abort();
  if (m.type == MsgType::compress &&
      (b.compress.addr != m.compress.addr || b.compress.length != m.compress.length || b.compress.value != m.compress.value))
    std::abort();
}

std::vector<uint8_t> seed(uint8_t sel, const std::byte* p, size_t n) {
  std::vector<uint8_t> s{sel};
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  s.insert(s.end(), b, b + n);
  return s;
}

}  // namespace

// Input: [selector: bit 0 = decode with the layout, bit 1 = the bytes are private data][bytes].
int qemu_rdma_one_input(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t sel = data[0];
  std::span<const std::byte> msg(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  if (sel & 2) {
    auto c = decode_caps(msg);
    if (c.ok()) {
      if (c->version != kVersion) std::abort();
      const Caps a = answer_caps(*c, (sel & 4) != 0);
      if ((a.flags & ~kKnownCaps) != 0 || (a.flags & ~c->flags) != 0) std::abort();
      auto enc = encode_caps(a);
      auto back = check_answer(*c, enc);
      if (!back.ok() || back->flags != a.flags) std::abort();
    }
    return 0;
  }
  const RamLayout* l = (sel & 1) ? &the_layout() : nullptr;
  std::string why;
  auto m = decode_control(msg, l, &why);
  if (!m.ok()) {
    if (why.empty()) std::abort();  // every refusal says why
    return 0;
  }
  if (!inside(m->file, msg)) std::abort();
  for (const auto& r : m->registers) check_register(*l, r);
  for (const auto& u : m->unregisters)
    if (u.block >= l->size() || u.chunk >= l->chunks(u.block)) std::abort();
  if (m->type == MsgType::compress) check_compress(*l, m->compress);
  if (m->type == MsgType::ram_blocks_result && m->blocks.size() != l->size()) std::abort();
  reencode(*m, l);
  return 0;
}

std::vector<std::vector<uint8_t>> qemu_rdma_seeds() {
  const RamLayout& l = the_layout();
  std::vector<std::vector<uint8_t>> seeds;
  std::byte out[512];
  auto add = [&](uint8_t sel, Result<size_t> n) {
    if (n.ok()) seeds.push_back(seed(sel, out, *n));
  };
  add(0, encode_empty(out, MsgType::ready));
  add(0, encode_empty(out, MsgType::register_finished));
  const std::byte file[] = {std::byte{'Q'}, std::byte{'E'}, std::byte{'V'}, std::byte{'M'}};
  add(0, encode_qemu_file(out, file));
  const RegisterArg regs[] = {{0, 5 * MiB + 4096, 0}, {2, MiB, 0}};
  add(1, encode_register_request(out, l, regs));
  const UnregisterRequest un[] = {{0, 31}};
  add(1, encode_unregister_request(out, l, un));
  const RegisterResult res[] = {{0x1234, 0x7f0000000000}};
  add(0, encode_register_result(out, res));
  add(1, encode_compress(out, l, 0, 3 * MiB, MiB));
  const uint64_t addrs[] = {0x7f0000000000, 0x7f1000000000, 0x7f2000000000};
  auto dst = RamLayout::packed({{"pc.ram", 0, 32 * MiB}, {"t", 0, 128 * 1024}, {"odd", 0, 3 * MiB / 2}});
  add(1, encode_ram_blocks_result(out, *dst, addrs, {}));
  auto caps = encode_caps({kVersion, kCapPinAll});
  seeds.push_back(seed(2 | 4, caps.data(), caps.size()));
  return seeds;
}

}  // namespace ibnbd::fuzz
