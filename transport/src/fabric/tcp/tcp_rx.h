// Receive side of a tcp-provider connection: turns the byte stream into placed data and
// completions. Independent of sockets (bytes come through RxHooks::read) so that the libFuzzer
// target drives exactly this code.
//
// Placement: a payload whose header has been parsed is read straight into its target (the
// region of the rkey, or the SGEs of the RECV it consumes). Bytes that arrive in the same read
// as their header land in a staging buffer first and are copied once from there. The buffer is
// large enough for a whole burst of small frames per read (one readv for a batch of 4 KiB IOs);
// beside a large payload only a small part of it is offered, so that the copy stays bounded
// by kStagingBesideLargePayload per read and large transfers are received in place.
// Every placement step holds an MrTable::Ref on the region it writes, and a target is checked
// (key, bounds, access) before the first byte of its frame is placed.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <system_error>

#include "fabric/mr_table.h"
#include "fabric/tcp/tcp_wire.h"

namespace ibtrs::fabric::tcp {

inline constexpr uint32_t kMaxRecvSge = 16;
inline constexpr uint32_t kMaxSendSge = 32;
// 64 KiB: a batch of 4 KiB IOs (16 per read) per readv. Measured A/B at 4 KiB QD32 on loopback
// against 16 KiB: client readv per IO 0.27 -> 0.08 (randread), server 0.28 -> 0.07
// (randwrite); 128 and 256 KiB took only ~0.02 more per IO off.
inline constexpr size_t kDefaultStaging = 64 * 1024;
// Staging offered beside an in-place payload of at least kDefaultStaging bytes: enough for the
// next frames' headers, small enough that a stream of large WRITEs is still copied only ~1.5%.
inline constexpr size_t kStagingBesideLargePayload = 16 * 1024;

// A posted RECV as the receive queue stores it.
struct RecvEntry {
  uint64_t wr_id = 0;
  uint32_t num_sge = 0;
  Sge sge[kMaxRecvSge];
};

// What the engine needs from its connection. Called only from RxEngine::pump, on the poller.
class RxHooks {
 public:
  // Reads into iov like readv(2): bytes read, 0 at end of stream, -errno (-EAGAIN: nothing now).
  virtual ssize_t read(const iovec* iov, int iovcnt) = 0;
  // The oldest posted RECV, or null when none is posted.
  virtual RecvEntry* head_recv() = 0;
  // Completes and removes the oldest posted RECV.
  virtual void complete_recv(WcStatus status, Opcode opcode, uint32_t byte_len, uint32_t imm,
                             bool with_imm) = 0;
  // The peer acknowledged `ack` of our data frames (cumulative). False: impossible value.
  virtual bool on_ack(uint32_t ack) = 0;
  // The peer reports that our data frame number `frame` failed with `status`.
  virtual void on_nak(uint32_t frame, WcStatus status) = 0;

 protected:
  ~RxHooks() = default;
};

enum class RxResult : uint8_t {
  idle,         // all readable bytes processed; wait for the socket
  more,         // stopped at the read budget; more may be readable
  rnr,          // a SEND / WRITE_IMM waits for a RECV to be posted
  peer_closed,  // DISCONNECT frame, end of stream or socket error (see error())
  nak,          // the peer failed one of our frames (on_nak was called); the stream is over
  failed,       // the peer broke the protocol or a target check failed; send nak_status()
};

class RxEngine {
 public:
  // `mrs`: the key table of the connection's protection domain; `conn`: the connection's id,
  // which memory windows bound on it carry as their owner.
  explicit RxEngine(const MrTable& mrs, size_t staging_bytes = kDefaultStaging, uint64_t conn = 0);
  RxEngine(const RxEngine&) = delete;
  RxEngine& operator=(const RxEngine&) = delete;

  // Processes staged bytes and reads at most `max_reads` times.
  RxResult pump(RxHooks& hooks, unsigned max_reads);

  // Data frames of the peer placed so far (mod 2^32); the value our headers acknowledge.
  uint32_t placed() const { return placed_.load(std::memory_order_acquire); }

  // Whether a frame placed since the last call asked for a prompt acknowledgement.
  bool take_ack_request() {
    bool r = ack_requested_;
    ack_requested_ = false;
    return r;
  }

  // After `failed`: the status to report to the peer in a NAK for frame number placed().
  WcStatus nak_status() const { return nak_status_; }
  // After `failed` or `peer_closed`: why (EPROTO, EMSGSIZE, EACCES, ECONNRESET, ...).
  std::error_code error() const { return error_; }

  // Payload bytes copied out of the staging buffer (the rest were received in place).
  uint64_t staged_copy_bytes() const { return staged_copy_bytes_; }
  uint64_t payload_bytes() const { return payload_bytes_; }
  // Bytes of the current frame's payload still to come (0 between frames).
  uint64_t payload_left() const { return state_ == State::payload ? remaining_ : 0; }

 private:
  enum class State : uint8_t { header, need_recv, payload, ended };
  struct Segment {
    uint32_t key;
    uint64_t addr;
    uint64_t len;
  };
  enum class Step : uint8_t { go_on, stop };

  // Runs the state machine over the staged bytes. `out` is set when processing must stop.
  Step process_staged(RxHooks& hooks, RxResult& out);
  Step run_staged(RxHooks& hooks, RxResult& out);
  Step on_header(RxHooks& hooks, RxResult& out);
  Step bind_recv(RxHooks& hooks, RxResult& out);
  void finish_frame(RxHooks& hooks);
  RxResult fail(WcStatus nak, int err);
  // Copies up to `n` staged bytes into the payload target; false if a region vanished.
  bool place_from_staging(size_t n);
  // Builds iovecs for the remaining payload (holding Refs in refs_). 0 if a region vanished.
  int payload_iov(iovec* iov, int max);
  void advance_payload(uint64_t n);
  size_t staged() const { return s_end_ - s_begin_; }

  const MrTable& mrs_;
  const uint64_t conn_;
  std::unique_ptr<std::byte[]> stage_;
  size_t stage_cap_;
  size_t s_begin_ = 0;
  size_t s_end_ = 0;

  State state_ = State::header;
  FrameHeader hdr_{};
  uint32_t need_access_ = 0;
  Segment segs_[kMaxRecvSge];
  uint32_t nsegs_ = 0;
  uint32_t seg_idx_ = 0;
  uint64_t seg_off_ = 0;
  uint64_t remaining_ = 0;
  MrTable::Ref refs_[kMaxRecvSge];
  // WRITE / WRITE_IMM target [remote_addr, +length) as checked by on_header; held only within
  // one process_staged() pass (see there).
  MrTable::Ref frame_ref_;

  std::atomic<uint32_t> placed_{0};
  bool ack_requested_ = false;
  WcStatus nak_status_ = WcStatus::success;
  std::error_code error_;
  uint64_t staged_copy_bytes_ = 0;
  uint64_t payload_bytes_ = 0;
};

}  // namespace ibtrs::fabric::tcp
