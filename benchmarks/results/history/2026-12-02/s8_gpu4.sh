#!/usr/bin/env bash
# Eighth session, device call 4 (code after the rows8 merge): (8, 4096, 16, 2) fwd+bwd,
# both backends beside fully tuned FLA, checks vs float64; the kernel's GPU tests.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 170 python -m benchmarks.run fwdbwd --impl xla,cutedsl,fla --shapes "8,4096,16,2" \
  --out $OUT/bench --deadline 150 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -4
timeout 90 python -m pytest -m gpu -v -p no:cacheprovider tests/test_cutedsl_gpu.py \
  -k "local_grad or packed_gradients" > $OUT/gputests.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gputests.log | tail -9
