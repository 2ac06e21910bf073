#!/usr/bin/env bash
# s22-2: batch_invariant with the integer-limb norm (GPU tests, A/B beside tuned FLA), then
# the AOT GPU test. Device run, carry [".gpu-deps"].
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( 470 - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
P="python -m pytest -m gpu -q -rA -p no:cacheprovider"
step 100 build python ffi/build.py --jobs 14
step 120 tests $P tests/test_cutedsl_gpu.py -k "sequence_alone or token_backward"
step 130 ab python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl-inv,fla --shapes "8,4096,16,2" \
  --deadline 110 --out $M/ab
step 200 aot $P -s tests/test_aot_gpu.py
grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/tests.log $M/aot.log | tail -14
grep -hE '^\| [0-9(]' $M/ab.log | cut -c1-200
