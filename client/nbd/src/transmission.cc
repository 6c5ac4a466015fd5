// The transmission phase (spec "Transmission", "Request types"): request headers are parsed as
// they arrive, checked, and handed to the export; many are in flight per connection and each
// is answered when its export request completes, so replies go out of order ("Replies need not
// be sent in the same order as requests").
#include <sys/socket.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "server_impl.h"

namespace ibnbd::nbd {

namespace {

using namespace wire;

void chunk_hdr(ChunkHdr& h, uint16_t flags, uint16_t type, uint64_t handle, uint32_t len) {
  h.magic.set(kStructuredReplyMagic);
  h.flags.set(flags);
  h.type.set(type);
  h.handle.set(handle);
  h.length.set(len);
}

}  // namespace

// ---- PagePool ----

void PagePool::init(std::span<std::byte> mem) {
  base_ = mem.data();
  pages_ = mem.size() / kPage;
  bits_.assign((pages_ + 63) / 64, 0);
  // The tail of the last word counts as taken, so no run reaches past the memory.
  for (size_t i = pages_; i < bits_.size() * 64; ++i) bits_[i / 64] |= uint64_t{1} << (i % 64);
  cursor_ = 0;
}

size_t PagePool::free_run(size_t i, size_t want) const {
  size_t n = 0;
  while (n < want && i + n < pages_) {
    const size_t k = i + n;
    const uint64_t w = bits_[k / 64] >> (k % 64);
    if (w != 0) return std::min(want, n + static_cast<size_t>(std::countr_zero(w)));
    n += 64 - k % 64;  // the rest of this word is free
  }
  return std::min(n, want);
}

void PagePool::mark(size_t from, size_t n, bool on) {
  while (n > 0) {
    const size_t bit = from % 64;
    const size_t k = std::min<size_t>(n, 64 - bit);
    const uint64_t m = (k == 64 ? ~uint64_t{0} : ((uint64_t{1} << k) - 1)) << bit;
    if (on) bits_[from / 64] |= m;
    else bits_[from / 64] &= ~m;
    from += k;
    n -= k;
  }
}

std::byte* PagePool::get(size_t len) {
  const size_t want = (len + kPage - 1) / kPage;
  if (want == 0 || want > pages_) return nullptr;
  // The first free page at or after i (pages_ if none).
  auto next_free = [this](size_t i) {
    while (i < pages_) {
      const uint64_t w = ~bits_[i / 64] >> (i % 64);
      if (w != 0) return std::min(pages_, i + static_cast<size_t>(std::countr_zero(w)));
      i = (i / 64 + 1) * 64;
    }
    return pages_;
  };
  // Next fit: runs starting in [from, to).
  auto find = [&](size_t from, size_t to) {
    for (size_t i = next_free(from); i < to && i + want <= pages_;) {
      const size_t r = free_run(i, want);
      if (r == want) return i;
      i = next_free(i + r);
    }
    return pages_;
  };
  size_t at = find(cursor_, pages_);
  if (at == pages_) at = find(0, cursor_);
  if (at == pages_) return nullptr;
  mark(at, want, true);
  cursor_ = at + want == pages_ ? 0 : at + want;
  return base_ + at * kPage;
}

void PagePool::put(std::byte* p, size_t len) {
  mark(static_cast<size_t>(p - base_) / kPage, (len + kPage - 1) / kPage, false);
}

// ---- requests ----

Slot& NbdServer::Impl::take_slot(Conn& c, uint64_t data_bytes) {
  Slot* s = c.free_slots;
  if (s != nullptr) {
    c.free_slots = s->next;
  } else {
    // Slots are made on demand, up to max_requests, and then reused.
    c.slots.push_back(std::make_unique<Slot>());
    s = c.slots.back().get();
    s->conn = &c;
  }
  s->next = nullptr;
  s->err = 0;
  s->flush_after = false;
  s->data_bytes = data_bytes;
  s->hdr_len = s->data_len = s->sent = 0;
  s->data = nullptr;
  s->lent = 0;
  ++c.inflight;
  c.inflight_bytes += data_bytes;
  return *s;
}

void NbdServer::Impl::release(Conn& c, Slot& s) {
  --c.inflight;
  c.inflight_bytes -= s.data_bytes;
  s.data_bytes = 0;
  if (s.lent > 0) {
    c.pool->put(s.data, s.lent);
    c.lent_bytes -= s.lent;
    s.lent = 0;
    if (!c.pool->waiters.empty()) c.pool->resume = true;
  }
  s.data = nullptr;
  if (s.buf.size() > kKeepBuffer) std::vector<std::byte>().swap(s.buf);
  s.next = c.free_slots;
  c.free_slots = &s;
  if (c.paused) {
    c.paused = false;
    c.resumed = true;
  }
}

bool NbdServer::Impl::parse_request(Conn& c) {
  if (c.paused || c.in_end - c.in_beg < sizeof(Request)) return false;
  Request r;
  std::memcpy(&r, c.in.data() + c.in_beg, sizeof(r));
  if (r.magic.get() != kRequestMagic) {
    // Without a valid header we cannot find the next one: the only way out is a hard
    // disconnect ("Either side MAY initiate a hard disconnect if it detects a violation").
    fail(c, "bad request magic", true);
    return false;
  }
  const uint16_t type = r.type.get();
  const uint32_t length = r.length.get();
  if (type == kCmdDisc) {
    // "The server MUST handle all outstanding requests ... and then close"; nothing may follow.
    c.in_beg += sizeof(r);
    c.rx_closed = true;
    return false;
  }
  const bool data_cmd = type == kCmdRead || type == kCmdWrite;
  const bool oversized = data_cmd && length > c.info.max_payload;
  const uint64_t data = data_cmd && !oversized ? length : 0;
  // Admission: a slot and room in the byte budget, or the header waits in the buffer (and the
  // socket stops being read) until a reply frees them. One request is always admitted.
  if ((c.free_slots == nullptr && c.slots.size() >= opts.max_requests) ||
      (c.inflight > 0 && c.inflight_bytes + data > opts.max_inflight_bytes)) {
    c.paused = true;
    return false;
  }
  // Then room in the export's request memory, behind the connections already waiting for it
  // (first come, first served: a large request is not starved by a stream of small ones).
  std::byte* lent = nullptr;
  if (data > 0 && c.pool != nullptr && data <= c.pool->capacity()) {
    if (c.pool->waiters.empty() || c.resuming) lent = c.pool->get(data);
    if (lent == nullptr) {
      if (!c.mem_wait) {
        c.mem_wait = true;
        c.pool->waiters.push_back(c.id);
        stats.memory_waits.fetch_add(1, std::memory_order_relaxed);
      }
      c.paused = true;
      return false;
    }
  }
  c.in_beg += sizeof(r);
  Slot& s = take_slot(c, data);
  if (lent != nullptr) {
    s.data = lent;
    s.lent = PagePool::rounded(data);
    c.lent_bytes += s.lent;
  }
  s.handle = r.handle.get();
  s.offset = r.offset.get();
  s.length = length;
  s.type = type;
  s.flags = r.flags.get();
  if (oversized) {
    reply(c, s, EINVAL);
    if (type == kCmdWrite) {
      // The payload of an oversized WRITE follows the header; rather than read and throw away
      // up to 4 GiB, stop reading after the error reply (the spec lets the server disconnect a
      // client that exceeds the advertised maximum payload).
      stats.protocol_errors.fetch_add(1, std::memory_order_relaxed);
      log("nbd: " + c.peer + ": WRITE of " + std::to_string(length) + " bytes is over the maximum payload; closing");
      c.rx_closed = true;
      ::shutdown(c.fd.get(), SHUT_RD);
      return false;
    }
    return true;
  }
  if (data_cmd && s.data == nullptr) {
    if (s.buf.size() < length) s.buf.resize(length);
    s.data = s.buf.data();
  }
  if (type == kCmdWrite) {
    c.rx_slot = &s;
    c.rx_got = 0;
    receive_payload(c);
    return true;
  }
  start_request(c, s);
  return true;
}

void NbdServer::Impl::receive_payload(Conn& c) {
  Slot& s = *c.rx_slot;
  const size_t n = std::min(c.in_end - c.in_beg, size_t{s.length} - c.rx_got);
  if (n > 0) {
    std::memcpy(s.data + c.rx_got, c.in.data() + c.in_beg, n);
    c.in_beg += n;
    c.rx_got += n;
  }
  if (c.rx_got < s.length) return;
  c.rx_slot = nullptr;
  start_request(c, s);
}

// Checks a request against the spec and the export, then submits it (or answers at once).
void NbdServer::Impl::start_request(Conn& c, Slot& s) {
  const ExportInfo& i = c.info;
  uint16_t allowed = kCmdFlagFua;  // "valid for all commands" once SEND_FUA is advertised
  switch (s.type) {
    case kCmdRead:
      if (c.structured) allowed |= kCmdFlagDf;
      break;
    case kCmdWriteZeroes:
      allowed |= kCmdFlagNoHole | kCmdFlagFastZero;
      break;
    case kCmdBlockStatus:
      allowed |= kCmdFlagReqOne;
      break;
    case kCmdWrite:
    case kCmdFlush:
    case kCmdTrim:
    case kCmdCache:
      break;
    default:
      return reply(c, s, EINVAL);  // "SHOULD return EINVAL if it receives an unknown command"
  }
  // "SHOULD return EINVAL if it receives a request with a flag not explicitly documented as
  // applicable to the given request."
  if (s.flags & ~allowed) return reply(c, s, EINVAL);
  if (s.type == kCmdFlush) return submit(c, s);  // offset and length are reserved: not checked

  const bool writes = s.type == kCmdWrite || s.type == kCmdTrim || s.type == kCmdWriteZeroes;
  // "SHOULD return EPERM if it receives a write or trim request on a read-only export."
  if (writes && i.read_only) return reply(c, s, EPERM);
  if ((s.type == kCmdTrim && !i.can_trim) || (s.type == kCmdWriteZeroes && !i.can_write_zeroes))
    return reply(c, s, EINVAL);  // not advertised
  // "A client MUST NOT use NBD_CMD_BLOCK_STATUS unless it selected a nonzero number of metadata
  // contexts during negotiation. Servers SHOULD reply to clients doing so anyway with EINVAL."
  if (s.type == kCmdBlockStatus && !c.meta_base_allocation) return reply(c, s, EINVAL);
  if (s.offset > i.size || s.length > i.size - s.offset) {
    // "SHOULD return ENOSPC if it receives a write request including one or more sectors
    // beyond the size of the device"; EINVAL for the others ("SHOULD return EINVAL if it
    // receives a NBD_CMD_BLOCK_STATUS request including one or more sectors beyond the size").
    return reply(c, s, s.type == kCmdWrite || s.type == kCmdWriteZeroes ? ENOSPC : EINVAL);
  }
  if (s.type != kCmdBlockStatus && (s.offset % i.min_block != 0 || s.length % i.min_block != 0))
    return reply(c, s, EINVAL);  // below the advertised minimum block size
  if (s.length == 0) {
    // Nothing to do; BLOCK_STATUS must describe at least one byte.
    return reply(c, s, s.type == kCmdBlockStatus ? EINVAL : 0);
  }
  if (s.type == kCmdWriteZeroes && (s.flags & kCmdFlagFastZero) && !i.fast_zero)
    return reply(c, s, EOPNOTSUPP);  // "MUST fail quickly with NBD_ENOTSUP"
  if (s.type == kCmdCache) return reply(c, s, 0);  // no cache on this side: nothing to load
  submit(c, s);
}

void NbdServer::Impl::submit(Conn& c, Slot& s) {
  const Done d{&Impl::on_done, &s};
  const bool fua = s.flags & kCmdFlagFua;
  Status st;
  switch (s.type) {
    case kCmdRead:
      st = c.exp->read(s.offset, std::span(s.data, s.length), d);
      break;
    case kCmdWrite:
      st = c.exp->write(s.offset, std::span<const std::byte>(s.data, s.length), fua, d);
      break;
    case kCmdFlush:
      st = c.exp->flush(d);
      break;
    case kCmdTrim:
      s.flush_after = fua;
      st = c.exp->trim(s.offset, s.length, d);
      break;
    case kCmdWriteZeroes:
      s.flush_after = fua;
      st = c.exp->write_zeroes(s.offset, s.length, s.flags & kCmdFlagNoHole, d);
      break;
    case kCmdBlockStatus: {
      // BLOCK_STATUS need not be aligned; the export's question is, so it is widened to whole
      // blocks (inside the export: its size is a multiple of min_block) and the answer cut
      // back to the request in reply().
      if (!s.extents) s.extents = std::make_unique<ExtentList>();
      const uint64_t b = c.info.min_block;
      s.status_offset = s.offset / b * b;
      const uint64_t end = (s.offset + s.length + b - 1) / b * b;
      st = c.exp->block_status(s.status_offset, end - s.status_offset, *s.extents, d);
      break;
    }
    default:
      st = ibtrs::errc(EINVAL);
  }
  if (!st.ok()) {
    s.flush_after = false;
    reply(c, s, st.error().value());
  }
}

// On the loop, after the handoff from the export's thread.
void NbdServer::Impl::complete(Conn& c, Slot& s) {
  if (c.tx_dead) return release(c, s);  // nobody to answer
  if (s.flush_after && s.err == 0) {
    // FUA on TRIM / WRITE_ZEROES: the export has no FUA for them, so a FLUSH after the
    // operation makes it stable before the reply (spec: "MUST NOT send its reply ... until all
    // write operations ... have been completed and persisted").
    s.flush_after = false;
    const Status st = c.exp->flush(Done{&Impl::on_done, &s});
    if (!st.ok()) reply(c, s, st.error().value());
    return;
  }
  if (s.type == kCmdWrite && s.err == 0)
    stats.write_bytes.fetch_add(s.length, std::memory_order_relaxed);
  reply(c, s, s.err);
}

// base:allocation: the export's extents, from the request's offset (the question began at the
// block before it), never past the request's end (so also right for REQ_ONE, which "MUST NOT"
// exceed the length), at most one with REQ_ONE. Statuses are the export's ExtentFlag bits,
// which are NBD's. An answer that does not reach the request's offset (an export breaking its
// contract) is said as data, which is always true.
void NbdServer::Impl::block_status_reply(Conn&, Slot& s) {
  static_assert(kExtentHole == kStateHole && kExtentZero == kStateZero);
  const ExtentList& l = *s.extents;
  const size_t max = (s.flags & kCmdFlagReqOne) ? 1 : kMaxExtents;
  // Room for the longest answer, once per slot (kept: below kKeepBuffer).
  if (s.buf.size() < kMaxExtents * sizeof(BlockDescriptor)) s.buf.resize(kMaxExtents * sizeof(BlockDescriptor));
  uint64_t skip = s.offset - s.status_offset;
  uint64_t left = s.length;
  size_t n = 0;
  for (uint32_t i = 0; i < l.count && n < max && left > 0; ++i) {
    uint64_t len = l.e[i].length;
    if (len <= skip) {
      skip -= len;
      continue;
    }
    len = std::min(len - skip, left);
    skip = 0;
    BlockDescriptor d;
    d.length.set(static_cast<uint32_t>(len));  // <= s.length, a 32-bit request field
    d.status.set(l.e[i].flags & (kStateHole | kStateZero));
    std::memcpy(s.buf.data() + n * sizeof(d), &d, sizeof(d));
    ++n;
    left -= len;
  }
  if (n == 0) {
    BlockDescriptor d;
    d.length.set(s.length);
    d.status.set(0);
    std::memcpy(s.buf.data(), &d, sizeof(d));
    n = 1;
  }
  BlockStatusHdr h;
  chunk_hdr(h.hdr, kReplyFlagDone, kReplyBlockStatus, s.handle,
            static_cast<uint32_t>(sizeof(h.context_id) + n * sizeof(BlockDescriptor)));
  h.context_id.set(kBaseAllocationId);
  std::memcpy(s.hdr, &h, sizeof(h));
  s.hdr_len = sizeof(h);
  s.data = s.buf.data();
  s.data_len = n * sizeof(BlockDescriptor);
}

// Builds the reply in the slot and queues it. Structured replies carry READ data and every
// error (the spec: servers "SHOULD prefer sending errors via a structured reply"); other
// successes use the simple reply, which the spec allows once structured replies are on.
void NbdServer::Impl::reply(Conn& c, Slot& s, int err) {
  stats.requests.fetch_add(1, std::memory_order_relaxed);
  if (err != 0) stats.errors.fetch_add(1, std::memory_order_relaxed);
  const uint32_t nerr = to_nbd_error(err);
  s.sent = 0;
  s.data_len = 0;
  if (c.structured && (s.type == kCmdRead || s.type == kCmdBlockStatus || nerr != 0)) {
    if (nerr != 0) {
      ErrorChunk e;
      const char* msg = std::strerror(err);
      const size_t ml = std::min(std::strlen(msg), sizeof(s.hdr) - sizeof(e));
      chunk_hdr(e.hdr, kReplyFlagDone, kReplyError, s.handle, static_cast<uint32_t>(6 + ml));
      e.error.set(nerr);
      e.msg_len.set(static_cast<uint16_t>(ml));
      std::memcpy(s.hdr, &e, sizeof(e));
      std::memcpy(s.hdr + sizeof(e), msg, ml);
      s.hdr_len = sizeof(e) + ml;
    } else if (s.type == kCmdRead && s.length == 0) {
      ChunkHdr h;  // OFFSET_DATA must carry at least one byte
      chunk_hdr(h, kReplyFlagDone, kReplyNone, s.handle, 0);
      std::memcpy(s.hdr, &h, sizeof(h));
      s.hdr_len = sizeof(h);
    } else if (s.type == kCmdRead) {
      // One content chunk for the whole read: DF is honoured by construction, and the data
      // cannot fail after the header is out (it is in memory), so the chunk is also the last.
      OffsetDataChunk d;
      chunk_hdr(d.hdr, kReplyFlagDone, kReplyOffsetData, s.handle, 8 + s.length);
      d.offset.set(s.offset);
      std::memcpy(s.hdr, &d, sizeof(d));
      s.hdr_len = sizeof(d);
      s.data_len = s.length;
    } else {
      block_status_reply(c, s);
    }
  } else {
    SimpleReply r;
    r.magic.set(kSimpleReplyMagic);
    r.error.set(nerr);
    r.handle.set(s.handle);
    std::memcpy(s.hdr, &r, sizeof(r));
    s.hdr_len = sizeof(r);
    if (s.type == kCmdRead && nerr == 0) s.data_len = s.length;
  }
  if (s.type == kCmdRead && nerr == 0) stats.read_bytes.fetch_add(s.length, std::memory_order_relaxed);
  s.next = nullptr;
  if (c.out_tail) c.out_tail->next = &s;
  else c.out_head = &s;
  c.out_tail = &s;
}

}  // namespace ibnbd::nbd
