// Migration images on a volume (docs/migration-image.md): QEMU migration streams (a main stream
// and one sub-stream per multifd channel) saved onto a remote volume and read back, with a
// directory of several images per volume, CRC32C per chunk, all-zero chunks elided and an
// explicit commit. The agent (`ibnbd migrate ...`) moves bytes between QEMU and these classes.
//
// Threading
//   - ImageStore: one thread at a time (the agent's control thread).
//   - ImageWriter: buffer() / produced() for a stream from one thread at a time (each stream
//     may have its own thread); commit() and abort() after every stream's producer stopped.
//   - StreamReader: one thread per reader; several readers of one image run in parallel.
//   - Volume completions arrive on any thread (the transport's); the classes hand them over.
// Errors: std::error_code values of errno (EINVAL bad argument, ENOENT no such image, EEXIST,
// ENOSPC no room on the volume, EBADMSG not an image / not formatted, EILSEQ corrupt: a CRC or
// a field that does not add up — the message of last_error() says which, EBUSY image PARTIAL
// where COMMITTED is needed, and the volume's own errors: EIO, ENOTCONN, ...).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ibtrs/result.h"

namespace ibnbd::migrate {

using ibtrs::Result;
using ibtrs::Status;

inline constexpr uint32_t kMaxStreams = 16;     // 1 main + up to 15 multifd channels
inline constexpr uint32_t kDefaultChunk = 1u << 20;

// Memory a Volume can read into and write from (registered with the transport for a remote
// volume, so chunks move without a copy).
class IoBuffer {
 public:
  virtual ~IoBuffer() = default;
  virtual std::byte* data() const = 0;
  virtual size_t size() const = 0;
};

// Completion of a volume request: err is 0 or a positive errno. Runs on any thread; must not
// block.
using VolumeDoneFn = void (*)(void* ctx, int err);
struct VolumeDone {
  VolumeDoneFn fn = nullptr;
  void* ctx = nullptr;
};

// Where images live. Offsets and lengths are multiples of block_size(). A submit that returns
// an error never runs `done`; one that returns 0 runs it exactly once.
class Volume {
 public:
  virtual ~Volume() = default;
  virtual uint64_t size() const = 0;
  virtual uint32_t block_size() const = 0;
  virtual Result<std::unique_ptr<IoBuffer>> alloc(size_t bytes) = 0;
  virtual Status write(const IoBuffer& buf, size_t buf_off, uint64_t off, size_t len, bool fua,
                       VolumeDone done) = 0;
  virtual Status read(const IoBuffer& buf, size_t buf_off, uint64_t off, size_t len,
                      VolumeDone done) = 0;
  virtual Status flush(VolumeDone done) = 0;
};

enum class ImageState : uint32_t { partial = 1, committed = 2 };
std::string_view to_string(ImageState s);

struct StreamInfo {
  uint64_t length = 0;   // bytes
  uint64_t chunks = 0;   // pieces (stored + zero)
};

struct ImageInfo {
  std::string name;
  ImageState state = ImageState::partial;
  uint64_t extent_start = 0;
  uint64_t extent_length = 0;
  uint32_t chunk_size = 0;
  uint64_t stored_chunks = 0;
  uint64_t zero_chunks = 0;
  std::chrono::system_clock::time_point created;
  std::chrono::system_clock::time_point committed;  // epoch while PARTIAL
  std::array<uint8_t, 16> vm_uuid{};
  std::string machine_type;
  std::vector<StreamInfo> streams;   // empty when the header could not be read
  std::string problem;               // why the header is unreadable / refused ("" if fine)
  uint64_t total_bytes() const;
};

struct Progress {
  uint64_t bytes = 0;        // stream bytes handled so far (all streams)
  uint64_t total = 0;        // known total (restore, verify), 0 when unknown (save)
  std::chrono::steady_clock::duration elapsed{};
};

struct CreateOptions {
  std::string name;                 // 1..63 bytes, no '/' or control characters
  uint32_t streams = 1;             // 1 + multifd channels
  uint32_t chunk_size = kDefaultChunk;
  uint64_t max_bytes = 0;           // cap on the extent (0: the largest free extent)
  uint32_t ring_chunks = 32;        // chunk buffers: writes in flight + being filled (>= streams + 1)
};

struct ReadOptions {
  uint32_t read_ahead = 16;         // chunks in flight per stream reader
};

class ImageWriter;
class ImageReader;

class ImageStore {
 public:
  // Reads the directory. A volume without one (both copies lack the magic) opens as empty and
  // is formatted by the first create(); a directory with a bad CRC in both copies is EILSEQ.
  static Result<std::unique_ptr<ImageStore>> open(Volume& volume);
  ~ImageStore();
  ImageStore(const ImageStore&) = delete;
  ImageStore& operator=(const ImageStore&) = delete;

  // Every image with its header's view (problem says why a header is unreadable).
  Result<std::vector<ImageInfo>> list();
  // Frees an image's extent (PARTIAL or COMMITTED). ENOENT.
  Status remove(std::string_view name);
  // Starts a save: reserves an extent, writes the directory and a PARTIAL header. EEXIST (an
  // image has the name: delete it first), ENOSPC, EINVAL. The store must outlive the writer.
  Result<std::unique_ptr<ImageWriter>> create(const CreateOptions& o);
  // A COMMITTED image for reading (EBUSY if PARTIAL; EILSEQ if its header or index is bad).
  // The store and its volume must outlive the reader.
  Result<std::unique_ptr<ImageReader>> open_image(std::string_view name);
  // The last error's details (which copy, which chunk, which field).
  const std::string& last_error() const;

  struct Impl;

 private:
  explicit ImageStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class ImageWriter {
 public:
  // Without commit(): waits for the writes in flight; the image stays PARTIAL.
  ~ImageWriter();
  ImageWriter(const ImageWriter&) = delete;
  ImageWriter& operator=(const ImageWriter&) = delete;

  // Space to read `stream`'s next bytes into (never empty); blocks while every chunk buffer is
  // in flight (back-pressure). ENOSPC when the extent is full; the first write error.
  Result<std::span<std::byte>> buffer(uint32_t stream);
  // `n` bytes were put at the start of the last buffer() span of `stream`. A full chunk goes
  // out (as a write, or as nothing when it is all zeroes).
  Status produced(uint32_t stream, size_t n);
  // Every stream ended: last pieces, index, flush, header COMMITTED, directory. Once.
  Status commit();
  Progress progress() const;
  const std::string& last_error() const;

  struct Impl;

 private:
  friend class ImageStore;
  explicit ImageWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Reads one stream of an image in order, `read_ahead` chunks in flight, each chunk's CRC
// checked before it is returned.
class StreamReader {
 public:
  ~StreamReader();  // waits for its reads in flight
  StreamReader(const StreamReader&) = delete;
  StreamReader& operator=(const StreamReader&) = delete;
  // The next piece (valid until the next call); empty at the end of the stream. EILSEQ when a
  // CRC does not match (last_error() names the stream, piece and volume offset).
  Result<std::span<const std::byte>> next();
  const std::string& last_error() const;

  struct Impl;

 private:
  friend class ImageReader;
  explicit StreamReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class ImageReader {
 public:
  ~ImageReader();
  ImageReader(const ImageReader&) = delete;
  ImageReader& operator=(const ImageReader&) = delete;
  const ImageInfo& info() const;
  // A reader of one stream (EINVAL: no such stream).
  Result<std::unique_ptr<StreamReader>> stream(uint32_t index, ReadOptions o = {});
  // Reads every stream and checks every CRC without handing data to anyone; progress is
  // called after each chunk (from this thread).
  Status verify(const std::function<void(const Progress&)>& progress = {});
  const std::string& last_error() const;

  struct Impl;

 private:
  friend class ImageStore;
  explicit ImageReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The machine type and VM uuid from the start of a QEMU migration stream (the "QEVM" magic,
// version 3, the configuration section and its uuid subsection). Missing pieces stay empty.
struct StreamIdentity {
  std::string machine_type;
  std::array<uint8_t, 16> vm_uuid{};
  bool is_qemu_stream = false;  // the magic and version were there
};
StreamIdentity parse_stream_identity(std::span<const std::byte> head);

}  // namespace ibnbd::migrate
