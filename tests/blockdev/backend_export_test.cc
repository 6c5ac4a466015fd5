// resolve_export(): what a client may open under dev_search_path, and the errno it gets when it
// may not. Real directories, files and symlinks in a scratch tree:
//   <tmp>/root/            the search root
//   <tmp>/root/disk.img    a file
//   <tmp>/root/sub/b.img   a file one level down
//   <tmp>/outside.img      a file beside the root
//   <tmp>/sessions/s1/x.img a per-session namespace
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "backend_test_util.h"
#include "ibnbd/backend.h"

namespace ibnbd::test {
namespace {

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = TempDir::make("/tmp");
    ASSERT_TRUE(d) << "mkdtemp";
    dir_.emplace(std::move(*d));
    root_ = *dir_ / "root";
    ASSERT_EQ(::mkdir(root_.c_str(), 0700), 0);
    ASSERT_EQ(::mkdir((root_ + "/sub").c_str(), 0700), 0);
    ASSERT_EQ(::mkdir((*dir_ / "sessions").c_str(), 0700), 0);
    ASSERT_EQ(::mkdir((*dir_ / "sessions/s1").c_str(), 0700), 0);
    ASSERT_TRUE(make_file(root_ + "/disk.img", 1 << 20));
    ASSERT_TRUE(make_file(root_ + "/sub/b.img", 1 << 20));
    ASSERT_TRUE(make_file(*dir_ / "outside.img", 1 << 20));
    ASSERT_TRUE(make_file(*dir_ / "sessions/s1/x.img", 1 << 20));
  }

  // The errno of a refused resolution (0 when it resolved), with the reason printed on failure.
  int refused(std::string_view tmpl, std::string_view sess, std::string_view dev) {
    std::string why;
    auto r = resolve_export(tmpl, sess, dev, &why);
    last_why_ = why;
    return r.ok() ? 0 : r.error().value();
  }

  std::optional<TempDir> dir_;
  std::string root_;
  std::string last_why_;
};

// Case: a plain relative name, and the same with "./" and doubled slashes. Expect: resolves to
// the file, kind file, and the cleaned relative path; the backend opens it beneath the root.
TEST_F(ExportTest, RelativeNameResolvesAndOpens) {
  auto t = resolve_export(root_, "any", "disk.img");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->kind, ExportTarget::Kind::file);
  EXPECT_EQ(t->rel_path, "disk.img");
  EXPECT_EQ(t->root_path, root_);
  auto t2 = resolve_export(root_ + "/", "any", ".//sub///./b.img");
  ASSERT_TRUE(t2.ok()) << t2.error().message();
  EXPECT_EQ(t2->rel_path, "sub/b.img");
  auto b = Backend::open(*t2, {});
  ASSERT_TRUE(b.ok()) << b.error().message();
  EXPECT_EQ((*b)->size(), 1u << 20);
}

// Case: '..' as a component, alone, in the middle, at the end. Expect: EINVAL before any lookup
// (the kernel refuses ".." too), even when the result would stay inside.
TEST_F(ExportTest, DotDotComponentsAreRefused) {
  EXPECT_EQ(refused(root_, "s", "../outside.img"), EINVAL) << last_why_;
  EXPECT_EQ(refused(root_, "s", "sub/../disk.img"), EINVAL);
  EXPECT_EQ(refused(root_, "s", "sub/.."), EINVAL);
  EXPECT_NE(last_why_.find(".."), std::string::npos) << last_why_;
  // A name that merely contains two dots is a name.
  ASSERT_TRUE(make_file(root_ + "/a..b", 4096));
  EXPECT_EQ(refused(root_, "s", "a..b"), 0) << last_why_;
}

// Case: absolute device names. Expect: one beneath the root is the same export as its relative
// rest; one outside the root is EXDEV; "/" and the root itself are not devices (EINVAL).
TEST_F(ExportTest, AbsoluteNamesOnlyBeneathTheRoot) {
  auto t = resolve_export(root_, "s", root_ + "/sub/b.img");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->rel_path, "sub/b.img");
  EXPECT_EQ(refused(root_, "s", *dir_ / "outside.img"), EXDEV) << last_why_;
  EXPECT_EQ(refused(root_, "s", "/etc/passwd"), EXDEV);
  // A sibling whose name starts like the root is outside too (component match, not prefix).
  ASSERT_EQ(::mkdir((root_ + "2").c_str(), 0700), 0);
  ASSERT_TRUE(make_file(root_ + "2/disk.img", 4096));
  EXPECT_EQ(refused(root_, "s", root_ + "2/disk.img"), EXDEV);
  EXPECT_EQ(refused(root_, "s", root_), EINVAL);
  EXPECT_EQ(refused(root_, "s", "/"), EXDEV);
  EXPECT_EQ(refused(root_, "s", "."), EINVAL);
}

// Case: symlinks. Expect: a relative link inside the root is followed; a relative link that
// climbs out, and an absolute link (even one pointing inside), are EXDEV (RESOLVE_BENEATH); a
// link in the middle of the path that leads out is EXDEV too.
TEST_F(ExportTest, SymlinksMayNotLeaveTheRoot) {
  ASSERT_EQ(::symlink("sub/b.img", (root_ + "/inside-link").c_str()), 0);
  ASSERT_EQ(::symlink("../outside.img", (root_ + "/escape-link").c_str()), 0);
  ASSERT_EQ(::symlink((root_ + "/disk.img").c_str(), (root_ + "/absolute-link").c_str()), 0);
  ASSERT_EQ(::symlink("..", (root_ + "/up").c_str()), 0);
  auto t = resolve_export(root_, "s", "inside-link");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->kind, ExportTarget::Kind::file);
  EXPECT_EQ(refused(root_, "s", "escape-link"), EXDEV) << last_why_;
  EXPECT_NE(last_why_.find("symlink"), std::string::npos) << last_why_;
  EXPECT_EQ(refused(root_, "s", "absolute-link"), EXDEV);
  EXPECT_EQ(refused(root_, "s", "up/outside.img"), EXDEV);
}

// Case: a search root under /proc/self and a name that is a /proc magic link. Expect: ELOOP
// (RESOLVE_NO_MAGICLINKS): a client cannot reach the server's own descriptors.
TEST_F(ExportTest, ProcMagicLinksAreRefused) {
  int fd = ::open((root_ + "/disk.img").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(refused("/proc/self", "s", "fd/" + std::to_string(fd)), ELOOP) << last_why_;
  ::close(fd);
}

// Case: %SESSNAME% in the search path. Expect: each session sees its own directory; a name from
// another session's directory is ENOENT; unusable session names are EINVAL; a session without a
// directory is ENOENT.
TEST_F(ExportTest, SessionNamespaces) {
  const std::string tmpl = *dir_ / "sessions/%SESSNAME%";
  auto t = resolve_export(tmpl, "s1", "x.img");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->root_path, *dir_ / "sessions/s1");
  EXPECT_EQ(refused(tmpl, "s2", "x.img"), ENOENT) << last_why_;
  EXPECT_EQ(refused(tmpl, "", "x.img"), EINVAL);
  EXPECT_EQ(refused(tmpl, "a/b", "x.img"), EINVAL);
  EXPECT_EQ(refused(tmpl, "..", "x.img"), EINVAL);
  EXPECT_EQ(refused(tmpl, "x..y", "x.img"), EINVAL);
  EXPECT_EQ(refused(tmpl, ".", "x.img"), EINVAL);
  EXPECT_EQ(refused(tmpl, std::string_view("s1\0", 3), "x.img"), EINVAL);
  // Without the placeholder the session name plays no part.
  EXPECT_EQ(refused(root_, "", "disk.img"), 0);
  // Every occurrence is replaced.
  ASSERT_EQ(::mkdir((*dir_ / "sessions/s1/s1").c_str(), 0700), 0);
  ASSERT_TRUE(make_file(*dir_ / "sessions/s1/s1/y.img", 4096));
  EXPECT_EQ(refused(*dir_ / "sessions/%SESSNAME%/%SESSNAME%", "s1", "y.img"), 0) << last_why_;
}

// Case: names that resolve to nothing usable. Expect: ENOENT for a missing file or root, EISDIR
// for a directory, ENOTBLK for a FIFO, EINVAL for an empty name or a relative search path,
// ENAMETOOLONG for an oversized name, ENOTDIR for a file used as a directory.
TEST_F(ExportTest, MissingAndUnusableTargets) {
  EXPECT_EQ(refused(root_, "s", "nope.img"), ENOENT) << last_why_;
  EXPECT_EQ(refused(root_ + "/no-such-dir", "s", "disk.img"), ENOENT);
  EXPECT_EQ(refused(root_, "s", "sub"), EISDIR);
  ASSERT_EQ(::mkfifo((root_ + "/fifo").c_str(), 0600), 0);
  EXPECT_EQ(refused(root_, "s", "fifo"), ENOTBLK);
  EXPECT_EQ(refused(root_, "s", ""), EINVAL);
  EXPECT_EQ(refused("relative/path", "s", "disk.img"), EINVAL);
  EXPECT_EQ(refused(root_, "s", std::string(5000, 'a')), ENAMETOOLONG);
  EXPECT_EQ(refused(root_, "s", "disk.img/x"), ENOTDIR);
}

// Case: the opened backend of a resolved read-only export. Expect: it is read-only and reports
// the file's size; a FIFO swapped in under an already resolved name is refused without hanging.
TEST_F(ExportTest, BackendOpenBeneathTheRoot) {
  auto t = resolve_export(root_, "s", "disk.img");
  ASSERT_TRUE(t.ok());
  OpenOptions o;
  o.read_only = true;
  auto b = Backend::open(*t, o);
  ASSERT_TRUE(b.ok()) << b.error().message();
  EXPECT_TRUE((*b)->read_only());
  EXPECT_EQ((*b)->geometry().nsectors, (1u << 20) / 512);
  ASSERT_EQ(::unlink((root_ + "/disk.img").c_str()), 0);
  ASSERT_EQ(::mkfifo((root_ + "/disk.img").c_str(), 0600), 0);
  auto f = Backend::open(*t, {});
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.error().value(), ENOTBLK);
}

// Case: one file under several names -- "./x", "//x", the absolute name, a relative symlink, a
// hard link -- and another file. Expect: every alias resolves to the same FileId (the server's
// key of the device), the other file to another; the opened backend reports the same id.
TEST_F(ExportTest, AliasesResolveToOneFileId) {
  ASSERT_EQ(::symlink("disk.img", (root_ + "/link.img").c_str()), 0);
  ASSERT_EQ(::link((root_ + "/disk.img").c_str(), (root_ + "/hard.img").c_str()), 0);
  auto t = resolve_export(root_, "s", "disk.img");
  ASSERT_TRUE(t.ok());
  const std::vector<std::string> aliases{"./disk.img", ".//disk.img", root_ + "/disk.img",
                                         "/" + root_ + "/disk.img", "link.img", "hard.img"};
  for (const std::string& alias : aliases) {
    auto a = resolve_export(root_, "s", alias);
    ASSERT_TRUE(a.ok()) << alias << ": " << a.error().message();
    EXPECT_EQ(a->id, t->id) << alias;
  }
  auto other = resolve_export(root_, "s", "sub/b.img");
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->id, t->id);
  auto b = Backend::open(*t, {});
  ASSERT_TRUE(b.ok()) << b.error().message();
  EXPECT_EQ((*b)->id(), t->id);
}

// Case: names with and without symlinks on the way: a file, a link to a file in another
// directory, a link to a directory, all reached through a search root that is itself a symlink.
// Expect: real_path is where each leads under the root (rel_path when no symlink is on the way):
// what the server's access rules check besides the name (docs/security.d/auth.md).
TEST_F(ExportTest, RealPathIsWhereTheNameLeads) {
  ASSERT_EQ(::mkdir((root_ + "/a").c_str(), 0700), 0);
  ASSERT_EQ(::symlink("../sub/b.img", (root_ + "/a/link.img").c_str()), 0);
  ASSERT_EQ(::symlink("../sub", (root_ + "/a/dir").c_str()), 0);
  const std::string via = *dir_ / "via";
  ASSERT_EQ(::symlink(root_.c_str(), via.c_str()), 0);
  const std::pair<const char*, const char*> cases[] = {
      {"disk.img", "disk.img"}, {"sub/b.img", "sub/b.img"}, {"a/link.img", "sub/b.img"}, {"a/dir/b.img", "sub/b.img"}};
  for (auto [name, real] : cases) {
    for (const std::string& root : {root_, via}) {
      auto t = resolve_export(root, "s", name);
      ASSERT_TRUE(t.ok()) << root << " " << name << ": " << t.error().message();
      EXPECT_EQ(t->rel_path, std::string(name)) << root;
      EXPECT_EQ(t->real_path, std::string(real)) << root << " " << name;
    }
  }
}

// Case: the file behind a resolved name is replaced (rename over it) before the backend opens
// it. Expect: ESTALE -- the access rules judged the old file; the backend must not serve a new
// one under its key.
TEST_F(ExportTest, AStoreReplacedAfterResolveIsStale) {
  auto t = resolve_export(root_, "s", "disk.img");
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(make_file(root_ + "/new.img", 1 << 20));
  ASSERT_EQ(::rename((root_ + "/new.img").c_str(), (root_ + "/disk.img").c_str()), 0);
  auto b = Backend::open(*t, {});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.error().value(), ESTALE);
}

}  // namespace
}  // namespace ibnbd::test
