#!/bin/bash
# Guest half of tests/vm/check.sh: runs inside the VM (through run-in-vm.sh)
# and prints one "ok NAME" or "not ok NAME: REASON" line per check on stdout.
#
#   check-guest.sh RW_DIR PROBE_DIR
# RW_DIR is an --rw-share (a file written there must reach the host),
# PROBE_DIR is a host directory that is NOT shared read-write (writes must stay
# in the VM's overlay) and the --cwd of the run.
# shellcheck disable=SC2016,SC2317 # bash -c snippets expand in the child; helpers run via check()
set -uo pipefail

rw_dir="$1"
probe_dir="$2"

ok() { echo "ok $1"; }
not_ok() { echo "not ok $1: $2"; }
check() { # NAME COMMAND... (passes when COMMAND succeeds)
  local name="$1"
  shift
  local out
  if out="$("$@" 2>&1)"; then ok "$name"; else not_ok "$name" "$(echo "$out" | tail -n 3 | tr '\n' ' ')"; fi
}
counter() { cat "/sys/class/infiniband/$1/ports/1/hw_counters/$2" 2>/dev/null || echo 0; }
netstat_tx() { cat "/sys/class/net/$1/statistics/tx_packets" 2>/dev/null || echo 0; }

# --- environment
check kernel-6.12 bash -c '[[ "$(uname -r)" == 6.12.* ]]'
check env-IBTRS_VM test "${IBTRS_VM:-}" = 1
check env-addresses test "${IBTRS_RDMA_ADDR_A:-}/${IBTRS_RDMA_ADDR_B:-}" = 198.18.0.1/198.18.0.2
check env-devices test "${IBTRS_RDMA_DEV_A:-}/${IBTRS_RDMA_DEV_B:-}" = rxe0/rxe1
check env-gid-indexes bash -c '[[ "${IBTRS_RDMA_GID_INDEX_A:-}" =~ ^[0-9]+$ && "${IBTRS_RDMA_GID_INDEX_B:-}" =~ ^[0-9]+$ ]]'
check env-user-var test "${IBTRS_CHECK_VAR:-}" = "hello world"
check cwd test "$(pwd)" = "$probe_dir"

# --- device nodes
for f in /dev/infiniband/uverbs0 /dev/infiniband/uverbs1 /dev/infiniband/rdma_cm /dev/ublk-control /dev/nbd0; do
  check "exists-$f" test -e "$f"
done

# --- RDMA devices
devs="$(ibv_devices 2>&1)"
if grep -qw rxe0 <<<"$devs" && grep -qw rxe1 <<<"$devs"; then ok ibv_devices-rxe0-rxe1; else not_ok ibv_devices-rxe0-rxe1 "$devs"; fi
links="$(rdma link 2>&1)"
if grep -q 'rxe0/1 state ACTIVE .*netdev veth0' <<<"$links" && grep -q 'rxe1/1 state ACTIVE .*netdev veth1' <<<"$links"; then
  ok rdma-link-active
else
  not_ok rdma-link-active "$links"
fi

# rping SERVER_ADDR [CLIENT_SRC]: server in the background, client with -C 3.
rping_pair() {
  local srv="$1" src="${2:-}" srv_pid rc
  rping -s -a "$srv" -C 3 >/dev/null 2>&1 &
  srv_pid=$!
  sleep 0.5
  timeout 30 rping -c -a "$srv" ${src:+-I "$src"} -C 3 >/dev/null 2>&1
  rc=$?
  timeout 10 tail --pid="$srv_pid" -f /dev/null 2>/dev/null || kill "$srv_pid" 2>/dev/null
  wait "$srv_pid" 2>/dev/null
  return "$rc"
}
# Asserts that a transfer went out of rxe FROM (over veth NETDEV) into rxe TO.
traffic_check() { # NAME FROM TO NETDEV COMMAND...
  local name="$1" from="$2" to="$3" nd="$4"
  shift 4
  local s0 r0 t0 s1 r1 t1
  s0=$(counter "$from" sent_pkts) r0=$(counter "$to" rcvd_pkts) t0=$(netstat_tx "$nd")
  if ! "$@"; then not_ok "$name" "command failed: $*"; return; fi
  s1=$(counter "$from" sent_pkts) r1=$(counter "$to" rcvd_pkts) t1=$(netstat_tx "$nd")
  if [ $((s1 - s0)) -gt 5 ] && [ $((r1 - r0)) -gt 5 ] && [ $((t1 - t0)) -ge $((s1 - s0)) ]; then
    ok "$name"
  else
    not_ok "$name" "counters: $from sent +$((s1 - s0)), $to rcvd +$((r1 - r0)), $nd tx +$((t1 - t0))"
  fi
}
traffic_check rping-A-to-B rxe0 rxe1 veth0 rping_pair 198.18.0.2 198.18.0.1
traffic_check rping-B-to-A rxe1 rxe0 veth1 rping_pair 198.18.0.1 198.18.0.2
traffic_check rping-unbound-to-B rxe0 rxe1 veth0 rping_pair 198.18.0.2

write_bw() {
  local srv_pid rc
  timeout 60 ib_write_bw -d rxe1 -x "$IBTRS_RDMA_GID_INDEX_B" -F -n 200 >/dev/null 2>&1 &
  srv_pid=$!
  sleep 1
  timeout 60 ib_write_bw -d rxe0 -x "$IBTRS_RDMA_GID_INDEX_A" -F -n 200 198.18.0.2 >/dev/null 2>&1
  rc=$?
  wait "$srv_pid"
  return $(( rc | $? ))
}
traffic_check ib_write_bw-rxe0-to-rxe1 rxe0 rxe1 veth0 write_bw

# --- file systems
# /tmp is the overlay's: writable in RAM, with the host's /tmp content visible.
check tmp-writable-overlay bash -c '[ "$(stat -f -c %T /tmp)" = overlayfs ] && touch /tmp/x'
check write-host-tree-in-overlay bash -c "echo guest >'$probe_dir/created-in-guest' && echo guest >>'$probe_dir/existing'"
check rw-share-write bash -c "echo from-guest >'$rw_dir/from-guest'"

echo "marker-on-stderr" >&2
echo "marker-on-stdout"
exit 0
