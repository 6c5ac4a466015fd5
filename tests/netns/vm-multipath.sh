#!/usr/bin/env bash
# shellcheck disable=SC2317,SC2016  # trap handlers; text for bash -c
# Multipath over real RDMA (Soft-RoCE) and mixed rdma + tcp sessions, run INSIDE the VM rig:
#
#   tests/vm/run-in-vm.sh --timeout 600 -- bash tests/netns/vm-multipath.sh BUILD_DIR
#   (ctest: vm_multipath, label vm)
#
# The VM has rxe0 on veth0 (198.18.0.1) and rxe1 on veth1 (198.18.0.2), see tests/vm/README.md.
# The server listens on 198.18.0.2, the client binds 198.18.0.1; paths differ by server port.
# Scenarios (TAP-like "ok - NAME" / "not ok - NAME: reason"):
#   rdma-two-paths    two rdma paths; path 0 disconnected and reconnected through the client's
#                     --control FIFO under verified load: no failed request, both paths carry IO,
#                     path 0 is back and carries IO again, rxe0 really sent packets
#   mixed-disconnect  one rdma and one tcp path; the rdma path disconnected (--control): the IO
#                     continues on tcp with zero errors and verification passing
#   mixed-rdma-cut    the same, but the rdma path is cut silently: tc u32 filters on the ingress
#                     of veth0/veth1 drop RoCEv2 (udp 4791) while tcp still flows over the same
#                     veths; RC retries or heartbeats must detect it. Last, because rxe in this kernel was seen not to
#                     accept new rdma_cm connections for a while after such drops (rping).
# Exit status: 0 all ok, 1 a scenario failed, 77 skipped (not in the VM, no ibtrs-load, no jq).
# Env: IBTRS_NETNS_ONLY="..." runs only the named scenarios; IBTRS_NETNS_KEEP=1 keeps the logs
# (in the VM's RAM: only useful with the printed tails, which failures show anyway).
set -u -o pipefail

BUILD=${1:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

skip_all() {
  echo "1..0 # SKIP $*"
  exit 77
}

[[ -n $BUILD ]] || { echo "usage: $0 BUILD_DIR" >&2; exit 2; }
[[ ${IBTRS_VM:-} == 1 && -n ${IBTRS_RDMA_ADDR_A:-} && -n ${IBTRS_RDMA_ADDR_B:-} ]] ||
  skip_all "not inside the VM rig (IBTRS_VM/IBTRS_RDMA_ADDR_A unset): run it through tests/vm/run-in-vm.sh"
command -v jq >/dev/null || skip_all "no jq to read ibtrs-load --json output"
LOAD=""
for c in "$BUILD/transport/ibtrs-load" "$BUILD/ibtrs-load" "$BUILD/bin/ibtrs-load"; do
  if [[ -x $c ]]; then LOAD=$c; break; fi
done
[[ -n $LOAD ]] || skip_all "ibtrs-load not built in $BUILD (looked in transport/, ./, bin/)"

# ---- configuration (TCG: slow CPUs, millisecond stalls -> small loads, lenient heartbeats) ----
A=$IBTRS_RDMA_ADDR_A
B=$IBTRS_RDMA_ADDR_B
DEV_A=${IBTRS_RDMA_DEV_A:-rxe0}
NET_A=${IBTRS_RDMA_NETDEV_A:-veth0}
NET_B=${IBTRS_RDMA_NETDEV_B:-veth1}
P1=12361 P2=12362 P3=12363
HB_MS=300
HB_MISSED=10
HB_TIMEOUT_MS=$((HB_MS * HB_MISSED))
RECONNECT_MS=300
SIZE=$((16 << 20))
QD=8
COMMON=(--hb-interval-ms "$HB_MS" --hb-missed "$HB_MISSED")
RDMA1="rdma:$A@rdma:$B:$P1"
RDMA2="rdma:$A@rdma:$B:$P2"
TCP3="tcp:$A@tcp:$B:$P3"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ibtrs-vm-mp.XXXXXX")
NETNS_DIR=$HERE
SERVER_WRAP=()
CLIENT_WRAP=()
CLIENT_GRACE=60
SERVER_TIMEOUT=200
SERVER_READY_TRIES=300
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HERE/lib.sh"

CUT=0     # the RoCE drop filters are installed
CLSACT=0  # the clsact qdiscs that carry them exist
uncut() {
  tc filter del dev "$NET_A" ingress 2>/dev/null
  tc filter del dev "$NET_B" ingress 2>/dev/null
  CUT=0
}
# The first clsact qdisc flips a kernel static key (live code patching). Under TCG that has
# panicked the guest (tc_run) when traffic was flowing, so the qdiscs are made while the VM is
# idle and only filters come and go during a load.
add_clsact() {
  tc qdisc add dev "$NET_A" clsact && tc qdisc add dev "$NET_B" clsact && CLSACT=1
}
del_clsact() {
  tc qdisc del dev "$NET_A" clsact 2>/dev/null
  tc qdisc del dev "$NET_B" clsact 2>/dev/null
  CLSACT=0
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  kill_pids
  ((CUT)) && uncut
  ((CLSACT)) && del_clsact
  if [[ ${IBTRS_NETNS_KEEP:-0} == 1 ]]; then echo "# logs kept in $WORK"; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

want() { [[ -z ${IBTRS_NETNS_ONLY:-} || " $IBTRS_NETNS_ONLY " == *" $1 "* ]]; }
rxe_sent() { cat "/sys/class/infiniband/$1/ports/1/hw_counters/sent_pkts" 2>/dev/null || echo 0; }

# path_name NAME SELECTOR: the path's name as the client prints it in its interval lines
path_name() {
  grep '^interval ' "$WORK/$1.out" | head -n 1 | INTERVAL_SEL=$2 awk '
    BEGIN { sel = ENVIRON["INTERVAL_SEL"]; idx = substr(sel, 1, 1) == "#" ? substr(sel, 2) + 0 : -1 }
    { n = split($0, seg, / \| /)
      for (i = 2; i <= n; i++) { split(seg[i], f, " ")
        if ((idx >= 0 && i - 2 == idx) || (idx < 0 && index(f[1], sel))) { print f[1]; exit } } }'
}

# control NAME FIFO LINE: sends LINE to the client's --control FIFO and waits (20 s) for the
# client's "control: LINE: RESULT" answer; prints RESULT, 0 iff it is "ok"
control() {
  local name=$1 fifo=$2 line=$3 res=""
  for _ in $(seq 100); do [[ -p $fifo ]] && break; sleep 0.1; done
  if [[ ! -p $fifo ]]; then echo "no control FIFO $fifo"; return 1; fi
  timeout 5 bash -c 'printf "%s\n" "$1" >"$2"' _ "$line" "$fifo" || { echo "FIFO write failed"; return 1; }
  for _ in $(seq 200); do
    res=$(grep -F "control: $line: " "$WORK/$name.out" | tail -n 1)
    [[ -n $res ]] && break
    sleep 0.1
  done
  res=${res#"control: $line: "}
  echo "${res:-no answer}"
  [[ $res == ok ]]
}

# end_load_at MS: lets the client's load run until client time MS, then ends it with SIGINT (the
# client drains and prints its summary as at the end of --seconds). The clients run with a long
# --seconds and the scenario ends them: on a loaded host a TCG guest runs several times slower,
# and a fixed load length ran out before the scenario's steps were done.
end_load_at() {
  for _ in $(seq 900); do
    (($(client_ms) >= $1)) && break
    kill -0 "$CLIENT_PID" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -INT "$CLIENT_PID" 2>/dev/null
  return 0
}
LOAD_CAP=90  # --seconds of every client: the bound if a scenario never ends its load

# grew NAME SELECTOR FROM_MS: ops of the path grew after FROM_MS (client time)
grew() { (($(ops_last "$1" "$2") > $(ops_at "$1" "$2" "$3"))); }

# ---- 1. two rdma paths, disconnect + reconnect one ----------------------------------------------
scenario_rdma_two_paths() {
  local n=rdma-two-paths rc msg why=() fifo=$WORK/rdma-two-paths.ctl p0 s0 t_back t_end sent0 sent1
  start_server "$n" "rdma:$B:$P1" "rdma:$B:$P2" || { not_ok "$n" "$ERR"; return; }
  sent0=$(rxe_sent "$DEV_A")
  start_client "$n" "$LOAD_CAP" --path "$RDMA1" --path "$RDMA2" --policy round-robin --rw randrw --bs 4096 \
    --qd "$QD" --verify --interval-ms 500 --control "$fifo"
  if ! wait_busy "$n" 400 '#0' '#1'; then
    wait_client; stop_server
    not_ok "$n" "both rdma paths never carried IO (stderr: $(err_tail "$WORK/$n.err"))"
    return
  fi
  p0=$(path_name "$n" '#0')
  sleep 2
  msg=$(control "$n" "$fifo" "disconnect $p0") || why+=("disconnect $p0: $msg")
  note "$n: disconnect $p0 at client t=$(client_ms) ms: $msg"
  sleep 3
  msg=$(control "$n" "$fifo" "reconnect $p0") || why+=("reconnect $p0: $msg")
  t_back=$(client_ms)
  note "$n: reconnect $p0 at client t=${t_back} ms: $msg"
  end_load_at $((t_back + 6000))
  wait_client
  rc=$?
  stop_server
  sent1=$(rxe_sent "$DEV_A")
  client_summary "$n"
  msg=$(check_clean "$n" $rc) || why+=("$msg")
  s0=$(path_field "$n" '#0' state)
  [[ $s0 == connected ]] || why+=("path 0 ends in state '${s0:-none}', want connected")
  t_end=$(last_t "$n" '#0')
  grew "$n" '#0' $((t_end - 2500)) || why+=("path 0 carried no IO in the last 2.5 s after its reconnect")
  [[ $(path_ops "$n" '#1') -gt 0 ]] || why+=("path 1 carried no IO")
  note "$n: rxe0 sent_pkts $sent0 -> $sent1"
  ((sent1 > sent0)) || why+=("$DEV_A sent no packets: the IO did not go over Soft-RoCE")
  finish "$n" "${why[@]}"
}

# ---- 2./3. mixed rdma + tcp session, the rdma path goes away ------------------------------------
# scenario_mixed NAME HOW: HOW is "disconnect" (control FIFO) or "cut" (drop RoCEv2 on the veths)
scenario_mixed() {
  local n=$1 how=$2 rc msg why=() fifo=$WORK/$1.ctl prdma t_cut after st lat
  start_server "$n" "rdma:$B:$P1" "tcp:$B:$P3" || { not_ok "$n" "$ERR"; return; }
  start_client "$n" "$LOAD_CAP" --path "$RDMA1" --path "$TCP3" --policy round-robin --rw randrw --bs 4096 \
    --qd "$QD" --verify --interval-ms 500 --control "$fifo"
  if ! wait_busy "$n" 400 '#0' '#1'; then
    wait_client; stop_server
    not_ok "$n" "the rdma and tcp paths never both carried IO (stderr: $(err_tail "$WORK/$n.err"))"
    return
  fi
  prdma=$(path_name "$n" '#0')
  sleep 2
  if [[ $how == disconnect ]]; then
    msg=$(control "$n" "$fifo" "disconnect $prdma") || why+=("disconnect $prdma: $msg")
    t_cut=$(client_ms)
    note "$n: disconnect $prdma at client t=${t_cut} ms: $msg"
    after=$((t_cut + 1000))
  else
    CUT=1
    # Dropped on ingress: an egress drop returns an error to rxe's sender, which then fails
    # the QP at once; an ingress drop is a silent loss that only retries and heartbeats find.
    if ! msg=$({ tc filter add dev "$NET_A" ingress protocol ip u32 match ip protocol 17 0xff \
        match ip dport 4791 0xffff action drop &&
      tc filter add dev "$NET_B" ingress protocol ip u32 match ip protocol 17 0xff \
        match ip dport 4791 0xffff action drop; } 2>&1); then
      why+=("could not install the RoCEv2 drop filters: $msg")
    fi
    t_cut=$(client_ms)
    note "$n: RoCEv2 (udp 4791) dropped on $NET_A/$NET_B from client t=${t_cut} ms"
    after=$((t_cut + HB_TIMEOUT_MS + 1500))
  fi
  # The load goes on for 4 s after the client reports the rdma path down (60 s at most: a cut
  # is found by the heartbeat timeout, which ends late on a loaded host).
  for _ in $(seq 600); do
    grep -qF "path_down $prdma" "$WORK/$n.out" && break
    sleep 0.1
  done
  end_load_at $(($(client_ms) + 4000))
  wait_client
  rc=$?
  stop_server
  ((CUT)) && uncut
  # Judge the tcp path from the moment the client saw the rdma path go down, in the client's
  # own load time (the time of its interval lines; client_ms also counts the session's open,
  # seconds under a loaded TCG guest).
  local t_down
  t_down=$(awk -v p="$prdma" '$1 == "event" && $3 == "path_down" && index($4, p) == 1 {
    sub(/s$/, "", $2); printf "%d", $2 * 1000; exit }' "$WORK/$n.out")
  [[ -n $t_down ]] && after=$((t_down + 500))
  client_summary "$n"
  msg=$(check_clean "$n" $rc) || why+=("$msg")
  grew "$n" '#1' "$after" || why+=("the tcp path carried no IO after the rdma path went away")
  if grew "$n" '#0' "$after"; then why+=("the rdma path still counted IO after it went away"); fi
  st=$(path_field "$n" '#0' state)
  [[ $st != connected ]] || why+=("the rdma path ends connected, want it down")
  lat=$(jfield "$n" .lat_max_us)
  note "$n: rdma path ends '$st'; lat_max_us=$lat"
  if [[ $how == cut && $lat =~ ^[0-9.]+$ ]] &&
    awk -v p="$lat" -v l=$(((HB_TIMEOUT_MS + 2000) * 1000)) 'BEGIN { exit !(p > l) }'; then
    why+=("lat_max_us $lat: a request waited longer than heartbeat timeout $HB_TIMEOUT_MS + 2000 ms")
  fi
  finish "$n" "${why[@]}"
  # Closing the session cancels a pending rdma (re)connect instead of waiting out the path's
  # connect_timeout (30 s): the cut path is usually mid-reconnect when the load ends.
  local open_s teardown
  open_s=$(grep '^event .* path_up ' "$WORK/$n.out" | head -n 2 | awk '{ t = $2 } END { print t + 0 }')
  teardown=$(awk -v w="$CLIENT_WALL_MS" -v o="$open_s" -v l="$(jfield "$n" .seconds)" \
    'BEGIN { printf "%d", w - (o + l) * 1000 }')
  echo "# measured: $n session teardown ${teardown} ms (client ${CLIENT_WALL_MS} ms - open ${open_s} s - load)"
  if ((teardown > 10000)); then
    not_ok "$n-teardown" "the client took ${teardown} ms to close after its load"
  else
    ok "$n-teardown"
  fi
}

note "VM $(uname -r), ibtrs-load $LOAD, $A ($DEV_A/$NET_A) -> $B, heartbeat ${HB_MS}ms x $HB_MISSED"
want rdma-two-paths && scenario_rdma_two_paths
want mixed-disconnect && scenario_mixed mixed-disconnect disconnect
if want mixed-rdma-cut; then
  if msg=$(add_clsact 2>&1); then
    sleep 1  # let the code patching settle before traffic starts
    scenario_mixed mixed-rdma-cut cut
  else
    not_ok mixed-rdma-cut "cannot add clsact qdiscs: $msg"
  fi
fi
note "done in $(now_ms) ms"
exit "$FAILED"
