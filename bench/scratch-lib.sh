# Shared by the benchmarks that serve a file from a scratch directory (bench/fio.sh,
# bench/large_io_ab.sh): sourced, not run.
#
# scratch_setup NAME FS: makes $tmp (/dev/shm/NAME.XXXXXX, the working directory from here on)
# and $export_dir, on tmpfs below $tmp, or with FS=ext4 on ext4 on a loop device over a 2 GiB
# sparse file in /var/tmp (a real file system under the same page cache; needs root). The EXIT
# trap kills the processes listed in $pids newest first (a client closes its device while its
# server still answers), unmounts, detaches and removes what was made.
pids=()
tmp="" mnt="" loopdev="" backing=""
scratch_cleanup() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  if [ -n "$mnt" ]; then umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true; rmdir "$mnt" 2>/dev/null || true; fi
  [ -z "$loopdev" ] || losetup -d "$loopdev" 2>/dev/null || true
  [ -z "$backing" ] || rm -f "$backing"
  [ -z "$tmp" ] || rm -rf "$tmp"
}
scratch_setup() {  # scratch_setup NAME tmpfs|ext4
  tmp=$(mktemp -d "/dev/shm/$1.XXXXXX")
  trap scratch_cleanup EXIT
  trap 'exit 130' INT TERM
  cd "$tmp"  # fio's state files
  export_dir="$tmp/export"
  if [ "$2" = ext4 ]; then
    [ "$(id -u)" = 0 ] || { echo "--fs ext4 needs root (losetup, mount)" >&2; exit 2; }
    backing=$(mktemp "/var/tmp/$1.XXXXXX.img")
    truncate -s 2G "$backing"
    loopdev=$(losetup --find --show "$backing")
    mkfs.ext4 -q -F "$loopdev"
    mnt=$(mktemp -d "/var/tmp/$1-mnt.XXXXXX")
    mount "$loopdev" "$mnt"
    export_dir="$mnt/export"
  fi
  mkdir -p "$export_dir"
}
