#!/usr/bin/env bash
# Installs what is needed, builds, and runs every test: the default build (-Werror) with all
# host tests, the VM rig's real-RDMA tests, AddressSanitizer and ThreadSanitizer+UBSan builds,
# and libFuzzer on the wire decoders. This is what CI runs (.ci/run).
#
#   bash scripts/test.sh            everything
#   IBTRS_STAGES="build host" bash scripts/test.sh   a subset: build host vm asan tsan fuzz
#
# Time (CI's budget is 35 minutes on 2 cores): the host and VM stages leave a core idle much of
# the time (tests wait on sockets, timers and a TCG guest), so the sanitizer and fuzz builds run
# behind them at the lowest CPU and IO priority, one after another; each test stage waits for
# its own build. A background build takes only what the foreground leaves (nice 19 weighs 15
# against 1024), so the tests' timing is what it would be alone.
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top" || exit 1
stages=${IBTRS_STAGES:-"build host vm asan tsan fuzz"}
jobs=$(nproc)
passed=0
failed=0
failed_names=()

wanted() { case " $stages " in *" $1 "*) return 0 ;; esac; return 1; }

stage() {  # stage NAME COMMAND...
  local name=$1
  shift
  wanted "$name" || return 0
  echo
  echo "=== $name: $*"
  local t0=$SECONDS
  if "$@"; then
    echo "=== $name: ok ($((SECONDS - t0)) s)"
    passed=$((passed + 1))
  else
    echo "=== $name: FAILED ($((SECONDS - t0)) s)"
    failed=$((failed + 1))
    failed_names+=("$name")
  fi
}

# Line tables only (-g1): sanitizer reports and backtraces keep file:line at a fraction of full
# debug info's compile time. The default build is what users run (-O2; the tests' own code at
# -Og: gtest-heavy files compile in half the time). The sanitizer builds trade code speed for
# compile time, which dominates there: they are -Og unity builds (CMAKE_UNITY_BUILD: a target's
# files compiled together, its headers parsed once). UBSan rides with TSan, not ASan: per file
# (fabric_conformance's unity file, user CPU) ASan+UBSan 35 s and TSan at -O1 19 s against ASan
# 21 s and TSan+UBSan 25 s at -Og, some 16 % less for the two builds, which were 2675 s of CPU
# of a CI run that is CPU-bound. (TSan+UBSan at -O1 is 42 s: UBSan's checks are what the
# optimizer then chews on.) Only the fio engine's test runs under ASan alone (a TSan runtime
# cannot join fio). Warnings are the default build's job (-Werror); at -Og GCC warns of
# uninitialized uses it cannot rule out.
configure_build() {  # configure_build DIR OPT [CMAKE-ARGS...] [-- TARGETS...]
  local dir=$1 opt=$2 args=() targets=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do args+=("$1"); shift; done
  [ $# -gt 0 ] && shift && targets=("$@")
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$opt -g1 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=$opt -g1 -DNDEBUG" \
    "${args[@]}" >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; return 1; }
  ninja -C "$dir" -j "$jobs" "${targets[@]}"
}

host_tests() {  # host_tests DIR [EXCLUDE-LABELS [EXCLUDE-NAMES]]: every test that needs neither the VM nor real RDMA
  # Three at a time: most tests wait on sockets and timers (the default build's suite keeps
  # under half of two cores busy at two at a time).
  ctest --test-dir "$1" -LE "${2:-^(rdma|vm|vm_one)\$}" ${3:+-E "$3"} --output-on-failure -j 3 --timeout 300
}

# The background builds: ASan, TSan, then the fuzz targets (clang 14 builds only what the fuzz
# stage runs: it lacks C++20 pieces some tests use, such as structured bindings captured by
# lambdas). Each writes build-logs/NAME.log and, when done, build-logs/NAME.rc. The fuzz build
# is ASan without UBSan: UBSan nearly doubles clang's time per file (client.cc: 24 s of CPU
# against 13.5 s), and every decoder's seeds and 20000 deterministic mutations run under UBSan
# in the TSan stage (fuzz_*_replay); the smoke run here is 10 s per target (long fuzzing runs
# can turn UBSan on: -DIBTRS_UBSAN=ON).
background_builds() {
  local name
  for name in asan tsan fuzz; do
    wanted "$name" || continue
    case $name in
      asan) configure_build build-asan -Og -DIBTRS_SANITIZE=address -DIBTRS_UBSAN=OFF -DIBTRS_RDMA=ON -DIBTRS_BENCH=OFF -DCMAKE_UNITY_BUILD=ON ;;
      tsan) configure_build build-tsan -Og -DIBTRS_SANITIZE=thread -DIBTRS_UBSAN=ON -DIBTRS_RDMA=ON -DIBTRS_BENCH=OFF -DCMAKE_UNITY_BUILD=ON ;;
      fuzz) CXX=clang++ configure_build build-fuzz -O2 -DIBTRS_WERROR=ON -DIBTRS_FUZZ=ON \
              -DIBTRS_SANITIZE=address -DIBTRS_UBSAN=OFF -DIBTRS_RDMA=OFF -DIBTRS_TESTS=ON -- \
              fuzz-replay fuzz_tcp_rx fuzz_proto fuzz_ibnbd_proto fuzz_auth fuzz_qemu_rdma fuzz_qemu_stream ;;
    esac >"build-logs/$name.log" 2>&1
    echo $? >"build-logs/$name.rc"
  done
}

wait_build() {  # wait_build NAME: the background build's result, its log's tail on failure
  local name=$1 t0=$SECONDS rc
  while [ ! -e "build-logs/$name.rc" ]; do
    kill -0 "$bg_pid" 2>/dev/null || [ -e "build-logs/$name.rc" ] ||
      { echo "the background builds stopped before $name was built"; return 1; }
    sleep 2
  done
  rc=$(cat "build-logs/$name.rc")
  echo "($name build: exit $rc; this stage waited $((SECONDS - t0)) s for it)"
  [ "$rc" = 0 ] || { tail -n 60 "build-logs/$name.log"; return 1; }
}

# The sanitizer stages leave out the netns scripts: they drive the same binaries as the host
# stage through shell, for about a minute each, and find nothing a sanitizer would. The short
# soak (label soak, ~65 s) runs in the default build only, for the suite's 35 minutes; its
# daemons under ASan: `ninja -C build-asan ibnbd-soak ibnbd-soak-fs && ctest --test-dir
# build-asan -L soak` (clean when it was merged; the sanitizer builds do not make the soak's
# programs by default: ibtrs_not_sanitized in CMakeLists.txt).
# seed_costs DIR: the default build's test times as DIR's timing history, so that ctest starts
# the long tests first there too (their order under a sanitizer is much the same).
seed_costs() {
  local from=build/Testing/Temporary/CTestCostData.txt
  [ -e "$from" ] && [ ! -e "$1/Testing/Temporary/CTestCostData.txt" ] || return 0
  mkdir -p "$1/Testing/Temporary" && cp "$from" "$1/Testing/Temporary/"
}
# ASan leaves out the loopback twins of the block-layer scenarios (ibnbd_client, integration,
# block_server): the code above the fabric is the same in both, and the tcp twin runs it with the
# tcp provider's receive path, which parses what a peer sent; the loopback fabric's memory is
# fabric_conformance_loopback's and session_loopback's (both run here).
asan_tests() {
  wait_build asan && seed_costs build-asan &&
    host_tests build-asan '^(rdma|vm|vm_one|netns|soak)$' '^(ibnbd_client_loopback|integration_loopback|block_server_loopback)$'
}
# TSan also leaves out twins whose difference is not threads: always_invalidate's re-keying
# (session_*_inv: memory registration, ASan's domain), integration over loopback (its tcp twin
# runs; fabric_conformance_loopback covers the loopback fabric's threads), the client library's
# scenarios over tcp (their loopback twin runs; the tcp provider's threads are
# fabric_conformance_tcp's and session_tcp's), rbd_gateway's functional round (rbd_failover keeps
# librbd's callbacks and the failover thread under TSan), and the shell-only install and chart
# tests: ~260 s of the stage's test time, for the suite's 35 minutes. The TSan build itself
# (IBTRS_TSAN in CMakeLists.txt) defines no test of third-party tools against the export
# (nbd_tools), of the migration agent under QEMU, of the soak checker, nor single-threaded units,
# and builds none of their programs: its build was the last to finish, and this stage waited
# 87-121 s for it (two CI runs, session 9).
tsan_tests() {
  wait_build tsan && seed_costs build-tsan &&
    host_tests build-tsan '^(rdma|vm|vm_one|netns)$' \
      '^(session_loopback_inv|session_tcp_inv|integration_loopback|ibnbd_client_tcp|rbd_gateway|install_layout|bench_chart)$'
}
# Two fuzzers at a time: each is one process on one core.
fuzz_tests() { wait_build fuzz && ctest --test-dir build-fuzz -L fuzz --output-on-failure -j 2; }

bash scripts/setup.sh || { echo "setup failed"; exit 1; }
mkdir -p build-logs
rm -f build-logs/{asan,tsan,fuzz}.rc

# A unity build, as the sanitizer builds: 322 s against 396 s for the whole tree on this host (635
# against 788 s of CPU; -O2's optimizer is most of the rest). Code that compiles only beside
# another file's includes would pass here: the README's demo (scripts/demo.sh) builds file by file.
stage build configure_build build -O2 -DIBTRS_WERROR=ON -DIBTRS_TEST_OPT=-Og -DIBTRS_RDMA=ON -DCMAKE_UNITY_BUILD=ON
bg_pid=""
if wanted asan || wanted tsan || wanted fuzz; then
  ( renice -n 19 "$BASHPID" >/dev/null; ionice -c 3 -p "$BASHPID" 2>/dev/null; background_builds ) &
  bg_pid=$!
fi
stage host host_tests build
# Real RDMA (Soft-RoCE), ublk, nbd and kTLS inside the VM: the rig's self-test and every VM test
# in one boot (vm_suite); skips (77) only without QEMU.
stage vm ctest --test-dir build -L '^vm$' --output-on-failure --timeout 900
stage asan asan_tests
stage tsan tsan_tests
stage fuzz fuzz_tests
[ -z "$bg_pid" ] || wait "$bg_pid"

echo
if [ "$failed" -ne 0 ]; then
  echo "failed stages: ${failed_names[*]}"
fi
echo "stages: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
