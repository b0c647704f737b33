#!/bin/bash
# Builds the benchmarks with -c opt and runs every section: the table on stdout (also saved as
# bench/results/latest.txt), every number in bench/results/latest.json, and a plot of the decode
# step's latency vs N (bench/results/latency_vs_n.png) when gnuplot is installed.
# Extra arguments go to memra_bench (e.g. --sections=hot_path, --quick).
set -euo pipefail
cd "$(dirname "$0")/.."

# (bazel/copts.bzl keeps GCC 12's -O2 -Wmaybe-uninitialized false positives from being fatal.)
opt=(-c opt)
bazel build "${opt[@]}" //bench:memra_bench //bench:echo_server //bench:load_engine \
  //server:memra-kvd
# The python_step section's memra_kv runs from this checkout: its stubs into python/memra_kv/_proto.
/usr/bin/python3 python/tools/gen_protos.py
bin="$(bazel info "${opt[@]}" bazel-bin 2>/dev/null)"

results=bench/results
mkdir -p "${results}"
status=0
"${bin}/bench/memra_bench" --kvd="${bin}/server/memra-kvd" --echo_server="${bin}/bench/echo_server" \
  --load_engine="${bin}/bench/load_engine" \
  --python_stepper=bench/python_step.py --python_path=python \
  --json_out="${results}/latest.json" --plot_data="${results}/latency_vs_n.dat" "$@" \
  | tee "${results}/latest.txt" || status=$?

if command -v gnuplot >/dev/null && [[ -s "${results}/latency_vs_n.dat" ]]; then
  gnuplot <<GNUPLOT
set terminal pngcairo size 900,600
set output "${results}/latency_vs_n.png"
set title "decode step (Begin+Prepare+Publish+Commit per session), p50 - $(date -u +%F)"
set xlabel "sessions per Step (N)"
set ylabel "microseconds per step"
set logscale xy
set key top left
set grid
plot "${results}/latency_vs_n.dat" using 1:2 with linespoints title "memra-kvd Step", \
     "" using 1:4 with linespoints title "gRPC floor (same bytes)", \
     "" using 1:6 with linespoints title "core/ in process"
GNUPLOT
  echo "plot: ${results}/latency_vs_n.png"
fi
exit "${status}"
