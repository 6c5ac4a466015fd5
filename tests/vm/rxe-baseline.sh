#!/bin/bash
# Soft-RoCE baseline: perftest ib_write_bw / ib_write_lat between rxe0
# (198.18.0.1, client) and rxe1 (198.18.0.2, server) inside the VM rig.
# These figures are the ceiling for the project's RDMA benchmarks in the VM.
#
#   tests/vm/run-in-vm.sh [--mtu 9000] -- tests/vm/rxe-baseline.sh [SECONDS]
#
# SECONDS: duration of each bandwidth test (default 5). Latency tests run
# 2000 iterations. Prints the exact commands and perftest's result lines.
set -uo pipefail

[ "${IBTRS_VM:-}" = 1 ] || { echo "run this inside the VM: tests/vm/run-in-vm.sh -- $0" >&2; exit 2; }
dur="${1:-5}"
B="$IBTRS_RDMA_ADDR_B"
GA="$IBTRS_RDMA_GID_INDEX_A" GB="$IBTRS_RDMA_GID_INDEX_B"
log="$(mktemp -d)"

# Waits until the perftest server listens on its port (18515): over TCP for
# the GID mode, as an rdma_cm listener for -R.
wait_listen() { # CM(0|1)
  local i
  for ((i = 0; i < 200; i++)); do
    if [ "$1" = 1 ]; then
      rdma resource show cm_id 2>/dev/null | grep -q 'state LISTEN.*:18515' && return 0
    else
      ss -Hltn 'sport = :18515' 2>/dev/null | grep -q . && return 0
    fi
    sleep 0.1
  done
  return 1
}
run_pair() { # CM(0|1) -- SERVER-CMD... -- CLIENT-CMD...
  local cm="$1" srv=() cli=()
  shift 2
  while [ "$1" != -- ]; do srv+=("$1"); shift; done
  shift
  cli=("$@")
  echo "### server: ${srv[*]}"
  echo "### client: ${cli[*]}"
  timeout 120 "${srv[@]}" >"$log/srv" 2>&1 &
  local spid=$! rc
  wait_listen "$cm" || echo "(server not listening after 20 s)"
  timeout 120 "${cli[@]}" >"$log/cli" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    kill "$spid" 2>/dev/null
    wait "$spid" 2>/dev/null
    echo "client failed (rc=$rc):"
    tail -n 5 "$log/cli"
    return
  fi
  wait "$spid"
  grep -A1 '#bytes' "$log/cli"
}
pair() { # TOOL ARGS...: server on rxe1, client on rxe0 -> B, GIDs by index
  local tool="$1"
  shift
  run_pair 0 -- "$tool" -d "$IBTRS_RDMA_DEV_B" -x "$GB" -F "$@" \
    -- "$tool" -d "$IBTRS_RDMA_DEV_A" -x "$GA" -F "$@" "$B"
}
pair_cm() { # TOOL ARGS...: the same with rdma_cm connection setup (-R)
  local tool="$1"
  shift
  run_pair 1 -- "$tool" -R -F "$@" -- "$tool" -R -F "$@" "$B"
}

echo "kernel $(uname -r), $(nproc) vCPUs, veth MTU $(cat /sys/class/net/veth0/mtu)," \
  "RoCE active_mtu $(ibv_devinfo -d rxe0 | awk '/active_mtu/ {print $2}')," \
  "GID index A=$GA B=$GB"
for size in 4096 65536 1048576; do
  pair ib_write_bw -s "$size" -D "$dur"
done
pair_cm ib_write_bw -s 65536 -D "$dur"
pair ib_write_bw -s 65536 -q 4 -D "$dur"
for size in 64 4096; do
  pair ib_write_lat -s "$size" -n 2000
done
pair_cm ib_write_lat -s 64 -n 2000
rm -rf -- "$log"
