#include "base/text.h"
#include "qemu_rdma_wire.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>

namespace ibnbd::migrate::qrdma {
namespace {

std::error_code fail(int e, std::string* why, std::string msg) {
  if (why != nullptr) *why = std::move(msg);
  return ibtrs::errc(e);
}

using base::hex;

template <typename T>
T load(std::span<const std::byte> s, size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof(T));
  return v;
}

template <typename T>
void store(std::span<std::byte> s, size_t at, const T& v) {
  std::memcpy(s.data() + at, &v, sizeof(T));
}

// Header + payload into `out`; the payload is written by `fill` at out[16..16 + len).
template <typename Fill>
Result<size_t> emit(std::span<std::byte> out, MsgType type, uint32_t repeat, size_t len, Fill fill) {
  if (len > kControlMaxBuffer - sizeof(HeaderWire)) return ibtrs::errc(EINVAL);
  if (out.size() < sizeof(HeaderWire) + len) return ibtrs::errc(ENOBUFS);
  HeaderWire h{};
  h.len.set(static_cast<uint32_t>(len));
  h.type.set(static_cast<uint32_t>(type));
  h.repeat.set(repeat);
  store(out, 0, h);
  fill(out.subspan(sizeof(HeaderWire), len));
  return sizeof(HeaderWire) + len;
}

bool payload_free(MsgType t) {
  return t == MsgType::error || t == MsgType::ready || t == MsgType::ram_blocks_request ||
         t == MsgType::register_finished || t == MsgType::unregister_finished;
}

std::string block_name(const RamLayout& l, uint32_t i) {
  return "block " + std::to_string(i) + " '" + l.block(i).name + "'";
}

// addr (destination ram_addr) inside block i: the offset in the block.
Result<uint64_t> offset_in(const RamLayout& l, uint32_t i, uint64_t addr, std::string* why,
                           const char* what) {
  const RamBlockLayout& b = l.block(i);
  if (addr < b.offset || addr - b.offset >= b.length)
    return fail(ERANGE, why, std::string(what) + ": address " + std::to_string(addr) + " outside " +
                                 block_name(l, i) + " [" + std::to_string(b.offset) + ", +" +
                                 std::to_string(b.length) + ")");
  return addr - b.offset;
}

Result<RegisterRequest> check_register(const RamLayout& l, uint32_t block, uint64_t addr,
                                       uint64_t chunks, std::string* why) {
  if (block >= l.size())
    return fail(ERANGE, why, "register: block index " + std::to_string(block) + " of " +
                                 std::to_string(l.size()) + " blocks");
  BASE_ASSIGN_OR_RETURN(uint64_t off, offset_in(l, block, addr, why, "register"));
  RegisterRequest r;
  r.block = block;
  r.addr = addr;
  r.offset = off;
  r.chunks = chunks;
  r.first_chunk = off >> kChunkShift;
  // first_chunk < chunks(block) holds (off < length); the last one must too, without wrapping.
  const uint64_t n = l.chunks(block);
  if (chunks >= n - r.first_chunk)
    return fail(ERANGE, why, "register: chunks " + std::to_string(r.first_chunk) + "+" +
                                 std::to_string(chunks) + " past the " + std::to_string(n) +
                                 " chunks of " + block_name(l, block));
  r.begin = r.first_chunk << kChunkShift;
  r.end = std::min((r.first_chunk + chunks + 1) << kChunkShift, l.block(block).length);
  return r;
}

Result<Compress> check_compress(const RamLayout& l, uint32_t value, uint32_t block, uint64_t addr,
                                uint64_t length, std::string* why) {
  if (value > 0xff)
    return fail(EBADMSG, why, "compress: fill value " + std::to_string(value) + " is not a byte");
  if (block >= l.size())
    return fail(ERANGE, why, "compress: block index " + std::to_string(block) + " of " +
                                 std::to_string(l.size()) + " blocks");
  BASE_ASSIGN_OR_RETURN(uint64_t off, offset_in(l, block, addr, why, "compress"));
  // One chunk at most, and inside the block: [off, off + length) within [chunk start, chunk end).
  const uint64_t chunk_end = std::min(((off >> kChunkShift) + 1) << kChunkShift, l.block(block).length);
  if (length == 0 || length > chunk_end - off)
    return fail(ERANGE, why, "compress: " + std::to_string(length) + " bytes at offset " +
                                 std::to_string(off) + " of " + block_name(l, block) +
                                 " leave its chunk");
  Compress c;
  c.value = static_cast<uint8_t>(value);
  c.block = block;
  c.addr = addr;
  c.offset = off;
  c.length = length;
  return c;
}

}  // namespace

std::string_view to_string(MsgType t) {
  switch (t) {
    case MsgType::none: return "NONE";
    case MsgType::error: return "ERROR";
    case MsgType::ready: return "READY";
    case MsgType::qemu_file: return "QEMU FILE";
    case MsgType::ram_blocks_request: return "RAM BLOCKS REQUEST";
    case MsgType::ram_blocks_result: return "RAM BLOCKS RESULT";
    case MsgType::compress: return "COMPRESS";
    case MsgType::register_request: return "REGISTER REQUEST";
    case MsgType::register_result: return "REGISTER RESULT";
    case MsgType::register_finished: return "REGISTER FINISHED";
    case MsgType::unregister_request: return "UNREGISTER REQUEST";
    case MsgType::unregister_finished: return "UNREGISTER FINISHED";
  }
  return "unknown";
}

// ---- capabilities ----

std::array<std::byte, sizeof(CapsWire)> encode_caps(Caps c) {
  CapsWire w{};
  w.version.set(c.version);
  w.flags.set(c.flags);
  std::array<std::byte, sizeof(CapsWire)> out;
  std::memcpy(out.data(), &w, sizeof(w));
  return out;
}

Result<Caps> decode_caps(std::span<const std::byte> pd, std::string* why) {
  if (pd.size() < sizeof(CapsWire))
    return fail(EBADMSG, why, "capabilities: " + std::to_string(pd.size()) + " bytes of private data, 8 needed");
  const auto w = load<CapsWire>(pd, 0);
  Caps c{w.version.get(), w.flags.get()};
  if (c.version != kVersion)
    return fail(EPROTONOSUPPORT, why, "capabilities: protocol version " + std::to_string(c.version) +
                                          " (only version 1 exists)");
  return c;
}

Caps answer_caps(Caps from_source, bool allow_pin_all) {
  Caps a = from_source;
  a.flags &= kKnownCaps;
  if (!allow_pin_all) a.flags &= ~kCapPinAll;
  return a;
}

Result<Caps> check_answer(Caps asked, std::span<const std::byte> pd, std::string* why) {
  BASE_ASSIGN_OR_RETURN(Caps c, decode_caps(pd, why));
  if ((c.flags & ~asked.flags) != 0)
    return fail(EPROTO, why, "capabilities: the destination granted flags " + hex(c.flags & ~asked.flags) +
                                 " that were not asked for");
  return c;
}

// ---- layout ----

Result<RamLayout> RamLayout::make(std::vector<RamBlockLayout> blocks, std::string* why) {
  if (blocks.empty() || blocks.size() > kMaxRamBlocks)
    return fail(EINVAL, why, "RAM layout: " + std::to_string(blocks.size()) + " blocks (1.." +
                                 std::to_string(kMaxRamBlocks) + ")");
  for (const RamBlockLayout& b : blocks) {
    if (b.length == 0 || b.offset + b.length < b.offset)
      return fail(EINVAL, why, "RAM layout: block '" + b.name + "' has length " + std::to_string(b.length) +
                                   " at offset " + std::to_string(b.offset));
  }
  std::vector<size_t> order(blocks.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return blocks[a].offset < blocks[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const RamBlockLayout& p = blocks[order[k - 1]];
    if (p.offset + p.length > blocks[order[k]].offset)
      return fail(EINVAL, why, "RAM layout: blocks '" + p.name + "' and '" + blocks[order[k]].name + "' overlap");
  }
  RamLayout l;
  l.blocks_ = std::move(blocks);
  return l;
}

Result<RamLayout> RamLayout::packed(std::vector<RamBlockLayout> blocks, std::string* why) {
  uint64_t at = 0;
  for (RamBlockLayout& b : blocks) {
    b.offset = at;
    // Lengths come from a stream: a sum that would wrap is refused.
    const uint64_t rounded = (b.length + kChunkSize - 1) & ~(kChunkSize - 1);
    if (b.length > ~uint64_t{0} - kChunkSize || at > ~uint64_t{0} - rounded)
      return fail(EINVAL, why, "RAM layout: block '" + b.name + "' does not fit the address space");
    at += rounded;
  }
  return make(std::move(blocks), why);
}

// ---- decode ----

Result<ControlMessage> decode_control(std::span<const std::byte> msg, const RamLayout* layout,
                                      std::string* why) {
  if (msg.size() < sizeof(HeaderWire) || msg.size() > kControlMaxBuffer)
    return fail(EBADMSG, why, "control message of " + std::to_string(msg.size()) + " bytes (16.." +
                                  std::to_string(kControlMaxBuffer) + ")");
  const auto h = load<HeaderWire>(msg, 0);
  const uint32_t len = h.len.get();
  const uint32_t type = h.type.get();
  ControlMessage m;
  m.repeat = h.repeat.get();
  if (len != msg.size() - sizeof(HeaderWire))
    return fail(EBADMSG, why, "control header says " + std::to_string(len) + " payload bytes, " +
                                  std::to_string(msg.size() - sizeof(HeaderWire)) + " arrived");
  if (type == 0 || type > kMaxMsgType)
    return fail(EPROTO, why, "control message type " + std::to_string(type) + " unknown");
  m.type = static_cast<MsgType>(type);
  const std::string name(to_string(m.type));
  if (m.type != MsgType::qemu_file && m.repeat > kMaxCommands)
    return fail(EBADMSG, why, name + ": repeat " + std::to_string(m.repeat) + " > " + std::to_string(kMaxCommands));
  const auto payload = msg.subspan(sizeof(HeaderWire));

  if (payload_free(m.type)) {
    if (len != 0) return fail(EBADMSG, why, name + " with " + std::to_string(len) + " payload bytes");
    return m;
  }
  if (m.type == MsgType::qemu_file) {
    m.file = payload;
    return m;
  }
  // Entry arrays: repeat entries of a fixed size, exactly.
  auto entries = [&](size_t size) -> Status {
    if (m.repeat == 0 || static_cast<uint64_t>(m.repeat) * size != len)
      return fail(EBADMSG, why, name + ": repeat " + std::to_string(m.repeat) + " x " + std::to_string(size) +
                                    " bytes != length " + std::to_string(len));
    return {};
  };
  auto need_layout = [&]() -> Status {
    if (layout == nullptr)
      return fail(EPROTO, why, name + " before the RAM block list is known");
    return {};
  };

  switch (m.type) {
    case MsgType::register_result: {
      BASE_TRY(entries(sizeof(RegisterResultWire)));
      m.results.reserve(m.repeat);
      for (uint32_t i = 0; i < m.repeat; ++i) {
        const auto w = load<RegisterResultWire>(payload, i * sizeof(RegisterResultWire));
        m.results.push_back({w.rkey.get(), w.host_addr.get()});
      }
      return m;
    }
    case MsgType::register_request: {
      BASE_TRY(entries(sizeof(RegisterWire)));
      BASE_TRY(need_layout());
      m.registers.reserve(m.repeat);
      for (uint32_t i = 0; i < m.repeat; ++i) {
        const auto w = load<RegisterWire>(payload, i * sizeof(RegisterWire));
        BASE_ASSIGN_OR_RETURN(RegisterRequest r,
                               check_register(*layout, w.current_index.get(), w.key.get(), w.chunks.get(), why));
        m.registers.push_back(r);
      }
      return m;
    }
    case MsgType::unregister_request: {
      BASE_TRY(entries(sizeof(RegisterWire)));
      BASE_TRY(need_layout());
      m.unregisters.reserve(m.repeat);
      for (uint32_t i = 0; i < m.repeat; ++i) {
        const auto w = load<RegisterWire>(payload, i * sizeof(RegisterWire));
        const uint32_t b = w.current_index.get();
        const uint64_t chunk = w.key.get();
        if (b >= layout->size() || chunk >= layout->chunks(b))
          return fail(ERANGE, why, "unregister: block " + std::to_string(b) + " chunk " + std::to_string(chunk) +
                                       " outside the layout");
        m.unregisters.push_back({b, chunk});
      }
      return m;
    }
    case MsgType::compress: {
      // QEMU's destination reads one entry whatever repeat says; its source sends repeat 1.
      if (m.repeat != 1 || len != sizeof(CompressWire))
        return fail(EBADMSG, why, name + ": repeat " + std::to_string(m.repeat) + ", length " +
                                      std::to_string(len) + " (one 24-byte entry expected)");
      BASE_TRY(need_layout());
      const auto w = load<CompressWire>(payload, 0);
      BASE_ASSIGN_OR_RETURN(m.compress, check_compress(*layout, w.value.get(), w.block_idx.get(),
                                                        w.offset.get(), w.length.get(), why));
      return m;
    }
    case MsgType::ram_blocks_result: {
      // repeat is 1 here (QEMU), not the entry count: the length says how many blocks.
      if (len == 0 || len % sizeof(DestBlockWire) != 0 || len / sizeof(DestBlockWire) > kMaxRamBlocks)
        return fail(EBADMSG, why, name + ": length " + std::to_string(len) + " is not 1.." +
                                      std::to_string(kMaxRamBlocks) + " entries of 32 bytes");
      BASE_TRY(need_layout());
      const size_t n = len / sizeof(DestBlockWire);
      if (n != layout->size())
        return fail(ERANGE, why, name + ": " + std::to_string(n) + " blocks, the stream has " +
                                     std::to_string(layout->size()));
      m.blocks.reserve(n);
      for (size_t i = 0; i < n; ++i) {
        const auto w = load<DestBlockWire>(payload, i * sizeof(DestBlockWire));
        DestBlock d{w.remote_host_addr.get(), w.offset.get(), w.length.get(), w.remote_rkey.get()};
        if (d.length != layout->block(i).length)
          return fail(ERANGE, why, name + ": " + block_name(*layout, static_cast<uint32_t>(i)) + " has " +
                                       std::to_string(d.length) + " bytes at the destination, " +
                                       std::to_string(layout->block(i).length) + " here");
        m.blocks.push_back(d);
      }
      // The destination's offsets must make a layout of their own (REGISTER / COMPRESS
      // addresses are translated into it).
      std::vector<RamBlockLayout> dl;
      dl.reserve(n);
      for (size_t i = 0; i < n; ++i) dl.push_back({layout->block(i).name, m.blocks[i].offset, m.blocks[i].length});
      std::string lwhy;
      if (!RamLayout::make(std::move(dl), &lwhy).ok()) return fail(ERANGE, why, name + ": " + lwhy);
      return m;
    }
    default:
      break;
  }
  return fail(EPROTO, why, name + " not handled");  // unreachable: every type is above
}

// ---- encode ----

Result<size_t> encode_empty(std::span<std::byte> out, MsgType type) {
  if (!payload_free(type)) return ibtrs::errc(EINVAL);
  return emit(out, type, 1, 0, [](std::span<std::byte>) {});
}

Result<size_t> encode_qemu_file(std::span<std::byte> out, std::span<const std::byte> bytes) {
  return emit(out, MsgType::qemu_file, 1, bytes.size(),
              [&](std::span<std::byte> p) { std::memcpy(p.data(), bytes.data(), bytes.size()); });
}

Result<size_t> encode_ram_blocks_result(std::span<std::byte> out, const RamLayout& layout,
                                        std::span<const uint64_t> host_addrs,
                                        std::span<const uint32_t> rkeys) {
  if (layout.size() == 0 || host_addrs.size() != layout.size() ||
      (!rkeys.empty() && rkeys.size() != layout.size()))
    return ibtrs::errc(EINVAL);
  return emit(out, MsgType::ram_blocks_result, 1, layout.size() * sizeof(DestBlockWire), [&](std::span<std::byte> p) {
    for (size_t i = 0; i < layout.size(); ++i) {
      DestBlockWire w{};
      w.remote_host_addr.set(host_addrs[i]);
      w.offset.set(layout.block(i).offset);
      w.length.set(layout.block(i).length);
      w.remote_rkey.set(rkeys.empty() ? 0 : rkeys[i]);
      store(p, i * sizeof(w), w);
    }
  });
}

Result<size_t> encode_register_request(std::span<std::byte> out, const RamLayout& layout,
                                       std::span<const RegisterArg> regs) {
  if (regs.empty() || regs.size() > kMaxCommands) return ibtrs::errc(EINVAL);
  for (const RegisterArg& r : regs) {
    if (r.block >= layout.size() || r.offset >= layout.block(r.block).length) return ibtrs::errc(EINVAL);
    if (!check_register(layout, r.block, layout.block(r.block).offset + r.offset, r.chunks, nullptr).ok())
      return ibtrs::errc(EINVAL);
  }
  return emit(out, MsgType::register_request, static_cast<uint32_t>(regs.size()), regs.size() * sizeof(RegisterWire),
              [&](std::span<std::byte> p) {
                for (size_t i = 0; i < regs.size(); ++i) {
                  RegisterWire w{};
                  w.key.set(layout.block(regs[i].block).offset + regs[i].offset);
                  w.current_index.set(regs[i].block);
                  w.chunks.set(regs[i].chunks);
                  store(p, i * sizeof(w), w);
                }
              });
}

Result<size_t> encode_unregister_request(std::span<std::byte> out, const RamLayout& layout,
                                         std::span<const UnregisterRequest> regs) {
  if (regs.empty() || regs.size() > kMaxCommands) return ibtrs::errc(EINVAL);
  for (const UnregisterRequest& r : regs)
    if (r.block >= layout.size() || r.chunk >= layout.chunks(r.block)) return ibtrs::errc(EINVAL);
  return emit(out, MsgType::unregister_request, static_cast<uint32_t>(regs.size()),
              regs.size() * sizeof(RegisterWire), [&](std::span<std::byte> p) {
                for (size_t i = 0; i < regs.size(); ++i) {
                  RegisterWire w{};
                  w.key.set(regs[i].chunk);
                  w.current_index.set(regs[i].block);
                  store(p, i * sizeof(w), w);
                }
              });
}

Result<size_t> encode_register_result(std::span<std::byte> out, std::span<const RegisterResult> results) {
  if (results.empty() || results.size() > kMaxCommands) return ibtrs::errc(EINVAL);
  return emit(out, MsgType::register_result, static_cast<uint32_t>(results.size()),
              results.size() * sizeof(RegisterResultWire), [&](std::span<std::byte> p) {
                for (size_t i = 0; i < results.size(); ++i) {
                  RegisterResultWire w{};
                  w.rkey.set(results[i].rkey);
                  w.host_addr.set(results[i].host_addr);
                  store(p, i * sizeof(w), w);
                }
              });
}

Result<size_t> encode_compress(std::span<std::byte> out, const RamLayout& layout, uint32_t block,
                               uint64_t offset, uint64_t length, uint8_t value) {
  if (block >= layout.size() || offset >= layout.block(block).length) return ibtrs::errc(EINVAL);
  const uint64_t addr = layout.block(block).offset + offset;
  if (!check_compress(layout, value, block, addr, length, nullptr).ok()) return ibtrs::errc(EINVAL);
  return emit(out, MsgType::compress, 1, sizeof(CompressWire), [&](std::span<std::byte> p) {
    CompressWire w{};
    w.value.set(value);
    w.block_idx.set(block);
    w.offset.set(addr);
    w.length.set(length);
    store(p, 0, w);
  });
}

}  // namespace ibnbd::migrate::qrdma
