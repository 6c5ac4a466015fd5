// ibnbd: the admin CLI, modelled on the `rnbd` tool. It holds no state and no logic of its own:
// each command is one request to a daemon's control socket (ibnbd-server or ibnbd-client), whose
// JSON answer is rendered as a table, JSON or CSV.
//
//   ibnbd [options] [client|server] [device|session|path] <command> [arguments]
#include <unistd.h>

#include <climits>
#include <cerrno>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <algorithm>
#include <charconv>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/text.h"
#include "ibnbd/types.h"
#include "ibtrs/auth.h"
#include "ibtrs/tls.h"
#include "control/client.h"
#include "control/command.h"
#include "control/output.h"

namespace {

using base::parse_size;

using nlohmann::json;
using namespace ibnbd::control;

const char kUsage[] =
    "usage: ibnbd [options] [client|server] [device|session|path] <command> [arguments]\n"
    "\n"
    "client (default):\n"
    "  device map <device> from <server> [<server> ...] [standby <server> [<server> ...]]\n"
    "         [ro|rw|migration] [session <name>] [standby-session <name>]\n"
    "         [host-key FILE] [host ID] [tls on|off] [--ublk [--ublk-queue-depth N]]\n"
    "         standby: a second server exporting the same store (a gateway of the same RBD\n"
    "         image), opened in the same mode and idle; IO moves there when the first is lost\n"
    "         host-key: authenticate with this key file instead of the daemon's --host-key\n"
    "         tls: TLS 1.3 on the session's tcp paths or not, instead of the daemon's --tls\n"
    "         --ublk: also serve it as the block device /dev/ublkbN (ublk_drv); it survives a\n"
    "         crash of ibnbd-client (a restarted daemon takes it back) and goes with unmap\n"
    "  device list | show <device> | unmap <device> [force] | remap <device> | resize <device>\n"
    "  device failover <device>   the standby becomes active now (an administrative failover)\n"
    "  device io <device> [size S] [offset S] [bs S] [qd N] [mode write-verify|write|verify]\n"
    "         writes a pattern and reads it back through the mapped device (progress on stderr)\n"
    "  device export <device> [unix PATH [mode MODE] [group GROUP]] [tcp [HOST:]PORT]\n"
    "         [tls-psk FILE | tls-cert FILE tls-key FILE [tls-ca FILE]] [insecure] [name NAME]\n"
    "         [remote]\n"
    "         serves the mapped device over NBD. The unix socket is owner-only unless mode\n"
    "         (octal) / group say more. tls-psk (psktool's identity:hexkey lines; ibnbd key psk)\n"
    "         or tls-cert/tls-key make every client use TLS 1.3 with those credentials (nbds://,\n"
    "         nbdkit --tls=require). tcp without TLS authenticates nobody: it needs the word\n"
    "         insecure (any local user can connect), and 'remote' beyond loopback; port 0\n"
    "         picks one | unexport <device> | exports\n"
    "  session list | show <session> | reconnect <session> | disconnect <session>\n"
    "  session recover [<session>]   reconnect paths that are down, re-open closed devices\n"
    "  session max-reconnect-attempts <session> [N]   shows, or sets (-1: forever, 0..9999)\n"
    "  path list [<session>] | add <session> <path> | delete <session> <path>\n"
    "       | reconnect <session> <path> | disconnect <session> <path>\n"
    "  path stats <session> [<path>] | reset-stats <session> [<path>] [<group>]\n"
    "server:\n"
    "  host add <host>|- key FILE [server-key FILE] [access PATTERN:ro|rw|migration ...]\n"
    "         adds a host, or replaces its keys (key rotation: new paths need the new key;\n"
    "         without 'access' a known host keeps its rules). '-': the host id of the key file.\n"
    "         PATTERN: '**' everything, 'dir/**' beneath dir, or a glob like 'a/*.img'\n"
    "  host list | remove <host> | stats\n"
    "  session list | show <session>\n"
    "  device list | show <device> | force-close <device> <session>\n"
    "  path list [<session>] | disconnect <session> <path>\n"
    "  path stats <session> [<path>] | reset-stats <session> [<path>] [<group>]\n"
    "  refusals list | reset     peers refused or cut off, by reason (counts since start/reset)\n"
    "  limits                    sessions, paths, chunk memory, backlog: in use against the caps\n"
    "  io-threads                how each IO thread waited for requests (--poll): spins that\n"
    "                            caught one, misses, blocks by reason, the learned gap\n"
    "key (no daemon):\n"
    "  key generate [host ID] [hmac 0|1|2|3] [length 32|48|64] [server-key] [out FILE]\n"
    "         a key file: a host id (a new nqn.2014-08.org.nvmexpress:uuid:... unless given),\n"
    "         a DHHC-1 secret and with server-key one for the server to prove; to FILE\n"
    "         (created with mode 0600) or stdout. Copy it to the client and the server.\n"
    "  key show FILE   the host and the keys' fingerprints (never the secrets)\n"
    "  key psk IDENTITY [out FILE]   a TLS pre-shared key for NBD exports (identity:hexkey,\n"
    "         the psktool format nbdkit and libnbd read; FILE mode 0600)\n"
    "migrate (runs ibnbd-migrate; `ibnbd migrate --help`):\n"
    "  migrate save|restore|list|verify|delete <volume> from <server>... [image <name>] ...\n"
    "  migrate ... <volume> nbd <socket> ...   (through a daemon's export of its mapping)\n"
    "\n"
    "options:\n"
    "  --format table|json|csv   (-f)    --units B|K|M|G|T|P|E|auto   (-u)\n"
    "  --noheaders                       --socket PATH (default /run/ibnbd-<client|server>.sock)\n"
    "  --fields SPEC, or SPEC as the last word of list/show: a,b (those columns, in that order),\n"
    "  +a / -b (the default set adjusted), all; e.g. device list device,state,size\n"
    "A <server> or <path> is [src@]dst with addresses like tcp:10.0.0.1, rdma:10.0.0.1:1234 or\n"
    "ip:10.0.0.1 (rdma). A stats <group> is all (default), rdma, rdma_lat, wc_completion,\n"
    "sg_entries, cpu_migration or reconnects, as the kernel's stats files, or (client) fence:\n"
    "the failover fence's counters.\n";

[[noreturn]] void fail(int code, const std::string& msg) {
  std::fprintf(stderr, "ibnbd: %s\n", msg.c_str());
  std::exit(code);
}

bool progress_shown = false;
std::string progress_phase;

// {"phase": "write", "done": bytes, "total": bytes, "mib_s": x}: one redrawn line on stderr.
void show_progress(const json& p) {
  const double total = p.value("total", 0.0), done = p.value("done", 0.0);
  const double frac = total > 0 ? std::min(1.0, done / total) : 0;
  const int width = 40, fill = static_cast<int>(frac * width);
  std::string bar(static_cast<size_t>(fill), '#');
  bar.resize(width, '.');
  const std::string phase = p.value("phase", std::string());
  if (progress_shown && phase != progress_phase) std::fputc('\n', stderr);  // keep the last one
  progress_phase = phase;
  std::fprintf(stderr, "\r%-6s [%s] %5.1f%%  %8.1f MiB/s", p.value("phase", std::string()).c_str(),
               bar.c_str(), frac * 100, p.value("mib_s", 0.0));
  std::fflush(stderr);
  progress_shown = true;
}

// One request over the daemon's control socket: progress lines are shown as they come, the
// last line is the answer.
json call(const std::string& path, const json& req) {
  std::string why;
  auto rsp = ibnbd::control::call(path, req, show_progress, &why);
  if (!rsp) fail(rsp.error() == std::errc::filename_too_long ? 2 : 1, why);
  if (progress_shown) std::fputc('\n', stderr);
  return std::move(*rsp);
}

// The daemon's verdict: on failure its message goes to stderr and its errno is the exit code.
const json& check(const json& rsp) {
  if (rsp.value("ok", false)) return rsp;
  int e = rsp.value("errno", 1);
  fail(e > 0 && e < 126 ? e : 1, rsp.value("error", std::string("failed")));
}

int64_t num(const json& j, const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<int64_t>() : 0; }
uint64_t unum(const json& j, const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<uint64_t>() : 0; }
std::string str(const json& j, const char* k) {
  if (!j.contains(k)) return "";
  if (j[k].is_string()) return j[k].get<std::string>();
  return j[k].dump();
}

struct Cli {
  OutputOptions out;
  std::string socket;
  std::string side = "client";
  std::string object;
  std::string command;
  std::vector<std::string> args;

  std::string arg(size_t i, const char* what) const {
    if (i >= args.size()) fail(22, command + ": missing " + what + "\n" + kUsage);
    return args[i];
  }
  void print(const Listing& l) const {
    std::string why;
    auto sel = select_fields(l, out.fields, &why);
    if (!sel) fail(22, why);
    std::fputs(render(*sel, out).c_str(), stdout);
  }
  json rpc(json req) const { return check(call(socket, req)); }
};

// ---- both sides: per-path counters (the daemons' path_stats / reset_stats commands) ----

// path stats <session> [<path>]: one row per path, the counters the kernel's stats files show;
// on the client also the failover fence's (stats/fence: the server's paths have none).
Listing path_stats_listing(const json& paths) {
  Listing l{{{"pathname"}, {"state"}, {"fabric"}, {"read_cnt", true}, {"rx_bytes", true},
             {"write_cnt", true}, {"tx_bytes", true}, {"inflights", true}, {"failovered", true},
             {"reconnects", true}, {"reconnects_failed", true}, {"lat_max_read_us", true},
             {"lat_max_write_us", true}},
            {}};
  const bool fence = std::any_of(paths.begin(), paths.end(), [](const json& p) { return p.contains("fence"); });
  if (fence)
    for (const char* c : {"fence_waited", "fenced", "fence_rtt_us", "fence_rtt_max_us"}) l.columns.push_back({c, true});
  for (auto& p : paths) {
    const json& st = p["stats"];
    l.rows.push_back({str(p, "name"), str(p, "state"), str(p, "fabric"), num(st, "read_cnt"),
                      Bytes{unum(st, "read_bytes")}, num(st, "write_cnt"), Bytes{unum(st, "write_bytes")},
                      num(st, "inflight"), num(st, "failovered"), num(st, "reconnects_ok"),
                      num(st, "reconnects_failed"), num(st, "lat_max_read_ns") / 1000,
                      num(st, "lat_max_write_ns") / 1000});
    if (fence) {
      const json f = p.value("fence", json::object());
      for (int64_t v : {num(f, "waited"), num(f, "fenced"), num(f, "last_rtt_ns") / 1000, num(f, "max_rtt_ns") / 1000})
        l.rows.back().emplace_back(v);
    }
  }
  return l;
}

bool is_stats_group(const std::string& w) {
  for (const char* g : {"all", "rdma", "rdma_lat", "wc_completion", "sg_entries", "cpu_migration", "reconnects", "fence"})
    if (w == g) return true;
  return false;
}

// path stats | reset-stats, the same words on both sides; false when `c` is another command.
bool run_path_stats(const Cli& c, const char* reset_cmd) {
  if (c.object != "path" || (c.command != "stats" && c.command != "reset-stats")) return false;
  json req{{"session", c.arg(0, "<session>")}};
  // A path name always has an address in it, so it never reads as a group name.
  for (size_t i = 1; i < c.args.size(); ++i) {
    const std::string& w = c.args[i];
    if (c.command == "reset-stats" && is_stats_group(w)) req["stats"] = w;
    else if (!req.contains("path")) req["path"] = w;
    else fail(22, c.command + ": unexpected word '" + w + "'");
  }
  if (c.command == "stats") {
    req["cmd"] = "path_stats";
    c.print(path_stats_listing(c.rpc(req)["paths"]));
  } else {
    req["cmd"] = reset_cmd;
    c.rpc(req);
  }
  return true;
}

// ---- server side ----

Listing server_sessions(const json& sessions, const std::string& only) {
  Listing l{{{"sessname"}, {"host"}, {"path_cnt", true}, {"devices", true}, {"rx_bytes", true},
             {"tx_bytes", true}, {"inflights", true}, {"version", true}},
            {}};
  for (auto& s : sessions) {
    if (!only.empty() && str(s, "name") != only) continue;
    const json& st = s["stats"];
    const std::string host = str(s, "host");
    l.rows.push_back({str(s, "name"), host.empty() ? std::string("(anonymous)") : host,
                      static_cast<int64_t>(s["paths"].size()),
                      static_cast<int64_t>(s["devices"].size()), Bytes{unum(st, "write_bytes")},
                      Bytes{unum(st, "read_bytes")}, num(st, "inflight"), num(s, "version")});
  }
  return l;
}

Listing server_paths(const json& sessions, const std::string& only) {
  Listing l{{{"sessname"}, {"pathname"}, {"src_addr"}, {"dst_addr"}, {"hca_name"}, {"hca_port", true},
             {"state"}, {"auth"}, {"tls"}, {"rx_bytes", true}, {"tx_bytes", true}, {"inflights", true}},
            {}};
  for (auto& s : sessions) {
    if (!only.empty() && str(s, "name") != only) continue;
    for (auto& p : s["paths"])
      l.rows.push_back({str(s, "name"), str(p, "name"), str(p, "src_addr"), str(p, "dst_addr"),
                        str(p, "hca_name"), num(p, "hca_port"), str(p, "state"),
                        str(p, "auth") + (p.value("auth_bidirectional", false) ? "+server" : ""),
                        p.contains("tls") ? str(p, "tls") : std::string("-"), Bytes{unum(p, "write_bytes")}, Bytes{unum(p, "read_bytes")}, num(p, "inflight")});
  }
  return l;
}

Listing server_devices(const json& devices, const std::string& only) {
  Listing l{{{"device"}, {"kind"}, {"size", true}, {"sessions"}, {"io_mode"}, {"rx_bytes", true},
             {"tx_bytes", true}, {"errors", true}},
            {}};
  for (auto& d : devices) {
    if (!only.empty() && str(d, "name") != only) continue;
    std::string holders;
    for (auto& h : d["sessions"]) {
      if (!holders.empty()) holders += " ";
      holders += str(h, "session") + ":" + str(h, "access_mode");
    }
    const json& st = d["stats"];
    l.rows.push_back({str(d, "name"), str(d, "kind"), Bytes{unum(d, "size")}, holders,
                      std::string(d.value("direct", false) ? "direct" : "buffered") +
                          (d.value("read_only", false) ? ",ro" : ""),
                      Bytes{unum(st, "write_bytes")}, Bytes{unum(st, "read_bytes")}, num(st, "errors")});
  }
  return l;
}

// refusals list: one row per reason, the latest refusal's time and detail.
Listing server_refusals(const json& refusals) {
  Listing l{{{"reason"}, {"count", true}, {"last_seen"}, {"last"}}, {}};
  for (auto& r : refusals) {
    std::string when = "-";
    if (const int64_t ms = num(r, "last_unix_ms"); ms > 0) {
      const time_t t = static_cast<time_t>(ms / 1000);
      tm tmv{};
      char buf[32];
      ::localtime_r(&t, &tmv);
      std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tmv);
      when = buf;
    }
    l.rows.push_back({str(r, "reason"), num(r, "count"), when, str(r, "last")});
  }
  return l;
}

// A file name as the daemon (with another working directory) can open it.
std::string absolute(const std::string& f) {
  char buf[PATH_MAX];
  if (::realpath(f.c_str(), buf) == nullptr) fail(errno, f + ": " + std::strerror(errno));
  return buf;
}

// server host add <host>|- key FILE [server-key FILE] [access PATTERN:MODE ...]
json host_add_request(const Cli& c) {
  json req{{"cmd", "host_add"}};
  if (c.arg(0, "<host> or -") != "-") req["host"] = c.args[0];
  for (size_t i = 1; i < c.args.size(); ++i) {
    const std::string& w = c.args[i];
    if (w == "key") req["key_file"] = absolute(c.arg(++i, "a key file"));
    else if (w == "server-key") req["server_key_file"] = absolute(c.arg(++i, "a key file"));
    else if (w == "access") {
      json rules = json::array();
      while (i + 1 < c.args.size()) {
        const std::string& r = c.args[++i];
        const size_t colon = r.rfind(':');
        if (colon == std::string::npos || colon == 0) fail(22, "access: PATTERN:ro|rw|migration, not '" + r + "'");
        rules.push_back({{"devices", r.substr(0, colon)}, {"mode", r.substr(colon + 1)}});
      }
      req["access"] = rules;
    } else {
      fail(22, "host add: unexpected word '" + w + "'");
    }
  }
  if (!req.contains("key_file")) fail(22, "host add: key FILE is required");
  return req;
}

Listing host_listing(const json& hosts) {
  Listing l{{{"host"}, {"keys"}, {"server_key"}, {"access"}, {"sessions", true}}, {}};
  for (auto& h : hosts) {
    std::string keys, access;
    for (auto& k : h["keys"]) keys += (keys.empty() ? "" : " ") + k.get<std::string>();
    for (auto& r : h["access"]) access += (access.empty() ? "" : " ") + str(r, "devices") + ":" + str(r, "mode");
    l.rows.push_back({str(h, "host"), keys, str(h, "server_key"), access.empty() ? std::string("(none)") : access,
                      num(h, "sessions")});
  }
  return l;
}

// limits: what peers hold against each cap.
Listing server_limits(const json& rsp) {
  const json& lim = rsp["limits"];
  const json& use = rsp["usage"];
  Listing l{{{"resource"}, {"used", true}, {"limit", true}}, {}};
  l.rows.push_back({"sessions", num(use, "sessions"), num(lim, "max_sessions")});
  l.rows.push_back({"handshaking_sessions", num(use, "handshaking_sessions"), num(lim, "max_sessions")});
  l.rows.push_back({"paths", num(use, "paths"),
                    num(lim, "max_paths_per_session") * num(lim, "max_sessions")});
  l.rows.push_back({"paths_per_session", "-", num(lim, "max_paths_per_session")});
  l.rows.push_back({"chunk_memory", Bytes{unum(use, "chunk_memory")}, Bytes{unum(lim, "max_chunk_memory")}});
  // Of the reserved chunk memory, what is in RAM (chunks are backed as requests touch them).
  l.rows.push_back({"chunk_resident", Bytes{unum(use, "chunk_resident")}, "-"});
  l.rows.push_back({"response_backlog", num(use, "backlog"), "-"});
  // Reconnects held until the session they would replace has drained: at most max_sessions
  // in all (then EAGAIN at once), each for drain_hold_ms (then EAGAIN).
  l.rows.push_back({"held_connects", num(use, "held_connects"), num(lim, "max_sessions")});
  l.rows.push_back({"handshake_timeout_ms", "-", num(lim, "handshake_timeout_ms")});
  l.rows.push_back({"ack_timeout_ms", "-", num(lim, "ack_timeout_ms")});
  l.rows.push_back({"drain_hold_ms", "-", num(lim, "drain_hold_ms")});
  // The failover fence since the server started (counts, no limit): PATH_FENCE answered, and
  // of those the ones that closed a live path.
  l.rows.push_back({"fences_answered", num(use, "fences_answered"), "-"});
  l.rows.push_back({"fences_closed", num(use, "fences_closed"), "-"});
  return l;
}

// io-threads: how each transport IO thread waited for work.
Listing server_io_threads(const json& threads) {
  Listing l{{{"thread", true}, {"mode"}, {"waits", true}, {"caught", true}, {"missed", true},
             {"preempted", true}, {"sleeps", true}, {"blocked"}, {"gap_us", true}},
            {}};
  for (auto& t : threads) {
    std::string blocked;
    for (auto& [reason, n] : t["blocked"].items())
      if (n.get<uint64_t>() > 0) blocked += (blocked.empty() ? "" : " ") + reason + ":" + std::to_string(n.get<uint64_t>());
    l.rows.push_back({num(t, "thread"), str(t, "mode"), num(t, "waits"), num(t, "spins_caught"),
                      num(t, "spins_missed"), num(t, "spins_preempted"), num(t, "sleeps"),
                      blocked.empty() ? std::string("-") : blocked,
                      num(t, "expected_gap_ns") / 1000});
  }
  return l;
}

int run_server(const Cli& c) {
  const std::string& o = c.object;
  const std::string& cmd = c.command;
  if (o == "refusals" && (cmd == "list" || cmd == "show")) {
    c.print(server_refusals(c.rpc({{"cmd", "refusals"}})["refusals"]));
    return 0;
  }
  if (o == "refusals" && cmd == "reset") {
    c.rpc({{"cmd", "reset_refusals"}});
    return 0;
  }
  if (o == "io-threads" && (cmd == "list" || cmd == "show")) {
    c.print(server_io_threads(c.rpc({{"cmd", "io_threads"}})["io_threads"]));
    return 0;
  }
  if (o == "limits" && (cmd == "list" || cmd == "show")) {
    c.print(server_limits(c.rpc({{"cmd", "limits"}})));
    return 0;
  }
  if (o == "host") {
    if (cmd == "add") {
      std::printf("%s\n", str(c.rpc(host_add_request(c)), "message").c_str());
    } else if (cmd == "list") {
      json rsp = c.rpc({{"cmd", "host_list"}});
      c.print(host_listing(rsp["hosts"]));
      if (rsp.value("allow_any_host", false) && c.out.format == Format::table)
        std::printf("allow_any_host: on (any host opens any device, without credentials)\n");
    } else if (cmd == "remove") {
      c.rpc({{"cmd", "host_remove"}, {"host", c.arg(0, "<host>")}});
    } else if (cmd == "stats") {
      json rsp = c.rpc({{"cmd", "auth_stats"}});
      Listing l{{{"counter"}, {"value", true}}, {}};
      for (auto& [k, v] : rsp.items())
        if (v.is_number() || v.is_boolean()) l.rows.push_back({k, v.is_boolean() ? int64_t{v.get<bool>()} : v.get<int64_t>()});
      c.print(l);
    } else {
      fail(22, "unknown command: server host " + cmd + "\n" + kUsage);
    }
    return 0;
  }
  if (o == "session" && (cmd == "list" || cmd == "show")) {
    std::string only = cmd == "show" ? c.arg(0, "<session>") : "";
    auto l = server_sessions(c.rpc({{"cmd", "sessions"}})["sessions"], only);
    if (!only.empty() && l.rows.empty()) fail(2, "no session " + only);
    c.print(l);
    if (cmd == "show") {
      std::fputs("\n", stdout);
      c.print(server_paths(c.rpc({{"cmd", "sessions"}})["sessions"], only));
    }
    return 0;
  }
  if (o == "path" && cmd == "list") {
    c.print(server_paths(c.rpc({{"cmd", "sessions"}})["sessions"], c.args.empty() ? "" : c.args[0]));
    return 0;
  }
  if (run_path_stats(c, "reset_stats")) return 0;
  if (o == "path" && cmd == "disconnect") {
    c.rpc({{"cmd", "disconnect_path"}, {"session", c.arg(0, "<session>")}, {"path", c.arg(1, "<path>")}});
    return 0;
  }
  if (o == "device" && (cmd == "list" || cmd == "show")) {
    std::string only = cmd == "show" ? c.arg(0, "<device>") : "";
    auto l = server_devices(c.rpc({{"cmd", "devices"}})["devices"], only);
    if (!only.empty() && l.rows.empty()) fail(2, "no device " + only);
    c.print(l);
    return 0;
  }
  if (o == "device" && (cmd == "force-close" || cmd == "close")) {
    c.rpc({{"cmd", "force_close"}, {"device", c.arg(0, "<device>")}, {"session", c.arg(1, "<session>")}});
    return 0;
  }
  fail(22, "unknown command: server " + o + " " + cmd + "\n" + kUsage);
}

// ---- client side: the daemon returns listings ready to render ----

// The summary of `device io`: a line per pass and the per-path split.
int print_io(const Cli& c, const json& rsp) {
  if (!rsp.contains("bytes")) check(rsp);
  Listing passes{{{"pass"}, {"bytes", true}, {"seconds", true}, {"MiB/s", true}, {"errors", true},
                  {"bad_blocks", true}},
                 {}};
  for (const char* k : {"write", "verify"}) {
    if (!rsp.contains(k)) continue;
    const json& r = rsp[k];
    char secs[32], rate[32];
    std::snprintf(secs, sizeof(secs), "%.2f", r.value("seconds", 0.0));
    std::snprintf(rate, sizeof(rate), "%.1f", r.value("mib_s", 0.0));
    passes.rows.push_back({k, Bytes{unum(rsp, "bytes")}, std::string(secs), std::string(rate),
                           num(r, "errors"), r.contains("bad_blocks") ? num(r, "bad_blocks") : int64_t{0}});
  }
  c.print(passes);
  Listing paths{{{"path"}, {"state"}, {"read_cnt", true}, {"rx_bytes", true}, {"write_cnt", true},
                 {"tx_bytes", true}, {"failovered", true}},
                {}};
  for (auto& p : rsp["paths"])
    paths.rows.push_back({str(p, "name"), str(p, "state"), num(p, "read_cnt"), Bytes{unum(p, "read_bytes")},
                          num(p, "write_cnt"), Bytes{unum(p, "write_bytes")}, num(p, "failovered")});
  std::fputs("\n", stdout);
  c.print(paths);
  check(rsp);
  return 0;
}

int run_client(const Cli& c) {
  json req{{"cmd", c.object + "_" + c.command}};
  const std::string& cmd = c.command;
  if (run_path_stats(c, "path_reset_stats")) return 0;
  if (c.object == "session" && cmd == "max-reconnect-attempts") {
    req = json{{"cmd", "session_max_reconnect_attempts"}, {"session", c.arg(0, "<session>")}};
    if (c.args.size() > 1) req["value"] = c.args[1];  // the daemon checks the range
    std::printf("%s\n", str(c.rpc(req), "max_reconnect_attempts").c_str());
    return 0;
  }
  if (c.object == "device" && cmd == "map") {
    // map <device> from <server> [<server> ...] [ro|rw|migration] [session <name>]
    //     [--ublk [--ublk-queue-depth N]]
    req["device"] = c.arg(0, "<device>");
    if (c.arg(1, "'from'") != "from") fail(22, "map <device> from <server> ...");
    json paths = json::array();
    json standby = json::array();
    json* servers = &paths;  // the words after 'standby' name the standby's servers
    for (size_t i = 2; i < c.args.size(); ++i) {
      const std::string& a = c.args[i];
      if (a == "ro" || a == "rw" || a == "migration") req["access_mode"] = a;
      else if (a == "standby") servers = &standby;
      else if (a == "standby-session") req["standby_session"] = c.arg(++i, "<session name>");
      else if (a == "session") req["session"] = c.arg(++i, "<session name>");
      else if (a == "host-key") req["host_key"] = absolute(c.arg(++i, "a key file"));
      else if (a == "host") req["host"] = c.arg(++i, "a host id");
      else if (a == "tls") req["tls"] = c.arg(++i, "on or off");
      else if (a == "--ublk" || a == "ublk") req["ublk"] = true;
      else if (a == "--ublk-queue-depth") {
        auto n = parse_size(c.arg(++i, "a queue depth"));
        if (!n || *n == 0 || *n > 4096) fail(22, "--ublk-queue-depth: 1..4096");
        req["ublk_queue_depth"] = *n;
      } else if (a.rfind("--", 0) == 0) fail(22, "map: unknown option " + a);
      else servers->push_back(a);
    }
    if (paths.empty()) fail(22, "map: at least one <server> path");
    req["paths"] = paths;
    if (servers == &standby && standby.empty()) fail(22, "map: standby needs at least one <server> path");
    if (!standby.empty()) req["standby_paths"] = standby;
    else if (req.contains("standby_session")) fail(22, "map: standby-session goes with standby <server>");
  } else if (c.object == "device" && cmd == "io") {
    // io <device> [size S] [offset S] [bs S] [qd N] [mode write-verify|write|verify]
    req["device"] = c.arg(0, "<device>");
    for (size_t i = 1; i < c.args.size(); i += 2) {
      const std::string& k = c.args[i];
      const std::string v = c.arg(i + 1, "a value");
      if (k == "mode") {
        req["mode"] = v;
        continue;
      }
      auto n = parse_size(v);
      if (!n || (k != "size" && k != "offset" && k != "bs" && k != "qd")) fail(22, "io: bad '" + k + " " + v + "'");
      req[k] = *n;
    }
  } else if (c.object == "device" && cmd == "export") {
    // export <device> [unix PATH [mode MODE] [group GROUP]] [tcp [HOST:]PORT insecure]
    //        [name NAME] [remote]
    req = json{{"cmd", "nbd_export"}, {"device", c.arg(0, "<device>")}};
    for (size_t i = 1; i < c.args.size(); ++i) {
      const std::string& k = c.args[i];
      if (k == "remote" || k == "insecure") req[k] = true;
      else if (k == "unix" || k == "tcp" || k == "name" || k == "mode" || k == "group") req[k] = c.arg(++i, "a value");
      else if (k == "tls-psk" || k == "tls-cert" || k == "tls-key" || k == "tls-ca")
        req["tls_" + k.substr(4)] = absolute(c.arg(++i, "a file"));  // the daemon's cwd is not ours
      else fail(22, "export: unknown word '" + k + "'");
    }
  } else if (c.object == "device" && cmd == "unexport") {
    req = json{{"cmd", "nbd_unexport"}, {"device", c.arg(0, "<device>")}};
  } else if (c.object == "device" && cmd == "exports") {
    req = json{{"cmd", "nbd_list"}};
  } else if (c.object == "device" && cmd != "list") {
    req["device"] = c.arg(0, "<device>");
    if (cmd == "unmap" && c.args.size() > 1) req["force"] = c.args[1] == "force";
  } else if (cmd == "recover") {
    if (!c.args.empty()) req["session"] = c.args[0];
  } else if (c.object == "session" && cmd != "list") {
    req["session"] = c.arg(0, "<session>");
  } else if (c.object == "path" && cmd == "list") {
    if (!c.args.empty()) req["session"] = c.args[0];
  } else if (c.object == "path") {
    req["session"] = c.arg(0, "<session>");
    req["path"] = c.arg(1, "<path>");
  }
  if (c.object == "device" && cmd == "io") return print_io(c, call(c.socket, req));
  json rsp = c.rpc(req);
  if (rsp.contains("columns")) c.print(listing_from_json(rsp));
  else if (rsp.contains("message")) std::printf("%s\n", str(rsp, "message").c_str());
  return 0;
}

}  // namespace

// `ibnbd migrate ...` is the migration agent, a program of its own (it holds an IBNBD session
// itself instead of talking to a daemon): next to this binary in an install, in the build tree's
// client/migrate/, else on PATH.
[[noreturn]] void exec_migrate(char** argv) {
  std::string self(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  if (n > 0) {
    self.resize(static_cast<size_t>(n));
    const std::string dir = self.substr(0, self.rfind('/'));
    for (const std::string& p : {dir + "/ibnbd-migrate", dir + "/../migrate/ibnbd-migrate"})
      if (::access(p.c_str(), X_OK) == 0) ::execv(p.c_str(), argv);
  }
  ::execvp("ibnbd-migrate", argv);
  fail(2, std::string("cannot run ibnbd-migrate: ") + std::strerror(errno));
}

// ibnbd key generate | show: no daemon involved.
int run_key(const std::vector<std::string>& a) {
  const std::string cmd = a.empty() ? "" : a[0];
  auto arg = [&](size_t i, const char* what) -> const std::string& {
    if (i >= a.size()) fail(22, "key " + cmd + ": missing " + what);
    return a[i];
  };
  if (cmd == "generate") {
    ibtrs::KeyFile k;
    auto transform = ibtrs::Secret::Transform::sha256;
    size_t len = 32;
    bool server_key = false;
    std::string out;
    for (size_t i = 1; i < a.size(); ++i) {
      const std::string& w = a[i];
      if (w == "host") k.host = arg(++i, "a host id");
      else if (w == "hmac") {
        const std::string& v = arg(++i, "0..3");
        if (v.size() != 1 || v[0] < '0' || v[0] > '3') fail(22, "hmac: 0 (none), 1 (SHA-256), 2 (SHA-384), 3 (SHA-512)");
        transform = static_cast<ibtrs::Secret::Transform>(v[0] - '0');
      } else if (w == "length") {
        len = std::strtoul(arg(++i, "32, 48 or 64").c_str(), nullptr, 10);
      } else if (w == "server-key") server_key = true;
      else if (w == "out") out = arg(++i, "a file");
      else fail(22, "key generate: unexpected word '" + w + "'");
    }
    if (k.host.empty()) k.host = ibtrs::generate_host_id();
    if (!ibtrs::valid_host_id(k.host)) fail(22, "host: printable, no spaces, 1..223 bytes");
    auto s = ibtrs::Secret::generate(transform, len);
    if (!s) fail(22, "length: 32, 48 or 64");
    k.key = std::move(*s);
    if (server_key) k.server_key = *ibtrs::Secret::generate(transform, len);
    if (out.empty()) {
      std::fputs(ibtrs::format_key_file(k).c_str(), stdout);
      return 0;
    }
    auto st = ibtrs::save_key_file(out, k);
    if (!st.ok()) fail(st.error().value(), out + ": " + st.error().message());
    std::printf("%s: key of host %s (fingerprint %s)%s\n", out.c_str(), k.host.c_str(), k.key.fingerprint().c_str(),
                server_key ? ", with a server key" : "");
    return 0;
  }
  if (cmd == "show") {
    std::string why;
    auto k = ibtrs::load_key_file(arg(1, "a key file"), &why);
    if (!k) fail(k.error().value(), why);
    std::printf("host        %s\nkey         %s (hmac %d)\nserver-key  %s\n",
                k->host.empty() ? "(none in the file)" : k->host.c_str(), k->key.fingerprint().c_str(),
                static_cast<int>(k->key.transform()),
                k->server_key ? k->server_key->fingerprint().c_str() : "(none)");
    return 0;
  }
  if (cmd == "psk") {
    // key psk IDENTITY [out FILE]: a TLS pre-shared key for NBD exports (psktool's format, which
    // nbdkit --tls-psk and libnbd's tls-psk-file= read).
    auto p = ibtrs::tls::generate_psk(arg(1, "an identity"));
    if (!p) fail(22, "identity: 1..255 printable characters, no spaces");
    if (a.size() > 2) {
      if (a[2] != "out" || a.size() != 4) fail(22, "key psk IDENTITY [out FILE]");
      auto st = ibtrs::tls::write_psk_file(a[3], *p);
      if (!st.ok()) fail(st.error().value(), a[3] + ": " + st.error().message());
      std::printf("%s: TLS PSK of %s\n", a[3].c_str(), p->identity.c_str());
      return 0;
    }
    std::string line = p->identity + ":";
    static const char kHex[] = "0123456789abcdef";
    for (std::byte b : p->key) {
      line += kHex[static_cast<uint8_t>(b) >> 4];
      line += kHex[static_cast<uint8_t>(b) & 15];
    }
    std::puts(line.c_str());
    return 0;
  }
  fail(22, "key generate | key show FILE | key psk IDENTITY [out FILE]\n" + std::string(kUsage));
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == "migrate") {
    argv[1] = const_cast<char*>("ibnbd-migrate");
    exec_migrate(argv + 1);
  }
  if (argc > 1 && std::string_view(argv[1]) == "key") return run_key(std::vector<std::string>(argv + 2, argv + argc));
  Cli c;
  std::vector<std::string> words;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(22, a + " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help" || a == "help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "-f" || a == "--format") {
      auto f = parse_format(value());
      if (!f) fail(22, "--format: table, json or csv");
      c.out.format = *f;
    } else if (a == "-u" || a == "--units") {
      auto u = parse_unit(value());
      if (!u) fail(22, "--units: B, K, M, G, T, P, E or auto");
      c.out.unit = *u;
    } else if (a == "--fields") {
      c.out.fields = value();
    } else if (a == "--noheaders") {
      c.out.headers = false;
    } else if (a == "--socket") {
      c.socket = value();
    } else if (a.size() > 1 && a[0] == '-' && !std::isdigit(static_cast<unsigned char>(a[1])) &&
               a != "--ublk" && a != "--ublk-queue-depth" &&
               !(a[1] != '-' && std::any_of(words.begin(), words.end(),
                                            [](const std::string& x) { return x == "list" || x == "show"; }))) {
      // "-1" is a value (max-reconnect-attempts), --ublk* are device map's own words, "-field"
      // after list/show removes a field (rnbd's selection); anything else with a dash is an
      // option.
      fail(22, "unknown option " + a + " (ibnbd --help lists them)");
    } else {
      words.push_back(a);
    }
  }
  size_t w = 0;
  if (w < words.size() && (words[w] == "client" || words[w] == "server")) c.side = words[w++];
  const bool server_only = c.side == "server" && w < words.size() &&
                           (words[w] == "refusals" || words[w] == "limits" || words[w] == "host" ||
                            words[w] == "io-threads");
  if (w >= words.size())
    fail(22, std::string("expected device, session or path (server: also host, refusals, limits, io-threads)\n") + kUsage);
  if (words[w] != "device" && words[w] != "session" && words[w] != "path" && !server_only)
    fail(22, "unknown word '" + words[w] + "': expected " +
                 (c.side == "server" ? "device, session, path, host, refusals, limits or io-threads"
                                     : "client, server, key, migrate, device, session or path") +
                 " (ibnbd --help lists the commands)");
  c.object = words[w++];
  c.command = w < words.size() ? words[w++] : "list";
  c.args.assign(words.begin() + static_cast<std::ptrdiff_t>(w), words.end());
  // rnbd's positional field selection: `device list devname,state`, `session show s1 -rx_bytes`.
  if ((c.command == "list" || c.command == "show") && !c.args.empty() && is_field_spec(c.args.back())) {
    c.out.fields = c.args.back();
    c.args.pop_back();
  }
  if (c.socket.empty()) c.socket = "/run/ibnbd-" + c.side + ".sock";
  return c.side == "server" ? run_server(c) : run_client(c);
}
