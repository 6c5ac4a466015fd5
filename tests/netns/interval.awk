# Reads ibtrs-load client --interval-ms lines and prints "T_MS OPS" for the path whose name
# contains ENVIRON["INTERVAL_SEL"] (cumulative reads+writes of that path at time T_MS).
# Placeholder format until the tool lands: "t_ms=500 NAME=OPS NAME=OPS ..."
{
  t = -1
  for (i = 1; i <= NF; i++) {
    if ($i ~ /^t_ms=/) { t = substr($i, 6) + 0 }
  }
  if (t < 0) next
  for (i = 1; i <= NF; i++) {
    if (index($i, ENVIRON["INTERVAL_SEL"]) && $i ~ /=[0-9]+$/) {
      n = split($i, kv, "=")
      print t, kv[n] + 0
    }
  }
}
