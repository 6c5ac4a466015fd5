// The fixed newstyle handshake (spec "Handshake", "Fixed newstyle negotiation", "Option types"):
// greeting, client flags, then options until EXPORT_NAME or a successful GO enters the
// transmission phase, or ABORT ends the session.
#include <cstring>

#include "server_impl.h"

namespace ibnbd::nbd {

namespace {

using namespace wire;

uint32_t rd32(const std::byte* p) {
  be32 v;
  std::memcpy(&v, p, 4);
  return v.get();
}
uint16_t rd16(const std::byte* p) {
  be16 v;
  std::memcpy(&v, p, 2);
  return v.get();
}

template <typename T>
void append(std::string& out, const T& wire_struct) {
  out.append(reinterpret_cast<const char*>(&wire_struct), sizeof(T));
}

// Spec "Conventions": strings are UTF-8 without NUL, at most 4096 bytes.
bool valid_string(std::string_view s) {
  return s.size() <= kMaxString && s.find('\0') == std::string_view::npos;
}

}  // namespace

void NbdServer::Impl::greet(Conn& c) {
  ServerGreeting g;
  g.nbd_magic.set(kNbdMagic);
  g.opt_magic.set(kOptMagic);
  g.flags.set(kFlagFixedNewstyle | kFlagNoZeroes);
  append(c.hs_out, g);
}

bool NbdServer::Impl::parse_handshake(Conn& c) {
  const std::byte* p = c.in.data() + c.in_beg;
  const size_t avail = c.in_end - c.in_beg;
  switch (c.phase) {
    case Conn::Phase::client_flags: {
      if (avail < 4) return false;
      const uint32_t flags = rd32(p);
      c.in_beg += 4;
      // "the server MUST drop the TCP connection if the client sets an unknown flag".
      if (flags & ~kClientKnownFlags) {
        fail(c, "unknown client flags " + std::to_string(flags), true);
        return false;
      }
      c.fixed_newstyle = flags & kClientFixedNewstyle;
      c.no_zeroes = flags & kClientNoZeroes;
      c.phase = Conn::Phase::option;
      return true;
    }
    case Conn::Phase::option: {
      if (avail < sizeof(OptionHdr)) return false;
      OptionHdr h;
      std::memcpy(&h, p, sizeof(h));
      if (h.magic.get() != kOptMagic) {
        fail(c, "bad option magic (not an NBD client?)", true);
        return false;
      }
      if (++c.options > kMaxOptions) {
        fail(c, "too many options", true);
        return false;
      }
      const uint32_t opt = h.option.get(), len = h.length.get();
      if (len > kMaxOptionLen) {
        c.in_beg += sizeof(h);
        if (len > kMaxOptionSkip) {
          fail(c, "option of " + std::to_string(len) + " bytes", true);
          return false;
        }
        c.skip_option = opt;
        c.skip_left = len;
        c.phase = Conn::Phase::option_skip;
        return true;
      }
      if (avail < sizeof(h) + len) return false;
      c.in_beg += sizeof(h) + len;
      handle_option(c, opt, p + sizeof(h), len);
      return true;
    }
    case Conn::Phase::option_skip: {
      const size_t n = std::min<uint64_t>(avail, c.skip_left);
      c.in_beg += n;
      c.skip_left -= n;
      if (c.skip_left > 0) return false;
      c.phase = Conn::Phase::option;
      option_error(c, c.skip_option, kRepErrTooBig, "option too large");
      return true;
    }
    case Conn::Phase::transmission:
      return false;
  }
  return false;
}

void NbdServer::Impl::option_reply(Conn& c, uint32_t opt, uint32_t type, const void* data, size_t len) {
  OptionReplyHdr h;
  h.magic.set(kRepMagic);
  h.option.set(opt);
  h.type.set(type);
  h.length.set(static_cast<uint32_t>(len));
  append(c.hs_out, h);
  if (len > 0) c.hs_out.append(static_cast<const char*>(data), len);
}

void NbdServer::Impl::option_error(Conn& c, uint32_t opt, uint32_t type, std::string_view msg) {
  // "All error replies MAY have some data set, in which case that data is an error message
  // string suitable for display to the user."
  option_reply(c, opt, type, msg.data(), msg.size());
}

std::pair<const std::string*, Export*> NbdServer::Impl::find_export(std::string_view name) const {
  for (auto& [n, e] : opts.exports)
    if (n == name) return {&n, e.get()};
  // The empty name is the "default" export (spec, NBD_OPT_EXPORT_NAME).
  if (name.empty()) return {&opts.exports.front().first, opts.exports.front().second.get()};
  return {nullptr, nullptr};
}

uint16_t NbdServer::Impl::transmission_flags(const ExportInfo& i, bool structured) {
  uint16_t f = kTxHasFlags | kTxSendFlush | kTxSendFua | kTxSendCache;
  if (i.read_only) {
    f |= kTxReadOnly;
  } else {
    if (i.can_trim) f |= kTxSendTrim;
    // FAST_ZERO goes with WRITE_ZEROES: an export that cannot zero fast fails those requests
    // quickly with ENOTSUP, which is what the flag promises (spec, NBD_CMD_WRITE_ZEROES).
    if (i.can_write_zeroes) f |= kTxSendWriteZeroes | kTxSendFastZero;
  }
  // Every READ is answered with one content chunk, so DF is always honoured; the flag MUST stay
  // clear without structured replies (spec, NBD_FLAG_SEND_DF).
  if (structured) f |= kTxSendDf;
  if (i.multi_conn) f |= kTxCanMultiConn;
  return f;
}

void NbdServer::Impl::enter_transmission(Conn& c, Export* e) {
  c.exp = e;
  c.info = e->info();
  auto pool = pools.find(e);
  c.pool = pool == pools.end() ? nullptr : &pool->second;
  c.tx_flags = transmission_flags(c.info, c.structured);
  // Contexts selected for another export do not carry over.
  if (c.meta_base_allocation && find_export(c.meta_export).second != e) c.meta_base_allocation = false;
  c.phase = Conn::Phase::transmission;
}

void NbdServer::Impl::handle_option(Conn& c, uint32_t opt, const std::byte* data, uint32_t len) {
  // FORCEDTLS: "the server MUST respond to any option other than NBD_OPT_STARTTLS, NBD_OPT_ABORT
  // [and NBD_OPT_EXPORT_NAME] with NBD_REP_ERR_TLS_REQD"; EXPORT_NAME cannot be answered, so the
  // connection is dropped.
  if (opts.tls_required && !c.tls_on() && opt != kOptStartTls && opt != kOptAbort) {
    if (opt == kOptExportName) return fail(c, "NBD_OPT_EXPORT_NAME before STARTTLS on a TLS-only export", false);
    return option_error(c, opt, kRepErrTlsReqd, "this server requires TLS: use NBD_OPT_STARTTLS");
  }
  switch (opt) {
    case kOptExportName: {
      const std::string_view name(reinterpret_cast<const char*>(data), len);
      auto [n, e] = find_export(name);
      if (e == nullptr || !valid_string(name)) {
        // "If the chosen export does not exist ... the server MUST terminate the session":
        // this option has no way to say no.
        fail(c, "NBD_OPT_EXPORT_NAME of an unknown export", false);
        return;
      }
      c.info = e->info();
      ExportNameReply r;
      r.size.set(c.info.size);
      r.flags.set(transmission_flags(c.info, c.structured));
      append(c.hs_out, r);
      if (!c.no_zeroes) c.hs_out.append(kExportNameZeroes, '\0');
      enter_transmission(c, e);
      return;
    }
    case kOptAbort:
      // "The server MUST reply with NBD_REP_ACK"; the client then drops the connection, and we
      // close once the ACK is out (or the client is gone).
      option_reply(c, opt, kRepAck);
      c.rx_closed = true;
      return;
    case kOptList:
      if (len != 0) return option_error(c, opt, kRepErrInvalid, "NBD_OPT_LIST takes no data");
      for (auto& [name, e] : opts.exports) {
        std::string payload(4, '\0');
        be32 l;
        l.set(static_cast<uint32_t>(name.size()));
        std::memcpy(payload.data(), &l, 4);
        payload += name;
        option_reply(c, opt, kRepServer, payload.data(), payload.size());
      }
      option_reply(c, opt, kRepAck);
      return;
    case kOptStartTls:
      // NOTLS mode: "it MUST respond with NBD_REP_ERR_POLICY ... NBD_REP_ERR_UNSUP".
      if (!opts.tls) return option_error(c, opt, kRepErrUnsup, "TLS is not supported by this server");
      if (len != 0) return option_error(c, opt, kRepErrInvalid, "NBD_OPT_STARTTLS takes no data");
      // "If the server receives NBD_OPT_STARTTLS after TLS has already been negotiated, it
      // MUST reply with NBD_REP_ERR_INVALID."
      if (c.tls != nullptr) return option_error(c, opt, kRepErrInvalid, "TLS is already on");
      option_reply(c, opt, kRepAck);
      c.starttls = true;  // the handshake starts once the ACK has left (flush_out)
      return;
    case kOptInfo:
    case kOptGo:
      return handle_info(c, opt, data, len);
    case kOptStructuredReply:
      if (len != 0) return option_error(c, opt, kRepErrInvalid, "NBD_OPT_STRUCTURED_REPLY takes no data");
      c.structured = true;
      option_reply(c, opt, kRepAck);
      return;
    case kOptListMetaContext:
    case kOptSetMetaContext:
      return handle_meta(c, opt, data, len);
    default:
      return option_error(c, opt, kRepErrUnsup, "option not supported");
  }
}

// NBD_OPT_INFO / NBD_OPT_GO: u32 name length, name, u16 number of requests, u16 requests.
void NbdServer::Impl::handle_info(Conn& c, uint32_t opt, const std::byte* data, uint32_t len) {
  if (len < 6) return option_error(c, opt, kRepErrInvalid, "short NBD_OPT_INFO/GO");
  const uint32_t name_len = rd32(data);
  if (name_len > len - 6) return option_error(c, opt, kRepErrInvalid, "bad export name length");
  const std::string_view name(reinterpret_cast<const char*>(data + 4), name_len);
  const uint16_t nreq = rd16(data + 4 + name_len);
  if (size_t{4} + name_len + 2 + size_t{2} * nreq != len)
    return option_error(c, opt, kRepErrInvalid, "bad number of information requests");
  if (!valid_string(name)) return option_error(c, opt, kRepErrInvalid, "bad export name");
  bool want_name = false, want_description = false;  // block sizes are always sent
  for (uint16_t i = 0; i < nreq; ++i) {
    // "The server MUST ignore any information requests it does not understand."
    switch (rd16(data + 4 + name_len + 2 + 2 * size_t{i})) {
      case kInfoName: want_name = true; break;
      case kInfoDescription: want_description = true; break;
      default: break;
    }
  }
  auto [n, e] = find_export(name);
  if (e == nullptr) return option_error(c, opt, kRepErrUnknown, "no such export");
  const ExportInfo info = e->info();
  // Requests must be aligned to min_block: there is no read-modify-write, a misaligned request
  // fails with EINVAL (nothing is written). A GO that did not ask for block sizes is still
  // accepted (the spec lets the server refuse it with NBD_REP_ERR_BLOCK_SIZE_REQD): the kernel's
  // nbd-client never asks, aligns to its -b block size, and could not use a 4 KiB volume at all
  // otherwise. NBD_OPT_EXPORT_NAME clients are served the same way.
  if (want_name) {
    std::string p(2, '\0');
    be16 t;
    t.set(kInfoName);
    std::memcpy(p.data(), &t, 2);
    p += *n;
    option_reply(c, opt, kRepInfo, p.data(), p.size());
  }
  if (want_description && !info.description.empty()) {
    std::string p(2, '\0');
    be16 t;
    t.set(kInfoDescription);
    std::memcpy(p.data(), &t, 2);
    p += info.description.substr(0, kMaxString);
    option_reply(c, opt, kRepInfo, p.data(), p.size());
  }
  // Block sizes are sent even when not asked for (as qemu-nbd does): a client that does not
  // understand them ignores them, and one that does learns our alignment.
  InfoBlockSize bs;
  bs.type.set(kInfoBlockSize);
  bs.minimum.set(info.min_block);
  bs.preferred.set(info.preferred_block);
  bs.maximum.set(info.max_payload);
  option_reply(c, opt, kRepInfo, &bs, sizeof(bs));
  // NBD_INFO_EXPORT: "The server MUST send this info reply" to INFO and GO.
  InfoExport ie;
  ie.type.set(kInfoExport);
  ie.size.set(info.size);
  ie.flags.set(transmission_flags(info, c.structured));
  option_reply(c, opt, kRepInfo, &ie, sizeof(ie));
  option_reply(c, opt, kRepAck);
  if (opt == kOptGo) enter_transmission(c, e);
}

// NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT: u32 export name length, name, u32 number
// of queries, then each query as u32 length + string. The only context is base:allocation.
void NbdServer::Impl::handle_meta(Conn& c, uint32_t opt, const std::byte* data, uint32_t len) {
  // "This option MUST NOT be requested unless structured replies have been negotiated first.
  // If a client attempts to do so, a server SHOULD send NBD_REP_ERR_INVALID."
  if (!c.structured) return option_error(c, opt, kRepErrInvalid, "negotiate structured replies first");
  if (len < 8) return option_error(c, opt, kRepErrInvalid, "short meta context option");
  const uint32_t name_len = rd32(data);
  if (name_len > len - 8) return option_error(c, opt, kRepErrInvalid, "bad export name length");
  const std::string_view name(reinterpret_cast<const char*>(data + 4), name_len);
  const uint32_t nq = rd32(data + 4 + name_len);
  size_t pos = size_t{8} + name_len;
  bool match = nq == 0 && opt == kOptListMetaContext;  // LIST with no query: every context
  for (uint32_t i = 0; i < nq; ++i) {
    if (len - pos < 4) return option_error(c, opt, kRepErrInvalid, "truncated query");
    const uint32_t ql = rd32(data + pos);
    pos += 4;
    if (ql > len - pos) return option_error(c, opt, kRepErrInvalid, "truncated query");
    const std::string_view q(reinterpret_cast<const char*>(data + pos), ql);
    pos += ql;
    if (q == "base:allocation" || (opt == kOptListMetaContext && q == "base:")) match = true;
  }
  if (pos != len) return option_error(c, opt, kRepErrInvalid, "trailing bytes after the queries");
  if (!valid_string(name)) return option_error(c, opt, kRepErrInvalid, "bad export name");
  if (find_export(name).second == nullptr) return option_error(c, opt, kRepErrUnknown, "no such export");
  if (match) {
    static constexpr std::string_view kCtx = "base:allocation";
    char p[4 + kCtx.size()];
    be32 id;
    // "The metadata context ID in these replies is reserved [for LIST] and SHOULD be set to 0."
    id.set(opt == kOptSetMetaContext ? kBaseAllocationId : 0);
    std::memcpy(p, &id, 4);
    std::memcpy(p + 4, kCtx.data(), kCtx.size());
    option_reply(c, opt, kRepMetaContext, p, sizeof(p));
  }
  if (opt == kOptSetMetaContext) {
    c.meta_base_allocation = match;
    c.meta_export = std::string(name);
  }
  option_reply(c, opt, kRepAck);
}

}  // namespace ibnbd::nbd
