// RBD images through librados + librbd (rbd.h): names, the cluster connection, opening an image
// as a Backend, and one stage of a request as librbd AIO (rbd_image.h).
#include "ibnbd/rbd.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "backend/extents.h"
#include "backend/rbd_image.h"

#ifdef IBNBD_HAVE_RBD
#include <rados/librados.h>
#include <rbd/librbd.h>
#endif

namespace ibnbd {

namespace {

constexpr size_t kMaxRbdComponent = 255;

// A pool, image, snapshot or namespace name we accept: Ceph allows more, but these are the
// names that cannot be read two ways in "rbd:POOL/IMAGE@SNAP" or a log line.
bool valid_component(std::string_view c, std::string* why, const char* what) {
  auto bad = [&](const std::string& reason) {
    if (why) *why = std::string(what) + " " + reason;
    return false;
  };
  if (c.empty()) return bad("is empty");
  if (c.size() > kMaxRbdComponent) return bad("is longer than 255 bytes");
  if (c == "." || c == "..") return bad("is '.' or '..'");
  for (const char ch : c) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == '/' || ch == '@' || u < 0x20 || u == 0x7f)
      return bad("has a '/', '@' or control character");
  }
  return true;
}

}  // namespace

std::string RbdName::text() const {
  std::string s = std::string(kRbdPrefix) + pool + "/" + image;
  if (!snap.empty()) s += "@" + snap;
  return s;
}

bool is_rbd_name(std::string_view dev_name) { return dev_name.substr(0, kRbdPrefix.size()) == kRbdPrefix; }

Result<RbdName> parse_rbd_name(std::string_view dev_name, std::string* why) {
  if (!is_rbd_name(dev_name)) {
    if (why) *why = "not an rbd: name";
    return errc(EINVAL);
  }
  std::string_view rest = dev_name.substr(kRbdPrefix.size());
  const size_t slash = rest.find('/');
  if (slash == std::string_view::npos) {
    if (why) *why = "want rbd:POOL/IMAGE[@SNAP]";
    return errc(EINVAL);
  }
  RbdName n;
  const std::string_view pool = rest.substr(0, slash);
  std::string_view image = rest.substr(slash + 1);
  std::string_view snap;
  if (const size_t at = image.find('@'); at != std::string_view::npos) {
    snap = image.substr(at + 1);
    image = image.substr(0, at);
    if (!valid_component(snap, why, "snapshot name")) return errc(EINVAL);
  }
  if (!valid_component(pool, why, "pool name") || !valid_component(image, why, "image name"))
    return errc(EINVAL);
  n.pool = pool;
  n.image = image;
  n.snap = snap;
  return n;
}

Result<std::string> rbd_namespace(std::string_view tmpl, std::string_view session_name) {
  std::string out;
  for (size_t i = 0; i < tmpl.size();) {
    if (tmpl.substr(i, kSessNamePlaceholder.size()) == kSessNamePlaceholder) {
      if (!valid_component(session_name, nullptr, "session")) return errc(EINVAL);
      out += session_name;
      i += kSessNamePlaceholder.size();
    } else {
      out += tmpl[i++];
    }
  }
  if (!out.empty() && !valid_component(out, nullptr, "namespace")) return errc(EINVAL);
  return out;
}

std::unique_ptr<Backend> backend::RbdAccess::make(std::unique_ptr<RbdImage> img, std::string name, FileId id,
                                                  uint64_t bytes, uint64_t obj_size, bool read_only) {
  std::unique_ptr<Backend> b(new Backend());
  b->rbd_ = std::move(img);
  b->name_ = std::move(name);
  b->id_ = std::move(id);
  b->kind_ = Backend::Kind::rbd;
  b->read_only_ = read_only;
  DeviceGeometry& g = b->geo_;
  // librbd takes any byte range; 512-byte sectors are the wire's unit. Objects (4 MiB by
  // default) are the unit of allocation: a discard smaller than one only zeroes.
  g.logical_block_size = kSectorSize;
  g.physical_block_size = 4096;
  // librbd takes any length in one op: the session's largest request (a chunk set, 1 MiB by
  // default) is the bound, as for files. At 512 KiB a 1 MiB write was two RADOS ops.
  g.max_hw_sectors = 64 * 1024;
  g.max_segments = kMaxIoSegments;
  if (!read_only) {
    b->can_discard_ = b->can_write_zeroes_ = true;
    g.max_discard_sectors = g.max_write_zeroes_sectors = UINT32_MAX;
    g.discard_granularity = static_cast<uint32_t>(std::min<uint64_t>(obj_size, UINT32_MAX));
  }
  // librbd's cache (rbd_cache, on by default) is write-back after the first flush: what it
  // acknowledged may go with this process, which a client that fails over to another gateway
  // must know (client.h, "Flush"). Without it, or write-through, an acknowledged write is in
  // RADOS: no volatile cache to report.
  g.cache_policy = kCacheFua;
  if (backend::rbd_cache_volatile(*b->rbd_)) g.cache_policy |= kCacheWriteBack;
  b->size_.store(bytes / kSectorSize * kSectorSize, std::memory_order_release);
  return b;
}

std::unique_ptr<Backend> backend::RbdAccess::make_fake(RbdFake* fake, uint64_t bytes, bool read_only) {
  auto img = std::make_unique<RbdImage>();
  img->fake = fake;
  FileId id;
  id.rbd = "fake/" + std::to_string(reinterpret_cast<uintptr_t>(fake));
  return make(std::move(img), "rbd:fake/image", std::move(id), bytes, 4u << 20, read_only);
}

#ifdef IBNBD_HAVE_RBD

bool rbd_supported() { return true; }

struct RbdCluster::Impl {
  rados_t cluster = nullptr;
  std::string fsid;
  ~Impl() {
    if (cluster) rados_shutdown(cluster);
  }
};

struct backend::RbdImage::Handles {
  rados_ioctx_t io = nullptr;
  rbd_image_t image = nullptr;
  uint64_t watch = 0;
  bool watching = false;
  ~Handles() {
    // librbd waits for a callback that is running before unwatch returns: none runs later.
    if (watching) (void)rbd_update_unwatch(image, watch);
    if (image) rbd_close(image);
    if (io) rados_ioctx_destroy(io);
  }
};

backend::RbdImage::RbdImage() = default;
// The handles (and with them the update watch) go before on_update, which the watch calls.
backend::RbdImage::~RbdImage() { h.reset(); }

RbdCluster::RbdCluster(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RbdCluster::~RbdCluster() = default;
const std::string& RbdCluster::fsid() const { return impl_->fsid; }

Result<std::unique_ptr<RbdCluster>> RbdCluster::connect(const RbdConfig& c, std::string* why) {
  auto fail = [why](int rc, const std::string& what) -> std::error_code {
    if (why) *why = what + ": " + std::strerror(rc);
    return errc(rc);
  };
  if (!valid_component(c.client_id, why, "client id")) return errc(EINVAL);
  // librados reads a missing file as "no configuration" and then fails much later with a
  // timeout; a missing conf or keyring named in our configuration is the admin's mistake now.
  for (const std::string* f : {&c.conf_file, &c.keyring}) {
    if (!f->empty() && ::access(f->c_str(), R_OK) != 0) return fail(errno, "cannot read " + *f);
  }
  auto impl = std::make_unique<Impl>();
  int rc = rados_create(&impl->cluster, c.client_id.c_str());
  if (rc < 0) return fail(-rc, "rados_create");
  rc = rados_conf_read_file(impl->cluster, c.conf_file.empty() ? nullptr : c.conf_file.c_str());
  if (rc < 0) return fail(-rc, "reading " + (c.conf_file.empty() ? std::string("ceph.conf") : c.conf_file));
  const std::string timeout = std::to_string(std::max<int64_t>(c.connect_timeout.count(), 1));
  struct {
    const char* key;
    std::string value;
  } settings[] = {
      {"keyring", c.keyring},
      // The mons must answer within the timeout (the default, 300 s, would hold the server's
      // control thread that long).
      {"client_mount_timeout", timeout},
      {"rados_mon_op_timeout", timeout},
      // librbd's logs go to the cluster's log settings, never to our stderr.
      {"log_to_stderr", "false"},
      {"err_to_stderr", "false"},
  };
  for (const auto& s : settings) {
    if (s.value.empty()) continue;
    rc = rados_conf_set(impl->cluster, s.key, s.value.c_str());
    if (rc < 0) return fail(-rc, std::string("setting ") + s.key);
  }
  rc = rados_connect(impl->cluster);
  if (rc < 0) {
    // rados_connect answers a refused key with EACCES/EPERM and no mon with ETIMEDOUT.
    return fail(-rc, "connecting to the cluster as client." + c.client_id);
  }
  char fsid[64] = {};
  rc = rados_cluster_fsid(impl->cluster, fsid, sizeof(fsid) - 1);
  if (rc < 0) return fail(-rc, "the cluster's fsid");
  impl->fsid = fsid;
  return std::unique_ptr<RbdCluster>(new RbdCluster(std::move(impl)));
}

Result<std::unique_ptr<Backend>> RbdCluster::open(const RbdName& name, std::string_view ns, const OpenOptions& o,
                                                  std::string* why) {
  auto fail = [why](int rc, const std::string& what) -> std::error_code {
    if (why) *why = what + ": " + std::strerror(rc);
    return errc(rc);
  };
  const bool snap = !name.snap.empty();
  if (snap && !o.read_only) {
    if (why) *why = "snapshots are read-only";
    return errc(EROFS);
  }
  auto img = std::make_unique<backend::RbdImage>();
  img->read_only = o.read_only;
  img->h = std::make_unique<backend::RbdImage::Handles>();
  auto& h = *img->h;
  int rc = rados_ioctx_create(impl_->cluster, name.pool.c_str(), &h.io);
  if (rc < 0) return fail(-rc, "pool " + name.pool);
  if (!ns.empty()) rados_ioctx_set_namespace(h.io, std::string(ns).c_str());
  const char* snap_name = snap ? name.snap.c_str() : nullptr;
  // Read-only opens take no watch (a watch is a write): a user whose caps allow only reads can
  // still export an image or snapshot ro. Writable opens watch the header, which is how librbd
  // learns of resizes and hands the exclusive lock over.
  rc = o.read_only ? rbd_open_read_only(h.io, name.image.c_str(), &h.image, snap_name)
                   : rbd_open(h.io, name.image.c_str(), &h.image, snap_name);
  if (rc < 0) {
    h.image = nullptr;
    std::string what = "image " + name.image;
    if (!ns.empty()) what += " (namespace " + std::string(ns) + ")";
    if (snap) what += " snapshot " + name.snap;
    return fail(-rc, what);
  }
  uint64_t bytes = 0;
  rc = rbd_get_size(h.image, &bytes);
  if (rc < 0) return fail(-rc, "the image's size");
  char id[128] = {};
  rc = rbd_get_id(h.image, id, sizeof(id));
  if (rc < 0) return fail(-rc, "the image's id");
  uint64_t snap_id = 0;
  if (snap && (rc = rbd_snap_get_id(h.image, snap_name, &snap_id)) < 0) return fail(-rc, "the snapshot's id");

  FileId fid;
  fid.rbd = impl_->fsid + "/" + std::to_string(rados_ioctx_get_id(h.io)) + "/" + std::string(ns) + "/" + id + "@" +
            (snap ? std::to_string(snap_id) : "head");
  rbd_image_info_t info{};
  const uint64_t obj = rbd_stat(h.image, &info, sizeof(info)) == 0 && info.obj_size ? info.obj_size : 4u << 20;
  return backend::RbdAccess::make(std::move(img), name.text(), std::move(fid), bytes, obj, o.read_only);
}

namespace backend {

namespace {
void aio_done(rbd_completion_t c, void* p) {
  const int64_t res = rbd_aio_get_return_value(c);
  rbd_aio_release(c);
  auto* a = static_cast<RbdAio*>(p);
  a->fn(a, res);  // last: the RbdAio may be reused from here on
}
}  // namespace

int rbd_start(RbdImage& img, RbdStage st, uint64_t off, uint64_t len, const iovec* iov, int niov, bool nounmap,
              RbdAio* aio) {
  if (img.fake) return img.fake->start(st, off, len, iov, niov, nounmap, aio);
  rbd_completion_t c = nullptr;
  int rc = rbd_aio_create_completion(aio, aio_done, &c);
  if (rc < 0) return rc;
  rbd_image_t im = img.h->image;
  switch (st) {
    case RbdStage::flush: rc = rbd_aio_flush(im, c); break;
    case RbdStage::read:
      rc = niov == 1 ? rbd_aio_read(im, off, iov[0].iov_len, static_cast<char*>(iov[0].iov_base), c)
                     : rbd_aio_readv(im, iov, niov, off, c);
      break;
    case RbdStage::write:
      rc = niov == 1 ? rbd_aio_write(im, off, iov[0].iov_len, static_cast<const char*>(iov[0].iov_base), c)
                     : rbd_aio_writev(im, iov, niov, off, c);
      break;
    case RbdStage::discard: rc = rbd_aio_discard(im, off, len, c); break;
    case RbdStage::write_zeroes:
      rc = rbd_aio_write_zeroes(im, off, len, c, nounmap ? RBD_WRITE_ZEROES_FLAG_THICK_PROVISION : 0, 0);
      break;
  }
  if (rc < 0) rbd_aio_release(c);
  return rc < 0 ? rc : 0;
}

bool rbd_cache_volatile(RbdImage& img) {
  if (img.fake) return true;  // a fake stands for the default: rbd_cache on, write-back
  // The image's effective settings (the configuration, then the pool's and the image's own).
  int n = 0;
  if (rbd_config_image_list(img.h->image, nullptr, &n) != -ERANGE || n <= 0) return true;
  std::vector<rbd_config_option_t> opts(static_cast<size_t>(n));
  if (rbd_config_image_list(img.h->image, opts.data(), &n) < 0) return true;
  bool cache = true, writethrough = false;
  for (int i = 0; i < n; ++i) {
    const std::string_view k = opts[i].name, v = opts[i].value;
    if (k == "rbd_cache") cache = v == "true";
    if (k == "rbd_cache_policy" && v == "writethrough") writethrough = true;
    if (k == "rbd_cache_max_dirty" && v == "0") writethrough = true;
  }
  rbd_config_image_list_cleanup(opts.data(), n);
  return cache && !writethrough;
}

int rbd_size(RbdImage& img, uint64_t* bytes) {
  return img.fake ? img.fake->size(bytes) : rbd_get_size(img.h->image, bytes);
}

namespace {
struct DiffWalk {
  std::span<Extent> out;
  uint32_t n = 0;
  uint64_t pos = 0;  // described up to here
  uint64_t end = 0;
  bool add(uint64_t len, uint32_t flags) { return append_extent(out, &n, len, flags); }
};
constexpr int kDiffFull = -ENOSPC;  // the walk's own stop: out is full
int diff_cb(uint64_t offs, size_t len, int exists, void* arg) {
  auto* w = static_cast<DiffWalk*>(arg);
  // Sector boundaries (a sector partly allocated is data), in order, inside the range; librbd
  // reports in ascending order, and anything else ends the walk where it is.
  uint64_t from = offs / kSectorSize * kSectorSize;
  uint64_t to = std::min(w->end, (offs + len + kSectorSize - 1) / kSectorSize * kSectorSize);
  from = std::max(from, w->pos);
  if (to <= from || !exists) return 0;  // exists = 0: discarded since from_snap, none here
  if (!w->add(from - w->pos, kExtentHole | kExtentZero)) return kDiffFull;
  w->pos = from;
  if (!w->add(to - from, 0)) return kDiffFull;
  w->pos = to;
  return w->n == w->out.size() ? kDiffFull : 0;
}
}  // namespace

int rbd_extents(RbdImage& img, uint64_t off, uint64_t len, std::span<Extent> out, uint32_t* n) {
  *n = 0;
  if (img.fake || out.empty()) return -EOPNOTSUPP;
  DiffWalk w{out, 0, off, off + std::min(len, kRbdExtentsSpan)};
  const int rc = rbd_diff_iterate2(img.h->image, nullptr, off, w.end - off, 1, 0, &diff_cb, &w);
  if (rc < 0 && rc != kDiffFull) return rc;
  // Full: the answer ends with the last allocated extent; else the rest of the span is a hole.
  if (rc != kDiffFull) (void)w.add(w.end - w.pos, kExtentHole | kExtentZero);
  *n = w.n;
  return 0;
}
int rbd_sync(RbdImage& img) { return img.fake ? img.fake->sync() : rbd_flush(img.h->image); }

namespace {
void update_cb(void* arg) {
  auto* img = static_cast<RbdImage*>(arg);
  img->on_update();
}
}  // namespace

int rbd_watch(RbdImage& img) {
  // A read-only image has no header watch in librbd (rbd_open_read_only), so nothing would
  // ever call back.
  if (img.fake || img.read_only) return -EOPNOTSUPP;
  if (img.h->watching) return -EBUSY;
  const int rc = rbd_update_watch(img.h->image, &img.h->watch, update_cb, &img);
  if (rc == 0) img.h->watching = true;
  return rc;
}

int rbd_take_over(RbdImage& img, std::string* fenced) {
  if (img.fake) return 0;  // a fake has no lock
  rbd_image_t im = img.h->image;
  int owner = 0;
  int rc = rbd_is_exclusive_lock_owner(im, &owner);
  if (rc < 0) return rc == -EINVAL ? 0 : rc;  // EINVAL: the image has no exclusive-lock feature
  if (owner) return 0;
  // librbd would wait for an owner that does not answer its lock request until the OSDs drop
  // the owner's watch (osd_client_watch_timeout, 30 s): a failover or a restarted server would
  // pause that long. Breaking the lock blocklists the owner (rbd_blocklist_on_break_lock), so
  // a previous server that is only cut off cannot write behind our back.
  char* owners[8] = {};
  size_t n = 8;
  rbd_lock_mode_t mode = RBD_LOCK_MODE_EXCLUSIVE;
  rc = rbd_lock_get_owners(im, &mode, owners, &n);
  if (rc == -ENOENT) return 0;  // nobody holds it: our first write takes it
  if (rc < 0) return rc;
  int result = 0;
  for (size_t i = 0; i < n; ++i) {
    const int b = rbd_lock_break(im, mode, owners[i]);
    if (b < 0 && b != -ENOENT && result == 0) result = b;  // ENOENT: it went away meanwhile
    if (b == 0) {
      if (!fenced->empty()) *fenced += ", ";
      *fenced += owners[i];
    }
  }
  rbd_lock_get_owners_cleanup(owners, n);
  return result;
}

}  // namespace backend

#else  // no librbd in this build

bool rbd_supported() { return false; }

struct RbdCluster::Impl {
  std::string fsid;
};
struct backend::RbdImage::Handles {};
backend::RbdImage::RbdImage() = default;
backend::RbdImage::~RbdImage() = default;
RbdCluster::RbdCluster(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RbdCluster::~RbdCluster() = default;
const std::string& RbdCluster::fsid() const { return impl_->fsid; }

Result<std::unique_ptr<RbdCluster>> RbdCluster::connect(const RbdConfig&, std::string* why) {
  if (why) *why = "this ibnbd-server was built without librbd (librbd-dev)";
  return errc(EOPNOTSUPP);
}
Result<std::unique_ptr<Backend>> RbdCluster::open(const RbdName&, std::string_view, const OpenOptions&,
                                                  std::string* why) {
  if (why) *why = "this ibnbd-server was built without librbd (librbd-dev)";
  return errc(EOPNOTSUPP);
}

namespace backend {
// Without librbd only the backend's tests make images: their fakes.
int rbd_start(RbdImage& img, RbdStage st, uint64_t off, uint64_t len, const iovec* iov, int niov, bool nounmap,
              RbdAio* aio) {
  return img.fake ? img.fake->start(st, off, len, iov, niov, nounmap, aio) : -EOPNOTSUPP;
}
bool rbd_cache_volatile(RbdImage&) { return true; }
int rbd_size(RbdImage& img, uint64_t* bytes) { return img.fake ? img.fake->size(bytes) : -EOPNOTSUPP; }
int rbd_extents(RbdImage&, uint64_t, uint64_t, std::span<Extent>, uint32_t* n) {
  *n = 0;
  return -EOPNOTSUPP;
}
int rbd_sync(RbdImage& img) { return img.fake ? img.fake->sync() : -EOPNOTSUPP; }
int rbd_watch(RbdImage&) { return -EOPNOTSUPP; }
int rbd_take_over(RbdImage& img, std::string*) { return img.fake ? 0 : -EOPNOTSUPP; }
}  // namespace backend

#endif

}  // namespace ibnbd
