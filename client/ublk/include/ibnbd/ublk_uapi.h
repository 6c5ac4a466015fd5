// The Linux 6.12 ublk uAPI (include/uapi/linux/ublk_cmd.h) as far as the ublk target uses it,
// written from the documented layouts (/work/shared/reference/devices.md): Debian bookworm's
// linux-libc-dev (6.1) lacks the ioctl-encoded commands and the recovery/feature flags, so the
// project carries its own copy. The struct and field names are the kernel's (so the driver's
// source can be read beside this file); the command and flag macros become constants.
//
// Every struct's size is asserted, and every ioctl-encoded opcode is computed with _IOR/_IOWR
// from the struct it carries and asserted equal to the value the kernel defines: a wrong field
// width here breaks the build, not the device.
#pragma once

#include <linux/ioctl.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace ibnbd::ublk::uapi {

// ---- control commands: io_uring IORING_OP_URING_CMD on /dev/ublk-control (SQE128 ring) ----

// The payload of a control command, in sqe->cmd (UBLK_CMD_*). 32 bytes: needs a 128-byte SQE.
struct ublksrv_ctrl_cmd {
  uint32_t dev_id;    // the device; ADD_DEV: this or ~0u (the kernel picks one)
  uint16_t queue_id;  // 0xffff: not a queue command (all we send)
  uint16_t len;       // bytes at addr (IN or OUT, per command)
  uint64_t addr;      // user buffer of the command (dev_info, params, features)
  uint64_t data[1];   // inline argument: START_DEV / END_USER_RECOVERY: the daemon's pid
  uint16_t dev_path_len;  // UNPRIVILEGED_DEV and GET_DEV_INFO2 only (includes the NUL)
  uint16_t pad;
  uint32_t reserved;
};

// What ADD_DEV takes and answers, and GET_DEV_INFO answers. 64 bytes.
struct ublksrv_ctrl_dev_info {
  uint16_t nr_hw_queues;  // clamped by the kernel to the number of CPUs
  uint16_t queue_depth;   // <= kMaxQueueDepth
  uint16_t state;         // kStateDead / kStateLive / kStateQuiesced
  uint16_t pad0;
  uint32_t max_io_buf_bytes;  // rounded down to a page by the kernel; <= kMaxIoBufBytes
  uint32_t dev_id;
  int32_t ublksrv_pid;  // the serving daemon (START_DEV / END_USER_RECOVERY), -1 when none
  uint32_t pad1;
  uint64_t flags;          // kF* below
  uint64_t ublksrv_flags;  // the daemon's own, stored and returned by the kernel untouched
  uint32_t owner_uid;      // set by the kernel
  uint32_t owner_gid;
  uint64_t reserved1;
  uint64_t reserved2;
};

// Opcode numbers (_IOC_NR) of the control commands.
inline constexpr uint32_t kCmdGetQueueAffinity = 0x01;
inline constexpr uint32_t kCmdGetDevInfo = 0x02;
inline constexpr uint32_t kCmdAddDev = 0x04;
inline constexpr uint32_t kCmdDelDev = 0x05;
inline constexpr uint32_t kCmdStartDev = 0x06;
inline constexpr uint32_t kCmdStopDev = 0x07;
inline constexpr uint32_t kCmdSetParams = 0x08;
inline constexpr uint32_t kCmdGetParams = 0x09;
inline constexpr uint32_t kCmdStartUserRecovery = 0x10;
inline constexpr uint32_t kCmdEndUserRecovery = 0x11;
inline constexpr uint32_t kCmdGetDevInfo2 = 0x12;
inline constexpr uint32_t kCmdGetFeatures = 0x13;
inline constexpr uint32_t kCmdDelDevAsync = 0x14;

// The ioctl-encoded control opcodes (UBLK_U_CMD_*), type 'u', size of ublksrv_ctrl_cmd.
inline constexpr uint32_t kUCmdGetQueueAffinity = _IOR('u', kCmdGetQueueAffinity, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdGetDevInfo = _IOR('u', kCmdGetDevInfo, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdAddDev = _IOWR('u', kCmdAddDev, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdDelDev = _IOWR('u', kCmdDelDev, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdStartDev = _IOWR('u', kCmdStartDev, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdStopDev = _IOWR('u', kCmdStopDev, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdSetParams = _IOWR('u', kCmdSetParams, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdGetParams = _IOR('u', kCmdGetParams, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdStartUserRecovery = _IOWR('u', kCmdStartUserRecovery, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdEndUserRecovery = _IOWR('u', kCmdEndUserRecovery, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdGetDevInfo2 = _IOR('u', kCmdGetDevInfo2, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdGetFeatures = _IOR('u', kCmdGetFeatures, ublksrv_ctrl_cmd);
inline constexpr uint32_t kUCmdDelDevAsync = _IOR('u', kCmdDelDevAsync, ublksrv_ctrl_cmd);

// GET_FEATURES answers a uint64_t of kF* bits (UBLK_FEATURES_LEN).
inline constexpr uint32_t kFeaturesLen = 8;

// Device flags (UBLK_F_*), 6.12.
inline constexpr uint64_t kFSupportZeroCopy = 1ull << 0;
inline constexpr uint64_t kFUringCmdCompInTask = 1ull << 1;
inline constexpr uint64_t kFNeedGetData = 1ull << 2;
// The device survives its daemon (QUIESCED) and a new daemon may take it back.
inline constexpr uint64_t kFUserRecovery = 1ull << 3;
// ... and requests that were with the dead daemon are issued again instead of failing (EIO).
inline constexpr uint64_t kFUserRecoveryReissue = 1ull << 4;
inline constexpr uint64_t kFUnprivilegedDev = 1ull << 5;
inline constexpr uint64_t kFCmdIoctlEncode = 1ull << 6;
inline constexpr uint64_t kFUserCopy = 1ull << 7;
inline constexpr uint64_t kFZoned = 1ull << 8;
// 6.16 (UBLK_F_UPDATE_SIZE): the device takes UBLK_U_CMD_UPDATE_SIZE. Set only where the build's
// <linux/ublk_cmd.h> has the command (UblkControl::update_size) and GET_FEATURES reports it.
inline constexpr uint64_t kFUpdateSize = 1ull << 10;

// Device states (UBLK_S_DEV_*).
inline constexpr uint16_t kStateDead = 0;
inline constexpr uint16_t kStateLive = 1;
inline constexpr uint16_t kStateQuiesced = 2;

inline constexpr uint32_t kMaxQueueDepth = 4096;          // UBLK_MAX_QUEUE_DEPTH
inline constexpr uint32_t kMaxIoBufBytes = 32u << 20;     // 1 << UBLK_IO_BUF_BITS (25)

// ---- parameters (SET_PARAMS / GET_PARAMS, addr -> ublk_params) ----

inline constexpr uint32_t kAttrReadOnly = 1u << 0;
inline constexpr uint32_t kAttrRotational = 1u << 1;
inline constexpr uint32_t kAttrVolatileCache = 1u << 2;  // the daemon must then serve FLUSH
inline constexpr uint32_t kAttrFua = 1u << 3;

struct ublk_param_basic {
  uint32_t attrs;             // kAttr*
  uint8_t logical_bs_shift;   // 9..PAGE_SHIFT
  uint8_t physical_bs_shift;  // >= logical_bs_shift
  uint8_t io_opt_shift;
  uint8_t io_min_shift;
  uint32_t max_sectors;       // <= max_io_buf_bytes >> 9
  uint32_t chunk_sectors;
  uint64_t dev_sectors;
  uint64_t virt_boundary_mask;
};

struct ublk_param_discard {
  uint32_t discard_alignment;
  uint32_t discard_granularity;  // must not be 0 when the type is set
  uint32_t max_discard_sectors;
  uint32_t max_write_zeroes_sectors;
  uint16_t max_discard_segments;  // 1 when max_discard_sectors != 0 (single range only)
  uint16_t reserved0;
};

struct ublk_param_devt {  // read-only: set by the kernel (GET_PARAMS), refused by SET_PARAMS
  uint32_t char_major;
  uint32_t char_minor;
  uint32_t disk_major;
  uint32_t disk_minor;
};

struct ublk_param_zoned {
  uint32_t max_open_zones;
  uint32_t max_active_zones;
  uint32_t max_zone_append_sectors;
  uint8_t reserved[20];
};

inline constexpr uint32_t kParamTypeBasic = 1u << 0;
inline constexpr uint32_t kParamTypeDiscard = 1u << 1;
inline constexpr uint32_t kParamTypeDevt = 1u << 2;
inline constexpr uint32_t kParamTypeZoned = 1u << 3;

struct ublk_params {
  uint32_t len;    // bytes of this struct the kernel should read (sizeof)
  uint32_t types;  // kParamType* included
  ublk_param_basic basic;
  ublk_param_discard discard;
  ublk_param_devt devt;
  ublk_param_zoned zoned;
};

// ---- IO: io_uring IORING_OP_URING_CMD on /dev/ublkcN, one ring per queue thread ----

// Opcode numbers of the IO commands, and their ioctl-encoded values (UBLK_U_IO_*).
inline constexpr uint32_t kIoFetchReq = 0x20;
inline constexpr uint32_t kIoCommitAndFetchReq = 0x21;
inline constexpr uint32_t kIoNeedGetData = 0x22;

// The payload of an IO command, in sqe->cmd (fits a 64-byte SQE). 16 bytes.
struct ublksrv_io_cmd {
  uint16_t q_id;
  uint16_t tag;
  int32_t result;  // COMMIT_AND_FETCH: bytes done (READ/WRITE) or 0, or -errno
  uint64_t addr;   // the tag's IO buffer: the driver copies WRITE data in, READ data out
};

inline constexpr uint32_t kUIoFetchReq = _IOWR('u', kIoFetchReq, ublksrv_io_cmd);
inline constexpr uint32_t kUIoCommitAndFetchReq = _IOWR('u', kIoCommitAndFetchReq, ublksrv_io_cmd);
inline constexpr uint32_t kUIoNeedGetData = _IOWR('u', kIoNeedGetData, ublksrv_io_cmd);

// CQE res of FETCH / COMMIT_AND_FETCH.
inline constexpr int32_t kIoResOk = 0;           // a request is in the tag's descriptor
inline constexpr int32_t kIoResNeedGetData = 1;  // NEED_GET_DATA only (not used)
inline constexpr int32_t kIoResAbort = -19;      // -ENODEV: the device stops, the tag is done

// One request, in the queue's descriptor array (mmap of /dev/ublkcN, read-only). 24 bytes.
struct ublksrv_io_desc {
  uint32_t op_flags;      // op: bits 0-7, flags: bits 8-31
  uint32_t nr_sectors;    // 512-byte sectors (nr_zones for REPORT_ZONES)
  uint64_t start_sector;
  uint64_t addr;          // the buffer of the tag (what FETCH / COMMIT gave)
};

inline constexpr uint8_t kIoOpRead = 0;
inline constexpr uint8_t kIoOpWrite = 1;
inline constexpr uint8_t kIoOpFlush = 2;
inline constexpr uint8_t kIoOpDiscard = 3;
inline constexpr uint8_t kIoOpWriteSame = 4;
inline constexpr uint8_t kIoOpWriteZeroes = 5;
// 10..15: zone operations (ZONED devices only).

inline constexpr uint32_t kIoFFailfastDev = 1u << 8;
inline constexpr uint32_t kIoFFailfastTransport = 1u << 9;
inline constexpr uint32_t kIoFFailfastDriver = 1u << 10;
inline constexpr uint32_t kIoFMeta = 1u << 11;
inline constexpr uint32_t kIoFFua = 1u << 13;
inline constexpr uint32_t kIoFNoUnmap = 1u << 15;
inline constexpr uint32_t kIoFSwap = 1u << 16;

// Descriptor array of queue q: at offset q * kDescQueueStride of /dev/ublkcN (the stride is
// room for kMaxQueueDepth descriptors, page-rounded), length depth * 24 page-rounded.
inline constexpr uint64_t kCmdBufOffset = 0;  // UBLKSRV_CMD_BUF_OFFSET
inline constexpr uint64_t kDescQueueStride = 98304;
inline constexpr uint64_t kIoBufOffset = 0x80000000ull;  // USER_COPY only (not used)

// ---- proofs ----

#define IBNBD_UAPI_STRUCT(T, size)                                         \
  static_assert(sizeof(T) == (size), #T " must be " #size " bytes");      \
  static_assert(std::is_trivially_copyable_v<T> && std::is_standard_layout_v<T>, #T)

IBNBD_UAPI_STRUCT(ublksrv_ctrl_cmd, 32);
IBNBD_UAPI_STRUCT(ublksrv_ctrl_dev_info, 64);
IBNBD_UAPI_STRUCT(ublk_param_basic, 32);
IBNBD_UAPI_STRUCT(ublk_param_discard, 20);
IBNBD_UAPI_STRUCT(ublk_param_devt, 16);
IBNBD_UAPI_STRUCT(ublk_param_zoned, 32);
IBNBD_UAPI_STRUCT(ublk_params, 112);
IBNBD_UAPI_STRUCT(ublksrv_io_cmd, 16);
IBNBD_UAPI_STRUCT(ublksrv_io_desc, 24);
#undef IBNBD_UAPI_STRUCT

static_assert(offsetof(ublksrv_ctrl_cmd, addr) == 8 && offsetof(ublksrv_ctrl_cmd, data) == 16 &&
              offsetof(ublksrv_ctrl_cmd, dev_path_len) == 24);
static_assert(offsetof(ublksrv_ctrl_dev_info, max_io_buf_bytes) == 8 &&
              offsetof(ublksrv_ctrl_dev_info, ublksrv_pid) == 16 &&
              offsetof(ublksrv_ctrl_dev_info, flags) == 24 &&
              offsetof(ublksrv_ctrl_dev_info, owner_uid) == 40);
static_assert(offsetof(ublk_params, basic) == 8 && offsetof(ublk_params, discard) == 40 &&
              offsetof(ublk_params, devt) == 60 && offsetof(ublk_params, zoned) == 76);
static_assert(offsetof(ublksrv_io_desc, start_sector) == 8 && offsetof(ublksrv_io_desc, addr) == 16);
static_assert(offsetof(ublksrv_io_cmd, result) == 4 && offsetof(ublksrv_io_cmd, addr) == 8);

// The encoded opcodes, as devices.md lists the kernel's values.
static_assert(kUCmdGetQueueAffinity == 0x80207501u);
static_assert(kUCmdGetDevInfo == 0x80207502u);
static_assert(kUCmdAddDev == 0xc0207504u);
static_assert(kUCmdDelDev == 0xc0207505u);
static_assert(kUCmdStartDev == 0xc0207506u);
static_assert(kUCmdStopDev == 0xc0207507u);
static_assert(kUCmdSetParams == 0xc0207508u);
static_assert(kUCmdGetParams == 0x80207509u);
static_assert(kUCmdStartUserRecovery == 0xc0207510u);
static_assert(kUCmdEndUserRecovery == 0xc0207511u);
static_assert(kUCmdGetDevInfo2 == 0x80207512u);
static_assert(kUCmdGetFeatures == 0x80207513u);
static_assert(kUCmdDelDevAsync == 0x80207514u);
static_assert(kUIoFetchReq == 0xc0107520u);
static_assert(kUIoCommitAndFetchReq == 0xc0107521u);
static_assert(kUIoNeedGetData == 0xc0107522u);
static_assert(kDescQueueStride == ((kMaxQueueDepth * sizeof(ublksrv_io_desc) + 4095) / 4096) * 4096);

}  // namespace ibnbd::ublk::uapi
