#!/usr/bin/env bash
# Sixth session, device call 1: the operands kernel v2 (16-bit q, k, v by cp.async,
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
step 70 build python ffi/build.py --jobs 14 --out /tmp/kern
export GDP_JAX_KERNEL_DIR=/tmp/kern
step 110 prep python -m pytest -m gpu -v -rA -s -p no:cacheprovider tests/test_chunk_prep_gpu.py
step 80 fwdtests python -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches or long_sequence_state"
step 70 robust python -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_robust_gpu.py -k "nonfinite or empty_and or tiny"
step 50 trace_fwd python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode fwd --top 25 --out /tmp/trf
step 150 fwd python -m benchmarks.run fwd --impl cutedsl,fla --shapes main --deadline 130 --out $M/fwd
tail -5 $M/build.log; grep -hE "PASSED|FAILED|passed|failed|Error|op forward|=.*/" $M/prep.log | tail -14
grep -hE "PASSED|FAILED|passed|failed" $M/fwdtests.log $M/robust.log | tail -40; head -30 $M/trace_fwd.log; tail -16 $M/fwd.log
