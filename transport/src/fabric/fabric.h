// The fabric layer: what the IBTRS session layer needs from an RDMA-capable transport, with
// providers picked at run time (rdma = rdma-core verbs, tcp = software RDMA over TCP,
// loopback = in-process with fault injection). Private to libibtrs.
//
// The model is the verbs model, reduced to what IBTRS uses:
//   Fabric      a provider instance (rdma_cm event channel + devices; tcp engine; loopback world)
//   Domain      a protection domain (PD) on one device; memory regions, windows and connections
//               live in one; CQs belong to the device (see "Protection domains" below)
//   MemoryRegion registered memory: address, length, lkey/rkey, access; deregistered on destruction
//   MemoryWindow a remotely accessible range of a region with a key of its own (verbs type 2B)
//   CompletionQueue  completions of one or more connections, polled in batches; a waitable fd
//   Connection  a reliable-connected queue pair: post SEND, RECV, RDMA WRITE, WRITE_WITH_IMM
//   Listener    accepts connection requests carrying private data
//
// Semantics every provider keeps (the conformance suite in tests/fabric checks them):
//   - Work requests on one connection execute in order. A WRITE's bytes are placed before any
//     later SEND or WRITE_WITH_IMM on the same connection completes at the receiver.
//   - A send-side work request completes when the peer has placed it (RC acknowledgement), not
//     when it left; its buffers may be reused only after its completion (or a later signalled
//     completion on the same connection, as in verbs).
//   - A remote write is checked against rkey, bounds and REMOTE_WRITE access before a byte is
//     placed. A violation completes that request with WcStatus::remote_access_error and moves the
//     connection to the error state; target memory is untouched.
//   - SEND and WRITE_WITH_IMM consume one posted RECV at the receiver. With none posted the
//     sender waits (RC with infinite RNR retry); a SEND larger than the RECV buffers is
//     WcStatus::remote_invalid_request at the sender and WcStatus::local_length_error at the receiver.
//   - Once a connection is in error (peer death, disconnect(), protocol violation) every
//     outstanding work request, send or receive, signalled or not, completes with
//     WcStatus::flush_error. Nothing hangs.
//   - Private data on connect / accept / reject is limited to kMaxPrivateData bytes.
//
// Protection domains (verbs semantics). Fabric::domain_for() gives a device's default domain;
// Domain::alloc_pd() gives further domains on the same device, each with a key space of its own.
//   - A connection belongs to one domain: the one that connect() was called on, or the one
//     passed to ConnectRequest::accept(). Its local SGEs are checked against that domain's
//     regions only (EINVAL at post on the software providers, local_protection_error on rdma),
//     and a remote WRITE arriving on it is checked against that domain's regions and windows
//     only: a valid key of another domain, even of the same device and process, is
//     remote_access_error at the writer, the connection goes to error and no byte is placed.
//   - CompletionQueues belong to the device: create_cq() on any domain of a device gives a CQ
//     that connections of every domain of that device may share.
//   - A domain must outlive its regions, windows and connections; it holds at most
//     PdAttr::max_keys keys (regions and windows) at once, beyond that ENOMEM.
//   - Keys are unpredictable: every registration, bind and rekey carries random key bits, as
//     many as the provider allows (software providers: mr_table.h; rdma: whatever the HCA draws,
//     8 bits of key on Soft-RoCE beside the index, and a random 8-bit key for every window bind).
//
// Progress: the rdma provider progresses in hardware. The software providers progress when the
// CompletionQueue a connection is attached to is polled (or armed and waited on): the owner of a
// CQ must keep polling it or waiting on its fd while connections on it are alive, as every IBTRS
// IO thread does.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ibtrs/address.h"
#include "ibtrs/result.h"
#include "ibtrs/tls.h"

namespace ibtrs::fabric {

// rdma_connect() carries at most 56 bytes of private data (IB CM REQ; RTRS's CON_REQ is exactly
// this size). Accept allows 196 and reject 148 on IB, but the smallest limit applies everywhere
// so an upper layer that works on one provider works on all.
inline constexpr size_t kMaxPrivateData = 56;

// Memory access rights, as in ibv_access_flags.
enum Access : uint32_t {
  kLocalWrite = 1u << 0,
  kRemoteWrite = 1u << 1,
  kRemoteRead = 1u << 2,
  kMwBind = 1u << 3,  // memory windows may be bound over the region (IBV_ACCESS_MW_BIND)
};

// Completion status. Names follow ibv_wc_status.
enum class WcStatus : uint8_t {
  success = 0,
  flush_error,              // IBV_WC_WR_FLUSH_ERR: the connection went to error before this ran
  local_length_error,       // IBV_WC_LOC_LEN_ERR: incoming message larger than the RECV buffers
  local_protection_error,   // IBV_WC_LOC_PROT_ERR: a local SGE is not inside its lkey's region
  remote_access_error,      // IBV_WC_REM_ACCESS_ERR: bad rkey, out of bounds or no REMOTE_WRITE
  remote_invalid_request,   // IBV_WC_REM_INV_REQ_ERR: the peer could not take the request
  remote_operation_error,   // IBV_WC_REM_OP_ERR: the peer failed while handling it
  retry_exceeded,           // IBV_WC_RETRY_EXC_ERR: the peer stopped answering
  fatal_error,              // anything else the provider reports
};
std::string_view to_string(WcStatus s);

enum class Opcode : uint8_t {
  send = 0,              // SEND: consumes a RECV at the peer
  write,                 // RDMA WRITE: one-sided, no completion at the peer
  write_with_imm,        // RDMA WRITE WITH IMMEDIATE: placed, then consumes a RECV at the peer
  recv,                  // completion of a RECV consumed by a SEND
  recv_rdma_with_imm,    // completion of a RECV consumed by a WRITE_WITH_IMM (byte_len = write size)
  local_inv,             // completion of an asynchronous window revocation (invalidate_mw)
};
std::string_view to_string(Opcode o);

// A scatter-gather element: local registered memory.
struct Sge {
  uint64_t addr = 0;
  uint32_t length = 0;
  uint32_t lkey = 0;
};

struct SendWr {
  uint64_t wr_id = 0;
  Opcode opcode = Opcode::send;  // send, write or write_with_imm
  std::span<const Sge> sg_list;
  uint64_t remote_addr = 0;      // write, write_with_imm
  uint32_t rkey = 0;             // write, write_with_imm
  uint32_t imm = 0;              // write_with_imm; delivered as the same host-order value
  bool signaled = true;          // false: no completion on success (selective signalling)
};

struct RecvWr {
  uint64_t wr_id = 0;
  std::span<const Sge> sg_list;
};

struct Completion {
  uint64_t wr_id = 0;
  WcStatus status = WcStatus::success;
  Opcode opcode = Opcode::send;  // valid only when status == success (as in verbs)
  uint32_t byte_len = 0;         // receives: bytes placed
  uint32_t imm = 0;              // recv_rdma_with_imm
  bool with_imm = false;
};

// A registered memory region. Deregisters on destruction; the memory must stay valid until then.
// After destruction no remote write can reach the memory, and later use of its keys fails.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  void* addr() const { return addr_; }
  size_t length() const { return length_; }
  uint32_t lkey() const { return lkey_; }
  uint32_t rkey() const { return rkey_; }
  uint32_t access() const { return access_; }

  // An SGE covering [offset, offset + len) of this region.
  Sge sge(size_t offset, uint32_t len) const {
    return Sge{reinterpret_cast<uint64_t>(static_cast<char*>(addr_) + offset), len, lkey_};
  }
  uint64_t remote_addr(size_t offset = 0) const {
    return reinterpret_cast<uint64_t>(static_cast<char*>(addr_) + offset);
  }

  // Per-use keys of one region (the server's always_invalidate of a chunk). revoke(): both keys
  // fail for every access from the return on, until restore() or rekey(). restore(): the region
  // is reachable again and the rkey is returned: the revoked keys themselves where the provider
  // can bring them back (software providers: the table entry comes back to life, so the peer
  // needs no new key), else new ones (rdma). rekey(): new keys in any case (the old ones, if
  // still valid, fail from the return on). Each returns after every placement through the old
  // keys has finished. Owner only, while no posted work request uses the region's keys.
  // Software providers: a key flip in the domain's table, no system call; rdma: deregistration
  // and registration (verbs cannot change a region's keys in place on every device). Errors:
  // ENOMEM (rdma: the registration failed; the region has no valid key).
  virtual ibtrs::Status revoke() = 0;
  virtual Result<uint32_t> restore() = 0;
  virtual Result<uint32_t> rekey() = 0;

 protected:
  MemoryRegion(void* addr, size_t length, uint32_t lkey, uint32_t rkey, uint32_t access)
      : addr_(addr), length_(length), lkey_(lkey), rkey_(rkey), access_(access) {}
  void set_keys(uint32_t lkey, uint32_t rkey) {
    lkey_ = lkey;
    rkey_ = rkey;
  }

 private:
  void* addr_;
  size_t length_;
  uint32_t lkey_;
  uint32_t rkey_;
  uint32_t access_;
};

// A memory window (verbs type 2B): a remotely accessible range of one memory region with a key
// of its own, bound and revoked through a connection (Connection::bind_mw / invalidate_mw)
// without registering anything. Once bound it answers only remote accesses that arrive on the
// connection it was bound on. From Domain::alloc_mw(); destruction revokes and frees it, and
// must come before the destruction of its domain. A region must not be deregistered while a
// window is bound over it (verbs refuses, and rdma would leak the region); the software
// providers revoke such windows with their region.
class MemoryWindow {
 public:
  virtual ~MemoryWindow() = default;
  MemoryWindow(const MemoryWindow&) = delete;
  MemoryWindow& operator=(const MemoryWindow&) = delete;
  // The key of the current or last binding; 0 before the first.
  uint32_t rkey() const { return rkey_; }

 protected:
  MemoryWindow() = default;
  uint32_t rkey_ = 0;
};

// Completions of the connections attached to it.
// Threading: one thread polls a CQ at a time (it is the owner); arm/poll/wait/fd from the owner.
class CompletionQueue {
 public:
  virtual ~CompletionQueue() = default;

  // Moves up to out.size() completions into `out`; returns how many. Never blocks. For the
  // software providers this is also where incoming data is placed.
  virtual size_t poll(std::span<Completion> out) = 0;

  // A file descriptor that becomes readable when completions may be available. Protocol, as
  // with ibv_req_notify_cq: arm(); poll() again (to close the race); wait for the fd; then
  // ack_events() and poll().
  virtual int fd() const = 0;
  virtual ibtrs::Status arm() = 0;
  virtual void ack_events() = 0;
  // True when fd() is readable whenever poll() has something to return, armed or not (the
  // tcp provider: an epoll set over its sockets, and completions are made only inside poll()
  // and never left queued by one that returned less than asked). Its owner may then wait on
  // fd() without the poll before and after arm() that the verbs protocol needs, which on tcp
  // are a readv each. arm() is still called before waiting (it sends what the CQ owes).
  virtual bool level_triggered() const { return false; }

  // Poll, and if nothing is there arm and wait on fd() up to `timeout`. Returns 0 only when
  // the timeout expired. Providers may do this in fewer system calls.
  virtual size_t wait(std::span<Completion> out, std::chrono::milliseconds timeout);

  uint32_t capacity() const { return capacity_; }

 protected:
  explicit CompletionQueue(uint32_t capacity) : capacity_(capacity) {}

 private:
  uint32_t capacity_;
};

// Connection-level events. Delivered on the rdma_cm event thread (rdma) or, for the software
// providers, on the thread polling the connection's CQ, from inside poll()/wait(). Handlers
// must not block, must not destroy any connection and must not poll a CQ; they record the event
// and let the owner act on it.
struct ConnectionEvents {
  // The connection left the connected state: the peer disconnected or died, disconnect() was
  // called, or a protocol error happened. Outstanding work requests complete with flush_error
  // on the CQ. Called at most once.
  std::function<void(std::error_code)> on_disconnected;
};

struct QueueCaps {
  uint32_t max_send_wr = 64;   // send-queue depth: outstanding SEND/WRITE/WRITE_WITH_IMM
  uint32_t max_recv_wr = 64;   // receive-queue depth
  uint32_t max_send_sge = 4;   // scatter-gather entries per send work request
  uint32_t max_recv_sge = 1;   // scatter-gather entries per receive work request
};

enum class ConnState : uint8_t { connected, error, closed };

// A reliable connection (RC queue pair).
// Threading: post_send/post_recv may be called from any thread (each call is atomic with
// respect to others on the same connection). disconnect() from any thread. Destruction from the
// owning thread after its CQ no longer needs it; destruction implies disconnect().
class Connection {
 public:
  virtual ~Connection() = default;

  // Posts a batch: all or nothing. A WRITE may carry no data (a fence: its completion covers
  // the requests before it). Errors: EINVAL (bad opcode, too many SGEs, an SGE outside
  // registered memory, > 2 GiB), ENOMEM (send queue full: fewer than wrs.size() free slots),
  // ENOTCONN (the connection is in error or closed; nothing was posted).
  virtual ibtrs::Status post_send(std::span<const SendWr> wrs) = 0;
  // post_send whose doorbell may be held until ring() (or the provider's own next flush), so
  // that a thread posting several requests in a row hands them to the wire together: on the
  // tcp provider one sendmsg for all of them instead of one each. The caller must ring() after
  // its last deferred post, while the connection is still alive for it (the upper layer's
  // gate). Providers whose posts cost no system call post at once and ring nothing.
  virtual ibtrs::Status post_send_deferred(std::span<const SendWr> wrs) { return post_send(wrs); }
  virtual void ring() {}
  virtual ibtrs::Status post_recv(std::span<const RecvWr> wrs) = 0;

  // Binds the unbound window `mw` to [addr, addr + len) of `mr` with `access` (kRemoteWrite
  // and/or kRemoteRead) and returns its new key, which answers only remote accesses arriving on
  // this connection. `mw` and `mr` must be of this connection's domain and `mr` registered with
  // kMwBind (and kLocalWrite for kRemoteWrite). The binding takes effect before any work
  // request posted on this connection after the call: a peer told the key by a later SEND or
  // WRITE_WITH_IMM can use it. Costs on rdma an unsignalled BIND_MW work request (a send-queue
  // slot until a later completion retires it: Domain::mw_send_slots()); on the software
  // providers a table entry, no system call. Errors: EINVAL (bound window, region or range not
  // allowed, another domain's objects), ENOTCONN, ENOMEM (send queue full).
  virtual Result<uint32_t> bind_mw(MemoryWindow& mw, const MemoryRegion& mr, uint64_t addr,
                                   uint64_t len, uint32_t access) = 0;
  // Revokes the key of `mw`, bound on this connection (a window bound elsewhere or not at all:
  // EINVAL). true: revoked when this returns, every placement through it finished (software
  // providers always; rdma when the connection is no longer connected: the window is then
  // replaced by a fresh one). false (rdma, connected): a signalled LOCAL_INV was posted, and
  // the key is revoked when a completion with `wr_id` and Opcode::local_inv arrives on this
  // connection's CQ. Should the connection break first, that completion is a flush_error and
  // the window stays bound to the dead connection, where nothing can reach it; call
  // invalidate_mw again to unbind it (then true). Afterwards the window may be bound again.
  virtual Result<bool> invalidate_mw(MemoryWindow& mw, uint64_t wr_id) = 0;

  // Moves the connection to error and tells the peer; outstanding requests flush. Idempotent.
  virtual void disconnect() = 0;

  virtual ConnState state() const = 0;
  virtual const QueueCaps& caps() const = 0;
  // Free send-queue slots right now (send-queue depth accounting for the upper layer).
  virtual uint32_t send_queue_free() const = 0;

  virtual const Address& local_address() const = 0;
  virtual const Address& peer_address() const = 0;
  // Device and port the connection runs on ("rxe0", 1), as the kernel's hca_name/hca_port.
  virtual std::string device_name() const = 0;
  virtual uint8_t port_num() const = 0;

  // Encryption of the connection's stream (tcp with TLS; other providers and plaintext tcp
  // say off). For listings and stats.
  virtual tls::Info tls() const { return {}; }
};

struct ConnectParams {
  Address remote;
  const Address* source = nullptr;        // optional source address to bind
  CompletionQueue* cq = nullptr;          // required; from the same domain
  QueueCaps caps;
  std::span<const std::byte> private_data;  // <= kMaxPrivateData
  ConnectionEvents events;
  std::chrono::milliseconds timeout{30000};  // RTRS's connect timeout
  // Optional: when this fd becomes readable (e.g. an eventfd the owner writes on shutdown) the
  // connect gives up at once with ECANCELED instead of waiting out `timeout`.
  int cancel_fd = -1;
  // TLS 1.3 on the connection (a client-role context; tcp only, EPROTONOSUPPORT elsewhere):
  // the handshake runs before the provider's own, within `timeout`. EACCES: the server refused
  // our credentials or we refused its; EPROTONOSUPPORT: a listener that requires TLS refused a
  // connect without it.
  std::shared_ptr<tls::Context> tls;
};


// A connection request received by a Listener.
class ConnectRequest {
 public:
  virtual ~ConnectRequest() = default;
  virtual std::span<const std::byte> private_data() const = 0;
  virtual const Address& peer_address() const = 0;
  virtual const Address& local_address() const = 0;
  // The domain the request arrived on: register memory and create the CQ there before accept.
  virtual class Domain& domain() = 0;

  // Accepts into protection domain `pd`: domain() or a domain allocated on its device with
  // Domain::alloc_pd() (EINVAL for any other). The connection is usable when this returns
  // (posting RECVs first is still advised); remote writes arriving on it are checked against
  // `pd`'s keys only. `cq` may come from any domain of the device.
  virtual Result<std::unique_ptr<Connection>> accept(class Domain& pd, CompletionQueue& cq,
                                                     const QueueCaps& caps,
                                                     std::span<const std::byte> private_data,
                                                     ConnectionEvents events) = 0;
  // Accepts into the request's own domain().
  Result<std::unique_ptr<Connection>> accept(CompletionQueue& cq, const QueueCaps& caps,
                                             std::span<const std::byte> private_data,
                                             ConnectionEvents events) {
    return accept(domain(), cq, caps, private_data, std::move(events));
  }
  // Rejects; the connecting side's connect() fails with ECONNREFUSED and gets the data.
  virtual ibtrs::Status reject(std::span<const std::byte> private_data) = 0;
  // The identity the peer proved with TLS (its PSK identity or certificate subject), or empty
  // for a connection without TLS.
  virtual std::string tls_identity() const { return {}; }
};

// Listens on one address.
//
// Accepting never waits on one peer. A peer whose connection request is not complete yet (tcp:
// a socket that has not sent its whole CONNECT_REQ) waits inside the listener with a deadline
// of its own (kHandshakeTimeout from its arrival), while complete requests from others are
// returned at once: an idle or slow peer costs only its own timeout, never another's connect.
// At most `backlog` (Fabric::listen) such peers wait; one more drops the oldest of them (an
// honest peer sends its request with its first packet, so it waits for a round trip at most,
// while a flood of idle sockets pushes out its own oldest). Peers that miss their deadline,
// are pushed out or send garbage are dropped, counted in drops(), and never returned. The rdma
// provider gets complete requests from rdma_cm, and loopback requests are complete when made:
// they have nothing pending and drop nothing.
//
// Threading: one thread calls get_request() at a time; drops() from any thread.
class Listener {
 public:
  // Peers dropped before they made a complete request, cumulative.
  struct Drops {
    uint64_t timed_out = 0;  // no complete request within kHandshakeTimeout
    uint64_t overflow = 0;   // the oldest of `backlog` pending peers, pushed out by a newer one
    uint64_t invalid = 0;    // a malformed request, or closed before completing it
    uint64_t plaintext = 0;  // a peer without TLS on a listener that requires it
    uint64_t tls_failed = 0; // a TLS handshake that failed (credentials refused, not TLS 1.3)
  };
  static constexpr std::chrono::milliseconds kHandshakeTimeout{5000};

  virtual ~Listener() = default;
  // Waits up to `timeout` for the next complete request. ETIMEDOUT when none came; a resource
  // error of the provider (EMFILE, ENFILE, ENOMEM: accept failed) is returned once, and the
  // listener retries it by itself after a pause, so the caller just calls again.
  virtual Result<std::unique_ptr<ConnectRequest>> get_request(std::chrono::milliseconds timeout) = 0;
  // Readable when get_request() has work: a request may be complete, or a pending peer's
  // deadline passed. Whoever waits on it calls get_request(0ms) each time it is readable, as
  // that call is also what drops expired peers.
  virtual int fd() const = 0;
  // The bound address (with the real port when 0 was asked for).
  virtual const Address& address() const = 0;
  virtual Drops drops() const { return {}; }
};

struct ConnectResult {
  std::unique_ptr<Connection> connection;
  std::vector<std::byte> private_data;  // the peer's accept private data
};

struct PdAttr {
  // Keys (regions and windows) the domain holds at once; 0: as many as the provider allows
  // (software providers: MrTable::kMaxCapacity; rdma: the device's limits). Beyond it
  // register_memory() and alloc_mw() fail with ENOMEM. On the software providers a smaller cap
  // also widens the random part of every key (mr_table.h).
  uint32_t max_keys = 0;
};

// A protection domain on one device (see "Protection domains" above).
// Threading: all methods thread-safe.
class Domain {
 public:
  virtual ~Domain() = default;
  virtual std::string device_name() const = 0;

  // A new protection domain on this domain's device, with its own key space. It must outlive
  // everything created in it and be destroyed before the Fabric. Errors: ENOMEM, EINVAL.
  virtual Result<std::unique_ptr<Domain>> alloc_pd(const PdAttr& attr) = 0;

  // Errors: EINVAL (null/zero length, unknown access bits), ENOMEM (also: the domain's
  // max_keys reached).
  virtual Result<std::unique_ptr<MemoryRegion>> register_memory(void* addr, size_t length,
                                                                uint32_t access) = 0;
  // A memory window of this domain, unbound. Errors: ENOTSUP (the device has no type 2 memory
  // windows), ENOMEM (also: max_keys reached).
  virtual Result<std::unique_ptr<MemoryWindow>> alloc_mw() = 0;
  // Send-queue slots a bind_mw or an asynchronous invalidate_mw takes on this device's
  // connections until a later completion retires it (QueueCaps sizing): 1 on rdma, 0 where
  // windows are table entries.
  virtual uint32_t mw_send_slots() const { return 0; }
  // A CQ of the device: connections of any domain of the device may use it.
  virtual Result<std::unique_ptr<CompletionQueue>> create_cq(uint32_t capacity) = 0;

  // Connects (blocking up to params.timeout); the connection belongs to this domain. Errors: ECONNREFUSED (rejected: reject data in
  // `reject_data` if non-null), ETIMEDOUT, EHOSTUNREACH/ENETUNREACH, EINVAL (bad params),
  // ENOSPC (the CQ's capacity cannot take this connection's queues).
  virtual Result<ConnectResult> connect(const ConnectParams& params,
                                        std::vector<std::byte>* reject_data = nullptr) = 0;
};

// A provider instance.
// Threading: all methods thread-safe. Must outlive every object created from it.
class Fabric {
 public:
  virtual ~Fabric() = default;
  virtual FabricKind kind() const = 0;

  // The domain (device) that reaches `remote` from `source`. Without a source, an address of
  // this host yields the device that owns it (what a listener on it uses), any other address
  // the device its route leaves through. A client on the same host as its server (test rigs)
  // passes `source`. Stable pointer for the fabric's lifetime; the same device always yields
  // the same domain.
  virtual Result<Domain*> domain_for(const Address& remote, const Address* source = nullptr) = 0;

  // Listens on `local` (port 0 picks a free one). `backlog` bounds pending requests: the
  // kernel's accept queue and the peers still sending their request (Listener). With `tls` (a
  // server-role context; tcp only, EPROTONOSUPPORT elsewhere) peers may run TLS 1.3 before
  // their request, and with `tls_required` they must: a plaintext peer is refused (its connect
  // fails with EPROTONOSUPPORT) and counted in Listener::drops().
  struct ListenOptions {
    int backlog = 128;
    std::shared_ptr<tls::Context> tls;
    bool tls_required = false;
  };
  virtual Result<std::unique_ptr<Listener>> listen(const Address& local, const ListenOptions& options) = 0;
  Result<std::unique_ptr<Listener>> listen(const Address& local, int backlog = 128) {
    ListenOptions o;
    o.backlog = backlog;
    return listen(local, o);
  }
};

// Checks shared by every provider, so the contract of post_send/post_recv and of QueueCaps is
// written once. Providers add their own checks after these (keys, queue space).

// The largest message verbs allows.
inline constexpr uint64_t kMaxMessage = 1ull << 31;

// EINVAL unless every request has a send-side opcode, at most caps.max_send_sge SGEs and at most
// kMaxMessage bytes.
ibtrs::Status check_send_batch(std::span<const SendWr> wrs, const QueueCaps& caps);
// EINVAL unless every request has at most caps.max_recv_sge SGEs and at most kMaxMessage bytes.
ibtrs::Status check_recv_batch(std::span<const RecvWr> wrs, const QueueCaps& caps);
// EINVAL unless both queue depths are in 1..max_wr and both SGE counts in 1..max_sge.
ibtrs::Status check_caps(const QueueCaps& caps, uint32_t max_wr, uint32_t max_sge);

struct FabricOptions {
  // tcp: busy-poll instead of sleeping in CompletionQueue::wait (trades a core for latency).
  bool busy_poll = false;
};

// Opens a provider by kind. ENOTSUP when the rdma provider was not built, ENODEV when no RDMA
// device exists.
Result<std::unique_ptr<Fabric>> open_fabric(FabricKind kind, const FabricOptions& options = {});

}  // namespace ibtrs::fabric
