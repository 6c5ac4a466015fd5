# Shared by the benchmarks that draw their table (bench/fio.sh, bench/rbd.sh,
# bench/migrate-vm.sh): sourced, not run. Needs $top (the source tree).
#
# chart_arg DIR ARG: --chart's argument as an absolute path (relative to DIR, the caller's
# directory: the benchmarks change theirs), or "none".
chart_arg() {
  case $2 in
    none | /*) echo "$2" ;;
    '') echo "--chart takes a PNG path or none" >&2; exit 2 ;;
    *) echo "$1/$2" ;;
  esac
}

# bench_chart CHART NAME TABLE TITLE VALUE...: draws TABLE (a file holding the run's markdown
# table) with bench/chart.sh into CHART, a PNG path given with the benchmark's --chart; empty
# means bench/out/NAME-<UTC time>.png (bench/out is ignored by git), "none" draws nothing. A
# chart that cannot be drawn costs the run nothing: it says why and the run's exit stays 0.
bench_chart() {
  local chart=$1 name=$2 table=$3 title=$4
  shift 4
  [ "$chart" != none ] || return 0
  if ! command -v gnuplot >/dev/null; then
    echo "no chart: gnuplot is missing (scripts/setup.sh installs gnuplot-nox)"
    return 0
  fi
  if [ -z "$chart" ]; then
    mkdir -p "$top/bench/out"
    chart="$top/bench/out/$name-$(date -u +%Y%m%d-%H%M%S).png"
  fi
  bash "$top/bench/chart.sh" --title "$title" "$table" "$chart" "$@" || echo "no chart: bench/chart.sh failed"
}
