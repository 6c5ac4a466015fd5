#include <cerrno>

#include "ibnbd/migrate_volume.h"

namespace ibnbd::migrate {
namespace {

class RegisteredBuffer final : public IoBuffer {
 public:
  explicit RegisteredBuffer(std::unique_ptr<ibtrs::RegisteredMemory> m) : mem_(std::move(m)) {}
  std::byte* data() const override { return mem_->data(); }
  size_t size() const override { return mem_->size(); }
  const ibtrs::RegisteredMemory* mem() const { return mem_.get(); }

 private:
  std::unique_ptr<ibtrs::RegisteredMemory> mem_;
};

class DeviceVolume final : public Volume {
 public:
  DeviceVolume(BlockSession& s, std::shared_ptr<RemoteDevice> d) : s_(s), d_(std::move(d)) {}
  uint64_t size() const override { return d_->size_bytes(); }
  uint32_t block_size() const override { return d_->geometry().logical_block_size; }
  Result<std::unique_ptr<IoBuffer>> alloc(size_t bytes) override {
    auto m = s_.alloc_buffer(bytes);
    if (!m) return m.error();
    return std::unique_ptr<IoBuffer>(new RegisteredBuffer(std::move(*m)));
  }
  // A 1 MiB chunk is split into parts of the server's chunk size (8 of 128 KiB by default),
  // each its own request: in a submission batch they leave in one sendmsg per connection on
  // tcp instead of one each (the READ requests of a restore are small: 8 system calls -> 1).
  // Neither call blocks (no permit: the part waits in the session queue), as a batch requires.
  Status write(const IoBuffer& buf, size_t buf_off, uint64_t off, size_t len, bool fua,
               VolumeDone done) override {
    auto seg = segment(buf, buf_off, len);
    if (!seg) return seg.error();
    d_->begin_batch();
    auto r = d_->write(off, std::span(&*seg, 1), fua ? uint32_t{kIoFua} : 0u, IoDone{done.fn, done.ctx});
    d_->end_batch();
    return r;
  }
  Status read(const IoBuffer& buf, size_t buf_off, uint64_t off, size_t len, VolumeDone done) override {
    auto seg = segment(buf, buf_off, len);
    if (!seg) return seg.error();
    d_->begin_batch();
    auto r = d_->read(off, std::span(&*seg, 1), IoDone{done.fn, done.ctx});
    d_->end_batch();
    return r;
  }
  Status flush(VolumeDone done) override { return d_->flush(IoDone{done.fn, done.ctx}); }

 private:
  static Result<ibtrs::IoSeg> segment(const IoBuffer& buf, size_t buf_off, size_t len) {
    // Only buffers from alloc() are registered; the library splits requests above one part.
    const auto* rb = dynamic_cast<const RegisteredBuffer*>(&buf);
    if (rb == nullptr || buf_off > buf.size() || len > buf.size() - buf_off || len > UINT32_MAX)
      return ibtrs::errc(EINVAL);
    return ibtrs::IoSeg{buf.data() + buf_off, static_cast<uint32_t>(len), rb->mem()};
  }

  BlockSession& s_;
  std::shared_ptr<RemoteDevice> d_;
};

}  // namespace

Result<std::unique_ptr<Volume>> device_volume(BlockSession& session, std::shared_ptr<RemoteDevice> dev) {
  if (!dev) return ibtrs::errc(EINVAL);
  return std::unique_ptr<Volume>(new DeviceVolume(session, std::move(dev)));
}

}  // namespace ibnbd::migrate
