#!/usr/bin/env bash
# ctest soak_diag: the VM soak's pieces that keep a failed run diagnosable and bounded, on the
# host (tools/soak/soak-diag.sh, soak-lib.sh's bounded), and the verdict's rule for an EIO after
# a server kill -9 (explain_errors: the client's timeout expired while the guest stalled, the
# defect of docs/reliability.md that session 9 reproduced by freezing the VM 40 s).
#   bounded       a command's status; 124 and back in time for one over its limit, one that
#                 ignores TERM, and one whose child holds its output open
#   diag_stalls   a stopped process's gap is recorded (the guest's stall monitor)
#   diag_tee      passes everything on, copies at most DIAG_CAP bytes, a line at a time
#   explain_errors  an EIO is explained only with the client's timeout line AND a stall; an EROFS
#                 only after an explained EIO; the C++ log lines it reads still say what it parses
# ~15 s, no root, no build needed (the sources are read for the log formats).
set -u -o pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$here/../..
# shellcheck source-path=SCRIPTDIR source=../../tools/soak/soak-lib.sh
. "$src/tools/soak/soak-lib.sh"
# shellcheck source-path=SCRIPTDIR source=../../tools/soak/soak-diag.sh
. "$src/tools/soak/soak-diag.sh"
tmp=$(mktemp -d /tmp/soak-diag-test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fails=0 n=0
ok() { n=$((n + 1)); echo "ok $n - $*"; }
not_ok() { n=$((n + 1)); fails=$((fails + 1)); echo "not ok $n - $*"; }
check() {  # check WHAT CONDITION...
  local what=$1
  shift
  if "$@"; then ok "$what"; else not_ok "$what"; fi
}
now_us() { echo "${EPOCHREALTIME/[.,]/}"; }

# ---- bounded
t0=$(now_us)
bounded 5 true
rc=$? dt=$((($(now_us) - t0) / 1000))
check "bounded: a command's status 0, back in ${dt} ms (< 1 s)" [ "$rc" = 0 ] && [ "$dt" -lt 1000 ]
bounded 5 bash -c 'exit 3'
check "bounded: a command's status 3" [ $? = 3 ]
t0=$(now_us)
bounded 5 sleep 1.5
rc=$? dt=$((($(now_us) - t0) / 1000))
check "bounded 5 sleep 1.5: 0 in ${dt} ms (1.5-2.5 s: the end is seen at once, not at the limit)" [ "$rc" = 0 ] && [ "$dt" -ge 1500 ] && [ "$dt" -lt 2500 ]
t0=$(now_us)
bounded 1 sleep 30
rc=$? dt=$((($(now_us) - t0) / 1000))
check "bounded 1 sleep 30: 124 in ${dt} ms (1-4 s)" [ "$rc" = 124 ] && [ "$dt" -ge 1000 ] && [ "$dt" -lt 4000 ]
t0=$(now_us)
bounded 1 bash -c 'trap "" TERM; while :; do sleep 0.2; done' 2>/dev/null
rc=$? dt=$((($(now_us) - t0) / 1000))
check "bounded: a command that ignores TERM gets KILL: 124 in ${dt} ms (6-9 s)" [ "$rc" = 124 ] && [ "$dt" -ge 5900 ] && [ "$dt" -lt 9000 ]

# ---- diag_stalls: a process that does not run for 3.5 s (SIGSTOP: what a starved VM looks like
# from inside) records one gap of about that.
: >"$tmp/stalls"
diag_stalls "$tmp/stalls" &
sp=$!
sleep 1.5
kill -STOP "$sp"
t_stop=$(now_us)
sleep 3.5
kill -CONT "$sp"
sleep 1.5
kill "$sp"
wait "$sp" 2>/dev/null
gap=$(awk -v t="$t_stop" '$1 > t && $2 >= 2000000 { print $2; exit }' "$tmp/stalls")
check "diag_stalls: a 3.5 s stop recorded as a gap of ${gap:-none} us (2.0-4.5 s beyond the second)" \
  [ -n "$gap" ] && [ "$gap" -ge 2000000 ] && [ "$gap" -le 4500000 ]

# ---- diag_tee
DIAG_CAP=10
out=$(printf 'abc\ndefgh\nijklmnop\nlast' | diag_tee "$tmp/tee")
check "diag_tee: passes every line on" [ "$out" = $'abc\ndefgh\nijklmnop\nlast' ]
check "diag_tee: copies up to DIAG_CAP (10) bytes, whole lines: '$(tr '\n' '|' <"$tmp/tee")'" \
  [ "$(cat "$tmp/tee")" = $'abc\ndefgh' ]
# shellcheck disable=SC2034  # soak-diag.sh's
DIAG_CAP=1048576

# ---- explain_errors. The client's log lines as the daemon prints them (the formats are checked
# against the sources below), the writer's errors as soak-vm.sh's writer_err writes them.
T=1795843300000000  # an epoch in us
us() { echo $((T + $1 * 1000000)); }
cl() {  # cl SECONDS KIND: a client log line at T + SECONDS
  local t=$((T + $1 * 1000000))
  case $2 in
    pending) echo "ibtrs $((t / 1000000)).$(printf %03d $((t % 1000000 / 1000))) warn: session soakvm: 3 requests failed (ENOTCONN): no path for pending_timeout (30000 ms)" ;;
    remap) echo "ibtrs $((t / 1000000)).$(printf %03d $((t % 1000000 / 1000))) warn: ibnbd soakvm: 2 IO parts failed (ENOTCONN): no path for remap_timeout (30000 ms)" ;;
    down) echo "ibtrs $((t / 1000000)).000 warn: path tcp:198.18.0.1@tcp:198.18.0.2:12381: down (Connection reset by peer), reconnecting" ;;
  esac
}
werr() { echo "$(us "$1") 05:21:58.746 f4 $2"; }  # werr SECONDS "STEP: MESSAGE"
eio="dd conv=fsync exit 1: dd: fsync failed for '/mnt/f4': Input/output error"
erofs="dd conv=fsync exit 1: dd: failed to open '/mnt/f5': Read-only file system"
explain() {  # explain ERRS CLIENT STALLS: "EXPLAINED UNEXPLAINED"
  explain_errors "$1" "$2" "$3" 30000 >"$tmp/x.out"
  awk '$1 == "explained" { e = $2 } $1 == "unexplained" { u = $2 } END { print e, u }' "$tmp/x.out"
}
# The guest frozen 40 s (run 4 of session 9): down at 0, a stall ending at 41, the timeout line
# at 41.1, the EIO at 41.5.
{ cl 0 down; cl 41 pending; } >"$tmp/cl"
echo "$(us 41) 40000000" >"$tmp/st"
werr 41 "$eio" >"$tmp/e"
check "explain: EIO after the client's pending_timeout, the guest stalled 40 s: explained" [ "$(explain "$tmp/e" "$tmp/cl" "$tmp/st")" = "1 0" ]
{ cl 0 down; cl 41 remap; } >"$tmp/cl2"
check "explain: the same with the block layer's remap_timeout line: explained" [ "$(explain "$tmp/e" "$tmp/cl2" "$tmp/st")" = "1 0" ]
grep -q "the guest stalled 40.0 s" "$tmp/x.out"
check "explain: the evidence is printed: $(sed -n 3p "$tmp/x.out" | cut -d' ' -f4- | cut -c1-150)" [ $? = 0 ]
: >"$tmp/nost"
check "explain: the same EIO without a stall (a slow restart, a lost request): UNEXPLAINED" [ "$(explain "$tmp/e" "$tmp/cl" "$tmp/nost")" = "0 1" ]
echo "$(us 41) 5000000" >"$tmp/st5"
check "explain: a stall of 5 s only: UNEXPLAINED" [ "$(explain "$tmp/e" "$tmp/cl" "$tmp/st5")" = "0 1" ]
{ echo "$(us 10) 4000000"; echo "$(us 20) 3000000"; echo "$(us 30) 3500000"; } >"$tmp/stmany"
check "explain: stalls of 4 + 3 + 3.5 s in the timeout's window add up: explained" [ "$(explain "$tmp/e" "$tmp/cl" "$tmp/stmany")" = "1 0" ]
echo "$(us -60) 40000000" >"$tmp/stold"
check "explain: a stall long before the timeout's window: UNEXPLAINED" [ "$(explain "$tmp/e" "$tmp/cl" "$tmp/stold")" = "0 1" ]
cl 0 down >"$tmp/cl0"
check "explain: an EIO with no timeout line from the client (the IO was lost or failed elsewhere): UNEXPLAINED" \
  [ "$(explain "$tmp/e" "$tmp/cl0" "$tmp/st")" = "0 1" ]
werr 120 "$eio" >"$tmp/elate"
check "explain: an EIO 79 s after the timeout line: UNEXPLAINED" [ "$(explain "$tmp/elate" "$tmp/cl" "$tmp/st")" = "0 1" ]
{ werr 41 "$eio"; werr 43 "$erofs"; } >"$tmp/e2"
check "explain: an EROFS after an explained EIO (ext4 aborted its journal): explained" [ "$(explain "$tmp/e2" "$tmp/cl" "$tmp/st")" = "2 0" ]
werr 43 "$erofs" >"$tmp/e3"
check "explain: an EROFS alone: UNEXPLAINED" [ "$(explain "$tmp/e3" "$tmp/cl" "$tmp/st")" = "0 1" ]
werr 41 "dd conv=fsync exit 124: # soak-vm.sh: 'dd ...' (pid 879) did not end 120 s + KILL: left behind, in state D" >"$tmp/e4"
check "explain: a step given up in D state: UNEXPLAINED" [ "$(explain "$tmp/e4" "$tmp/cl" "$tmp/st")" = "0 1" ]

# The daemon's log formats that explain_errors parses: a change of wording there must change
# the parser and this test.
grep -q '"session %s: %zu requests failed (ENOTCONN): no path for pending_timeout (%lld ms)"' "$src/transport/src/client/client_failover.cc"
check "the transport's pending_timeout line is still the one parsed" [ $? = 0 ]
grep -q '"ibnbd %s: %zu IO parts failed (%s): %s for remap_timeout (%lld ms)"' "$src/client/src/lib/session.cc"
check "the block layer's remap_timeout line is still the one parsed" [ $? = 0 ]
grep -q '"ibtrs %lld.%03lld %s: "' "$src/base/src/log.cc"
check "the log's prefix is still 'ibtrs EPOCH.mmm LEVEL: ' (wall clock, as the writer's times)" [ $? = 0 ]

echo "1..$n"
[ "$fails" = 0 ]
