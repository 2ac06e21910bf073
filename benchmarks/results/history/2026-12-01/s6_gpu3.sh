#!/usr/bin/env bash
# Sixth session, device call 3: the operands kernel v2 under Nsight Compute (one launch at (8, 4096, 16, 2)), its precision against tuned FLA, the remaining GPU tests it touches and the long-sequence forward rows (16-bit q, k, v by cp.async,
# single-product K K^T / Q K^T, blocked inverse, beta-folded X in registers): its GPU
# tests, the op's forward tests, the non-finite causality tests, the forward beside
# tuned FLA and where the forward spends its time.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false GDP_BENCH_COMMIT=${GDP_BENCH_COMMIT:-unknown}
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
step 60 build python ffi/build.py --jobs 14 --out /tmp/kern
export GDP_JAX_KERNEL_DIR=/tmp/kern
step 100 ncu ncu --target-processes all -k regex:ChunkPrep --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis python -m benchmarks.run fwd --impl cutedsl --shapes "8,4096,16,2" --no-check --iters 1 --reps 1 --out /tmp/ncub
step 60 prep python -m pytest -m gpu -v -rA -s -p no:cacheprovider tests/test_chunk_prep_gpu.py -k "fla or xla_operands"
step 100 gputests python -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_cutedsl_gpu.py -k "cp_cutedsl or deterministic or model_grad or backend_resolution"
step 60 robust python -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_robust_gpu.py -k "empty or invalid or masked or unnormalised"
step 120 fwdlong python -m benchmarks.run fwd --impl cutedsl,fla --shapes "1,65536,16,2;1,65536,32,2" --deadline 100 --out $M/fwdlong
tail -2 $M/build.log; grep -vE "^==PROF==|^\[" $M/ncu.log | grep -E "Duration|Throughput|Registers|Shared Memory|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles|Stall|Waves|L1|L2|DRAM|Elapsed|Executed Ipc|Issue|ERR" | head -60
grep -hE "FAILED|passed|failed|op forward" $M/prep.log $M/gputests.log $M/robust.log | tail -20; tail -8 $M/fwdlong.log
