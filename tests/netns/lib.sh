# Shared helpers of tests/netns/multipath.sh and tests/netns/vm-multipath.sh (sourced).
#
# The caller sets: WORK (scratch dir), LOAD (ibtrs-load), COMMON (args for server and client),
# CLIENT_WRAP / SERVER_WRAP (arrays put in front of the command, e.g. (ip netns exec NS); may be
# empty), SIZE, RECONNECT_MS.
#
# A path is selected in the client's JSON and interval output by a SELECTOR: "#N" is the N-th
# --path (from 0), anything else a substring of the path's name (e.g. its destination address).
# shellcheck shell=bash disable=SC2317,SC2034,SC2016  # traps; globals for the caller; jq text

PIDS=()          # background processes we started (timeout(1) wrappers), killed by kill_pids
FAILED=0
T0=$(date +%s%N)

now_ms() { echo $((($(date +%s%N) - T0) / 1000000)); }
note() { echo "# [$(now_ms) ms] $*"; }
ok() { echo "ok - $*"; }
not_ok() { echo "not ok - $1: $2"; FAILED=1; }
join() { local IFS=$'\n'; echo "$*" | paste -sd '|' - | sed 's/|/; /g'; }
# finish NAME WHY...: "ok - NAME" when no reason is given, else "not ok - NAME: r1; r2"
finish() {
  local n=$1; shift
  if (($#)); then not_ok "$n" "$(join "$@")"; else ok "$n"; fi
}
err_tail() { tail -n "${2:-3}" "$1" 2>/dev/null | tr '\n' ' '; }

kill_pids() {
  local p alive
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for _ in $(seq 30); do
    alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  PIDS=()
}

# ---- server -----------------------------------------------------------------------------------
SERVER_PID=""
SERVER_EXTRA=()  # more server arguments for the next start_server
ERR=""
# start_server NAME LISTEN_ADDRESS...: 0 when it is listening, else 1 with the reason in $ERR.
# Call it directly, not in $(...): SERVER_PID and PIDS must be set in this shell.
start_server() {
  local name=$1; shift
  local args=() a ready=$WORK/$name.server.ready
  for a in "$@"; do args+=(--listen "$a"); done
  rm -f "$ready"
  "${SERVER_WRAP[@]}" timeout -k 3 "${SERVER_TIMEOUT:-180}" "$LOAD" server "${args[@]}" \
    "${COMMON[@]}" "${SERVER_EXTRA[@]}" --size "$SIZE" --ready-file "$ready" \
    >"$WORK/$name.server.out" 2>"$WORK/$name.server.err" &
  SERVER_PID=$!
  PIDS+=("$SERVER_PID")
  for _ in $(seq "${SERVER_READY_TRIES:-100}"); do
    [[ -e $ready ]] && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.1
  done
  ERR="server did not become ready: $(err_tail "$WORK/$name.server.err")"
  return 1
}

stop_server() {
  [[ -n $SERVER_PID ]] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=""
}

# ---- client -----------------------------------------------------------------------------------
CLIENT_PID=""
CLIENT_T0=0
# start_client NAME SECONDS ARGS...: a background client run, stdout in $WORK/NAME.out
start_client() {
  local name=$1 secs=$2; shift 2
  CLIENT_T0=$(now_ms)
  "${CLIENT_WRAP[@]}" timeout -k 3 $((secs + ${CLIENT_GRACE:-25})) "$LOAD" client \
    --session "$name-$$" "${COMMON[@]}" --reconnect-delay-ms "$RECONNECT_MS" --size "$SIZE" \
    --seconds "$secs" --json "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  CLIENT_PID=$!
  PIDS+=("$CLIENT_PID")
}
# ms since the running client was started (to compare with its interval timestamps)
client_ms() { echo $(($(now_ms) - CLIENT_T0)); }

# wait_client: the client's exit status (124 = timeout(1) killed it); CLIENT_WALL_MS is how long
# the client process ran
CLIENT_WALL_MS=0
wait_client() {
  local rc
  wait "$CLIENT_PID"
  rc=$?
  CLIENT_PID=""
  CLIENT_WALL_MS=$(client_ms)
  return $rc
}

# ---- reading the output -----------------------------------------------------------------------
# The final JSON object of a client run.
final_json() { grep '^{' "$WORK/$1.out" | tail -n 1; }
# jfield NAME JQ_EXPR
jfield() { final_json "$1" | jq -r "$2" 2>/dev/null; }

JQ_PATH='def pick($s): if ($s | startswith("#")) then .paths[($s[1:] | tonumber)]
  else ([.paths[] | select(.name | contains($s))][0]) end;'
# path_field NAME SELECTOR FIELD
path_field() {
  final_json "$1" | jq -r --arg s "$2" --arg f "$3" "$JQ_PATH"' pick($s)[$f] // empty' 2>/dev/null
}
# path_ops NAME SELECTOR: reads + writes of that path
path_ops() {
  final_json "$1" | jq -r --arg s "$2" "$JQ_PATH"' pick($s) | ((.reads // 0) + (.writes // 0))' \
    2>/dev/null
}

# interval_series NAME SELECTOR -> "T_MS OPS" lines from the --interval-ms output (T_MS since the
# client started, OPS the path's cumulative reads + writes).
interval_series() {
  grep -v '^{' "$WORK/$1.out" | INTERVAL_SEL=$2 awk -f "$NETNS_DIR/interval.awk"
}
# ops of a path at the last sample taken at or before T_MS, at the end, and the last sample's time
ops_at() { interval_series "$1" "$2" | awk -v t="$3" '$1 <= t { v = $2 } END { print v + 0 }'; }
ops_last() { interval_series "$1" "$2" | awk '{ v = $2 } END { print v + 0 }'; }
last_t() { interval_series "$1" "$2" | awk '{ v = $1 } END { print v + 0 }'; }

# wait_busy NAME TRIES SELECTOR...: until every listed path has carried IO in the interval output
# (TRIES x 0.1 s at most); 1 when the client exited or time ran out
wait_busy() {
  local name=$1 tries=$2 s n; shift 2
  for _ in $(seq "$tries"); do
    n=0
    for s in "$@"; do
      [[ $(interval_series "$name" "$s" | awk '$2 > 0' | head -n 1) ]] && n=$((n + 1))
    done
    ((n == $#)) && return 0
    [[ -n $CLIENT_PID ]] && ! kill -0 "$CLIENT_PID" 2>/dev/null && return 1
    sleep 0.1
  done
  return 1
}

client_summary() {
  local name=$1 j
  j=$(final_json "$name" | jq -c '{ops, iops, mib_s, errors, verify_errors, lat_p50_us, lat_p99_us,
    lat_max_us, max_pause_ms, paths: [.paths[] | {name, state, ops: ((.reads // 0) + (.writes // 0)),
    failovered, reconnects_ok}]}' 2>/dev/null)
  note "$name: ${j:-no JSON; stderr: $(err_tail "$WORK/$name.err")}"
  note "$name: client ran ${CLIENT_WALL_MS} ms in all; load $(jfield "$name" .seconds) s; last event:" \
    "$(grep '^event ' "$WORK/$name.out" | tail -n 1)"
}

# check_clean NAME RC: exit 0, a JSON line, zero errors and verify errors; else prints the problem
check_clean() {
  local name=$1 rc=$2 e v
  if [[ -z $(final_json "$name") ]]; then
    echo "no JSON result (exit $rc; stderr: $(err_tail "$WORK/$name.err"))"
    return 1
  fi
  e=$(jfield "$name" .errors)
  v=$(jfield "$name" .verify_errors)
  if [[ $rc -ne 0 || $e != 0 || $v != 0 ]]; then
    echo "exit $rc, errors=$e, verify_errors=$v (stderr: $(err_tail "$WORK/$name.err"))"
    return 1
  fi
  return 0
}
