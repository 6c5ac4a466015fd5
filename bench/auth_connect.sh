#!/usr/bin/env bash
# Connect time with and without host authentication: bench/auth_connect.cc (one in-process
# server, client sessions of one path opened one after the other on loopback tcp), printed as a
# markdown table with the host and its load before and after. A benchmark, not a test: it
# asserts nothing. Figures: docs/security.d/auth-bench.md.
#
#   bash bench/auth_connect.sh [--count N] [--io-threads T]
#
# The build directory comes from $IBTRS_BUILD (default build).
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
build=${IBTRS_BUILD:-build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
ninja -C "$build" auth-connect >/dev/null
echo "host: $(nproc) CPUs, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), kernel $(uname -r)"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "command: bash bench/auth_connect.sh $*"
echo
"$build/bench/auth-connect" --fabric tcp "$@"
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
