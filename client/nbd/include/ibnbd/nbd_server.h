// libibnbd-nbd: an NBD server (NetworkBlockDevice/nbd doc/proto.md) over an abstract export, so
// that any NBD client -- nbdinfo, nbdcopy, nbdfuse, qemu, fio's nbd engine, the kernel's nbd
// client -- can use a volume mapped by the IBNBD client library. The client daemon exports a
// RemoteDevice through DeviceExport (ibnbd/nbd_device_export.h); unit tests use a RAM export.
//
// Protocol subset (client/README.md, "NBD export", says the same for humans)
//   Handshake: fixed newstyle only (oldstyle is gone since nbd 3.10), NO_ZEROES; options GO,
//   INFO (NBD_INFO_EXPORT always, NBD_INFO_BLOCK_SIZE always, NBD_INFO_NAME on request),
//   EXPORT_NAME, LIST, ABORT, STRUCTURED_REPLY, LIST_META_CONTEXT / SET_META_CONTEXT
//   (base:allocation), STARTTLS when the server has TLS credentials (NbdServerOptions::tls; TLS
//   1.3 with a PSK or certificates, ibtrs/tls.h; "FORCEDTLS" when tls_required: every option
//   but STARTTLS and ABORT gets NBD_REP_ERR_TLS_REQD until the upgrade, as nbdkit --tls=require
//   does); every other option gets NBD_REP_ERR_UNSUP (STARTTLS too without credentials: NOTLS).
//   Transmission: READ, WRITE, DISC, FLUSH, TRIM, CACHE, WRITE_ZEROES, BLOCK_STATUS; flags FUA,
//   NO_HOLE, DF, REQ_ONE, FAST_ZERO. BLOCK_STATUS answers from Export::block_status: one
//   BLOCK_STATUS chunk of at most kMaxExtents descriptors (one with REQ_ONE) over a prefix of
//   the range, never past its end. Many requests are in flight per connection and replies go
//   out in completion order. Structured replies when negotiated, simple replies otherwise.
//
// Data path
//   An export that lends request memory (Export::request_memory: the device export's memory
//   registered with its session) gets READ and WRITE data in it: WRITE payloads are received
//   into it and READ replies sent from it, so the bytes are not copied on their way between the
//   socket and the transport. The server carves each request's buffer out of it (4 KiB pages);
//   when it is full, the next READ or WRITE waits, its header and what follows left in the
//   socket, until a reply frees room. A connection that holds some of it and makes no progress
//   (a WRITE payload that stops coming, replies the client does not read) while others wait
//   for room is dropped after NbdServerOptions::stall_timeout, so no client pins it for good.
//   Other exports get buffers of the server's own.
//
// Threading
//   - One event-loop thread per NbdServer does all socket IO and protocol work.
//   - Export functions are called on that thread. Their completions may run on any thread,
//     even inside the submitting call. Those that run on the loop thread (inline, or inside
//     Export::poll_loop) are taken as they are; those of other threads are handed back to the
//     loop (a locked list and an eventfd), so an Export needs no knowledge of the loop.
//   - An export may let the loop run its completions itself (Export::attach_loop / poll_loop:
//     the device export reaps its transport connections there): one thread wake-up per IO.
//   - start, serve_fd, listening, stats and stop: any thread but an Export completion.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ibnbd/types.h"
#include "ibtrs/result.h"
#include "ibtrs/tls.h"

namespace ibnbd::nbd {

using ibtrs::Result;
using ibtrs::Status;

// Completion of an export request: err is 0 or a positive errno.
using DoneFn = void (*)(void* ctx, int err);
struct Done {
  DoneFn fn = nullptr;
  void* ctx = nullptr;
};

// What a client is told about an export (NBD_INFO_EXPORT, NBD_INFO_BLOCK_SIZE), read once per
// connection when it chooses the export.
struct ExportInfo {
  uint64_t size = 0;              // bytes, a multiple of min_block
  uint32_t min_block = 512;       // power of two, 1..64 KiB: requests must be aligned to it
  uint32_t preferred_block = 4096;// power of two >= min_block
  uint32_t max_payload = 32u << 20;  // largest READ / WRITE, a multiple of min_block
  bool read_only = false;
  bool can_trim = false;          // trim() does something
  bool can_write_zeroes = false;  // write_zeroes() is supported
  // write_zeroes() is faster than writing zeroes (NBD_CMD_FLAG_FAST_ZERO is served; without it
  // such requests fail at once with ENOTSUP, as the spec asks, and the client falls back).
  bool fast_zero = false;
  // Only when FLUSH on one connection makes the writes of every connection stable: the spec
  // ("NBD_FLAG_CAN_MULTI_CONN") asks that flush and FUA effects be visible across connections.
  bool multi_conn = false;
  std::string description;        // NBD_INFO_DESCRIPTION when non-empty
};

// The device behind an export. Submit functions return an errno without running `done`, or
// 0 and `done` runs exactly once later (on any thread, possibly inside the call). Offsets and
// lengths are already checked against ExportInfo (aligned, inside the device, length > 0) and
// buffers stay valid until `done`. Called on the server's loop thread only.
class Export {
 public:
  virtual ~Export() = default;
  virtual ExportInfo info() const = 0;
  virtual Status read(uint64_t offset, std::span<std::byte> out, Done done) = 0;
  // fua: the data is stable when `done` runs (NBD_CMD_FLAG_FUA).
  virtual Status write(uint64_t offset, std::span<const std::byte> data, bool fua, Done done) = 0;
  // Makes every write completed before it stable.
  virtual Status flush(Done done) = 0;
  virtual Status trim(uint64_t offset, uint64_t len, Done done) = 0;
  // no_hole: the range must stay allocated (NBD_CMD_FLAG_NO_HOLE).
  virtual Status write_zeroes(uint64_t offset, uint64_t len, bool no_hole, Done done) = 0;
  // NBD_CMD_BLOCK_STATUS (base:allocation): the extents of a prefix of [offset, offset + len)
  // into `out` (ibnbd::RemoteDevice::block_status's rules; ExtentFlag bits are NBD's
  // NBD_STATE_HOLE / NBD_STATE_ZERO). The default answers "all data" at once, which the spec
  // allows of any block.
  virtual Status block_status(uint64_t /*offset*/, uint64_t len, ExtentList& out, Done done) {
    out.count = 1;
    out.e[0] = Extent{len, 0};
    done.fn(done.ctx, 0);
    return {};
  }
  // Around the requests the server submits from one parse of a connection's input: an export
  // may hold their submission back and hand them on together at end_batch() (the device
  // export: a submission batch of its session). Called on the server's loop thread, which
  // neither blocks nor waits for a completion in between.
  virtual void begin_batch() {}
  virtual void end_batch() {}

  // Request memory (optional): memory in which the export reads and writes without a copy,
  // from which the server takes the data buffers of READ and WRITE (see "Data path" above),
  // or empty: the server uses its own. Asked once, when the server starts; it must stay valid
  // and the same until the server has stopped, hold at least info().max_payload bytes (or
  // larger requests use the server's memory), and serve one NbdServer at a time.
  virtual std::span<std::byte> request_memory() { return {}; }

  // Completion polling (optional). attach_loop(): on the loop thread when it starts; a file
  // descriptor the loop waits on with its sockets, readable when poll_loop() has completions
  // to run, or -1 (the default: completions come back through the hand-off). poll_loop(): on
  // the loop thread when that fd is readable, and after a completion of this export arrived
  // from another thread (a sign that the export's polling lost hold of something, which the
  // call may take back); runs what completed, their `done` callbacks inside. Never inside a
  // begin_batch() / end_batch() pair. detach_loop(): on the loop thread as it ends, once every
  // request of the export has completed.
  virtual int attach_loop() { return -1; }
  virtual void poll_loop() {}
  virtual void detach_loop() {}
};

// Where a server listens: a unix stream socket path, or a numeric TCP address.
struct ListenSpec {
  enum class Kind : uint8_t { unix_socket, tcp };
  Kind kind = Kind::tcp;
  std::string path;  // unix_socket
  // unix_socket: who may connect (NBD has no authentication of its own): the socket file's mode,
  // owner-only by default, and its group (unset: the process's).
  mode_t mode = 0600;
  std::optional<gid_t> group;
  std::string host;  // tcp: numeric IPv4 or IPv6 (no brackets)
  uint16_t port = 0; // tcp: 0 picks a free port (listening() tells which)

  static ListenSpec unix_socket(std::string path, mode_t mode = 0600, std::optional<gid_t> group = {});
  // "HOST:PORT", "[V6]:PORT", ":PORT" or "PORT" (host 127.0.0.1), "localhost:PORT". EINVAL.
  static Result<ListenSpec> parse_tcp(std::string_view s);
  // A tcp address inside 127.0.0.0/8 or ::1; unix sockets count as local too.
  bool is_local() const;
  std::string to_string() const;  // "unix:PATH" or "tcp:HOST:PORT" ("[V6]:PORT")
};

struct NbdServerOptions {
  // Exports by name; the first also answers to the empty ("default") name, which most clients
  // send unless told otherwise (nbd-client, qemu nbd:unix:..., nbd+unix:///?socket=).
  std::vector<std::pair<std::string, std::shared_ptr<Export>>> exports;
  std::vector<ListenSpec> listen;  // may be empty: serve_fd() only
  uint32_t max_connections = 64;   // more are accepted and closed at once
  uint32_t max_requests = 128;     // per connection in flight (more wait in the socket)
  uint64_t max_inflight_bytes = 64u << 20;  // per connection, data of requests in flight
  // A connection that has not reached transmission by then is closed (a stuck or hostile
  // client must not hold a connection slot forever).
  std::chrono::milliseconds handshake_timeout{10000};
  // A connection that holds request memory of its export and has neither received nor sent a
  // byte for this long while other requests wait for that memory is closed (see "Data path").
  std::chrono::milliseconds stall_timeout{30000};
  // TLS (NBD_OPT_STARTTLS): a server-role context. With tls_required nothing but STARTTLS and
  // ABORT is served in plaintext (the spec's FORCEDTLS mode).
  std::shared_ptr<ibtrs::tls::Context> tls;
  bool tls_required = false;
  // Diagnostics (connection refused, protocol errors), on the loop thread. Optional.
  std::function<void(const std::string&)> log;
};

struct NbdServerStats {
  uint64_t accepted = 0;         // connections taken (listeners and serve_fd)
  uint64_t refused = 0;          // over max_connections
  uint32_t connections = 0;      // open now
  uint64_t requests = 0;         // transmission requests answered
  uint64_t errors = 0;           // of those, answered with an error
  uint64_t protocol_errors = 0;  // connections dropped for breaking the protocol
  uint64_t tls_upgrades = 0;     // connections that completed STARTTLS
  uint64_t tls_failures = 0;     // STARTTLS handshakes that failed (credentials, protocol)
  uint64_t read_bytes = 0;       // READ data sent
  uint64_t write_bytes = 0;      // WRITE data received and written
  uint64_t memory_waits = 0;     // READ / WRITE that waited for room in the request memory
  uint64_t stalls = 0;           // connections dropped by stall_timeout
};

class NbdServer {
 public:
  // Binds every listener (a unix path holding a stale socket is replaced; anything else there is
  // EEXIST) and starts the loop. Errors: EINVAL (no export, an export name longer than 4096
  // bytes, bad options: tls_required without tls, a client-role tls context), what
  // socket/bind/listen return.
  static Result<std::unique_ptr<NbdServer>> start(NbdServerOptions options);
  // stop().
  ~NbdServer();
  NbdServer(const NbdServer&) = delete;
  NbdServer& operator=(const NbdServer&) = delete;

  // Serves an already connected stream socket (takes ownership). ESHUTDOWN after stop().
  Status serve_fd(int fd);
  // Closes the listeners (and removes unix socket files), drops every connection, waits for
  // the export requests in flight to complete, joins the loop. Idempotent.
  void stop();

  // The listeners as bound (tcp port 0 replaced by the real port).
  const std::vector<ListenSpec>& listening() const;
  NbdServerStats stats() const;

  struct Impl;

 private:
  explicit NbdServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ibnbd::nbd
