#!/usr/bin/env bash
# Seventh session, device call 1: where the fwd+bwd time goes, per XLA fusion / kernel,
# for both backends at (8, 4096, 16, 2), with the optimized HLO to name the fusions.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
for impl in xla cutedsl; do
  timeout 200 python -m benchmarks.trace --shape 8,4096,16,2 --impl $impl --mode fwdbwd \
    --top 80 --out /tmp/tr_$impl --hlo $OUT/${impl}_fwdbwd.hlo.gz > $OUT/trace_$impl.log 2>&1
  head -45 $OUT/trace_$impl.log
done
