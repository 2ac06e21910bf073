#!/usr/bin/env bash
# Fifth session, device call 2: the one-pass CP rank (issue 21) and intra_cp on it (issue 20).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false GDP_BENCH_COMMIT=${GDP_BENCH_COMMIT:-unknown}
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
step 70 build python ffi/build.py --jobs 14 --out /tmp/kern
export GDP_JAX_KERNEL_DIR=/tmp/kern
step 130 gputests python -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_cutedsl_gpu.py -k "cp_cutedsl or model_grad"
step 150 cp_rank python -m benchmarks.cp_rank --backend cutedsl --T 131072 --P 2 --json $M/cp_rank.json
step 260 long python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl-cp2,cutedsl-cp4,cutedsl-cpauto,fla --shapes "1,65536,16,2;1,131072,8,2" --deadline 240 --out $M/long
tail -3 $M/build.log; grep -hE "PASSED|FAILED|SKIPPED|passed|failed" $M/gputests.log | tail -8; tail -12 $M/cp_rank.log; tail -22 $M/long.log
