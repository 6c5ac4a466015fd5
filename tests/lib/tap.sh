# Sourced by the end-to-end scripts: TAP-like reporting ("ok - NAME" / "not ok - NAME: why");
# `failed` turns 1 at the first failure (the scripts exit with it).
failed=0
ok() { echo "ok - $1"; }
not_ok() { echo "not ok - $1: $2"; failed=1; }
# check_cmd NAME CMD...: ok when CMD succeeds; its stdout and stderr stay in $work/out and
# $work/err for the script to inspect ($work must be set).
check_cmd() {
  local name=$1
  shift
  if "$@" >"$work/out" 2>"$work/err"; then ok "$name"; else not_ok "$name" "exit $?: $(tail -3 "$work/err")"; fi
}
# expect NAME WANT_RC CMD...: runs CMD, checks its exit status ($work/out and $work/err keep
# its output, as check_cmd's).
expect() {
  local name=$1 want=$2 rc
  shift 2
  "$@" >"$work/out" 2>"$work/err"
  rc=$?
  if [ "$rc" = "$want" ]; then ok "$name"; else not_ok "$name" "exit $rc, want $want: $(tail -2 "$work/err")"; fi
}
# wait_for FILE: until FILE exists (10 s at most).
wait_for() { for _ in $(seq 100); do [ -e "$1" ] && return 0; sleep 0.1; done; return 1; }
