// The crypto glue of host authentication (transport/src/auth): known-answer tests where a
// standard gives vectors (FIPS 180 SHA-256, RFC 4231 HMAC, RFC 7748 X25519, RFC 4648 base64,
// the CRC-32 check value, nvme-cli's documented DHHC-1 secret), then the DHHC-1 secrets, key
// files and the DH-HMAC-CHAP computations of auth/chap.h.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "auth/chap.h"
#include "auth/crypto.h"
#include "ibtrs/auth.h"

namespace ibtrs::auth {
namespace {

std::vector<uint8_t> unhex(std::string_view h) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < h.size(); i += 2)
    out.push_back(static_cast<uint8_t>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16)));
  return out;
}
Bytes bytes_of(std::string_view s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

std::string hmac_hex(Hash h, Bytes key, std::string_view msg) {
  std::vector<uint8_t> out(hash_len(h));
  const Bytes parts[] = {bytes_of(msg)};
  EXPECT_TRUE(hmac(h, key, parts, out).ok());
  return to_hex(out);
}

// ---- known answers ----

TEST(AuthCrypto, Sha256OfAbc) {  // FIPS 180-2, appendix B.1
  uint8_t d[32];
  const Bytes parts[] = {bytes_of("ab"), bytes_of("c")};  // pieces hash as their concatenation
  ASSERT_TRUE(digest(Hash::sha256, parts, d).ok());
  EXPECT_EQ(to_hex(d), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(AuthCrypto, HmacRfc4231) {
  const std::vector<uint8_t> k1(20, 0x0b);
  EXPECT_EQ(hmac_hex(Hash::sha256, k1, "Hi There"),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  const auto jefe = bytes_of("Jefe");
  EXPECT_EQ(hmac_hex(Hash::sha256, jefe, "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hmac_hex(Hash::sha384, jefe, "what do ya want for nothing?"),
            "af45d2e376484031617f78d2b58a6b1b9c7ef464f5a01b47e42ec3736322445e"
            "8e2240ca5e69e2c78b3239ecfab21649");
  EXPECT_EQ(hmac_hex(Hash::sha512, jefe, "what do ya want for nothing?"),
            "164b7a7bfcf819e2e395fbe73b56e0a387bd64222e831fd610270cd7ea250554"
            "9758bf75c05a994a6d034f65f8f0e6fdcaeab1a34d4a6b4b636e070a38bce737");
}

TEST(AuthCrypto, HmacRefusesWrongOutputSizeAndEmptyKey) {
  uint8_t out[31];
  const Bytes parts[] = {bytes_of("x")};
  EXPECT_EQ(hmac(Hash::sha256, bytes_of("k"), parts, out).error(), std::errc::invalid_argument);
  uint8_t ok[32];
  EXPECT_EQ(hmac(Hash::sha256, {}, parts, ok).error(), std::errc::invalid_argument);
}

TEST(AuthCrypto, X25519Rfc7748) {  // RFC 7748 section 6.1
  auto alice = X25519::from_private(unhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"));
  auto bob = X25519::from_private(unhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb"));
  ASSERT_TRUE(alice.ok() && bob.ok());
  EXPECT_EQ(to_hex(alice->public_key()), "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a");
  EXPECT_EQ(to_hex(bob->public_key()), "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f");
  auto z1 = alice->derive(bob->public_key());
  auto z2 = bob->derive(alice->public_key());
  ASSERT_TRUE(z1.ok() && z2.ok());
  EXPECT_EQ(to_hex(*z1), "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742");
  EXPECT_EQ(*z1, *z2);
}

TEST(AuthCrypto, X25519RefusesLowOrderPeer) {
  auto k = X25519::generate();
  ASSERT_TRUE(k.ok());
  const X25519Key zero{};  // the identity: every shared secret with it is zero
  EXPECT_EQ(k->derive(zero).error(), std::errc::invalid_argument);
  EXPECT_EQ(k->derive(std::span<const uint8_t>(zero.data(), 31)).error(), std::errc::invalid_argument);
}

TEST(AuthCrypto, X25519KeysAreFresh) {
  auto a = X25519::generate();
  auto b = X25519::generate();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->public_key(), b->public_key());
}

TEST(AuthCrypto, Crc32CheckValue) {
  EXPECT_EQ(crc32(bytes_of("123456789")), 0xcbf43926u);
  EXPECT_EQ(crc32({}), 0u);
}

TEST(AuthCrypto, Base64Rfc4648) {
  const std::pair<const char*, const char*> v[] = {{"f", "Zg=="},     {"fo", "Zm8="},
                                                   {"foo", "Zm9v"},   {"foob", "Zm9vYg=="},
                                                   {"fooba", "Zm9vYmE="}, {"foobar", "Zm9vYmFy"}};
  for (auto [plain, enc] : v) {
    EXPECT_EQ(base64_encode(bytes_of(plain)), enc);
    auto d = base64_decode(enc);
    ASSERT_TRUE(d.ok()) << enc;
    EXPECT_EQ(std::string(d->begin(), d->end()), plain);
  }
  for (const char* bad : {"", "Zg=", "Z===", "Zm9v\n", "Zm 9", "Zg==Zg==", "Zm9*", "=Zm9"})
    EXPECT_FALSE(base64_decode(bad).ok()) << bad;
}

TEST(AuthCrypto, EqualCt) {
  const uint8_t a[] = {1, 2, 3}, b[] = {1, 2, 3}, c[] = {1, 2, 4};
  EXPECT_TRUE(equal_ct(a, b));
  EXPECT_FALSE(equal_ct(a, c));
  EXPECT_FALSE(equal_ct(a, std::span(b, 2)));
}

TEST(AuthCrypto, RandomBytesDiffer) {
  uint8_t a[32] = {}, b[32] = {};
  ASSERT_TRUE(random_bytes(a).ok());
  ASSERT_TRUE(random_bytes(b).ok());
  EXPECT_FALSE(equal_ct(a, b));
}

// ---- DHHC-1 secrets ----

// The example secret of nvme-cli's and the kernel's documentation (32 bytes, no transform).
constexpr const char* kDocSecret = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";

TEST(AuthSecret, ParsesTheDocumentedSecret) {
  auto s = Secret::parse(std::string("  ") + kDocSecret + "\n");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->transform(), Secret::Transform::none);
  EXPECT_EQ(s->bytes().size(), 32u);
  EXPECT_EQ(s->to_string(), kDocSecret);
}

TEST(AuthSecret, RefusesBadText) {
  std::string flipped = kDocSecret;
  flipped[12] = flipped[12] == 'A' ? 'B' : 'A';  // a key byte changes: the CRC no longer fits
  EXPECT_EQ(Secret::parse(flipped).error(), std::errc::bad_message);
  for (std::string bad : {std::string(""), std::string("DHHC-1:00:"), std::string("DHHC-2:00:ia6z:"),
                          std::string(kDocSecret).substr(0, std::string(kDocSecret).size() - 1),
                          std::string("DHHC-1:04") + std::string(kDocSecret).substr(9),
                          std::string("DHHC-1:0:") + std::string(kDocSecret).substr(10),
                          std::string("DHHC-1:00:Zm9vYmFy:")})  // 6 bytes: too short a key
    EXPECT_EQ(Secret::parse(bad).error(), std::errc::invalid_argument) << bad;
}

TEST(AuthSecret, GenerateRoundTrips) {
  for (auto t : {Secret::Transform::none, Secret::Transform::sha256, Secret::Transform::sha384,
                 Secret::Transform::sha512}) {
    for (size_t len : {32u, 48u, 64u}) {
      auto s = Secret::generate(t, len);
      ASSERT_TRUE(s.ok());
      auto back = Secret::parse(s->to_string());
      ASSERT_TRUE(back.ok());
      EXPECT_TRUE(*back == *s);
      EXPECT_EQ(back->bytes().size(), len);
      EXPECT_EQ(back->fingerprint(), s->fingerprint());
      EXPECT_EQ(s->fingerprint().size(), 16u);
    }
  }
  EXPECT_FALSE(Secret::generate(Secret::Transform::sha256, 33).ok());
  auto a = Secret::generate(), b = Secret::generate();
  EXPECT_FALSE(*a == *b);
  EXPECT_NE(a->fingerprint(), b->fingerprint());
}

TEST(AuthSecret, HostIds) {
  EXPECT_TRUE(valid_host_id("nqn.2024-01.io.example:host-a"));
  EXPECT_FALSE(valid_host_id(""));
  EXPECT_FALSE(valid_host_id("a b"));
  EXPECT_FALSE(valid_host_id(std::string(224, 'a')));
  EXPECT_TRUE(valid_host_id(std::string(223, 'a')));
  const std::string g = generate_host_id();
  EXPECT_TRUE(valid_host_id(g));
  EXPECT_EQ(g.rfind("nqn.2014-08.org.nvmexpress:uuid:", 0), 0u);
  EXPECT_NE(g, generate_host_id());
}

class KeyFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ibtrs-keyfile-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { (void)std::system(("rm -rf " + dir_).c_str()); }
  std::string write(const std::string& name, const std::string& text, mode_t mode) {
    const std::string p = dir_ + "/" + name;
    std::ofstream(p) << text;
    ::chmod(p.c_str(), mode);
    return p;
  }
  std::string dir_;
};

TEST_F(KeyFiles, SaveLoadRoundTrip) {
  KeyFile k;
  k.host = "nqn.2024-01.io.example:host-a";
  k.key = *Secret::generate();
  k.server_key = *Secret::generate(Secret::Transform::sha512, 64);
  const std::string p = dir_ + "/a.key";
  ASSERT_TRUE(save_key_file(p, k).ok());
  struct stat st {};
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(save_key_file(p, k).error(), std::errc::file_exists);
  auto back = load_key_file(p);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->host, k.host);
  EXPECT_TRUE(back->key == k.key);
  ASSERT_TRUE(back->server_key.has_value());
  EXPECT_TRUE(*back->server_key == *k.server_key);
}

TEST_F(KeyFiles, RefusesFilesOthersCanRead) {
  const std::string text = std::string("host h\nkey ") + kDocSecret + "\n";
  std::string why;
  EXPECT_EQ(load_key_file(write("world", text, 0644), &why).error(), std::errc::operation_not_permitted);
  EXPECT_NE(why.find("chmod 600"), std::string::npos) << why;
  EXPECT_EQ(load_key_file(write("other-w", text, 0602)).error(), std::errc::operation_not_permitted);
  EXPECT_TRUE(load_key_file(write("group", text, 0640)).ok());
  EXPECT_TRUE(load_key_file(write("owner", text, 0400)).ok());
}

TEST_F(KeyFiles, BareSecretAndSyntaxErrors) {
  auto bare = load_key_file(write("bare", std::string("# nvme-cli\n") + kDocSecret + "\n", 0600));
  ASSERT_TRUE(bare.ok());
  EXPECT_TRUE(bare->host.empty());
  EXPECT_EQ(bare->key.to_string(), kDocSecret);
  std::string why;
  EXPECT_EQ(load_key_file(write("nokey", "host h\n", 0600), &why).error(), std::errc::invalid_argument);
  EXPECT_EQ(load_key_file(write("word", std::string("colour blue\nkey ") + kDocSecret, 0600), &why).error(),
            std::errc::invalid_argument);
  EXPECT_NE(why.find(":1:"), std::string::npos) << why;
  EXPECT_EQ(load_key_file(write("space", std::string("host a b\nkey ") + kDocSecret, 0600)).error(),
            std::errc::invalid_argument);
  EXPECT_EQ(load_key_file(write("two", std::string("key ") + kDocSecret + "\nkey " + kDocSecret, 0600)).error(),
            std::errc::invalid_argument);
  std::string crc = std::string("key ") + kDocSecret;
  crc[15] = crc[15] == 'A' ? 'B' : 'A';
  EXPECT_EQ(load_key_file(write("crc", crc, 0600)).error(), std::errc::bad_message);
  EXPECT_EQ(load_key_file(dir_ + "/missing").error(), std::errc::no_such_file_or_directory);
  EXPECT_EQ(load_key_file(dir_).error(), std::errc::invalid_argument);
}

// ---- DH-HMAC-CHAP ----

// The reference values were computed with an independent implementation of the formulas in
// auth/chap.h (Python's hmac and hashlib), from RFC 7748's shared secret and the documented
// DHHC-1 secret with the SHA-256 transform.
Transcript reference_transcript() {
  Transcript t;
  t.tid = 0xbeef;
  t.sess_uuid.fill(0x11);
  t.path_uuid.fill(0x22);
  t.sessname = "demo";
  t.pathname = "tcp:127.0.0.1:1@tcp:127.0.0.1:2";
  t.host = "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6";
  return t;
}

TEST(AuthChap, ReferenceValues) {
  const Transcript t = reference_transcript();
  auto doc = Secret::parse(std::string(kDocSecret).replace(8, 1, "1"));  // hh 01: SHA-256 transform
  ASSERT_TRUE(doc.ok());
  auto kh = transform_key(*doc, t.host);
  ASSERT_TRUE(kh.ok());
  EXPECT_EQ(to_hex(*kh), "b9e21c833ba5dbb60ddf4c29b195ac232cd89302646bfdb848bc5b732c93cee5");
  X25519Key z{};
  auto zb = unhex("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742");
  std::copy(zb.begin(), zb.end(), z.begin());
  Nonce c1{}, c2{};
  for (size_t i = 0; i < c1.size(); ++i) {
    c1[i] = static_cast<uint8_t>(i);
    c2[i] = static_cast<uint8_t>(32 + i);
  }
  auto ca = augmented_challenge(z, c1);
  ASSERT_TRUE(ca.ok());
  EXPECT_EQ(to_hex(*ca), "684f8ac855d91fb5b1e119d17581155f52138928717748d1be32cc2a86b4f129");
  auto r1 = host_response(*kh, *ca, 0x01020304, t);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(to_hex(*r1), "51fcc4f9102b1a5870015d9668250aafd7ddb3295f716d4ebf73dea6f6e2c1bd");
  auto r2 = response(Role::server, *doc, z, c2, 0x0a0b0c0d, t);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(to_hex(*r2), "3a0ceefa57ac33e014b160458753f5666a6c27a75bcf0df323e113933fb3ea79");
  auto r1b = response(Role::host, *doc, z, c1, 0x01020304, t);
  ASSERT_TRUE(r1b.ok());
  EXPECT_EQ(*r1b, *r1);
}

TEST(AuthChap, UntransformedKeyIsTheSecret) {
  auto s = Secret::parse(kDocSecret);
  auto k = transform_key(*s, "any host");
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(*k, s->bytes());
  EXPECT_FALSE(transform_key(Secret{}, "h").ok());
}

// Every input of the transcript changes the response: a response proves the secret for one
// challenge, one path of one session and one host only.
TEST(AuthChap, ResponseCoversEveryInput) {
  const Transcript t = reference_transcript();
  auto s = Secret::generate();
  X25519Key z{};
  z.fill(7);
  Nonce c{};
  c.fill(9);
  const Digest base = *response(Role::host, *s, z, c, 1, t);
  auto differs = [&](auto change) {
    Transcript u = t;
    X25519Key zz = z;
    Nonce cc = c;
    uint32_t seq = 1;
    change(u, zz, cc, seq);
    return *response(Role::host, *s, zz, cc, seq, u) != base;
  };
  EXPECT_TRUE(differs([](Transcript&, X25519Key& zz, Nonce&, uint32_t&) { zz[0] ^= 1; }));
  EXPECT_TRUE(differs([](Transcript&, X25519Key&, Nonce& cc, uint32_t&) { cc[31] ^= 1; }));
  EXPECT_TRUE(differs([](Transcript&, X25519Key&, Nonce&, uint32_t& q) { q = 2; }));
  EXPECT_TRUE(differs([](Transcript& u, X25519Key&, Nonce&, uint32_t&) { u.tid ^= 1; }));
  EXPECT_TRUE(differs([](Transcript& u, X25519Key&, Nonce&, uint32_t&) { u.sess_uuid[3] ^= 1; }));
  EXPECT_TRUE(differs([](Transcript& u, X25519Key&, Nonce&, uint32_t&) { u.path_uuid[3] ^= 1; }));
  EXPECT_TRUE(differs([](Transcript& u, X25519Key&, Nonce&, uint32_t&) { u.sessname += "x"; }));
  EXPECT_TRUE(differs([](Transcript& u, X25519Key&, Nonce&, uint32_t&) { u.pathname += "x"; }));
  EXPECT_TRUE(differs([](Transcript& u, X25519Key&, Nonce&, uint32_t&) { u.host += "x"; }));
  // The same values under the other role (reflection) give another answer.
  EXPECT_NE(*response(Role::server, *s, z, c, 1, t), base);
  // And another secret.
  EXPECT_NE(*response(Role::host, *Secret::generate(), z, c, 1, t), base);
}

// Both ends of a real exchange agree; a recorded reply does not answer a new challenge.
TEST(AuthChap, ExchangeAndReplay) {
  const Transcript t = reference_transcript();
  auto key = Secret::generate();
  auto server = X25519::generate();
  auto client = X25519::generate();
  Nonce c1{};
  ASSERT_TRUE(random_bytes(c1).ok());
  auto zc = client->derive(server->public_key());
  auto zs = server->derive(client->public_key());
  ASSERT_TRUE(zc.ok() && zs.ok());
  const Digest r1 = *response(Role::host, *key, *zc, c1, 77, t);
  EXPECT_EQ(*response(Role::host, *key, *zs, c1, 77, t), r1);
  // The server's next exchange: a new ephemeral key and nonce. The old client value and
  // response no longer fit.
  auto server2 = X25519::generate();
  Nonce c1b{};
  ASSERT_TRUE(random_bytes(c1b).ok());
  auto zs2 = server2->derive(client->public_key());
  EXPECT_NE(*response(Role::host, *key, *zs2, c1b, 77, t), r1);
  EXPECT_NE(*response(Role::host, *key, *zs2, c1, 77, t), r1);  // even with the old nonce
}

}  // namespace
}  // namespace ibtrs::auth
