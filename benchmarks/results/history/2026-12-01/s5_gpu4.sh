#!/usr/bin/env bash
# Fifth session, device call 4: the GPU tests of the cutedsl backend on the final code, in
# three parallel jobs (prebuilt kernels), each cut at 195 s (pytest -v keeps partial results).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el build; timeout 50 python ffi/build.py --jobs 14 --out /tmp/kern > $M/build.log 2>&1; el "build rc=$?"
export GDP_JAX_KERNEL_DIR=/tmp/kern
P="timeout 195 python -m pytest -m gpu -v -rA -p no:cacheprovider"
$P tests/test_cutedsl_gpu.py -k "gradients_match or recompute or deterministic" > $M/grads.log 2>&1 &
$P tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches or long_sequence or cp_cutedsl or model_grad" > $M/fwd.log 2>&1 &
$P tests/test_robust_gpu.py -k "tiny_lengths or empty_and_length or nonfinite" > $M/robust.log 2>&1 &
wait; el done
for f in grads fwd robust; do echo "== $f: $(grep -c PASSED $M/$f.log) PASSED lines, $(grep -c FAILED $M/$f.log) FAILED"; grep -E "FAILED|passed|failed" $M/$f.log | tail -4; done
