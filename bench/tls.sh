#!/usr/bin/env bash
# What TLS 1.3 costs on the tcp provider: ibtrs-load (RAM-volume server and client, host key
# authentication on every row) over loopback tcp, plain against TLS with the record layer in the
# kernel (kTLS, where the kernel has it) and in userspace. Rows alternate plain / TLS per round,
# so drift in the host's load hits both. Prints IOPS, MiB/s, p50 latency and CPU per IO
# (client + server user+system time over the run) with the TLS/plain ratios, and the host and its
# load before and after. A benchmark, not a test: it asserts nothing.
#
#   bash bench/tls.sh [--seconds N] [--rounds N]       on this host (no kTLS here: userspace)
#   bash bench/tls.sh --vm [--seconds N] [--rounds N]  inside the VM rig (6.12 kernel, kTLS)
#
# The build directory comes from $IBTRS_BUILD (default build). Loopback addresses only.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
seconds=3
rounds=2
vm=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --vm) vm=1; shift ;;
    *) echo "usage: $0 [--vm] [--seconds N] [--rounds N]" >&2; exit 2 ;;
  esac
done
case "$seconds$rounds" in *[!0-9]*) echo "--seconds and --rounds take whole numbers" >&2; exit 2 ;; esac

build=${IBTRS_BUILD:-build}
if [ "${IBTRS_VM:-}" != 1 ]; then
  if [ ! -f "$build/build.ninja" ]; then
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  fi
  ninja -C "$build" -j "$(nproc)" ibtrs-load ibnbd >/dev/null
  if [ "$vm" = 1 ]; then
    exec bash "$top/tests/vm/run-in-vm.sh" --timeout 1500 --modprobe tls -- \
      env IBTRS_BUILD="$(cd "$build" && pwd)" bash "$top/bench/tls.sh" --seconds "$seconds" --rounds "$rounds"
  fi
fi
load="$build/transport/ibtrs-load"
cli="$build/client/cli/ibnbd"
[ -x "$cli" ] || cli=$(find "$build" -name ibnbd -type f -perm -u+x | head -1)

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

"$cli" key generate host nqn.2014-08.org.example:bench out "$tmp/host.key" >/dev/null

# cpu_ticks PID: user + system clock ticks of a process so far.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p" <<<"$2" | head -1; }

# A server per mode, started once: plain, tls (kernel record layer where it can), tls-user.
declare -A addr spid
start() {  # start MODE ARGS...
  local m=$1
  shift
  "$load" server --listen tcp:127.0.0.1:0 --queue-depth 128 --chunk-size 2M --size 1G \
    --host-key "$tmp/host.key" "$@" --ready-file "$tmp/$m.ready" >"$tmp/$m.log" 2>&1 &
  spid[$m]=$!
  pids+=("$!")
  for _ in $(seq 200); do [ -s "$tmp/$m.ready" ] && break; sleep 0.05; done
  [ -s "$tmp/$m.ready" ] || { echo "server $m did not start"; cat "$tmp/$m.log"; exit 1; }
  addr[$m]=$(sed -n 's/^listening //p' "$tmp/$m.ready" | head -1)
}
start plain
start tls --tls required
start tls-user --tls required --tls-user
declare -A cargs=([plain]="" [tls]="--tls on" [tls-user]="--tls on --tls-user")

# one MODE RW BS QD: "iops mib_s p50_us cpu_us_per_io"
one() {
  local m=$1 rw=$2 bs=$3 qd=$4 s0 s1 out t
  s0=$(cpu_ticks "${spid[$m]}")
  # shellcheck disable=SC2086
  out=$(/usr/bin/time -f "cpu %U %S" "$load" client --session "b-$m-$RANDOM" --path "${addr[$m]}" \
    --host-key "$tmp/host.key" ${cargs[$m]} --rw "$rw" --bs "$bs" --qd "$qd" --seconds "$seconds" \
    --size 1G --json 2>&1) || { echo "client $m failed: $out" >&2; echo "0 0 0 0"; return; }
  s1=$(cpu_ticks "${spid[$m]}")
  local line ops
  line=$(grep '^{' <<<"$out" | tail -1)
  sed -n 's/.*"tls":"\([^"]*\)".*/\1/p' <<<"$line" | head -1 >"$tmp/$m.tls"
  ops=$(field ops "$line")
  t=$(sed -n 's/^cpu \([0-9.]*\) \([0-9.]*\)$/\1 \2/p' <<<"$out" | tail -1)
  awk -v iops="$(field iops "$line")" -v mib="$(field mib_s "$line")" -v p50="$(field lat_p50_us "$line")" \
    -v ops="$ops" -v ct="$t" -v st=$((s1 - s0)) -v hz="$(getconf CLK_TCK)" 'BEGIN {
      split(ct, c, " "); cpu = c[1] + c[2] + st / hz;
      printf "%.0f %.1f %.1f %.2f\n", iops, mib, p50, (ops > 0 ? cpu * 1e6 / ops : 0) }'
}

echo "host: $(nproc) CPUs, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), kernel $(uname -r)"
echo "kTLS: $(grep -q '^tls ' /proc/modules 2>/dev/null && echo "module loaded" || echo "not loaded here (the first TLS connection tries)")"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "command: bash bench/tls.sh --seconds $seconds --rounds $rounds$([ "${IBTRS_VM:-}" = 1 ] && echo " --vm")"
echo

workloads=("randread 4k 32" "randwrite 4k 32" "randread 4k 1" "read 1m 4" "write 1m 4")
declare -A sum
for w in "${workloads[@]}"; do
  for r in $(seq "$rounds"); do
    for m in plain tls tls-user; do
      # shellcheck disable=SC2086
      read -r iops mib p50 cpu < <(one "$m" $w)
      sum[$w,$m,iops]=$(awk -v a="${sum[$w,$m,iops]:-0}" -v b="$iops" 'BEGIN{print a+b}')
      sum[$w,$m,mib]=$(awk -v a="${sum[$w,$m,mib]:-0}" -v b="$mib" 'BEGIN{print a+b}')
      sum[$w,$m,p50]=$(awk -v a="${sum[$w,$m,p50]:-0}" -v b="$p50" 'BEGIN{print a+b}')
      sum[$w,$m,cpu]=$(awk -v a="${sum[$w,$m,cpu]:-0}" -v b="$cpu" 'BEGIN{print a+b}')
    done
  done
done

echo "| workload | mode | IOPS | MiB/s | p50 µs | CPU µs/IO | IOPS vs plain | CPU/IO vs plain |"
echo "|---|---|---|---|---|---|---|---|"
for w in "${workloads[@]}"; do
  for m in plain tls tls-user; do
    avg() { awk -v a="${sum[$w,$m,$1]}" -v n="$rounds" 'BEGIN{printf "%.'"$2"'f", a/n}'; }
    ratio() { awk -v a="${sum[$w,$m,$1]}" -v b="${sum[$w,plain,$1]}" 'BEGIN{ if (b > 0) printf "%.2fx", a/b; else print "n/a" }'; }
    label="$m ($(cat "$tmp/$m.tls" 2>/dev/null))"
    echo "| $w | $label | $(avg iops 0) | $(avg mib 1) | $(avg p50 1) | $(avg cpu 2) | $(ratio iops) | $(ratio cpu) |"
  done
done
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
