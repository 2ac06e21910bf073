#!/usr/bin/env bash
# Eleventh session, device call 2: the benchmark shapes for cutedsl beside fully tuned FLA
# at today's main (the reverted operands kernel), then the GPU tests of the non-finite
# rules (both backends) and the AOT path, each on its own.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
timeout 200 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main \
  --out /tmp/bench --deadline 170 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -10
cp /tmp/bench/*.md $OUT/ 2>/dev/null
P="python -m pytest -m gpu -q -rA -p no:cacheprovider --durations=5"
timeout 120 $P tests/test_robust_gpu.py > $OUT/tests.log 2>&1; echo "robust rc=$?" >> $OUT/tests.log
timeout 150 $P tests/test_aot_gpu.py >> $OUT/tests.log 2>&1; echo "aot rc=$?" >> $OUT/tests.log
grep -E "passed|failed|rc=" $OUT/tests.log
