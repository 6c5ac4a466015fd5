#include "log_writes.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <utility>
#include <vector>

#include "base/unique_fd.h"

namespace ibnbd::soak::logwrites {
namespace {

using ibtrs::errc;
using ibtrs::Result;
using ibtrs::Status;

// The largest piece of an entry's data read and written at once: an entry may describe a
// device-sized write, a replay's memory does not grow with it.
constexpr size_t kChunk = 1u << 20;

std::error_code fail(std::string* why, std::string msg) {
  if (why != nullptr) *why = std::move(msg);
  return errc(EINVAL);
}

// a * b + c without wrapping, or nullopt
std::optional<uint64_t> mul_add(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t m = 0, r = 0;
  if (__builtin_mul_overflow(a, b, &m) || __builtin_add_overflow(m, c, &r)) return std::nullopt;
  return r;
}

std::string at(uint64_t index) { return "entry " + std::to_string(index) + ": "; }

// The target's byte range of an entry that writes or discards, checked against the target.
Status fits_target(const Entry& e, uint32_t ss, uint64_t target_size, std::string* why) {
  const auto end = mul_add(e.sector + e.nr_sectors, ss, 0);  // sum checked by the reader
  if (!end || *end > target_size)
    return fail(why, at(e.index) + "blocks " + std::to_string(e.sector) + "+" + std::to_string(e.nr_sectors) +
                         " of " + std::to_string(ss) + " bytes end past the target (" + std::to_string(target_size) +
                         " bytes)");
  return {};
}

}  // namespace

Result<Reader> Reader::open(Source& src, std::string* why) {
  WireSuper sb{};
  if (src.size() < sizeof sb)
    return fail(why, "log of " + std::to_string(src.size()) + " bytes: shorter than its super block");
  if (auto s = src.read_at(0, {reinterpret_cast<std::byte*>(&sb), sizeof sb}); !s) {
    if (why != nullptr) *why = "reading the super block: " + s.error().message();
    return s.error();
  }
  if (sb.magic.get() != kMagic) return fail(why, "not a dm-log-writes log (bad magic)");
  if (sb.version.get() != kVersion)
    return fail(why, "log version " + std::to_string(sb.version.get()) + ", this tool knows version 1");
  const uint32_t ss = sb.sectorsize.get();
  if (ss < kMinSectorSize || ss > kMaxSectorSize || (ss & (ss - 1)) != 0)
    return fail(why, "sectorsize " + std::to_string(ss) + ": not a power of two in [512, 65536]");
  if (src.size() < ss) return fail(why, "log of " + std::to_string(src.size()) + " bytes: shorter than its super block");
  // Every entry takes a block at least: more than fit is a damaged super, and caps every loop
  // over the entries by the log's size.
  const uint64_t n = sb.nr_entries.get();
  const uint64_t fit = src.size() / ss - 1;
  if (n > fit)
    return fail(why, "super says " + std::to_string(n) + " entries, the log's " + std::to_string(src.size()) +
                         " bytes hold at most " + std::to_string(fit) + ": truncated or damaged");
  Reader r(src, ss, n);
  r.offset_ = ss;
  return r;
}

Result<std::optional<Entry>> Reader::next(std::string* why) {
  if (index_ >= nr_entries_) return std::optional<Entry>{};
  const uint64_t i = index_;
  const uint64_t size = src_->size();
  if (offset_ > size || size - offset_ < sectorsize_)
    return fail(why, at(i) + "header at byte " + std::to_string(offset_) + " is past the log's end (" +
                         std::to_string(size) + " bytes): truncated log");
  // The header and a mark's name share one block: read the block (at most 64 KiB, by the
  // checked sectorsize).
  if (block_.size() != sectorsize_) block_.resize(sectorsize_);
  const auto& block = block_;
  if (auto s = src_->read_at(offset_, block_); !s) {
    if (why != nullptr) *why = at(i) + "reading the header: " + s.error().message();
    return s.error();
  }
  WireEntry we{};
  std::memcpy(&we, block.data(), sizeof we);
  Entry e;
  e.index = i;
  e.sector = we.sector.get();
  e.nr_sectors = we.nr_sectors.get();
  e.flags = we.flags.get();
  const uint64_t data_len = we.data_len.get();
  if ((e.flags & ~kKnownFlags) != 0) return fail(why, at(i) + "unknown flags " + std::to_string(e.flags));
  if (e.is_mark()) {
    // The kernel logs a mark as its own entry: no sectors, no other flag, the name after the
    // header in the same block.
    if (e.flags != kMark || e.nr_sectors != 0 || e.sector != 0)
      return fail(why, at(i) + "a MARK with flags " + std::to_string(e.flags) + ", sector " + std::to_string(e.sector) +
                           ", " + std::to_string(e.nr_sectors) + " sectors");
    if (data_len > sectorsize_ - sizeof we)
      return fail(why, at(i) + "mark name of " + std::to_string(data_len) + " bytes does not fit its block");
    e.mark.assign(reinterpret_cast<const char*>(block.data()) + sizeof we, data_len);
    if (e.mark.find('\0') != std::string::npos) return fail(why, at(i) + "mark name with a NUL byte");
  } else if (data_len != 0) {
    // Inline data (data_len on a write) came from DAX logging, which 6.x kernels do not have:
    // its layout is not this one, so it is refused rather than guessed.
    return fail(why, at(i) + "data_len " + std::to_string(data_len) + " on a write: inline data is not supported");
  }
  if (e.is_discard() && (e.flags & (kFlush | kFua)) != 0)
    return fail(why, at(i) + "a DISCARD with FLUSH or FUA (the kernel never logs one)");
  // The range must be addressable in bytes, whatever the target.
  if (!mul_add(e.sector, 1, e.nr_sectors) || !mul_add(e.sector + e.nr_sectors, sectorsize_, 0))
    return fail(why, at(i) + "blocks " + std::to_string(e.sector) + "+" + std::to_string(e.nr_sectors) +
                         " overflow a 64-bit byte offset");
  e.data_offset = offset_ + sectorsize_;
  uint64_t next = e.data_offset;
  if (e.has_data()) {
    const auto end = mul_add(e.nr_sectors, sectorsize_, e.data_offset);
    if (!end || *end > size)
      return fail(why, at(i) + std::to_string(e.nr_sectors) + " blocks of data at byte " +
                           std::to_string(e.data_offset) + " run past the log's end (" + std::to_string(size) +
                           " bytes): truncated log");
    next = *end;
  }
  e.next_offset = next;
  offset_ = next;
  ++index_;
  return std::optional<Entry>{std::move(e)};
}

Result<Point> parse_point(std::string_view s) {
  Point p;
  if (s.starts_with("mark:")) {
    p.mark = std::string(s.substr(5));
    if (p.mark.empty()) return errc(EINVAL);
    return p;
  }
  uint64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || ptr != s.data() + s.size()) return errc(EINVAL);
  p.index = v;
  return p;
}

Result<ReplayStats> replay(Source& log, Sink& target, const ReplayOptions& o, std::string* why) {
  BASE_ASSIGN_OR_RETURN(Reader r, Reader::open(log, why));
  const uint32_t ss = r.sectorsize();
  // Pass 1: find both points and check every entry of the range, writing nothing.
  bool started = !o.start_after.has_value();
  uint64_t first_index = 0, first_offset = ss;
  std::optional<uint64_t> last;
  uint64_t largest = 0;
  while (!last) {
    BASE_ASSIGN_OR_RETURN(auto e, r.next(why));
    if (!e) break;
    if (!started) {
      if (o.to.matches(*e))
        return fail(why, "replay-to " + o.to.str() + " (entry " + std::to_string(e->index) +
                             ") is not after start-after " + o.start_after->str());
      if (o.start_after->matches(*e)) {
        started = true;
        first_index = e->index + 1;
        first_offset = e->next_offset;
      }
      continue;
    }
    if (e->has_data() || e->is_discard()) BASE_TRY(fits_target(*e, ss, target.size(), why));
    if (e->has_data()) largest = std::max(largest, e->nr_sectors);
    if (o.to.matches(*e)) last = e->index;
  }
  if (!started)
    return fail(why, "start-after " + o.start_after->str() + ": no such entry in the log (" +
                         std::to_string(r.nr_entries()) + " entries)");
  if (!last)
    return fail(why, "replay-to " + o.to.str() + ": no such entry after " +
                         (o.start_after ? "start-after " + o.start_after->str() : std::string("the start")) + " (" +
                         std::to_string(r.nr_entries()) + " entries)");
  if (o.drop && (*o.drop < first_index || *o.drop > *last))
    return fail(why, "drop " + std::to_string(*o.drop) + " is outside the replayed entries " +
                         std::to_string(first_index) + ".." + std::to_string(*last));

  // Pass 2: apply them.
  ReplayStats st;
  st.first = first_index;
  st.last = *last;
  std::vector<std::byte> buf(static_cast<size_t>(std::min<uint64_t>(kChunk, largest * ss)));
  r.seek(first_index, first_offset);
  for (;;) {
    BASE_ASSIGN_OR_RETURN(auto e, r.next(why));
    if (!e) break;  // cannot happen: pass 1 found `last` in the same bytes
    if (o.drop && e->index == *o.drop) {
      ++st.dropped;
    } else if (e->is_discard()) {
      if (e->nr_sectors != 0) {
        if (auto s = target.discard(e->sector * ss, e->nr_sectors * ss); !s) {
          if (why != nullptr) *why = at(e->index) + "discard on the target: " + s.error().message();
          return s.error();
        }
      }
      ++st.discards;
    } else if (e->has_data()) {
      const uint64_t total = e->nr_sectors * ss;
      for (uint64_t done = 0; done < total;) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), total - done));
        std::span<std::byte> piece(buf.data(), n);
        if (auto s = log.read_at(e->data_offset + done, piece); !s) {
          if (why != nullptr) *why = at(e->index) + "reading its data from the log: " + s.error().message();
          return s.error();
        }
        if (auto s = target.write_at(e->sector * ss + done, piece); !s) {
          if (why != nullptr) *why = at(e->index) + "writing the target: " + s.error().message();
          return s.error();
        }
        done += n;
      }
      ++st.writes;
      st.bytes += total;
    }
    if (e->index == *last) break;
  }
  if (auto s = target.sync(); !s) {
    if (why != nullptr) *why = "syncing the target: " + s.error().message();
    return s.error();
  }
  return st;
}

Status for_each(Source& log, const std::function<Status(const Entry&)>& fn, std::string* why) {
  BASE_ASSIGN_OR_RETURN(Reader r, Reader::open(log, why));
  for (;;) {
    BASE_ASSIGN_OR_RETURN(auto e, r.next(why));
    if (!e) return {};
    BASE_TRY(fn(*e));
  }
}

std::string flag_names(uint64_t flags) {
  static constexpr std::pair<uint64_t, const char*> kNames[] = {
      {kFlush, "FLUSH"}, {kFua, "FUA"}, {kDiscard, "DISCARD"}, {kMark, "MARK"}, {kMetadata, "META"}};
  std::string out;
  for (const auto& [bit, name] : kNames) {
    if ((flags & bit) == 0) continue;
    if (!out.empty()) out += '|';
    out += name;
  }
  if ((flags & (kDiscard | kMark)) == 0) out = out.empty() ? "WRITE" : "WRITE|" + out;
  return out;
}

std::string printable(std::string_view name) {
  std::string out;
  for (const char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (u > 0x20 && u < 0x7f && c != '\\') {
      out += c;
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 15];
    }
  }
  return out;
}

namespace {

struct Opened {
  base::UniqueFd fd;  // a file or a block device
  uint64_t size = 0;
  bool block = false;
};

Result<Opened> open_path(const std::string& path, int flags) {
  Opened o;
  o.fd.reset(::open(path.c_str(), flags | O_CLOEXEC));
  if (!o.fd) return errc(errno);
  const int fd = o.fd.get();
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errc(errno);
  if (S_ISBLK(st.st_mode)) {
    o.block = true;
    if (::ioctl(fd, BLKGETSIZE64, &o.size) != 0) return errc(errno);
  } else if (S_ISREG(st.st_mode)) {
    o.size = static_cast<uint64_t>(st.st_size);
  } else {
    return errc(EINVAL);  // a pipe or a directory has no offsets to replay at
  }
  return o;
}

class FdSource final : public Source {
 public:
  explicit FdSource(Opened o) : o_(std::move(o)) {}
  uint64_t size() const override { return o_.size; }
  Status read_at(uint64_t off, std::span<std::byte> out) override {
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::pread(o_.fd.get(), out.data() + done, out.size() - done, static_cast<off_t>(off + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return errc(errno);
      if (n == 0) return errc(EIO);  // the file shrank under us
      done += static_cast<size_t>(n);
    }
    return {};
  }

 private:
  Opened o_;
};

class FdSink final : public Sink {
 public:
  explicit FdSink(Opened o) : o_(std::move(o)) {}
  uint64_t size() const override { return o_.size; }
  Status write_at(uint64_t off, std::span<const std::byte> data) override {
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::pwrite(o_.fd.get(), data.data() + done, data.size() - done, static_cast<off_t>(off + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return errc(errno);
      if (n == 0) return errc(EIO);
      done += static_cast<size_t>(n);
    }
    return {};
  }
  Status discard(uint64_t off, uint64_t len) override {
    if (o_.block) {
      uint64_t range[2] = {off, len};
      if (::ioctl(o_.fd.get(), BLKDISCARD, range) == 0) return {};
    } else if (::fallocate(o_.fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off),
                           static_cast<off_t>(len)) == 0) {
      return {};
    }
    // No discard here (EOPNOTSUPP, a device without it): zeroes are one state a discard may
    // leave, so they stand for it.
    const std::vector<std::byte> zeroes(static_cast<size_t>(std::min<uint64_t>(kChunk, len)));
    for (uint64_t done = 0; done < len;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(zeroes.size(), len - done));
      BASE_TRY(write_at(off + done, {zeroes.data(), n}));
      done += n;
    }
    return {};
  }
  Status sync() override {
    if (::fdatasync(o_.fd.get()) != 0) return errc(errno);
    return {};
  }

 private:
  Opened o_;
};

}  // namespace

Result<std::unique_ptr<Source>> open_source(const std::string& path) {
  BASE_ASSIGN_OR_RETURN(Opened o, open_path(path, O_RDONLY));
  return std::unique_ptr<Source>(new FdSource(std::move(o)));
}

Result<std::unique_ptr<Sink>> open_sink(const std::string& path) {
  BASE_ASSIGN_OR_RETURN(Opened o, open_path(path, O_RDWR));
  return std::unique_ptr<Sink>(new FdSink(std::move(o)));
}

}  // namespace ibnbd::soak::logwrites
