# Sourced by the end-to-end scripts: the daemons and the CLI of a build directory.
#   ibnbd_bins BUILD_DIR   sets srv, cld and ibnbd; exits 77 (skip) when one is not built.
ibnbd_bins() {
  srv=$1/server/ibnbd-server
  cld=$1/client/daemon/ibnbd-client
  ibnbd=$1/client/cli/ibnbd
  local b
  for b in "$srv" "$cld" "$ibnbd"; do
    [ -x "$b" ] || { echo "1..0 # SKIP $b not built"; exit 77; }
  done
}

# ibnbd_auth DIR [HOST]: the secure default of the daemons for a test: a host key (mode 0600)
# and a server config granting that host every device in every mode. Sets host_key (the file),
# srv_auth (ibnbd-server's arguments: --config DIR/hosts.json) and cld_auth (ibnbd-client's:
# --host-key FILE). Needs ibnbd_bins first. Tests whose subject is not authentication use it so
# that they run as the daemons are meant to; tests/cli/auth.sh covers refusals.
ibnbd_auth() {
  local dir=$1 host=${2:-nqn.2014-08.org.nvmexpress:uuid:7e570000-0000-4000-8000-000000000001}
  host_key=$dir/host.key
  rm -f "$host_key"
  "$ibnbd" key generate host "$host" out "$host_key" >/dev/null || { echo "not ok - key generate"; exit 1; }
  printf '{"hosts": [{"key_file": "%s", "access": [{"devices": "**", "mode": "migration"}]}]}\n' \
    "$host_key" >"$dir/hosts.json"
  srv_auth=(--config "$dir/hosts.json")
  cld_auth=(--host-key "$host_key")
}
