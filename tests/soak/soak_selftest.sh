#!/usr/bin/env bash
# ctest soak_selftest: the soak checker against a device that lies (issue 17). ibnbd-soak drives
# a file on ibnbd-soak-fs (--file: O_DIRECT through FUSE) three times: honest, with writes to
# the first MiB acknowledged and dropped, and with them torn (their last 64 bytes unwritten).
# Expect: exit 0 with nothing found; exit 1 with lost blocks (and nothing torn); exit 1 with torn
# blocks. A checker that never fails proves nothing. And the schedule's end with hooks slower
# than its plan. Skips (77) without FUSE.
#
#   bash tests/soak/soak_selftest.sh BUILD_DIR
# shellcheck disable=SC2317  # cleanup runs from a trap
set -u -o pipefail

build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd) || exit 1
# shellcheck source=../lib/tap.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/tap.sh"
soak=$build/tools/soak/ibnbd-soak
fs=$build/tools/soak/ibnbd-soak-fs
for b in "$soak" "$fs"; do [ -x "$b" ] || { echo "1..0 # SKIP $b not built"; exit 77; }; done
command -v jq >/dev/null || { echo "1..0 # SKIP no jq"; exit 77; }
[ -e /dev/fuse ] && command -v fusermount3 >/dev/null || { echo "1..0 # SKIP no FUSE here"; exit 77; }

work=$(mktemp -d "${TMPDIR:-/tmp}/soak-selftest.XXXXXX")
fs_pid=""
cleanup() {
  [ -n "$fs_pid" ] && { fusermount3 -u "$work/mnt" 2>/dev/null; kill "$fs_pid" 2>/dev/null; wait "$fs_pid" 2>/dev/null; }
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/back" "$work/mnt"
"$fs" "$work/back" "$work/mnt" >"$work/fs.log" 2>&1 &
fs_pid=$!
wait_for "$work/mnt/.soak-ctl" || { echo "1..0 # SKIP ibnbd-soak-fs did not mount: $(tail -1 "$work/fs.log")"; exit 77; }

# run NAME SEED CTL: a fresh sparse volume, CTL written to the control file, a 4 s soak.
run() {
  local name=$1 seed=$2 ctl=$3
  rm -f "$work/back/vol.img"
  truncate -s 16M "$work/back/vol.img"
  echo "$ctl" >"$work/mnt/.soak-ctl"
  timeout 120 "$soak" --file "$work/mnt/vol.img" --seed "$seed" --duration 4s --interval 2s --qd 8 \
    --json "$work/$name.json" >"$work/$name.log" 2>&1
  echo $? >"$work/$name.rc"
  echo clear >"$work/mnt/.soak-ctl"
}
field() { jq -r "$2" "$work/$1.json" 2>/dev/null; }

# Case: an honest device. Expect: exit 0, every block verified, no defect.
run honest 1 clear
rc=$(cat "$work/honest.rc")
if [ "$rc" = 0 ] && [ "$(field honest .blocks_checked.verified)" -ge 4096 ]; then
  ok "honest device: clean, $(field honest .ios.total) IOs, all 4096 blocks verified"
else
  not_ok "honest device" "exit $rc: $(tail -5 "$work/honest.log")"
fi

# Case: writes to the first MiB acknowledged and dropped. Expect: exit 1, lost blocks, none torn.
run lose 2 "lose 0 1048576"
rc=$(cat "$work/lose.rc")
lost=$(( $(field lose .blocks_checked.lost) + $(field lose .blocks_checked.lost_flushed) ))
if [ "$rc" = 1 ] && [ "$lost" -gt 0 ] && [ "$(field lose .blocks_checked.torn)" = 0 ]; then
  ok "dropped writes: found $lost lost blocks ($(field lose .blocks_checked.lost_flushed) of them flushed)"
else
  not_ok "dropped writes" "exit $rc, lost $lost, torn $(field lose .blocks_checked.torn): $(tail -5 "$work/lose.log")"
fi

# Case: writes to the first MiB torn. Expect: exit 1, torn blocks.
run tear 3 "tear 0 1048576"
rc=$(cat "$work/tear.rc")
torn=$(field tear .blocks_checked.torn)
if [ "$rc" = 1 ] && [ "${torn:-0}" -gt 0 ]; then
  ok "torn writes: found $torn torn blocks"
else
  not_ok "torn writes" "exit $rc, torn ${torn:-none}: $(tail -5 "$work/tear.log")"
fi
# Case: hooks slower than the plan (a TCG guest's: every step 2 s), a plain file, seed 4 (6
# faults planned in 12 s). Expect: a clean run that stops starting faults at its end: fewer of
# them ran than were planned (before, a late fault's start in the past was not checked against
# the end, and the plan's rest ran one after the other after the IO had stopped).
printf '#!/bin/sh\nsleep 2\n' >"$work/slow-hook"
truncate -s 16M "$work/back/late.img"
timeout 120 "$soak" --file "$work/back/late.img" --seed 4 --duration 12s --interval 6s --qd 4 --faults server-stop \
  --hb-timeout-ms 100 --gap-ms 100,100 --hook "sh $work/slow-hook" --json "$work/late.json" >"$work/late.log" 2>&1
rc=$?
ran=$(field late .faults_run) planned=$(field late .faults_planned)
if [ "$rc" = 0 ] && [ "${planned:-0}" -ge 5 ] && [ "${ran:-99}" -lt "$planned" ]; then
  ok "late faults: $ran of $planned ran, none after the end"
else
  not_ok "late faults" "exit $rc, $ran of $planned ran: $(tail -5 "$work/late.log")"
fi
exit "$failed"
