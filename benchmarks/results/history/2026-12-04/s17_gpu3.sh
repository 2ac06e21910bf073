#!/usr/bin/env bash
# Seventeenth session, device call 3: the GPU tests that run the changed kernels (operands
# kernel at 3 CTAs an SM with ballot flags; recursion kernels at BV = 64), and the s16
# bounds (XLA_TOL, CROSS_TOL, CROSS_GRAD_TOL) for the first time on the GPU. 4 jobs in
# parallel after the prebuild, each cut at 290 s.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 70 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
mkdir -p $OUT/tests
P="python -m pytest -m gpu -q -rA -p no:cacheprovider --durations=5"
run() { name=$1; shift; ( timeout 290 "$@" > $OUT/tests/$name.log 2>&1; echo "rc=$?" >> $OUT/tests/$name.log ) & }
run cutedsl_fwd $P tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches or long_sequence_state"
run cutedsl_grad $P tests/test_cutedsl_gpu.py -k "gradients_match"
run cutedsl_rest $P tests/test_cutedsl_gpu.py -k "not forward_matches and not packed_matches and not gradients_match and not long_sequence_state"
run robust $P tests/test_robust_gpu.py
wait
for f in $OUT/tests/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" $f | tail -8 | cut -c1-300; done
