// A small IBNBD server for the client library's tests, until server/ exists: ibtrs::Server, the
// real codec (decode_request, the response encoders, version negotiation), the real access
// rules (proto::OpenTable, check_op_allowed) and RAM volumes. It records every IO it is sent and
// has knobs for the faults the client must survive: fail IO with an errno, hold IO, forget
// every device id (as a restarted server would), refuse OPEN, answer another version. Size
// notices as the real server gives them (WATCH held per session, answered on a resize or any
// path's loss; EBUSY for a second, EPROTO before a version 4 SESS_INFO), with a knob to hold
// the answers back.
//
// Threading: ServerHandler callbacks come from the server's threads; knobs and observers are
// for the test thread. One mutex guards the open table and the session list (access.h allows
// that in place of a single control thread), one the volumes' bytes.
#pragma once

#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ibtrs/server.h"
#include "proto/access.h"
#include "proto/ibnbd_proto.h"

namespace ibnbd::test {

namespace proto = ibnbd::proto;

// What the server saw of one IO request.
struct IoRecord {
  std::string session;
  std::string dev;        // empty when the id was unknown
  proto::Io io;
  bool operator==(const IoRecord&) const = default;
};

class FakeBlockServer final : public ibtrs::ServerHandler {
 public:
  // A sane block device: 512-byte sectors, 1 MiB per READ/WRITE, discard / write-zeroes /
  // secure erase supported, a write-back cache with FUA.
  static DeviceGeometry default_geometry() {
    DeviceGeometry g;
    g.logical_block_size = 512;
    g.physical_block_size = 4096;
    g.max_hw_sectors = 2048;
    g.max_write_zeroes_sectors = 8192;
    g.max_discard_sectors = 8192;
    g.discard_granularity = 4096;
    g.max_segments = 128;
    g.secure_discard = true;
    g.cache_policy = kCacheFua | kCacheWriteBack;
    return g;
  }

  // Exports `name` with `size` bytes (before the server starts).
  void add_device(const std::string& name, uint64_t size, DeviceGeometry geo = default_geometry()) {
    auto d = std::make_unique<Volume>();
    geo.nsectors = size / kSectorSize;
    d->geo = geo;
    d->nsectors.store(geo.nsectors);
    d->mem.resize(size);
    vols_[name] = std::move(d);
  }
  // Exports `alias` as another name of `name`: one volume, one device (as a symlink on the real
  // server), before the server starts.
  void add_alias(const std::string& alias, const std::string& name) { vols_[alias] = vols_.at(name); }
  // Exports `owner`'s volume `name` too, bytes shared (two gateways of one store), before the
  // server starts. Each server keeps its own open table, as two real servers would.
  void share_device(const std::string& name, FakeBlockServer& owner) { vols_[name] = owner.vols_.at(name); }

  // ---- ServerHandler --------------------------------------------------------------------------
  // The transport opens a path for IO before it announces the session (the client's first
  // request may race on_session_up), so the session's state is found or made on first use
  // rather than kept in ServerSession::context.
  void on_session_up(ibtrs::ServerSession& s) override {
    std::lock_guard l(mu_);
    (void)sess_locked(s);
  }
  void on_session_down(ibtrs::ServerSession& s) override {
    std::lock_guard l(mu_);
    auto it = sessions_.find(&s);
    if (it == sessions_.end()) return;
    (void)table_.end_session(it->second->id);
    sessions_.erase(it);
  }
  void on_path_up(ibtrs::ServerSession& s, const ibtrs::ServerPathInfo&) override {
    std::lock_guard l(mu_);
    ++sess_locked(s).paths;
  }
  // A session without paths is over for its client (a reconnect makes a new one): release what
  // it held now, not when its last held request completes, or its writer slots would refuse the
  // client's own re-open.
  // Any path's loss lets go of the session's WATCH (as the real server: the transport re-sends
  // a lost path's request into the same chunk, where it waits for the old copy).
  void on_path_down(ibtrs::ServerSession& s, const ibtrs::ServerPathInfo&) override {
    ibtrs::ServerRequest* w = nullptr;
    std::vector<std::byte> rsp;
    {
      std::lock_guard l(mu_);
      Sess& c = sess_locked(s);
      w = take_watch_locked(c, true, rsp);
      if (--c.paths == 0) (void)table_.end_session(c.id);
    }
    complete_watch(w, rsp);
  }

  void on_request(ibtrs::ServerRequest& r) override {
    requests_.fetch_add(1);
    auto m = proto::decode_request(r.usr(), proto::Carrier{r.dir(), r.data().size()});
    if (!m.ok()) return r.complete(m.error().value());
    Sess* sess = nullptr;
    {
      std::lock_guard l(mu_);
      sess = &sess_locked(r.session());
    }
    switch (m->type) {
      case proto::MsgType::sess_info: return sess_info(r, *sess, m->sess_info);
      case proto::MsgType::open: return open(r, *sess, m->open);
      case proto::MsgType::close: return close(r, *sess, m->close);
      case proto::MsgType::io: return io(r, *sess, m->io);
      case proto::MsgType::watch: return watch(r, *sess, m->watch);
      default: return r.complete(EBADMSG);
    }
  }

  // ---- knobs ------------------------------------------------------------------------------------
  // Called for every IO of a known device before it is served; a non-zero errno fails it.
  void set_io_fault(std::function<int(const proto::Io&)> f) {
    std::lock_guard l(mu_);
    io_fault_ = std::move(f);
  }
  // Held IO waits until release_held() serves it or drop_held() fails it unserved.
  void hold_io(bool on) { hold_.store(on); }
  size_t held() {
    std::lock_guard l(mu_);
    return held_.size();
  }
  void release_held() {
    for (auto& h : take_held()) serve(*h.req, h.vol, h.io);
  }
  // As a crashed server: the held requests are answered with `err` and change nothing.
  void drop_held(int err) {
    for (auto& h : take_held()) h.req->complete(err);
  }
  // As after a restart: every live session loses its device ids and holds nothing.
  void forget_ids() {
    std::lock_guard l(mu_);
    for (auto& [key, c] : sessions_) {
      (void)table_.end_session(c->id);
      c->id = next_id_++;
    }
  }
  void refuse_open(int err) { refuse_open_.store(err); }
  // BLOCK_STATUS answers these bytes instead of the volume's extents (a hostile server).
  void answer_status_with(std::vector<std::byte> raw) {
    std::lock_guard l(mu_);
    status_raw_ = std::move(raw);
  }
  // Answers SESS_INFO with this version instead of negotiating.
  void answer_version(std::optional<uint8_t> v) {
    std::lock_guard l(mu_);
    version_ = v;
  }
  // The volume (and every alias and share of it) is `size` bytes from now on: IO is checked
  // against the new size, and the sessions that hold it are told (their WATCH answered, unless
  // hold_notices). Another server sharing the volume tells its own with notify_resized.
  void resize(const std::string& name, uint64_t size) {
    Volume& v = *vols_.at(name);
    {
      std::lock_guard l(v.mu);
      v.mem.resize(size);
      v.nsectors.store(size / kSectorSize);
    }
    notify_resized(name);
  }
  void notify_resized(const std::string& name) {
    std::vector<std::pair<ibtrs::ServerRequest*, std::vector<std::byte>>> done;
    {
      std::lock_guard l(mu_);
      for (const auto& h : table_.holders(file_of(name))) {
        for (auto& [key, c] : sessions_) {
          if (c->id != h.session) continue;
          c->epoch = ++next_epoch_;
          if (hold_notices_.load()) continue;
          std::vector<std::byte> rsp;
          if (auto* w = take_watch_locked(*c, false, rsp)) done.emplace_back(w, std::move(rsp));
        }
      }
    }
    for (auto& [w, rsp] : done) complete_watch(w, rsp);
  }
  // Resizes change the epochs but leave held WATCHes unanswered (until a path goes down); a
  // WATCH that arrives with an older epoch is still answered at once.
  void hold_notices(bool on) { hold_notices_.store(on); }
  size_t held_watches() {
    std::lock_guard l(mu_);
    size_t n = 0;
    for (auto& [key, c] : sessions_) n += c->watch != nullptr;
    return n;
  }

  // ---- observers ----------------------------------------------------------------------------------
  std::vector<IoRecord> ios() {
    std::lock_guard l(mu_);
    return ios_;
  }
  size_t io_count() {
    std::lock_guard l(mu_);
    return ios_.size();
  }
  std::vector<proto::Holder> holders(const std::string& dev) {
    std::lock_guard l(mu_);
    return table_.holders(file_of(dev));
  }
  // The volume's bytes (copy, taken under the lock).
  std::vector<std::byte> bytes(const std::string& dev, uint64_t off, size_t len) {
    Volume& v = *vols_.at(dev);
    std::lock_guard l(v.mu);
    return {v.mem.begin() + static_cast<ptrdiff_t>(off), v.mem.begin() + static_cast<ptrdiff_t>(off + len)};
  }
  void fill(const std::string& dev, uint64_t off, size_t len, std::byte b) {
    Volume& v = *vols_.at(dev);
    std::lock_guard l(v.mu);
    std::memset(v.mem.data() + off, static_cast<int>(b), len);
  }
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> opens_{0};
  std::atomic<uint64_t> reopens_{0};  // OPENs with kOpenReopen (remaps of a device held before)
  std::atomic<uint64_t> closes_{0};
  std::atomic<uint64_t> sess_infos_{0};
  std::atomic<uint64_t> watches_{0};       // WATCH requests (re-sent copies included)
  std::atomic<uint64_t> watches_busy_{0};  // refused: the session had one held
  std::atomic<uint64_t> watches_early_{0}; // refused: no version 4 SESS_INFO (yet)

 private:
  struct Volume {
    DeviceGeometry geo;                  // nsectors as added; the size now is `nsectors`
    std::atomic<uint64_t> nsectors{0};
    std::mutex mu;
    std::vector<std::byte> mem;
  };
  struct Sess {
    proto::SessionId id;
    std::string name;
    int paths;
    uint8_t version = 0;
    uint64_t epoch = 0;
    ibtrs::ServerRequest* watch = nullptr;
    uint64_t watch_seen = 0;
  };
  struct Held {
    ibtrs::ServerRequest* req;
    Volume* vol;
    proto::Io io;
  };

  Sess& sess_locked(ibtrs::ServerSession& s) {
    auto& c = sessions_[&s];
    if (!c) {
      c = std::make_unique<Sess>(Sess{next_id_++, s.name(), 0});
      c->epoch = ++next_epoch_;
    }
    return *c;
  }

  void watch(ibtrs::ServerRequest& r, Sess& s, const proto::Watch& m) {
    watches_.fetch_add(1);
    std::vector<std::byte> rsp;
    ibtrs::ServerRequest* w = nullptr;
    {
      std::lock_guard l(mu_);
      if (s.version < proto::kWatchVersion) {
        watches_early_.fetch_add(1);
        return r.complete(EPROTO);
      }
      if (s.watch != nullptr) {
        watches_busy_.fetch_add(1);
        return r.complete(EBUSY);
      }
      s.watch = &r;
      s.watch_seen = m.epoch;
      w = take_watch_locked(s, false, rsp);  // at once when the epoch differs (hold_notices or not)
    }
    complete_watch(w, rsp);
  }

  // The session's held WATCH and its answer, when it is due (`release`: always). The caller
  // completes it after unlocking (complete_watch).
  ibtrs::ServerRequest* take_watch_locked(Sess& s, bool release, std::vector<std::byte>& out) {
    if (s.watch == nullptr || (!release && s.watch_seen == s.epoch)) return nullptr;
    proto::WatchRsp rsp;
    rsp.epoch = s.epoch;
    for (const auto& o : table_.devices_of(s.id)) {
      if (o.force_closed) continue;
      rsp.entries.push_back(proto::WatchEntry{o.device_id, vols_.at(o.dev)->nsectors.load()});
    }
    rsp.total = static_cast<uint32_t>(rsp.entries.size());
    ibtrs::ServerRequest* w = std::exchange(s.watch, nullptr);
    out.resize(w->data().size());
    auto n = proto::encode_watch_rsp(out, rsp);
    out.resize(n.ok() ? *n : 0);
    return w;
  }
  static void complete_watch(ibtrs::ServerRequest* w, const std::vector<std::byte>& rsp) {
    if (w == nullptr) return;
    if (rsp.empty()) return w->complete(EINVAL);
    std::memcpy(w->data().data(), rsp.data(), rsp.size());
    w->complete(0);
  }

  std::vector<Held> take_held() {
    std::lock_guard l(mu_);
    return std::exchange(held_, {});
  }

  void sess_info(ibtrs::ServerRequest& r, Sess& s, const proto::SessInfo& m) {
    sess_infos_.fetch_add(1);
    std::optional<uint8_t> forced;
    {
      std::lock_guard l(mu_);
      forced = version_;
    }
    if (forced) {
      // Written by hand: our encoder refuses versions we do not speak, and that is the point.
      proto::SessInfoRspMsg w{};
      w.hdr.type.set(static_cast<uint16_t>(proto::MsgType::sess_info_rsp));
      w.ver = *forced;
      std::memcpy(r.data().data(), &w, sizeof(w));
      {
        std::lock_guard l(mu_);
        s.version = *forced;
      }
      return r.complete(0);
    }
    auto v = proto::negotiate_version(m.ver);
    if (!v.ok()) return r.complete(v.error().value());
    auto n = proto::encode_sess_info_rsp(r.data(), proto::SessInfoRsp{*v});
    if (n.ok()) {
      std::lock_guard l(mu_);
      s.version = *v;
    }
    r.complete(n.ok() ? 0 : n.error().value());
  }

  void open(ibtrs::ServerRequest& r, Sess& s, const proto::Open& m) {
    opens_.fetch_add(1);
    if (m.flags & proto::kOpenReopen) reopens_.fetch_add(1);
    if (int e = refuse_open_.load()) return r.complete(e);
    auto it = vols_.find(m.dev_name);
    if (it == vols_.end()) return r.complete(ENOENT);
    Result<proto::OpenTable::Grant> g = errc(EINVAL);
    proto::OpenRsp rsp;
    {
      std::lock_guard l(mu_);
      g = table_.open(s.id, file_of(m.dev_name), m.dev_name, m.mode);
      rsp.size_epoch = s.version >= proto::kWatchVersion ? s.epoch : 0;
    }
    if (!g.ok()) return r.complete(g.error().value());
    rsp.device_id = g->device_id;
    rsp.geo = it->second->geo;
    rsp.geo.nsectors = it->second->nsectors.load();
    auto n = proto::encode_open_rsp(r.data(), rsp);
    r.complete(n.ok() ? 0 : n.error().value());
  }

  void close(ibtrs::ServerRequest& r, Sess& s, const proto::Close& m) {
    closes_.fetch_add(1);
    std::lock_guard l(mu_);
    auto rel = table_.close(s.id, m.device_id);
    r.complete(rel.ok() ? 0 : rel.error().value());
  }

  void io(ibtrs::ServerRequest& r, Sess& s, const proto::Io& m) {
    std::function<int(const proto::Io&)> fault;
    Result<proto::Opening> o = errc(ENODEV);
    {
      std::lock_guard l(mu_);
      o = table_.lookup(s.id, m.device_id);
      ios_.push_back(IoRecord{s.name, o.ok() ? o->dev : std::string(), m});
      fault = io_fault_;
    }
    if (!o.ok()) return r.complete(o.error().value());
    if (auto st = proto::check_op_allowed(o->mode, m.op); !st.ok()) return r.complete(st.error().value());
    Volume* v = vols_.at(o->dev).get();
    const uint64_t nsectors = v->nsectors.load();
    if (m.sector > nsectors || m.bi_size / kSectorSize > nsectors - m.sector) return r.complete(EINVAL);
    if (fault) {
      if (int e = fault(m)) return r.complete(e);
    }
    if (hold_.load()) {
      std::lock_guard l(mu_);
      held_.push_back(Held{&r, v, m});
      return;
    }
    if (m.op == IoOp::block_status) {
      std::lock_guard l(mu_);
      if (!status_raw_.empty()) {
        std::memcpy(r.data().data(), status_raw_.data(), std::min(status_raw_.size(), r.data().size()));
        return r.complete(0);
      }
    }
    serve(r, v, m);
  }

  static void serve(ibtrs::ServerRequest& r, Volume* v, const proto::Io& m) {
    const size_t off = m.sector * kSectorSize;
    std::lock_guard l(v->mu);
    if (off + m.bi_size > v->mem.size()) return r.complete(EIO);  // shrunk since it was checked
    switch (m.op) {
      case IoOp::read: std::memcpy(r.data().data(), v->mem.data() + off, m.bi_size); break;
      case IoOp::write: std::memcpy(v->mem.data() + off, r.data().data(), m.bi_size); break;
      case IoOp::flush: break;
      // A RAM volume reads zeroes after a discard, like a thinly provisioned one.
      case IoOp::discard:
      case IoOp::secure_erase:
      case IoOp::write_zeroes: std::memset(v->mem.data() + off, 0, m.bi_size); break;
      case IoOp::block_status: return r.complete(status(r, *v, off, m.bi_size));
    }
    r.complete(0);
  }

  // A RAM volume's holes: its 4 KiB blocks of zeros (as a thinly provisioned store that unmaps
  // what is discarded), at most kMaxExtents extents over a prefix of the range.
  static int status(ibtrs::ServerRequest& r, const Volume& v, size_t off, uint32_t len) {
    Extent e[kMaxExtents];
    uint32_t n = 0;
    for (size_t pos = 0; pos < len;) {
      const size_t step = std::min<size_t>(4096 - (off + pos) % 4096, len - pos);
      const std::byte* p = v.mem.data() + off + pos;
      const uint32_t f = std::all_of(p, p + step, [](std::byte b) { return b == std::byte{0}; })
                             ? kExtentHole | kExtentZero : 0u;
      if (n > 0 && e[n - 1].flags == f) {
        e[n - 1].length += step;
      } else if (n == kMaxExtents) {
        break;
      } else {
        e[n++] = Extent{step, f};
      }
      pos += step;
    }
    auto w = proto::encode_block_status_rsp(r.data(), std::span<const Extent>(e, n), len);
    return w.ok() ? 0 : w.error().value();
  }

  // One volume is one store: its address is its identity, whatever name it is opened by.
  FileId file_of(const std::string& name) const {
    return FileId{false, 0, reinterpret_cast<uintptr_t>(vols_.at(name).get()), {}};
  }

  std::map<std::string, std::shared_ptr<Volume>> vols_;  // fixed once the server runs
  std::mutex mu_;
  proto::OpenTable table_;
  proto::SessionId next_id_ = 1;
  // Live sessions by the server's object (erased at on_session_down, before it is freed).
  std::map<const ibtrs::ServerSession*, std::unique_ptr<Sess>> sessions_;
  std::vector<IoRecord> ios_;
  std::vector<Held> held_;
  std::function<int(const proto::Io&)> io_fault_;
  std::optional<uint8_t> version_;
  std::vector<std::byte> status_raw_;
  std::atomic<bool> hold_{false};
  std::atomic<int> refuse_open_{0};
  std::atomic<bool> hold_notices_{false};
  uint64_t next_epoch_ = 1000;  // under mu_
};

}  // namespace ibnbd::test
