#!/usr/bin/env bash
# Prints the path of a promtool (`promtool check metrics` lints the daemons' metrics in
# tests/cli/daemons.sh). Debian ships it only inside the prometheus package, whose install would
# also start a Prometheus server on this machine: the package is downloaded (apt-get download)
# and only promtool is extracted into a cache, nothing installed.
#
#   scripts/promtool.sh [--cached-only]
#
#   --cached-only  no apt, no network: print it if the cache (or PATH) has it, else exit 3
#   The cache: $IBNBD_PROMTOOL_CACHE, default /var/cache/ibnbd (fio-headers.sh's too).
#
# Exit: 0 and the path on stdout; 1 it cannot be had (the reason on stderr); 2 usage;
# 3 --cached-only and nothing cached.
set -euo pipefail

cache=${IBNBD_PROMTOOL_CACHE:-/var/cache/ibnbd}
case "${1:-}" in
  "") cached_only=0 ;;
  --cached-only) cached_only=1 ;;
  *) echo "usage: $0 [--cached-only]" >&2; exit 2 ;;
esac
say() { echo "promtool: $*" >&2; }

if command -v promtool >/dev/null; then command -v promtool; exit 0; fi
tool=$cache/promtool/usr/bin/promtool
if [ -x "$tool" ] && "$tool" --version >/dev/null 2>&1; then echo "$tool"; exit 0; fi
[ "$cached_only" = 1 ] && exit 3

command -v apt-get >/dev/null || { say "no apt-get: install Debian's prometheus package's promtool by hand"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# apt-get download runs as the _apt user where it can: give it a directory it may write.
chmod 0777 "$tmp"
if ! (cd "$tmp" && apt-get download -qq prometheus >"$tmp/log" 2>&1); then
  # The package lists may be missing or stale (a fresh machine): once more after an update.
  apt-get update -qq >/dev/null 2>&1 || true
  (cd "$tmp" && apt-get download -qq prometheus >"$tmp/log" 2>&1) ||
    { say "apt-get download prometheus failed: $(tail -2 "$tmp/log")"; exit 1; }
fi
deb=$(ls "$tmp"/prometheus_*.deb 2>/dev/null | head -1)
[ -n "$deb" ] || { say "apt-get download prometheus gave no package"; exit 1; }
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp" ./usr/bin/promtool ||
  { say "no usr/bin/promtool in $(basename "$deb")"; exit 1; }
mkdir -p "$cache/promtool/usr/bin"
install -m 0755 "$tmp/usr/bin/promtool" "$tool.new"
mv "$tool.new" "$tool"
"$tool" --version >/dev/null 2>&1 || { say "$tool does not run"; exit 1; }
echo "$tool"
