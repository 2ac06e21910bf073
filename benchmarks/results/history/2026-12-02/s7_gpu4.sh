#!/usr/bin/env bash
# Seventh session, device call 4: the benchmark shapes, both backends beside fully tuned
# FLA in one process (every row checked against float64 first), then the cutedsl GPU
# gradient tests and a kernel trace of the cutedsl fwd+bwd.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
timeout 400 python -m benchmarks.run fwdbwd --impl xla,cutedsl,fla --shapes main --out $OUT/bench \
  --deadline 330 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -13
timeout 110 python -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_cutedsl_gpu.py -k "grad" \
  > $OUT/gputests_grad.log 2>&1; grep -cE "PASSED" $OUT/gputests_grad.log; grep -E "FAILED|ERROR|passed|failed" $OUT/gputests_grad.log | tail -5
timeout 60 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode fwdbwd --top 120 \
  --out /tmp/trc --hlo $OUT/cutedsl_fwdbwd.hlo.gz > $OUT/trace_cutedsl.log 2>&1; head -3 $OUT/trace_cutedsl.log
