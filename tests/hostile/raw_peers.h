// The hostile-peer suite's attackers: clients of the documented wire formats that obey only what
// the server enforces.
//
//   RawFabricPeer  IBTRS by hand over the fabric layer (docs/protocol.md): CON_REQ, INFO, the
//                  authentication exchange, and requests written into the server's chunks with
//                  WRITE_WITH_IMM, plus plain RDMA writes anywhere with any key. What a client
//                  holding a chunk key can do.
//   RawTcpPeer     the tcp provider's framing by hand over a socket (docs/fabric.md), for what
//                  the fabric code would not do: never acknowledging, never reading.
//
// Those that get a session authenticate by hand (DH-HMAC-CHAP, auth/chap.h) with credentials
// they are given -- in the suite an insider's, a host the server knows with grants of its own --
// or come without credentials, as an outsider.
//
// Threading: one thread per peer. None of them answers heartbeats: cases stay well under the
// server's missed-heartbeat limit (5 x 5 s).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fabric/fabric.h"
#include "ibtrs/auth.h"
#include "ibtrs/address.h"
#include "ibtrs/path_spec.h"
#include "proto/ibnbd_proto.h"
#include "proto/ibtrs_proto.h"

namespace ibnbd::hostile {

using Ms = std::chrono::milliseconds;
using ibtrs::Result;
using ibtrs::Status;

// IBNBD messages as the wire wants them (encoded by hand where the encoders would refuse).
std::vector<std::byte> sess_info_msg();
std::vector<std::byte> open_msg(AccessMode mode, std::string_view name);
std::vector<std::byte> close_msg(uint32_t device_id);
std::vector<std::byte> io_msg(uint32_t device_id, IoOp op, uint64_t offset, uint32_t len);

class RawFabricPeer {
 public:
  struct Options {
    std::string session_name = "raw";
    ibtrs::Uuid16 session = ibtrs::Uuid16::random();
    ibtrs::Uuid16 path = ibtrs::Uuid16::random();
    uint16_t cid_num = 2;  // service + one IO connection
    bool info = true;      // false: stop after the CON_REQs, a half-open path
    uint16_t connect = 0;  // connections to make (of cid_num); 0: all
    // Credentials. With a key every CON_REQ carries the auth flag and the path authenticates
    // after INFO_REQ as the key's host. Without one the CON_REQs carry no flag (an anonymous
    // client, which a server admitting only hosts refuses at its first connection), unless
    // `claim_auth`: the flag without credentials, for paths that never reach the challenge
    // (info = false).
    ibtrs::ClientAuth auth;
    bool claim_auth = false;
  };
  // Errors: the fabric's connect errors, or the errno of the server's CON_RSP refusal (EACCES:
  // no credentials); the AUTH_FAILURE's reason (EACCES: an unknown host, a wrong key, a host
  // other than the session's); EPROTO for an answer we cannot read; ETIMEDOUT.
  static Result<std::unique_ptr<RawFabricPeer>> connect(const ibtrs::Address& a, const Options& o);
  ~RawFabricPeer();
  RawFabricPeer(const RawFabricPeer&) = delete;
  RawFabricPeer& operator=(const RawFabricPeer&) = delete;

  uint16_t queue_depth() const { return qd_; }
  uint32_t chunk_size() const { return chunk_size_; }
  bool invalidates() const { return invalidate_; }
  const std::vector<ibtrs::proto::ChunkDesc>& chunks() const { return chunks_; }
  // Every connection still connected (progresses the software fabric first).
  bool connected();

  // Writes a request into chunk `chunk` and raises its immediate, without waiting:
  //   read:  [usr][ReadMsg][BufDesc -> our buffer at `resp_off`, `len` bytes]
  //   write: [data][usr][WriteMsg]
  Status post_read(uint32_t chunk, std::span<const std::byte> usr, uint32_t len, size_t resp_off = 0);
  Status post_write(uint32_t chunk, std::span<const std::byte> usr, std::span<const std::byte> data = {});
  // The next response on the IO connection. ETIMEDOUT; ECONNRESET once the server closed.
  Result<ibtrs::proto::IoRspImm> next_response(Ms t);
  // One request at a time: posts into chunk 0 and waits for its answer (the errno), or minus
  // the error of the wait.
  int request_read(std::span<const std::byte> usr, uint32_t len, Ms t = Ms(5000));
  int request_write(std::span<const std::byte> usr, std::span<const std::byte> data = {}, Ms t = Ms(5000));
  // A plain RDMA write of `bytes` to the server at (addr, key): only the server's fabric checks.
  Status rdma_write(uint64_t addr, uint32_t key, std::span<const std::byte> bytes);
  // Where the server writes READ data and responses (1 MiB).
  std::byte* response_area() { return buf_.get(); }

  // IBNBD on top: SESS_INFO, OPEN (the response decoded), CLOSE. The errno, or minus a wait's.
  int sess_info();
  int open(const std::string& name, AccessMode mode, proto::OpenRsp* rsp = nullptr);
  int close(uint32_t device_id);

 private:
  struct Con {
    std::unique_ptr<ibtrs::fabric::CompletionQueue> cq;
    std::unique_ptr<ibtrs::fabric::Connection> conn;
  };
  RawFabricPeer() = default;
  Status post_recvs(Con& c, size_t area_off, uint32_t slot, uint32_t n);
  // The next message on the service connection; empty when it broke or after `t`.
  std::vector<std::byte> svc_recv(Ms t);
  // SENDs `m` on the service connection from the data area's `slot`-th KiB.
  Status svc_send(std::span<const std::byte> m, uint32_t slot);
  Status post_request(uint32_t chunk, uint32_t len, uint32_t offset, size_t stage_off);
  // The errno of the answer for `chunk` (others' are dropped), or minus a failure of the post or
  // the wait.
  int answer_of(const Status& posted, uint32_t chunk, Ms t);
  std::byte* stage(uint32_t chunk) { return buf_.get() + kStageOff + size_t{chunk} * kStageSlot; }

  static constexpr size_t kRespSize = 1 << 20;         // [0, 1 MiB): READ targets
  static constexpr size_t kStageOff = 1 << 20;         // [1 MiB, 2 MiB): one slot per chunk
  static constexpr size_t kStageSlot = 8192;           // usr + ReadMsg/WriteMsg of small requests
  static constexpr size_t kDataOff = 2 << 20;          // [2 MiB, 3 MiB): write data, rdma_write
  static constexpr size_t kRecvOff = 3 << 20;          // [3 MiB, 4 MiB): receive slots
  static constexpr size_t kBufSize = 4 << 20;

  ibtrs::fabric::Domain* dom_ = nullptr;
  std::unique_ptr<std::byte[]> buf_;
  std::unique_ptr<ibtrs::fabric::MemoryRegion> mr_;
  std::vector<Con> cons_;
  std::vector<ibtrs::proto::ChunkDesc> chunks_;
  std::deque<ibtrs::proto::IoRspImm> answers_;  // taken from the CQ, not returned yet
  ibtrs::proto::ImmLayout layout_{};
  uint16_t qd_ = 0;
  uint32_t chunk_size_ = 0;
  bool invalidate_ = false;
};

// One tcp provider stream by hand. Data frames we send carry ack = 0 for ever: we never
// acknowledge anything the server sends.
class RawTcpPeer {
 public:
  // Connects and sends CONNECT_REQ with `con_req`; reads CONNECT_RSP. On a reject the errno of
  // its CON_RSP (EACCES: a client without credentials), or ECONNREFUSED.
  static Result<std::unique_ptr<RawTcpPeer>> connect(uint16_t port, const ibtrs::proto::ConReq& con_req,
                                                     ibtrs::proto::ConRsp* rsp);
  ~RawTcpPeer();
  RawTcpPeer(const RawTcpPeer&) = delete;
  RawTcpPeer& operator=(const RawTcpPeer&) = delete;

  // Data frames. A send the socket cannot take for kSendStall gives up with ETIMEDOUT (what is
  // left of the frame unsent: the stream is of no further use): the server stops reading a peer
  // that does not acknowledge, and disconnects it only after its ack timeout (30 s).
  static constexpr Ms kSendStall{1000};
  Status send(std::span<const std::byte> payload);
  Status write_imm(uint64_t addr, uint32_t rkey, uint32_t imm, std::span<const std::byte> payload);
  // Reads frames until one of `type` arrives (its header and payload), skipping others. ETIMEDOUT.
  struct Frame {
    uint8_t type = 0;
    uint32_t imm = 0;
    std::vector<std::byte> payload;
  };
  Result<Frame> read_frame(uint8_t type, Ms t);
  int fd() const { return fd_; }

 private:
  explicit RawTcpPeer(int fd) : fd_(fd) {}
  Status send_all(const void* p, size_t n);
  Status recv_all(void* p, size_t n, Ms t);
  int fd_;
};

// A whole IBTRS session (one path: service + one IO connection) over RawTcpPeer streams, that
// never acknowledges a frame.
class RawTcpSession {
 public:
  // Through INFO_RSP, authenticating with `auth` when it holds a key (as RawFabricPeer). The
  // connect and authentication errors; EPROTO for an INFO_RSP we cannot read.
  static Result<std::unique_ptr<RawTcpSession>> connect(uint16_t port, const std::string& name,
                                                        const ibtrs::ClientAuth& auth);
  uint16_t queue_depth() const { return qd_; }
  // A READ request into chunk `c`: [usr][ReadMsg][BufDesc x ndesc], `len` bytes split evenly
  // over the descriptors, which name a buffer nobody registered (the server writes it anyway).
  Status post_read(uint32_t c, std::span<const std::byte> usr, uint32_t len, uint16_t ndesc = 1);
  // The next response's immediate on the IO connection (data frames before it are skipped).
  Result<ibtrs::proto::IoRspImm> answer(Ms t);

 private:
  RawTcpSession() = default;
  std::unique_ptr<RawTcpPeer> svc_, io_;
  std::vector<ibtrs::proto::ChunkDesc> chunks_;
  ibtrs::proto::ImmLayout layout_{};
  uint16_t qd_ = 0;
};

// A TCP connection that never says anything (what an idle or malicious peer holds open).
class SilentSocket {
 public:
  static Result<std::unique_ptr<SilentSocket>> connect(uint16_t port);
  ~SilentSocket();
  SilentSocket(const SilentSocket&) = delete;
  SilentSocket& operator=(const SilentSocket&) = delete;

 private:
  explicit SilentSocket(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace ibnbd::hostile
