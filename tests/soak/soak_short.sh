#!/usr/bin/env bash
# ctest soak_short (issue 17): two short soaks of tools/soak/soak.sh side by side, every host
# fault on each (path cut, link flaps, server kill -9 and SIGSTOP, ENOSPC, EIO, a slow backend,
# policy changes, path remove/add; client daemon kill -9 on the NBD one):
#   lib  the client library's device, a fixed seed (the same faults every run)
#   nbd  the client daemon's NBD export, a random seed (printed: SOAK_NBD_SEED=N replays it)
# Fails on any lost, torn, stale or corrupt block, an application error no fault explains, a
# fault that could not be run, or a fault that did not bite (ENOSPC / EIO never seen).
# Exit 77 (skip) when soak.sh skips (not root, no netns, not built).
#
#   bash tests/soak/soak_short.sh BUILD_DIR      env: SOAK_LIB_SEED, SOAK_NBD_SEED, SOAK_DURATION
set -u -o pipefail

build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd) || exit 1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
soak=$here/../../tools/soak/soak.sh
# shellcheck source-path=SCRIPTDIR source=verdict.sh
. "$here/verdict.sh"
lib_seed=${SOAK_LIB_SEED:-17}
nbd_seed=${SOAK_NBD_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
dur=${SOAK_DURATION:-60s}
out=$(mktemp -d "${TMPDIR:-/tmp}/soak-short.XXXXXX")
trap 'rm -rf "$out"' EXIT
echo "# soak_short: lib seed $lib_seed (fixed), nbd seed $nbd_seed (random; SOAK_NBD_SEED=$nbd_seed replays it), $dur each"

# Short gaps between faults, so that each run sees every kind within its minute.
# shellcheck disable=SC2054  # "1000,2500" is one argument
common=(--duration "$dur" -- --gap-ms 1000,2500 --qd 16 --iops 3000)
bash "$soak" "$build" --target lib --seed "$lib_seed" --json "$out/lib.json" "${common[@]}" >"$out/lib.log" 2>&1 &
lib_pid=$!
bash "$soak" "$build" --target nbd --seed "$nbd_seed" --json "$out/nbd.json" "${common[@]}" >"$out/nbd.log" 2>&1 &
nbd_pid=$!
wait "$lib_pid"
lib_rc=$?
wait "$nbd_pid"
nbd_rc=$?

failed=0
for t in lib nbd; do
  rc_var=${t}_rc
  rc=${!rc_var}
  echo "# ---- $t (exit $rc)"
  sed 's/^/  /' "$out/$t.log"
  if [ "$rc" = 77 ]; then
    continue
  fi
  if [ "$rc" != 0 ]; then
    echo "not ok - soak $t: exit $rc"
    failed=1
    continue
  fi
  # The faults must have happened and bitten: most kinds at least once, and the backend
  # faults seen as errors by the application.
  if command -v jq >/dev/null && [ -s "$out/$t.json" ]; then
    # (A fault waits for IO to flow again after the one before: a slow host, ASan's build, runs
    # fewer of them in the minute; six kinds is what any of them ran so far with room to spare.)
    soak_json_why "$out/$t.json" 6
    kinds=$(jq -r '[.faults[].kind] | join(",")' "$out/$t.json")
    if [ ${#why[@]} -eq 0 ]; then
      echo "ok - soak $t: clean, faults $kinds"
    else
      echo "not ok - soak $t: ${why[*]}"
      failed=1
    fi
  else
    echo "ok - soak $t: clean (no jq: the faults' effect not checked)"
  fi
done
if [ "$lib_rc" = 77 ] && [ "$nbd_rc" = 77 ]; then
  echo "1..0 # SKIP $(grep -h SKIP "$out/lib.log" | head -1)"
  exit 77
fi
exit "$failed"
