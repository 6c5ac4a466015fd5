// Server-side access rules (blockdev/src/proto/access.h): every mode against every set of
// existing holders, re-open, close, force_close, device ids per session, and session ends.
#include <gtest/gtest.h>

#include <functional>
#include <string_view>
#include <vector>

#include "proto/access.h"

namespace ibnbd::proto {
namespace {

constexpr AccessMode kRo = AccessMode::ro;
constexpr AccessMode kRw = AccessMode::rw;
constexpr AccessMode kMig = AccessMode::migration;

template <typename T>
int err_of(const Result<T>& r) {
  return r.ok() ? 0 : r.error().value();
}

// The stores of these tests: one file per name, except where a test makes aliases itself.
FileId fid(std::string_view name) { return FileId{false, 1, std::hash<std::string_view>{}(name), {}}; }

// ------------------------------------------------------------------------------------------
// DeviceOpeners: the rules

struct RuleCase {
  const char* existing_name;
  std::vector<AccessMode> existing;  // holders before, sessions 1, 2, ...
  AccessMode asked;                  // by a new session
  int expect;                        // 0 or errno
};

// Case: a new session asks ro, rw or migration while the device is held by nobody, by readers,
// by one rw writer, by one migration writer, by an rw and a migration writer, or by two
// migration writers. Expect: ro always; rw only without a writer; migration while writers < 2.
TEST(DeviceOpeners, EveryModeAgainstEveryHolderSet) {
  const std::vector<RuleCase> cases = {
      {"nobody", {}, kRo, 0},
      {"nobody", {}, kRw, 0},
      {"nobody", {}, kMig, 0},
      {"ro", {kRo}, kRo, 0},
      {"ro", {kRo}, kRw, 0},
      {"ro", {kRo}, kMig, 0},
      {"ro ro", {kRo, kRo}, kRw, 0},
      {"rw", {kRw}, kRo, 0},
      {"rw", {kRw}, kRw, EBUSY},
      {"rw", {kRw}, kMig, 0},
      {"migration", {kMig}, kRo, 0},
      {"migration", {kMig}, kRw, EBUSY},
      {"migration", {kMig}, kMig, 0},
      {"ro rw", {kRo, kRw}, kRw, EBUSY},
      {"ro rw", {kRo, kRw}, kMig, 0},
      {"rw migration", {kRw, kMig}, kRo, 0},
      {"rw migration", {kRw, kMig}, kRw, EBUSY},
      {"rw migration", {kRw, kMig}, kMig, EBUSY},
      {"migration migration", {kMig, kMig}, kRo, 0},
      {"migration migration", {kMig, kMig}, kRw, EBUSY},
      {"migration migration", {kMig, kMig}, kMig, EBUSY},
  };
  for (const RuleCase& c : cases) {
    DeviceOpeners d;
    SessionId s = 1;
    for (AccessMode m : c.existing) ASSERT_TRUE(d.open(s++, m).ok()) << c.existing_name;
    const auto before = d.holders();
    const uint32_t writers_before = d.writers();
    auto r = d.open(100, c.asked);
    const std::string what = std::string(c.existing_name) + " + " + std::string(to_string(c.asked));
    EXPECT_EQ(err_of(r), c.expect) << what;
    if (c.expect == 0) {
      EXPECT_EQ(*r, DeviceOpeners::Opened::now) << what;
      EXPECT_EQ(d.mode_of(100), c.asked) << what;
      EXPECT_EQ(d.writers(), writers_before + (is_writer(c.asked) ? 1 : 0)) << what;
    } else {
      EXPECT_EQ(d.holders(), before) << what << ": a refusal changes nothing";
      EXPECT_EQ(d.mode_of(100), std::nullopt) << what;
    }
  }
}

// Case: any number of readers. Expect: all granted, no writer counted.
TEST(DeviceOpeners, ReadersAreUnlimited) {
  DeviceOpeners d;
  for (SessionId s = 0; s < 1000; ++s) ASSERT_TRUE(d.open(s, kRo).ok());
  EXPECT_EQ(d.writers(), 0u);
  EXPECT_EQ(d.holders().size(), 1000u);
  EXPECT_TRUE(d.open(5000, kRw).ok());
}

// Case: the same session opens again in the same mode (rw while it is the only writer,
// migration while two write). Expect: Opened::already, counted once.
TEST(DeviceOpeners, ReopenInTheSameModeCountsOnce) {
  DeviceOpeners d;
  ASSERT_EQ(d.open(1, kRw).value(), DeviceOpeners::Opened::now);
  EXPECT_EQ(d.open(1, kRw).value(), DeviceOpeners::Opened::already);
  EXPECT_EQ(d.writers(), 1u);
  EXPECT_EQ(d.holders(), (std::vector<Holder>{{1, kRw}}));

  DeviceOpeners m;
  ASSERT_TRUE(m.open(1, kMig).ok());
  ASSERT_TRUE(m.open(2, kMig).ok());
  EXPECT_EQ(m.open(2, kMig).value(), DeviceOpeners::Opened::already) << "writers == 2 is no refusal here";
  EXPECT_EQ(m.writers(), 2u);
}

// Case: the same session opens again in another mode: up (ro -> rw) with no other writer, down
// (rw -> ro), sideways (rw -> migration). Expect: EBUSY, the first mode stays.
TEST(DeviceOpeners, ReopenInAnotherModeIsRefused) {
  struct Case {
    AccessMode held, asked;
  };
  for (Case c : {Case{kRo, kRw}, Case{kRo, kMig}, Case{kRw, kRo}, Case{kRw, kMig}, Case{kMig, kRw},
                 Case{kMig, kRo}}) {
    DeviceOpeners d;
    ASSERT_TRUE(d.open(1, c.held).ok());
    EXPECT_EQ(err_of(d.open(1, c.asked)), EBUSY) << to_string(c.held) << " -> " << to_string(c.asked);
    EXPECT_EQ(d.mode_of(1), c.held);
    EXPECT_EQ(d.writers(), is_writer(c.held) ? 1u : 0u);
  }
}

// Case: holders close. Expect: a writer's close frees its slot for another rw; a close by a
// session that holds nothing is ENOENT; after the last close the device is empty.
TEST(DeviceOpeners, CloseReleasesTheSlot) {
  DeviceOpeners d;
  ASSERT_TRUE(d.open(1, kRw).ok());
  ASSERT_TRUE(d.open(2, kRo).ok());
  EXPECT_EQ(err_of(d.open(3, kRw)), EBUSY);
  EXPECT_TRUE(d.close(1).ok());
  EXPECT_EQ(d.writers(), 0u);
  EXPECT_TRUE(d.open(3, kRw).ok());
  EXPECT_EQ(err_of(d.close(1)), ENOENT) << "closed twice";
  EXPECT_EQ(err_of(d.close(42)), ENOENT);
  EXPECT_EQ(d.holders(), (std::vector<Holder>{{2, kRo}, {3, kRw}}));
  EXPECT_TRUE(d.close(2).ok());
  EXPECT_TRUE(d.close(3).ok());
  EXPECT_TRUE(d.empty());
}

// Case: an unknown mode value. Expect: EINVAL.
TEST(DeviceOpeners, UnknownModeIsInvalid) {
  DeviceOpeners d;
  EXPECT_EQ(err_of(d.open(1, static_cast<AccessMode>(3))), EINVAL);
  EXPECT_TRUE(d.empty());
}

// Case: every op for every mode. Expect: ro may READ, FLUSH and BLOCK_STATUS only (EPERM
// otherwise); writers may do everything.
TEST(Access, OpsAllowedByMode) {
  for (uint8_t o = 0; o <= static_cast<uint8_t>(IoOp::block_status); ++o) {
    const auto op = static_cast<IoOp>(o);
    const bool ro_ok = op == IoOp::read || op == IoOp::flush || op == IoOp::block_status;
    EXPECT_EQ(check_op_allowed(kRo, op).ok(), ro_ok) << to_string(op);
    if (!ro_ok) {
      EXPECT_EQ(check_op_allowed(kRo, op).error().value(), EPERM);
    }
    EXPECT_TRUE(check_op_allowed(kRw, op).ok()) << to_string(op);
    EXPECT_TRUE(check_op_allowed(kMig, op).ok()) << to_string(op);
  }
}

// ------------------------------------------------------------------------------------------
// DeviceIdAllocator

// Case: ids taken and given back. Expect: the lowest free id; a released id comes back only
// after its release; releasing an id not taken is ENOENT.
TEST(DeviceIdAllocator, LowestFreeReusedOnlyAfterRelease) {
  DeviceIdAllocator a;
  EXPECT_EQ(a.alloc().value(), 0u);
  EXPECT_EQ(a.alloc().value(), 1u);
  EXPECT_EQ(a.alloc().value(), 2u);
  EXPECT_TRUE(a.release(1).ok());
  EXPECT_FALSE(a.in_use(1));
  EXPECT_EQ(a.alloc().value(), 1u);
  EXPECT_EQ(a.alloc().value(), 3u);
  EXPECT_EQ(err_of(a.release(9)), ENOENT);
  EXPECT_TRUE(a.release(0).ok());
  EXPECT_EQ(err_of(a.release(0)), ENOENT);
  EXPECT_EQ(a.size(), 3u);
}

// Case: an allocator of ids 0..2, and one whose last id is UINT32_MAX. Expect: ENOSPC when all
// are taken, and no wrap-around at the top of the range.
TEST(DeviceIdAllocator, RunsOutWithoutWrapping) {
  DeviceIdAllocator a(2);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(a.alloc().value(), i);
  EXPECT_EQ(err_of(a.alloc()), ENOSPC);
  ASSERT_TRUE(a.release(2).ok());
  EXPECT_EQ(a.alloc().value(), 2u);

  DeviceIdAllocator one(0);
  EXPECT_EQ(one.alloc().value(), 0u);
  EXPECT_EQ(err_of(one.alloc()), ENOSPC);
}

// ------------------------------------------------------------------------------------------
// OpenTable

// Case: two sessions open devices. Expect: ids per session from 0; first_holder only for the
// first session on a device; holders listed with their modes.
TEST(OpenTable, IdsArePerSession) {
  OpenTable t;
  auto a = t.open(1, fid("/dev/a"), "/dev/a", kRw).value();
  auto b = t.open(1, fid("/dev/b"), "/dev/b", kRo).value();
  auto a2 = t.open(2, fid("/dev/a"), "/dev/a", kRo).value();
  EXPECT_EQ(a.device_id, 0u);
  EXPECT_EQ(b.device_id, 1u);
  EXPECT_EQ(a2.device_id, 0u) << "session 2 has its own ids";
  EXPECT_TRUE(a.first_holder);
  EXPECT_TRUE(b.first_holder);
  EXPECT_FALSE(a2.first_holder);
  EXPECT_EQ(t.holders(fid("/dev/a")), (std::vector<Holder>{{1, kRw}, {2, kRo}}));
  EXPECT_TRUE(t.holders(fid("/dev/none")).empty());
  auto l = t.lookup(1, 1);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->dev, "/dev/b");
  EXPECT_EQ(l->mode, kRo);
  EXPECT_EQ(err_of(t.lookup(2, 1)), ENODEV) << "session 2 has no id 1";
  EXPECT_EQ(err_of(t.lookup(3, 0)), ENODEV);
}

// Case: a session re-opens a device (after a reconnect the client remaps everything). Expect:
// the same id, reopened set, nothing counted twice; in another mode EBUSY.
TEST(OpenTable, ReopenReturnsTheSameId) {
  OpenTable t;
  ASSERT_TRUE(t.open(1, fid("/dev/x"), "/dev/x", kRo).ok());
  auto first = t.open(1, fid("/dev/a"), "/dev/a", kRw).value();
  auto again = t.open(1, fid("/dev/a"), "/dev/a", kRw).value();
  EXPECT_EQ(again.device_id, first.device_id);
  EXPECT_TRUE(again.reopened);
  EXPECT_FALSE(again.first_holder);
  EXPECT_EQ(t.devices_of(1).size(), 2u);
  EXPECT_EQ(err_of(t.open(1, fid("/dev/a"), "/dev/a", kRo)), EBUSY);
  EXPECT_EQ(t.holders(fid("/dev/a")), (std::vector<Holder>{{1, kRw}}));
}

// Case: the rules across sessions, through the table. Expect: EBUSY leaves no trace (no id
// taken, no device entry).
TEST(OpenTable, RefusalLeavesNoTrace) {
  OpenTable t;
  ASSERT_TRUE(t.open(1, fid("/dev/a"), "/dev/a", kRw).ok());
  EXPECT_EQ(err_of(t.open(2, fid("/dev/a"), "/dev/a", kRw)), EBUSY);
  EXPECT_TRUE(t.devices_of(2).empty());
  auto m = t.open(2, fid("/dev/a"), "/dev/a", kMig).value();
  EXPECT_EQ(m.device_id, 0u) << "the refused open took no id";
}

// Case: a session whose ids are exhausted opens another device. Expect: ENOSPC, and the device
// does not count it as a holder.
TEST(OpenTable, NoIdLeftRollsBack) {
  OpenTable t(0);  // one id per session
  ASSERT_TRUE(t.open(1, fid("/dev/a"), "/dev/a", kRo).ok());
  EXPECT_EQ(err_of(t.open(1, fid("/dev/b"), "/dev/b", kRw)), ENOSPC);
  EXPECT_TRUE(t.holders(fid("/dev/b")).empty());
  EXPECT_TRUE(t.open(2, fid("/dev/b"), "/dev/b", kRw).ok()) << "no writer was left behind";
}

// Case: CLOSE by each holder. Expect: last_holder only for the last one; the id is free again
// for the next OPEN; closing an id the session does not have is ENOENT.
TEST(OpenTable, CloseFreesIdAndReportsLastHolder) {
  OpenTable t;
  ASSERT_TRUE(t.open(1, fid("/dev/a"), "/dev/a", kRw).ok());
  ASSERT_TRUE(t.open(2, fid("/dev/a"), "/dev/a", kRo).ok());
  auto c1 = t.close(1, 0).value();
  EXPECT_EQ(c1.dev, "/dev/a");
  EXPECT_FALSE(c1.last_holder);
  EXPECT_EQ(err_of(t.close(1, 0)), ENOENT);
  EXPECT_EQ(err_of(t.close(2, 7)), ENOENT);
  EXPECT_TRUE(t.close(2, 0).value().last_holder);
  EXPECT_TRUE(t.holders(fid("/dev/a")).empty());
  auto again = t.open(1, fid("/dev/b"), "/dev/b", kRo).value();
  EXPECT_EQ(again.device_id, 0u) << "reused after close";
  EXPECT_TRUE(again.first_holder);
}

// Case: the admin force-closes a session's device while another session holds it too.
// Expect: the session's IO to the id fails (ENODEV), its writer slot is free, the id stays
// reserved (a new OPEN gets another id) until the client's CLOSE, which reports no last holder.
TEST(OpenTable, ForceCloseKeepsTheIdUntilClose) {
  OpenTable t;
  ASSERT_EQ(t.open(1, fid("/dev/a"), "/dev/a", kRw).value().device_id, 0u);
  ASSERT_TRUE(t.open(2, fid("/dev/a"), "/dev/a", kRo).ok());
  auto f = t.force_close(fid("/dev/a"), 1);
  ASSERT_TRUE(f.ok());
  EXPECT_FALSE(f->last_holder);
  EXPECT_EQ(err_of(t.lookup(1, 0)), ENODEV);
  EXPECT_EQ(t.holders(fid("/dev/a")), (std::vector<Holder>{{2, kRo}}));
  EXPECT_TRUE(t.open(3, fid("/dev/a"), "/dev/a", kRw).ok()) << "the writer slot is free";

  auto other = t.open(1, fid("/dev/b"), "/dev/b", kRo).value();
  EXPECT_EQ(other.device_id, 1u) << "id 0 is still reserved";
  auto back = t.open(1, fid("/dev/a"), "/dev/a", kRo).value();
  EXPECT_EQ(back.device_id, 2u) << "re-open after force_close is a new open";
  EXPECT_FALSE(back.reopened);
  const auto listed = t.devices_of(1);
  ASSERT_EQ(listed.size(), 3u);
  EXPECT_TRUE(listed[0].force_closed);

  auto c = t.close(1, 0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->dev, "/dev/a");
  EXPECT_FALSE(c->last_holder) << "the holder went at force_close";
  EXPECT_EQ(t.open(1, fid("/dev/c"), "/dev/c", kRo).value().device_id, 0u) << "free after the client's CLOSE";
}

// Case: force_close of the last holder, and of something not held. Expect: last_holder; ENOENT.
TEST(OpenTable, ForceCloseOfTheLastHolder) {
  OpenTable t;
  ASSERT_TRUE(t.open(1, fid("/dev/a"), "/dev/a", kRo).ok());
  EXPECT_EQ(err_of(t.force_close(fid("/dev/a"), 2)), ENOENT);
  EXPECT_EQ(err_of(t.force_close(fid("/dev/b"), 1)), ENOENT);
  EXPECT_TRUE(t.force_close(fid("/dev/a"), 1).value().last_holder);
  EXPECT_EQ(err_of(t.force_close(fid("/dev/a"), 1)), ENOENT) << "already force-closed";
  EXPECT_TRUE(t.holders(fid("/dev/a")).empty());
}

// Case: a session ends holding two devices (one shared) and a force-closed id. Expect: both
// devices released, last_holder only where it was alone, its ids gone, others untouched.
TEST(OpenTable, EndSessionReleasesEverything) {
  OpenTable t;
  ASSERT_TRUE(t.open(1, fid("/dev/a"), "/dev/a", kRw).ok());
  ASSERT_TRUE(t.open(1, fid("/dev/b"), "/dev/b", kRo).ok());
  ASSERT_TRUE(t.open(1, fid("/dev/c"), "/dev/c", kRo).ok());
  ASSERT_TRUE(t.open(2, fid("/dev/b"), "/dev/b", kRo).ok());
  ASSERT_TRUE(t.force_close(fid("/dev/c"), 1).ok());
  auto gone = t.end_session(1);
  ASSERT_EQ(gone.size(), 2u);
  EXPECT_EQ(gone[0].dev, "/dev/a");
  EXPECT_TRUE(gone[0].last_holder);
  EXPECT_EQ(gone[1].dev, "/dev/b");
  EXPECT_FALSE(gone[1].last_holder);
  EXPECT_TRUE(t.devices_of(1).empty());
  EXPECT_EQ(t.holders(fid("/dev/b")), (std::vector<Holder>{{2, kRo}}));
  EXPECT_TRUE(t.end_session(1).empty()) << "twice";
  EXPECT_TRUE(t.open(3, fid("/dev/a"), "/dev/a", kRw).ok());
}

// Case: one file reached by three names (a symlink, "./f.img", "/root/f.img" all resolve to the
// same FileId), opened by two sessions. Expect: the rules count the file, not the names -- a
// second rw through another name is EBUSY; the same session opening an alias in the same mode
// gets its id back (one store, one id), in another mode EBUSY; the device keeps the name of its
// first opening; CLOSE of the one id releases the file.
TEST(OpenTable, AliasesAreOneDevice) {
  OpenTable t;
  const FileId f{false, 8, 12345, {}};
  const FileId other{false, 9, 12345, {}};  // same inode number on another filesystem
  auto a = t.open(1, f, "/srv/f.img", kRw).value();
  EXPECT_EQ(err_of(t.open(2, f, "/srv/link.img", kRw)), EBUSY) << "a symlink is no second writer";
  auto again = t.open(1, f, "/srv/./f.img", kRw).value();
  EXPECT_EQ(again.device_id, a.device_id);
  EXPECT_TRUE(again.reopened);
  EXPECT_EQ(err_of(t.open(1, f, "/srv/link.img", kRo)), EBUSY) << "a mode change is CLOSE + OPEN";
  EXPECT_EQ(t.devices_of(1).size(), 1u);
  EXPECT_EQ(t.devices_of(1)[0].dev, "/srv/f.img");
  auto o = t.open(2, other, "/srv/f.img", kRw).value();
  EXPECT_TRUE(o.first_holder) << "another file is another device, whatever its name";
  auto c = t.close(1, a.device_id).value();
  EXPECT_TRUE(c.last_holder);
  EXPECT_EQ(c.file, f);
  EXPECT_TRUE(t.open(2, f, "/srv/link.img", kRw).ok()) << "the writer left";
}

// Case: block devices are their rdev: two device nodes of one disk. Expect: one device.
TEST(OpenTable, TwoNodesOfOneDiskAreOneDevice) {
  OpenTable t;
  const FileId disk{true, 0x0801, 0, {}};
  ASSERT_TRUE(t.open(1, disk, "/srv/sda1", kRw).ok());
  EXPECT_EQ(err_of(t.open(2, disk, "/srv/copy-of-sda1", kRw)), EBUSY);
  EXPECT_NE((FileId{true, 5, 0, {}}), (FileId{false, 5, 0, {}})) << "a file and a disk never collide";
}

// Case: has_id, which lets the server answer a CLOSE of an unknown id at once. Expect: true for
// held and force-closed ids, false for others and other sessions.
TEST(OpenTable, HasIdSeesHeldAndReservedIds) {
  OpenTable t;
  ASSERT_TRUE(t.open(1, fid("/dev/a"), "/dev/a", kRw).ok());
  ASSERT_TRUE(t.open(1, fid("/dev/b"), "/dev/b", kRw).ok());
  ASSERT_TRUE(t.force_close(fid("/dev/b"), 1).ok());
  EXPECT_TRUE(t.has_id(1, 0));
  EXPECT_TRUE(t.has_id(1, 1)) << "force-closed: reserved until the client's CLOSE";
  EXPECT_FALSE(t.has_id(1, 2));
  EXPECT_FALSE(t.has_id(2, 0));
  ASSERT_TRUE(t.close(1, 1).ok());
  EXPECT_FALSE(t.has_id(1, 1));
}

// ---- ExportAcl: per-export access control ----

TEST(ExportAcl, Patterns) {
  EXPECT_TRUE(acl_pattern_matches("**", "a/b/c.img"));
  EXPECT_TRUE(acl_pattern_matches("a/**", "a/b/c.img"));
  EXPECT_TRUE(acl_pattern_matches("a/**", "a/x"));
  EXPECT_FALSE(acl_pattern_matches("a/**", "a"));
  EXPECT_FALSE(acl_pattern_matches("a/**", "ab/x")) << "a prefix of the name is not the directory";
  EXPECT_TRUE(acl_pattern_matches("a/*.img", "a/x.img"));
  EXPECT_FALSE(acl_pattern_matches("a/*.img", "a/b/x.img")) << "'*' never crosses a '/'";
  EXPECT_FALSE(acl_pattern_matches("*", "a/x.img"));
  EXPECT_TRUE(acl_pattern_matches("vol[12].img", "vol2.img"));
  EXPECT_TRUE(acl_pattern_matches("exact.img", "exact.img"));
  EXPECT_FALSE(acl_pattern_matches("exact.img", "exact.img2"));
}

TEST(ExportAcl, RefusesBadRules) {
  EXPECT_TRUE(check_acl_rule({"a/**", kRw}).ok());
  EXPECT_EQ(err_of(check_acl_rule({"", kRw})), EINVAL);
  EXPECT_EQ(err_of(check_acl_rule({"../b/*", kRw})), EINVAL);
  EXPECT_EQ(err_of(check_acl_rule({"a/../b", kRw})), EINVAL);
  EXPECT_EQ(err_of(check_acl_rule({"a", static_cast<AccessMode>(3)})), EINVAL);
  ExportAcl acl;
  EXPECT_EQ(err_of(acl.set_host("h", {{"ok/*", kRo}, {"..", kRo}})), EINVAL);
  EXPECT_EQ(acl.rules_of("h"), nullptr) << "a refused set changes nothing";
}

// Case: host A may write its directory, B may only read the shared one; C has keys but no
// rules. Expect: A rw on its own, nothing on B's (EACCES); B ro on shared, EPERM for rw there;
// an unlisted host and an anonymous session EACCES until any host is allowed.
TEST(ExportAcl, HostsDevicesModes) {
  ExportAcl acl;
  ASSERT_TRUE(acl.set_host("host-a", {{"a/**", kRw}, {"shared/*", kRo}}).ok());
  ASSERT_TRUE(acl.set_host("host-b", {{"b/**", kRw}, {"shared/*", kRo}}).ok());
  ASSERT_TRUE(acl.set_host("host-c", {}).ok());
  ASSERT_TRUE(acl.set_host("host-m", {{"vm/*.img", AccessMode::migration}}).ok());
  EXPECT_TRUE(acl.check("host-a", "a/disk.img", kRw).ok());
  EXPECT_TRUE(acl.check("host-a", "a/deep/disk.img", kRo).ok());
  EXPECT_EQ(err_of(acl.check("host-a", "a/disk.img", AccessMode::migration)), EPERM);
  EXPECT_EQ(err_of(acl.check("host-a", "b/disk.img", kRo)), EACCES);
  EXPECT_EQ(err_of(acl.check("host-a", "b/disk.img", kRw)), EACCES);
  EXPECT_TRUE(acl.check("host-b", "shared/base.img", kRo).ok());
  EXPECT_EQ(err_of(acl.check("host-b", "shared/base.img", kRw)), EPERM);
  EXPECT_EQ(err_of(acl.check("host-c", "a/disk.img", kRo)), EACCES);
  EXPECT_TRUE(acl.check("host-m", "vm/x.img", AccessMode::migration).ok());
  EXPECT_TRUE(acl.check("host-m", "vm/x.img", kRw).ok()) << "migration grants rw too";
  EXPECT_EQ(err_of(acl.check("stranger", "a/disk.img", kRo)), EACCES);
  EXPECT_EQ(err_of(acl.check("", "a/disk.img", kRo)), EACCES);
  acl.set_allow_any_host(true);
  EXPECT_TRUE(acl.check("stranger", "a/disk.img", kRw).ok());
  EXPECT_TRUE(acl.check("", "b/disk.img", AccessMode::migration).ok());
  EXPECT_EQ(err_of(acl.check("host-b", "shared/base.img", kRw)), EPERM) << "listed hosts keep their rules";
  EXPECT_EQ(err_of(acl.check("host-c", "a/disk.img", kRo)), EACCES);
  ASSERT_TRUE(acl.remove_host("host-c").ok());
  EXPECT_TRUE(acl.check("host-c", "a/disk.img", kRo).ok()) << "now unlisted: any host applies";
  EXPECT_EQ(err_of(acl.remove_host("host-c")), ENOENT);
}

}  // namespace
}  // namespace ibnbd::proto
