#!/usr/bin/env bash
# Fifth session, device call 3: CP rank overheads of both backends after the one-pass ranks
# and the differentiated-forward operands (issue 21), the CP GPU tests, where the cutedsl
# forward spends its time, and the recursion kernels' split / value-tile A/B.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false GDP_BENCH_COMMIT=${GDP_BENCH_COMMIT:-unknown}
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
step 60 build python ffi/build.py --jobs 14 --out /tmp/kern
export GDP_JAX_KERNEL_DIR=/tmp/kern
step 90 gputests python -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_cutedsl_gpu.py -k "cp_cutedsl or model_grad"
step 120 cp_rank python -m benchmarks.cp_rank --backend cutedsl --T 131072 --P 2 --json $M/cp_rank.json
step 170 cp_rank_xla python -m benchmarks.cp_rank --backend xla --T 131072 --P 2 --json $M/cp_rank_xla.json
step 50 trace_fwd python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode fwd --top 25 --out /tmp/trf
step 140 ab python -m benchmarks.kernel_ab --shape 8,4096,16,2 --configs "split=1,bv=32;split=0,bv=32;split=1,bv=64;split=0,bv=64" --json $M/ab.json
grep -hE "PASSED|FAILED|passed|failed" $M/gputests.log | tail -5; tail -2 $M/cp_rank.log; tail -2 $M/cp_rank_xla.log; head -28 $M/trace_fwd.log; tail -8 $M/ab.log
