#include "proto_target.h"

#include <cstdlib>
#include <cstring>

#include "proto/ibtrs_proto.h"

namespace ibtrs::fuzz {
namespace {

using namespace ibtrs::proto;

bool inside(std::span<const std::byte> part, std::span<const std::byte> whole) {
  return part.empty() ||
         (part.data() >= whole.data() && part.data() + part.size() <= whole.data() + whole.size());
}

template <typename T>
void put(std::vector<uint8_t>& out, const T& v) {
  auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

}  // namespace

// Input: [selector][selector-specific parameters][message bytes].
int proto_one_input(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  const uint8_t which = data[0] % 7;
  uint32_t param;
  std::memcpy(&param, data + 1, 4);
  std::span<const std::byte> msg(reinterpret_cast<const std::byte*>(data + 5), size - 5);
  std::string why;
  switch (which) {
    case 0:
      (void)parse_con_req(msg, &why);
      break;
    case 1: {
      auto r = parse_con_rsp(msg, &why);
      // An accepted geometry must be usable as an immediate layout.
      if (r.ok() && r->errno_.get() == 0 && !imm_layout(r->queue_depth.get(), r->chunk_size.get()))
        std::abort();
      break;
    }
    case 2:
      (void)parse_info_req(msg, &why);
      break;
    case 3: {
      auto r = parse_info_rsp(msg, static_cast<uint16_t>(param), param >> 16 << 12, &why);
      if (r.ok() && !inside(std::as_bytes(*r), msg)) std::abort();
      break;
    }
    case 5: {
      // PATH_FENCE: one encoding per message (what is accepted is what the builder makes).
      auto r = parse_path_fence(msg, &why);
      if (r.ok()) {
        const PathFence back = make_path_fence(r->path_uuid, r->recon_cnt);
        if (msg.size() != sizeof(back) || std::memcmp(&back, msg.data(), sizeof(back)) != 0) std::abort();
      }
      break;
    }
    case 6: {
      auto r = parse_fence_rsp(msg, &why);
      if (r.ok()) {
        if (r->status != kFenceClosed && r->status != kFenceNotLive) std::abort();
        const FenceRsp back = make_fence_rsp(r->status, r->path_uuid, r->recon_cnt);
        if (msg.size() != sizeof(back) || std::memcmp(&back, msg.data(), sizeof(back)) != 0) std::abort();
      }
      break;
    }
    default: {
      // The message bytes are the chunk; param is the immediate's offset.
      // The header bytes come back in the copy, the write payload in the chunk.
      static std::byte copy[4096];
      auto r = parse_io_req(msg, param & 0xfffff, 4096, copy, &why);
      if (r.ok()) {
        if (r->kind == IoKind::write) {
          if (!inside(r->write.data, msg) || !inside(r->write.usr, copy)) std::abort();
        } else {
          if (!inside(r->read.usr, copy) || !inside(std::as_bytes(r->read.descs), copy)) std::abort();
        }
      }
      // The same bytes as a session's chunks with chunk sets: chunks of 64 << (0..7) bytes,
      // the lead and offset from the parameter, max_io_size up to four chunks less a header of
      // at most 64 bytes. Whatever comes back lies in the chunks (data) or the copy (headers),
      // and a write's data starts at a chunk's start.
      const uint32_t cs = 64u << ((param >> 20) & 7);
      const size_t whole = msg.size() / cs * cs;
      if (whole > 0) {
        const SetGeometry g{cs, 64, 4 * cs - 64 - ((param >> 23) & 63)};
        const uint32_t lead = (param >> 26) % static_cast<uint32_t>(whole / cs);
        auto area = msg.first(whole);
        auto q = parse_io_req(area, g, lead, (param & 0xfffff) % cs, copy, &why);
        if (q.ok()) {
          if (q->kind == IoKind::write) {
            if (!inside(q->write.data, area) || !inside(q->write.usr, copy) ||
                q->write.data.size() > g.max_io_size ||
                (q->write.data.data() - area.data()) % cs != 0)
              std::abort();
          } else {
            if (!inside(q->read.data, area) || !inside(q->read.usr, copy) ||
                !inside(std::as_bytes(q->read.descs), copy) || q->read.data.size() != q->read.total_len)
              std::abort();
          }
        }
      }
      break;
    }
  }
  return 0;
}

std::vector<std::vector<uint8_t>> proto_seeds() {
  std::vector<std::vector<uint8_t>> seeds;
  Uuid a{}, b{};
  a[0] = 1;
  b[0] = 2;
  {
    std::vector<uint8_t> s{0, 0, 0, 0, 0};
    put(s, make_con_req(0, 3, 1, true, a, b));
    seeds.push_back(s);
  }
  {
    std::vector<uint8_t> s{1, 0, 0, 0, 0};
    put(s, make_con_rsp(0, 512, 128 * 1024, 4096, 0));
    seeds.push_back(s);
  }
  {
    std::vector<uint8_t> s{2, 0, 0, 0, 0};
    put(s, make_info_req("sess", "ip:1.2.3.4@ip:5.6.7.8").value());
    seeds.push_back(s);
  }
  {
    std::vector<uint8_t> s{5, 0, 0, 0, 0};
    put(s, make_path_fence(b, 3));
    seeds.push_back(s);
  }
  {
    std::vector<uint8_t> s{6, 0, 0, 0, 0};
    put(s, make_fence_rsp(kFenceClosed, b, 3));
    seeds.push_back(s);
  }
  {
    // 2 chunks of 8 KiB: param = count | (8192 >> 12) << 16
    std::vector<uint8_t> s{3, 2, 0, 2, 0};
    InfoRspHeader h{};
    h.type.set(static_cast<uint16_t>(MsgType::info_rsp));
    h.sg_cnt.set(2);
    put(s, h);
    for (int i = 0; i < 2; ++i) {
      ChunkDesc d{};
      d.addr.set(0x10000 + i * 8192);
      d.len.set(8192);
      put(s, d);
    }
    seeds.push_back(s);
  }
  {
    // write: 64 data bytes, 16 header bytes, message at 80
    std::vector<uint8_t> s{4, 80, 0, 0, 0};
    s.resize(5 + 80, 0xab);
    WriteMsg m{};
    m.type.set(static_cast<uint16_t>(MsgType::write));
    m.usr_len.set(16);
    m.data_len.set(64);
    put(s, m);
    s.resize(s.size() + 64, 0);
    seeds.push_back(s);
  }
  {
    // read: 8 header bytes, message at 8 with 2 descriptors
    std::vector<uint8_t> s{4, 8, 0, 0, 0};
    s.resize(5 + 8, 0xcd);
    ReadMsgHeader h{};
    h.type.set(static_cast<uint16_t>(MsgType::read));
    h.usr_len.set(8);
    h.sg_cnt.set(2);
    put(s, h);
    for (int i = 0; i < 2; ++i) {
      BufDesc d{};
      d.addr.set(0x7000 + i * 4096);
      d.key.set(3);
      d.len.set(4096);
      put(s, d);
    }
    seeds.push_back(s);
  }
  return seeds;
}

}  // namespace ibtrs::fuzz
