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
