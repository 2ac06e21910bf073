#!/usr/bin/env bash
# Ninth session, device call 2: the backward's factors on the operands kernel (X output)
# and 16-bit dS_end: the operands kernel's GPU tests, the benchmark shapes beside fully
# tuned FLA, the op A/B of the three backward configurations, the gradient GPU tests.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
timeout 70 python -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_chunk_prep_gpu.py \
  -k "inverse or match_xla" > $OUT/gputests_prep.log 2>&1
grep -E "^X |PASSED|FAILED|ERROR|passed|failed" $OUT/gputests_prep.log | tail -9
timeout 230 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --out $OUT/bench \
  --deadline 190 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -8
timeout 120 python -m benchmarks.local_grad --skip-precision --json $OUT/local_grad.json \
  > $OUT/local_grad.log 2>&1; grep -E "^op|alone" $OUT/local_grad.log
timeout 100 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_cutedsl_gpu.py \
  -k "gradients_match or deterministic or recompute or local_grad" > $OUT/gputests.log 2>&1
grep -cE "PASSED" $OUT/gputests.log; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gputests.log | tail -6
