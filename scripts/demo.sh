#!/usr/bin/env bash
# The main job: installs what is needed, builds, then starts a server and a client on this
# machine that move and verify data over the fabric layer's tcp provider, and print throughput
# and latency. (Later issues replace this with the block-device demo.)
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build ibtrs-fabric-perf

perf=build/transport/ibtrs-fabric-perf
port=${IBTRS_DEMO_PORT:-18515}
addr="tcp:127.0.0.1:$port"
log=$(mktemp)
"$perf" server --listen "$addr" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 50); do grep -q listening "$log" && break; sleep 0.1; done
grep -q listening "$log" || { cat "$log"; echo "demo: server did not start"; exit 1; }

echo "== server process $server listening on $addr"
echo "== client: 20000 blocks of 64 KiB written into the server's memory (RDMA WRITE_WITH_IMM),"
echo "   checked there, written back by the server and checked again"
"$perf" client --connect "$addr" --test verify --size 64k --iters 20000 --depth 16
echo "== client: round-trip latency of 8-byte WRITE_WITH_IMM ping-pongs"
"$perf" client --connect "$addr" --test lat --iters 20000
echo "== client: streaming RDMA WRITE bandwidth"
"$perf" client --connect "$addr" --test bw --sizes 4k,64k,1m --seconds 1 --depth 32
sleep 0.2
echo "== server log"
cat "$log"
