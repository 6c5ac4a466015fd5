# Reads ibtrs-load client --interval-ms output and prints "T_MS OPS" for one path: its cumulative
# reads + writes at T_MS after the start of the load. The path is ENVIRON["INTERVAL_SEL"]: "#N"
# for the N-th path (from 0), else a substring of the path's name. Input lines look like
#   interval 1.250s iops 41234 inflight 32 | ip:198.18.10.1@ip:198.18.10.2 connected ops 25000 | ...
# Other lines (events, the summary, JSON) are ignored.
BEGIN {
  sel = ENVIRON["INTERVAL_SEL"]
  idx = -1
  if (substr(sel, 1, 1) == "#") idx = substr(sel, 2) + 0
}
$1 == "interval" && $2 ~ /^[0-9.]+s$/ {
  t = int(substr($2, 1, length($2) - 1) * 1000 + 0.5)
  n = split($0, seg, / \| /)
  for (i = 2; i <= n; i++) {
    split(seg[i], f, " ")  # NAME STATE ops N
    if ((idx >= 0 && i - 2 == idx) || (idx < 0 && index(f[1], sel))) {
      print t, f[4] + 0
      break
    }
  }
}
