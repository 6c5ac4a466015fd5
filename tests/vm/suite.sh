#!/usr/bin/env bash
# The VM rig's tests in one boot of the guest (ctest: vm_suite). Runs inside the VM
# (tests/vm/run-in-vm.sh): each entry of LIST (written by tests/CMakeLists.txt from every
# ibtrs_vm_test) in turn, each in its own session with its own time limit; whatever an entry
# leaves running when it ends is killed (and said), so that it cannot disturb the next.
#
#   bash tests/vm/suite.sh LIST      LIST: one entry per line, NAME, TIMEOUT and the command's
#                                    arguments separated by the ASCII unit separator (0x1f)
#   IBTRS_VM_ONLY="vm_ublk_tcp vm_fabric"   runs only those entries
#
# Output: "=== NAME" before an entry, "=== NAME: ok|FAILED (exit N)|skipped (N s)" after it,
# and a summary. Exit: 0 when none failed, 1 when one did, 77 when every entry skipped.
set -u -o pipefail

list=${1:?usage: $0 LIST}
[ -r "$list" ] || { echo "suite: cannot read $list" >&2; exit 2; }
sep=$'\x1f'
only=" ${IBTRS_VM_ONLY:-} "
passed=() failed=() skipped=()
t_suite=$SECONDS

while IFS= read -r line || [ -n "$line" ]; do
  [ -n "$line" ] || continue
  IFS=$sep read -r -a f <<<"$line"
  name=${f[0]} limit=${f[1]}
  cmd=("${f[@]:2}")
  [ "$only" = "  " ] || [[ $only == *" $name "* ]] || continue
  echo "=== $name"
  t0=$SECONDS
  # Its own session, so that what it leaves behind can be found by session id afterwards.
  setsid --wait timeout -k 10 "$limit" "${cmd[@]}" </dev/null &
  pid=$!
  wait "$pid"
  rc=$?
  left=$(ps -o pid= -s "$pid" 2>/dev/null | tr -s ' \n' ' ')
  if [ -n "${left// /}" ]; then
    echo "suite: $name left processes behind, killed:$left" >&2
    # shellcheck disable=SC2086 # a list of pids
    kill -KILL $left 2>/dev/null
  fi
  dt=$((SECONDS - t0))
  case $rc in
    0) passed+=("$name"); echo "=== $name: ok ($dt s)" ;;
    77) skipped+=("$name"); echo "=== $name: skipped ($dt s)" ;;
    124) failed+=("$name"); echo "=== $name: FAILED (timed out after $limit s)" ;;
    *) failed+=("$name"); echo "=== $name: FAILED (exit $rc, $dt s)" ;;
  esac
done <"$list"

echo "suite: ${#passed[@]} passed, ${#failed[@]} failed, ${#skipped[@]} skipped in $((SECONDS - t_suite)) s"
[ ${#failed[@]} -eq 0 ] || { echo "suite: failed: ${failed[*]}"; exit 1; }
[ ${#skipped[@]} -eq 0 ] || echo "suite: skipped: ${skipped[*]}"
[ ${#passed[@]} -gt 0 ] || [ ${#skipped[@]} -eq 0 ] || exit 77
exit 0
