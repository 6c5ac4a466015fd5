#include "backend/extents.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "backend/rbd_image.h"
#include "proto/ibnbd_proto.h"

namespace ibnbd::backend {

namespace {

constexpr uint64_t kSector = kSectorSize;
uint64_t down(uint64_t v) { return v / kSector * kSector; }
uint64_t up(uint64_t v, uint64_t limit) { return std::min(limit, (v + kSector - 1) / kSector * kSector); }

}  // namespace

bool append_extent(std::span<Extent> out, uint32_t* n, uint64_t len, uint32_t flags) {
  if (len == 0) return true;
  if (*n > 0 && out[*n - 1].flags == flags) {
    out[*n - 1].length += len;
    return true;
  }
  if (*n == out.size()) return false;
  out[(*n)++] = Extent{len, flags};
  return true;
}

int file_extents(int fd, uint64_t offset, uint64_t len, std::span<Extent> out, uint32_t* n) {
  *n = 0;
  if (out.empty()) return -EINVAL;
  const uint64_t end = offset + len;
  uint64_t pos = offset;
  // Each pass adds an extent or grows the last one, and pos only moves on; the bound is for a
  // filesystem whose answers would not (two lseeks per extent at most).
  for (size_t pass = 0; pos < end && pass < 2 * out.size() + 2; ++pass) {
    const off_t d = ::lseek(fd, static_cast<off_t>(pos), SEEK_DATA);
    uint64_t data_at = 0;
    if (d >= 0) {
      data_at = static_cast<uint64_t>(d);
    } else if (errno == ENXIO) {
      data_at = end;  // no data from pos on: a hole to the end (past EOF too)
    } else if (errno == EINVAL || errno == EOPNOTSUPP) {
      (void)append_extent(out, n, end - pos, 0);  // no SEEK_DATA here: all data is a true answer
      return 0;
    } else {
      return -errno;
    }
    // A hole up to the sector the data starts in.
    const uint64_t hole_end = std::min(end, down(data_at));
    if (hole_end > pos) {
      if (!append_extent(out, n, hole_end - pos, kExtentHole | kExtentZero)) return 0;
      pos = hole_end;
      continue;
    }
    const off_t h = ::lseek(fd, static_cast<off_t>(pos), SEEK_HOLE);
    uint64_t hole_at = 0;
    if (h >= 0) {
      hole_at = static_cast<uint64_t>(h);
    } else if (errno == ENXIO) {
      hole_at = pos;  // pos went past EOF between the two calls (a shrink): the next pass says hole
    } else {
      return -errno;
    }
    // Data up to the end of the sector the hole starts in (at least one sector: pos is in data).
    const uint64_t data_end = std::max(up(hole_at, end), std::min(end, pos + kSector));
    if (!append_extent(out, n, data_end - pos, 0)) return 0;
    pos = data_end;
  }
  return 0;
}

namespace {

int rbd_or_all_data(Backend& be, uint64_t offset, uint64_t len, std::span<Extent> out, uint32_t* n) {
  if (RbdImage* img = be.rbd()) {
    const int rc = rbd_extents(*img, offset, len, out, n);
    if (rc != -EOPNOTSUPP) return rc;
  }
  // A block device: whether a range of it is mapped is the device's secret (BLKDISCARDZEROES
  // says nothing since Linux 4.12, and reading to find zeros would cost what it saves).
  out[0] = Extent{len, 0};
  *n = 1;
  return 0;
}

}  // namespace

int block_status(Backend& be, uint64_t offset, uint64_t len, std::span<std::byte> out) {
  Extent e[kMaxExtents];
  uint32_t n = 0;
  int rc = 0;
  if (be.kind() == Backend::Kind::file)
    rc = file_extents(be.fd(), offset, len, e, &n);
  else
    rc = rbd_or_all_data(be, offset, len, e, &n);
  if (rc < 0) return rc;
  auto w = proto::encode_block_status_rsp(out, std::span<const Extent>(e, n), len);
  return w.ok() ? 0 : -w.error().value();
}

}  // namespace ibnbd::backend
