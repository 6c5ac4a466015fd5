#!/usr/bin/env bash
# Host authentication and per-export access control with the real daemons, driven through the
# `ibnbd` CLI as an administrator would (docs/security.d/auth.md). TAP-like output; exit 1 when
# anything failed.
#
#   bash tests/cli/auth.sh BUILD_DIR        (ctest: cli_auth)
set -u -o pipefail

build=${1:?usage: $0 BUILD_DIR}
. "$(dirname "${BASH_SOURCE[0]}")/../lib/ibnbd_bins.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/tap.sh"
ibnbd_bins "$build"
command -v jq >/dev/null || { echo "1..0 # SKIP no jq"; exit 77; }

work=$(mktemp -d /var/tmp/ibnbd-auth-test.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT

# start_client NAME [ARGS...]: an ibnbd-client on $work/NAME.sock.
start_client() {
  local n=$1
  shift
  "$cld" "$@" --control-socket "$work/$n.sock" --ready-file "$work/$n.ready" --hb-interval-ms 200 \
    --reconnect-delay-ms 100 --state-dir "$work/state-$n" >"$work/$n.log" 2>&1 &
  pids+=($!)
  wait_for "$work/$n.ready" || { not_ok "client $n start" "$(cat "$work/$n.log")"; exit 1; }
}

A=nqn.2014-08.org.nvmexpress:uuid:a0000000-0000-4000-8000-00000000000a
B=nqn.2014-08.org.nvmexpress:uuid:b0000000-0000-4000-8000-00000000000b
k() { "$ibnbd" key "$@"; }

# Case: key generation. Expect: a file of mode 0600 with the host and a DHHC-1 secret; a second
# generate to the same file refuses to overwrite it; show prints fingerprints, never the secret.
expect "key generate host A" 0 k generate host "$A" out "$work/a.key"
expect "key generate host B with a server key" 0 k generate host "$B" hmac 2 length 48 server-key out "$work/b.key"
mode=$(stat -c %a "$work/a.key")
[ "$mode" = 600 ] && ok "key file mode 0600" || not_ok "key file mode 0600" "mode $mode"
grep -q "^key DHHC-1:01:" "$work/a.key" && grep -q "^host $A\$" "$work/a.key" &&
  ok "key file holds the host and a DHHC-1 secret" || not_ok "key file contents" "$(cat "$work/a.key")"
expect "generate refuses to overwrite" 17 k generate host "$A" out "$work/a.key"
expect "key show" 0 k show "$work/a.key"
secret=$(sed -n 's/^key DHHC-1:01:\(.*\):$/\1/p' "$work/a.key")
grep -qF "$secret" "$work/out" && not_ok "show hides the secret" "$(cat "$work/out")" || ok "show hides the secret"
k generate host "$A" out "$work/a-wrong.key" >/dev/null   # host A's id, another secret
k generate host nqn.2014-08.org.example:stranger out "$work/stranger.key" >/dev/null
cp "$work/a.key" "$work/a-open.key" && chmod 644 "$work/a-open.key"
expect "a world-readable key file is refused (EPERM)" 1 k show "$work/a-open.key"
grep -q "chmod 600" "$work/err" && ok "... saying chmod 600" || not_ok "... saying chmod 600" "$(cat "$work/err")"

mkdir -p "$work/export/a" "$work/export/b" "$work/export/shared"
truncate -s 16M "$work/export/a/disk.img" "$work/export/b/disk.img" "$work/export/shared/base.img"
cat >"$work/srv.json" <<JSON
{"listen": ["tcp:127.0.0.1:0", "tcp:127.0.0.1:0"],
 "hosts": [{"key_file": "$work/a.key",
            "access": [{"devices": "a/**", "mode": "rw"}, {"devices": "shared/*", "mode": "ro"}]},
           {"key_file": "$work/b.key", "access": [{"devices": "b/**", "mode": "rw"}]}]}
JSON

# Case: a config naming a world-readable key file. Expect: the server refuses to start, saying why.
sed "s|$work/a.key|$work/a-open.key|" "$work/srv.json" >"$work/srv-open.json"
"$srv" --config "$work/srv-open.json" --dev-search-path "$work/export" --control-socket "$work/x.sock" \
  >"$work/x.log" 2>&1 && not_ok "server refuses a world-readable key file" "it started" ||
  { grep -q "chmod 600" "$work/x.log" && ok "server refuses a world-readable key file" ||
      not_ok "server refuses a world-readable key file" "$(cat "$work/x.log")"; }

"$srv" --config "$work/srv.json" --dev-search-path "$work/export" --hb-interval-ms 200 \
  --control-socket "$work/srv.sock" --ready-file "$work/srv.ready" >"$work/srv.log" 2>&1 &
pids+=($!)
wait_for "$work/srv.ready" || { echo "not ok - server start: $(cat "$work/srv.log")"; exit 1; }
grep -q WARNING "$work/srv.log" && not_ok "no warning without allow_any_host" "$(cat "$work/srv.log")" ||
  ok "no warning without allow_any_host"
mapfile -t addrs < <(sed -n "s/^listening //p" "$work/srv.ready")
s() { "$ibnbd" --socket "$work/srv.sock" server "$@"; }
start_client ca --host-key "$work/a.key"
ca() { "$ibnbd" --socket "$work/ca.sock" client "$@"; }

# Case: host A on its own directory over two paths. Expect: mapped rw, IO verifies, both
# paths authenticated as A on both sides.
expect "A maps a/disk.img rw" 0 ca device map a/disk.img from "${addrs[@]}" rw session sa
expect "A writes and verifies it" 0 ca device io a/disk.img size 4M bs 256K qd 4
auth=$(ca -f json path list sa | jq -r '[.[] | .auth + " " + .host] | unique | join(",")')
[ "$auth" = "authenticated $A" ] && ok "client: both paths authenticated as A" || not_ok "client path auth" "'$auth'"
host=$(s -f json session list | jq -r '.[] | select(.sessname == "sa") | .host')
[ "$host" = "$A" ] && ok "server: session of host A" || not_ok "server: session of host A" "'$host'"
sauth=$(s -f json path list sa | jq -r '[.[] | .auth] | unique | join(",")')
[ "$sauth" = authenticated ] && ok "server: paths authenticated" || not_ok "server: paths authenticated" "'$sauth'"

# Case: host A outside its grants. Expect: B's directory EACCES (13), also for a name that does
# not exist there; the shared one ro but not rw (EPERM, exit 1).
expect "A on b/disk.img is EACCES" 13 ca device map b/disk.img from "${addrs[0]}" ro session sa
expect "A on b/missing.img is EACCES too (nothing learnt)" 13 ca device map b/missing.img from "${addrs[0]}" ro session sa
expect "A maps shared/base.img ro" 0 ca device map shared/base.img from "${addrs[0]}" ro session sa
expect "A unmaps it" 0 ca device unmap shared/base.img
expect "A asking rw on shared is EPERM" 1 ca device map shared/base.img from "${addrs[0]}" rw session sa
grep -q "not permitted" "$work/err" && ok "... and says so" || not_ok "... and says so" "$(cat "$work/err")"

# Case: an unknown host, host A with a wrong key, a key file others may read, a daemon
# without credentials. Expect: EACCES, EACCES, EPERM, EACCES; no session left behind.
expect "an unknown host is EACCES" 13 ca device map shared/base.img from "${addrs[0]}" ro session sx host-key "$work/stranger.key"
expect "a wrong key is EACCES" 13 ca device map shared/base.img from "${addrs[0]}" ro session sw host-key "$work/a-wrong.key"
expect "a world-readable key is EPERM" 1 ca device map shared/base.img from "${addrs[0]}" ro session so host-key "$work/a-open.key"
start_client anon
expect "a client without credentials is EACCES" 13 "$ibnbd" --socket "$work/anon.sock" client device map a/disk.img from "${addrs[0]}" ro session sn
n=$(ca -f json session list | jq length)
[ "$n" = 1 ] && ok "only the good session on the client" || not_ok "only the good session" "$n sessions"
expect "the same session with another key is EINVAL" 22 ca device map shared/base.img from "${addrs[0]}" ro session sa host-key "$work/a-wrong.key"

# Case: host B with its server key (bidirectional). Expect: mapped, paths authenticated+server.
start_client cb --host-key "$work/b.key"
expect "B maps b/disk.img, the server proves its key" 0 "$ibnbd" --socket "$work/cb.sock" client device map b/disk.img from "${addrs[0]}" rw session sb
bauth=$("$ibnbd" --socket "$work/cb.sock" client -f json path list sb | jq -r '.[0].auth')
[ "$bauth" = authenticated+server ] && ok "B's path is bidirectional" || not_ok "B's path is bidirectional" "'$bauth'"

# Case: the server's host list. Expect: both hosts with fingerprints and rules, never a secret.
expect "host list" 0 s -f json host list
grep -qF "$secret" "$work/out" && not_ok "host list hides secrets" "it shows A's" || ok "host list hides secrets"
fa=$(jq -r ".[] | select(.host == \"$A\") | .keys" "$work/out")
fa_want=$(k show "$work/a.key" | awk '/^key /{print $2}')
[ "$fa" = "$fa_want" ] && ok "host list shows A's key fingerprint" || not_ok "A's fingerprint" "'$fa' vs '$fa_want'"

# Case: key rotation: the admin generates a new key for A and adds it (rules kept). Expect: the
# mapped device keeps working; a new session with the old key is EACCES, with the new one fine;
# when the server drops the old session's path, its reconnect is refused and not retried in a
# loop (the path rests closed, saying permission denied).
k generate host "$A" out "$work/a2.key" >/dev/null
expect "server host add rotates A's key" 0 s host add - key "$work/a2.key"
grep -q replaced "$work/out" && ok "... replaced" || not_ok "... replaced" "$(cat "$work/out")"
expect "the mapped device still works" 0 ca device io a/disk.img size 1M bs 64K qd 2
expect "a new session with the old key is EACCES" 13 ca device map shared/base.img from "${addrs[0]}" ro session s-old
expect "a new session with the new key is fine" 0 ca device map shared/base.img from "${addrs[0]}" ro session s-new host-key "$work/a2.key"
p0=$(s -f json path list sa | jq -r '.[0].pathname')
expect "the server drops a path of the old session" 0 s path disconnect sa "$p0"
for _ in $(seq 50); do
  st=$(ca -f json path list sa | jq -r '[.[] | select(.last_error != "")] | .[0].state // ""')
  [ "$st" = closed ] && break
  sleep 0.1
done
[ "$st" = closed ] && ok "the refused path rests closed" || not_ok "the refused path rests closed" "state '$st'"
le=$(ca -f json path list sa | jq -r '[.[] | select(.state == "closed") | .last_error] | .[0]')
[ "$le" = "Permission denied" ] && ok "... with permission denied" || not_ok "... with permission denied" "'$le'"
r1=$(ca -f json path stats sa | jq '[.[] | .reconnects_failed] | add')
sleep 1
r2=$(ca -f json path stats sa | jq '[.[] | .reconnects_failed] | add')
[ -n "$r1" ] && [ "$r1" != null ] && [ "$r1" = "$r2" ] && ok "no reconnect loop ($r2 failed attempt(s))" || not_ok "no reconnect loop" "$r1 -> $r2 failed attempts"
expect "IO still works on the other path" 0 ca device io a/disk.img size 1M bs 64K qd 2

# Case: the admin removes host B. Expect: B's new sessions are refused; the counters saw it all.
expect "server host remove B" 0 s host remove "$B"
start_client cb2 --host-key "$work/b.key"
expect "B is EACCES now (an unknown host)" 13 "$ibnbd" --socket "$work/cb2.sock" client device map b/disk.img from "${addrs[0]}" ro session sb2
expect "removing B again is ENOENT" 2 s host remove "$B"
expect "host stats" 0 s -f json host stats
for c in refused_unknown_host refused_bad_response refused_no_credentials open_refused_eacces open_refused_eperm authenticated; do
  v=$(jq -r ".[] | select(.counter == \"$c\") | .value" "$work/out")
  [ "${v:-0}" -gt 0 ] && ok "counter $c = $v" || not_ok "counter $c" "'$v'"
done

# Case: the explicit any-host setting. Expect: the server warns at start; a client without
# credentials maps rw.
"$srv" --listen tcp:127.0.0.1:0 --allow-any-host --dev-search-path "$work/export" \
  --control-socket "$work/any.sock" --ready-file "$work/any.ready" >"$work/any.log" 2>&1 &
pids+=($!)
wait_for "$work/any.ready" || not_ok "any-host server start" "$(cat "$work/any.log")"
grep -q "WARNING: allow_any_host" "$work/any.log" && ok "the any-host server warns" || not_ok "the any-host server warns" "$(cat "$work/any.log")"
any=$(sed -n "s/^listening //p" "$work/any.ready")
expect "an anonymous client maps rw there" 0 "$ibnbd" --socket "$work/anon.sock" client device map b/disk.img from "$any" rw session sany
aauth=$("$ibnbd" --socket "$work/anon.sock" client -f json path list sany | jq -r '.[0].auth')
[ "$aauth" = none ] && ok "... on an unauthenticated path" || not_ok "... on an unauthenticated path" "'$aauth'"

# Case: a server that requires TLS on its tcp listeners (PSKs derived from the hosts' keys).
# Expect: A's session without TLS is refused for good with EPROTONOSUPPORT (93) saying so, and
# counted; with tls on it maps, IO verifies, and both sides list the path's TLS; a client daemon
# asking for TLS without a host key is EINVAL before connecting.
"$srv" --config "$work/srv.json" --listen tcp:127.0.0.1:0 --tls required --dev-search-path "$work/export" \
  --control-socket "$work/tls.sock" --ready-file "$work/tls.ready" >"$work/tls.log" 2>&1 &
pids+=($!)
wait_for "$work/tls.ready" || not_ok "TLS server start" "$(cat "$work/tls.log")"
tls_addr=$(sed -n "s/^listening //p" "$work/tls.ready")
st() { "$ibnbd" --socket "$work/tls.sock" server "$@"; }
truncate -s 16M "$work/export/a/tls.img"
start_client ct --host-key "$work/a.key"
ct() { "$ibnbd" --socket "$work/ct.sock" client "$@"; }
expect "plaintext to a TLS-required server is EPROTONOSUPPORT" 93 ct device map a/tls.img from "$tls_addr" rw session st-plain
grep -q "requires TLS" "$work/err" && ok "... saying the server requires TLS" || not_ok "... saying so" "$(cat "$work/err")"
n=$(st -f json refusals list | jq -r '.[] | select(.reason == "listen_plaintext") | .count')
[ "${n:-0}" -ge 1 ] && ok "the server counts the plaintext client ($n)" || not_ok "listen_plaintext counted" "'$n'"
expect "A maps over TLS" 0 ct device map a/tls.img from "$tls_addr" rw session st tls on
expect "A writes and verifies over TLS" 0 ct device io a/tls.img size 4M bs 256K qd 4
ctls=$(ct -f json path list st | jq -r '.[0].tls')
case "$ctls" in kTLS\ TLS_*|user\ TLS_*) ok "client lists the path's TLS ($ctls)" ;; *) not_ok "client lists TLS" "'$ctls'" ;; esac
stls=$(st -f json path list st | jq -r '.[0].tls')
[ "$stls" = "$ctls" ] && ok "server lists the same ($stls)" || not_ok "server lists TLS" "'$stls' vs '$ctls'"
expect "the same session without TLS is EINVAL" 22 ct device map shared/base.img from "$tls_addr" ro session st tls off
expect "TLS without a host key is EINVAL" 22 "$ibnbd" --socket "$work/anon.sock" client device map a/tls.img from "$tls_addr" ro session st-anon tls on
grep -q "host key" "$work/err" && ok "... naming the host key" || not_ok "... naming the host key" "$(cat "$work/err")"
expect "unmap the TLS device" 0 ct device unmap a/tls.img

expect "server still answers" 0 s session list
exit $failed
