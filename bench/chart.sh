#!/usr/bin/env bash
# A PNG chart of a benchmark's table (issue 19: "pictures where people look rather than read").
# It reads the first markdown table of a file (the one bench/fio.sh, bench/rbd.sh and
# bench/migrate-vm.sh print) and draws one panel per value column: clustered bars, one cluster
# per group (the workload) and one bar per series (the target), on a log scale when the values
# span more than a factor of 20 (4 KiB IOPS beside 1 MiB IOPS). Cells that hold no number (a
# failed or left-out run) leave a gap. gnuplot-nox (scripts/setup.sh) draws it.
#
#   bash bench/chart.sh [--title TEXT] [--group COL] [--series COL] TABLE.md OUT.png VALUE-COL...
#
# --group names the column whose values make the clusters (default: the table's first column);
# --series the column whose values make the bars of a cluster (default: the second column if it
# holds no numbers, otherwise none: one bar per group). A value column is named by its header
# text ("IOPS", "mean us", "p99 us"), optionally with the panel's axis label after "="
# ("gateway=gateway CPU us/IO"); a trailing "x" or unit after the number is ignored.
# Example (the rows of a recorded run):
#   bash bench/chart.sh --title "fio, quiet host" table.md fio.png IOPS "mean us" "p99 us"
set -euo pipefail

title="" group="" series=""
while [ $# -gt 0 ]; do
  case "$1" in
    --title) title=$2; shift 2 ;;
    --group) group=$2; shift 2 ;;
    --series) series=$2; shift 2 ;;
    --) shift; break ;;
    -*) echo "usage: $0 [--title TEXT] [--group COL] [--series COL] TABLE.md OUT.png VALUE-COL..." >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -ge 3 ] || { echo "usage: $0 [--title TEXT] [--group COL] [--series COL] TABLE.md OUT.png VALUE-COL..." >&2; exit 2; }
table=$1 out=$2
shift 2
command -v gnuplot >/dev/null || { echo "chart: gnuplot is missing (scripts/setup.sh installs gnuplot-nox)" >&2; exit 1; }
[ -r "$table" ] || { echo "chart: cannot read $table" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ibnbd-chart.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# The first table, as tab-separated cells (header first, the |---| line dropped).
awk '
  /^[[:space:]]*\|/ { in_t = 1
    line = $0; sub(/^[[:space:]]*\|/, "", line); sub(/\|[[:space:]]*$/, "", line)
    n = split(line, c, "|"); row = ""
    sep = 1
    for (i = 1; i <= n; i++) { gsub(/^[[:space:]]+|[[:space:]]+$/, "", c[i]); if (c[i] !~ /^:?-+:?$/) sep = 0
      row = row (i > 1 ? "\t" : "") c[i] }
    if (!sep) print row
    next }
  in_t { exit }
' "$table" >"$tmp/cells.tsv"
[ "$(wc -l <"$tmp/cells.tsv")" -ge 2 ] || { echo "chart: no markdown table in $table" >&2; exit 1; }

# One data file per value column: a row per group, a column per series (in first-seen order).
panel=0
labels=()
for spec in "$@"; do
  panel=$((panel + 1))
  value=${spec%%=*}
  labels+=("${spec#*=}")
  awk -F'\t' -v group="$group" -v series="$series" -v value="$value" -v out="$tmp/p$panel.dat" '
    NR == 1 {
      for (i = 1; i <= NF; i++) col[$i] = i
      g = group == "" ? 1 : col[group]; v = col[value]
      if (series != "") s = col[series]
      if (!g || !v || (series != "" && !s)) { print "chart: no column named " (!g ? group : !v ? value : series) > "/dev/stderr"; exit 3 }
      next }
    NR == 2 && series == "" && $2 !~ /^[0-9.]/ && v != 2 { s = 2 }
    {
      gk = $g; sk = s ? $s : value
      if (!(gk in gseen)) { gseen[gk] = 1; gs[++ng] = gk }
      if (!(sk in sseen)) { sseen[sk] = 1; ss[++ns] = sk }
      x = $v; if (match(x, /^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/)) {
        x = substr(x, RSTART, RLENGTH) + 0
        val[gk, sk] = x
        if (x > 0 && (min == "" || x < min)) min = x
        if (x > max) max = x
      }
    }
    END {
      if (ng == 0) exit 3
      printf "group" > out
      for (j = 1; j <= ns; j++) printf "\t%s", ss[j] > out
      printf "\n" > out
      for (i = 1; i <= ng; i++) {
        printf "%s", gs[i] > out
        for (j = 1; j <= ns; j++) printf "\t%s", ((gs[i], ss[j]) in val) ? val[gs[i], ss[j]] : "NaN" > out
        printf "\n" > out
      }
      # log scale: from the decade below the smallest positive value
      lo = 0; if (min != "" && max / min > 20) { lo = 1; while (lo * 10 <= min) lo *= 10; while (lo > min) lo /= 10 }
      print ns, ng, lo
    }' "$tmp/cells.tsv" >"$tmp/p$panel.meta" || { echo "chart: cannot chart column \"$value\" of $table" >&2; exit 1; }
done

# gnuplot: stacked panels sharing the clusters; the key once, right of the first panel.
{
  echo "set terminal pngcairo size 1400,$((360 * panel + 60)) font 'sans,10' noenhanced"
  echo "set output '$out'"
  echo "set datafile separator '\t'"
  echo "set datafile missing 'NaN'"
  echo "set style data histograms"
  echo "set style histogram clustered gap 1"
  echo "set style fill solid 0.85 border -1"
  echo "set boxwidth 0.9"
  # 16 distinguishable colours (gnuplot's own 8 repeat after the eighth target)
  c=0
  for rgb in 1f77b4 ff7f0e 2ca02c d62728 9467bd 8c564b e377c2 7f7f7f bcbd22 17becf \
    aec7e8 ffbb78 98df8a ff9896 c5b0d5 000000; do
    c=$((c + 1))
    echo "set linetype $c linecolor rgb '#$rgb'"
  done
  echo "set linetype cycle 16"
  echo "set grid ytics"
  echo "set xtics nomirror scale 0"
  echo "set key outside right top vertical Left reverse"
  echo "set lmargin 12; set rmargin 26"
  echo "set multiplot layout $panel,1 title '${title//\'/}'"
  for i in $(seq "$panel"); do
    read -r ns ng lo <"$tmp/p$i.meta"
    label=${labels[$((i - 1))]}
    if [ "$lo" != 0 ]; then echo "set logscale y; set yrange [$lo:*]"; else echo "unset logscale y; set yrange [0:*]"; fi
    echo "set xrange [-0.6:$ng - 0.4]"
    echo "set ylabel '${label//\'/}'"
    [ "$i" = 1 ] && [ "$ns" -gt 1 ] || echo "unset key"
    echo "plot for [c=2:$((ns + 1))] '$tmp/p$i.dat' using c:xtic(1) title columnhead(c)"
  done
  echo "unset multiplot"
} >"$tmp/plot.gp"
gnuplot "$tmp/plot.gp"
echo "chart: $out ($panel panel(s) from $table)"
