#!/usr/bin/env bash
# Eighth session, device call 1: the new chunk-local gradient kernel (LocalGradKernel) -
# precision vs float64 beside XLA float32, kernel time vs XLA's local gradients, the
# cutedsl fwd+bwd with and without it; then the GPU gradient tests and the operands
# kernel's tests (its helpers moved to sm90.py).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -2 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
timeout 240 python -m benchmarks.local_grad --json $OUT/local_grad.json > $OUT/local_grad.log 2>&1
echo "rc $?"; tail -16 $OUT/local_grad.log
timeout 150 python -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_cutedsl_gpu.py -k "grad" \
  > $OUT/gputests_grad.log 2>&1; grep -cE "PASSED" $OUT/gputests_grad.log; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gputests_grad.log | tail -8
timeout 60 python -m pytest -m gpu -q -p no:cacheprovider tests/test_chunk_prep_gpu.py \
  > $OUT/gputests_prep.log 2>&1; tail -2 $OUT/gputests_prep.log
