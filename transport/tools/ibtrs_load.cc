// ibtrs-load: a RAM-volume server and a load generator on the public session API of libibtrs.
//
//   ibtrs-load server --listen ADDR [--listen ADDR ...] [--size BYTES] [--ready-file PATH] ...
//   ibtrs-load client --session NAME --path SPEC [--path SPEC ...] [--rw MODE] [--bs SIZE] ...
//
// Every request carries a LoadHdr as its user header: where on the server's volume the data
// goes or comes from. The server copies between the request's data and its volume inline on the
// IO thread. The client keeps --qd requests in flight, resubmitting from the completion callback,
// and reports throughput, latency, errors and the longest pause between completions (what a
// failover costs the caller). `ibtrs-load --help` lists every option.
#include "ibtrs_load.h"

#include <pthread.h>

#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <exception>

namespace ibtrs_load {

std::mutex g_out_mu;

__attribute__((format(printf, 1, 2))) void say(const char* fmt, ...) {
  std::lock_guard lk(g_out_mu);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stdout, fmt, ap);
  va_end(ap);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

__attribute__((format(printf, 1, 2))) void warn(const char* fmt, ...) {
  std::lock_guard lk(g_out_mu);
  std::fflush(stdout);
  va_list ap;
  va_start(ap, fmt);
  std::fputs("ibtrs-load: ", stderr);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
}

std::string errtext(std::error_code ec) { return ec.message() + " (" + std::to_string(ec.value()) + ")"; }
std::string errtext(int err) { return std::string(std::strerror(err)) + " (" + std::to_string(err) + ")"; }

double mib(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

std::string json_str(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

sigset_t block_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

std::string stats_text(const ibtrs::PathStatsSnapshot& s) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "reads %" PRIu64 " (%.1f MiB) writes %" PRIu64 " (%.1f MiB)", s.read_cnt,
                mib(s.read_bytes), s.write_cnt, mib(s.write_bytes));
  return buf;
}

namespace {

int run(int argc, char** argv) {
  if (argc < 2) usage_error("server or client?");
  std::string_view mode = argv[1];
  if (mode == "--help" || mode == "-h" || mode == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  Args args(argc, argv, 2);
  if (mode == "server") return run_server(parse_server(args));
  if (mode == "client") return run_client(parse_client(args));
  if (mode == "local") {
    int split = 2;
    while (split < argc && std::string_view(argv[split]) != "--") ++split;
    Args sargs(argc, argv, 2, split);
    Args cargs(argc, argv, split < argc ? split + 1 : argc);
    ServerConfig sc = parse_server(sargs);
    return run_local(sc, parse_client(cargs, false));
  }
  usage_error("unknown mode '" + std::string(mode) + "'");
}

}  // namespace

}  // namespace ibtrs_load

int main(int argc, char** argv) {
  try {
    return ibtrs_load::run(argc, argv);
  } catch (const std::exception& e) {
    ibtrs_load::warn("fatal: %s", e.what());
  } catch (...) {
    ibtrs_load::warn("fatal: unknown exception");
  }
  return 1;
}

