#!/usr/bin/env bash
# Ninth session, device call 1: (8, 4096, 16, 2) cutedsl fwd+bwd beside fully tuned FLA after
# the dO pad fix; where the cutedsl fwd+bwd and its backward spend their GPU time (trace +
# optimized HLO -> kernels by source line).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
timeout 130 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes "8,4096,16,2" \
  --out $OUT/bench --deadline 110 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -3
timeout 80 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --top 90 \
  --hlo $OUT/fb.hlo.gz --out /tmp/t1 > $OUT/trace_fb.log 2>&1; head -3 $OUT/trace_fb.log
python -m benchmarks.hlo_lines $OUT/trace_fb.log $OUT/fb.hlo.gz --top 70 > $OUT/lines_fb.log 2>&1
timeout 80 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode bwd --top 90 \
  --hlo $OUT/bwd.hlo.gz --out /tmp/t2 > $OUT/trace_bwd.log 2>&1; head -3 $OUT/trace_bwd.log
python -m benchmarks.hlo_lines $OUT/trace_bwd.log $OUT/bwd.hlo.gz --top 70 --by line > $OUT/lines_bwd.log 2>&1
tail -40 $OUT/lines_bwd.log
