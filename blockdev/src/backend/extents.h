// Where the data of a store lies (the IoEngine's BLOCK_STATUS): holes of a sparse file through
// lseek(SEEK_DATA / SEEK_HOLE), allocated extents of an RBD image through rbd_diff_iterate2, all
// data for a block device. Internal to ibnbd_backend; unit-tested.
//
// Each call describes a prefix of the range asked for, at most kMaxExtents extents (the caller
// asks again from where it ended), so the work per call is bounded by extents, never by the
// size of the store: a 1 TiB file with one hole at its end costs two lseeks. They block (on the
// filesystem's metadata, the cluster): the engine runs them on its helper thread.
#pragma once

#include <cstdint>
#include <span>

#include "ibnbd/backend.h"
#include "ibnbd/types.h"

namespace ibnbd::backend {

// Appends `len` bytes with `flags` to out[0..*n), merged into the last extent when the flags
// agree. False when out is full (nothing added). len 0 adds nothing.
bool append_extent(std::span<Extent> out, uint32_t* n, uint64_t len, uint32_t flags);

// The extents of [offset, offset + len) of a regular file: holes (kExtentHole | kExtentZero)
// and data (0), boundaries on 512-byte sectors (a sector partly data is data), at most
// out.size() of them. *n receives how many; they cover a prefix of the range, > 0 bytes unless
// len is 0. A filesystem without SEEK_DATA (EINVAL from lseek) answers all data. Past the end
// of the file (it shrank): a hole. Returns 0 or -errno.
int file_extents(int fd, uint64_t offset, uint64_t len, std::span<Extent> out, uint32_t* n);

// The wire answer (proto::encode_block_status_rsp) for [offset, offset + len) of `be` into
// `out` (proto::kBlockStatusReplyBytes). len: 1..UINT32_MAX, a multiple of 512. 0 or -errno.
int block_status(Backend& be, uint64_t offset, uint64_t len, std::span<std::byte> out);

}  // namespace ibnbd::backend
