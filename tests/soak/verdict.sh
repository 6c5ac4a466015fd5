# Sourced by the soak's ctest wrappers (soak_short.sh, vm_soak_short.sh): what a clean run's
# --json must also show for the run to count -- that its faults happened and bit.
#   soak_json_why JSON MIN_KINDS [KIND...]: fills the array `why` with the reasons it does not
#   (empty: it counts): fewer than MIN_KINDS kinds of fault ran, a KIND never ran, ENOSPC or EIO faults
#   that no request saw, a final verify that did not read every block.
# shellcheck shell=bash
soak_json_why() {
  local j=$1 min=$2 kinds n k
  shift 2
  why=()
  kinds=$(jq -r '[.faults[].kind] | join(",")' "$j")
  n=$(jq '.faults | length' "$j")
  [ "$n" -ge "$min" ] || why+=("only $n kinds of fault ran ($kinds)")
  for k in "$@"; do
    case ,$kinds, in *,"$k",*) ;; *) why+=("no $k ran") ;; esac
  done
  if jq -e '.faults[] | select(.kind == "enospc")' "$j" >/dev/null; then
    [ "$(jq '.errors.enospc' "$j")" -gt 0 ] || why+=("enospc ran but no write saw ENOSPC")
  fi
  if jq -e '.faults[] | select(.kind == "eio")' "$j" >/dev/null; then
    [ "$(jq '.errors.eio' "$j")" -gt 0 ] || why+=("eio ran but no request saw EIO")
  fi
  [ "$(jq ".blocks_checked.verified" "$j")" -ge "$(jq ".blocks" "$j")" ] ||
    why+=("the final verify read $(jq '.blocks_checked.verified' "$j") of $(jq '.blocks' "$j") blocks")
}
