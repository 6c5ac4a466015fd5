#!/usr/bin/env bash
# Runs a command inside a throw-away QEMU/TCG VM that boots Debian's 6.12 kernel
# with the host root filesystem shared read-only (9p + tmpfs overlay), Soft-RoCE
# (rxe0/rxe1 over a veth pair), ublk_drv and nbd. See tests/vm/README.md.
#
#   tests/vm/run-in-vm.sh [options] -- COMMAND [ARGS...]
#
# Exit code: COMMAND's exit code, or
#   77  prerequisite missing (qemu-system-x86_64, ...): the caller should skip
#   124 timeout (QEMU killed)
#   125 rig failure (kernel download, boot, guest setup, ...)
#   130/143 interrupted (SIGINT/SIGTERM)
#   141 our stdout/stderr was closed while the VM ran (e.g. "| head")
# shellcheck disable=SC2317 # the cleanup functions are only invoked by traps
set -euo pipefail

RIG_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly RIG_DIR
readonly INIT_SRC="$RIG_DIR/init"
readonly GUEST_SETUP="$RIG_DIR/guest-setup.sh"
# Bump when the initramfs layout produced by build_initramfs changes.
readonly INITRAMFS_FORMAT=1
# Bump when the kernel cache layout produced by build_kernel_cache changes.
readonly KERNEL_CACHE_FORMAT=1
# Modules stored decompressed in the cache (with their dependencies): the ones
# guest-setup.sh always loads plus likely extras. xz under TCG is slow.
readonly HOT_MODULES=(veth rdma_rxe ib_uverbs rdma_ucm ublk_drv nbd configfs sch_netem sch_tbf sch_htb)
# Modules that stage 1 (tests/vm/init) insmods from the initramfs, in order.
readonly INITRAMFS_MODULES=(netfs 9pnet 9pnet_virtio 9p overlay)

me="run-in-vm"
say() { echo "$me: $*" >&2; }
die() { say "ERROR: $*"; exit 125; }
skip() { say "SKIP: $*"; exit 77; }

usage() {
  cat <<'EOF'
usage: tests/vm/run-in-vm.sh [options] -- COMMAND [ARGS...]

Boots a QEMU/TCG VM (Debian 6.12 kernel, host root read-only + tmpfs overlay,
rxe0/rxe1 Soft-RoCE over veth0/veth1, ublk_drv, nbd) and runs COMMAND in it.
COMMAND is exec'd with its arguments as given (no shell); use
`-- sh -c '...'` for shell syntax.

options:
  --timeout SECONDS  kill the VM after SECONDS (boot included; default 600)
  --cwd DIR          working directory of COMMAND (default: the caller's cwd)
  --mem MB           guest memory (default 2048)
  --smp N            guest CPUs (default 2)
  --rw-share DIR     mount host DIR read-write at the same path (repeatable)
  --env NAME=VALUE   extra environment variable for COMMAND (repeatable)
  --modprobe MOD     extra kernel module to load (repeatable)
  --mtu N            MTU of veth0/veth1 (default 1500 -> RoCE MTU 1024;
                     9000 -> RoCE MTU 4096)
  --verbose          also print the guest console (kernel + setup log) on stderr
  -h, --help         this text

environment:
  IBTRS_VM_CACHE     cache dir (default ~/.cache/ibtrs-vm)
  IBTRS_VM_KERNEL    kernel version to use, e.g. 6.12.117+deb12-amd64, or
                     "latest" (ask apt); default: newest cached, else latest
  IBTRS_VM_VERBOSE=1 same as --verbose (2: also trace the guest setup)
  IBTRS_VM_APPEND    extra kernel command line arguments
  IBTRS_VM_QEMU      QEMU binary (default qemu-system-x86_64)

exit code: COMMAND's, or 77 (prerequisite missing), 124 (timeout),
125 (rig failure), 130/143 (interrupted), 141 (stdout/stderr closed).
EOF
}

# ---------------------------------------------------------------- arguments
timeout_s=600
cwd="$PWD"
mem=2048
smp=2
verbose="${IBTRS_VM_VERBOSE:-0}"
rw_shares=()
user_env=()
extra_modules=()
mtu=1500

need_arg() { [ "$#" -ge 2 ] || { say "option $1 needs an argument"; usage >&2; exit 125; }; }
while [ "$#" -gt 0 ]; do
  case "$1" in
    --timeout) need_arg "$@"; timeout_s="$2"; shift 2 ;;
    --timeout=*) timeout_s="${1#*=}"; shift ;;
    --cwd) need_arg "$@"; cwd="$2"; shift 2 ;;
    --cwd=*) cwd="${1#*=}"; shift ;;
    --mem) need_arg "$@"; mem="$2"; shift 2 ;;
    --mem=*) mem="${1#*=}"; shift ;;
    --smp) need_arg "$@"; smp="$2"; shift 2 ;;
    --smp=*) smp="${1#*=}"; shift ;;
    --rw-share) need_arg "$@"; rw_shares+=("$2"); shift 2 ;;
    --rw-share=*) rw_shares+=("${1#*=}"); shift ;;
    --env) need_arg "$@"; user_env+=("$2"); shift 2 ;;
    --env=*) user_env+=("${1#*=}"); shift ;;
    --modprobe) need_arg "$@"; extra_modules+=("$2"); shift 2 ;;
    --modprobe=*) extra_modules+=("${1#*=}"); shift ;;
    --mtu) need_arg "$@"; mtu="$2"; shift 2 ;;
    --mtu=*) mtu="${1#*=}"; shift ;;
    --verbose|-v) verbose=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) say "unknown option: $1"; usage >&2; exit 125 ;;
  esac
done
[ "$#" -gt 0 ] || { say "no COMMAND given"; usage >&2; exit 125; }

is_uint() { [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -gt 0 ]; }
is_uint "$timeout_s" || die "--timeout must be a positive integer (seconds), got '$timeout_s'"
is_uint "$mem" || die "--mem must be a positive integer (MB), got '$mem'"
{ is_uint "$mtu" && [ "$mtu" -ge 1280 ] && [ "$mtu" -le 65535 ]; } || die "--mtu must be 1280..65535, got '$mtu'"
is_uint "$smp" || die "--smp must be a positive integer, got '$smp'"
case "$cwd" in /*) ;; *) cwd="$PWD/$cwd" ;; esac
[ -d "$cwd" ] || die "--cwd $cwd: no such directory"
cwd="$(cd "$cwd" && pwd -P)"
for i in "${!rw_shares[@]}"; do
  [ -d "${rw_shares[$i]}" ] || die "--rw-share ${rw_shares[$i]}: no such directory"
  rw_shares[i]="$(cd "${rw_shares[$i]}" && pwd -P)"
  [ "${rw_shares[$i]}" != / ] || die "--rw-share / is not allowed"
done
for e in "${user_env[@]}"; do
  [[ "$e" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env expects NAME=VALUE, got '$e'"
done
for m in "${extra_modules[@]}"; do
  [[ "$m" =~ ^[A-Za-z0-9_-]+$ ]] || die "--modprobe: bad module name '$m'"
done
# ---------------------------------------------------------------- prerequisites
qemu_bin="${IBTRS_VM_QEMU:-qemu-system-x86_64}"
command -v "$qemu_bin" >/dev/null 2>&1 \
  || skip "$qemu_bin not found (install qemu-system-x86, see scripts/setup.sh)"
[ -r "$INIT_SRC" ] || die "missing $INIT_SRC"
[ -r "$GUEST_SETUP" ] || die "missing $GUEST_SETUP"

cache_root="${IBTRS_VM_CACHE:-${HOME:-/root}/.cache/ibtrs-vm}"

# ---------------------------------------------------------------- cleanup
qemu_pid=""
sleep_pid=""
boot_pid=""
reader_pids=()
run_dir=""
tmp_paths=()

kill_qemu() {
  if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then
    kill -TERM "$qemu_pid" 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      kill -0 "$qemu_pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL "$qemu_pid" 2>/dev/null || true
    wait "$qemu_pid" 2>/dev/null || true
  fi
  qemu_pid=""
}

cleanup() {
  kill_qemu
  for p in "$sleep_pid" "$boot_pid"; do
    [ -n "$p" ] || continue
    kill "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  sleep_pid="" boot_pid=""
  for p in "${reader_pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  reader_pids=()
  for p in "${tmp_paths[@]}"; do rm -rf -- "$p"; done
  tmp_paths=()
  if [ -n "$run_dir" ]; then rm -rf -- "$run_dir"; run_dir=""; fi
}

on_signal() {
  local sig="$1" code="$2"
  trap - INT TERM
  say "interrupted by SIG$sig, killing the VM"
  cleanup
  exit "$code"
}
trap cleanup EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
trap 'on_signal HUP 129' HUP

# ---------------------------------------------------------------- kernel cache
apt_latest_kver() {
  local pat='^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$' v
  v="$(apt-cache search --names-only "$pat" 2>/dev/null | awk '{print $1}' \
        | sed -e 's/^linux-image-//' -e 's/-unsigned$//' | sort -V | tail -n 1)"
  if [ -z "$v" ]; then
    say "apt-cache knows no linux-image-6.12.*+deb12-amd64-unsigned, running apt-get update"
    if [ "$(id -u)" -eq 0 ]; then apt-get update -qq >&2 || true; else sudo -n apt-get update -qq >&2 || true; fi
    v="$(apt-cache search --names-only "$pat" 2>/dev/null | awk '{print $1}' \
          | sed -e 's/^linux-image-//' -e 's/-unsigned$//' | sort -V | tail -n 1)"
  fi
  echo "$v"
}

kernel_cache_ok() { # DIR
  [ -f "$1/vmlinuz" ] && [ -f "$1/modules/modules.dep" ] && [ "$(cat "$1/format" 2>/dev/null)" = "$KERNEL_CACHE_FORMAT" ]
}

newest_cached_kver() {
  local d best=""
  [ -d "$cache_root" ] || return 0
  for d in "$cache_root"/6.12.*+deb12-amd64; do
    kernel_cache_ok "$d" || continue
    best="$(printf '%s\n%s\n' "$best" "${d##*/}" | sed '/^$/d' | sort -V | tail -n 1)"
  done
  echo "$best"
}

build_kernel_cache() {
  local kver="$1" dest="$cache_root/$1" tmp deb t0
  local tool
  for tool in apt-get dpkg depmod; do
    command -v "$tool" >/dev/null 2>&1 || skip "$tool not found, cannot fetch the VM kernel"
  done
  t0=$SECONDS
  say "building the kernel cache for $kver in $dest"
  mkdir -p "$cache_root"
  tmp="$(mktemp -d "$cache_root/.kernel-$kver.XXXXXX")"
  tmp_paths+=("$tmp")
  local apt_opts=(-q)
  [ "$(id -u)" -ne 0 ] || apt_opts+=(-o APT::Sandbox::User=root)
  (cd "$tmp" && apt-get "${apt_opts[@]}" download "linux-image-$kver-unsigned" >&2) \
    || die "apt-get download linux-image-$kver-unsigned failed"
  deb="$(echo "$tmp"/linux-image-*.deb)"
  [ -f "$deb" ] || die "downloaded package not found in $tmp"
  dpkg -x "$deb" "$tmp/x" || die "dpkg -x $deb failed"
  rm -f -- "$deb"
  [ -f "$tmp/x/boot/vmlinuz-$kver" ] || die "vmlinuz-$kver missing from the package"
  [ -d "$tmp/x/lib/modules/$kver" ] || die "modules for $kver missing from the package"
  depmod -b "$tmp/x" "$kver" || die "depmod -b failed"
  local mods m
  mods="$(modprobe -d "$tmp/x" -S "$kver" --show-depends -a "${HOT_MODULES[@]}" 2>/dev/null \
          | awk '$1 == "insmod" {print $2}' | sort -u)"
  for m in $mods; do
    case "$m" in
      *.ko.xz|*.ko.zst|*.ko.gz)
        decompress_module "$m" "${m%.*}" || die "cannot decompress $m"
        rm -f -- "$m"
        ;;
    esac
  done
  depmod -b "$tmp/x" "$kver" || die "depmod -b failed"
  mkdir "$tmp/k"
  mv "$tmp/x/boot/vmlinuz-$kver" "$tmp/k/vmlinuz"
  mv "$tmp/x/boot/config-$kver" "$tmp/k/config" 2>/dev/null || true
  mv "$tmp/x/lib/modules/$kver" "$tmp/k/modules"
  echo "$KERNEL_CACHE_FORMAT" >"$tmp/k/format"
  # Atomic publish: rename(2) of a complete directory. If a concurrent run won
  # the race, mv -T fails on the non-empty target and we use its copy.
  # An outdated cache (other KERNEL_CACHE_FORMAT) is renamed away first.
  if [ -e "$dest" ] && ! kernel_cache_ok "$dest"; then
    mv -T "$dest" "$tmp/old" 2>/dev/null || true
  fi
  if ! mv -T "$tmp/k" "$dest" 2>/dev/null; then
    kernel_cache_ok "$dest" || die "cannot publish $dest"
  fi
  rm -rf -- "$tmp"
  say "kernel cache ready ($((SECONDS - t0)) s)"
}

decompress_module() { # SRC DST
  case "$1" in
    *.ko.xz) xz -dc -- "$1" >"$2" ;;
    *.ko.zst) zstd -qdc -- "$1" >"$2" ;;
    *.ko.gz) gzip -dc -- "$1" >"$2" ;;
    *.ko) cp -- "$1" "$2" ;;
    *) return 1 ;;
  esac
}

build_initramfs() { # KDIR IMG
  local kdir="$1" img="$2" tmp m src busybox
  busybox="$(command -v busybox || true)"
  [ -n "$busybox" ] || skip "busybox not found (install busybox-static)"
  command -v cpio >/dev/null 2>&1 || skip "cpio not found"
  file -b "$busybox" 2>/dev/null | grep -q 'dynamically linked' \
    && skip "$busybox is dynamically linked (install busybox-static)"
  [ "$verbose" = 0 ] || say "building $img"
  tmp="$(mktemp -d "$kdir/.initramfs.XXXXXX")"
  tmp_paths+=("$tmp")
  mkdir -p "$tmp/root/bin" "$tmp/root/modules"
  cp -- "$busybox" "$tmp/root/bin/busybox"
  cp -- "$INIT_SRC" "$tmp/root/init"
  chmod 0755 "$tmp/root/init" "$tmp/root/bin/busybox"
  for m in "${INITRAMFS_MODULES[@]}"; do
    src="$(find "$kdir/modules/kernel" -name "$m.ko*" -print -quit)"
    [ -n "$src" ] || die "module $m not found in $kdir/modules"
    decompress_module "$src" "$tmp/root/modules/$m.ko" || die "cannot decompress $src"
  done
  (cd "$tmp/root" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet) >"$tmp/img" \
    || die "cpio failed"
  mv -f -- "$tmp/img" "$img"
  rm -rf -- "$tmp"
  # Drop initramfs images of older init versions (not in use for an hour).
  find "$kdir" -maxdepth 1 -name 'initramfs-*.cpio' ! -name "${img##*/}" -mmin +60 -delete 2>/dev/null || true
}

case "${IBTRS_VM_KERNEL:-}" in
  "") kver="$(newest_cached_kver)"; [ -n "$kver" ] || kver="$(apt_latest_kver)" ;;
  latest) kver="$(apt_latest_kver)" ;;
  *) kver="$IBTRS_VM_KERNEL" ;;
esac
[ -n "$kver" ] || die "cannot find a linux-image-6.12.*+deb12-amd64-unsigned package (apt-cache search)"
[[ "$kver" =~ ^[0-9A-Za-z.+_-]+$ ]] || die "bad kernel version '$kver'"
kdir="$cache_root/$kver"
if ! kernel_cache_ok "$kdir"; then
  # Serialize concurrent first runs (the build itself is atomic anyway).
  mkdir -p "$cache_root"
  if command -v flock >/dev/null 2>&1; then
    exec {lock_fd}>"$cache_root/.lock"
    flock "$lock_fd"
  fi
  kernel_cache_ok "$kdir" || build_kernel_cache "$kver"
  [ -z "${lock_fd:-}" ] || exec {lock_fd}>&-
fi

# Cache key of the initramfs: the init script, busybox, the module list, the format.
init_hash="$( { echo "format=$INITRAMFS_FORMAT modules=${INITRAMFS_MODULES[*]}";
                cat "$INIT_SRC"; sha256sum <"$(command -v busybox || echo /nonexistent)" 2>/dev/null || true; } \
              | sha256sum | cut -c1-16)"
initrd="$kdir/initramfs-$init_hash.cpio"
if [ ! -f "$initrd" ]; then
  build_initramfs "$kdir" "$initrd"
else
  touch -c "$initrd" 2>/dev/null || true
fi

# ---------------------------------------------------------------- per-run dir
run_dir="$(mktemp -d "${TMPDIR:-/tmp}/ibtrs-vm.XXXXXX")"
ctl="$run_dir/ctl"
mkdir "$ctl"
cp -- "$GUEST_SETUP" "$ctl/guest-setup.sh"
{
  printf '# generated by run-in-vm.sh\n'
  printf 'IBTRS_VM_KVER=%q\n' "$kver"
  printf 'IBTRS_VM_CWD=%q\n' "$cwd"
  printf 'IBTRS_VM_VERBOSE=%q\n' "$verbose"
  printf 'IBTRS_VM_MTU=%q\n' "$mtu"
  # When QEMU will be killed (epoch seconds; the guest's clock is the host's): a command may
  # end itself before, with its reason (tools/soak/soak-vm.sh's watchdog).
  printf 'IBTRS_VM_DEADLINE=%q\n' "$(($(date +%s) + timeout_s))"
  # Fault injection for the rig's own self-test (check.sh): panic-first, hang-first, panic-always.
  printf 'IBTRS_VM_TEST_BOOT_FAULT=%q\n' "${IBTRS_VM_TEST_BOOT_FAULT:-}"
  printf 'vm_cmd=('; printf ' %q' "$@"; printf ' )\n'
  printf 'vm_env=('; [ "${#user_env[@]}" -eq 0 ] || printf ' %q' "${user_env[@]}"; printf ' )\n'
  printf 'vm_rw_shares=('; [ "${#rw_shares[@]}" -eq 0 ] || printf ' %q' "${rw_shares[@]}"; printf ' )\n'
  printf 'vm_modules=('; [ "${#extra_modules[@]}" -eq 0 ] || printf ' %q' "${extra_modules[@]}"; printf ' )\n'
} >"$ctl/config"

for f in console stdout stderr; do mkfifo "$run_dir/$f.in" "$run_dir/$f.out"; done

qesc() { printf '%s' "${1//,/,,}"; } # QEMU option value escaping
# tsc=reliable: on a loaded host the guest's clocksource watchdog marks the emulated TSC unstable,
# and the kernel then patches the sched_clock static branch while the other vCPU runs through it;
# multi-threaded TCG once executed the half-patched int3 (an Oops in sched_clock_cpu, CI run of
# 2026-11-27, a second TCG guest beside it). The TSC of one TCG guest is one host clock.
qemu=(
  "$qemu_bin" -name ibtrs-vm
  -accel "tcg,thread=multi" -cpu max -smp "$smp" -m "$mem"
  -nodefaults -no-reboot -display none -nic none
  -kernel "$kdir/vmlinuz" -initrd "$initrd"
  -append "console=ttyS0 quiet loglevel=3 panic=-1 tsc=reliable ibtrs_kver=$kver${IBTRS_VM_APPEND:+ $IBTRS_VM_APPEND}"
  -serial "pipe:$run_dir/console"
  -fsdev "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap"
  -device "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot"
  -fsdev "local,id=modules,path=$(qesc "$kdir/modules"),security_model=none,readonly=on"
  -device "virtio-9p-pci,fsdev=modules,mount_tag=modules"
  -fsdev "local,id=ctl,path=$(qesc "$ctl"),security_model=none"
  -device "virtio-9p-pci,fsdev=ctl,mount_tag=ctl"
  -device virtio-serial-pci
  -chardev "pipe,id=out,path=$(qesc "$run_dir/stdout")" -device "virtserialport,chardev=out,name=ibtrs.stdout"
  -chardev "pipe,id=err,path=$(qesc "$run_dir/stderr")" -device "virtserialport,chardev=err,name=ibtrs.stderr"
)
for i in "${!rw_shares[@]}"; do
  qemu+=(-fsdev "local,id=rw$i,path=$(qesc "${rw_shares[$i]}"),security_model=none,multidevs=remap"
         -device "virtio-9p-pci,fsdev=rw$i,mount_tag=rw$i")
done

drain_readers() {
  local f fd p
  # Add and drop a writer on each FIFO: wakes a reader still blocked in open()
  # (QEMU never started) and lets every reader see EOF after the buffered data.
  for f in console stdout stderr; do
    exec {fd}<>"$run_dir/$f.out"
    exec {fd}>&-
  done
  for _ in $(seq 50); do
    local alive=0
    for p in "${reader_pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 1 ] || break
    sleep 0.1
  done
  for p in "${reader_pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  reader_pids=()
}

show_console_tail() {
  [ "$verbose" != 0 ] && return 0
  if [ -s "$run_dir/console.log" ]; then
    say "last lines of the guest console:"
    tail -n 40 "$run_dir/console.log" | tr -d '\r' | sed 's/^/  | /' >&2
  fi
  if [ -s "$run_dir/qemu.log" ]; then
    say "QEMU output:"
    sed 's/^/  | /' "$run_dir/qemu.log" >&2
  fi
}

# Why a guest died: the kernel's own words from its console (panic, oops, BUG), else its last line.
death_reason() {
  local log="$run_dir/console.log" line
  line="$(tr -d '\r' <"$log" 2>/dev/null | grep -E -m1 'Kernel panic|BUG:|Oops|general protection|RIP:' || true)"
  [ -n "$line" ] || line="$(tr -d '\r' <"$log" 2>/dev/null | sed '/^[[:space:]]*$/d' | tail -n 1 || true)"
  [ -n "$line" ] || line="nothing on the console"
  printf '%s' "$line" | sed 's/^[[:space:]]*//' | cut -c1-200
}

# ---------------------------------------------------------------- run
launcher=()
if setpriv --help 2>/dev/null | grep -q -- --pdeathsig; then
  # QEMU dies with this script even if the script is SIGKILLed.
  launcher=(setpriv --pdeathsig KILL)
fi

# One boot of the VM, bounded by `budget` seconds in all and by `boot_budget` seconds until the
# guest's command starts (guest-setup.sh writes ctl/started just before it). Sets timed_out,
# boot_hung, output_closed, qemu_rc and elapsed.
boot_vm() { # BUDGET BOOT_BUDGET
  local budget="$1" boot_budget="$2" t_start=$SECONDS finished wait_rc rest p
  timed_out=0 boot_hung=0 output_closed=0 qemu_rc=""
  rm -f -- "$ctl/status" "$ctl/started" "$run_dir/console.log" "$run_dir/qemu.log"
  # Readers of QEMU's output pipes. They block in open() until QEMU opens the
  # FIFOs and end at EOF once QEMU is gone (see drain_readers).
  cat "$run_dir/stdout.out" &
  reader_pids+=("$!")
  cat "$run_dir/stderr.out" >&2 &
  reader_pids+=("$!")
  if [ "$verbose" != 0 ]; then
    tee "$run_dir/console.log" <"$run_dir/console.out" >&2 &
  else
    cat "$run_dir/console.out" >"$run_dir/console.log" &
  fi
  reader_pids+=("$!")

  "${launcher[@]}" "${qemu[@]}" </dev/null >"$run_dir/qemu.log" 2>&1 &
  qemu_pid=$!
  "${launcher[@]}" sleep "$budget" &
  sleep_pid=$!
  "${launcher[@]}" sleep "$boot_budget" &
  boot_pid=$!

  # Wait for whichever ends first: QEMU (normal), the timeout, the boot deadline, or an output
  # reader. A reader ends with status 0 at EOF, i.e. when QEMU exits; it fails early only if our
  # stdout/stderr went away (e.g. "| head"), and then the guest would block on a full pipe, so
  # the VM is stopped. The boot deadline only counts while the guest's command has not started.
  local waiting=("${reader_pids[@]}")
  while [ -z "$qemu_rc" ]; do
    finished=""
    set +e
    if [ -n "$boot_pid" ]; then
      wait -n -p finished "$qemu_pid" "$sleep_pid" "$boot_pid" "${waiting[@]}"
    else
      wait -n -p finished "$qemu_pid" "$sleep_pid" "${waiting[@]}"
    fi
    wait_rc=$?
    set -e
    if [ "$finished" = "$qemu_pid" ]; then
      qemu_rc=$wait_rc
      qemu_pid=""
    elif [ -n "$boot_pid" ] && [ "$finished" = "$boot_pid" ]; then
      boot_pid=""
      if [ ! -e "$ctl/started" ]; then
        boot_hung=1
        kill_qemu
        qemu_rc=137
      fi
    elif [ "$finished" = "$sleep_pid" ] || { [ -n "$finished" ] && [ "$wait_rc" != 0 ]; }; then
      if [ "$finished" = "$sleep_pid" ]; then timed_out=1; sleep_pid=""; else output_closed=1; fi
      kill_qemu
      qemu_rc=137
    elif [ -n "$finished" ]; then
      rest=()
      for p in "${waiting[@]}"; do [ "$p" = "$finished" ] || rest+=("$p"); done
      waiting=("${rest[@]}")
    else
      die "internal error: wait -n returned $wait_rc without a pid"
    fi
  done
  for p in "$sleep_pid" "$boot_pid"; do
    [ -n "$p" ] || continue
    kill "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  sleep_pid="" boot_pid=""
  elapsed=$((SECONDS - t_start))
  drain_readers
}

# The guest may die before its command starts: a kernel that panics under TCG early in boot
# (seen: sched_clock_cpu, 1.5 s in), or a boot that hangs. Nothing of the command ran, so it is
# booted once more, and the log says so and why. A guest that dies after its command started
# is the command's failure and is reported as before.
boot_timeout_s=${IBTRS_VM_BOOT_TIMEOUT:-120}
is_uint "$boot_timeout_s" || die "IBTRS_VM_BOOT_TIMEOUT must be a positive integer (seconds), got '$boot_timeout_s'"
t_run=$SECONDS
for attempt in 1 2; do
  echo "IBTRS_VM_BOOT_ATTEMPT=$attempt" >"$ctl/attempt"
  left=$((timeout_s - (SECONDS - t_run)))
  [ "$left" -gt 0 ] || left=1
  boot_budget=$boot_timeout_s
  [ "$boot_budget" -le "$left" ] || boot_budget=$left
  boot_vm "$left" "$boot_budget"
  if [ "$output_closed" = 1 ] || [ "$timed_out" = 1 ] || [ -e "$ctl/started" ] || [ -f "$ctl/status" ]; then
    break
  fi
  # Died (or hung) before the command started.
  if [ "$boot_hung" = 1 ]; then
    why="its command had not started ${boot_budget} s after boot (IBTRS_VM_BOOT_TIMEOUT); last console line: $(death_reason)"
  else
    why="QEMU exited with $qemu_rc ${elapsed} s into boot: $(death_reason)"
  fi
  if [ "$attempt" = 2 ]; then
    say "the guest died again before its command started: $why"
    break
  fi
  if [ $((timeout_s - (SECONDS - t_run))) -le 1 ]; then
    say "the guest died before its command started ($why); no time left for another boot"
    break
  fi
  say "the guest died before its command started ($why); booting it again (once)"
  [ -s "$run_dir/console.log" ] && cp -f -- "$run_dir/console.log" "$run_dir/console.boot1.log"
done
elapsed=$((SECONDS - t_run))

if [ "$output_closed" = 1 ]; then
  say "output closed while the VM was running; QEMU was killed" || true
  exit 141
fi
if [ "$timed_out" = 1 ]; then
  say "TIMEOUT: the VM did not finish within ${timeout_s} s; QEMU was killed"
  show_console_tail
  exit 124
fi

status=""
[ -f "$ctl/status" ] && status="$(cat "$ctl/status")"
case "$status" in
  rc=*)
    rc="${status#rc=}"
    [ "$verbose" = 0 ] || say "COMMAND exited with $rc (VM ran ${elapsed} s)"
    exit "$rc"
    ;;
  setup-error*)
    say "guest setup failed: ${status#setup-error }"
    show_console_tail
    exit 125
    ;;
  *)
    if [ -e "$ctl/started" ]; then
      say "the guest died after its command started, without an exit status (QEMU exit code $qemu_rc after ${elapsed} s): $(death_reason)"
    else
      say "the VM stopped without reporting an exit status (QEMU exit code $qemu_rc after ${elapsed} s)"
    fi
    show_console_tail
    exit 125
    ;;
esac
