#include "proto/ibnbd_proto.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

namespace ibnbd::proto {

namespace {

constexpr uint8_t kCachePolicyMask = kCacheFua | kCacheWriteBack;

bool known_op(IoOp op) { return static_cast<uint8_t>(op) <= static_cast<uint8_t>(IoOp::block_status); }

bool known_mode(uint8_t m) { return m <= static_cast<uint8_t>(AccessMode::migration); }

bool all_zero(const uint8_t* p, size_t n) {
  return std::all_of(p, p + n, [](uint8_t b) { return b == 0; });
}

MsgHdr make_hdr(MsgType t) {
  MsgHdr h{};
  h.type.set(static_cast<uint16_t>(t));
  return h;
}

template <typename T>
Result<size_t> store(std::span<std::byte> out, const T& m) {
  if (out.size() < sizeof(T)) return errc(ENOBUFS);
  std::memcpy(out.data(), &m, sizeof(T));
  return sizeof(T);
}

// Requests are exactly their struct; responses land in a read buffer that may be longer, and a
// SESS_INFO from a newer client may have grown.
enum class Len : uint8_t { exact, at_least };

// The message of type `want` at the start of `msg`. The bytes are copied out, so nothing is read
// past the span and the caller sees one consistent snapshot even if the peer's buffer changes.
template <typename T>
Result<T> load_msg(std::span<const std::byte> msg, MsgType want, Len len) {
  auto type = peek_type(msg);
  if (!type.ok()) return type.error();
  if (*type != want) return errc(EBADMSG);
  if (msg.size() < sizeof(T) || (len == Len::exact && msg.size() != sizeof(T)))
    return errc(EBADMSG);
  T m;
  std::memcpy(&m, msg.data(), sizeof(T));
  return m;
}

bool read_buffer_fits(Carrier c, size_t rsp_len) {
  return c.dir == ibtrs::IoDir::read && c.data_len >= rsp_len;
}

}  // namespace

std::string_view to_string(MsgType t) {
  switch (t) {
    case MsgType::sess_info: return "SESS_INFO";
    case MsgType::sess_info_rsp: return "SESS_INFO_RSP";
    case MsgType::open: return "OPEN";
    case MsgType::open_rsp: return "OPEN_RSP";
    case MsgType::io: return "IO";
    case MsgType::close: return "CLOSE";
    case MsgType::watch: return "WATCH";
    case MsgType::watch_rsp: return "WATCH_RSP";
    case MsgType::block_status_rsp: return "BLOCK_STATUS_RSP";
  }
  return "?";
}

Result<uint32_t> pack_rw(IoOp op, uint32_t flags) {
  if (!known_op(op) || (flags & ~kIoFlagsMask) != 0) return errc(EINVAL);
  return static_cast<uint32_t>(op) | flags;
}

Result<Rw> unpack_rw(uint32_t rw) {
  const auto op = static_cast<IoOp>(rw & kRwOpMask);
  const uint32_t flags = rw & ~kRwOpMask;
  if (!known_op(op) || (flags & ~kIoFlagsMask) != 0) return errc(EINVAL);
  return Rw{op, flags};
}

Carrier carrier_of(const Io& io) {
  switch (io.op) {
    case IoOp::read: return {ibtrs::IoDir::read, io.bi_size};
    case IoOp::write: return {ibtrs::IoDir::write, io.bi_size};
    case IoOp::block_status: return {ibtrs::IoDir::read, kBlockStatusReplyBytes};
    default: return kCloseCarrier;  // every other op is a WRITE without data
  }
}

Status check_dev_name(std::string_view name) {
  if (name.empty() || name.size() > kDevNameMax) return errc(EINVAL);
  // Control characters (NUL among them) would cut the name short or garble the server's
  // listings; anything else, UTF-8 included, is a legal file name.
  for (char ch : name) {
    const auto b = static_cast<unsigned char>(ch);
    if (b < 0x20 || b == 0x7f) return errc(EINVAL);
  }
  return {};
}

Status check_geometry(const DeviceGeometry& g) {
  const uint32_t lbs = g.logical_block_size;
  const uint32_t pbs = g.physical_block_size;
  if (!std::has_single_bit(lbs) || lbs < kSectorSize || lbs > kMaxLogicalBlockSize)
    return errc(EINVAL);
  if (!std::has_single_bit(pbs) || pbs < lbs) return errc(EINVAL);
  if (g.max_hw_sectors == 0) return errc(EINVAL);  // a device that takes no READ or WRITE
  if (g.nsectors > std::numeric_limits<uint64_t>::max() / kSectorSize) return errc(EINVAL);
  if ((g.cache_policy & ~kCachePolicyMask) != 0) return errc(EINVAL);
  return {};
}

Status check_io(const Io& io) {
  BASE_TRY(pack_rw(io.op, io.flags));
  if ((io.flags & kIoNoUnmap) != 0 && io.op != IoOp::write_zeroes) return errc(EINVAL);
  // A question, not an IO: there is nothing to make durable or to order against.
  if (io.op == IoOp::block_status && io.flags != 0) return errc(EINVAL);
  if (io.bi_size % kSectorSize != 0) return errc(EINVAL);
  if ((io.op == IoOp::flush) != (io.bi_size == 0)) return errc(EINVAL);
  // The backend works in bytes: the end of the range must be representable.
  if (io.sector > (std::numeric_limits<uint64_t>::max() - io.bi_size) / kSectorSize)
    return errc(EINVAL);
  return {};
}

Result<uint8_t> negotiate_version(uint8_t client_ver) {
  if (client_ver < kMinProtoVersion) return errc(EPROTONOSUPPORT);
  return std::min(client_ver, kProtoVersion);
}

Result<uint8_t> accept_version(uint8_t proposed, uint8_t answered) {
  if (answered > std::min(proposed, kProtoVersion)) return errc(EPROTO);
  if (answered < kMinProtoVersion) return errc(EPROTONOSUPPORT);
  return answered;
}

// ------------------------------------------------------------------------------------------
// Encoders

namespace {

bool speakable(uint8_t ver) { return ver >= kMinProtoVersion && ver <= kProtoVersion; }

// SESS_INFO and its response differ only in type.
template <typename W>
Result<size_t> encode_version_msg(std::span<std::byte> out, MsgType t, uint8_t ver) {
  if (!speakable(ver)) return errc(EINVAL);
  W w{};
  w.hdr = make_hdr(t);
  w.ver = ver;
  return store(out, w);
}

}  // namespace

Result<size_t> encode_sess_info(std::span<std::byte> out, const SessInfo& m) {
  return encode_version_msg<SessInfoMsg>(out, MsgType::sess_info, m.ver);
}

Result<size_t> encode_sess_info_rsp(std::span<std::byte> out, const SessInfoRsp& m) {
  return encode_version_msg<SessInfoRspMsg>(out, MsgType::sess_info_rsp, m.ver);
}

Result<size_t> encode_open(std::span<std::byte> out, const Open& m) {
  if (!known_mode(static_cast<uint8_t>(m.mode))) return errc(EINVAL);
  BASE_TRY(check_dev_name(m.dev_name));
  if (m.flags & ~kOpenFlagsMask) return errc(EINVAL);
  OpenMsg w{};
  w.hdr = make_hdr(MsgType::open);
  w.access_mode = static_cast<uint8_t>(m.mode);
  w.flags = m.flags;
  std::memcpy(w.dev_name, m.dev_name.data(), m.dev_name.size());
  return store(out, w);
}

Result<size_t> encode_open_rsp(std::span<std::byte> out, const OpenRsp& m) {
  const DeviceGeometry& g = m.geo;
  BASE_TRY(check_geometry(g));
  OpenRspMsg w{};
  w.hdr = make_hdr(MsgType::open_rsp);
  w.device_id.set(m.device_id);
  w.nsectors.set(g.nsectors);
  w.max_hw_sectors.set(g.max_hw_sectors);
  w.max_write_zeroes_sectors.set(g.max_write_zeroes_sectors);
  w.max_discard_sectors.set(g.max_discard_sectors);
  w.discard_granularity.set(g.discard_granularity);
  w.discard_alignment.set(g.discard_alignment);
  w.physical_block_size.set(g.physical_block_size);
  w.logical_block_size.set(g.logical_block_size);
  w.max_segments.set(g.max_segments);
  w.secure_discard = g.secure_discard ? 1 : 0;
  w.cache_policy = g.cache_policy;
  w.size_epoch.set(m.size_epoch);
  return store(out, w);
}

Result<size_t> encode_close(std::span<std::byte> out, const Close& m) {
  CloseMsg w{};
  w.hdr = make_hdr(MsgType::close);
  w.device_id.set(m.device_id);
  return store(out, w);
}

Result<size_t> encode_io(std::span<std::byte> out, const Io& m) {
  BASE_TRY(check_io(m));
  IoMsg w{};
  w.hdr = make_hdr(MsgType::io);
  w.device_id.set(m.device_id);
  w.sector.set(m.sector);
  w.rw.set(pack_rw(m.op, m.flags).value());
  w.bi_size.set(m.bi_size);
  w.prio.set(m.prio);
  return store(out, w);
}

Result<size_t> encode_watch(std::span<std::byte> out, const Watch& m) {
  WatchMsg w{};
  w.hdr = make_hdr(MsgType::watch);
  w.epoch.set(m.epoch);
  return store(out, w);
}

namespace {

// The rules of a WATCH_RSP's contents, shared by its encoder and decoder.
Status check_watch_rsp(uint64_t epoch, uint32_t total, std::span<const WatchEntry> entries) {
  // 0 is the client's "none seen": an answer with it would never differ from a fresh client's.
  if (epoch == 0 || entries.size() > total) return errc(EINVAL);
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i > 0 && entries[i].device_id <= entries[i - 1].device_id) return errc(EINVAL);
    if (entries[i].nsectors > std::numeric_limits<uint64_t>::max() / kSectorSize) return errc(EINVAL);
  }
  return {};
}

}  // namespace

Result<size_t> encode_watch_rsp(std::span<std::byte> out, const WatchRsp& m) {
  BASE_TRY(check_watch_rsp(m.epoch, m.total, m.entries));
  if (out.size() < sizeof(WatchRspMsg)) return errc(ENOBUFS);
  const size_t fit = std::min(m.entries.size(), (out.size() - sizeof(WatchRspMsg)) / kWatchEntryBytes);
  WatchRspMsg w{};
  w.hdr = make_hdr(MsgType::watch_rsp);
  w.count.set(static_cast<uint32_t>(fit));
  w.total.set(m.total);
  w.epoch.set(m.epoch);
  std::memcpy(out.data(), &w, sizeof(w));
  for (size_t i = 0; i < fit; ++i) {
    WatchEntryMsg e{};
    e.device_id.set(m.entries[i].device_id);
    e.nsectors.set(m.entries[i].nsectors);
    std::memcpy(out.data() + sizeof(w) + i * kWatchEntryBytes, &e, sizeof(e));
  }
  return watch_buffer_bytes(fit);
}

namespace {

// The rules of a BLOCK_STATUS_RSP's extents, shared by its encoder and decoder.
Status check_extents(std::span<const Extent> extents, uint64_t range_len) {
  if (extents.empty() || extents.size() > kMaxExtents) return errc(EINVAL);
  uint64_t sum = 0;
  for (const Extent& e : extents) {
    if (e.length == 0 || e.length % kSectorSize != 0 || (e.flags & ~kExtentFlagsMask) != 0)
      return errc(EINVAL);
    if (e.length > range_len - sum) return errc(EINVAL);  // runs past the range (sum <= range_len)
    sum += e.length;
  }
  return {};
}

}  // namespace

Result<size_t> encode_block_status_rsp(std::span<std::byte> out, std::span<const Extent> extents,
                                       uint64_t range_len) {
  BASE_TRY(check_extents(extents, range_len));
  const size_t len = sizeof(BlockStatusRspMsg) + extents.size() * sizeof(ExtentMsg);
  if (out.size() < len) return errc(ENOBUFS);
  BlockStatusRspMsg w{};
  w.hdr = make_hdr(MsgType::block_status_rsp);
  w.count.set(static_cast<uint32_t>(extents.size()));
  std::memcpy(out.data(), &w, sizeof(w));
  for (size_t i = 0; i < extents.size(); ++i) {
    ExtentMsg e{};
    // check_extents bounds each length by the range, which the caller keeps to 32 bits; a
    // longer one could not have come from one request.
    if (extents[i].length > std::numeric_limits<uint32_t>::max()) return errc(EINVAL);
    e.length.set(static_cast<uint32_t>(extents[i].length));
    e.flags.set(extents[i].flags);
    std::memcpy(out.data() + sizeof(w) + i * sizeof(e), &e, sizeof(e));
  }
  return len;
}

// ------------------------------------------------------------------------------------------
// Decoders

Result<MsgType> peek_type(std::span<const std::byte> msg) {
  if (msg.size() < sizeof(MsgHdr)) return errc(EBADMSG);
  MsgHdr h;
  std::memcpy(&h, msg.data(), sizeof(h));
  const uint16_t t = h.type.get();
  if (t > static_cast<uint16_t>(MsgType::block_status_rsp)) return errc(EBADMSG);
  return static_cast<MsgType>(t);
}

Result<SessInfo> decode_sess_info(std::span<const std::byte> usr, Carrier c) {
  // Reserved bytes and any tail are not checked: the client wrote them before it knew our
  // version, and a newer one may put something there that we must be able to ignore.
  BASE_ASSIGN_OR_RETURN(SessInfoMsg w, load_msg<SessInfoMsg>(usr, MsgType::sess_info, Len::at_least));
  if (!read_buffer_fits(c, sizeof(SessInfoRspMsg))) return errc(EINVAL);
  return SessInfo{w.ver};
}

Result<Open> decode_open(std::span<const std::byte> usr, Carrier c) {
  BASE_ASSIGN_OR_RETURN(OpenMsg w, load_msg<OpenMsg>(usr, MsgType::open, Len::exact));
  if (w.hdr.reserved.get() != 0 || (w.flags & ~kOpenFlagsMask) != 0 || !all_zero(w.reserved1, sizeof(w.reserved1)))
    return errc(EINVAL);
  if (!known_mode(w.access_mode)) return errc(EINVAL);
  const auto* nul = std::find(std::begin(w.dev_name), std::end(w.dev_name), uint8_t{0});
  if (nul == std::end(w.dev_name)) return errc(EINVAL);
  const auto len = static_cast<size_t>(nul - std::begin(w.dev_name));
  if (!all_zero(nul, kDevNameField - len)) return errc(EINVAL);  // NUL padded, nothing hidden
  Open m;
  m.mode = static_cast<AccessMode>(w.access_mode);
  m.flags = w.flags;
  m.dev_name.assign(reinterpret_cast<const char*>(w.dev_name), len);
  BASE_TRY(check_dev_name(m.dev_name));
  if (!read_buffer_fits(c, sizeof(OpenRspMsg))) return errc(EINVAL);
  return m;
}

Result<Close> decode_close(std::span<const std::byte> usr, Carrier c) {
  BASE_ASSIGN_OR_RETURN(CloseMsg w, load_msg<CloseMsg>(usr, MsgType::close, Len::exact));
  if (w.hdr.reserved.get() != 0) return errc(EINVAL);
  if (c != kCloseCarrier) return errc(EINVAL);
  return Close{w.device_id.get()};
}

Result<Io> decode_io(std::span<const std::byte> usr, Carrier c) {
  BASE_ASSIGN_OR_RETURN(IoMsg w, load_msg<IoMsg>(usr, MsgType::io, Len::exact));
  if (w.hdr.reserved.get() != 0 || !all_zero(w.reserved, sizeof(w.reserved))) return errc(EINVAL);
  BASE_ASSIGN_OR_RETURN(Rw rw, unpack_rw(w.rw.get()));
  Io m;
  m.device_id = w.device_id.get();
  m.sector = w.sector.get();
  m.op = rw.op;
  m.flags = rw.flags;
  m.bi_size = w.bi_size.get();
  m.prio = w.prio.get();
  BASE_TRY(check_io(m));
  // A WRITE that arrived as a transport READ would store the reply buffer's garbage; a READ
  // whose buffer differs from bi_size would leak or lose bytes.
  if (c != carrier_of(m)) return errc(EINVAL);
  return m;
}

Result<Watch> decode_watch(std::span<const std::byte> usr, Carrier c) {
  BASE_ASSIGN_OR_RETURN(WatchMsg w, load_msg<WatchMsg>(usr, MsgType::watch, Len::exact));
  if (w.hdr.reserved.get() != 0 || w.reserved.get() != 0) return errc(EINVAL);
  if (!read_buffer_fits(c, sizeof(WatchRspMsg))) return errc(EINVAL);
  return Watch{w.epoch.get()};
}

Result<Request> decode_request(std::span<const std::byte> usr, Carrier c) {
  Request r;
  BASE_ASSIGN_OR_RETURN(r.type, peek_type(usr));
  switch (r.type) {
    case MsgType::sess_info: {
      BASE_ASSIGN_OR_RETURN(r.sess_info, decode_sess_info(usr, c));
      return r;
    }
    case MsgType::open: {
      BASE_ASSIGN_OR_RETURN(r.open, decode_open(usr, c));
      return r;
    }
    case MsgType::close: {
      BASE_ASSIGN_OR_RETURN(r.close, decode_close(usr, c));
      return r;
    }
    case MsgType::io: {
      BASE_ASSIGN_OR_RETURN(r.io, decode_io(usr, c));
      return r;
    }
    case MsgType::watch: {
      BASE_ASSIGN_OR_RETURN(r.watch, decode_watch(usr, c));
      return r;
    }
    case MsgType::sess_info_rsp:
    case MsgType::open_rsp:
    case MsgType::watch_rsp:
    case MsgType::block_status_rsp:
      break;
  }
  return errc(EBADMSG);  // a response where a request belongs
}

Result<SessInfoRsp> decode_sess_info_rsp(std::span<const std::byte> buf) {
  BASE_ASSIGN_OR_RETURN(SessInfoRspMsg w,
                         load_msg<SessInfoRspMsg>(buf, MsgType::sess_info_rsp, Len::at_least));
  // The server answers knowing our version, so unlike SESS_INFO nothing unknown may be set.
  if (w.hdr.reserved.get() != 0 || !all_zero(w.reserved, sizeof(w.reserved))) return errc(EINVAL);
  return SessInfoRsp{w.ver};
}

Result<OpenRsp> decode_open_rsp(std::span<const std::byte> buf, uint8_t ver) {
  BASE_ASSIGN_OR_RETURN(OpenRspMsg w, load_msg<OpenRspMsg>(buf, MsgType::open_rsp, Len::at_least));
  if (w.hdr.reserved.get() != 0) return errc(EINVAL);
  // Reserved before version 4: a server of an older session never sets it.
  if (ver < kWatchVersion && w.size_epoch.get() != 0) return errc(EINVAL);
  if (w.secure_discard > 1) return errc(EINVAL);
  OpenRsp m;
  m.device_id = w.device_id.get();
  m.size_epoch = w.size_epoch.get();
  DeviceGeometry& g = m.geo;
  g.nsectors = w.nsectors.get();
  g.max_hw_sectors = w.max_hw_sectors.get();
  g.max_write_zeroes_sectors = w.max_write_zeroes_sectors.get();
  g.max_discard_sectors = w.max_discard_sectors.get();
  g.discard_granularity = w.discard_granularity.get();
  g.discard_alignment = w.discard_alignment.get();
  g.physical_block_size = w.physical_block_size.get();
  g.logical_block_size = w.logical_block_size.get();
  g.max_segments = w.max_segments.get();
  g.secure_discard = w.secure_discard != 0;
  g.cache_policy = w.cache_policy;
  BASE_TRY(check_geometry(g));
  return m;
}

Result<WatchRsp> decode_watch_rsp(std::span<const std::byte> buf) {
  BASE_ASSIGN_OR_RETURN(WatchRspMsg w, load_msg<WatchRspMsg>(buf, MsgType::watch_rsp, Len::at_least));
  if (w.hdr.reserved.get() != 0 || w.reserved.get() != 0) return errc(EINVAL);
  const uint32_t count = w.count.get();
  // The entries the header counts must lie in the buffer: nothing is read past it, and a count
  // the buffer cannot hold allocates nothing.
  if (count > (buf.size() - sizeof(WatchRspMsg)) / kWatchEntryBytes) return errc(EBADMSG);
  WatchRsp m;
  m.epoch = w.epoch.get();
  m.total = w.total.get();
  if (count > m.total) return errc(EINVAL);
  m.entries.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    WatchEntryMsg e;
    std::memcpy(&e, buf.data() + sizeof(w) + size_t{i} * kWatchEntryBytes, sizeof(e));
    if (e.reserved.get() != 0) return errc(EINVAL);
    m.entries.push_back(WatchEntry{e.device_id.get(), e.nsectors.get()});
  }
  BASE_TRY(check_watch_rsp(m.epoch, m.total, m.entries));
  return m;
}

Status decode_block_status_rsp(std::span<const std::byte> buf, uint64_t range_len, ExtentList& out) {
  out.count = 0;
  BASE_ASSIGN_OR_RETURN(BlockStatusRspMsg w,
                         load_msg<BlockStatusRspMsg>(buf, MsgType::block_status_rsp, Len::at_least));
  if (w.hdr.reserved.get() != 0 || !all_zero(w.reserved, sizeof(w.reserved))) return errc(EINVAL);
  const uint32_t count = w.count.get();
  // Nothing past the buffer is read and nothing past `out` written, whatever count says.
  if (count > kMaxExtents || count > (buf.size() - sizeof(w)) / sizeof(ExtentMsg)) return errc(EBADMSG);
  for (uint32_t i = 0; i < count; ++i) {
    ExtentMsg e;
    std::memcpy(&e, buf.data() + sizeof(w) + size_t{i} * sizeof(e), sizeof(e));
    out.e[i] = Extent{e.length.get(), e.flags.get()};
  }
  if (Status st = check_extents(std::span<const Extent>(out.e, count), range_len); !st.ok()) return st;
  out.count = count;
  return {};
}

}  // namespace ibnbd::proto
