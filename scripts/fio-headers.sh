#!/usr/bin/env bash
# Prints the include directory of a configured fio source tree that matches the installed fio,
# for building the external ioengine (client/fio). Debian ships no fio headers, and an external
# engine must be built against the exact version it is loaded into: fio refuses an engine whose
# ops->version differs from its own FIO_IOOPS_VERSION, and struct thread_data / io_u / fio_file
# are read by offset. The matching tree is Debian's source package of the installed fio
# (deb-src is enabled for it when missing), unpacked into a cache and run through fio's
# ./configure so that config-host.h exists.
#
#   scripts/fio-headers.sh [--cached-only] [--cache DIR]
#
#   --cached-only  no apt, no network: print the tree if the cache has it, else exit 3 (CMake's
#                  AUTO mode uses this so that a plain configure never touches the system)
#   --cache DIR    default $IBNBD_FIO_CACHE or /var/cache/ibnbd
#
# Exit: 0 and the include directory on stdout; 1 the tree cannot be made (the reason on
# stderr); 2 usage; 3 --cached-only and nothing cached; 4 the installed fio and the source
# differ (refused: an engine built against other headers would crash or be rejected by fio).
set -euo pipefail

cache=${IBNBD_FIO_CACHE:-/var/cache/ibnbd}
cached_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cached-only) cached_only=1; shift ;;
    --cache) cache=${2:?--cache needs a directory}; shift 2 ;;
    *) echo "usage: $0 [--cached-only] [--cache DIR]" >&2; exit 2 ;;
  esac
done
say() { echo "fio-headers: $*" >&2; }

command -v fio >/dev/null || { say "fio is not installed (scripts/setup.sh installs it)"; exit 1; }
# "fio-3.33" -> 3.33: the upstream version the engine is loaded into.
fio_ver=$(fio --version | sed -n 's/^fio-//p')
[ -n "$fio_ver" ] || { say "cannot read the version of $(command -v fio)"; exit 1; }
# The Debian version (3.33-3): the source package is pinned to it, so Debian's patches match too.
deb_ver=$(dpkg-query -W -f='${Version}' fio 2>/dev/null || true)
tree=$cache/fio-$fio_ver
stamp=$tree/.ibnbd-fio-version

tree_version() {  # the version a tree says it is (FIO-VERSION-GEN: DEF_VER=fio-3.33)
  sed -n 's/^DEF_VER=fio-//p' "$1/FIO-VERSION-GEN" 2>/dev/null
}

if [ -f "$stamp" ] && [ -f "$tree/config-host.h" ] && [ "$(cat "$stamp")" = "$fio_ver $deb_ver" ]; then
  echo "$tree"
  exit 0
fi
if [ "$cached_only" = 1 ]; then
  say "no configured fio $fio_ver tree in $cache (run scripts/fio-headers.sh or scripts/setup.sh)"
  exit 3
fi
[ -n "$deb_ver" ] || { say "fio $fio_ver is not a Debian package: put a configured fio-$fio_ver tree in $tree"; exit 1; }

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive

# deb-src for the suites the binary packages come from, only when apt knows no fio source yet.
if ! apt-cache showsrc fio 2>/dev/null | grep -q "^Version: $deb_ver\$"; then
  list=/etc/apt/sources.list.d/ibnbd-deb-src.sources
  if [ ! -f "$list" ]; then
    say "enabling deb-src for bookworm in $list"
    $SUDO tee "$list" >/dev/null <<'SRC'
# Added by ibnbd scripts/fio-headers.sh: the fio source package gives the headers the fio
# external ioengine is built against.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  $SUDO apt-get update -qq
fi
command -v dpkg-source >/dev/null || $SUDO apt-get install -y -qq --no-install-recommends dpkg-dev

$SUDO mkdir -p "$cache"
work=$(mktemp -d "$cache/.fio-src.XXXXXX")
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # apt's _apt user downloads into it
# --download-only and a separate dpkg-source -x: the unpack lands where we say, and needs no
# build dependencies.
(cd "$work" && apt-get source -qq --download-only "fio=$deb_ver" >&2) ||
  { say "apt-get source fio=$deb_ver failed"; exit 1; }
dsc=$(ls "$work"/fio_*.dsc 2>/dev/null | head -1)
[ -n "$dsc" ] || { say "no fio .dsc was downloaded"; exit 1; }
(cd "$work" && dpkg-source -q -x "$dsc" src >&2) || { say "dpkg-source -x $dsc failed"; exit 1; }

src_ver=$(tree_version "$work/src")
if [ "$src_ver" != "$fio_ver" ]; then
  say "refusing: the installed fio is $fio_ver but the source package is fio $src_ver"
  exit 4
fi

# fio's own configure with the flags of Debian's rules (debian/rules: --disable-native
# --prefix=/usr --enable-gfio --enable-libnbd) so that the CONFIG_* macros that shape struct
# thread_data and io_u match the installed binary as far as this host's libraries allow. The two
# --enable flags are left out: they only add the GTK client and the nbd engine, change no shared
# struct, and would make libnbd-dev / GTK a build dependency. It writes config-host.h; fio
# itself is not compiled.
(cd "$work/src" && ./configure --disable-native --prefix=/usr >"$work/configure.log" 2>&1) ||
  { say "fio ./configure failed:"; tail -20 "$work/configure.log" >&2; exit 1; }
[ -f "$work/src/config-host.h" ] || { say "fio ./configure wrote no config-host.h"; exit 1; }

rm -rf "$tree"
mv "$work/src" "$tree"
echo "$fio_ver $deb_ver" >"$stamp"
say "fio $fio_ver ($deb_ver) headers in $tree"
echo "$tree"
