#!/usr/bin/env bash
# Self-test of the VM rig (tests/vm/run-in-vm.sh). Boots the VM eight times
# (~10 s each on 2 cores, plus a one-time kernel download into the cache) and
# checks: rxe0/rxe1 in ibv_devices, rping between 198.18.0.1 and 198.18.0.2
# over the right rxe devices, ib_write_bw, the device nodes (uverbs, rdma_cm,
# ublk-control, nbd0), environment, --cwd, --env, --rw-share, the overlay
# protecting the host, stdout/stderr separation, exit code propagation,
# --timeout, SIGTERM handling (no QEMU left behind), exit code 77 when
# QEMU is missing, and a guest that dies or hangs before its command starts
# booted again once (but not one that dies after).
#
#   tests/vm/check.sh        prints "N passed, N failed"; exit 0 if all passed,
#                            1 if any failed, 77 if the rig cannot run here.
set -euo pipefail

RIG_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN="$RIG_DIR/run-in-vm.sh"

passed=0
failed=0
pass() { passed=$((passed + 1)); echo "PASS  $1"; }
fail() { failed=$((failed + 1)); echo "FAIL  $1${2:+: $2}"; }
expect() { # NAME CONDITION-COMMAND...
  local name="$1"
  shift
  if "$@"; then pass "$name"; else fail "$name"; fi
}

# Host scratch dirs. The probe dir lives in the rig cache dir.
cache_root="${IBTRS_VM_CACHE:-${HOME:-/root}/.cache/ibtrs-vm}"
mkdir -p "$cache_root"
probe_dir="$(mktemp -d "$cache_root/check-probe.XXXXXX")"
rw_dir="$(mktemp -d "${TMPDIR:-/tmp}/ibtrs-vm-check-rw.XXXXXX")"
# run-in-vm.sh creates its per-run dir below TMPDIR: a unique TMPDIR lets us
# find (and assert the absence of) QEMU processes of our runs.
run_tmp="$(mktemp -d "${TMPDIR:-/tmp}/ibtrs-vm-check-run.XXXXXX")"
out="$run_tmp/out"
err="$run_tmp/err"
bg_pid=""
cleanup() {
  if [ -n "$bg_pid" ]; then kill "$bg_pid" 2>/dev/null || true; wait "$bg_pid" 2>/dev/null || true; fi
  rm -rf -- "$probe_dir" "$rw_dir" "$run_tmp"
}
trap cleanup EXIT
echo original >"$probe_dir/existing"

no_qemu_left() { ! pgrep -f -- "$run_tmp/ibtrs-vm\." >/dev/null; }

run() { TMPDIR="$run_tmp" "$RUN" "$@"; }

# --- 0: QEMU missing -> 77 (no VM needed)
rc=0
IBTRS_VM_QEMU=/nonexistent/qemu-system-x86_64 run -- true >"$out" 2>"$err" || rc=$?
if [ "$rc" = 77 ] && grep -q SKIP "$err"; then pass "qemu-missing-exits-77"; else fail "qemu-missing-exits-77" "rc=$rc"; fi

# --- 1: the main guest self-test
t0=$SECONDS
rc=0
run --timeout 400 --cwd "$probe_dir" --rw-share "$rw_dir" --env "IBTRS_CHECK_VAR=hello world" \
  -- bash "$RIG_DIR/check-guest.sh" "$rw_dir" "$probe_dir" >"$out" 2>"$err" || rc=$?
if [ "$rc" = 77 ]; then
  cat "$err"
  echo "0 passed, 0 failed (skipped: the rig cannot run here)"
  exit 77
fi
echo "(guest self-test VM: $((SECONDS - t0)) s)"
if [ "$rc" = 0 ]; then
  pass "guest-run-exit-0"
else
  fail "guest-run-exit-0" "rc=$rc"
  sed 's/^/  stderr| /' "$err"
fi
while IFS= read -r line; do
  case "$line" in
    "ok "*) pass "guest: ${line#ok }" ;;
    "not ok "*) fail "guest: ${line#not ok }" ;;
  esac
done <"$out"
grep -q '^ok ' "$out" || fail "guest-produced-results" "$(tail -n 5 "$err" | tr '\n' ' ')"
expect "stdout-on-host-stdout" grep -qx marker-on-stdout "$out"
expect "stderr-on-host-stderr" grep -qx marker-on-stderr "$err"
expect "stdout-stderr-separated" bash -c "! grep -q marker-on-stderr '$out' && ! grep -q marker-on-stdout '$err'"
expect "rw-share-reached-host" grep -qx from-guest "$rw_dir/from-guest"
expect "host-tree-unchanged" bash -c "[ ! -e '$probe_dir/created-in-guest' ] && [ \"\$(cat '$probe_dir/existing')\" = original ]"
expect "no-qemu-left-after-run" no_qemu_left

# --- 2: exit code propagation: with case 5's hang below (one boot fewer)

# --- 3: --timeout kills the VM
t0=$SECONDS
rc=0
run --timeout 15 -- sleep 1000 >"$out" 2>"$err" || rc=$?
dt=$((SECONDS - t0))
if [ "$rc" = 124 ] && grep -q TIMEOUT "$err" && [ "$dt" -lt 35 ]; then
  pass "timeout-exits-124 (${dt} s)"
else
  fail "timeout-exits-124" "rc=$rc after ${dt} s"
fi
expect "no-qemu-left-after-timeout" no_qemu_left

# --- 4: SIGTERM kills the VM
TMPDIR="$run_tmp" "$RUN" -- sleep 1000 >"$out" 2>"$err" &
bg_pid=$!
for _ in $(seq 100); do pgrep -f -- "$run_tmp/ibtrs-vm\." >/dev/null && break; sleep 0.1; done
sleep 2
kill -TERM "$bg_pid"
rc=0
wait "$bg_pid" || rc=$?
bg_pid=""
sleep 0.5
if [ "$rc" = 143 ]; then pass "sigterm-exits-143"; else fail "sigterm-exits-143" "rc=$rc"; fi
expect "no-qemu-left-after-sigterm" no_qemu_left

# --- 5: a guest that dies before its command starts is booted again, once, and the log says why.
# (One boot panicking and the next succeeding is the hang case below with a panic for a cause: the
# retry path is the same, so it is not booted separately.) The reason is checked for its form,
# not for the injected "Kernel panic": TCG's own early Oops can kill a boot first (seen in CI:
# the log then quotes the Oops' last lines), and that is the same retry path.)
rc=0
IBTRS_VM_TEST_BOOT_FAULT=panic-always run -- sh -c 'echo command-ran' >"$out" 2>"$err" || rc=$?
if [ "$rc" = 125 ] && ! grep -q command-ran "$out" && [ "$(grep -c 'booting it again' "$err")" = 1 ] &&
   grep -Eq 'died before its command started \((QEMU exited|its command had not started).+\); booting it again' "$err" &&
   grep -q 'died again before its command started' "$err"; then
  pass "boot-panic-twice-fails-125"
else
  fail "boot-panic-twice-fails-125" "rc=$rc $(tail -n 3 "$err" | tr '\n' ' ')"
fi
# A boot that hangs before the command counts as dead after IBTRS_VM_BOOT_TIMEOUT; the second
# boot's command exits 3: its exit code is run-in-vm.sh's (case 2).
hang_case() {
  rc=0
  IBTRS_VM_BOOT_TIMEOUT=30 IBTRS_VM_TEST_BOOT_FAULT=hang-first run -- sh -c 'echo command-ran; exit 3' >"$out" 2>"$err" || rc=$?
}
hang_case
# The retry's own boot may die of the early TCG panic the retry exists for (seen 1.5-3.7 s into
# boot, about one boot in a few dozen): the hang took the one retry, so the case failed for a
# cause that is not its subject. It runs once more then, and says so.
if [ "$rc" = 125 ] && grep -q 'died again before its command started: QEMU exited.*Kernel panic' "$err"; then
  echo "# boot-hang-retried-once: the retry's boot panicked on its own ($(grep -o 'Kernel panic[^|]*' "$err" | head -1)); once more"
  hang_case
fi
if [ "$rc" = 3 ] && grep -qx command-ran "$out" && grep -q 'had not started 30 s after boot.*booting it again' "$err"; then
  pass "boot-hang-retried-once"
  pass "exit-code-3-propagates"
else
  fail "boot-hang-retried-once" "rc=$rc $(tail -n 3 "$err" | tr '\n' ' ')"
  [ "$rc" = 3 ] && pass "exit-code-3-propagates" || fail "exit-code-3-propagates" "rc=$rc"
fi
# Death after the command started is the command's failure: not booted again.
rc=0
run -- sh -c 'echo command-ran; echo c >/proc/sysrq-trigger; sleep 30' >"$out" 2>"$err" || rc=$?
if [ "$rc" = 125 ] && [ "$(grep -c command-ran "$out")" = 1 ] && ! grep -q 'booting it again' "$err" &&
   grep -q 'died after its command started' "$err"; then
  pass "death-after-start-not-retried"
else
  fail "death-after-start-not-retried" "rc=$rc $(tail -n 3 "$err" | tr '\n' ' ')"
fi
expect "no-qemu-left-after-boot-faults" no_qemu_left

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
