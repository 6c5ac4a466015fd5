#include "auth_target.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "auth/chap.h"
#include "proto/ibtrs_proto.h"

namespace ibtrs::fuzz {
namespace {

using namespace ibtrs::proto;

// Fixed ends of the exchange, so that a run is a function of its input alone.
const auth::X25519& our_dh() {
  static const auth::X25519 k = [] {
    uint8_t priv[32];
    for (int i = 0; i < 32; ++i) priv[i] = static_cast<uint8_t>(0x40 + i);
    return *auth::X25519::from_private(priv);
  }();
  return k;
}
const Secret& our_key() {
  static const Secret s = *Secret::parse("DHHC-1:01:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:");
  return s;
}

template <typename T>
bool same_bytes(const T& m, std::span<const std::byte> msg) {
  return msg.size() == sizeof(T) && std::memcmp(&m, msg.data(), sizeof(T)) == 0;
}

// What a side does with a peer's X25519 value and challenge: derive (a low-order point is
// refused, never used) and answer.
void answer(const std::array<uint8_t, 32>& peer_public, const auth::Nonce& challenge, uint32_t seq,
            uint16_t tid, const std::string& host) {
  auto z = our_dh().derive(peer_public);
  if (!z.ok()) return;
  static constexpr auth::X25519Key kZero{};
  if (*z == kZero) std::abort();  // an all-zero secret must have been refused
  auth::Transcript t;
  t.tid = tid;
  t.sessname = "fuzz";
  t.pathname = "a@b";
  t.host = host.empty() ? "nqn.2014-08.org.example:fuzz" : host;
  if (!auth::response(auth::Role::host, our_key(), *z, challenge, seq, t).ok()) std::abort();
}

// [selector][bytes of m].
std::vector<uint8_t> seed(uint8_t selector, const void* m, size_t len) {
  std::vector<uint8_t> s(1 + len);
  s[0] = selector;
  std::memcpy(s.data() + 1, m, len);
  return s;
}
template <typename T>
std::vector<uint8_t> seed(uint8_t selector, const T& m) {
  return seed(selector, &m, sizeof(m));
}

}  // namespace

// Input: [selector][message bytes].
int auth_one_input(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t which = data[0] % 6;
  std::span<const std::byte> msg(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  std::string why;
  switch (which) {
    case 0: {  // the client receives a challenge
      auto c = parse_auth_challenge(msg, &why);
      if (!c.ok()) break;
      auto back = make_auth_challenge(*c);
      if (!back.ok() || !same_bytes(*back, msg)) std::abort();  // one encoding per message
      answer(c->dh_public, c->nonce, c->seqnum, c->tid, {});
      break;
    }
    case 1: {  // the server receives a reply
      auto r = parse_auth_reply(msg, &why);
      if (!r.ok()) break;
      if (!valid_host_id(r->host)) std::abort();
      auto back = make_auth_reply(*r);
      if (!back.ok() || !same_bytes(*back, msg)) std::abort();
      answer(r->dh_public, auth::Nonce{}, 1, r->tid, r->host);
      break;
    }
    case 2: {
      auto s = parse_auth_success(msg, &why);
      if (s.ok() && !same_bytes(make_auth_success(*s), msg)) std::abort();
      break;
    }
    case 3: {
      auto f = parse_auth_failure(msg, &why);
      if (f.ok() && !same_bytes(make_auth_failure(f->tid, f->reason), msg)) std::abort();
      break;
    }
    case 4: {  // a secret as text (key files, configs, the control socket)
      std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
      auto s = Secret::parse(text);
      if (!s.ok()) break;
      auto again = Secret::parse(s->to_string());
      if (!again.ok() || !(*again == *s)) std::abort();
      break;
    }
    default: {  // any service message, dispatched by its type as the client does
      auto t = peek_msg_type(msg);
      if (!t.ok()) break;
      switch (*t) {
        case MsgType::auth_challenge: (void)parse_auth_challenge(msg, &why); break;
        case MsgType::auth_success: (void)parse_auth_success(msg, &why); break;
        case MsgType::auth_failure: (void)parse_auth_failure(msg, &why); break;
        case MsgType::auth_reply: (void)parse_auth_reply(msg, &why); break;
        default: break;
      }
      break;
    }
  }
  return 0;
}

std::vector<std::vector<uint8_t>> auth_seeds() {
  std::vector<std::vector<uint8_t>> seeds;
  AuthChallengeView c;
  c.tid = 0x1234;
  c.seqnum = 7;
  c.nonce.fill(0x11);
  c.dh_public = our_dh().public_key();
  for (uint8_t sel : {0, 5}) seeds.push_back(seed(sel, *make_auth_challenge(c)));
  AuthReplyView r;
  r.tid = 0x1234;
  r.host = "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6";
  r.dh_public = our_dh().public_key();
  r.response.fill(0x22);
  seeds.push_back(seed(1, *make_auth_reply(r)));
  r.bidirectional = true;
  r.seqnum2 = 9;
  r.challenge2.fill(0x33);
  seeds.push_back(seed(1, *make_auth_reply(r)));
  AuthSuccessView ok;
  ok.tid = 1;
  ok.has_response = true;
  ok.response.fill(0x44);
  seeds.push_back(seed(2, make_auth_success(ok)));
  seeds.push_back(seed(3, make_auth_failure(1, EACCES)));
  for (const char* text : {"DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:",
                           "DHHC-1:03:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:\n"}) {
    seeds.push_back(seed(4, text, std::strlen(text)));
  }
  return seeds;
}

}  // namespace ibtrs::fuzz
