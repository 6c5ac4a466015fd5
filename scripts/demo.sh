#!/usr/bin/env bash
# The main job: installs what is needed, builds, then on this machine
#   1. generates a host key (`ibnbd key generate`) and starts ibnbd-server exporting a sparse
#      file to that host only (every path authenticates with DH-HMAC-CHAP; others are refused),
#   2. starts ibnbd-client with the key and maps the file with `ibnbd client device map` over the
#      tcp fabric on loopback with two paths,
#   3. writes a pattern over the whole device and reads it back, verified, with a progress bar,
#   4. prints throughput and the per-path split, the sessions as both sides see them,
#   5. unmaps and stops everything (also on Ctrl-C or failure).
# Everything stays on 127.0.0.1 and in a temporary directory.
#
#   bash scripts/demo.sh [--size SIZE]        (default 1G; e.g. 256M for a quick look)
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
size=1G
while [ $# -gt 0 ]; do
  case "$1" in
    --size) size=$2; shift 2 ;;
    *) echo "usage: $0 [--size SIZE]" >&2; exit 2 ;;
  esac
done

bash scripts/setup.sh
# The same optimized build as scripts/test.sh (RelWithDebInfo), so the two share one tree.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C build ibnbd-server ibnbd-client ibnbd

bin=$top/build
srv=$bin/server/ibnbd-server
cli_daemon=$bin/client/daemon/ibnbd-client
ibnbd=$bin/client/cli/ibnbd
work=$(mktemp -d /var/tmp/ibnbd-demo.XXXXXX)
pids=()
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -S "$work/client.sock" ]; then
    "$ibnbd" --socket "$work/client.sock" client device unmap demo.img force >/dev/null 2>&1 || true
  fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ $rc -ne 0 ]; then
    echo "demo failed (exit $rc); daemon logs:" >&2
    tail -n 20 "$work"/*.log >&2 2>/dev/null || true
  fi
  rm -rf "$work"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_for() {  # wait_for FILE PID
  for _ in $(seq 100); do
    [ -e "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

mkdir -p "$work/export"
truncate -s "$size" "$work/export/demo.img"
echo "== ibnbd key generate: the client host's identity and secret (mode 0600)"
"$ibnbd" key generate host nqn.2014-08.org.nvmexpress:uuid:de300000-0000-4000-8000-000000000001 \
  server-key out "$work/host.key"
# The server knows the host by the same file and grants it demo.img rw, nothing else.
cat >"$work/server.json" <<JSON
{"hosts": [{"key_file": "$work/host.key", "access": [{"devices": "demo.img", "mode": "rw"}]}]}
JSON
echo "== ibnbd-server: exporting $work/export/demo.img ($size, sparse) on two loopback ports"
"$srv" --config "$work/server.json" --listen tcp:127.0.0.1:0 --listen tcp:127.0.0.1:0 \
  --dev-search-path "$work/export" \
  --control-socket "$work/server.sock" --ready-file "$work/server.ready" >"$work/server.log" 2>&1 &
pids+=($!)
wait_for "$work/server.ready" "${pids[-1]}" || { echo "ibnbd-server did not start" >&2; exit 1; }
mapfile -t addrs < <(sed -n 's/^listening //p' "$work/server.ready")
echo "   listening on ${addrs[*]}"

echo "== ibnbd-client: the client daemon, authenticating with the key (and checking the server's)"
"$cli_daemon" --host-key "$work/host.key" --control-socket "$work/client.sock" --ready-file "$work/client.ready" \
  >"$work/client.log" 2>&1 &
pids+=($!)
wait_for "$work/client.ready" "${pids[-1]}" || { echo "ibnbd-client did not start" >&2; exit 1; }

c() { "$ibnbd" --socket "$work/client.sock" client "$@"; }
s() { "$ibnbd" --socket "$work/server.sock" server "$@"; }

echo "== ibnbd client device map demo.img from ${addrs[*]} rw session demo"
c device map demo.img from "${addrs[@]}" rw session demo
echo
echo "== write a pattern over the whole device, read it back and verify it"
c device io demo.img bs 1M qd 16
echo
echo "== the session from the client"
c session list
echo
c path list demo
echo
echo "== and from the server: the session's host, its paths authenticated"
s session list
echo
s path list
echo
s host list
echo
s device list
echo
echo "== unmap"
c device unmap demo.img
c device list
echo "demo: ok"
