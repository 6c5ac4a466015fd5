// ibtrs-load's private header: the tool's wire header, its configuration, the output helpers and
// the entry point of each mode. One file per concern, as the library splits its own:
//   ibtrs_load.cc           main, mode dispatch, output (say, warn, errors, JSON strings)
//   ibtrs_load_args.cc      the command line: usage, Args, the server's and the client's options
//   ibtrs_load_server.cc    the RAM-volume server (and `local`, server and client in one process)
//   ibtrs_load_workload.h/.cc  the client's slots, the --verify data, the IO path
//   ibtrs_load_client.cc    the client session, the --control FIFO, the run loop
//   ibtrs_load_report.cc    the interval lines and the final report (text and --json)
#pragma once

#include <signal.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "ibtrs/client.h"
#include "ibtrs/path_spec.h"
#include "ibtrs/server.h"
#include "ibtrs/types.h"

namespace ibtrs_load {

using Clock = std::chrono::steady_clock;

// ---- the tool's wire protocol -----------------------------------------------------------------

constexpr uint32_t kLoadMagic = 0x4C4F4144;  // "LOAD"

// The user header of every request. Both ends of this tool run on little-endian hosts (the
// project targets x86-64 and arm64 Linux), so the struct travels as it lies in memory.
struct LoadHdr {
  uint64_t offset = 0;  // byte offset on the server's volume
  uint32_t len = 0;     // data bytes: must equal the request's data length
  uint32_t magic = kLoadMagic;
};
static_assert(sizeof(LoadHdr) == 16, "LoadHdr is 16 bytes on the wire");
static_assert(std::endian::native == std::endian::little, "LoadHdr travels in host byte order");

// ---- output (ibtrs_load.cc) --------------------------------------------------------------------

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}


// Completion, event, control and main threads all print; one lock keeps their lines whole, and a
// flush per line lets a script that tails the output see each line as it happens.
extern std::mutex g_out_mu;
__attribute__((format(printf, 1, 2))) void say(const char* fmt, ...);
__attribute__((format(printf, 1, 2))) void warn(const char* fmt, ...);
std::string errtext(std::error_code ec);
std::string errtext(int err);
double mib(uint64_t bytes);
std::string json_str(std::string_view s);
std::string stats_text(const ibtrs::PathStatsSnapshot& s);
// Signals are taken synchronously (sigwait / sigtimedwait), so they are blocked before any
// library thread exists: threads inherit the mask and none of them is picked to take them.
sigset_t block_stop_signals();

// ---- command line (ibtrs_load_args.cc) ----------------------------------------------------------

extern const char kUsage[];
[[noreturn]] void usage_error(const std::string& msg);

// Walks argv; each typed getter takes the value after the current flag or stops with usage.
class Args {
 public:
  Args(int argc, char** argv, int first, int last = -1) {
    for (int i = first; i < (last < 0 ? argc : last); ++i) v_.emplace_back(argv[i]);
  }
  bool next() {
    if (i_ >= v_.size()) return false;
    flag_ = v_[i_++];
    return true;
  }
  std::string_view flag() const { return flag_; }
  std::string_view str();
  uint64_t num(uint64_t lo, uint64_t hi);
  uint64_t size(uint64_t lo, uint64_t hi);
  double seconds();
  [[noreturn]] void unknown() const { usage_error("unknown option '" + std::string(flag_) + "'"); }

 private:
  std::vector<std::string_view> v_;
  size_t i_ = 0;
  std::string_view flag_;
};

struct ServerConfig {
  std::vector<ibtrs::Address> listen;
  uint32_t queue_depth = 512;
  uint32_t chunk_size = 128 * 1024;
  uint32_t io_threads = 0;
  std::optional<uint32_t> hb_interval_ms;
  std::optional<uint32_t> hb_missed;
  uint64_t size = 1ull << 30;
  std::string ready_file;
  bool busy_poll = false;
  bool always_invalidate = false;
  std::string host_key;
  ibtrs::tls::Options tls;
};

enum class Rw { randread, randwrite, read, write, randrw };

struct ClientConfig {
  std::string session;
  std::vector<ibtrs::PathSpec> paths;
  ibtrs::MpPolicy policy = ibtrs::MpPolicy::min_inflight;
  Rw rw = Rw::randread;
  std::string rw_name = "randread";
  uint64_t bs = 4096;
  uint32_t qd = 1;
  double seconds = 0;
  uint64_t count = 0;
  uint64_t size = 1ull << 30;
  bool verify = false;
  uint32_t io_threads = 0;
  std::optional<uint32_t> hb_interval_ms;
  std::optional<uint32_t> hb_missed;
  std::optional<uint32_t> reconnect_delay_ms;
  std::optional<uint32_t> pending_timeout_ms;
  bool busy_poll = false;
  bool json = false;
  uint32_t interval_ms = 0;
  std::string control;
  std::string host_key;
  ibtrs::tls::Options tls;
};

ServerConfig parse_server(Args& a);
ClientConfig parse_client(Args& a, bool paths_required = true);

// ---- modes ----------------------------------------------------------------------------------------

int run_server(const ServerConfig& c);                 // ibtrs_load_server.cc
int run_local(const ServerConfig& sc, ClientConfig cc);  // ibtrs_load_server.cc
int run_client(const ClientConfig& c);                 // ibtrs_load_client.cc

// ---- report (ibtrs_load_report.cc) ----------------------------------------------------------------

// Latency histogram, log-linear: exact below 128 ns, then 64 sub-buckets per power of two
// (under 1.6% error), so percentiles need no stored samples however long the run.
class LatHist {
 public:
  static constexpr size_t kBuckets = 58 * 64 + 128;

  void add(uint64_t ns) {
    ++b_[index(ns)];
    ++n_;
    max_ = std::max(max_, ns);
  }
  void merge(const LatHist& o) {
    for (size_t i = 0; i < kBuckets; ++i) b_[i] += o.b_[i];
    n_ += o.n_;
    max_ = std::max(max_, o.max_);
  }
  uint64_t count() const { return n_; }
  uint64_t max() const { return max_; }
  // The middle of the bucket holding the p-th sample, capped at the exact maximum.
  uint64_t percentile(double p) const {
    if (n_ == 0) return 0;
    uint64_t want = std::max<uint64_t>(1, static_cast<uint64_t>(p * static_cast<double>(n_) + 0.999999));
    uint64_t seen = 0;
    for (size_t i = 0; i < kBuckets; ++i) {
      seen += b_[i];
      if (seen >= want) return std::min(max_, middle(i));
    }
    return max_;
  }

 private:
  static size_t index(uint64_t v) {
    if (v < 128) return static_cast<size_t>(v);
    unsigned shift = static_cast<unsigned>(std::bit_width(v)) - 7;  // v >> shift is in [64, 128)
    return shift * 64 + static_cast<size_t>(v >> shift);
  }
  static uint64_t middle(size_t i) {
    if (i < 128) return i;
    size_t shift = i / 64 - 1;
    uint64_t low = static_cast<uint64_t>(i - shift * 64) << shift;
    return low + ((uint64_t{1} << shift) >> 1);
  }
  std::array<uint64_t, kBuckets> b_{};
  uint64_t n_ = 0;
  uint64_t max_ = 0;
};

// What a finished run measured (the client's report).
struct RunResult {
  uint64_t ops = 0;
  uint64_t bytes = 0;
  double secs = 0;
  LatHist lat;
  uint64_t errors = 0;
  uint64_t verify_errors = 0;
  uint64_t max_pause_ns = 0;
  double open_ms = 0;
  std::vector<ibtrs::ClientPathInfo> paths;
};

// One --interval-ms line: `dops` operations in the last `dt` seconds, `elapsed` into the run.
void print_interval(uint64_t inflight, ibtrs::ClientSession& s, double elapsed, uint64_t dops, double dt);
// The lines after the run, and the --json line.
void print_report(const ClientConfig& c, const RunResult& r);

}  // namespace ibtrs_load
