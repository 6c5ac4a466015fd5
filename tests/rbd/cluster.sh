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
  # The EXIT trap does not run when the test is killed (ctest's timeout), and ceph-mon and
  # ceph-osd are daemons outside its process group: a watchdog in a session of its own stops
  # what the test started once the test's shell is gone: every process with a path under $work
  # on its command line (gateways, client daemons, fio; its own names $work without a slash),
  # then the cluster. After a normal exit the trap has done both, and the watchdog finds nothing.
  setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 2; done
    pkill -KILL -f -- "$3/"; bash "$2/scripts/ceph-dev.sh" stop "$3/ceph" >/dev/null 2>&1
    rm -rf -- "$3"' _ "$$" "$top" "$work" </dev/null >/dev/null 2>&1 &
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
# t CMD...: CMD with 60 s at most. The first time one runs out, what the test's daemons and the
# cluster were doing is printed ("# stall: ..." lines): the state of every thread of every
# process in $pids (kernel wait channel; user stacks too when gdb is installed), the client
# daemons' and servers' listings, and Ceph's health (slow ops). Two CI runs of session 12 saw
# the gateway's IO stop under the host stage's full load and nothing else said why.
t() {
  local rc=0
  timeout 60 "$@" || rc=$?
  [ "$rc" = 124 ] && [ -z "${stall_reported:-}" ] && { stall_reported=1; rbd_stall_report "$*" >&2; }
  return "$rc"
}
rbd_stall_report() {
  local p task sock
  echo "# stall: '$1' ran out of its 60 s; the test's processes and the cluster:"
  for p in "${pids[@]}"; do
    [ -d "/proc/$p" ] || continue
    echo "# stall: pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline" | cut -c1-160)"
    for task in /proc/"$p"/task/*; do
      echo "# stall:   tid ${task##*/} $(cat "$task/comm" 2>/dev/null) $(cut -d' ' -f3 "$task/stat" 2>/dev/null) wchan=$(cat "$task/wchan" 2>/dev/null)"
    done
    command -v gdb >/dev/null &&
      timeout 30 gdb -p "$p" -batch -ex 'thread apply all bt 10' 2>/dev/null | grep '^#\|^Thread' | head -150 | sed 's/^/# stall:   /'
  done
  for sock in "$work"/*.sock; do
    [ -S "$sock" ] || continue
    for what in "client session list" "client device list" "server session list"; do
      # shellcheck disable=SC2086  # the words of a command
      [ -n "${ibnbd:-}" ] && timeout 5 "$ibnbd" --socket "$sock" $what 2>/dev/null | sed "s|^|# stall: ${sock##*/} $what: |" | head -20
    done
  done
  timeout 20 ceph -s 2>&1 | sed 's/^/# stall: ceph: /' | head -30
  timeout 20 ceph health detail 2>&1 | sed 's/^/# stall: ceph: /' | head -30
}
