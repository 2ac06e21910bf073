#!/usr/bin/env bash
# The fourth session's owed measurements on the H200, as three device calls of < 600 s each
# (the fifth session ran their substance with benchmarks/results/history/2026-12-01/s5_gpu{1,2,3}.sh;
# still not re-run: the segment sweep, the xla fwd+bwd rows, the GPU tests cut short):
#   bash benchmarks/run_gpu_measurements.sh 1   # timings: fwdbwd vs FLA, xla segment sizes, kernel trace, cold start
#   bash benchmarks/run_gpu_measurements.sh 2   # the AOT GPU test alone, one xla CP rank, the GPU tests cut short on 2026-12-01
#   bash benchmarks/run_gpu_measurements.sh 3   # intra_cp (CP inside the device) at (1, 65536, 16, 2) beside FLA
# (device run: carry [".gpu-deps"]). Logs and raw files under $OUT/m; a summary is printed last.
# Each step has its own timeout so one slow step cannot take the others' results.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
export GDP_BENCH_COMMIT=${GDP_BENCH_COMMIT:-unknown}
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( 580 - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
case "${1:-1}" in
1)
  step 320 fwdbwd python -m benchmarks.run fwdbwd --impl cutedsl,xla,fla --shapes main --deadline 280 --out $M/fwdbwd
  step 110 segments python -m benchmarks.segments --shape 8,4096,16,2 --sizes none,8192,4096 --json $M/segments.json
  step 60 trace python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --top 30 --out /tmp/tr
  step 150 cold python -m benchmarks.cold_start --build --kernels /tmp/kern --modes prebuilt prebuilt+xla-cache
  tail -25 $M/fwdbwd.log; cat $M/segments.log; head -34 $M/trace.log; tail -8 $M/cold.log ;;
2)
  P="python -m pytest -m gpu -v -rA -p no:cacheprovider"
  step 300 aot $P -s tests/test_aot_gpu.py
  step 150 cp_rank_xla python -m benchmarks.cp_rank --backend xla --T 131072 --P 2 --json $M/cp_rank_xla.json
  step 130 rest $P tests/test_cutedsl_gpu.py tests/test_robust_gpu.py -k "packed_gradients_match or tiny_lengths"
  grep -hE "PASSED|FAILED|passed|failed" $M/aot.log $M/rest.log | tail -20; tail -3 $M/cp_rank_xla.log ;;
3)
  step 560 long python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl-cpauto,xla-cpauto,fla --shapes "1,65536,16,2;1,131072,8,2" --deadline 480 --out $M/long
  tail -20 $M/long.log ;;
esac
