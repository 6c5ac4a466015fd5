#!/usr/bin/env bash
# What `cmake --install` puts in place, tried as a system would use it: the files of the layout
# (daemons, CLI, migration agent, ibnbd-maps, fio engine, systemd units, /etc examples, bash
# completion), `systemd-analyze verify` on the units, then each unit's ExecStart/ExecStop run as
# systemd would run it (paths under the DESTDIR, /run and /etc paths moved into a scratch
# directory): the server from its JSON config, the client daemon with the options of its
# EnvironmentFile, ibnbd-maps mapping a maps file (a bad line fails alone, a second run changes
# nothing), unmapping in reverse order, and both daemons stopping on KillSignal within
# TimeoutStopSec. TAP-like output; exit 1 when anything failed.
#
#   bash tests/install/install.sh BUILD_DIR        (ctest: install_layout)
set -u -o pipefail
build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd)
. "$(dirname "${BASH_SOURCE[0]}")/../lib/tap.sh"
command -v jq >/dev/null || { echo "1..0 # SKIP no jq"; exit 77; }

work=$(mktemp -d /var/tmp/ibnbd-install-test.XXXXXX)
root=$work/root
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT

# Case: install into a DESTDIR. Expect: every file of the layout, the units naming the installed
# binaries.
DESTDIR=$root cmake --install "$build" >"$work/install.log" 2>&1 || { echo "not ok - cmake --install: $(tail -3 "$work/install.log")"; exit 1; }
prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$build/CMakeCache.txt")
unitdir=$(cd "$root" && find . -name ibnbd-server.service -printf '%h\n' | sed 's/^\.//' | head -1)
missing=""
for f in "$prefix/sbin/ibnbd-server" "$prefix/sbin/ibnbd-client" "$prefix/sbin/ibnbd-maps" "$prefix/bin/ibnbd" \
  "$prefix/bin/ibnbd-migrate" "$unitdir/ibnbd-server.service" "$unitdir/ibnbd-client.service" \
  "$unitdir/ibnbd-maps.service" /etc/ibnbd/server.json.example /etc/ibnbd/maps.example /etc/default/ibnbd-client \
  "$prefix/share/bash-completion/completions/ibnbd"; do
  [ -e "$root$f" ] || missing="$missing $f"
done
[ -z "$missing" ] && ok "the layout is installed" || not_ok "the layout is installed" "missing:$missing"
if grep -q '^GO_MD2MAN:FILEPATH=/' "$build/CMakeCache.txt"; then
  bad=""
  for p in ibnbd ibnbd-server ibnbd-client ibnbd-migrate; do
    m=$root$prefix/share/man/man8/$p.8
    [ -e "$m" ] && MANWIDTH=80 man -l "$m" 2>/dev/null | grep -q "^NAME" || bad="$bad $p.8"
  done
  [ -z "$bad" ] && ok "the man pages are installed and render" || not_ok "the man pages render" "$bad"
fi
if [ -e "$build/client/fio/libibnbd-fio.so" ]; then
  ls "$root$prefix"/lib*/ibnbd/libibnbd-fio.so >/dev/null 2>&1 && ok "the fio engine is installed" ||
    not_ok "the fio engine is installed" "not under $prefix/lib*/ibnbd"
fi
bad=""
for u in "$root$unitdir"/ibnbd-*.service; do
  for b in $(sed -n 's/^Exec\(Start\|Stop\)=\([^ ]*\).*/\2/p' "$u"); do [ -x "$root$b" ] || bad="$bad $(basename "$u"):$b"; done
done
[ -z "$bad" ] && ok "every unit's command is an installed program" || not_ok "units name installed programs" "$bad"
for b in "$prefix/sbin/ibnbd-server" "$prefix/sbin/ibnbd-client" "$prefix/bin/ibnbd" "$prefix/bin/ibnbd-migrate"; do
  expect "$(basename "$b") --help runs" 0 "$root$b" --help
done
expect "ibnbd migrate finds the installed agent beside it" 0 "$root$prefix/bin/ibnbd" migrate --help
bash -n "$root$prefix/share/bash-completion/completions/ibnbd" && ok "the bash completion parses" ||
  not_ok "the bash completion parses" "bash -n failed"

# Case: the Debian package (cpack -G DEB; not for sanitizer builds: their binaries are large and
# the layout is the same). Expect: the layout's files, the units naming the package's paths,
# the /etc files as conffiles, library dependencies found.
if ! grep -q '^IBTRS_SANITIZE:STRING=.\+' "$build/CMakeCache.txt" && command -v cpack >/dev/null && command -v dpkg-deb >/dev/null; then
  if (cd "$build" && cpack -G DEB -B "$work/deb") >"$work/cpack.log" 2>&1; then
    deb=$(ls "$work"/deb/ibnbd_*.deb | head -1)
    dpkg-deb -c "$deb" | awk '{print $6}' | sed 's#^\./#/#' >"$work/deb.files"
    dmiss=""
    for f in "$prefix/sbin/ibnbd-server" "$prefix/sbin/ibnbd-maps" "$prefix/bin/ibnbd" "$unitdir/ibnbd-maps.service" /etc/default/ibnbd-client; do
      grep -qx "$f" "$work/deb.files" || dmiss="$dmiss $f"
    done
    [ -z "$dmiss" ] && ok "the package holds the layout" || not_ok "the package holds the layout" "missing:$dmiss"
    mkdir -p "$work/debx" && dpkg-deb -x "$deb" "$work/debx" && dpkg-deb -e "$deb" "$work/debx/DEBIAN"
    grep -q "^ExecStart=$prefix/sbin/ibnbd-server " "$work/debx$unitdir/ibnbd-server.service" &&
      ok "the package's units name its paths" || not_ok "the package's units name its paths" "$(grep ExecStart "$work/debx$unitdir/ibnbd-server.service")"
    grep -qx /etc/default/ibnbd-client "$work/debx/DEBIAN/conffiles" && ok "/etc files are conffiles" ||
      not_ok "/etc files are conffiles" "$(cat "$work/debx/DEBIAN/conffiles" 2>&1)"
    dpkg-deb -f "$deb" Depends | grep -q "libssl3" && ok "the package depends on the libraries it links" ||
      not_ok "the package's dependencies" "$(dpkg-deb -f "$deb" Depends)"
  else
    not_ok "cpack -G DEB" "$(tail -3 "$work/cpack.log")"
  fi
fi

# Case: systemd-analyze verify on the installed units (the host's targets copied in, no man
# pages checked), and on a unit with a command that is not there. Expect: clean; refused.
if command -v systemd-analyze >/dev/null && [ -d /lib/systemd/system ]; then
  cp -n /lib/systemd/system/*.target "$root$unitdir/" 2>/dev/null
  if systemd-analyze verify --man=no --root="$root" "$root$unitdir"/ibnbd-*.service >"$work/verify" 2>&1; then
    ok "systemd-analyze verify is clean"
  else
    not_ok "systemd-analyze verify is clean" "$(head -5 "$work/verify")"
  fi
  sed 's#^ExecStart=.*#ExecStart=/nonexistent/ibnbd-server#' "$root$unitdir/ibnbd-server.service" >"$root$unitdir/broken.service"
  systemd-analyze verify --man=no --root="$root" "$root$unitdir/broken.service" >/dev/null 2>&1 &&
    not_ok "verify refuses a missing command" "it passed" || ok "verify refuses a missing command"
  rm -f "$root$unitdir/broken.service"
else
  echo "# systemd-analyze verify skipped: no systemd-analyze or /lib/systemd/system here"
fi

# The units' commands as systemd runs them: Exec lines, $VAR from Environment= and the
# EnvironmentFile, the system paths moved under $work.
unit_cmd() {  # unit_cmd UNIT KEY: the unit's KEY= line with paths moved
  sed -n "s/^$2=//p" "$root$unitdir/$1" | head -1 |
    sed -e "s#/etc/ibnbd/#$work/etc/#g" -e "s#/run/ibnbd-server.sock#$work/srv.sock#g" \
        -e "s#/run/ibnbd-client.sock#$work/cl.sock#g" -e "s#/run/ibnbd-client#$work/state#g" \
        -e "s#^\\([^ ]*\\)#$root\\1#"
}
mkdir -p "$work/etc" "$work/export"
truncate -s 16M "$work/export/a.img" "$work/export/b.img"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
jq --arg l "tcp:127.0.0.1:$port" --arg d "$work/export" \
  '.listen = [$l] | .dev_search_path = $d | del(.hosts) | .allow_any_host = true' \
  "$root/etc/ibnbd/server.json.example" >"$work/etc/server.json" ||
  { echo "not ok - the example config is not JSON"; exit 1; }
read -ra srv_cmd <<<"$(unit_cmd ibnbd-server.service ExecStart)"
"${srv_cmd[@]}" >"$work/srv.log" 2>&1 &
srv_pid=$!
pids+=("$srv_pid")
ibnbd=$root$prefix/bin/ibnbd
for _ in $(seq 100); do "$ibnbd" --socket "$work/srv.sock" server session list >/dev/null 2>&1 && break; sleep 0.1; done
expect "the server unit's command serves its control socket" 0 "$ibnbd" --socket "$work/srv.sock" server session list
# EnvironmentFile: the installed default, then ours appended (systemd reads them in order).
cp "$root/etc/default/ibnbd-client" "$work/etc/default"
echo "IBNBD_CLIENT_OPTS=\"--hb-interval-ms 200 --ready-file $work/cl.ready\"" >>"$work/etc/default"
IBNBD_CLIENT_OPTS=
. "$work/etc/default"
read -ra cl_cmd <<<"$(unit_cmd ibnbd-client.service ExecStart | sed "s#\$IBNBD_CLIENT_OPTS#$IBNBD_CLIENT_OPTS#")"
"${cl_cmd[@]}" >"$work/cl.log" 2>&1 &
cl_pid=$!
pids+=("$cl_pid")
wait_for "$work/cl.ready" && ok "the client unit's command starts with its EnvironmentFile's options" ||
  not_ok "the client daemon started" "$(tail -3 "$work/cl.log")"

# Case: ibnbd-maps map with two good lines and one bad one. Expect: exit 1, both good devices
# mapped, the bad one named; a second run maps nothing new and says so; unmap: all gone.
cat >"$work/etc/maps" <<MAPS
# volumes of this host
a.img from tcp:127.0.0.1:$port rw session s1
nope.img from tcp:127.0.0.1:$port rw session s1   # not on the server
b.img from tcp:127.0.0.1:$port ro session s1
MAPS
read -ra map_cmd <<<"$(unit_cmd ibnbd-maps.service ExecStart)"
read -ra unmap_cmd <<<"$(unit_cmd ibnbd-maps.service ExecStop)"
export IBNBD_SOCKET=$work/cl.sock
expect "ibnbd-maps map with one bad line exits 1" 1 "${map_cmd[@]}" "$work/etc/maps"
grep -q "mapping nope.img failed" "$work/err" && ok "... naming the bad line's device" || not_ok "... naming the bad device" "$(cat "$work/err")"
n=$("$ibnbd" --socket "$work/cl.sock" client -f json device list | jq -r '[.[].device] | sort | join(",")')
[ "$n" = "a.img,b.img" ] && ok "... and the good lines are mapped" || not_ok "... and the good lines are mapped" "'$n'"
"${map_cmd[@]}" "$work/etc/maps" >"$work/out" 2>&1
grep -q "a.img is mapped already" "$work/out" && ok "a second map run leaves mapped devices alone" ||
  not_ok "a second map run leaves mapped devices alone" "$(cat "$work/out")"
expect "ibnbd-maps unmap exits 0" 0 "${unmap_cmd[@]}" "$work/etc/maps"
[ "$(sed -n 's/^ibnbd-maps: unmapped //p' "$work/out" | tr '\n' ' ')" = "b.img a.img " ] && ok "... in the reverse order" ||
  not_ok "... in the reverse order" "$(cat "$work/out")"
n=$("$ibnbd" --socket "$work/cl.sock" client -f json device list | jq length)
[ "$n" = 0 ] && ok "... and nothing is mapped" || not_ok "... and nothing is mapped" "$n devices"

# Case: systemctl stop: KillSignal to each daemon. Expect: both exit 0 within TimeoutStopSec.
for d in "ibnbd-client.service:$cl_pid" "ibnbd-server.service:$srv_pid"; do
  u=${d%%:*} p=${d##*:}
  sig=$(sed -n 's/^KillSignal=SIG//p' "$root$unitdir/$u")
  t=$(sed -n 's/^TimeoutStopSec=//p' "$root$unitdir/$u")
  kill -s "${sig:-TERM}" "$p"
  rc=0
  timeout "${t:-90}" tail --pid="$p" -f /dev/null || rc=$?
  wait "$p"
  st=$?
  [ "$rc" = 0 ] && [ "$st" = 0 ] && ok "$u stops on SIG${sig:-TERM} within ${t:-90} s" ||
    not_ok "$u stops on SIG${sig:-TERM}" "wait rc $rc, exit $st"
done
pids=()

exit $failed
