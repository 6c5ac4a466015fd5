#!/usr/bin/env bash
# bench/chart.sh against tables shaped like the benchmarks' (Case / Expect per check).
set -u -o pipefail
chart=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../bench" && pwd)/chart.sh
command -v gnuplot >/dev/null || { echo "skipped: gnuplot is missing (scripts/setup.sh installs gnuplot-nox)"; exit 77; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/chart-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failed=0
ok() { echo "ok - $1"; }
not_ok() { echo "not ok - $1"; failed=1; }
is_png() { [ -s "$1" ] && [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; }

cat >"$tmp/fio.md" <<'T'
# fio benchmark (text before the table is skipped)

| workload | target | IOPS | MiB/s | mean us | p99 us | IOPS vs best peer |
| --- | --- | --- | --- | --- | --- | --- |
| 4k randread qd32 | nbdkit-unix | 61100 | 238.7 | 32.1 | 80.0 | 1.00 |
| 4k randread qd32 | ibnbd-1p | 152900 | 597.3 | 11.0 | 40.2 | 2.50 |
| 1m write qd8 | nbdkit-unix | 1130 | 1130.0 | 7000.5 | 9000 | 1.00 |
| 1m write qd8 | ibnbd-1p | failed (fio exit 1) | | | | |

| a second table | is | ignored |
T

# Case: a fio-shaped table, three value columns, one run failed.
# Expect: a PNG; the failed run is a gap, not an error.
if bash "$chart" --title "t" "$tmp/fio.md" "$tmp/fio.png" IOPS "mean us=mean latency (us)" "p99 us" >"$tmp/out" 2>&1 &&
  is_png "$tmp/fio.png"; then ok "fio table drawn"; else not_ok "fio table: $(cat "$tmp/out")"; fi

# Case: a table whose second column is a value (bench/migrate-vm.sh: one bar per row).
# Expect: a PNG.
printf '| row | MiB/s (median) | s |\n| --- | --- | --- |\n| save qemu rdma | 8.2 | 5.9 |\n| save agent rdma | 5.2 | 9.3 |\n' >"$tmp/mig.md"
if bash "$chart" "$tmp/mig.md" "$tmp/mig.png" "MiB/s (median)" >"$tmp/out" 2>&1 && is_png "$tmp/mig.png"; then
  ok "one series per row drawn"; else not_ok "one series: $(cat "$tmp/out")"; fi

# Case: a value column the table does not have.
# Expect: exit 1, the column named, no file.
if bash "$chart" "$tmp/fio.md" "$tmp/bad.png" "IOPS" "median us" >"$tmp/out" 2>&1; then
  not_ok "an unknown column was accepted"
elif grep -q 'median us' "$tmp/out" && [ ! -e "$tmp/bad.png" ]; then ok "unknown column named"
else not_ok "unknown column: $(cat "$tmp/out")"; fi

# Case: a file without a markdown table; no arguments.
# Expect: exit 1 saying so; usage with exit 2.
echo "no table here" >"$tmp/none.md"
bash "$chart" "$tmp/none.md" "$tmp/none.png" IOPS >"$tmp/out" 2>&1
rc=$?
if [ "$rc" = 1 ] && grep -q "no markdown table" "$tmp/out"; then ok "no table: clear error"; else not_ok "no table: rc=$rc $(cat "$tmp/out")"; fi
bash "$chart" >"$tmp/out" 2>&1
rc=$?
if [ "$rc" = 2 ] && grep -q usage "$tmp/out"; then ok "usage"; else not_ok "usage: rc=$rc"; fi

exit "$failed"
