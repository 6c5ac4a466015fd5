# Sourced by soak-vm.sh: what a failed or hung VM soak leaves on the host (--logs DIR, a
# --rw-share of run-in-vm.sh) and the watchdog that ends a run that stopped moving well before
# the VM's limit (--watchdog). Everything the guest logs lives in its RAM and dies with it, so
# the logs are copied out while the run goes (every DIAG_EVERY s), again in full on any exit and
# when the watchdog fires. Bounded: each copied file is its last DIAG_CAP bytes, every command
# has a time limit, and nothing here reads the device under test or a process's memory (a
# /proc/PID/cmdline read waits for a task's mmap lock, which a task stuck on the device holds).
#
# The caller sets WORK, CLI, LOGS (the directory, "" for none), WATCHDOG_AT (epoch seconds, 0
# for none), WATCHDOG (the same in seconds from the run's start, for the message) and MAIN_PID
# (its own pid) before diag_start. Files in LOGS:
#   stdout.log stderr.log           the run's own output (soak-vm.sh and ibnbd-soak)
#   srv.log cl.log hook.log ...     the daemons' logs, the hook log, the writer's errors
#   dmesg.txt                       the guest kernel's log
#   dstate.txt                      tasks seen in D state for DIAG_EVERY s or more: their stacks
#   dump-REASON/                    a full dump (exit, watchdog): ps, D-state stacks after
#                                   sysrq-w, the daemons' device/path/session lists (JSON), the
#                                   block devices' in-flight counts, dm and loop state
# shellcheck shell=bash disable=SC2317  # functions called from traps and the watchdog

DIAG_EVERY=${DIAG_EVERY:-15}
DIAG_CAP=${DIAG_CAP:-1048576}
DIAG_PID="" DIAG_TEES=""
WATCHDOG_GRACE=${WATCHDOG_GRACE:-90}  # seconds from the watchdog's TERM to its KILL

# The files of $WORK worth having: the daemons', the hook's, the writer's and the checks' logs.
diag_files() {
  local f
  for f in srv.log cl.log hook.log writer.err writer.explained stalls marks durable mkfs.log fsck.log \
    check.log nbd.log dm.err lw.list lw.err lw.fsck lw.mount lw.sum; do
    [ -s "$WORK/$f" ] && echo "$f"
  done
}

# diag_copy: the tails of the logs and the kernel's log into $LOGS (each written aside, then
# renamed: a reader on the host never sees half a copy)
diag_copy() {
  local f
  [ -n "$LOGS" ] || return 0
  for f in $(diag_files); do
    tail -c "$DIAG_CAP" "$WORK/$f" >"$LOGS/.$f" 2>/dev/null && mv -f "$LOGS/.$f" "$LOGS/$f"
  done
  timeout 10 dmesg 2>/dev/null | tail -c "$DIAG_CAP" >"$LOGS/.dmesg.txt" && mv -f "$LOGS/.dmesg.txt" "$LOGS/dmesg.txt"
  return 0
}

# diag_dtasks: "PID COMM" of each task (threads too) in D state, from /proc/*/task/*/stat with
# bash's read (no process per task: a fork costs ~60 ms under TCG)
diag_dtasks() {
  local t line rest
  for t in /proc/[0-9]*/task/[0-9]*; do
    read -r line 2>/dev/null <"$t/stat" || continue
    rest=${line##*) }
    [ "${rest%% *}" = D ] || continue
    line=${line#* (}
    echo "${t##*/} ${line%%) *}"
  done
}

# diag_stack PID: a task's kernel stack and wait channel (root reads /proc/PID/stack)
diag_stack() {
  local w=""
  read -r w 2>/dev/null <"/proc/$1/wchan"
  echo "  wchan: ${w:-?}"
  sed 's/^/  /' "/proc/$1/stack" 2>/dev/null | head -n 40
}

# diag_dump REASON: everything at once into $LOGS/dump-REASON (or a summary on stderr without
# --logs). Bounded: 15 s per command, files capped.
diag_dump() {
  local why=$1 d pid comm n=0 dev
  if [ -z "$LOGS" ]; then
    while read -r pid comm; do
      n=$((n + 1))
      [ "$n" -le 8 ] || continue
      echo "# D state: $pid ($comm)"
      diag_stack "$pid" | sed 's/^/#/'
    done < <(diag_dtasks) >&2
    return 0
  fi
  d=$LOGS/dump-$why
  mkdir -p "$d" || return 0
  date '+%F %T' >"$d/when"
  cat /proc/loadavg /proc/uptime >>"$d/when" 2>/dev/null
  diag_copy
  # The tasks blocked in the kernel: our own listing with stacks, and the kernel's (sysrq-w:
  # blocked tasks with their stacks, into the kernel log).
  while read -r pid comm; do
    echo "== $pid ($comm)"
    diag_stack "$pid"
  done < <(diag_dtasks) | head -c "$DIAG_CAP" >"$d/dstate.txt"
  echo w >/proc/sysrq-trigger 2>/dev/null
  sleep 1
  timeout 10 dmesg 2>/dev/null | tail -c "$DIAG_CAP" >"$d/dmesg.txt"
  timeout -k 2 15 ps -eLo pid,tid,ppid,stat,wchan:32,etimes,comm 2>&1 | head -c "$DIAG_CAP" >"$d/ps.txt"
  {
    # 5 s each; a daemon that does not answer the first is stuck (or stopped): noted, not asked
    # again (three more waits would hold the watchdog's TERM back)
    for side in client:cl server:srv; do
      echo "== ${side%%:*}"
      for what in session path device; do
        echo "-- $what list"
        timeout -k 2 5 "$CLI" --socket "$WORK/${side#*:}.sock" "${side%%:*}" -f json "$what" list 2>&1 && continue
        echo "(no answer in 5 s, or an error: the rest of this daemon not asked)"
        break
      done
    done
  } | head -c "$DIAG_CAP" >"$d/ibnbd-state.txt"
  {
    # In-flight requests of each block device of the stack, and blk-mq's view of the ublk and
    # nbd queues (debugfs: what is dispatched and not completed).
    for dev in /sys/block/ublkb* /sys/block/nbd* /sys/block/dm-* /sys/block/loop*; do
      [ -e "$dev/inflight" ] || continue
      read -r r w 2>/dev/null <"$dev/inflight" || continue
      case ${dev##*/} in ublkb*) ;; *) [ "$r$w" = 00 ] && continue ;; esac
      echo "${dev##*/}: inflight $r $w, stat $(cat "$dev/stat" 2>/dev/null)"
    done
    for dev in /sys/kernel/debug/block/ublkb*; do
      [ -d "$dev" ] || continue
      echo "== debugfs ${dev##*/}"
      timeout -k 2 10 grep -r . "$dev" 2>/dev/null | grep -v '/sched/' | head -n 200
    done
    echo "== dmsetup"
    timeout -k 2 10 dmsetup info -c 2>&1
    timeout -k 2 10 dmsetup status 2>&1
    echo "== losetup"
    timeout -k 2 10 losetup -a 2>&1
    echo "== mounts"
    grep -E 'ublkb|nbd|ibnbd|mapper' /proc/mounts
    echo "== pressure"
    grep -H . /proc/pressure/* 2>/dev/null
  } | head -c "$DIAG_CAP" >"$d/block.txt"
}

# diag_watch: the background loop. Every DIAG_EVERY s: the logs copied out, and each task in D
# state that was there a round ago gets its stack into dstate.txt (once per task; the kernel's
# hung-task report needs 120 s). At WATCHDOG_AT: the reason on stderr, a full dump, then the run
# is ended (TERM to the run, whose trap cleans up; the processes of the run that are still there
# 30 s later get KILL, and the tasks that cannot die -- D state -- are named).
diag_watch() {
  local seen="" prev="" reported="" pid comm n=0 sp=""
  trap - EXIT INT TERM HUP
  trap '[ -n "$sp" ] && kill "$sp" 2>/dev/null; exit 0' TERM
  while kill -0 "$MAIN_PID" 2>/dev/null; do
    sleep "$DIAG_EVERY" &
    sp=$!
    wait "$sp"
    sp=""
    diag_copy
    seen=""
    while read -r pid comm; do
      seen+=" $pid"
      case " $prev " in *" $pid "*) ;; *) continue ;; esac
      case " $reported " in *" $pid "*) continue ;; esac
      reported+=" $pid"
      n=$((n + 1))
      [ "$n" -le 50 ] || continue
      [ -n "$LOGS" ] && { echo "== $(date +%T) $pid ($comm) in D state for ${DIAG_EVERY} s or more"; diag_stack "$pid"; } >>"$LOGS/dstate.txt"
    done < <(diag_dtasks)
    prev=$seen
    if [ "$WATCHDOG_AT" -gt 0 ] && [ "$EPOCHSECONDS" -ge "$WATCHDOG_AT" ]; then
      echo "# soak-vm.sh: WATCHDOG: the run did not end within $WATCHDOG s (--watchdog); tasks in D state:$(diag_dtasks | head -n 8 | tr '\n' ';')" >&2
      diag_dump watchdog
      echo "watchdog" >"$WORK/watchdog"
      kill -TERM "$MAIN_PID" 2>/dev/null
      # The run's cleanup stops the daemons (10 s each), unmounts (60 s), may restart a dead
      # client daemon to free its ublk device: up to a minute and a half (WATCHDOG_GRACE)
      for _ in $(seq "$WATCHDOG_GRACE"); do kill -0 "$MAIN_PID" 2>/dev/null || return 0; sleep 1; done
      echo "# soak-vm.sh: WATCHDOG: the run did not end $WATCHDOG_GRACE s after TERM: KILL to its processes; left in D state:$(diag_dtasks | tr '\n' ';')" >&2
      diag_kill_tree "$MAIN_PID"
      return 0
    fi
  done
}

# diag_kill_tree PID: KILL to PID's descendants, then PID (a task in D state takes it when it
# leaves the kernel, if ever)
diag_kill_tree() {
  local c k kids=()
  for c in /proc/"$1"/task/*/children; do read -r -a k 2>/dev/null <"$c" && kids+=("${k[@]}"); done
  for c in "${kids[@]}"; do
    case " $BASHPID $DIAG_TEES " in *" $c "*) ;; *) diag_kill_tree "$c" ;; esac
  done
  kill -KILL "$1" 2>/dev/null
}

# diag_stalls FILE: until killed, a line "END_US GAP_US" in FILE for each second that took 2 s
# or more longer than it should: the guest did not run (a host that starves the VM's threads:
# what the kernel reports as a soft lockup from 20 s on). A read with a timeout on a pipe
# nobody writes to, not sleep(1): a fork a second would cost the guest ~6 % of a vCPU.
diag_stalls() {
  local fd prev now gap
  trap - EXIT INT TERM HUP
  exec {fd}<> <(:)
  prev=${EPOCHREALTIME/[.,]/}
  while :; do
    read -r -t 1 -u "$fd"
    now=${EPOCHREALTIME/[.,]/}
    gap=$((now - prev - 1000000))
    [ "$gap" -lt 2000000 ] || echo "$now $gap" >>"$1"
    prev=$now
  done
}

# explain_errors ERRS CLIENT_LOG STALLS TIMEOUT_MS: the writer's errors (ERRS: "EPOCH_US TIME
# FILE STEP: MESSAGE" lines) that the configured behaviour explains, the rest as unexplained.
# A server kill -9 must cost time only; an EIO is what the client does by design when no path
# came back within its timeout (the transport's pending_timeout, the block layer's
# remap_timeout: 30 s), and that may happen on a guest that did not run for much of that time
# (the server's restart waits for the guest too). So an EIO is explained when (a) the client's
# log says its timeout expired (and what it failed) at most 60 s before the error surfaced and
# 1 s after, and (b) the guest stalled (STALLS, diag_stalls) for 10 s or more in all within
# TIMEOUT_MS + 5 s before that expiry. An EROFS after an explained EIO is its consequence (ext4
# aborted its journal). Prints "explained N" / "unexplained N", then one line per error with
# its verdict and evidence.
explain_errors() {
  awk -v tmo_us="$(($4 * 1000))" '
    FILENAME == ARGV[1] { n_err++; t_err[n_err] = $1; line[n_err] = $0; next }
    FILENAME == ARGV[2] {
      # "ibtrs 1795843318.512 warn: session S: 3 requests failed (ENOTCONN): no path for pending_timeout (30000 ms)"
      if ($1 == "ibtrs" && $3 == "warn:" && / failed \((ENOTCONN|ETIMEDOUT)\): .* for (pending|remap)_timeout/) {
        split($2, p, "."); n_exp++; t_exp[n_exp] = p[1] * 1000000 + substr(p[2] "000000", 1, 6)
      }
      next
    }
    { n_st++; st_end[n_st] = $1; st_gap[n_st] = $2 }
    END {
      ex = 0; un = 0; eio_ok = 0
      for (i = 1; i <= n_err; i++) {
        why = ""
        if (line[i] ~ /Read-only file system/ && eio_ok) why = "EROFS after an explained EIO"
        else if (line[i] ~ /Input\/output error/) {
          for (j = 1; j <= n_exp && why == ""; j++) {
            if (t_exp[j] < t_err[i] - 60000000 || t_exp[j] > t_err[i] + 1000000) continue
            stalled = 0
            for (k = 1; k <= n_st; k++)
              if (st_end[k] <= t_exp[j] && st_end[k] >= t_exp[j] - tmo_us - 5000000) stalled += st_gap[k]
            if (stalled >= 10000000)
              why = sprintf("the client timeout expired %.1f s before, after the guest stalled %.1f s (stalls that ended in the %d s before it)", (t_err[i] - t_exp[j]) / 1e6, stalled / 1e6, tmo_us / 1e6 + 5)
          }
        }
        if (why != "") { ex++; eio_ok = 1; out[i] = "explained: " why }
        else { un++; out[i] = "UNEXPLAINED" }
      }
      print "explained " ex; print "unexplained " un
      for (i = 1; i <= n_err; i++) print line[i] " -- " out[i]
    }' "$1" "$2" "$3"
}

# diag_tee FILE: stdin to stdout and, up to DIAG_CAP bytes, to FILE, a line at a time as it
# comes (tee | head -c would hold the copy in head's buffer until the run ends: a hung run's
# output would be what is missing)
diag_tee() {
  local line n=0
  : >"$1"
  while IFS= read -r line || [ -n "$line" ]; do
    printf '%s\n' "$line"
    [ "$n" -lt "$DIAG_CAP" ] || continue
    printf '%s\n' "$line" >>"$1"
    n=$((n + ${#line} + 1))
  done
}

# diag_start: the run's output also into $LOGS, and the watcher (when there is a log dir or a
# watchdog)
diag_start() {
  if [ -n "$LOGS" ]; then
    # Copies of stdout and stderr, each capped; -p: a copy that stopped does not stop the output.
    # The tees are spared by the watchdog's KILL: its last words go through them.
    exec > >(diag_tee "$LOGS/stdout.log")
    DIAG_TEES=$!
    exec 2> >(diag_tee "$LOGS/stderr.log" >&2)
    DIAG_TEES+=" $!"
  fi
  if [ -n "$LOGS" ] || [ "$WATCHDOG_AT" -gt 0 ]; then
    diag_watch &
    DIAG_PID=$!
  fi
}

# diag_end: the watcher stopped (the caller dumped what it wanted first: diag_dump)
diag_end() {
  [ -n "$DIAG_PID" ] && kill -TERM "$DIAG_PID" 2>/dev/null
  DIAG_PID=""
  return 0
}
