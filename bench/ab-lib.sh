# Shared by the A/B benchmark scripts that compare two ibtrs-load builds (bench/isolation.sh,
# bench/vm-isolation.sh): sourced, not run.
#
# ab_args DEFAULT_ROUNDS DEFAULT_SECONDS "$@": parses --before PATH [--after PATH] [--rounds N]
# [--seconds S] into $before, $after (absolute paths), $rounds and $seconds, or exits 2.
ab_args() {
  local top
  top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  rounds=$1
  seconds=$2
  shift 2
  before=""
  after="$top/${IBTRS_BUILD:-build}/transport/ibtrs-load"
  while [ $# -gt 0 ]; do
    case "$1" in
      --before) before=$2; shift 2 ;;
      --after) after=$2; shift 2 ;;
      --rounds) rounds=$2; shift 2 ;;
      --seconds) seconds=$2; shift 2 ;;
      *) echo "usage: $0 --before PATH [--after PATH] [--rounds N] [--seconds S]" >&2; exit 2 ;;
    esac
  done
  case "$rounds$seconds" in '' | *[!0-9]*) echo "--rounds and --seconds take whole numbers" >&2; exit 2 ;; esac
  [ -x "$before" ] && [ -x "$after" ] || { echo "need --before and --after ibtrs-load binaries" >&2; exit 2; }
  before=$(cd "$(dirname "$before")" && pwd)/$(basename "$before")
  after=$(cd "$(dirname "$after")" && pwd)/$(basename "$after")
}

# json_field FIELD <<< '{"a":1,...}': a top-level number of ibtrs-load's JSON line.
json_field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p" | tail -1; }

# median < numbers, one a line (0 for none).
median() {
  sort -n | awk '{ v[NR] = $1 } END { if (NR == 0) print 0; else if (NR % 2) print v[(NR + 1) / 2];
    else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
