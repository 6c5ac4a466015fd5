# Sourced by the soak's environments (tools/soak/README.md): soak.sh (two network namespaces on
# the host) and soak-vm.sh (inside the VM rig: ublk, the kernel's nbd client, device-mapper,
# netem). What both need: waiting, the daemons' starts, the client daemon's control socket, the
# hook's kinds that do not depend on where the links are, and the end of a run.
#
# The sourcing script sets, before it calls these (run mode) or in $SOAK_WORK/env (hook mode):
#   WORK SRV CLD CLI SESSION HB_MS HB_MISSED RECONNECT_MS EXPORT_DIR
#   NSS NSC   the server's and the client's network namespace ("" in the VM: no namespace)
# and defines path_spec A|B (the client's path argument), listen_spec A|B (the server's) and
# client_mapped (what follows a start of the client daemon: map, export, connect).
# shellcheck shell=bash disable=SC2317  # functions called from traps and hooks

log() { echo "# ${0##*/} [$(date +%T.%N | cut -c1-12)] $*"; }

pid_alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
# wait_gone PID: until the process is gone (it is not our child: poll), 10 s at most
wait_gone() {
  for _ in $(seq 200); do pid_alive "$1" || return 0; sleep 0.05; done
  return 1
}
# wait_file FILE [TRIES]: 50 ms each (default 200: 10 s)
wait_file() { for _ in $(seq "${2:-200}"); do [ -e "$1" ] && return 0; sleep 0.05; done; return 1; }

# await PID SECONDS: 0 once PID (a background job of this shell) ended, its status in AWAIT_RC;
# 1 when it is still there after SECONDS. Polls with builtins -- kill -0, and read -t on a pipe
# nobody writes to as the sleep: no fork, which costs ~60 ms under TCG -- not `wait -n`: a job
# that ended before wait -n was called may be reaped and forgotten by then, and wait -n waits
# for the next one instead (seen: a bounded 1 s step took 6). bash keeps the status of a
# background pid it reaped, so `wait PID` still gives it.
await() {
  local i
  [ -n "${BOUNDED_FD:-}" ] || exec {BOUNDED_FD}<> <(:)
  for ((i = 0; i <= $2 * 10; i++)); do
    if ! kill -0 "$1" 2>/dev/null; then
      wait "$1" 2>/dev/null
      AWAIT_RC=$?
      return 0
    fi
    [ "$i" = $(($2 * 10)) ] || read -r -t 0.1 -u "$BOUNDED_FD"
  done
  return 1
}

# bounded SECONDS CMD [ARGS...]: CMD's status, or 124 when it ran longer than SECONDS (then
# TERM, KILL after 5 s). Unlike timeout(1) it does not wait for a task that cannot die: one in
# D state on a device whose IO never returns is left behind after 5 s more, named on stderr
# with its kernel stack, and the caller goes on. Not for a command whose output a $(...) reads
# (a task left behind holds the pipe open).
bounded() {
  local secs=$1 pid w t
  shift
  "$@" &
  pid=$!
  await "$pid" "$secs" && return "$AWAIT_RC"
  for w in TERM KILL; do
    kill -"$w" "$pid" 2>/dev/null
    await "$pid" 5 && return 124
  done
  {
    echo "# ${0##*/}: '$*' (pid $pid) did not end ${secs} s + KILL: left behind, in state $(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)"
    for t in "$pid" $(cat /proc/"$pid"/task/*/children 2>/dev/null); do
      sed "s|^|#   $t: |" "/proc/$t/stack" 2>/dev/null | head -n 20
    done
  } >&2
  return 124
}

# in_ns NS: the command prefix that runs in network namespace NS (none when NS is empty); a
# prefix, not a function, so that `"${run[@]}" DAEMON &` leaves the daemon's own pid in $!
in_ns() { run=(); [ -z "$1" ] || run=(ip netns exec "$1"); }

start_server() {
  local run
  rm -f "$WORK/srv.ready"
  in_ns "$NSS"
  "${run[@]}" "$SRV" --listen "$(listen_spec A)" --listen "$(listen_spec B)" \
    --config "$WORK/hosts.json" --dev-search-path "$EXPORT_DIR" --control-socket "$WORK/srv.sock" \
    --ready-file "$WORK/srv.ready" --hb-interval-ms "$HB_MS" --hb-missed "$HB_MISSED" \
    >>"$WORK/srv.log" 2>&1 </dev/null &
  echo $! >"$WORK/srv.pid"
  disown  # a hook kills it with -9: no job report from this shell
  wait_file "$WORK/srv.ready" 200 || { log "server did not start: $(tail -3 "$WORK/srv.log")"; return 1; }
}

# start_client_daemon [READY_TRIES]: the daemon with the run's state dir (a ublk device of a
# killed one is recovered before the ready file appears), then client_mapped.
start_client_daemon() {
  local run
  rm -f "$WORK/cl.ready"
  in_ns "$NSC"
  "${run[@]}" "$CLD" --host-key "$WORK/host.key" --control-socket "$WORK/cl.sock" \
    --ready-file "$WORK/cl.ready" --state-dir "$WORK/cl-state" --hb-interval-ms "$HB_MS" \
    --hb-missed "$HB_MISSED" --reconnect-delay-ms "$RECONNECT_MS" >>"$WORK/cl.log" 2>&1 </dev/null &
  echo $! >"$WORK/cl.pid"
  disown
  wait_file "$WORK/cl.ready" "${1:-200}" || { log "client daemon did not start: $(tail -3 "$WORK/cl.log")"; return 1; }
  client_mapped
}

# map_volume NAME [ARGS...]: map NAME over paths A and B. The server may still hold a killed
# daemon's rw open until it notices the dead session: retried for 20 s.
map_volume() {
  local name=$1 i out
  shift
  for i in $(seq 40); do
    out=$(timeout 60 "$CLI" --socket "$WORK/cl.sock" client device map "$name" from \
      "$(path_spec A)" "$(path_spec B)" rw session "$SESSION" "$@" 2>&1) && return 0
    [ "$i" = 40 ] && { log "map failed: $out"; return 1; }
    sleep 0.5
  done
}

# ctl JSON: one command to the client daemon's control socket, its answer on stdout
ctl() {
  python3 - "$WORK/cl.sock" "$1" <<'EOF'
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(30)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\n")
buf = b""
while not buf.endswith(b"\n"):
    d = s.recv(65536)
    if not d:
        break
    buf += d
line = buf.decode().strip().splitlines()[-1] if buf else ""
print(line)
sys.exit(0 if '"ok": true' in line or '"ok":true' in line else 1)
EOF
}

fill_tmpfs() {  # until the tmpfs has no free page
  dd if=/dev/zero of="$WORK/tmpfs/filler.1" bs=1M status=none 2>/dev/null
  dd if=/dev/zero of="$WORK/tmpfs/filler.2" bs=4k status=none 2>/dev/null
  return 0
}

# hook_common PHASE KIND [ARGS]: the kinds done the same way everywhere; 100 when KIND:PHASE is
# not one of them (the environment's own), else the step's status.
hook_common() {
  local phase=$1 kind=$2 pid
  shift 2
  case $kind:$phase in
    server-kill:start)
      pid=$(cat "$WORK/srv.pid")
      kill -KILL "$pid" 2>/dev/null
      wait_gone "$pid" ;;
    server-kill:stop) pid_alive "$(cat "$WORK/srv.pid")" || start_server ;;
    server-stop:start) kill -STOP "$(cat "$WORK/srv.pid")" ;;
    server-stop:stop) kill -CONT "$(cat "$WORK/srv.pid")" ;;
    client-kill:start)
      pid=$(cat "$WORK/cl.pid")
      kill -KILL "$pid" 2>/dev/null
      wait_gone "$pid" ;;
    client-kill:stop) pid_alive "$(cat "$WORK/cl.pid")" || start_client_daemon "${CL_READY_TRIES:-200}" ;;
    enospc:start) fill_tmpfs ;;
    enospc:stop) rm -f "$WORK"/tmpfs/filler.* ;;
    policy:start) ctl "{\"cmd\": \"session_policy\", \"session\": \"$SESSION\", \"policy\": \"$1\"}" >/dev/null ;;
    path-remove:start) timeout 30 "$CLI" --socket "$WORK/cl.sock" client path delete "$SESSION" "$(path_spec "$1")" >/dev/null ;;
    path-remove:stop) timeout 30 "$CLI" --socket "$WORK/cl.sock" client path add "$SESSION" "$(path_spec "$1")" >/dev/null ;;
    *) return 100 ;;
  esac
}

# stop_daemons: as an admin stops them (SIGTERM: unmap, close, sync), the client side first (its
# CLOSE reaches a live server); KILL after 10 s.
stop_daemons() {
  local f p
  for f in cl srv; do
    p=$(cat "$WORK/$f.pid" 2>/dev/null)
    if pid_alive "$p"; then
      kill -CONT "$p" 2>/dev/null
      kill -TERM "$p" 2>/dev/null
      wait_gone "$p" || kill -KILL "$p" 2>/dev/null
    fi
  done
}

# sanitizer_verdict RC LOG...: RC, or 1 when a sanitizer reported in one of the logs (printed)
sanitizer_verdict() {
  local rc=$1
  shift
  if grep -lE "ERROR: (Address|Leak|Thread)Sanitizer|runtime error:" "$@" >/dev/null 2>&1; then
    echo "# ${0##*/}: a sanitizer reported in a daemon's log:" >&2
    grep -hE -A12 "ERROR: (Address|Leak|Thread)Sanitizer|runtime error:" "$@" 2>/dev/null |
      head -n 60 | sed 's/^/#   /' >&2
    [ "$rc" = 0 ] && rc=1
  fi
  echo "$rc"
}

# show_logs: the tails a failed run needs
show_logs() {
  echo "# hook log:"; tail -n 30 "$WORK/hook.log" 2>/dev/null | sed 's/^/#   /'
  echo "# server log:"; tail -n 20 "$WORK/srv.log" 2>/dev/null | sed 's/^/#   /'
  if [ -s "$WORK/cl.log" ]; then echo "# client daemon log:"; tail -n 20 "$WORK/cl.log" | sed 's/^/#   /'; fi
}

# hook_mode hook PHASE KIND [ARGS]: the hook's entry (ibnbd-soak runs `SCRIPT hook ...` with
# SOAK_WORK set): the run's env file, the common kinds, then the script's env_hook PHASE KIND
# [ARGS] for the others (2 for a kind it does not know). Exits with the step's status.
hook_mode() {
  local phase=$2 kind=$3 rc
  shift 3
  [ -n "${SOAK_WORK:-}" ] && [ -r "$SOAK_WORK/env" ] || { echo "${0##*/} hook: SOAK_WORK not set" >&2; exit 2; }
  # shellcheck source=/dev/null
  . "$SOAK_WORK/env"
  log "hook $phase $kind $*"
  hook_common "$phase" "$kind" "$@"
  rc=$?
  if [ $rc = 100 ]; then
    env_hook "$phase" "$kind" "$@"
    rc=$?
  fi
  [ $rc = 0 ] || log "hook $phase $kind failed: exit $rc"
  exit $rc
}

# parse_run_args DEFAULT_TARGET BUILD_DIR [OPTIONS]: sets BUILD (absolute), TARGET, SEED,
# DURATION, FAULTS, SIZE, JSON, KEEP and EXTRA (after --); an option it does not know goes to the
# script's env_option OPTION [VALUE], which sets `took` to the words it used (0: unknown).
# shellcheck disable=SC2034  # the caller's globals
parse_run_args() {
  TARGET=$1 BUILD=${2:-} SEED="" DURATION=60s FAULTS=all SIZE=64M JSON="" KEEP=0 EXTRA=()
  [ -n "$BUILD" ] && [ -d "$BUILD" ] || { echo "usage: $0 BUILD_DIR [options] (see the top of the file)" >&2; exit 2; }
  BUILD=$(cd "$BUILD" && pwd)
  shift 2
  while [ $# -gt 0 ]; do
    case $1 in
      --target) TARGET=$2; shift 2 ;;
      --seed) SEED=$2; shift 2 ;;
      --duration) DURATION=$2; shift 2 ;;
      --faults) FAULTS=$2; shift 2 ;;
      --size) SIZE=$2; shift 2 ;;
      --json) JSON=$2; shift 2 ;;
      --keep) KEEP=1; shift ;;
      --) shift; EXTRA=("$@"); break ;;
      *)
        took=0
        env_option "$@"
        [ "$took" -gt 0 ] || { echo "${0##*/}: unknown option $1" >&2; exit 2; }
        shift "$took" ;;
    esac
  done
}
