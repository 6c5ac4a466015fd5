// QEMU's RDMA migration protocol (`migrate rdma:` / `-incoming rdma:`, migration/rdma.c of QEMU
// 7.2) spoken by the agent over librdmacm + libibverbs directly: the project's rdma fabric puts
// its own framing into the rdma_cm private data, which QEMU would not understand. The wire format
// is qemu_rdma_wire.h; the stream rewriting is qemu_ram_stream.h; docs/migration-image.md
// ("QEMU's RDMA migration protocol (as implemented)") describes the exchange.
//
//   SaveEndpoint     the destination role: listens, accepts QEMU's source with the capabilities
//                    answer and answers READY / RAM BLOCKS / REGISTER / COMPRESS / REGISTER
//                    FINISHED / QEMU FILE as rdma.c's destination does. The stream goes through an
//                    InlineRewriter whose PageSource is a RamMirror (qemu_rdma_ram.h): the output
//                    is an ordinary stream with the pages inline.
//   RestoreEndpoint  the source role: connects to QEMU's destination and plays an ordinary stream
//                    through an RdmaSplitter: QEMU FILE messages, pages by RDMA WRITE into the
//                    chunks the destination registers (or the blocks it pinned), zero runs of
//                    unregistered chunks as COMPRESS.
//   Link             one RC connection with the control buffers and a completion loop; public so
//                    that tests can play a hostile peer.
//
// Every control message goes through decode_control before anything uses it. A protocol error or
// a local failure sends ERROR (unless the peer sent one) and closes: QEMU's migration fails at
// once instead of waiting. Every wait has a deadline (EndpointOptions::timeout): a peer that stops
// answering is ETIMEDOUT, a peer that goes away is EPIPE. Nothing here is thread-safe except
// stats(): each endpoint is driven by one thread.
#pragma once

#include <atomic>
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
#include "qemu_ram_stream.h"
#include "qemu_rdma_wire.h"

struct ibv_pd;

namespace ibnbd::migrate::qrdma {

using Clock = std::chrono::steady_clock;

// "HOST:PORT" or "[IPV6]:PORT", as QEMU's rdma: URIs spell it. HOST may be a name.
struct RdmaAddress {
  std::string host;
  std::string port;
  std::string text() const;
};
Result<RdmaAddress> parse_rdma_address(std::string_view s, std::string* why = nullptr);

// The save side's default cap on registered guest RAM: RLIMIT_MEMLOCK's soft limit when finite
// (registration beyond it fails anyway), else half the physical memory.
uint64_t default_pin_limit();

struct EndpointOptions {
  std::chrono::milliseconds timeout{120000};  // longest wait for the peer: a connection, a message,
                                              // a completion (RDMA WRITEs into the save side come
                                              // without messages: a round of pin-all writes must fit)
  uint64_t pin_limit = 0;                     // save: registered guest RAM at most (0: default_pin_limit())
  bool allow_pin_all = true;                  // save: grant pin-all when the source asks (QEMU does)
  bool pin_all = false;                       // restore: ask for pin-all (QEMU's rdma-pin-all)
  uint32_t write_slots = 8;                   // restore: 1 MiB staging buffers, RDMA WRITEs in flight
};

// Counters another thread may read (progress lines).
struct EndpointStats {
  std::atomic<uint64_t> file_bytes{0};  // stream bytes carried in QEMU FILE messages
  std::atomic<uint64_t> ram_bytes{0};   // save: bytes of pages reported; restore: written by RDMA + COMPRESS
  std::atomic<uint64_t> messages{0};    // control messages received
  std::atomic<uint64_t> rounds{0};      // REGISTER FINISHED rounds
};

class SaveEndpoint {
 public:
  // Binds and listens (port "0": any free port, see port()). The agent prints the address, then
  // QEMU is told `migrate rdma:HOST:PORT`.
  static Result<std::unique_ptr<SaveEndpoint>> listen(const RdmaAddress& at, const EndpointOptions& o,
                                                      std::string* why = nullptr);
  ~SaveEndpoint();
  SaveEndpoint(const SaveEndpoint&) = delete;
  SaveEndpoint& operator=(const SaveEndpoint&) = delete;

  uint16_t port() const;
  // Accepts one source (refusing a bad capabilities version with a reject), takes its stream and
  // writes it to `out` rewritten as an ordinary stream. OK when the source closed after the end of
  // its RAM section without an ERROR; the error otherwise (last_error() says what), the source
  // having been sent ERROR when the failure was not its own.
  Status run(qstream::ByteSink& out);
  const std::string& last_error() const;
  const EndpointStats& stats() const;
  bool pinned_all() const;  // the source asked for pin-all and got it
  uint64_t pinned_bytes() const;

  struct Impl;

 private:
  explicit SaveEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class RestoreEndpoint {
 public:
  // Connects (QEMU may still be starting: a refused connection is retried until o.timeout).
  static Result<std::unique_ptr<RestoreEndpoint>> connect(const RdmaAddress& to, const EndpointOptions& o,
                                                          std::string* why = nullptr);
  ~RestoreEndpoint();  // closes (after abort() or finish(), or sends ERROR first when neither ran)
  RestoreEndpoint(const RestoreEndpoint&) = delete;
  RestoreEndpoint& operator=(const RestoreEndpoint&) = delete;

  // The stream's bytes in pieces of any size.
  Status feed(std::span<const std::byte> b);
  // End of the stream: the rest goes out; then waits until QEMU closes the connection (it has
  // loaded everything). EPROTO when QEMU asks for more instead.
  Status finish();
  // Gives up: ERROR to QEMU (its incoming migration fails at once), then close.
  void abort();
  const std::string& last_error() const;
  const EndpointStats& stats() const;
  bool pin_all() const;  // asked and granted

  struct Impl;

 private:
  explicit RestoreEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One RC connection as QEMU's control channel uses it: two receive slots (READY and DATA in
// rdma.c's naming), one send buffer (512 KiB each, registered), RDMA WRITE, and a completion loop
// whose waits end at a deadline.
class Link {
 public:
  enum Slot : int { kReady = 0, kData = 1 };
  struct Mr {
    virtual ~Mr() = default;
    virtual uint32_t lkey() const = 0;
    virtual uint32_t rkey() const = 0;
  };

  // Source role: resolves, connects with `private_data`, waits for ESTABLISHED. The kReady slot
  // is posted before the connect (the destination may send at once). ECONNREFUSED when the peer
  // rejected (its private data, if any, in *answer), EHOSTUNREACH, ETIMEDOUT.
  static Result<std::unique_ptr<Link>> connect(const RdmaAddress& to, std::span<const std::byte> private_data,
                                               uint32_t write_slots, Clock::time_point deadline,
                                               std::vector<std::byte>* answer, std::string* why);
  ~Link();
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  // Posts the receive of `s` (its previous message's bytes are then gone).
  Status post_recv(Slot s);
  // The bytes of the message received into `s`, valid until `s` is posted again.
  Result<std::span<const std::byte>> wait_recv(Slot s, Clock::time_point deadline);
  bool recv_done(Slot s);
  // Where to encode the next message; send(n) SENDs its first n bytes and waits for the
  // completion.
  std::span<std::byte> send_buffer();
  Status send(size_t n, Clock::time_point deadline);
  // Memory for RDMA (access: ibv_access_flags). EINVAL/ENOMEM with the memlock limit in *why.
  Result<std::unique_ptr<Mr>> reg(void* addr, size_t len, int access, std::string* why);
  ibv_pd* pd() const;
  // An RDMA WRITE of `local` (inside memory registered with `lkey`) to `remote` / `rkey`,
  // signalled; `tag` comes back from wait_write. EAGAIN when the send queue is full.
  Status post_write(std::span<const std::byte> local, uint32_t lkey, uint64_t remote, uint32_t rkey, uint64_t tag);
  uint32_t writes_in_flight() const { return writes_in_flight_; }
  Result<uint64_t> wait_write(Clock::time_point deadline);
  // Waits until the peer disconnects (or `s` receives a message: false then).
  Result<bool> wait_disconnect_or_recv(Slot s, Clock::time_point deadline);
  bool disconnected() const { return disconnected_; }
  bool timed_out() const { return timed_out_; }  // a wait ended at its deadline
  // How long a last ERROR may take to be acknowledged: 2 s, 0.5 s once a wait has timed out.
  Clock::time_point error_deadline() const;
  void disconnect();
  // What the last failed completion or event was.
  const std::string& last_error() const { return err_; }

  struct Res;

 private:
  Link();
  friend struct SaveEndpoint::Impl;
  Status wait(Clock::time_point deadline, const std::function<bool()>& done);
  Status poll_cq();
  Status poll_cm();
  // Why the QP failed, from the device's asynchronous events (e.g. an RDMA WRITE of the peer
  // outside the memory its key covers: IBV_EVENT_QP_ACCESS_ERR). "" when none came.
  std::string qp_event();
  Status broken();
  Status setup(uint32_t write_slots, std::string* why);

  std::unique_ptr<Res> res_;
  struct RecvSlot {
    bool posted = false;
    bool done = false;
    uint32_t len = 0;
  } recv_[2];
  bool send_busy_ = false;
  bool send_ok_ = true;  // the last SEND's completion
  uint32_t writes_in_flight_ = 0;
  std::vector<uint64_t> writes_done_;
  std::error_code failed_;  // first failed completion (other than a flush)
  bool flushed_ = false;    // a flushed work request: the QP is in error
  bool disconnected_ = false;
  bool connected_ = false;        // ESTABLISHED was seen: a disconnect is due at the end
  bool disconnect_sent_ = false;
  bool timed_out_ = false;
  std::string err_;
};

}  // namespace ibnbd::migrate::qrdma
