// ImageStore, ImageWriter, ImageReader and StreamReader (docs/migration-image.md).
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "crc32c.h"
#include "image_format.h"
#include "ibnbd/migrate_image.h"

namespace ibnbd::migrate {

namespace {

using namespace fmt;

std::error_code err(int e) { return {e, std::generic_category()}; }

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
uint64_t round_down(uint64_t v, uint64_t a) { return v / a * a; }

uint64_t now_ns() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

std::chrono::system_clock::time_point from_ns(uint64_t ns) {
  return std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::nanoseconds(ns)));
}

bool all_zero(const std::byte* p, size_t n) {
  // Word-wise; a migration stream's pieces are rarely zero, so the first words usually decide.
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    if (w != 0) return false;
  }
  for (; i < n; ++i)
    if (p[i] != std::byte{0}) return false;
  return true;
}

// One synchronous volume request (metadata: directory, headers, index).
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int error = 0;
  static void cb(void* ctx, int e) {
    auto* w = static_cast<Waiter*>(ctx);
    std::lock_guard lk(w->mu);
    w->error = e;
    w->done = true;
    w->cv.notify_all();
  }
  Status wait(Status submitted) {
    if (!submitted) return submitted;
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return done; });
    return error ? Status(err(error)) : Status{};
  }
};

Status sync_write(Volume& v, const IoBuffer& b, uint64_t off, size_t len, bool fua) {
  Waiter w;
  return w.wait(v.write(b, 0, off, len, fua, {&Waiter::cb, &w}));
}
Status sync_read(Volume& v, const IoBuffer& b, uint64_t off, size_t len) {
  Waiter w;
  return w.wait(v.read(b, 0, off, len, {&Waiter::cb, &w}));
}
Status sync_flush(Volume& v) {
  Waiter w;
  return w.wait(v.flush({&Waiter::cb, &w}));
}

const char* describe(const std::error_code& e) {
  switch (e.value()) {
    case EBADMSG: return "no magic";
    case EILSEQ: return "bad CRC or inconsistent fields";
    case EPROTONOSUPPORT: return "unknown version";
    default: return nullptr;
  }
}

std::string why(const std::error_code& e) {
  const char* d = describe(e);
  return d ? d : e.message();
}

ImageInfo info_from(const Header& h, const DirView::Entry& slot) {
  ImageInfo i;
  i.name = slot.name;
  i.state = static_cast<ImageState>(h.state.get());
  i.extent_start = slot.start;
  i.extent_length = h.extent_length.get();
  i.chunk_size = h.chunk_size.get();
  i.stored_chunks = h.stored_chunks.get();
  i.created = from_ns(h.created_ns.get());
  i.committed = from_ns(h.committed_ns.get());
  std::memcpy(i.vm_uuid.data(), h.vm_uuid, 16);
  i.machine_type = fixed_string(h.machine_type, sizeof h.machine_type);
  if (i.state == ImageState::committed) {
    uint64_t pieces = 0;
    for (uint32_t s = 0; s < h.stream_count.get(); ++s) {
      i.streams.push_back({h.streams[s].length.get(), h.streams[s].chunks.get()});
      pieces += h.streams[s].chunks.get();
    }
    i.zero_chunks = pieces - std::min(pieces, i.stored_chunks);
  } else {
    i.streams.resize(h.stream_count.get());
  }
  return i;
}

}  // namespace

std::string_view to_string(ImageState s) {
  return s == ImageState::committed ? "committed" : "partial";
}

uint64_t ImageInfo::total_bytes() const {
  uint64_t t = 0;
  for (const auto& s : streams) t += s.length;
  return t;
}

// ---------------------------------------------------------------------------------- store

struct ImageStore::Impl {
  Volume& vol;
  DirView dir;
  bool formatted = false;
  std::unique_ptr<IoBuffer> meta;  // one block for directory and header IO
  std::string last_error;

  explicit Impl(Volume& v) : vol(v) {}

  uint64_t mirror_offset() const { return round_down(vol.size(), kBlock) - kBlock; }
  // Extents end before the directory mirror, on a 1 MiB boundary.
  uint64_t usable_end() const { return round_down(mirror_offset(), kExtentAlign); }

  std::error_code fail(std::error_code e, std::string msg) {
    last_error = std::move(msg);
    return e;
  }

  Status read_dir() {
    DirView best;
    bool have = false;
    std::error_code first_bad;
    std::string bad_copy;
    for (uint64_t off : {uint64_t{0}, mirror_offset()}) {
      BASE_TRY(sync_read(vol, *meta, off, kBlock));
      Directory d;
      std::memcpy(&d, meta->data(), kBlock);
      auto v = decode(d, vol.size());
      if (v) {
        if (!have || v->generation > best.generation) best = std::move(*v);
        have = true;
      } else if (v.error().value() != EBADMSG && !first_bad) {
        first_bad = v.error();
        bad_copy = off == 0 ? "primary" : "mirror";
      }
    }
    if (have) {
      dir = std::move(best);
      formatted = true;
      return {};
    }
    if (first_bad)
      return fail(err(EILSEQ), "image directory (" + bad_copy + " copy): " + why(first_bad));
    dir = DirView{};  // never formatted: empty
    formatted = false;
    return {};
  }

  Status write_dir() {
    DirView d = dir;
    d.generation = dir.generation + 1;
    d.volume_size = formatted ? dir.volume_size : vol.size();
    Directory raw;
    encode(d, raw);
    std::memcpy(meta->data(), &raw, kBlock);
    // Primary then mirror, each stable before the next: a crash leaves one valid copy.
    BASE_TRY(sync_write(vol, *meta, 0, kBlock, true));
    BASE_TRY(sync_write(vol, *meta, mirror_offset(), kBlock, true));
    dir = d;
    formatted = true;
    return {};
  }

  // The image's header: the primary, else the mirror at the slot's end. The message says why
  // neither is usable.
  Result<Header> read_header(const DirView::Entry& e) {
    std::string why_not;
    for (uint64_t off : {e.start, e.start + e.length - kBlock}) {
      BASE_TRY(sync_read(vol, *meta, off, kBlock));
      Header h;
      std::memcpy(&h, meta->data(), kBlock);
      auto c = check(h, e.length);
      if (c) return h;
      if (!why_not.empty()) why_not += "; ";
      why_not += (off == e.start ? "header: " : "header mirror: ") + why(c.error());
      if (c.error().value() == EBADMSG && off == e.start && e.state == kSlotPartial) break;
    }
    last_error = "image " + e.name + ": " + why_not;
    return err(EILSEQ);
  }

  // A slot left PARTIAL by a crash after its header was committed (docs: commit order 5-6)
  // becomes COMMITTED with the header's extent. Before every directory write.
  void reconcile() {
    for (auto& e : dir.slots) {
      if (e.state != kSlotPartial) continue;
      auto h = read_header(e);
      if (h && h->state.get() == static_cast<uint32_t>(ImageState::committed)) {
        e.state = kSlotCommitted;
        e.length = h->extent_length.get();
      }
    }
  }

  DirView::Entry* find(std::string_view name) {
    for (auto& e : dir.slots)
      if (e.state != kSlotFree && e.name == name) return &e;
    return nullptr;
  }

  // The largest free range of the volume: [start, start + length).
  std::pair<uint64_t, uint64_t> largest_gap() const {
    std::vector<std::pair<uint64_t, uint64_t>> used;
    for (const auto& e : dir.slots)
      if (e.state != kSlotFree) used.emplace_back(e.start, e.start + e.length);
    std::sort(used.begin(), used.end());
    std::pair<uint64_t, uint64_t> best{0, 0};
    uint64_t at = kExtentAlign;
    const uint64_t end = usable_end();
    for (const auto& [s, e] : used) {
      if (s > at && s - at > best.second) best = {at, s - at};
      at = std::max(at, e);
    }
    if (end > at && end - at > best.second) best = {at, end - at};
    return best;
  }
};

ImageStore::ImageStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ImageStore::~ImageStore() = default;
const std::string& ImageStore::last_error() const { return impl_->last_error; }

Result<std::unique_ptr<ImageStore>> ImageStore::open(Volume& volume) {
  if (volume.block_size() == 0 || volume.block_size() > kBlock || kBlock % volume.block_size() != 0)
    return err(EINVAL);  // directory and headers are 4 KiB blocks
  if (volume.size() < 4 * kExtentAlign) return err(ENOSPC);
  auto impl = std::make_unique<Impl>(volume);
  BASE_ASSIGN_OR_RETURN(impl->meta, volume.alloc(kBlock));
  BASE_TRY(impl->read_dir());
  return std::unique_ptr<ImageStore>(new ImageStore(std::move(impl)));
}

Result<std::vector<ImageInfo>> ImageStore::list() {
  auto& m = *impl_;
  BASE_TRY(m.read_dir());
  std::vector<ImageInfo> out;
  for (const auto& e : m.dir.slots) {
    if (e.state == kSlotFree) continue;
    auto h = m.read_header(e);
    if (h) {
      out.push_back(info_from(*h, e));
    } else {
      ImageInfo i;
      i.name = e.name;
      i.state = e.state == kSlotCommitted ? ImageState::committed : ImageState::partial;
      i.extent_start = e.start;
      i.extent_length = e.length;
      i.problem = h.error().value() == EILSEQ ? m.last_error : h.error().message();
      out.push_back(std::move(i));
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

Status ImageStore::remove(std::string_view name) {
  auto& m = *impl_;
  BASE_TRY(m.read_dir());
  auto* e = m.find(name);
  if (e == nullptr) return m.fail(err(ENOENT), "no image named " + std::string(name));
  const DirView::Entry gone = *e;
  *e = DirView::Entry{};
  m.reconcile();
  if (auto w = m.write_dir(); !w) {
    (void)m.read_dir();  // what the volume holds now
    return w;
  }
  // Overwrite the header so that a stale directory copy cannot revive the image.
  std::memset(m.meta->data(), 0, kBlock);
  return sync_write(m.vol, *m.meta, gone.start, kBlock, true);
}


// --------------------------------------------------------------------------------- writer

struct ImageWriter::Impl {
  ImageStore::Impl& store;
  Volume& vol;
  DirView::Entry slot;           // the reserved extent
  uint32_t slot_index = 0;
  CreateOptions opts;
  uint64_t created_ns = 0;
  std::unique_ptr<IoBuffer> ring;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();

  struct Piece {
    uint32_t stored;
    uint32_t crc;
    uint32_t length;
  };
  struct Stream {
    int64_t slot = -1;           // ring slot being filled
    size_t fill = 0;
    uint64_t length = 0;
    std::vector<Piece> pieces;
  };
  std::vector<Stream> streams;
  StreamIdentity identity;
  bool identity_seen = false;

  mutable std::mutex mu;         // free slots, in-flight count, first error, counters
  std::condition_variable cv;
  std::vector<uint32_t> free_slots;
  uint32_t inflight = 0;
  std::error_code first_error;
  uint64_t stored_chunks = 0;
  uint64_t bytes = 0;
  bool committed = false;
  std::string last_error;

  // Each write in flight carries its ring slot back to the completion (one per slot, fixed).
  struct WriteCtx {
    Impl* w;
    uint32_t ring_slot;
  };
  std::vector<WriteCtx> ctxs;

  Impl(ImageStore::Impl& s, Volume& v) : store(s), vol(v) {}

  uint32_t cs() const { return opts.chunk_size; }
  std::byte* slot_data(uint32_t i) const { return ring->data() + size_t{i} * cs(); }

  static void on_write(void* ctx, int e) {
    auto* c = static_cast<WriteCtx*>(ctx);
    Impl& w = *c->w;
    std::lock_guard lk(w.mu);
    if (e != 0 && !w.first_error) w.first_error = err(e);
    w.free_slots.push_back(c->ring_slot);
    --w.inflight;
    w.cv.notify_all();
  }

  // Index bytes, rounded to blocks, for `pieces` entries.
  static uint64_t index_bytes(uint64_t pieces) {
    return std::max<uint64_t>(kBlock, round_up(pieces * sizeof(IndexEntry), kBlock));
  }
  uint64_t pieces_total() const {
    uint64_t n = 0;
    for (const auto& s : streams) n += s.pieces.size();
    return n;
  }
  // Does one more stored chunk still leave room for the index (with a last piece per stream)
  // and the header mirror?
  bool room_for_chunk() const {
    const uint64_t data_end = kExtentAlign + (stored_chunks + 1) * cs();
    const uint64_t idx = index_bytes(pieces_total() + streams.size() + 1);
    return round_up(data_end, kBlock) + idx + kBlock <= slot.length;
  }

  // Sends the filled part of `st`'s slot as its next piece. Called with mu unlocked.
  Status submit(Stream& st, uint32_t stream_no) {
    const auto rs = static_cast<uint32_t>(st.slot);
    const auto len = static_cast<uint32_t>(st.fill);
    std::byte* p = slot_data(rs);
    if (stream_no == 0 && st.pieces.empty()) {
      identity = parse_stream_identity({p, len});
      identity_seen = true;
    }
    const uint32_t crc = crc32c({p, len});
    st.slot = -1;
    st.fill = 0;
    std::unique_lock lk(mu);
    if (first_error) return first_error;
    if (all_zero(p, len)) {
      st.pieces.push_back({kNoChunk, crc, len});
      free_slots.push_back(rs);
      bytes += len;
      return {};
    }
    if (!room_for_chunk()) {
      free_slots.push_back(rs);
      last_error = "image " + slot.name + ": the extent (" + std::to_string(slot.length >> 20) +
                   " MiB) is full";
      first_error = err(ENOSPC);
      return first_error;
    }
    const uint64_t k = stored_chunks++;
    st.pieces.push_back({static_cast<uint32_t>(k), crc, len});
    ++inflight;
    bytes += len;
    lk.unlock();
    // The tail of a short last piece goes out as zeroes (whole blocks on the volume).
    const uint64_t wlen = round_up(len, vol.block_size());
    std::memset(p + len, 0, wlen - len);
    auto r = vol.write(*ring, size_t{rs} * cs(), slot.start + kExtentAlign + k * cs(), wlen, false,
                       {&on_write, &ctxs[rs]});
    if (!r) {
      lk.lock();
      if (!first_error) first_error = r.error();
      free_slots.push_back(rs);
      --inflight;
      cv.notify_all();
      return r.error();
    }
    return {};
  }

  void wait_idle() {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return inflight == 0; });
  }

  Header header(ImageState state, uint64_t extent_length, uint64_t index_offset,
                const std::vector<IndexEntry>& index, uint32_t index_crc) const {
    Header h;
    std::memset(&h, 0, sizeof h);
    h.state.set(static_cast<uint32_t>(state));
    h.chunk_size.set(cs());
    h.stream_count.set(static_cast<uint32_t>(streams.size()));
    h.created_ns.set(created_ns);
    h.committed_ns.set(state == ImageState::committed ? now_ns() : 0);
    std::memcpy(h.vm_uuid, identity.vm_uuid.data(), 16);
    set_fixed_string(h.machine_type, sizeof h.machine_type, identity.machine_type);
    set_fixed_string(h.name, sizeof h.name, slot.name);
    h.extent_length.set(extent_length);
    h.data_offset.set(kExtentAlign);
    h.stored_chunks.set(stored_chunks);
    h.index_offset.set(index_offset);
    h.index_entries.set(index.size());
    h.index_crc.set(index_crc);
    uint64_t first = 0;
    for (size_t i = 0; i < streams.size(); ++i) {
      h.streams[i].length.set(streams[i].length);
      h.streams[i].chunks.set(streams[i].pieces.size());
      h.streams[i].first_entry.set(first);
      first += streams[i].pieces.size();
    }
    seal(h);
    return h;
  }

  Status write_header(const Header& h, uint64_t off, bool fua) {
    std::memcpy(store.meta->data(), &h, kBlock);
    return sync_write(vol, *store.meta, off, kBlock, fua);
  }
};

ImageWriter::ImageWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ImageWriter::~ImageWriter() {
  if (impl_) impl_->wait_idle();
}
const std::string& ImageWriter::last_error() const { return impl_->last_error; }

Progress ImageWriter::progress() const {
  std::lock_guard lk(impl_->mu);
  return {impl_->bytes, 0, std::chrono::steady_clock::now() - impl_->started};
}

Result<std::span<std::byte>> ImageWriter::buffer(uint32_t stream) {
  auto& w = *impl_;
  if (stream >= w.streams.size() || w.committed) return err(EINVAL);
  auto& st = w.streams[stream];
  if (st.slot < 0) {
    std::unique_lock lk(w.mu);
    w.cv.wait(lk, [&] { return !w.free_slots.empty() || w.first_error; });
    if (w.first_error) return w.first_error;
    st.slot = w.free_slots.back();
    w.free_slots.pop_back();
    st.fill = 0;
  }
  return std::span<std::byte>(w.slot_data(static_cast<uint32_t>(st.slot)) + st.fill, w.cs() - st.fill);
}

Status ImageWriter::produced(uint32_t stream, size_t n) {
  auto& w = *impl_;
  if (stream >= w.streams.size() || w.committed) return err(EINVAL);
  auto& st = w.streams[stream];
  if (st.slot < 0 || n > w.cs() - st.fill) return err(EINVAL);
  st.fill += n;
  st.length += n;
  if (st.fill == w.cs()) return w.submit(st, stream);
  return {};
}

Status ImageWriter::commit() {
  auto& w = *impl_;
  if (w.committed) return err(EINVAL);
  w.committed = true;
  for (uint32_t i = 0; i < w.streams.size(); ++i) {
    auto& st = w.streams[i];
    if (st.slot < 0) continue;
    if (st.fill == 0) {
      std::lock_guard lk(w.mu);
      w.free_slots.push_back(static_cast<uint32_t>(st.slot));
      st.slot = -1;
      continue;
    }
    if (auto r = w.submit(st, i); !r) {
      w.wait_idle();
      return r;
    }
  }
  w.wait_idle();
  if (w.first_error) return w.first_error;
  if (!w.identity_seen) w.identity = StreamIdentity{};  // an empty main stream

  // Index after the data, then the header mirror; the extent shrinks to what is used.
  std::vector<IndexEntry> index;
  index.reserve(w.pieces_total());
  for (const auto& st : w.streams) {
    for (const auto& p : st.pieces) {
      IndexEntry e{};
      e.stored.set(p.stored);
      e.crc.set(p.crc);
      e.length.set(p.length);
      index.push_back(e);
    }
  }
  const uint64_t index_off = round_up(kExtentAlign + w.stored_chunks * w.cs(), kBlock);
  const uint64_t ibytes = Impl::index_bytes(index.size());
  const uint64_t extent = round_up(index_off + ibytes + kBlock, kExtentAlign);
  if (extent > w.slot.length) {  // room_for_chunk() keeps this from happening
    w.last_error = "image " + w.slot.name + ": no room for the index";
    return err(ENOSPC);
  }
  const auto index_span = std::as_bytes(std::span(index));
  const uint32_t index_crc = crc32c(index_span);
  BASE_ASSIGN_OR_RETURN(auto ibuf, w.vol.alloc(ibytes));
  std::memset(ibuf->data(), 0, ibytes);
  std::memcpy(ibuf->data(), index_span.data(), index_span.size());
  BASE_TRY(sync_write(w.vol, *ibuf, w.slot.start + index_off, ibytes, false));
  const Header h = w.header(ImageState::committed, extent, index_off, index, index_crc);
  BASE_TRY(w.write_header(h, w.slot.start + extent - kBlock, false));
  BASE_TRY(sync_flush(w.vol));
  BASE_TRY(w.write_header(h, w.slot.start, true));
  // The image is committed now (the header decides); the directory catches up. If this write
  // fails, the next directory update reconciles the slot (ImageStore::Impl::reconcile).
  auto& e = w.store.dir.slots[w.slot_index];
  e.state = kSlotCommitted;
  e.length = extent;
  return w.store.write_dir();
}

Result<std::unique_ptr<ImageWriter>> ImageStore::create(const CreateOptions& o) {
  auto& m = *impl_;
  if (!valid_name(o.name)) return m.fail(err(EINVAL), "bad image name '" + o.name + "'");
  if (o.streams == 0 || o.streams > kMaxStreams || o.chunk_size < kMinChunk ||
      o.chunk_size > kMaxChunk || (o.chunk_size & (o.chunk_size - 1)) != 0 ||
      o.ring_chunks < o.streams + 1 || o.ring_chunks > 1024)
    return m.fail(err(EINVAL), "bad image options");
  BASE_TRY(m.read_dir());
  m.reconcile();  // before looking for space: a reconciled slot gives back its unused extent
  if (m.find(o.name)) return m.fail(err(EEXIST), "an image named " + o.name + " exists");
  uint32_t slot_index = kSlots;
  for (uint32_t i = 0; i < kSlots; ++i)
    if (m.dir.slots[i].state == kSlotFree) {
      slot_index = i;
      break;
    }
  if (slot_index == kSlots) return m.fail(err(ENOSPC), "the volume holds " + std::to_string(kSlots) + " images already");
  auto [start, length] = m.largest_gap();
  if (o.max_bytes != 0) length = std::min(length, round_up(o.max_bytes + 2 * kExtentAlign, kExtentAlign));
  if (length < 2 * kExtentAlign + o.chunk_size)
    return m.fail(err(ENOSPC), "no free extent on the volume for a new image");

  auto impl = std::make_unique<ImageWriter::Impl>(m, m.vol);
  auto& w = *impl;
  w.opts = o;
  w.slot = {o.name, start, length, kSlotPartial};
  w.slot_index = slot_index;
  w.created_ns = now_ns();
  w.streams.resize(o.streams);
  BASE_ASSIGN_OR_RETURN(w.ring, m.vol.alloc(size_t{o.ring_chunks} * o.chunk_size));
  w.ctxs.reserve(o.ring_chunks);
  for (uint32_t i = 0; i < o.ring_chunks; ++i) w.ctxs.push_back({&w, i});
  for (uint32_t i = o.ring_chunks; i-- > 0;) w.free_slots.push_back(i);

  m.dir.slots[slot_index] = w.slot;
  if (auto r = m.write_dir(); !r) {
    (void)m.read_dir();
    return r.error();
  }
  BASE_TRY(w.write_header(w.header(ImageState::partial, length, 0, {}, 0), start, true));
  return std::unique_ptr<ImageWriter>(new ImageWriter(std::move(impl)));
}

// --------------------------------------------------------------------------------- reader

struct ImageReader::Impl {
  ImageStore::Impl& store;
  Volume& vol;
  ImageInfo info;
  uint64_t data_start = 0;  // volume offset of stored chunk 0
  std::vector<std::vector<IndexEntry>> pieces;  // per stream
  std::string last_error;
};

struct StreamReader::Impl {
  Volume& vol;
  const ImageReader::Impl& image;
  uint32_t stream = 0;
  uint32_t depth = 0;
  std::unique_ptr<IoBuffer> ring;
  std::string last_error;

  struct SlotState {
    StreamReader::Impl* r = nullptr;
    bool inflight = false;
    bool done = false;
    int error = 0;
  };
  std::vector<SlotState> slots;
  uint64_t issued = 0;    // pieces submitted (or zero-filled)
  uint64_t returned = 0;  // pieces handed out
  std::mutex mu;
  std::condition_variable cv;

  Impl(Volume& v, const ImageReader::Impl& i) : vol(v), image(i) {}
  uint32_t cs() const { return image.info.chunk_size; }
  const std::vector<IndexEntry>& entries() const { return image.pieces[stream]; }

  static void on_read(void* ctx, int e) {
    auto* s = static_cast<SlotState*>(ctx);
    std::lock_guard lk(s->r->mu);
    s->inflight = false;
    s->done = true;
    s->error = e;
    s->r->cv.notify_all();
  }

  Status issue() {
    const auto& ent = entries();
    while (issued < ent.size() && issued < returned + depth) {
      const uint32_t si = static_cast<uint32_t>(issued % depth);
      const IndexEntry& e = ent[issued];
      auto& s = slots[si];
      s = {this, false, false, 0};
      const uint32_t stored = e.stored.get();
      if (stored == kNoChunk) {
        std::memset(ring->data() + size_t{si} * cs(), 0, e.length.get());
        s.done = true;
      } else {
        s.inflight = true;
        const uint64_t len = round_up(e.length.get(), vol.block_size());
        auto r = vol.read(*ring, size_t{si} * cs(), image.data_start + uint64_t{stored} * cs(), len,
                          {&on_read, &s});
        if (!r) {
          s.inflight = false;
          return r;
        }
      }
      ++issued;
    }
    return {};
  }

  void wait_idle() {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] {
      return std::none_of(slots.begin(), slots.end(), [](const SlotState& s) { return s.inflight; });
    });
  }
};

StreamReader::StreamReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StreamReader::~StreamReader() {
  if (impl_) impl_->wait_idle();
}
const std::string& StreamReader::last_error() const { return impl_->last_error; }

Result<std::span<const std::byte>> StreamReader::next() {
  auto& r = *impl_;
  const auto& ent = r.entries();
  if (r.returned >= ent.size()) return std::span<const std::byte>{};
  BASE_TRY(r.issue());
  const uint64_t piece = r.returned;
  const uint32_t si = static_cast<uint32_t>(piece % r.depth);
  {
    std::unique_lock lk(r.mu);
    r.cv.wait(lk, [&] { return r.slots[si].done; });
  }
  const IndexEntry& e = ent[piece];
  const std::byte* p = r.ring->data() + size_t{si} * r.cs();
  const uint32_t len = e.length.get();
  const uint64_t where = e.stored.get() == kNoChunk
                             ? 0
                             : r.image.data_start + uint64_t{e.stored.get()} * r.cs();
  if (r.slots[si].error != 0) {
    r.last_error = "stream " + std::to_string(r.stream) + " piece " + std::to_string(piece) +
                   ": read at volume offset " + std::to_string(where) + " failed";
    return err(r.slots[si].error);
  }
  if (crc32c({p, len}) != e.crc.get()) {
    r.last_error = "image " + r.image.info.name + ": stream " + std::to_string(r.stream) +
                   " piece " + std::to_string(piece) +
                   (e.stored.get() == kNoChunk ? std::string(" (a zero piece)")
                                               : " at volume offset " + std::to_string(where)) +
                   ": CRC32C mismatch";
    return err(EILSEQ);
  }
  ++r.returned;  // its slot is reused by the next issue(), after the caller is done with it
  return std::span<const std::byte>(p, len);
}

ImageReader::ImageReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ImageReader::~ImageReader() = default;
const ImageInfo& ImageReader::info() const { return impl_->info; }
const std::string& ImageReader::last_error() const { return impl_->last_error; }

Result<std::unique_ptr<StreamReader>> ImageReader::stream(uint32_t index, ReadOptions o) {
  auto& m = *impl_;
  if (index >= m.pieces.size() || o.read_ahead == 0 || o.read_ahead > 1024) return err(EINVAL);
  auto impl = std::make_unique<StreamReader::Impl>(m.vol, m);
  impl->stream = index;
  // One more slot than read-ahead: the piece the caller holds is not overwritten.
  impl->depth = o.read_ahead + 1;
  impl->slots.resize(impl->depth);
  BASE_ASSIGN_OR_RETURN(impl->ring, m.vol.alloc(size_t{impl->depth} * m.info.chunk_size));
  return std::unique_ptr<StreamReader>(new StreamReader(std::move(impl)));
}

Status ImageReader::verify(const std::function<void(const Progress&)>& progress) {
  auto& m = *impl_;
  Progress p;
  p.total = m.info.total_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t s = 0; s < m.pieces.size(); ++s) {
    BASE_ASSIGN_OR_RETURN(auto r, stream(s));
    for (;;) {
      auto piece = r->next();
      if (!piece) {
        m.last_error = r->last_error();
        return piece.error();
      }
      if (piece->empty()) break;
      p.bytes += piece->size();
      p.elapsed = std::chrono::steady_clock::now() - t0;
      if (progress) progress(p);
    }
  }
  return {};
}

Result<std::unique_ptr<ImageReader>> ImageStore::open_image(std::string_view name) {
  auto& m = *impl_;
  BASE_TRY(m.read_dir());
  auto* e = m.find(name);
  if (e == nullptr) return m.fail(err(ENOENT), "no image named " + std::string(name));
  BASE_ASSIGN_OR_RETURN(Header h, m.read_header(*e));
  if (h.state.get() != static_cast<uint32_t>(ImageState::committed))
    return m.fail(err(EBUSY), "image " + std::string(name) + " is PARTIAL: its save never completed");
  auto impl = std::make_unique<ImageReader::Impl>(ImageReader::Impl{m, m.vol, info_from(h, *e), 0, {}, {}});
  impl->data_start = e->start + kExtentAlign;
  const uint64_t n = h.index_entries.get();
  const uint64_t ibytes = std::max<uint64_t>(kBlock, round_up(n * sizeof(IndexEntry), kBlock));
  BASE_ASSIGN_OR_RETURN(auto ibuf, m.vol.alloc(ibytes));
  BASE_TRY(sync_read(m.vol, *ibuf, e->start + h.index_offset.get(), ibytes));
  std::vector<IndexEntry> index(n);
  std::memcpy(index.data(), ibuf->data(), n * sizeof(IndexEntry));
  if (crc32c(std::as_bytes(std::span(index))) != h.index_crc.get())
    return m.fail(err(EILSEQ), "image " + std::string(name) + ": index CRC32C mismatch");
  const uint32_t cs = h.chunk_size.get();
  const uint64_t stored = h.stored_chunks.get();
  for (uint32_t s = 0; s < h.stream_count.get(); ++s) {
    const auto& d = h.streams[s];
    const uint64_t first = d.first_entry.get(), chunks = d.chunks.get(), len = d.length.get();
    std::vector<IndexEntry> v(index.begin() + static_cast<ptrdiff_t>(first),
                              index.begin() + static_cast<ptrdiff_t>(first + chunks));
    for (uint64_t i = 0; i < chunks; ++i) {
      const uint64_t want = i + 1 < chunks ? cs : len - (chunks - 1) * cs;
      const uint32_t k = v[i].stored.get();
      if (v[i].length.get() != want || (k != kNoChunk && k >= stored))
        return m.fail(err(EILSEQ), "image " + std::string(name) + ": index entry " +
                                       std::to_string(first + i) + " does not fit the header");
    }
    impl->pieces.push_back(std::move(v));
  }
  return std::unique_ptr<ImageReader>(new ImageReader(std::move(impl)));
}

}  // namespace ibnbd::migrate
