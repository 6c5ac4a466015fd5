// An open librbd image (Backend::rbd()) and how the IoEngine starts one stage of a request on it.
// Internal to ibnbd_backend: librbd's headers stay out of the public ones. Built without librbd
// (IBNBD_HAVE_RBD unset), RbdImage is never created and rbd_start() fails with EOPNOTSUPP.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "ibnbd/backend.h"
#include "ibnbd/types.h"

namespace ibnbd::backend {

struct RbdAio;
enum class RbdStage : uint8_t;

// Stands in for librbd in the backend's own tests (tests/blockdev/backend_rbd_test.cc): starts
// each stage itself and completes it from a thread of its own, as librbd's callbacks come. The
// same contract as rbd_start() and friends below.
struct RbdFake {
  virtual ~RbdFake() = default;
  virtual int start(RbdStage st, uint64_t off, uint64_t len, const iovec* iov, int niov, bool nounmap,
                    RbdAio* aio) = 0;
  virtual int size(uint64_t* bytes) = 0;
  virtual int sync() = 0;
};

struct RbdImage {
  struct Handles;  // rados_ioctx_t + rbd_image_t (+ the update watch), and the cluster's
  std::unique_ptr<Handles> h;
  RbdFake* fake = nullptr;  // tests only: every call goes to it instead of librbd
  bool read_only = false;   // opened with rbd_open_read_only: librbd keeps no header watch
  // Backend::watch_size's callback, called from librbd's thread; set before the watch and
  // outlived by it (~RbdImage unwatches first).
  std::function<void()> on_update;
  RbdImage();
  ~RbdImage();  // rbd_update_unwatch, rbd_close (which waits for its AIO), then the ioctx
  RbdImage(const RbdImage&) = delete;
  RbdImage& operator=(const RbdImage&) = delete;
};

// One stage in flight on an image, owned by the caller (the engine has one per slot: a slot has
// one stage in flight at a time, so the IO path allocates nothing of its own). `fn(this, res)`
// runs once on a librbd thread with librbd's return value (bytes or 0, or a negative errno); it
// may hand the RbdAio on (to the owning thread), which may reuse it at once: nothing touches the
// RbdAio after fn.
struct RbdAio;
using RbdDoneFn = void (*)(RbdAio* aio, int64_t res);
struct RbdAio {
  RbdDoneFn fn = nullptr;
  void* owner = nullptr;  // the caller's
  uint64_t tag = 0;       // the caller's
  int64_t res = 0;        // the caller's (e.g. res kept for the owning thread)
  RbdAio* next = nullptr; // the caller's (e.g. a completion list)
};

// What one stage of a request is on an image.
enum class RbdStage : uint8_t {
  flush,         // rbd_aio_flush: PREFLUSH, FUA's durability after the operation, FLUSH
  read,          // rbd_aio_read / readv into the caller's memory
  write,         // rbd_aio_write / writev from it
  discard,       // rbd_aio_discard
  write_zeroes,  // rbd_aio_write_zeroes (NOUNMAP: thick provisioning of the zeroed range)
};

// Starts one stage; `aio->fn` follows exactly once unless this returns an error (negative
// errno: librbd refused it at once, nothing was started).
int rbd_start(RbdImage& img, RbdStage st, uint64_t off, uint64_t len, const iovec* iov, int niov,
              bool nounmap, RbdAio* aio);

// BLOCK_STATUS of an image (backend/extents.h): rbd_diff_iterate2 from the image's creation
// (no from-snapshot, parents included, exact extents rather than whole objects) over at most
// kRbdExtentsSpan bytes of [off, off + len): allocated extents are data, the rest holes that
// read as zeros. At most out.size() extents into out, *n of them, a prefix of the range.
// Blocks on the cluster (the engine's helper thread). -EOPNOTSUPP for a fake or without librbd
// (the caller answers all data).
inline constexpr uint64_t kRbdExtentsSpan = 256ull << 20;
int rbd_extents(RbdImage& img, uint64_t off, uint64_t len, std::span<Extent> out, uint32_t* n);

// rbd_get_size / rbd_flush (blocking; control thread).
int rbd_size(RbdImage& img, uint64_t* bytes);
// rbd_update_watch with img.on_update as the callback (Backend::watch_size). -EOPNOTSUPP for a
// fake or a read-only image.
int rbd_watch(RbdImage& img);
int rbd_sync(RbdImage& img);
// Whether librbd's cache may hold writes it acknowledged (rbd_cache on, write-back): what the
// geometry's kCacheWriteBack says to clients.
bool rbd_cache_volatile(RbdImage& img);
// Breaks the exclusive lock when another client holds it (Backend::take_over); *fenced names
// the owners broken.
int rbd_take_over(RbdImage& img, std::string* fenced);

// How the rbd code fills a Backend of kind rbd (a friend of Backend).
struct RbdAccess {
  // A Backend over `img`: `bytes` long, objects of `obj_size` bytes (the discard granularity),
  // read-only or not. RbdCluster::open uses it, and the backend's own tests with a fake image.
  static std::unique_ptr<Backend> make(std::unique_ptr<RbdImage> img, std::string name, FileId id, uint64_t bytes,
                                       uint64_t obj_size, bool read_only);
  // For the backend's own tests: an image whose every call goes to `fake` (which must outlive
  // the Backend).
  static std::unique_ptr<Backend> make_fake(RbdFake* fake, uint64_t bytes, bool read_only);
};

}  // namespace ibnbd::backend
