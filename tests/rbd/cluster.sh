# Sourced by the RBD end-to-end tests (rbd_gateway.sh, rbd_failover.sh): a scratch directory
# (not on tmpfs: bluestore opens its block file O_DIRECT), the processes in $pids stopped newest
# first and the cluster after them on exit, and a single-host cluster (scripts/ceph-dev.sh: a
# mon and a bluestore OSD on a file, cephx on). Needs $top; sets work, pids, t0, t, CEPH_CONF and
# ibnbd_keyring (client.ibnbd's, "profile rbd" on pool rbd); exits 77 when Ceph cannot run here.
#
#   rbd_cluster_start NAME      (NAME: the scratch directory's prefix)
rbd_cluster_start() {
  work=$(mktemp -d "/var/tmp/$1.XXXXXX")
  cd "$work" || exit 1
  pids=()
  trap rbd_cluster_cleanup EXIT
  local env_out rc
  t0=$SECONDS  # the scripts report their whole time from here
  env_out=$(bash "$top/scripts/ceph-dev.sh" start "$work/ceph" --osd-store bluestore --osd-mb 1024 --no-mgr 2>"$work/ceph.err")
  rc=$?
  [ "$rc" = 77 ] && { echo "1..0 # SKIP $(tail -1 "$work/ceph.err")"; exit 77; }
  [ "$rc" = 0 ] || { echo "not ok - ceph-dev start: $(tail -5 "$work/ceph.err")"; exit 1; }
  export CEPH_CONF=$work/ceph/ceph.conf
  echo "# cluster up in $((SECONDS - t0)) s"
  ibnbd_keyring=$(sed -n 's/^CEPH_IBNBD_KEYRING=//p' <<<"$env_out")
}
rbd_cluster_cleanup() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null
    wait "${pids[i]}" 2>/dev/null
  done
  bash "$top/scripts/ceph-dev.sh" stop "$work/ceph" >/dev/null 2>&1
  rm -rf "$work"
}
t() { timeout 60 "$@"; }
