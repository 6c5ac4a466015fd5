#!/usr/bin/env bash
# Multipath failover and policy tests over network namespaces (tcp fabric), with ibtrs-load.
#
#   bash tests/netns/multipath.sh BUILD_DIR        (ctest: netns_multipath, label netns)
#
# Two namespaces, "client" and "server", joined by two veth pairs:
#   pair A  vca 198.18.10.1/24 <-> vsa 198.18.10.2/24
#   pair B  vcb 198.18.11.1/24 <-> vsb 198.18.11.2/24
# Only 198.18.0.0/15 (benchmarking range) addresses, nothing routed out of the namespaces.
# One ibtrs-load server per scenario listens on both server addresses; the client session has one
# path per pair. Scenarios (TAP-like output, "ok - NAME" / "not ok - NAME: reason"):
#   failover   pair A down (client side) during a verified randrw run: no failed request, no
#              verify error, path B carries the IO afterwards, neither the IO pause nor any
#              request's latency exceeds heartbeat timeout + 1 s
#   failover-silent  the same with the server side of pair A down: the client's link stays up
#   link-back  pair A down, then up again during a run: path A reconnects and carries IO again
#   delay      5 ms one-way delay on pair A (netem; without sch_netem a TUN link with the same
#              delay made by tundelay.py stands in for pair A): min-latency and min-inflight send
#              most of the IO to path B
#   tbf        both pairs shaped to the same rate: two paths give >= 1.5x the IOPS of one
# Exit status: 0 all ok, 1 a scenario failed, 77 skipped (not root, no `ip netns`, no
# ibtrs-load, no jq). Env: IBTRS_NETNS_ONLY="failover delay" runs only those scenarios;
# IBTRS_NETNS_KEEP=1 keeps the scratch directory with every log.
# shellcheck disable=SC2317  # functions called from traps
set -u -o pipefail

BUILD=${1:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

skip_all() {
  echo "1..0 # SKIP $*"
  exit 77
}

[[ -n $BUILD ]] || { echo "usage: $0 BUILD_DIR" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || skip_all "not root (uid $(id -u)): network namespaces need CAP_SYS_ADMIN"
command -v ip >/dev/null || skip_all "no ip(8) (iproute2)"
command -v jq >/dev/null || skip_all "no jq to read ibtrs-load --json output"
LOAD=""
for c in "$BUILD/transport/ibtrs-load" "$BUILD/ibtrs-load" "$BUILD/bin/ibtrs-load"; do
  if [[ -x $c ]]; then LOAD=$c; break; fi
done
[[ -n $LOAD ]] || skip_all "ibtrs-load not built in $BUILD (looked in transport/, ./, bin/)"

# ---- configuration ----------------------------------------------------------------------------
NSC=ibtrs-c-$$
NSS=ibtrs-s-$$
PORT=12346
HB_MS=200
HB_MISSED=5
HB_TIMEOUT_MS=$((HB_MS * HB_MISSED))
RECONNECT_MS=200
SIZE=$((64 << 20))
A_SRC=198.18.10.1 A_DST=198.18.10.2
B_SRC=198.18.11.1 B_DST=198.18.11.2
C_SRC=198.18.12.1 C_DST=198.18.12.2  # the tundelay.py link (delay scenario without netem)
PATH_A="tcp:$A_SRC@tcp:$A_DST:$PORT"
PATH_B="tcp:$B_SRC@tcp:$B_DST:$PORT"
PATH_C="tcp:$C_SRC@tcp:$C_DST:$PORT"
COMMON=(--hb-interval-ms "$HB_MS" --hb-missed "$HB_MISSED")

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ibtrs-netns.XXXXXX")
NETNS_DIR=$HERE
SERVER_WRAP=(ip netns exec "$NSS")
CLIENT_WRAP=(ip netns exec "$NSC")
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HERE/lib.sh"

cleanup() {
  local rc=$? ns p
  trap - EXIT INT TERM HUP
  kill_pids
  # Whatever still runs inside our namespaces was started by this script.
  for ns in "$NSC" "$NSS"; do
    if [[ -e /run/netns/$ns ]]; then
      for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null
    fi
  done
  if [[ ${IBTRS_NETNS_KEEP:-0} == 1 ]]; then
    echo "# logs kept in $WORK"
  else
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# ---- namespaces -------------------------------------------------------------------------------
if ! err=$(ip netns add "$NSC" 2>&1); then
  skip_all "ip netns add failed: $err"
fi
if ! err=$(ip netns add "$NSS" 2>&1); then
  skip_all "ip netns add failed: $err"
fi

setup_links() {
  local c s
  ip -n "$NSC" link set lo up && ip -n "$NSS" link set lo up || return 1
  for c in vca:vsa:$A_SRC:$A_DST vcb:vsb:$B_SRC:$B_DST; do
    IFS=: read -r c s src dst <<<"$c"
    ip -n "$NSC" link add name "$c" type veth peer name "$s" netns "$NSS" || return 1
    ip -n "$NSC" addr add "$src/24" dev "$c" || return 1
    ip -n "$NSS" addr add "$dst/24" dev "$s" || return 1
    ip -n "$NSC" link set "$c" up || return 1
    ip -n "$NSS" link set "$s" up || return 1
  done
  # IPv6 off: no DAD/RS noise on the links.
  for ns in "$NSC" "$NSS"; do
    ip netns exec "$ns" sysctl -q -w net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 \
      2>/dev/null
  done
  return 0
}
if ! err=$(setup_links 2>&1); then
  skip_all "could not create the veth pairs in the namespaces: $err"
fi
note "namespaces $NSC / $NSS, ibtrs-load $LOAD, work dir $WORK"

want() { [[ -z ${IBTRS_NETNS_ONLY:-} || " $IBTRS_NETNS_ONLY " == *" $1 "* ]]; }

# ---- 1. failover ------------------------------------------------------------------------------
# scenario_failover NAME NS DEV: cut pair A by setting DEV down in NS. The client side's veth
# (failover) fails fast: its route goes away and sends fail. The server side's veth
# (failover-silent) leaves the client's link up and its packets silently dropped, so only the
# heartbeats can tell.
scenario_failover() {
  local n=$1 cut_ns=$2 cut_dev=$3 rc msg t_down d_a d_b pause latmax why=()
  start_server "$n" "tcp:$A_DST:$PORT" "tcp:$B_DST:$PORT" || { not_ok "$n" "$ERR"; return; }
  start_client "$n" 8 --path "$PATH_A" --path "$PATH_B" --rw randrw --bs 4096 --qd 32 --verify \
    --interval-ms 250
  if ! wait_busy "$n" 150 "$A_DST" "$B_DST"; then
    wait_client; stop_server
    not_ok "$n" "both paths never carried IO before the cut (stderr: $(err_tail "$WORK/$n.err" 2))"
    return
  fi
  sleep 2
  ip -n "$cut_ns" link set "$cut_dev" down
  t_down=$(client_ms)
  note "$n: pair A down ($cut_dev) at client t=${t_down} ms"
  wait_client
  rc=$?
  ip -n "$cut_ns" link set "$cut_dev" up
  stop_server
  client_summary "$n"
  msg=$(check_clean "$n" $rc) || why+=("$msg")
  pause=$(jfield "$n" .max_pause_ms)
  latmax=$(jfield "$n" .lat_max_us)
  # Path B must have carried IO after the failure was detected; path A none after the cut.
  d_b=$(($(ops_last "$n" "$B_DST") - $(ops_at "$n" "$B_DST" $((t_down + HB_TIMEOUT_MS + 500)))))
  d_a=$(($(ops_last "$n" "$A_DST") - $(ops_at "$n" "$A_DST" $((t_down + HB_TIMEOUT_MS + 500)))))
  note "$n: after cut+hb timeout: path A +$d_a ops, path B +$d_b ops; max_pause_ms=$pause," \
    "lat_max_us=$latmax (limit for both $((HB_TIMEOUT_MS + 1000)) ms)"
  echo "# measured: $n max_pause_ms $pause lat_max_ms $(awk -v l="$latmax" 'BEGIN { printf "%.1f", l / 1000 }')"
  ((d_b > 0)) || why+=("path B carried no IO after pair A went down")
  ((d_a == 0)) || why+=("path A still counted $d_a ops after its link was down")
  if [[ ! $pause =~ ^[0-9.]+$ ]]; then
    why+=("no max_pause_ms in the JSON")
  elif awk -v p="$pause" -v l=$((HB_TIMEOUT_MS + 1000)) 'BEGIN { exit !(p > l) }'; then
    why+=("max_pause_ms $pause > heartbeat timeout $HB_TIMEOUT_MS + 1000")
  fi
  # With path B busy the completion stream barely pauses; the requests caught on path A wait for
  # the failure to be detected and failed over: their latency is the failover time.
  if [[ ! $latmax =~ ^[0-9.]+$ ]]; then
    why+=("no lat_max_us in the JSON")
  elif awk -v p="$latmax" -v l=$(((HB_TIMEOUT_MS + 1000) * 1000)) 'BEGIN { exit !(p > l) }'; then
    why+=("lat_max_us $latmax: a request waited longer than heartbeat timeout $HB_TIMEOUT_MS + 1000 ms")
  fi
  finish "$n" "${why[@]}"
}

# ---- 2. link back -----------------------------------------------------------------------------
scenario_link_back() {
  local n=link-back rc msg t_up t_end a_up a_end rec st why=()
  start_server $n "tcp:$A_DST:$PORT" "tcp:$B_DST:$PORT" || { not_ok $n "$ERR"; return; }
  start_client $n 14 --path "$PATH_A" --path "$PATH_B" --rw randrw --bs 4096 --qd 32 --verify \
    --interval-ms 250
  if ! wait_busy $n 150 "$A_DST" "$B_DST"; then
    wait_client; stop_server
    not_ok $n "both paths never carried IO (stderr: $(err_tail "$WORK/$n.err" 2))"
    return
  fi
  sleep 1
  ip -n "$NSC" link set vca down
  note "$n: pair A down at client t=$(client_ms) ms"
  sleep 2
  ip -n "$NSC" link set vca up
  t_up=$(client_ms)
  note "$n: pair A up at client t=${t_up} ms"
  wait_client
  rc=$?
  stop_server
  client_summary $n
  msg=$(check_clean $n $rc) || why+=("$msg")
  rec=$(path_field $n "$A_DST" reconnects_ok)
  st=$(path_field $n "$A_DST" state)
  [[ ${rec:-0} -ge 1 ]] || why+=("path A reconnects_ok=${rec:-none}, want >= 1")
  [[ $st == connected ]] || why+=("path A ends in state '${st:-none}', want connected")
  # Path A's op count must grow again in the last 2 s of the run.
  t_end=$(last_t $n "$A_DST")
  a_up=$(ops_at $n "$A_DST" $((t_end - 2000)))
  a_end=$(ops_last $n "$A_DST")
  note "$n: path A ops $a_up at t=$((t_end - 2000)) ms -> $a_end at t=$t_end ms"
  ((a_end > a_up)) || why+=("path A carried no IO in the last 2 s (ops stayed at $a_end)")
  finish $n "${why[@]}"
}

# ---- 3. delay ---------------------------------------------------------------------------------
ML_MIN_PCT=90   # min-latency: share of ops on the fast path
MI_MIN_PCT=70   # min-inflight
scenario_delay() {
  local n=delay how="" err slow_dst slow_path td_pid="" msg why=() pol name rc pa pb pct min
  if err=$(ip netns exec "$NSC" tc qdisc add dev vca root netem delay 5ms 2>&1) &&
    err=$(ip netns exec "$NSS" tc qdisc add dev vsa root netem delay 5ms 2>&1); then
    how="netem delay 5ms on both ends of pair A"
    slow_dst=$A_DST slow_path=$PATH_A
  else
    note "$n: no netem ($(echo "$err" | head -n 1)); trying a TUN link with tundelay.py"
    local py
    py=$(command -v python3)
    if [[ -z $py ]]; then
      ok "$n # SKIP no netem: $(echo "$err" | head -n 1); no python3 for tundelay.py"
      return
    fi
    "$py" "$HERE/tundelay.py" --ns-a "$NSC" --dev-a tdc --addr-a "$C_SRC/24" \
      --ns-b "$NSS" --dev-b tds --addr-b "$C_DST/24" --delay-ms 5 \
      --ready-file "$WORK/tundelay.ready" 2>"$WORK/tundelay.err" &
    td_pid=$!
    PIDS+=("$td_pid")
    for _ in $(seq 50); do [[ -e $WORK/tundelay.ready ]] && break; sleep 0.1; done
    if [[ ! -e $WORK/tundelay.ready ]]; then
      ok "$n # SKIP no netem: $(echo "$err" | head -n 1); tundelay.py failed: $(tail -n 1 "$WORK/tundelay.err")"
      return
    fi
    how="no sch_netem; TUN link 198.18.12.0/24 with 5 ms one-way delay (tundelay.py) as the slow path"
    slow_dst=$C_DST slow_path=$PATH_C
  fi
  note "$n: $how"
  for pol in min-latency min-inflight; do
    name=$n-$pol
    # A fresh server per run: --verify expects never-written blocks to read as zeros.
    if ! start_server "$name" "tcp:$slow_dst:$PORT" "tcp:$B_DST:$PORT"; then
      why+=("$pol: $ERR")
      continue
    fi
    start_client "$name" 5 --path "$slow_path" --path "$PATH_B" --policy $pol --rw randrw \
      --bs 4096 --qd 32 --verify
    wait_client
    rc=$?
    stop_server
    client_summary "$name"
    msg=$(check_clean "$name" $rc) || { why+=("$pol: $msg"); continue; }
    pa=$(path_ops "$name" "$slow_dst")
    pb=$(path_ops "$name" "$B_DST")
    if ((pa + pb == 0)); then why+=("$pol: no ops counted on the paths"); continue; fi
    pct=$((100 * pb / (pa + pb)))
    min=$ML_MIN_PCT
    [[ $pol == min-inflight ]] && min=$MI_MIN_PCT
    note "$n: $pol: fast path B $pb ops, delayed path $pa ops: ${pct}% on B (want >= ${min}%)"
    echo "# measured: delay $pol B-share ${pct}% ($pb of $((pa + pb)) ops)"
    ((pct >= min)) || why+=("$pol sent only ${pct}% of IO to path B (want >= ${min}%)")
  done
  if [[ -n $td_pid ]]; then
    kill -TERM "$td_pid" 2>/dev/null
    wait "$td_pid" 2>/dev/null
  else
    ip netns exec "$NSC" tc qdisc del dev vca root 2>/dev/null
    ip netns exec "$NSS" tc qdisc del dev vsa root 2>/dev/null
  fi
  if ((${#why[@]})); then finish $n "${why[@]}"; else ok "$n # $how"; fi
}

# ---- 4. rate shaping --------------------------------------------------------------------------
TBF_RATE=200mbit
TBF_MIN_RATIO=1.5
scenario_tbf() {
  local n=tbf err dev msg why=() i1 i2 rc ratio name
  for dev in "$NSC:vca" "$NSC:vcb" "$NSS:vsa" "$NSS:vsb"; do
    if ! err=$(ip netns exec "${dev%%:*}" tc qdisc add dev "${dev#*:}" root tbf rate $TBF_RATE \
      burst 256kb latency 100ms 2>&1); then
      ok "$n # SKIP no tbf: $(echo "$err" | head -n 1)"
      ip netns exec "$NSC" tc qdisc del dev vca root 2>/dev/null
      ip netns exec "$NSC" tc qdisc del dev vcb root 2>/dev/null
      ip netns exec "$NSS" tc qdisc del dev vsa root 2>/dev/null
      return
    fi
  done
  note "$n: tbf rate $TBF_RATE on both ends of both pairs"
  SERVER_EXTRA=(--chunk-size 256k)  # room for 128 KiB IOs plus the header
  if start_server $n "tcp:$A_DST:$PORT" "tcp:$B_DST:$PORT"; then
    for name in $n-1path $n-2paths; do
          if [[ $name == *-1path ]]; then
        start_client "$name" 5 --path "$PATH_A" --rw write --bs 131072 --qd 16
      else
        start_client "$name" 5 --path "$PATH_A" --path "$PATH_B" --policy min-inflight --rw write \
          --bs 131072 --qd 16
      fi
      wait_client
      rc=$?
      client_summary "$name"
      msg=$(check_clean "$name" $rc) || why+=("$name: $msg")
    done
    stop_server
    SERVER_EXTRA=()
    i1=$(jfield $n-1path .iops)
    i2=$(jfield $n-2paths .iops)
    if [[ $i1 =~ ^[0-9.]+$ && $i2 =~ ^[0-9.]+$ ]]; then
      ratio=$(awk -v a="$i1" -v b="$i2" 'BEGIN { if (a > 0) printf "%.2f", b / a; else print 0 }')
      note "$n: 1 path $i1 IOPS, 2 paths $i2 IOPS: ratio ${ratio}x (want >= ${TBF_MIN_RATIO}x," \
        "target 1.8x)"
      echo "# measured: tbf ratio ${ratio}x"
      awk -v r="$ratio" -v m=$TBF_MIN_RATIO 'BEGIN { exit !(r >= m) }' ||
        why+=("2 paths gave only ${ratio}x the IOPS of 1 path ($i2 vs $i1)")
    else
      why+=("no IOPS figures (1 path: '$i1', 2 paths: '$i2')")
    fi
  else
    why+=("$ERR")
  fi
  for dev in "$NSC:vca" "$NSC:vcb" "$NSS:vsa" "$NSS:vsb"; do
    ip netns exec "${dev%%:*}" tc qdisc del dev "${dev#*:}" root 2>/dev/null
  done
  finish $n "${why[@]}"
}

want failover && scenario_failover failover "$NSC" vca
want failover-silent && scenario_failover failover-silent "$NSS" vsa
want link-back && scenario_link_back
want delay && scenario_delay
want tbf && scenario_tbf

note "done in $(now_ms) ms"
exit "$FAILED"
