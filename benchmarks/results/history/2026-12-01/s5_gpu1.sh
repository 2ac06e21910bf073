#!/usr/bin/env bash
# Fifth session, device call 1 (code 97a1a0a): the measurements owed by session 4.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false GDP_BENCH_COMMIT=97a1a0a
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
nvidia-smi --query-gpu=name,memory.used --format=csv
step 230 fwdbwd python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --deadline 200 --out $M/fwdbwd
step 200 aot python -m pytest -m gpu -v -rA -p no:cacheprovider -s tests/test_aot_gpu.py
step 150 cold python -m benchmarks.cold_start --build --kernels /tmp/kern --modes prebuilt+xla-cache prebuilt
tail -30 $M/fwdbwd.log; grep -hE "PASSED|FAILED|passed|failed|Error" $M/aot.log | tail -12; tail -12 $M/cold.log
