// ibnbd-log-replay: lists and replays dm-log-writes logs (log_writes.h; tools/soak/README.md).
// soak-vm.sh --log-writes drives it: one incremental replay per checked point, so checking N
// points of a log costs one pass over its data, not N.
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "log_writes.h"

namespace {

namespace lw = ibnbd::soak::logwrites;

constexpr const char* kUsage = R"(usage: ibnbd-log-replay --log LOG --list
       ibnbd-log-replay --log LOG --flush-points
       ibnbd-log-replay --log LOG --target DEV|FILE --replay-to POINT [--start-after POINT] [--drop ENTRY]

A dm-log-writes log (a file or the log device) and what it holds:
  --list            every entry: INDEX FLAGS SECTOR NR_SECTORS [MARK-NAME] (sectors in blocks
                    of the log's sectorsize, printed first as a '#' line)
  --flush-points    the FLUSH, FUA and MARK entries: INDEX FLAGS [MARK-NAME]
  --replay-to P     write every entry's data to the target at its sector, DISCARDs as zeroes
                    (a hole in a file, BLKDISCARD on a device), up to and including P
  --start-after P   the target already holds the replay up to P: continue after it
  --drop ENTRY      leave that entry out (a broken stack, for the checker's self-test only)
A POINT is an entry's index or mark:NAME (the first mark of that name).
Exit: 0 done, 1 a bad or truncated log or a point not in it, 2 usage, 3 I/O error.
)";

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "ibnbd-log-replay: %s\n%s", why.c_str(), kUsage);
  std::exit(2);
}

lw::Point point(const std::string& opt, const std::string& v) {
  auto p = lw::parse_point(v);
  if (!p) usage(opt + " " + v + ": an entry index or mark:NAME");
  return *p;
}

// 1 for a log that is not what it should be (the reader's EINVAL), 3 for the system's errors.
int failed(const std::string& what, std::error_code ec, const std::string& why) {
  std::fprintf(stderr, "ibnbd-log-replay: %s: %s\n", what.c_str(), why.empty() ? ec.message().c_str() : why.c_str());
  return ec == std::errc::invalid_argument && !why.empty() ? 1 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  std::string log_path, target;
  bool do_list = false, do_points = false;
  std::optional<lw::Point> to, start_after;
  std::optional<uint64_t> drop;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--list") {
      do_list = true;
      continue;
    }
    if (a == "--flush-points") {
      do_points = true;
      continue;
    }
    if (i + 1 >= argc) usage(a + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    if (a == "--log") log_path = v;
    else if (a == "--target") target = v;
    else if (a == "--replay-to") to = point(a, v);
    else if (a == "--start-after") start_after = point(a, v);
    else if (a == "--drop") {
      auto p = lw::parse_point(v);
      if (!p || !p->index) usage("--drop " + v + ": an entry index");
      drop = p->index;
    } else {
      usage("unknown option " + a);
    }
  }
  if (log_path.empty()) usage("--log is required");
  if (int(do_list) + int(do_points) + int(to.has_value()) != 1)
    usage("one of --list, --flush-points, --replay-to");
  if (to.has_value() != !target.empty()) usage("--replay-to and --target go together");
  if ((start_after || drop) && !to) usage("--start-after and --drop need --replay-to");

  auto src = lw::open_source(log_path);
  if (!src) return failed("opening " + log_path, src.error(), "");
  std::string why;
  if (do_list || do_points) {
    auto r = lw::Reader::open(**src, &why);
    if (!r) return failed(log_path, r.error(), why);
    std::printf("# log %s: %llu entries, sectorsize %u\n", log_path.c_str(),
                static_cast<unsigned long long>(r->nr_entries()), r->sectorsize());
    auto s = lw::for_each(
        **src,
        [&](const lw::Entry& e) -> ibtrs::Status {
          if (do_points && !lw::is_flush_point(e)) return {};
          std::printf("%llu %s", static_cast<unsigned long long>(e.index), lw::flag_names(e.flags).c_str());
          if (do_list)
            std::printf(" %llu %llu", static_cast<unsigned long long>(e.sector),
                        static_cast<unsigned long long>(e.nr_sectors));
          if (e.is_mark()) std::printf(" %s", lw::printable(e.mark).c_str());
          std::putchar('\n');
          return {};
        },
        &why);
    if (!s) return failed(log_path, s.error(), why);
    return std::fflush(stdout) == 0 ? 0 : 3;
  }

  auto sink = lw::open_sink(target);
  if (!sink) return failed("opening " + target, sink.error(), "");
  lw::ReplayOptions o;
  o.to = *to;
  o.start_after = start_after;
  o.drop = drop;
  auto st = lw::replay(**src, **sink, o, &why);
  if (!st) return failed("replay of " + log_path, st.error(), why);
  std::printf("replayed entries %llu..%llu: %llu writes (%llu bytes), %llu discards%s\n",
              static_cast<unsigned long long>(st->first), static_cast<unsigned long long>(st->last),
              static_cast<unsigned long long>(st->writes), static_cast<unsigned long long>(st->bytes),
              static_cast<unsigned long long>(st->discards),
              st->dropped != 0 ? (", dropped entry " + std::to_string(*drop)).c_str() : "");
  return 0;
}
