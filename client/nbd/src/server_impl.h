// Private state of the NBD server: the loop (server.cc), the handshake (handshake.cc) and the
// transmission phase (transmission.cc) share these types. Everything here is touched by the
// loop thread only, except what says otherwise (Impl::done_mu_ and what it guards).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/unique_fd.h"
#include "ibnbd/nbd_server.h"
#include "ibnbd/nbd_proto.h"

namespace ibnbd::nbd {

using Clock = std::chrono::steady_clock;

// Spec, "Conventions": strings MUST be no longer than 4096 bytes.
inline constexpr size_t kMaxString = 4096;
// Largest option we buffer and parse. INFO/GO (4 + name + 2 + 2 * requests) and meta-context
// queries of real clients are far below it; a larger option is read past and answered
// NBD_REP_ERR_TOO_BIG, up to kMaxOptionSkip, past which the client is only wasting our time and
// is dropped (the spec lets a server disconnect a client it deems a denial of service).
inline constexpr size_t kMaxOptionLen = 64 << 10;
inline constexpr uint64_t kMaxOptionSkip = 16 << 20;
// Options a client may send before choosing an export (same reasoning).
inline constexpr uint32_t kMaxOptions = 1024;
// Input buffer of a connection: a whole option or many request headers.
inline constexpr size_t kInBufSize = 2 * kMaxOptionLen;
static_assert(kMaxOptionLen <= kInBufSize, "an option must fit the input buffer");
// A slot keeps its data buffer for the next request up to this size (no allocation on the hot
// path for the usual 4 KiB..1 MiB requests); larger buffers are given back when done.
inline constexpr size_t kKeepBuffer = 2 << 20;
// While the server stops, a connection whose replies make no progress for this long (or
// stall_timeout, if shorter) is dropped: stop() waits for the export, not for a client that
// does not read.
inline constexpr std::chrono::milliseconds kStopDrain{5000};

struct Conn;

// An export's request memory (Export::request_memory) carved into 4 KiB pages for the data of
// READ and WRITE requests: a bitmap and a next-fit cursor, so a stream of equal sizes takes
// pages in a ring without searching. Loop thread only.
class PagePool {
 public:
  static constexpr size_t kPage = 4096;
  void init(std::span<std::byte> mem);
  size_t capacity() const { return pages_ * kPage; }
  // A buffer of `len` bytes (1..capacity()), or nullptr when no run of free pages is that long.
  std::byte* get(size_t len);
  void put(std::byte* p, size_t len);
  static size_t rounded(size_t len) { return (len + kPage - 1) / kPage * kPage; }
  // Connections waiting for room, oldest first (ids; stale ones are skipped).
  std::vector<uint64_t> waiters;
  bool resume = false;  // pages came back while some waited: the loop resumes them

 private:
  bool used(size_t i) const { return (bits_[i / 64] >> (i % 64)) & 1; }
  void mark(size_t from, size_t n, bool on);
  // Length of the run of free pages at `i`, up to `want`.
  size_t free_run(size_t i, size_t want) const;
  std::byte* base_ = nullptr;
  size_t pages_ = 0;
  size_t cursor_ = 0;
  std::vector<uint64_t> bits_;
};

// One transmission request from header to reply.
struct Slot {
  Conn* conn = nullptr;
  Slot* next = nullptr;      // free list or output queue (loop thread)
  Slot* done_next = nullptr; // completion list (under Impl::done_mu_)
  uint64_t handle = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
  uint16_t type = 0;
  uint16_t flags = 0;
  int err = 0;               // written by the completion, read by the loop after the handoff
  bool flush_after = false;  // FUA on TRIM / WRITE_ZEROES: a FLUSH follows before the reply
  uint64_t data_bytes = 0;   // counted against max_inflight_bytes
  // READ data out, WRITE data in: `lent` bytes of the export's request memory, or buf.
  std::byte* data = nullptr;
  size_t lent = 0;
  std::vector<std::byte> buf;
  // BLOCK_STATUS: the export's answer (made at the slot's first one, kept with the slot), and
  // the range asked of it: the request's, widened to the export's blocks.
  std::unique_ptr<ExtentList> extents;
  uint64_t status_offset = 0;
  // The reply: header (and an error message) in hdr, then data (READ; BLOCK_STATUS's
  // descriptors, in buf) from `data`.
  unsigned char hdr[128];
  size_t hdr_len = 0;
  size_t data_len = 0;
  size_t sent = 0;  // of hdr_len + data_len
};

struct Conn {
  NbdServer::Impl* srv = nullptr;
  uint64_t id = 0;
  base::UniqueFd fd;
  bool registered = false;  // in the epoll set
  bool resumed = false;     // a slot was freed while paused: parse again
  enum class Phase : uint8_t { client_flags, option, option_skip, transmission } phase =
      Phase::client_flags;
  // Input: bytes [in_beg, in_end) of in are received and not yet parsed.
  std::vector<std::byte> in;
  size_t in_beg = 0, in_end = 0;
  // Handshake.
  bool fixed_newstyle = false;
  bool no_zeroes = false;
  bool structured = false;
  bool meta_base_allocation = false;  // base:allocation selected by SET_META_CONTEXT
  std::string meta_export;            // for the export named in SET_META_CONTEXT
  uint32_t options = 0;
  uint32_t skip_option = 0;   // option being read past (too big)
  uint64_t skip_left = 0;
  Clock::time_point deadline{};
  std::string hs_out;  // handshake replies not yet sent
  size_t hs_sent = 0;
  // Transmission.
  Export* exp = nullptr;
  ExportInfo info;
  uint16_t tx_flags = 0;
  std::vector<std::unique_ptr<Slot>> slots;
  Slot* free_slots = nullptr;
  Slot* out_head = nullptr;
  Slot* out_tail = nullptr;
  uint32_t inflight = 0;        // slots taken
  uint64_t inflight_bytes = 0;
  Slot* rx_slot = nullptr;      // WRITE whose payload is being received
  size_t rx_got = 0;
  bool paused = false;          // no slot, byte budget or request memory for the next request
  PagePool* pool = nullptr;     // the export's request memory, if it lends some
  uint64_t lent_bytes = 0;      // of it, held by this connection's slots
  bool mem_wait = false;        // in pool->waiters
  bool resuming = false;        // being resumed from pool->waiters: may go ahead of them
  Clock::time_point last_io{};  // a byte received or sent (stall_timeout)
  // Teardown: no more input is parsed; the socket write side is dead (replies are dropped);
  // the connection is freed once both hold (or rx is closed and every reply went out) and no
  // slot is taken.
  bool rx_closed = false;
  bool tx_dead = false;
  uint32_t events = 0;  // epoll mask now armed
  std::string peer;     // for logs
  // STARTTLS: `starttls` from the option until the ACK has left in plaintext, then the
  // handshake (tls set, not established), then every byte through tls.
  bool starttls = false;
  std::unique_ptr<ibtrs::tls::Session> tls;
  bool tls_on() const { return tls != nullptr && tls->established(); }
  ssize_t recv_into(void* dst, size_t len);
  ssize_t send_iov(const iovec* iov, int n);
};

struct NbdServer::Impl {
  NbdServerOptions opts;
  std::vector<ListenSpec> bound;
  std::vector<base::UniqueFd> listen_fds;  // closed (-1) once the server stops listening
  base::UniqueFd epfd;
  base::UniqueFd evfd;
  std::thread thread;
  std::atomic<bool> stopping{false};
  std::mutex stop_mu;  // serializes stop()
  bool stopped = false;
  uint64_t next_id = 1;
  std::map<uint64_t, std::unique_ptr<Conn>> conns;
  std::vector<uint64_t> touched;  // connections with completions in this batch
  // TLS connections with decrypted input waiting in userspace: their sockets may not wake the
  // loop, so it reads them again without waiting.
  std::vector<uint64_t> rx_ready;

  // Request memory, one pool per export that lends some.
  std::map<Export*, PagePool> pools;
  // Exports whose completions the loop polls (Export::attach_loop), by epoll tag.
  std::vector<Export*> polled;
  // Completions that ran on the loop thread (inline, or inside Export::poll_loop): taken as
  // they are, after the call that ran them.
  Slot* local_head = nullptr;
  Slot* local_tail = nullptr;
  bool remote_seen = false;  // the last drain found completions of another thread

  // Handoff from other threads: completed slots and sockets to adopt.
  std::mutex done_mu;
  Slot* done_head = nullptr;
  Slot* done_tail = nullptr;
  std::vector<base::UniqueFd> adopt;
  bool signalled = false;  // the eventfd holds a wakeup not yet consumed

  struct Counters {
    std::atomic<uint64_t> accepted{0}, refused{0}, requests{0}, errors{0}, protocol_errors{0},
        read_bytes{0}, write_bytes{0}, tls_upgrades{0}, tls_failures{0}, memory_waits{0}, stalls{0};
    std::atomic<uint32_t> connections{0};
  } stats;

  ~Impl();
  // server.cc
  void run();
  void wake();
  void add_conn(base::UniqueFd fd, std::string peer);
  void on_event(Conn& c, uint32_t ev);
  void on_readable(Conn& c);
  void pump(Conn& c);
  void parse(Conn& c);
  void flush_out(Conn& c);
  void update(Conn& c);  // re-arm epoll; free the connection when its teardown is complete
  void fail(Conn& c, const std::string& why, bool protocol_error);  // hard disconnect
  void drain_completions();
  void run_completions(Slot* list);  // completes a list of done slots, then pumps their connections
  void poll_exports();
  void resume_waiters();
  void check_stalls(Clock::time_point now);
  void tx_gone(Conn& c);  // the socket's write side is dead: queued replies are dropped
  void start_tls(Conn& c);
  void tls_handshake(Conn& c);
  void log(const std::string& m) const;
  static void on_done(void* ctx, int err);
  // handshake.cc
  void greet(Conn& c);
  bool parse_handshake(Conn& c);  // false: needs more input (or the connection is closing)
  void handle_option(Conn& c, uint32_t opt, const std::byte* data, uint32_t len);
  void option_reply(Conn& c, uint32_t opt, uint32_t type, const void* data = nullptr,
                    size_t len = 0);
  void option_error(Conn& c, uint32_t opt, uint32_t type, std::string_view msg);
  void handle_info(Conn& c, uint32_t opt, const std::byte* data, uint32_t len);
  void handle_meta(Conn& c, uint32_t opt, const std::byte* data, uint32_t len);
  std::pair<const std::string*, Export*> find_export(std::string_view name) const;
  void enter_transmission(Conn& c, Export* e);
  static uint16_t transmission_flags(const ExportInfo& i, bool structured);
  // transmission.cc
  bool parse_request(Conn& c);  // false: needs more input or a free slot
  void receive_payload(Conn& c);
  void start_request(Conn& c, Slot& s);
  void submit(Conn& c, Slot& s);
  void complete(Conn& c, Slot& s);
  void reply(Conn& c, Slot& s, int err);
  void block_status_reply(Conn& c, Slot& s);
  Slot& take_slot(Conn& c, uint64_t data_bytes);
  void release(Conn& c, Slot& s);
};

// errno -> one of the values the spec allows on the wire ("Error values").
uint32_t to_nbd_error(int err);

}  // namespace ibnbd::nbd
